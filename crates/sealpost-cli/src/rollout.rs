//! `sealpost rollout`: switch which dispatcher implementation claims a route's rows (R25,
//! `sealpost::store::rollout`, docs/operations.md "Rolling out a new dispatcher").

use clap::Subcommand;
use sealpost::runtime;
use sealpost::store::{self, AliasView, RolloutCommand};
use sealpost_cli::config::Settings;
use sealpost_core::rollout::DivergenceKind;

#[derive(Subcommand, Debug)]
pub enum RolloutCmd {
    /// Start a rollout: the candidate runs beside the incumbent and claims nothing. The
    /// incumbent is the route's current claimant, or (on a route's first rollout) the one
    /// implementation its cluster's dispatchers announced, or --incumbent.
    Shadow {
        /// The implementation being rolled out (its dispatchers' `implementation`).
        #[arg(long)]
        candidate: String,
        /// The route (a route policy name).
        #[arg(long)]
        route: String,
        /// The implementation claiming now, on a route's first rollout.
        #[arg(long)]
        incumbent: Option<String>,
    },
    /// The shadowed candidate claims the events of TYPES whose aggregate falls in the
    /// first SHARE percent (a fixed share of aggregates: an aggregate's events all go to
    /// one implementation); the incumbent claims the rest. Repeat it to change the types or
    /// the share.
    Takeover {
        /// The candidate (as shadowed).
        #[arg(long)]
        candidate: String,
        /// The route.
        #[arg(long)]
        route: String,
        /// Event types, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        types: Vec<String>,
        /// Percentage of aggregates, 1 to 100.
        #[arg(long, default_value_t = 5)]
        share: u32,
    },
    /// The candidate claims every row of the route; the incumbent stays the rollback target.
    Promote {
        /// The route.
        #[arg(long)]
        route: String,
    },
    /// The incumbent claims every row again. Switches the alias and nothing else: what the
    /// candidate already sent converges into its publish slot and stays reconciled.
    Rollback {
        /// The route.
        #[arg(long)]
        route: String,
    },
    /// Mark the candidate's unexplained shadow divergences on ROUTE (of one kind, or all)
    /// as explained, with who and why: `promote` is refused while one is unexplained.
    Explain {
        /// The route.
        #[arg(long)]
        route: String,
        /// The candidate.
        #[arg(long)]
        candidate: String,
        /// Only this kind: destination_digest, payload_digest, envelope_generation,
        /// headers or ordering.
        #[arg(long)]
        kind: Option<String>,
        /// Who explains.
        #[arg(long)]
        operator: String,
        /// Why the difference is intended.
        #[arg(long)]
        reason: String,
    },
    /// Every route's alias, the shadows' comparisons, the implementations announced, and
    /// the latest switches.
    Status {
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
}

fn describe(v: &AliasView) -> String {
    let a = &v.alias;
    format!(
        "route {} ({}/{}): stage {}, generation {}: {}",
        a.route,
        a.cluster,
        a.topic,
        a.stage.name(),
        a.generation,
        v.claims
    )
}

pub async fn run(cmd: RolloutCmd, cfg: &Settings) -> Result<i32, String> {
    let mut pg = runtime::pg_connect(&cfg.database_url)
        .await
        .map_err(|x| x.to_string())?;
    let (route, command) = match cmd {
        RolloutCmd::Status { json } => {
            let s = match store::rollout_status(&pg).await {
                Ok(s) => s,
                Err(x) => return Err(sealpost::roles::explain(&pg, x).await.to_string()),
            };
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&s).map_err(|e| e.to_string())?
                );
                return Ok(0);
            }
            if s.aliases.is_empty() {
                println!("no rollouts: every dispatcher claims the rows its protocol allows");
            }
            for a in &s.aliases {
                println!("{}", describe(a));
            }
            for sh in &s.shadows {
                println!(
                    "shadow of {} on {}: {} compared, {} matched, {} diverged, {} unexplained",
                    sh.candidate, sh.route, sh.compared, sh.matched, sh.diverged, sh.unexplained
                );
                for d in &sh.examples {
                    println!(
                        "  {} {}/{}: incumbent \"{}\", candidate \"{}\"{}",
                        d.kind,
                        d.event_id,
                        d.member,
                        d.incumbent,
                        d.candidate,
                        d.explanation
                            .as_deref()
                            .map(|e| format!(" (explained: {e})"))
                            .unwrap_or_default()
                    );
                }
            }
            if !s.implementations.is_empty() {
                println!("announced:");
                for i in &s.implementations {
                    println!(
                        "  {} {} on {} (owner {}, protocol {}..={}, seen at {} ms)",
                        i.role,
                        i.implementation,
                        i.cluster,
                        i.owner,
                        i.protocol_min,
                        i.protocol_max,
                        i.seen_at_ms
                    );
                }
            }
            if !s.log.is_empty() {
                println!("latest switches:");
                for l in &s.log {
                    println!(
                        "  {} {} by {} at {} ms -> generation {} stage {}",
                        l.route,
                        l.command,
                        l.by_login,
                        l.at_ms,
                        l.alias.alias.generation,
                        l.alias.alias.stage.name()
                    );
                }
            }
            return Ok(0);
        }
        RolloutCmd::Explain {
            route,
            candidate,
            kind,
            operator,
            reason,
        } => {
            let kind = match kind {
                None => None,
                Some(k) => Some(DivergenceKind::parse(&k).ok_or_else(|| {
                    format!(
                        "`{k}` is not a divergence kind: use destination_digest, payload_digest, envelope_generation, headers or ordering"
                    )
                })?),
            };
            match store::explain_divergences(&pg, &route, &candidate, kind, &operator, &reason)
                .await
            {
                Ok(0) => {
                    println!("nothing to explain: {candidate} has no unexplained divergence on route {route} (see sealpost rollout status)");
                    return Ok(0);
                }
                Ok(n) => {
                    println!("explained {n} divergence(s) of {candidate} on {route} (by {operator}: {reason})");
                    return Ok(0);
                }
                Err(x) => return Err(sealpost::roles::explain(&pg, x).await.to_string()),
            }
        }
        RolloutCmd::Shadow {
            candidate,
            route,
            incumbent,
        } => (
            route,
            RolloutCommand::Shadow {
                candidate,
                incumbent,
            },
        ),
        RolloutCmd::Takeover {
            candidate,
            route,
            types,
            share,
        } => (
            route,
            RolloutCommand::Takeover {
                candidate,
                types: types
                    .into_iter()
                    .map(|t| t.trim().to_string())
                    .filter(|t| !t.is_empty())
                    .collect(),
                share,
            },
        ),
        RolloutCmd::Promote { route } => (route, RolloutCommand::Promote),
        RolloutCmd::Rollback { route } => (route, RolloutCommand::Rollback),
    };
    match store::rollout(&mut pg, &route, &command).await {
        Ok(c) => {
            match (&c.after, c.changed) {
                (Some(a), true) => {
                    println!("switched: {}", describe(a));
                    for w in &c.warnings {
                        println!("warning: {w}");
                    }
                }
                (Some(a), false) => println!("unchanged: {}", describe(a)),
                (None, _) => println!("route {route} has no rollout; nothing to {}", c.command),
            }
            Ok(0)
        }
        Err(x) => Err(sealpost::roles::explain(&pg, x).await.to_string()),
    }
}
