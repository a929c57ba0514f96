//! The `sealpost` command's settings ([`Settings`]): the library's runtime configuration
//! ([`sealpost::runtime::Config`], the file's top-level keys), the broker to use (`broker`)
//! and each adapter's own configuration (the `[nats]`, `[rabbitmq]` and `[kafka]` tables),
//! loaded from a TOML file and the environment.

use std::ops::{Deref, DerefMut};

use sealpost::runtime::{Config, ConfigError};
use sealpost_kafka::KafkaConfig;
use sealpost_nats::NatsConfig;
use sealpost_rabbitmq::RabbitConfig;

/// Everything the command needs. Derefs to the runtime [`Config`].
#[derive(Clone, Debug)]
pub struct Settings {
    /// Store and loop limits (the file's top-level keys).
    pub run: Config,
    /// The broker dispatch, consume, demo and reconcile use: `nats`, `rabbitmq` or `kafka`
    /// (the `--broker` flag overrides it).
    pub broker: String,
    /// `[nats]` (and `NATS_*`).
    pub nats: NatsConfig,
    /// `[rabbitmq]` (and `RABBITMQ_*`).
    pub rabbitmq: RabbitConfig,
    /// `[kafka]` (and `KAFKA_*`).
    pub kafka: KafkaConfig,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            run: Config::default(),
            broker: "nats".to_string(),
            nats: NatsConfig::default(),
            rabbitmq: RabbitConfig::default(),
            kafka: KafkaConfig::default(),
        }
    }
}

impl Settings {
    /// `run` beside each adapter's configuration from the environment (`NATS_*`,
    /// `RABBITMQ_*`, `KAFKA_*`), for a program that builds its runtime [`Config`] in code.
    pub fn from_run(run: Config) -> Result<Settings, LoadError> {
        let mut kafka = KafkaConfig::from_env().map_err(|e| LoadError::Broker(e.to_string()))?;
        kafka.ack_timeout = std::time::Duration::from_millis(run.ack_timeout_ms);
        Ok(Settings {
            run,
            nats: NatsConfig::from_env(),
            rabbitmq: RabbitConfig::from_env(),
            kafka,
            ..Settings::default()
        })
    }
}

/// The loops' PostgreSQL connections: `database_url`, TLS as its `sslmode` says.
pub fn pg_source(cfg: &Config) -> std::sync::Arc<dyn sealpost::pg::PgSource> {
    std::sync::Arc::new(sealpost::pg::PgConnector::from_config(cfg))
}

impl Deref for Settings {
    type Target = Config;
    fn deref(&self) -> &Config {
        &self.run
    }
}

impl DerefMut for Settings {
    fn deref_mut(&mut self) -> &mut Config {
        &mut self.run
    }
}

/// Why the configuration could not be loaded; each names the file or the offending key.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Unreadable file.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// Path.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// Malformed TOML or a bad key.
    #[error("config file {path}: {message}")]
    Parse {
        /// Path.
        path: String,
        /// Where (line, column, key) and the parser's words, without the offending line and
        /// without any quoted string value ([`parse_message`]): the line could hold a
        /// password.
        message: String,
    },
    /// A value out of range.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    /// A broker setting out of range or malformed (`[kafka]`, `KAFKA_*`).
    #[error("{0}")]
    Broker(String),
}

/// The file's tables: the adapters' own, and the rest (the runtime keys).
#[derive(serde::Deserialize)]
struct File {
    #[serde(default)]
    broker: Option<String>,
    #[serde(default)]
    nats: Option<toml::Value>,
    #[serde(default)]
    rabbitmq: Option<toml::Value>,
    #[serde(default)]
    kafka: Option<toml::Value>,
    #[serde(flatten)]
    run: toml::Table,
}

