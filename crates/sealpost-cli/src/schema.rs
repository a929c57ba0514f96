//! `sealpost schema`: the contract registry (R26, `sealpost::contract`).

use clap::Subcommand;
use sealpost::contract::{self, ContractError, Error};
use sealpost::runtime;
use sealpost_cli::config::Settings;

#[derive(Subcommand, Debug)]
pub enum SchemaCmd {
    /// Register FILE (an Avro record schema, JSON) as the next version of EVENT_TYPE, after
    /// checking it against every registered version both ways (new readers of history, old
    /// readers of new events) and its field annotations; refused, with each rule it breaks,
    /// otherwise. Registering a text already registered prints that version.
    Register {
        /// Event type, e.g. `order.created`.
        #[arg(long)]
        event_type: String,
        /// The schema file.
        #[arg(long)]
        file: String,
    },
    /// Check FILE as the next version of EVENT_TYPE without registering it: prints each
    /// rule it breaks; exit status 1 when it breaks one.
    Check {
        /// Event type.
        #[arg(long)]
        event_type: String,
        /// The schema file.
        #[arg(long)]
        file: String,
    },
    /// List the event types with contracts, or one event type's versions.
    List {
        /// Event type.
        #[arg(long)]
        event_type: Option<String>,
    },
    /// Print a registered version's schema.
    Show {
        /// Event type.
        #[arg(long)]
        event_type: String,
        /// Version [default: the latest].
        #[arg(long)]
        version: Option<u32>,
    },
}

fn read(file: &str) -> Result<String, String> {
    std::fs::read_to_string(file).map_err(|e| format!("cannot read schema file `{file}`: {e}"))
}

async fn shown(pg: &tokio_postgres::Client, e: Error) -> String {
    match e {
        Error::Store(x) => sealpost::roles::explain(pg, x).await.to_string(),
        e => e.to_string(),
    }
}

pub async fn run(cmd: SchemaCmd, cfg: &Settings) -> Result<i32, String> {
    let mut pg = runtime::pg_connect(&cfg.database_url)
        .await
        .map_err(|x| x.to_string())?;
    match cmd {
        SchemaCmd::Register { event_type, file } => {
            let text = read(&file)?;
            match contract::register(&mut pg, &event_type, &text).await {
                Ok((v, true)) => {
                    println!(
                        "registered {} (fingerprint {}); producers write payload_schema \"{}\"",
                        v.id(),
                        v.fingerprint.to_prefixed_hex(),
                        v.id()
                    );
                    Ok(0)
                }
                Ok((v, false)) => {
                    println!(
                        "{file} is already registered as {}; nothing changed",
                        v.id()
                    );
                    Ok(0)
                }
                Err(e) => Err(shown(&pg, e).await),
            }
        }
        SchemaCmd::Check { event_type, file } => {
            let text = read(&file)?;
            let c = match contract::check(&pg, &event_type, &text).await {
                Ok(c) => c,
                Err(e) => return Err(shown(&pg, e).await),
            };
            if let Some(v) = c.same_as {
                println!("{file} is registered already as {event_type}@{v}");
                return Ok(0);
            }
            if c.breaches.is_empty() {
                println!(
                    "compatible: {file} may be registered as {event_type}@{} (checked both ways against {} registered version(s))",
                    c.next_version,
                    c.next_version - 1
                );
                return Ok(0);
            }
            println!(
                "{} breaking change(s); {file} cannot be registered as {event_type}@{}:",
                c.breaches.len(),
                c.next_version
            );
            for b in &c.breaches {
                println!("  {b}");
            }
            Ok(1)
        }
        SchemaCmd::List { event_type: None } => {
            let types = match contract::event_types(&pg).await {
                Ok(t) => t,
                Err(e) => return Err(shown(&pg, e).await),
            };
            if types.is_empty() {
                println!("no contracts registered; add one with `sealpost schema register --event-type T --file F`");
            }
            for (t, v, at) in types {
                println!("{t}\tlatest version {v}\tregistered {at}");
            }
            Ok(0)
        }
        SchemaCmd::List {
            event_type: Some(t),
        } => {
            let vs = match contract::versions(&pg, &t).await {
                Ok(v) => v,
                Err(e) => return Err(shown(&pg, e).await),
            };
            if vs.is_empty() {
                return Err(format!("no contract registered for `{t}`"));
            }
            for v in vs {
                println!(
                    "{}\tfingerprint {}",
                    v.id(),
                    v.fingerprint.to_prefixed_hex()
                );
            }
            Ok(0)
        }
        SchemaCmd::Show {
            event_type,
            version,
        } => {
            let vs = match contract::versions(&pg, &event_type).await {
                Ok(v) => v,
                Err(e) => return Err(shown(&pg, e).await),
            };
            let v = match version {
                Some(n) => vs.iter().find(|v| v.version == n),
                None => vs.last(),
            }
            .ok_or_else(|| {
                ContractError::NotRegistered {
                    event_type: event_type.clone(),
                    version: version.unwrap_or(1),
                }
                .to_string()
            })?;
            let pretty: serde_json::Value =
                serde_json::from_str(&v.text).map_err(|x| x.to_string())?;
            println!(
                "{}",
                serde_json::to_string_pretty(&pretty).map_err(|x| x.to_string())?
            );
            Ok(0)
        }
    }
}
