//! The `sealpost` command's library half: the TOML configuration, the demo, the bench, the
//! example consumers, the status web page and the text printers. The operator functions
//! (reconciliation report, purge, trace) live in the library, `sealpost::ops`, re-exported
//! here as `ops`. The binary (`src/main.rs`) parses the command line; tests reach these
//! modules as `sealpost_cli::...`.

pub mod bench;
pub mod brokers;
pub mod capacity;
pub mod config;
pub mod consume_bench;
pub mod consumer;
pub mod cpu;
pub mod demo;
pub mod metrics;
pub use sealpost::ops;
pub mod web;

use sealpost::store;

/// Prints a status table.
pub fn print_status(s: &store::Status) {
    println!("{:<18}{:>10}", "state", "rows");
    for (k, v) in &s.states {
        println!("{k:<18}{v:>10}");
    }
    println!("oldest PENDING    {:>9.1}s", s.oldest_pending_s);
    println!(
        "unknown           {:>10}  (oldest {:.1}s)",
        s.unknown, s.oldest_unknown_s
    );
    println!("quarantined       {:>10}", s.quarantined);
    for (id, why) in &s.quarantined_rows {
        println!("  QUARANTINED {id}: {why}  (release: sealpost release {id})");
    }
    for (id, n, why) in &s.stuck_rows {
        println!("  CANNOT LEAVE {id}: {n} tries, last: {why}");
    }
    if s.missing_at_broker > 0 {
        println!(
            "published but missing at the broker {:>4}  (see sealpost reconcile)",
            s.missing_at_broker
        );
    }
    if s.sets.total > 0 {
        println!(
            "delivery sets     {:>10}  ({} complete, {} in progress, {} blocked)",
            s.sets.total, s.sets.complete, s.sets.in_progress, s.sets.blocked
        );
        for v in &s.sets.open {
            let members: Vec<String> = v
                .members
                .iter()
                .map(|m| format!("{}={}", m.route, m.state.as_deref().unwrap_or("removed")))
                .collect();
            println!(
                "  SET {} {} ({}, {}/{} needed published): {}",
                v.event_id,
                v.status.to_uppercase(),
                v.rule,
                v.published,
                v.needed,
                members.join(", ")
            );
        }
    }
    for v in &s.rollout.aliases {
        let a = &v.alias;
        println!(
            "ROLLOUT {} stage {} (generation {}): {}",
            a.route,
            a.stage.name(),
            a.generation,
            v.claims
        );
    }
    for sh in &s.rollout.shadows {
        println!(
            "  shadow of {} on {}: {} compared, {} matched, {} diverged, {} unexplained{}",
            sh.candidate,
            sh.route,
            sh.compared,
            sh.matched,
            sh.diverged,
            sh.unexplained,
            if sh.unexplained > 0 {
                " (promotion refused until explained: sealpost rollout status)"
            } else {
                ""
            }
        );
    }
    for c in &s.cdc {
        println!(
            "CDC slot {} ({}): {}{}, {} unconfirmed log bytes, {} retained, confirmed {:.1}s ago, {} rows in its window",
            c.slot,
            c.cluster,
            if c.exists { "exists" } else { "GONE" },
            if c.active { ", streaming" } else { ", no publisher" },
            c.unconfirmed_bytes,
            c.retained_bytes,
            c.confirmed_age_s,
            c.window_rows
        );
        if let Some(p) = c.problem(300.0) {
            println!("  CDC: {p}");
        }
    }
}

/// Prints a reconciliation report.
pub fn print_reconcile(r: &ops::ReconcileReport) {
    println!(
        "committed {}  published {}  stream messages scanned {}",
        r.committed, r.published, r.stream_messages_scanned
    );
    for (c, n) in &r.consumed {
        println!("consumer {c}: {n} consumption receipts");
    }
    if r.second_copies + r.resent_after_unknown > 0 {
        println!(
            "evidence, not loss: {} second copies recorded, {} events sent again after an unknown outcome (consumers' inboxes absorb the copies)",
            r.second_copies, r.resent_after_unknown
        );
    }
    if r.findings.is_empty() {
        println!("no findings");
    }
    for f in &r.findings {
        let who = f
            .consumer
            .as_deref()
            .map(|c| format!(" [{c}]"))
            .unwrap_or_default();
        println!(
            "FINDING {}{who}: {} (threshold {} s), e.g. {:?}",
            f.kind,
            f.count,
            f.threshold_s,
            f.event_ids.iter().take(3).collect::<Vec<_>>()
        );
    }
}

/// Prints a trace (from [`ops::trace`]) as text: one block per event member.
pub fn print_trace(t: &serde_json::Value) {
    let s = |v: &serde_json::Value| match v {
        serde_json::Value::String(x) => x.clone(),
        serde_json::Value::Null => "-".to_string(),
        other => other.to_string(),
    };
    let events = t["events"].as_array().cloned().unwrap_or_default();
    if events.is_empty() {
        println!(
            "{}: no envelope found (never committed, or a wrong id)",
            s(&t["query"])
        );
        return;
    }
    for e in events {
        let env = &e["envelope"];
        println!(
            "event {} member {}: {}",
            s(&e["event_id"]),
            s(&e["member"]),
            s(&e["state"])
        );
        println!(
            "  committed   yes (txid {}), envelope generation {}",
            s(&env["creating_txid"]),
            s(&env["generation"])
        );
        println!(
            "  fact        {} {}",
            s(&env["event_type"]),
            s(&env["aggregate"])
        );
        println!(
            "  destination {} (digest {})",
            s(&env["destination"]),
            s(&env["destination_digest"])
        );
        println!("  payload     {}", s(&env["payload_digest"]));
        for a in e["attempts"].as_array().into_iter().flatten() {
            println!(
                "  attempt     #{} gen {} claim gen {} owner {}: {}",
                s(&a["attempt_id"]),
                s(&a["attempt_generation"]),
                s(&a["claim_generation"]),
                s(&a["owner"]),
                s(&a["status"])
            );
        }
        match e["broker_position"].as_object() {
            Some(p) => println!(
                "  broker      {}#{} (primary attempt #{})",
                s(&p["stream"]),
                s(&p["sequence"]),
                s(&p["primary_attempt_id"])
            ),
            None => println!("  broker      no accepted receipt yet"),
        }
        for r in e["receipts"].as_array().into_iter().flatten() {
            println!(
                "  receipt     {} via {} attempt #{} at {}#{}",
                s(&r["kind"]),
                s(&r["source"]),
                s(&r["attempt_id"]),
                s(&r["stream"]),
                s(&r["sequence"])
            );
        }
        let consumers = e["consumers"].as_array().cloned().unwrap_or_default();
        if consumers.is_empty() {
            println!("  consumers   none yet");
        }
        for c in consumers {
            println!(
                "  consumer    {} receipt #{} from {}#{}",
                s(&c["consumer"]),
                s(&c["receipt_id"]),
                s(&c["stream"]),
                s(&c["sequence"])
            );
        }
        for q in e["quarantine"].as_array().into_iter().flatten() {
            println!("  QUARANTINE  {}: {}", s(&q["reason"]), s(&q["detail"]));
        }
        for a in e["audit"].as_array().into_iter().flatten() {
            println!("  audit       {}: {}", s(&a["what"]), s(&a["detail"]));
        }
    }
}
