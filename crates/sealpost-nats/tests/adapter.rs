//! The adapter against a real NATS JetStream (127.0.0.1:4222, or `NATS_URL`), with no
//! database: how each broker answer maps to a [`SendResult`], the deadline, and the lookup.
//! The permission and connection cases run a private `nats-server` on a free port.

#[path = "../../sealpost/tests/common/teardown_nats.rs"]
mod teardown_nats;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sealpost_core::envelope::{Destination, EventId, PartitionAlgorithm, PAYLOAD_DOMAIN};
use sealpost_core::port::{Broker, NeverSentReason, RefusalKind, SendRequest, SendResult};
use sealpost_core::reconcile::Lookup;
use sealpost_core::Digest;
use sealpost_nats::{subject, Nats};

const CLUSTER: &str = "nats-local";

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

fn destination(cluster: &str, topic: &str) -> Destination {
    Destination {
        cluster: cluster.into(),
        topic: topic.into(),
        routing_key: "k".into(),
        partition_algorithm: PartitionAlgorithm::None,
        route_policy_generation: 1,
        serializer: "json.v1".into(),
        durability: "file".into(),
        required_ack: "stream".into(),
        ordering: sealpost_core::envelope::EventOrdering::Unordered,
    }
}

fn request(destination: &Destination, payload: &[u8]) -> SendRequest {
    SendRequest {
        event_id: EventId(*uuid::Uuid::now_v7().as_bytes()),
        member: 0,
        envelope_generation: 1,
        attempt_id: 1,
        payload_digest: Digest::of_bytes(PAYLOAD_DOMAIN, payload),
        destination: destination.clone(),
        destination_digest: destination.digest(),
        payload: payload.to_vec(),
        envelope: Default::default(),
        signature: None,
    }
}

fn later() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

/// The adapter, with stream `topic` made for the test: deleted when the guard drops (also
/// when the test fails).
async fn connect(topic: &str) -> (Nats, teardown_nats::Teardown) {
    let nats = Nats::connect(&nats_url(), CLUSTER, Duration::from_secs(2))
        .await
        .expect("NATS must be running");
    let guard = teardown_nats::stream(&nats_url(), topic);
    nats.ensure_stream(topic).await.expect("stream");
    (nats, guard)
}

/// A fresh stream name per test run.
fn topic(tag: &str) -> String {
    let r = uuid::Uuid::now_v7().as_u128() as u64 % 1_000_000;
    format!("A{tag}{r}")
}

async fn stream_messages(nats: &Nats, topic: &str) -> u64 {
    nats.js
        .get_stream(topic)
        .await
        .unwrap()
        .get_info()
        .await
        .unwrap()
        .state
        .messages
}

#[tokio::test]
async fn capabilities_declare_lookup_window_and_create_if_absent() {
    let t = topic("CAP");
    let (nats, _stream) = connect(&t).await;
    assert_eq!(nats.cluster(), CLUSTER);
    let c = nats.capabilities();
    assert!(c.lookup_by_event_id && c.create_if_absent && !c.per_key_ordering);
    assert_eq!(c.duplicate_window_ms, Some(120_000));
    let _ = nats.js.delete_stream(&t).await;
}

