//! No secret leaves Sealpost (issue 20): the PostgreSQL connection string as it may be
//! printed ([`redact_dsn`]), a password read from a file and appended to a connection string
//! ([`with_password`], [`read_secret_file`]), and, re-exported from the core, the redaction
//! of broker URLs and Kafka properties that the adapters use.
//!
//! Every error, log line and `Debug` that could carry a connection string, a URL or a token
//! goes through these: [`crate::runtime::RunError::Connect`] holds only the redacted form,
//! [`crate::runtime::Config`]'s `Debug` redacts its URLs.

use std::path::{Path, PathBuf};

pub use sealpost_core::secret::{is_secret_key, redact_properties, redact_url, scrub, REDACTED};

/// What [`redact_dsn`] prints for a string it cannot tokenize (so it cannot tell where a
/// password ends).
pub const UNPARSEABLE: &str = "(a connection string that does not parse; not shown)";

/// A PostgreSQL connection string, in either form, as it may be shown: the values of
/// `password` and any other secret key ([`is_secret_key`]) replaced by [`REDACTED`]; host,
/// port, user, dbname and the other keys kept. A key=value string that does not tokenize
/// (an unterminated quote, a key without `=`) is not shown at all ([`UNPARSEABLE`]).
pub fn redact_dsn(dsn: &str) -> String {
    if is_url(dsn) {
        return redact_url(dsn);
    }
    match key_value_pairs(dsn) {
        Some(pairs) => pairs
            .iter()
            .map(|p| {
                if is_secret_key(p.key) {
                    format!("{}={REDACTED}", p.key)
                } else {
                    p.text.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join(" "),
        None => UNPARSEABLE.to_string(),
    }
}

/// The password of a key=value connection string, or of a URL's query, if it sets one
/// (the last one wins, as in libpq). A URL's `user:password@` is not looked at.
pub fn dsn_password(dsn: &str) -> Option<String> {
    if is_url(dsn) {
        return None;
    }
    key_value_pairs(dsn)?
        .into_iter()
        .rev()
        .find(|p| p.key == "password")
        .map(|p| p.value)
}

/// `dsn` with `password` set to `password`, added last so it wins over one the string holds
/// (tokio-postgres and libpq take the last value of a key; a URL's query parameter wins over
/// its `user:password@`). Quoted and escaped for the key=value form, percent-encoded for a
/// URL.
pub fn with_password(dsn: &str, password: &str) -> String {
    if is_url(dsn) {
        let encoded: String =
            percent_encoding::utf8_percent_encode(password, percent_encoding::NON_ALPHANUMERIC)
                .collect();
        let (head, fragment) = match dsn.find('#') {
            Some(h) => (&dsn[..h], &dsn[h..]),
            None => (dsn, ""),
        };
        // The query starts at the first `?` after the credentials (tokio-postgres's reading).
        let after_credentials = head.find('@').map_or(0, |i| i + 1);
        let sep = if head[after_credentials..].contains('?') {
            "&"
        } else {
            "?"
        };
        format!("{head}{sep}password={encoded}{fragment}")
    } else {
        let quoted = password.replace('\\', "\\\\").replace('\'', "\\'");
        let dsn = dsn.trim_end();
        if dsn.is_empty() {
            format!("password='{quoted}'")
        } else {
            format!("{dsn} password='{quoted}'")
        }
    }
}

/// Why a secret file could not be used. Names the file and the key that named it, never
/// what it holds.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    /// The file cannot be read.
    #[error("cannot read the {key} file {}: {source}; check the path and that this process may read it", path.display())]
    Read {
        /// The configuration key or flag naming the file.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is empty (or holds only a newline).
    #[error("the {key} file {} is empty; write the secret into it (one trailing newline is ignored)", path.display())]
    Empty {
        /// The configuration key or flag naming the file.
        key: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// The file is not UTF-8 text.
    #[error("the {key} file {} is not UTF-8 text; write the secret as text", path.display())]
    NotText {
        /// The configuration key or flag naming the file.
        key: &'static str,
        /// The file.
        path: PathBuf,
    },
}

/// The secret in the file `path` (named by the configuration key or flag `key`), with one
/// trailing newline (`\n` or `\r\n`) removed and nothing else changed.
pub fn read_secret_file(key: &'static str, path: &Path) -> Result<String, SecretFileError> {
    let bytes = std::fs::read(path).map_err(|source| SecretFileError::Read {
        key,
        path: path.to_path_buf(),
        source,
    })?;
    let mut text = String::from_utf8(bytes).map_err(|_| SecretFileError::NotText {
        key,
        path: path.to_path_buf(),
    })?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    if text.is_empty() {
        return Err(SecretFileError::Empty {
            key,
            path: path.to_path_buf(),
        });
    }
    Ok(text)
}

/// Whether a connection string is in the URL form (tokio-postgres's two schemes).
fn is_url(dsn: &str) -> bool {
    let d = dsn.trim_start();
    d.starts_with("postgres://") || d.starts_with("postgresql://")
}

/// One `key=value` of the key=value form.
pub(crate) struct Pair<'a> {
    pub(crate) key: &'a str,
    /// The value, unquoted and unescaped.
    pub(crate) value: String,
    /// The pair as written.
    pub(crate) text: &'a str,
}

/// The key=value form, tokenized the way tokio-postgres (and libpq) does: whitespace around
/// `=`, values bare or in single quotes, a backslash escaping the next character. `None`
/// when it does not tokenize. Shared with [`crate::tls`].
pub(crate) fn key_value_pairs(dsn: &str) -> Option<Vec<Pair<'_>>> {
    let mut it = dsn.char_indices().peekable();
    let mut pairs = Vec::new();
    loop {
        while it.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, _)) = it.peek() else {
            break;
        };
        while it
            .next_if(|&(_, c)| !c.is_whitespace() && c != '=')
            .is_some()
        {}
        let key_end = it.peek().map_or(dsn.len(), |&(i, _)| i);
        let key = &dsn[start..key_end];
        if key.is_empty() {
            return None;
        }
        while it.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        it.next_if(|&(_, c)| c == '=')?;
        while it.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if it.next_if(|&(_, c)| c == '\'').is_some() {
            loop {
                match it.next()?.1 {
                    '\'' => break,
                    '\\' => value.push(it.next()?.1),
                    c => value.push(c),
                }
            }
        } else {
            while let Some((_, c)) = it.next_if(|(_, c)| !c.is_whitespace()) {
                if c == '\\' {
                    if let Some((_, escaped)) = it.next() {
                        value.push(escaped);
                    }
                } else {
                    value.push(c);
                }
            }
        }
        let end = it.peek().map_or(dsn.len(), |&(i, _)| i);
        pairs.push(Pair {
            key,
            value,
            text: &dsn[start..end],
        });
    }
    Some(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn dsn(input: &str, expect: &str) {
        let got = redact_dsn(input);
        assert_eq!(got, expect, "input: {input}");
    }

    #[test]
    fn key_value_passwords_are_replaced() {
        dsn(
            "host=db.example port=5433 user=app password=hunter2 dbname=orders",
            "host=db.example port=5433 user=app password=*** dbname=orders",
        );
        // Quoted with spaces, escaped quotes, whitespace around `=`.
        dsn(
            "host=db password='a b' user=app",
            "host=db password=*** user=app",
        );
        dsn(
            "host=db password = 'it\\'s a secret' dbname=x",
            "host=db password=*** dbname=x",
        );
        dsn("password=back\\ slash host=h", "password=*** host=h");
        dsn("password='' host=h", "password=*** host=h");
        // Other secret keys, and a password that spells a key.
        dsn(
            "host=h sslpassword=k3y sslkey=/etc/key.pem",
            "host=h sslpassword=*** sslkey=/etc/key.pem",
        );
        dsn("host=h password='user=x host=y'", "host=h password=***");
        // No password at all: unchanged (whitespace normalised).
        dsn(
            "host=127.0.0.1   user=postgres dbname=test",
            "host=127.0.0.1 user=postgres dbname=test",
        );
        dsn("", "");
    }

    #[test]
    fn unparseable_strings_are_not_shown() {
        dsn("host=h password='unterminated", UNPARSEABLE);
        dsn("host=h hunter2", UNPARSEABLE);
    }

    #[test]
    fn url_passwords_are_replaced() {
        dsn(
            "postgres://app:hunter2@db:5432/orders?sslmode=require",
            "postgres://app:***@db:5432/orders?sslmode=require",
        );
        dsn(
            "postgresql://app:p%40ss%20w@db/orders",
            "postgresql://app:***@db/orders",
        );
        dsn(
            "postgres://db/orders?user=app&password=hunter2",
            "postgres://db/orders?user=app&password=***",
        );
        dsn("postgres://db/orders", "postgres://db/orders");
    }

    #[test]
    fn a_password_is_appended_so_that_it_wins() {
        let kv = with_password("host=h user=u password=old", "a b'c\\d");
        assert_eq!(kv, "host=h user=u password=old password='a b\\'c\\\\d'");
        assert_eq!(dsn_password(&kv).as_deref(), Some("a b'c\\d"));
        assert_eq!(redact_dsn(&kv), "host=h user=u password=*** password=***");
        let parsed: tokio_postgres::Config = kv.parse().unwrap();
        assert_eq!(parsed.get_password(), Some("a b'c\\d".as_bytes()));

        let url = with_password("postgres://u@h/db?sslmode=disable", "p@ss/w?rd&x");
        assert_eq!(
            url,
            "postgres://u@h/db?sslmode=disable&password=p%40ss%2Fw%3Frd%26x"
        );
        let parsed: tokio_postgres::Config = url.parse().unwrap();
        assert_eq!(parsed.get_password(), Some("p@ss/w?rd&x".as_bytes()));
        assert_eq!(
            redact_dsn(&url),
            "postgres://u@h/db?sslmode=disable&password=***"
        );
        let url = with_password("postgres://u:old@h/db", "new");
        let parsed: tokio_postgres::Config = url.parse().unwrap();
        assert_eq!(parsed.get_password(), Some("new".as_bytes()));
    }

    #[test]
    fn secret_files_trim_one_newline_and_name_the_file() {
        let dir = std::env::temp_dir().join(format!("sealpost-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("pw");
        std::fs::write(&f, "hunter2\n\n").unwrap();
        assert_eq!(read_secret_file("k", &f).unwrap(), "hunter2\n");
        std::fs::write(&f, " spaced \r\n").unwrap();
        assert_eq!(read_secret_file("k", &f).unwrap(), " spaced ");
        std::fs::write(&f, "\n").unwrap();
        let e = read_secret_file("database_password_file", &f)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("database_password_file") && e.contains("empty"),
            "{e}"
        );
        let missing = dir.join("missing");
        let e = read_secret_file("database_password_file", &missing)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&missing.display().to_string()), "{e}");
        std::fs::write(&f, [0xff, 0xfe, b'x']).unwrap();
        let e = read_secret_file("k", &f).unwrap_err().to_string();
        assert!(e.contains("UTF-8"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
