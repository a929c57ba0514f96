//! The PostgreSQL roles shipped with the schema (migration 6, `docs/schema.md` "Roles and
//! grants"): mapping logins to them (`sealpost migrate --grant KIND=LOGIN`), the role name
//! prefix a database's migration uses, and the explanation of a refused statement
//! ([`explain`]: the login, the Sealpost roles it holds, what it lacks and who holds it).

use crate::store::{self, StoreError};

/// The jobs a Sealpost role does; each is one NOLOGIN role, `PREFIX` + the kind's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Inserts envelopes and work rows, reads the route policy.
    Producer,
    /// Claims and accepts: work, attempt and receipt writes.
    Dispatcher,
    /// The dispatcher's rights plus the verification pass (cursor, findings).
    Reconciler,
    /// Its own consumer ids' inbox, dead letters, watermarks and reported progress.
    Consumer,
    /// Release, purge (the envelope only through the audited functions), reads everything.
    Operator,
    /// Reads everything but payloads: the status page, `status`, `trace`.
    Reader,
}

impl Kind {
    /// Every kind, in the order of `docs/schema.md`.
    pub const ALL: [Kind; 6] = [
        Kind::Producer,
        Kind::Dispatcher,
        Kind::Reconciler,
        Kind::Consumer,
        Kind::Operator,
        Kind::Reader,
    ];

    /// The kind's name (`sealpost.role.kind`).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Producer => "producer",
            Kind::Dispatcher => "dispatcher",
            Kind::Reconciler => "reconciler",
            Kind::Consumer => "consumer",
            Kind::Operator => "operator",
            Kind::Reader => "reader",
        }
    }

    /// The kind named `s`.
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// The role name prefix of a migration that is not told one.
pub const DEFAULT_PREFIX: &str = "sealpost_";

/// A login mapped to a role: `KIND=LOGIN`, and for a consumer `consumer=LOGIN:CONSUMER_ID`
/// (the consumer id it may write as; without one, the login's own name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The role.
    pub kind: Kind,
    /// The login (an existing PostgreSQL role that can log in).
    pub login: String,
    /// A consumer's id (consumers only).
    pub consumer_id: Option<String>,
}

