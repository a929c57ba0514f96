//! Loading the runtime configuration ([`sealpost::runtime::Config`]) from a TOML file and the
//! environment.

use sealpost::runtime::{Config, ConfigError};

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
}

/// Loads defaults, then the file (if given), then `DATABASE_URL` / `NATS_URL`, and validates.
pub fn load(path: Option<&str>) -> Result<Config, LoadError> {
    let mut c = match path {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|source| LoadError::Read {
                path: p.to_string(),
                source,
            })?;
            toml::from_str::<Config>(&text).map_err(|e| LoadError::Parse {
                path: p.to_string(),
                message: parse_message(&text, &e),
            })?
        }
        None => Config::default(),
    };
    c.apply_env();
    c.apply_secret_files()?;
    c.validate()?;
    Ok(c)
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
        std::fs::write(&good, "lease_ms = 4000\nack_timeout_ms = 1000\n").unwrap();
        let c = load(Some(good.to_str().unwrap())).unwrap();
        assert_eq!((c.lease_ms, c.ack_timeout_ms), (4_000, 1_000));
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
    fn nats_tls_and_credential_keys_reach_the_adapter_options() {
        use sealpost_nats::NatsOptions;
        let dir = std::env::temp_dir().join(format!("sealpost-config-nats-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("nats.toml");
        std::fs::write(
            &file,
            "nats_tls_ca_file = \"/etc/sealpost/ca.pem\"\n\
             nats_tls_cert_file = \"/etc/sealpost/client.pem\"\n\
             nats_tls_key_file = \"/etc/sealpost/client.key\"\n\
             nats_require_tls = true\n\
             nats_creds_file = \"/etc/sealpost/app.creds\"\n",
        )
        .unwrap();
        let c = load(Some(file.to_str().unwrap())).unwrap();
        assert_eq!(
            crate::brokers::nats_options(&c),
            NatsOptions {
                tls_ca_file: Some("/etc/sealpost/ca.pem".into()),
                tls_cert_file: Some("/etc/sealpost/client.pem".into()),
                tls_key_file: Some("/etc/sealpost/client.key".into()),
                require_tls: true,
                creds_file: Some("/etc/sealpost/app.creds".into()),
                ..Default::default()
            }
        );
        // Nothing configured: what `Nats::connect` always did.
        assert_eq!(
            crate::brokers::nats_options(&Config::default()),
            NatsOptions::default()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn rabbitmq_and_kafka_tls_and_credential_keys_are_read() {
        use sealpost_rabbitmq::RabbitOptions;
        let dir = std::env::temp_dir().join(format!("sealpost-config-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tls.toml");
        std::fs::write(
            &file,
            "rabbitmq_url = \"amqps://app@mq.example.com/%2f\"\n\
             rabbitmq_tls_ca_file = \"/etc/sealpost/mq-ca.pem\"\n\
             rabbitmq_tls_cert_file = \"/etc/sealpost/mq-client.pem\"\n\
             rabbitmq_tls_key_file = \"/etc/sealpost/mq-client.key\"\n\
             rabbitmq_password_file = \"/etc/sealpost/mq-password\"\n\
             kafka_sasl_password_file = \"/etc/sealpost/kafka-password\"\n",
        )
        .unwrap();
        let c = load(Some(file.to_str().unwrap())).unwrap();
        assert_eq!(
            crate::brokers::rabbitmq_options(&c),
            RabbitOptions {
                tls_ca_file: Some("/etc/sealpost/mq-ca.pem".into()),
                tls_cert_file: Some("/etc/sealpost/mq-client.pem".into()),
                tls_key_file: Some("/etc/sealpost/mq-client.key".into()),
                password_file: Some("/etc/sealpost/mq-password".into()),
            }
        );
        assert_eq!(c.kafka_sasl_password_file, "/etc/sealpost/kafka-password");
        // Nothing configured: what `Rabbit::connect` always did.
        assert_eq!(
            crate::brokers::rabbitmq_options(&Config::default()),
            RabbitOptions::default()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
