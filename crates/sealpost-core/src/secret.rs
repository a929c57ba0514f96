//! Redaction of credentials in the strings Sealpost prints: broker URLs (`nats://`,
//! `amqp(s)://`, a comma-separated list of them) and Kafka client properties
//! (`sasl.password=...`). The adapters and the library call these before a URL or a property
//! list reaches an error, a log line or a `Debug`; `sealpost::secret` adds the PostgreSQL
//! connection string. What stays is what makes an error useful: scheme, user, host, port,
//! path and the non-secret parameters.
//!
//! The URL rules are deliberately wider than a URL parser's: clients read credentials more
//! leniently than WHATWG (tokio-postgres ends them at the *first* `@`, the `url` crate at the
//! *last*; an unencoded `/` in a password is accepted by one and refused by the other), so a
//! parser that refuses or splits differently would leave a password in clear. Here the
//! credentials run from `://` to the last `@` before the host ends, covering both readings,
//! and nothing is refused. Pure string functions: no IO.

/// What a secret is replaced with.
pub const REDACTED: &str = "***";

/// Whether a connection or client property named `key` holds a secret: passwords, tokens,
/// secrets, private keys inline, JAAS and OAuth bearer configurations (any case).
pub fn is_secret_key(key: &str) -> bool {
    let k = key.trim().to_ascii_lowercase();
    k == "pass"
        || k == "pwd"
        || k.contains("password")
        || k.contains("passwd")
        || k.contains("secret")
        || k.contains("token")
        || k.contains("jaas")
        || k.contains("oauthbearer.config")
        || k.contains("key.pem")
        || k.contains("credential")
        || k == "auth"
        || k == "nkey"
        || k == "seed"
}

/// `url` (one URL, or several separated by commas) with every password, token and secret
/// query parameter replaced by [`REDACTED`]. The user of `user:password@` stays; a lone
/// `something@` (a NATS token) is replaced, except for `postgres(ql)://` and `amqp(s)://`,
/// where it is a user name. A string with no `scheme://` is returned as it is.
pub fn redact_url(url: &str) -> String {
    // Where each URL's scheme starts: the letters before each `://`.
    let mut starts: Vec<usize> = Vec::new();
    let mut from = 0;
    while let Some(i) = url[from..].find("://") {
        let sep = from + i;
        let scheme_start = url[..sep]
            .char_indices()
            .rev()
            .take_while(|&(_, c)| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
            .last()
            .map_or(sep, |(j, _)| j);
        starts.push(scheme_start);
        from = sep + 3;
    }
    let Some(&first) = starts.first() else {
        return url.to_string();
    };
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..first]);
    for (n, &start) in starts.iter().enumerate() {
        let end = starts.get(n + 1).copied().unwrap_or(url.len());
        out.push_str(&redact_one_url(&url[start..end]));
    }
    out
}