/// Why a grant or a prefixed migration was refused.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    /// The `--grant` or `--role-prefix` argument does not parse.
    #[error("{0}")]
    Usage(String),
    /// The login does not exist.
    #[error("no PostgreSQL role `{0}`: create the login first (CREATE ROLE \"{0}\" LOGIN PASSWORD ...; Sealpost never creates logins or holds their passwords), then run the grant again")]
    NoLogin(String),
    /// The database's roles carry another prefix.
    #[error("this database's Sealpost roles were created with the prefix `{recorded}` (sealpost.role), not `{asked}`; a prefix cannot change after migration 6 — drop --role-prefix or use `{recorded}`")]
    OtherPrefix {
        /// The prefix in `sealpost.role`.
        recorded: String,
        /// The prefix asked for.
        asked: String,
    },
    /// Roles are missing and this login may not create them.
    #[error("the Sealpost roles {missing:?} do not exist and `{login}` may not create roles (no CREATEROLE): have a DBA create them (CREATE ROLE <name> NOLOGIN for each), then run `sealpost migrate --grant ...` again, which applies the grants")]
    NotInstalled {
        /// The missing roles.
        missing: Vec<String>,
        /// The login that tried.
        login: String,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<tokio_postgres::Error> for RoleError {
    fn from(e: tokio_postgres::Error) -> Self {
        RoleError::Store(e.into())
    }
}

/// Parses `KIND=LOGIN` or `consumer=LOGIN:CONSUMER_ID`.
pub fn parse_grant(s: &str) -> Result<Grant, RoleError> {
    let usage = || {
        RoleError::Usage(format!(
            "--grant `{s}`: expected KIND=LOGIN (KIND one of producer, dispatcher, reconciler, consumer, operator, reader), or consumer=LOGIN:CONSUMER_ID"
        ))
    };
    let (kind, rest) = s.split_once('=').ok_or_else(usage)?;
    let kind = Kind::parse(kind.trim()).ok_or_else(usage)?;
    let (login, consumer_id) = match rest.split_once(':') {
        Some((l, c)) if kind == Kind::Consumer && !c.is_empty() => (l, Some(c.to_string())),
        Some(_) => return Err(usage()),
        None => (rest, None),
    };
    if login.is_empty() {
        return Err(usage());
    }
    Ok(Grant {
        kind,
        login: login.to_string(),
        consumer_id,
    })
}

/// Checks a role name prefix: lower-case letters, digits and `_`, starting with a letter or
/// `_`, at most 40 bytes (the migration checks the same).
pub fn check_prefix(p: &str) -> Result<(), RoleError> {
    let ok = !p.is_empty()
        && p.len() <= 40
        && p.bytes()
            .enumerate()
            .all(|(i, b)| b.is_ascii_lowercase() || b == b'_' || (i > 0 && b.is_ascii_digit()));
    if ok {
        Ok(())
    } else {
        Err(RoleError::Usage(format!(
            "--role-prefix `{p}`: lower-case letters, digits and _, not starting with a digit, at most 40 bytes"
        )))
    }
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// [`store::migrate`] with the role name prefix migration 6 creates its roles under
/// (`None`: [`DEFAULT_PREFIX`]). On a database migrated before, the prefix must be the one it
/// recorded.
pub async fn migrate(
    client: &tokio_postgres::Client,
    prefix: Option<&str>,
) -> Result<(), RoleError> {
    if let Some(p) = prefix {
        check_prefix(p)?;
        client
            .batch_execute(&format!("SET sealpost.role_prefix = '{p}'"))
            .await?;
    }
    let result = store::migrate(client).await;
    if prefix.is_some() {
        client.batch_execute("RESET sealpost.role_prefix").await?;
    }
    result?;
    if let Some(p) = prefix {
        let recorded = role_name(client, Kind::Producer)
            .await?
            .trim_end_matches("producer")
            .to_string();
        if recorded != p {
            return Err(RoleError::OtherPrefix {
                recorded,
                asked: p.to_string(),
            });
        }
    }
    Ok(())
}

/// The name of this database's role of `kind`.
pub async fn role_name(client: &tokio_postgres::Client, kind: Kind) -> Result<String, RoleError> {
    match client
        .query_opt(
            "SELECT role_name::text FROM sealpost.role WHERE kind = $1",
            &[&kind.name()],
        )
        .await?
    {
        Some(r) => Ok(r.get(0)),
        None => Err(RoleError::Store(StoreError::NotMigrated)),
    }
}

/// The Sealpost roles of this database that do not exist in the cluster (migration 6 ran as
/// a login that may not create roles, or a DBA dropped one).
pub async fn missing(client: &tokio_postgres::Client) -> Result<Vec<String>, RoleError> {
    Ok(client
        .query(
            "SELECT r.role_name::text FROM sealpost.role r
             WHERE NOT EXISTS (SELECT 1 FROM pg_roles p WHERE p.rolname = r.role_name)
             ORDER BY r.kind",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Creates the missing roles and (re)applies every grant and policy of migration 6
/// (`sealpost.install_roles()`, idempotent). Run by the schema owner.
pub async fn install(client: &tokio_postgres::Client) -> Result<(), RoleError> {
    let ok: bool = client
        .query_one("SELECT sealpost.install_roles()", &[])
        .await?
        .get(0);
    if ok {
        return Ok(());
    }
    let login: String = client
        .query_one("SELECT current_user::text", &[])
        .await?
        .get(0);
    Err(RoleError::NotInstalled {
        missing: missing(client).await?,
        login,
    })
}

/// Maps a login to a role: `GRANT <role> TO <login>`, and for a consumer the consumer id it
/// may write as (`sealpost.consumer_login`; default: the login's name), after [`install`].
/// Idempotent. Run by the schema owner; it needs ADMIN OPTION on the Sealpost roles (a
/// superuser, or the login that created them, has it). Returns the role's name.
pub async fn grant(client: &tokio_postgres::Client, g: &Grant) -> Result<String, RoleError> {
    let role = role_name(client, g.kind).await?;
    // The grants may never have been applied (migration 6 ran as a login without
    // CREATEROLE and a DBA made the roles since): apply them, idempotently.
    install(client).await?;
    let exists = client
        .query_opt("SELECT 1 FROM pg_roles WHERE rolname = $1", &[&g.login])
        .await?
        .is_some();
    if !exists {
        return Err(RoleError::NoLogin(g.login.clone()));
    }
    client
        .batch_execute(&format!(
            "GRANT {} TO {}",
            quote_ident(&role),
            quote_ident(&g.login)
        ))
        .await?;
    if g.kind == Kind::Consumer {
        let id = g.consumer_id.as_deref().unwrap_or(&g.login);
        client
            .execute(
                "INSERT INTO sealpost.consumer_login (login, consumer_id) VALUES ($1, $2)
                 ON CONFLICT DO NOTHING",
                &[&g.login, &id],
            )
            .await?;
    }
    Ok(role)
}

/// Names the refused login in a [`StoreError::Permission`] (`current_user` and the Sealpost
/// roles it holds) and says what it lacks and which Sealpost roles hold it; any other error
/// is returned as it is. Call it on the client that was refused (its transaction rolled
/// back); when the catalogue cannot be asked, the server's words stay.
pub async fn explain(client: &tokio_postgres::Client, e: StoreError) -> StoreError {
    let StoreError::Permission {
        role: None,
        needed,
        source,
    } = e
    else {
        return e;
    };
    let message = source
        .as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_default();
    let (role, more) = describe(client, &message).await;
    StoreError::Permission {
        role: Some(role),
        needed: match more {
            Some(m) => format!("{needed}; {m}"),
            None => needed,
        },
        source,
    }
}

/// The login and its roles; what it lacks on the object the message names.
async fn describe(client: &tokio_postgres::Client, message: &str) -> (String, Option<String>) {
    let login: String = match client.query_one("SELECT current_user::text", &[]).await {
        Ok(r) => r.get(0),
        Err(_) => return ("this login".into(), None),
    };
    let held: Vec<String> = client
        .query(
            "SELECT kind FROM sealpost.role WHERE pg_has_role(current_user, role_name, 'MEMBER')
             ORDER BY kind",
            &[],
        )
        .await
        .map(|rows| rows.iter().map(|r| r.get(0)).collect())
        .unwrap_or_default();
    let who = if held.is_empty() {
        format!("login `{login}` (holds no Sealpost role)")
    } else {
        format!("login `{login}` (Sealpost role {})", held.join(", "))
    };
    let object = |kw: &str| {
        message
            .split_once(kw)
            .map(|(_, t)| t.trim().trim_matches('"').to_string())
    };
    let more = if message.contains("row-level security") {
        let table = object("for table").unwrap_or_default();
        Some(format!(
            "the row of sealpost.{table} belongs to a consumer id this login is not mapped to (a consumer writes only its own rows; `sealpost migrate --grant consumer={login}:CONSUMER_ID` maps one)"
        ))
    } else if let Some(t) =
        object("permission denied for table").or_else(|| object("permission denied for view"))
    {
        lacking_on_table(client, &login, &t).await
    } else if let Some(f) = object("permission denied for function") {
        client
            .query_one(
                "SELECT string_agg(DISTINCT r.kind, ', ') FROM pg_proc p, sealpost.role r
                 WHERE p.pronamespace = 'sealpost'::regnamespace AND p.proname = $1
                   AND has_function_privilege(r.role_name, p.oid, 'EXECUTE')",
                &[&f],
            )
            .await
            .ok()
            .map(|r| {
                let holders: Option<String> = r.get(0);
                format!(
                    "it needs EXECUTE on sealpost.{f}, which role {} holds{}",
                    holders.as_deref().unwrap_or("no"),
                    hint(holders.as_deref(), &login)
                )
            })
    } else if message.contains("admin option on role") {
        Some(format!(
            "`{login}` may not hand out that role: a DBA runs the GRANT, or gives it the Sealpost roles WITH ADMIN OPTION (GRANT <role> TO {login} WITH ADMIN OPTION)"
        ))
    } else if message.contains("for schema") {
        Some(format!(
            "it needs USAGE on schema sealpost, which every Sealpost role holds{}",
            hint(Some("reader"), &login)
        ))
    } else {
        None
    };
    (who, more)
}

fn hint(holders: Option<&str>, login: &str) -> String {
    match holders.and_then(|h| h.split(", ").next()) {
        Some(k) if !k.is_empty() => format!(" (e.g. `sealpost migrate --grant {k}={login}`)"),
        _ => String::new(),
    }
}

/// "on sealpost.T it lacks INSERT (held by producer, operator), DELETE (held by no role)":
/// the privileges on the whole table (a role with a column grant, the reader's SELECT on
/// `envelope` without `payload`, lacks it).
async fn lacking_on_table(
    client: &tokio_postgres::Client,
    login: &str,
    table: &str,
) -> Option<String> {
    let rows = client
        .query(
            "WITH t AS (SELECT to_regclass('sealpost.' || quote_ident($1)) AS oid),
                  p(priv, n) AS (VALUES ('SELECT', 1), ('INSERT', 2), ('UPDATE', 3), ('DELETE', 4)),
                  has(who, priv, ok) AS (
                      SELECT x.who, p.priv,
                             has_table_privilege(x.who, t.oid, p.priv)
                      FROM t, p, (SELECT current_user::text AS who UNION SELECT role_name::text FROM sealpost.role) x)
             SELECT p.priv, (SELECT string_agg(r.kind, ', ' ORDER BY r.kind) FROM sealpost.role r
                             JOIN has h ON h.who = r.role_name::text AND h.priv = p.priv AND h.ok)
             FROM p JOIN has me ON me.who = current_user::text AND me.priv = p.priv AND NOT me.ok
             ORDER BY p.n",
            &[&table],
        )
        .await
        .ok()?;
    if rows.is_empty() {
        return None;
    }
    let lacks: Vec<String> = rows
        .iter()
        .map(|r| {
            let priv_: String = r.get(0);
            let holders: Option<String> = r.get(1);
            match holders {
                Some(h) => format!("{priv_} (held by {h}{})", hint(Some(&h), login)),
                None => format!("{priv_} (held by no Sealpost role)"),
            }
        })
        .collect();
    Some(format!("on sealpost.{table} it lacks {}", lacks.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_parse_as_documented() {
        let g = parse_grant("reader=status_page").unwrap();
        assert_eq!(
            (g.kind, g.login.as_str(), g.consumer_id),
            (Kind::Reader, "status_page", None)
        );
        let g = parse_grant("consumer=fulfilment:fulfilment-1").unwrap();
        assert_eq!(
            (g.kind, g.login.as_str(), g.consumer_id.as_deref()),
            (Kind::Consumer, "fulfilment", Some("fulfilment-1"))
        );
        // Without an id a consumer login writes as its own name (`grant` fills it in).
        assert_eq!(
            parse_grant("consumer=fulfilment").unwrap().consumer_id,
            None
        );
        for bad in [
            "janitor=x",
            "reader",
            "reader=",
            "reader=a:b",
            "consumer=a:",
            "=a",
        ] {
            assert!(parse_grant(bad).is_err(), "{bad}");
        }
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.name()), Some(k));
        }
    }

    #[test]
    fn prefixes_are_plain_lower_case_identifiers() {
        for ok in ["sealpost_", "orders_prod_", "_x", "a1_"] {
            check_prefix(ok).unwrap();
        }
        for bad in ["", "Sealpost_", "1x", "a-b", "a'b", "a b", &"x".repeat(41)] {
            assert!(check_prefix(bad).is_err(), "{bad}");
        }
    }
}
