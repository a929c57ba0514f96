//! Where the loops get their PostgreSQL connections: a [`PgSource`], injected by the service.
//!
//! The dispatchers, the reconciler and the consumer hold one connection each for as long as
//! it works (their prepared statements live on it) and ask their source for another when it
//! breaks, at the moment their machine says the next transaction is due (the backoff is the
//! machine's, not a sleep here). Two sources come with the library:
//!
//! - [`PgConnector`]: a connection string, with TLS as its `sslmode` says (libpq's
//!   meanings, over rustls; see [`crate::tls`]). What the `sealpost` command uses.
//! - a [`deadpool_postgres::Pool`] (cargo feature `deadpool`): the service's own pool, with
//!   whatever TLS connector and limits it was built with.
//!
//! Any other pool or connector plugs in by implementing [`PgSource`].

use std::fmt;
use std::ops::{Deref, DerefMut};

use futures::future::BoxFuture;

use crate::runtime::{pg_connect, Config, RunError};
use crate::secret;

/// A source of PostgreSQL connections for the loops.
pub trait PgSource: Send + Sync + 'static {
    /// A working connection, or why there is none. The error must not carry a password
    /// ([`RunError::Connect`] holds the connection string redacted); a TLS setting that can
    /// never work is [`RunError::Tls`], which ends a consumer instead of being retried.
    fn connect(&self) -> BoxFuture<'_, Result<PgConn, RunError>>;

    /// What the source connects to, for logs: never a password.
    fn describe(&self) -> String;
}

/// A connection from a [`PgSource`]: a `tokio_postgres::Client` of one's own, or one lent
/// by a pool (returned to it on drop). Derefs to the client.
pub struct PgConn(Box<dyn DerefMut<Target = tokio_postgres::Client> + Send + Sync>);

impl PgConn {
    /// Wraps anything that derefs to a client (a pool's guard, say).
    pub fn new(
        client: impl DerefMut<Target = tokio_postgres::Client> + Send + Sync + 'static,
    ) -> PgConn {
        PgConn(Box::new(client))
    }
}

/// A client owned outright.
struct Owned(tokio_postgres::Client);

impl Deref for Owned {
    type Target = tokio_postgres::Client;
    fn deref(&self) -> &tokio_postgres::Client {
        &self.0
    }
}

impl DerefMut for Owned {
    fn deref_mut(&mut self) -> &mut tokio_postgres::Client {
        &mut self.0
    }
}

impl From<tokio_postgres::Client> for PgConn {
    fn from(c: tokio_postgres::Client) -> PgConn {
        PgConn::new(Owned(c))
    }
}

impl Deref for PgConn {
    type Target = tokio_postgres::Client;
    fn deref(&self) -> &tokio_postgres::Client {
        &self.0
    }
}

impl DerefMut for PgConn {
    fn deref_mut(&mut self) -> &mut tokio_postgres::Client {
        &mut self.0
    }
}

/// A connection string: each [`PgSource::connect`] opens a new connection, over TLS as the
/// string's `sslmode` says ([`pg_connect`]). Its `Debug` shows the string redacted.
#[derive(Clone)]
pub struct PgConnector {
    url: String,
}

impl PgConnector {
    /// A connector for `url` (key/value or `postgresql://` form).
    pub fn new(url: impl Into<String>) -> PgConnector {
        PgConnector { url: url.into() }
    }

    /// The configuration's `database_url` (its password file already applied by
    /// [`Config::apply_secret_files`]).
    pub fn from_config(cfg: &Config) -> PgConnector {
        PgConnector::new(cfg.database_url.clone())
    }
}

impl fmt::Debug for PgConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PgConnector")
            .field(&secret::redact_dsn(&self.url))
            .finish()
    }
}

impl PgSource for PgConnector {
    fn connect(&self) -> BoxFuture<'_, Result<PgConn, RunError>> {
        Box::pin(async move { pg_connect(&self.url).await.map(PgConn::from) })
    }

    fn describe(&self) -> String {
        secret::redact_dsn(&self.url)
    }
}

#[cfg(feature = "deadpool")]
mod pool {
    use super::*;

    /// A pooled client, derefed to the `tokio_postgres::Client` it wraps.
    struct Pooled(deadpool_postgres::Object);

    impl Deref for Pooled {
        type Target = tokio_postgres::Client;
        fn deref(&self) -> &tokio_postgres::Client {
            &self.0
        }
    }

    impl DerefMut for Pooled {
        fn deref_mut(&mut self) -> &mut tokio_postgres::Client {
            &mut self.0
        }
    }

    /// The service's pool: each loop borrows one connection and keeps it while it works
    /// (size the pool for the dispatchers, the reconciler and the consumers it serves).
    impl PgSource for deadpool_postgres::Pool {
        fn connect(&self) -> BoxFuture<'_, Result<PgConn, RunError>> {
            Box::pin(async move {
                match self.get().await {
                    Ok(o) => Ok(PgConn::new(Pooled(o))),
                    Err(e) => Err(RunError::Pool(format!(
                        "{}; is PostgreSQL running, and is the pool's configuration right (and big enough: each loop holds one connection)?",
                        crate::runtime::with_causes(&e)
                    ))),
                }
            })
        }

        fn describe(&self) -> String {
            let s = self.status();
            format!(
                "a deadpool-postgres pool ({} of {} connections in use)",
                s.size.saturating_sub(s.available),
                s.max_size
            )
        }
    }
}