/// One `scheme://[userinfo@]host[/path][?query][#fragment]` (possibly followed by a list
/// separator and a bare `host:port`).
fn redact_one_url(unit: &str) -> String {
    let sep = unit.find("://").expect("a unit starts at a scheme");
    let scheme = unit[..sep].to_ascii_lowercase();
    let rest = &unit[sep + 3..];
    let mut out = String::with_capacity(unit.len());
    out.push_str(&unit[..sep + 3]);
    // The credentials end at the last `@` before the host ends (the host ends at the first
    // `/`, `?` or `#` after the first `@`).
    let after = match rest.find('@') {
        Some(first_at) => {
            let host_end = rest[first_at..]
                .find(['/', '?', '#'])
                .map_or(rest.len(), |i| first_at + i);
            let last_at = rest[..host_end]
                .rfind('@')
                .expect("first_at is before host_end");
            let userinfo = &rest[..last_at];
            match userinfo.split_once(':') {
                Some((user, _)) => {
                    out.push_str(user);
                    out.push(':');
                    out.push_str(REDACTED);
                }
                None if matches!(
                    scheme.as_str(),
                    "postgres" | "postgresql" | "amqp" | "amqps"
                ) =>
                {
                    out.push_str(userinfo)
                }
                None => out.push_str(REDACTED),
            }
            &rest[last_at..]
        }
        None => rest,
    };
    // The query's secret parameters (`?password=...`, `&token=...`).
    match after.find('?') {
        Some(q) => {
            out.push_str(&after[..=q]);
            let query = &after[q + 1..];
            let (query, fragment) = match query.find('#') {
                Some(h) => (&query[..h], &query[h..]),
                None => (query, ""),
            };
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if is_secret_key(&percent_decoded(k)) => {
                        format!("{k}={REDACTED}")
                    }
                    _ => pair.to_string(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
            out.push_str(fragment);
        }
        None => out.push_str(after),
    }
    out
}

/// `%XX` sequences decoded (invalid ones kept), for comparing key names.
fn percent_decoded(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Kafka client properties `key=value[,key=value]` (the `KAFKA_CLIENT_PROPERTIES` form) with
/// the value of every secret key ([`is_secret_key`]) replaced by [`REDACTED`]. A secret value
/// that itself holds commas is covered up to the next `key=` entry.
pub fn redact_properties(properties: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut in_secret = false;
    for entry in properties.split(',') {
        let key = entry.split_once('=').map(|(k, _)| k.trim());
        let is_key = key.is_some_and(|k| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        });
        match key {
            Some(k) if is_key => {
                in_secret = is_secret_key(k);
                if in_secret {
                    out.push(format!("{k}={REDACTED}"));
                } else {
                    out.push(entry.to_string());
                }
            }
            // The rest of a secret value that held a comma.
            _ if in_secret => {}
            _ => out.push(entry.to_string()),
        }
    }
    out.join(",")
}

/// `text` with every occurrence of each non-empty secret replaced by [`REDACTED`]: a last
/// line of defence for messages built by other libraries from a value that held a secret.
pub fn scrub(text: &str, secrets: &[&str]) -> String {
    let mut out = text.to_string();
    for s in secrets.iter().filter(|s| !s.is_empty()) {
        out = out.replace(s, REDACTED);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn url(input: &str, expect: &str) {
        assert_eq!(redact_url(input), expect, "input: {input}");
    }

    #[test]
    fn url_passwords_are_replaced_and_the_rest_kept() {
        url(
            "nats://app:s3cret@nats.example:4222",
            "nats://app:***@nats.example:4222",
        );
        url(
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqp://guest:***@127.0.0.1:5672/%2f",
        );
        url(
            "amqps://u:p%40ss%2Fw@rabbit:5671/vhost?heartbeat=10",
            "amqps://u:***@rabbit:5671/vhost?heartbeat=10",
        );
        // No credentials at all: unchanged.
        url("nats://127.0.0.1:4222", "nats://127.0.0.1:4222");
        url("127.0.0.1:9092", "127.0.0.1:9092");
        url("", "");
        // A user without a password stays where it is a user name.
        url("amqp://guest@rabbit/", "amqp://guest@rabbit/");
        url("postgres://alice@db/app", "postgres://alice@db/app");
        // A NATS token is the secret itself.
        url("nats://t0ken@nats:4222", "nats://***@nats:4222");
        url("tls://t0ken@nats:4222", "tls://***@nats:4222");
    }

    #[test]
    fn tricky_url_credentials_are_covered_under_either_reading() {
        // Unencoded `@`: the url crate ends the credentials at the last one.
        url("nats://u:p@ss@host:4222", "nats://u:***@host:4222");
        // Unencoded `/` and `?` before the `@`: tokio-postgres ends them at the first `@`.
        url("postgres://u:pa/ss@host/db", "postgres://u:***@host/db");
        url("postgres://u:p?a#s@host/db", "postgres://u:***@host/db");
        url("postgres://u:p/?@ss@host/db", "postgres://u:***@host/db");
        // A colon in the password, an empty password.
        url("amqp://u:a:b:c@h", "amqp://u:***@h");
        url("amqp://u:@h", "amqp://u:***@h");
        // An `@` in the query does not move the host.
        url(
            "postgres://u:pw@h/db?application_name=a@b",
            "postgres://u:***@h/db?application_name=a@b",
        );
    }

    #[test]
    fn url_lists_and_query_secrets() {
        url(
            "nats://a:one@n1:4222,nats://b:two@n2:4222",
            "nats://a:***@n1:4222,nats://b:***@n2:4222",
        );
        url(
            "nats://a:one@n1:4222,n2:4222",
            "nats://a:***@n1:4222,n2:4222",
        );
        url(
            "postgres://h/db?user=u&password=hunter2&sslmode=require",
            "postgres://h/db?user=u&password=***&sslmode=require",
        );
        url(
            "postgres://h/db?pass%77ord=hunter2#frag",
            "postgres://h/db?pass%77ord=***#frag",
        );
        url("nats://h?auth_token=abc", "nats://h?auth_token=***");
        // A comma inside a password: the list split must not leave a piece behind.
        url("amqp://u:a,b@h/", "amqp://u:***@h/");
    }

    #[test]
    fn kafka_properties() {
        let r = |s: &str| redact_properties(s);
        assert_eq!(
            r("security.protocol=SASL_SSL,sasl.mechanism=PLAIN,sasl.username=app,sasl.password=hunter2"),
            "security.protocol=SASL_SSL,sasl.mechanism=PLAIN,sasl.username=app,sasl.password=***"
        );
        assert_eq!(
            r("ssl.key.password=k3y, ssl.key.pem=-----BEGIN,linger.ms=5"),
            "ssl.key.password=***,ssl.key.pem=***,linger.ms=5"
        );
        // A secret holding commas: its pieces go too.
        assert_eq!(
            r("sasl.password=a,b,c,acks=all"),
            "sasl.password=***,acks=all"
        );
        assert_eq!(r("batch.num.messages=1"), "batch.num.messages=1");
        assert_eq!(r(""), "");
        assert_eq!(r("SASL.PASSWORD=x"), "SASL.PASSWORD=***");
    }

    #[test]
    fn scrub_replaces_each_secret() {
        assert_eq!(
            scrub("failed for u:hunter2 (hunter2)", &["hunter2", ""]),
            "failed for u:*** (***)"
        );
    }
}