/// Loads defaults, then the file (if given), then the environment (`DATABASE_URL`,
/// `NATS_*`, `RABBITMQ_*`, `KAFKA_*`, ...), reads the secret files and validates.
pub fn load(path: Option<&str>) -> Result<Settings, LoadError> {
    let mut c = match path {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|source| LoadError::Read {
                path: p.to_string(),
                source,
            })?;
            parse(&text).map_err(|message| LoadError::Parse {
                path: p.to_string(),
                message,
            })?
        }
        None => Settings::default(),
    };
    c.run.apply_env();
    c.run.apply_secret_files()?;
    c.run.validate()?;
    // Signing key and keyring (SEALPOST_SIGNING_KEY_FILE, SEALPOST_VERIFY_KEYS_DIR): read
    // now, so a bad key stops the command at once with the file named.
    c.run.load_keys()?;
    c.nats.apply_env();
    c.rabbitmq.apply_env();
    c.kafka
        .apply_env()
        .and_then(|()| c.kafka.validate())
        .map_err(|e| LoadError::Broker(e.to_string()))?;
    c.kafka.ack_timeout = std::time::Duration::from_millis(c.run.ack_timeout_ms);
    Ok(c)
}

/// The settings a file's text gives (defaults for what it leaves out), or the message of
/// [`parse_message`].
fn parse(text: &str) -> Result<Settings, String> {
    let file: File = toml::from_str(text).map_err(|e| parse_message(text, &e))?;
    if let Some(moved) = file.run.keys().find_map(|k| moved_key(k)) {
        return Err(moved);
    }
    Ok(Settings {
        run: toml::Value::Table(file.run)
            .try_into()
            .map_err(|e| value_message("", &e))?,
        broker: file.broker.unwrap_or_else(|| "nats".to_string()),
        nats: table(file.nats, "nats")?,
        rabbitmq: table(file.rabbitmq, "rabbitmq")?,
        kafka: table(file.kafka, "kafka")?,
    })
}

/// An adapter's table, or its defaults when the file has none.
fn table<T: serde::de::DeserializeOwned + Default>(
    v: Option<toml::Value>,
    name: &str,
) -> Result<T, String> {
    match v {
        Some(v) => v.try_into().map_err(|e| value_message(name, &e)),
        None => Ok(T::default()),
    }
}

/// A top-level key of the old flat layout (`nats_url`, `kafka_brokers`, ...): where it lives
/// now.
fn moved_key(key: &str) -> Option<String> {
    for (prefix, table) in [
        ("nats_", "nats"),
        ("rabbitmq_", "rabbitmq"),
        ("kafka_", "kafka"),
    ] {
        if let Some(rest) = key.strip_prefix(prefix) {
            let security = [
                "tls_ca_file",
                "tls_cert_file",
                "tls_key_file",
                "require_tls",
                "creds_file",
                "nkey_seed_file",
                "user",
                "password_file",
                "token_file",
            ];
            let at = if table != "kafka" && security.contains(&rest) {
                format!("[{table}.security]")
            } else {
                format!("[{table}]")
            };
            return Some(format!(
                "key `{key}` moved: write `{rest}` in the {at} table (the broker settings belong to their adapters now)"
            ));
        }
    }
    None
}

/// A value's error (no span: the tables are deserialized after parsing) with its key path,
/// quoted strings hidden.
fn value_message(table: &str, e: &toml::de::Error) -> String {
    let shown = hide_quoted(e.to_string().trim());
    let (words, key) = match shown.rsplit_once("\nin `") {
        Some((w, k)) => (
            w.trim().to_string(),
            Some(k.trim_end_matches('`').to_string()),
        ),
        None => (shown.clone(), None),
    };
    let path = match (table.is_empty(), key) {
        (true, Some(k)) => Some(k),
        (false, Some(k)) => Some(format!("{table}.{k}")),
        (false, None) => Some(table.to_string()),
        (true, None) => None,
    };
    match path {
        Some(p) => format!("key `{p}`: {words}"),
        None => words,
    }
}