#[tokio::test]
async fn receipt_duplicate_already_stored_and_lookup() {
    let t = topic("RCP");
    let (nats, _stream) = connect(&t).await;
    let d = destination(CLUSTER, &t);
    let r = request(&d, b"{\"x\":1}");
    let first = match nats.send_batch(vec![r.clone()], later()).await.remove(0) {
        SendResult::Receipt(rec) => rec,
        other => panic!("{other:?}"),
    };
    assert!(first.sequence > 0 && !first.broker_duplicate);
    assert_eq!(
        (first.event_id, first.attempt_id, first.stream.as_str()),
        (r.event_id, r.attempt_id, t.as_str())
    );
    // A re-send inside the duplicate window: the original position, marked duplicate.
    let mut again = r.clone();
    again.attempt_id = 2;
    match nats.send_batch(vec![again], later()).await.remove(0) {
        SendResult::Receipt(rec) => {
            assert!(rec.broker_duplicate);
            assert_eq!(rec.sequence, first.sequence);
        }
        other => panic!("{other:?}"),
    }
    // A copy already on an event's subject (here published out of band, with another message
    // id): create-if-absent refuses a second one.
    let r2 = request(&d, b"{\"x\":2}");
    nats.js
        .publish(subject(&t, r2.event_id, 0), "rogue".into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(
        nats.send_batch(vec![r2.clone()], later()).await,
        vec![SendResult::AlreadyStored]
    );
    assert_eq!(stream_messages(&nats, &t).await, 2, "no second copy");
    // The lookup finds the first event with its headers, as a receipt.
    match nats.lookup(&d, r.event_id, 0).await {
        // Unjudged: the reader judges its seal (`sealpost_core::signature::judge_copy`).
        Lookup::Copies(c) => {
            assert_eq!(c.len(), 1, "{c:?}");
            let rec = c[0].receipt.clone();
            assert_eq!(rec.sequence, first.sequence);
            assert_eq!(rec.payload_digest, r.payload_digest);
            assert_eq!(rec.destination_digest, r.destination_digest);
        }
        other => panic!("{other:?}"),
    }
    // The out-of-band copy carries no Sealpost headers: not proof of anything.
    assert_eq!(nats.lookup(&d, r2.event_id, 0).await, Lookup::Unavailable);
    let absent = request(&d, b"{}");
    assert_eq!(nats.lookup(&d, absent.event_id, 0).await, Lookup::Absent);
    let _ = nats.js.delete_stream(&t).await;
}

/// Issue 23's forgery: someone who may publish copies a genuine message's headers onto an
/// event's subject, with that event's sealed payload digest in the digest header (it is no
/// secret: every consumer sees it) and a foreign payload. The lookup's receipt carries the
/// digest of the bytes stored, not the header's, so the reconciler cannot adopt the copy: at
/// this create-if-absent broker it becomes a conflict for an operator, never `PUBLISHED`
/// (before, the header's digest matched the sealed one and the copy was adopted).
#[tokio::test]
async fn a_forged_copy_with_matching_headers_is_never_adopted() {
    use sealpost_core::claim::ClaimToken;
    use sealpost_core::reconcile::{decide_reconcile, ReconcileDecision, ReconcilePolicy};
    use sealpost_core::row::{Attempt, AttemptStatus, Claim, EventRow};
    use sealpost_core::{QuarantineReason, State};

    let t = topic("FRG");
    let (nats, _stream) = connect(&t).await;
    let d = destination(CLUSTER, &t);
    // The genuine message of one event, sent: its headers are what a forger copies.
    let genuine = request(&d, b"{\"order\":\"o-1\"}");
    assert!(matches!(
        nats.send_batch(vec![genuine.clone()], later()).await[0],
        SendResult::Receipt(_)
    ));
    let stored = nats
        .js
        .get_stream(&t)
        .await
        .unwrap()
        .get_last_raw_message_by_subject(&subject(&t, genuine.event_id, 0))
        .await
        .unwrap();
    // The victim: another event, sealed but not yet stored (its send timed out, say).
    let victim = request(&d, b"{\"order\":\"o-2\",\"total_cents\":100}");
    let foreign = b"{\"order\":\"o-2\",\"total_cents\":999999}";
    let mut headers = stored.headers.clone();
    let forged_digest = Digest::of_bytes(PAYLOAD_DOMAIN, foreign);
    headers.insert(
        sealpost_nats::H_EVENT_ID,
        victim.event_id.to_string().as_str(),
    );
    headers.insert(
        sealpost_nats::H_PAYLOAD_DIGEST,
        victim.payload_digest.to_prefixed_hex().as_str(),
    );
    headers.insert(
        "Nats-Msg-Id",
        format!("{}:0:{}", victim.event_id, victim.attempt_id).as_str(),
    );
    nats.js
        .publish_with_headers(
            subject(&t, victim.event_id, 0),
            headers,
            foreign.to_vec().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let found = match nats.lookup(&d, victim.event_id, 0).await {
        Lookup::Copies(c) => c[0].receipt.clone(),
        other => panic!("the forged copy is found: {other:?}"),
    };
    assert_eq!(
        found.payload_digest, forged_digest,
        "the receipt carries the digest of the stored bytes"
    );
    assert_ne!(found.payload_digest, victim.payload_digest);
    // The reconciler's decision on the victim's row: a conflict, not an adoption.
    let mut row = EventRow::new_pending(victim.event_id, 0, victim.payload_digest, d.clone());
    row.state = State::Reconciling;
    row.claim_generation = 2;
    row.claim = Some(Claim {
        owner: 9,
        generation: 2,
        lease_until_ms: u64::MAX,
    });
    row.attempts.push(Attempt {
        id: found.attempt_id,
        attempt_generation: 1,
        claim_generation: 1,
        owner: 1,
        envelope_generation: 1,
        destination_digest: d.digest(),
        status: AttemptStatus::Unknown,
        started_at_ms: 0,
    });
    let token = ClaimToken {
        owner: 9,
        generation: 2,
    };
    let policy = ReconcilePolicy {
        create_if_absent: true,
        ..ReconcilePolicy::default()
    };
    assert_eq!(
        decide_reconcile(&row, token, &Lookup::Found(found), policy, 1),
        ReconcileDecision::Conflict(QuarantineReason::PayloadDigestMismatch)
    );
}

#[tokio::test]
async fn nothing_leaves_after_the_deadline_or_for_another_cluster_or_stream() {
    let t = topic("DL");
    let (nats, _stream) = connect(&t).await;
    let d = destination(CLUSTER, &t);
    let late = request(&d, b"{}");
    assert_eq!(
        nats.send_batch(vec![late.clone()], Instant::now()).await,
        vec![SendResult::NeverSent(NeverSentReason::DeadlinePassed)]
    );
    assert_eq!(nats.lookup(&d, late.event_id, 0).await, Lookup::Absent);
    assert_eq!(stream_messages(&nats, &t).await, 0, "nothing was sent");
    // Another cluster's destination: never sent, and the lookup cannot be asked here.
    let elsewhere = destination("other-cluster", &t);
    let r = request(&elsewhere, b"{}");
    match nats.send_batch(vec![r.clone()], later()).await.remove(0) {
        SendResult::NeverSent(NeverSentReason::WrongCluster(_)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(
        nats.lookup(&elsewhere, r.event_id, 0).await,
        Lookup::Unavailable
    );
    // No stream for the topic: the broker answers before storing anything.
    let missing = destination(CLUSTER, &format!("{t}NOSTREAM"));
    match nats
        .send_batch(vec![request(&missing, b"{}")], later())
        .await
        .remove(0)
    {
        SendResult::NeverSent(NeverSentReason::NoSuchDestination(_)) => {}
        other => panic!("{other:?}"),
    }
    // Over the server's max_payload: refused before sending, for good.
    let max = nats.client.server_info().max_payload;
    match nats
        .send_batch(vec![request(&d, &vec![b'x'; max + 1])], later())
        .await
        .remove(0)
    {
        SendResult::Refused {
            kind: RefusalKind::PayloadTooLarge,
            ..
        } => {}
        other => panic!("{other:?}"),
    }
    // One batch, results in order.
    let ok = request(&d, b"{}");
    let res = nats
        .send_batch(vec![ok, request(&elsewhere, b"{}")], later())
        .await;
    assert!(matches!(res[0], SendResult::Receipt(_)), "{res:?}");
    assert!(
        matches!(
            res[1],
            SendResult::NeverSent(NeverSentReason::WrongCluster(_))
        ),
        "{res:?}"
    );
    let _ = nats.js.delete_stream(&t).await;
}

/// A private nats-server with JetStream and a user who may not publish on `sp.DENIED.>`.
struct PrivateServer {
    child: Child,
    dir: std::path::PathBuf,
    url: String,
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn private_server() -> Option<PrivateServer> {
    let bin = "/usr/sbin/nats-server";
    if !std::path::Path::new(bin).exists() {
        eprintln!("skipped: no {bin}");
        return None;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("sealpost-nats-perm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("server.conf");
    std::fs::write(
        &conf,
        format!(
            r#"listen: "127.0.0.1:{port}"
jetstream {{ store_dir: "{}" }}
no_auth_user: "sp"
authorization {{
  users = [
    {{ user: "sp", password: "sp",
       permissions: {{ publish: {{ allow: [">"], deny: ["sp.DENIED.>"] }}, subscribe: {{ allow: [">"] }} }} }}
  ]
}}
"#,
            dir.join("js").display()
        ),
    )
    .unwrap();
    let child = Command::new(bin)
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn nats-server");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "private nats-server never listened"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(PrivateServer {
        child,
        dir,
        // `no_auth_user`: a client without credentials is the restricted user.
        url: format!("nats://127.0.0.1:{port}"),
    })
}

#[tokio::test]
async fn not_permitted_is_a_refusal_and_a_lost_connection_sends_nothing() {
    let Some(mut server) = private_server() else {
        return;
    };
    let nats = Nats::connect(&server.url, CLUSTER, Duration::from_secs(1))
        .await
        .expect("private server");
    nats.ensure_stream("DENIED").await.expect("stream");
    nats.ensure_stream("OPEN").await.expect("stream");
    let denied = destination(CLUSTER, "DENIED");
    match nats
        .send_batch(vec![request(&denied, b"{}")], later())
        .await
        .remove(0)
    {
        SendResult::Refused {
            kind: RefusalKind::NotPermitted,
            detail,
        } => assert!(
            detail.to_lowercase().contains("permissions violation"),
            "{detail}"
        ),
        other => panic!("{other:?}"),
    }
    let open = destination(CLUSTER, "OPEN");
    assert!(matches!(
        nats.send_batch(vec![request(&open, b"{}")], later())
            .await
            .remove(0),
        SendResult::Receipt(_)
    ));
    // The server goes away: nothing is handed to the client while it is disconnected.
    let _ = server.child.kill();
    let _ = server.child.wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    while nats.client.connection_state() == sealpost_nats::async_nats::connection::State::Connected
    {
        assert!(Instant::now() < deadline, "client never noticed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match nats
        .send_batch(vec![request(&open, b"{}")], later())
        .await
        .remove(0)
    {
        SendResult::NeverSent(NeverSentReason::NotConnected(_)) => {}
        other => panic!("{other:?}"),
    }
}

/// A message whose headers NATS cannot carry (a CR/LF in a header value made async-nats
/// panic and took the batch with it) is refused alone; its neighbours are published.
#[tokio::test]
async fn an_unencodable_message_is_refused_alone_and_its_batch_is_sent() {
    let t = topic("ENC");
    let (nats, _stream) = connect(&t).await;
    let d = destination(CLUSTER, &t);
    let mut reqs: Vec<SendRequest> = (0..4).map(|_| request(&d, b"{}")).collect();
    reqs[1].envelope.aggregate_id = "o-1\r\nX-Evil: 1".into();
    reqs[2].envelope.tenant = "t".repeat(300);
    let out = nats.send_batch(reqs, later()).await;
    assert!(matches!(out[0], SendResult::Receipt(_)), "{:?}", out[0]);
    assert!(matches!(out[3], SendResult::Receipt(_)), "{:?}", out[3]);
    for (o, field) in [(&out[1], "`aggregate_id`"), (&out[2], "`tenant`")] {
        match o {
            SendResult::Refused {
                kind: RefusalKind::Unencodable,
                detail,
            } => assert!(detail.contains(field), "{detail}"),
            other => panic!("expected an Unencodable refusal, got {other:?}"),
        }
    }
    assert_eq!(stream_messages(&nats, &t).await, 2);
    nats.js.delete_stream(&t).await.unwrap();
}

/// A well-formed signature header (the adapter never verifies one; the reader does).
fn seal_header() -> String {
    sealpost_core::signature::SignatureHeader {
        key_id: "k-1".into(),
        signature: [9; sealpost_core::signature::SIGNATURE_LEN],
    }
    .format()
}

/// A look-alike published on an event's subject (no expected-sequence header, so NATS takes
/// it), as an independent client would, with the genuine message's headers and a foreign
/// payload; under the event's `Nats-Msg-Id` when `same_msg_id` (NATS drops it as a duplicate
/// if the genuine message came first inside the window).
async fn publish_look_alike(
    nats: &Nats,
    topic: &str,
    of: &SendRequest,
    payload: &[u8],
    same_msg_id: bool,
) {
    let mut headers = sealpost_nats::async_nats::HeaderMap::new();
    for (k, v) in [
        (sealpost_nats::H_EVENT_ID, of.event_id.to_string()),
        (sealpost_nats::H_MEMBER, of.member.to_string()),
        (
            sealpost_nats::H_ENVELOPE_GENERATION,
            of.envelope_generation.to_string(),
        ),
        (sealpost_nats::H_ATTEMPT_ID, of.attempt_id.to_string()),
        (
            sealpost_nats::H_PAYLOAD_DIGEST,
            of.payload_digest.to_prefixed_hex(),
        ),
        (
            sealpost_nats::H_DESTINATION_DIGEST,
            of.destination_digest.to_prefixed_hex(),
        ),
    ] {
        headers.insert(k, v.as_str());
    }
    if same_msg_id {
        headers.insert("Nats-Msg-Id", of.event_id.to_string().as_str());
    }
    nats.js
        .publish_with_headers(
            subject(topic, of.event_id, 0),
            headers,
            payload.to_vec().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Simulator finding (issue 23): a look-alike published *after* the genuine copy must not
/// hide it. The lookup returns every copy on the subject, oldest first, and the reader's
/// judgement picks the sealed one.
#[tokio::test]
async fn a_look_alike_after_the_genuine_copy_does_not_hide_it() {
    let t = topic("SHD");
    let (nats, _stream) = connect(&t).await;
    let d = destination(CLUSTER, &t);
    let mut genuine = request(&d, b"{\"order\":\"o-1\"}");
    genuine.signature = Some(seal_header());
    let SendResult::Receipt(ack) = nats
        .send_batch(vec![genuine.clone()], later())
        .await
        .remove(0)
    else {
        panic!("genuine send")
    };
    // Under the event's id the broker drops it as a duplicate; under another id it is stored.
    for (payload, same_msg_id) in [
        (&b"{\"order\":\"o-1\",\"forged\":true}"[..], true),
        (b"{\"order\":\"o-1\",\"forged\":1}", false),
        (b"{\"order\":\"o-1\",\"forged\":2}", false),
    ] {
        publish_look_alike(&nats, &t, &genuine, payload, same_msg_id).await;
    }
    let Lookup::Copies(copies) = nats.lookup(&d, genuine.event_id, 0).await else {
        panic!("copies expected")
    };
    assert_eq!(copies.len(), 3, "every copy on the subject is read");
    assert_eq!(copies[0].receipt.sequence, ack.sequence, "oldest first");
    assert_eq!(copies[0].seal.signature, genuine.signature);
    // The reader admits only the genuine signature: the genuine copy is found, wherever the
    // look-alikes stand.
    let judged = sealpost_core::signature::judge_copy(
        Lookup::Copies(copies),
        sealpost_core::signature::SignaturePolicy::Require,
        |_, _, _| sealpost_core::signature::Crypto::Valid,
    );
    match judged {
        Lookup::Found(r) => {
            assert_eq!(r.sequence, ack.sequence);
            assert_eq!(r.payload_digest, genuine.payload_digest);
        }
        other => panic!("{other:?}"),
    }
}

/// Simulator finding (issue 23): a forger who publishes first under the event's
/// `Nats-Msg-Id` makes the genuine send a broker duplicate whose ACK names the forgery's
/// sequence. The adapter reads that message: not this one, so the send is "already stored"
/// (a lookup away), never a receipt. A genuine re-send within the window stays a receipt.
#[tokio::test]
async fn a_duplicate_ack_naming_a_look_alike_is_not_a_receipt() {
    let t = topic("DUP");
    let (nats, _stream) = connect(&t).await;
    let d = destination(CLUSTER, &t);
    let mut victim = request(&d, b"{\"order\":\"o-2\"}");
    victim.signature = Some(seal_header());
    publish_look_alike(
        &nats,
        &t,
        &victim,
        b"{\"order\":\"o-2\",\"total_cents\":1}",
        true,
    )
    .await;
    assert_eq!(
        nats.send_batch(vec![victim.clone()], later()).await,
        vec![SendResult::AlreadyStored],
        "a duplicate of the look-alike is no receipt of the genuine send"
    );
    // The genuine case: the same message sent twice inside the window.
    let mut ours = request(&d, b"{\"order\":\"o-3\"}");
    ours.signature = Some(seal_header());
    let SendResult::Receipt(first) = nats.send_batch(vec![ours.clone()], later()).await.remove(0)
    else {
        panic!("first send")
    };
    assert!(!first.broker_duplicate);
    let mut again = ours.clone();
    again.attempt_id = 2;
    match nats.send_batch(vec![again], later()).await.remove(0) {
        SendResult::Receipt(r) => {
            assert!(r.broker_duplicate);
            assert_eq!(r.sequence, first.sequence);
        }
        other => panic!("a genuine duplicate stays a receipt: {other:?}"),
    }
}