/// A TOML error as it may be printed: the line, column and key where it is, and the
/// parser's words with every double-quoted string in them replaced by `"***"`. Never the
/// offending line itself (toml's `Display` quotes it, and a line may hold a password) nor a
/// value serde quotes (`invalid type: string "..."`).
pub fn parse_message(text: &str, e: &toml::de::Error) -> String {
    let words = hide_quoted(e.message().trim());
    let Some(span) = e.span() else {
        return words;
    };
    let start = span.start.min(text.len());
    let before = &text[..start];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = text[line_start..start].chars().count() + 1;
    let line_text = text[line_start..].lines().next().unwrap_or("");
    // The key of a `key = value` line: bare keys only (a quoted key is not shown).
    let key = line_text
        .split_once('=')
        .map(|(k, _)| k.trim())
        .filter(|k| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        });
    match key {
        Some(k) => format!("line {line}, column {column} (key `{k}`): {words}"),
        None => format!("line {line}, column {column}: {words}"),
    }
}

/// `s` with the contents of every `"..."` replaced by `***`.
fn hide_quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut inside = false;
    for c in s.chars() {
        if c == '"' {
            if inside {
                out.push_str("***");
            }
            inside = !inside;
            out.push(c);
        } else if !inside {
            out.push(c);
        }
    }
    if inside {
        out.push_str("***");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_overrides_defaults_and_bad_keys_are_named() {
        let dir = std::env::temp_dir().join(format!("sealpost-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(
            &good,
            "lease_ms = 4000\nack_timeout_ms = 1000\nrescan_every_ms = 200\n",
        )
        .unwrap();
        let c = load(Some(good.to_str().unwrap())).unwrap();
        assert_eq!((c.lease_ms, c.ack_timeout_ms), (4_000, 1_000));
        // The dispatcher machine gets the full-scan period the file names.
        assert_eq!(c.dispatcher_config().rescan_every_ms, 200);
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "no_such_key = 1\n").unwrap();
        let e = load(Some(bad.to_str().unwrap())).unwrap_err().to_string();
        assert!(e.contains("no_such_key"), "{e}");
        let out = dir.join("range.toml");
        std::fs::write(&out, "lease_ms = 2000\nack_timeout_ms = 2000\n").unwrap();
        let e = load(Some(out.to_str().unwrap())).unwrap_err().to_string();
        assert!(e.contains("ack_timeout_ms"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn toml_errors_do_not_quote_the_offending_line() {
        let dir = std::env::temp_dir().join(format!("sealpost-config-toml-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("bad.toml");
        for (text, at) in [
            // An unterminated string on the password's line.
            (
                "lease_ms = 4000\ndatabase_url = \"host=h password=hunter2\n",
                "line ",
            ),
            // A value of the wrong type: serde quotes the string.
            ("lease_ms = \"hunter2\"\n", "key `lease_ms`"),
            // Garbage after a value.
            ("database_url = \"password=hunter2\" hunter2\n", "line 1"),
        ] {
            std::fs::write(&file, text).unwrap();
            let e = load(Some(file.to_str().unwrap())).unwrap_err().to_string();
            assert!(!e.contains("hunter2"), "{e}");
            assert!(e.contains(at), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_database_password_file_is_appended_and_never_printed() {
        let dir = std::env::temp_dir().join(format!("sealpost-config-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pw = dir.join("pw");
        std::fs::write(&pw, "hunter 2\n").unwrap();
        let file = dir.join("c.toml");
        std::fs::write(
            &file,
            format!(
                "database_url = \"host=h user=app\"\ndatabase_password_file = \"{}\"\n",
                pw.display()
            ),
        )
        .unwrap();
        let c = load(Some(file.to_str().unwrap())).unwrap();
        assert_eq!(
            sealpost::secret::dsn_password(&c.database_url).as_deref(),
            Some("hunter 2")
        );
        let debug = format!("{c:?}");
        assert!(!debug.contains("hunter"), "{debug}");
        assert!(debug.contains("host=h user=app password=***"), "{debug}");
        std::fs::remove_file(&pw).unwrap();
        let e = load(Some(file.to_str().unwrap())).unwrap_err().to_string();
        assert!(
            e.contains("database_password_file") && e.contains(&pw.display().to_string()),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn broker_tables_reach_the_adapters_and_old_flat_keys_say_where_they_went() {
        use sealpost_nats::NatsOptions;
        use sealpost_rabbitmq::RabbitOptions;
        let dir =
            std::env::temp_dir().join(format!("sealpost-config-brokers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("brokers.toml");
        std::fs::write(
            &file,
            "lease_ms = 4000\n\
             ack_timeout_ms = 1500\n\
             broker = \"kafka\"\n\
             [nats]\n\
             url = \"tls://nats.example.com:4222\"\n\
             cluster = \"prod-nats\"\n\
             [nats.security]\n\
             tls_ca_file = \"/etc/sealpost/ca.pem\"\n\
             tls_cert_file = \"/etc/sealpost/client.pem\"\n\
             tls_key_file = \"/etc/sealpost/client.key\"\n\
             require_tls = true\n\
             creds_file = \"/etc/sealpost/app.creds\"\n\
             [rabbitmq]\n\
             url = \"amqps://app@mq.example.com/%2f\"\n\
             [rabbitmq.security]\n\
             tls_ca_file = \"/etc/sealpost/mq-ca.pem\"\n\
             password_file = \"/etc/sealpost/mq-password\"\n\
             [kafka]\n\
             brokers = \"k1:9092,k2:9092\"\n\
             partitions = 12\n\
             client_properties = \"security.protocol=SASL_SSL,sasl.mechanism=SCRAM-SHA-512\"\n\
             sasl_password_file = \"/etc/sealpost/kafka-password\"\n",
        )
        .unwrap();
        let c = load(Some(file.to_str().unwrap())).unwrap();
        assert_eq!((c.lease_ms, c.broker.as_str()), (4_000, "kafka"));
        assert_eq!(
            (c.nats.url.as_str(), c.nats.cluster.as_str()),
            ("tls://nats.example.com:4222", "prod-nats")
        );
        assert_eq!(
            c.nats.security,
            NatsOptions {
                tls_ca_file: Some("/etc/sealpost/ca.pem".into()),
                tls_cert_file: Some("/etc/sealpost/client.pem".into()),
                tls_key_file: Some("/etc/sealpost/client.key".into()),
                require_tls: true,
                creds_file: Some("/etc/sealpost/app.creds".into()),
                ..Default::default()
            }
        );
        assert_eq!(
            c.rabbitmq.security,
            RabbitOptions {
                tls_ca_file: Some("/etc/sealpost/mq-ca.pem".into()),
                password_file: Some("/etc/sealpost/mq-password".into()),
                ..Default::default()
            }
        );
        assert_eq!(c.rabbitmq.cluster, "rabbitmq-local", "a default kept");
        assert_eq!(c.kafka.partitions, 12);
        assert_eq!(c.kafka.ack_timeout, std::time::Duration::from_millis(1_500));
        assert_eq!(
            c.kafka.sasl_password_file.as_deref(),
            Some(std::path::Path::new("/etc/sealpost/kafka-password"))
        );
        // The old flat keys are refused with their new place.
        std::fs::write(&file, "nats_creds_file = \"/x\"\n").unwrap();
        let e = load(Some(file.to_str().unwrap())).unwrap_err().to_string();
        assert!(
            e.contains("nats_creds_file") && e.contains("[nats.security]"),
            "{e}"
        );
        std::fs::write(&file, "kafka_brokers = \"h:1\"\n").unwrap();
        let e = load(Some(file.to_str().unwrap())).unwrap_err().to_string();
        assert!(e.contains("`brokers`") && e.contains("[kafka]"), "{e}");
        // A typo inside a table is named with its table.
        std::fs::write(&file, "[nats]\nurll = \"nats://h:4222\"\n").unwrap();
        let e = load(Some(file.to_str().unwrap())).unwrap_err().to_string();
        assert!(e.contains("urll"), "{e}");
        // Malformed Kafka properties are named, never quoted.
        std::fs::write(&file, "[kafka]\nclient_properties = \"sasl.password\"\n").unwrap();
        let e = load(Some(file.to_str().unwrap())).unwrap_err().to_string();
        assert!(e.contains("kafka") && !e.contains("sasl.password"), "{e}");
        // Nothing configured: what the adapters always did.
        let d = Settings::default();
        assert_eq!(d.nats.security, NatsOptions::default());
        assert_eq!(d.rabbitmq.security, RabbitOptions::default());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
