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
    if !std::path::Path::new(NATS_SERVER).exists() {
        eprintln!("skipped: no {NATS_SERVER}");
        return None;
    }
    Some(start_server(
        |port, store| {
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
                store.display()
            )
        },
        &[],
    ))
}

const NATS_SERVER: &str = "/usr/sbin/nats-server";

/// Starts `nats-server` on a free port with the configuration `config(port, store_dir)` and
/// the environment `env`, in a directory of its own (removed when it drops); waits until it
/// listens.
fn start_server(
    config: impl FnOnce(u16, &std::path::Path) -> String,
    env: &[(&str, &str)],
) -> PrivateServer {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir =
        std::env::temp_dir().join(format!("sealpost-nats-perm-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("server.conf");
    std::fs::write(&conf, config(port, &dir.join("js"))).unwrap();
    let child = Command::new(NATS_SERVER)
        .arg("-c")
        .arg(&conf)
        .envs(env.iter().copied())
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
    PrivateServer {
        child,
        dir,
        url: format!("nats://127.0.0.1:{port}"),
    }
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

// Broker rights (docs/security.md): a private server runs the users and permissions of
// docs/nats-permissions.conf, read from that file (the template is what is tested), and each
// forbidden action is refused by the server.

/// The passwords the template reads from the server's environment.
const RIGHTS_USERS: [(&str, &str); 3] = [
    ("admin", "SEALPOST_NATS_ADMIN_PASSWORD"),
    ("dispatcher", "SEALPOST_NATS_DISPATCHER_PASSWORD"),
    ("fulfilment", "SEALPOST_NATS_FULFILMENT_PASSWORD"),
];

/// A private server with docs/nats-permissions.conf and a password per user (`pw-<user>`).
fn rights_server() -> PrivateServer {
    // .ci/run starts this very binary: without it these tests fail, they do not skip.
    assert!(
        std::path::Path::new(NATS_SERVER).exists(),
        "no {NATS_SERVER}: the broker rights tests run a private nats-server"
    );
    let template = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/nats-permissions.conf"
    ))
    .expect("docs/nats-permissions.conf");
    let env: Vec<(String, String)> = RIGHTS_USERS
        .iter()
        .map(|(user, var)| (var.to_string(), format!("pw-{user}")))
        .collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    start_server(
        |port, store| {
            format!(
                "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: \"{}\" }}\n{template}",
                store.display()
            )
        },
        &env,
    )
}

/// The adapter, connected as `user` of the template (its password from a file, as
/// `nats.security.password_file` would give it).
async fn rights_connect(server: &PrivateServer, user: &str) -> Nats {
    let file = server.dir.join(format!("{user}.password"));
    std::fs::write(&file, format!("pw-{user}\n")).unwrap();
    let options = sealpost_nats::NatsOptions {
        user: Some(user.into()),
        password_file: Some(file),
        ..Default::default()
    };
    Nats::connect_with(&server.url, CLUSTER, Duration::from_secs(1), &options)
        .await
        .unwrap_or_else(|e| panic!("connect as {user}: {e}"))
}

/// A plain client as `user`, independent of the adapter, with the server errors it was sent.
struct Witness {
    js: sealpost_nats::async_nats::jetstream::Context,
    errors: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Witness {
    async fn connect(server: &PrivateServer, user: &str) -> Witness {
        use sealpost_nats::async_nats;
        let errors: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
        let seen = errors.clone();
        let client =
            async_nats::ConnectOptions::with_user_and_password(user.into(), format!("pw-{user}"))
                .event_callback(move |event| {
                    let seen = seen.clone();
                    async move {
                        if let async_nats::Event::ServerError(e) = event {
                            seen.lock().unwrap().push(e.to_string());
                        }
                    }
                })
                .connect(server.url.as_str())
                .await
                .unwrap_or_else(|e| panic!("connect as {user}: {e}"));
        let js = async_nats::jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(1))
            .build(client);
        Witness { js, errors }
    }

    /// Asserts that the server refused a publish on `subject` with a permissions violation
    /// (its `-ERR` comes before the request's timeout; the callback may run a moment later).
    async fn assert_refused(&self, subject: &str) {
        for _ in 0..100 {
            let errors = self.errors.lock().unwrap().clone();
            if errors.iter().any(|e| {
                e.to_lowercase()
                    .contains("permissions violation for publish")
                    && e.contains(&format!("\"{subject}\""))
            }) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "the server did not refuse `{subject}`; it said {:?}",
            self.errors.lock().unwrap()
        );
    }
}

/// Messages in stream `name` and its max age, as the administrator sees them.
async fn admin_view(admin: &Nats, name: &str) -> (u64, Duration) {
    let info = admin
        .js
        .get_stream(name)
        .await
        .expect("the stream exists")
        .get_info()
        .await
        .unwrap();
    (info.state.messages, info.config.max_age)
}

#[tokio::test]
async fn rights_a_dispatcher_publishes_and_looks_up_but_may_not_create_change_purge_or_delete_a_stream(
) {
    let server = rights_server();
    let admin = rights_connect(&server, "admin").await;
    admin
        .ensure_stream("ORDERS")
        .await
        .expect("the admin creates the stream");
    let dispatcher = rights_connect(&server, "dispatcher").await;

    // What it is for: publish an event and look it up.
    let d = destination(CLUSTER, "ORDERS");
    let r = request(&d, b"{\"order\":1}");
    let receipt = match dispatcher
        .send_batch(vec![r.clone()], later())
        .await
        .remove(0)
    {
        SendResult::Receipt(rc) => rc,
        other => panic!("the dispatcher may publish on sp.ORDERS.>: {other:?}"),
    };
    match dispatcher.lookup(&d, r.event_id, 0).await {
        Lookup::Copies(c) => assert_eq!(c[0].receipt.sequence, receipt.sequence),
        other => panic!("the dispatcher may look the event up: {other:?}"),
    }
    assert!(matches!(
        dispatcher.lookup(&d, EventId([7; 16]), 0).await,
        Lookup::Absent
    ));

    // Creating a stream is an administrator's: a clear error naming the subject to grant.
    let e = dispatcher
        .ensure_stream("INVOICES")
        .await
        .expect_err("the dispatcher may not create a stream")
        .to_string();
    assert!(e.contains("may not create stream `INVOICES`"), "{e}");
    assert!(e.contains("$JS.API.STREAM.CREATE.INVOICES"), "{e}");
    assert!(e.contains("docs/security.md"), "{e}");
    assert!(
        admin.js.get_stream("INVOICES").await.is_err(),
        "no stream was created"
    );

    // Change retention, purge, delete: each refused by the server, and nothing changed.
    let before = admin_view(&admin, "ORDERS").await;
    assert_eq!(before, (1, Duration::ZERO));
    let w = Witness::connect(&server, "dispatcher").await;
    let mut config = admin
        .js
        .get_stream("ORDERS")
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    config.max_age = Duration::from_secs(1);
    assert!(w.js.update_stream(config).await.is_err());
    w.assert_refused("$JS.API.STREAM.UPDATE.ORDERS").await;
    let stream =
        w.js.get_stream("ORDERS")
            .await
            .expect("stream info is allowed");
    assert!(stream.purge().await.is_err());
    w.assert_refused("$JS.API.STREAM.PURGE.ORDERS").await;
    assert!(w.js.delete_stream("ORDERS").await.is_err());
    w.assert_refused("$JS.API.STREAM.DELETE.ORDERS").await;
    assert!(w
        .js
        .get_stream("ORDERS")
        .await
        .unwrap()
        .delete_message(receipt.sequence)
        .await
        .is_err());
    w.assert_refused("$JS.API.STREAM.MSG.DELETE.ORDERS").await;
    assert_eq!(admin_view(&admin, "ORDERS").await, before);
}

#[tokio::test]
async fn rights_a_consumer_consumes_its_own_consumer_but_may_not_publish_an_event_or_purge() {
    use sealpost_core::subscription::{FetchLimits, Settlement, Subscription};
    use sealpost_nats::NatsSubscription;

    let server = rights_server();
    let admin = rights_connect(&server, "admin").await;
    admin
        .ensure_stream("ORDERS")
        .await
        .expect("the admin creates the stream");
    let dispatcher = rights_connect(&server, "dispatcher").await;
    let d = destination(CLUSTER, "ORDERS");
    let sent: Vec<SendRequest> = (0..2)
        .map(|i| request(&d, format!("{{\"n\":{i}}}").as_bytes()))
        .collect();
    for o in dispatcher.send_batch(sent.clone(), later()).await {
        assert!(matches!(o, SendResult::Receipt(_)), "{o:?}");
    }

    // Its own durable consumer, through Sealpost's subscription: created, read, acked.
    let consumer = rights_connect(&server, "fulfilment").await;
    let mut sub =
        NatsSubscription::subscribe(&consumer, "ORDERS", "fulfilment", Duration::from_secs(30))
            .await
            .expect("the consumer may open its own consumer");
    let mut got = Vec::new();
    for _ in 0..20 {
        got.extend(
            sub.fetch(FetchLimits {
                messages_max: 10,
                bytes_max: 1 << 20,
                wait_ms: 500,
            })
            .await
            .expect("fetch"),
        );
        if got.len() >= sent.len() {
            break;
        }
    }
    let ids: Vec<EventId> = got
        .iter()
        .map(|m| sub.read(m).headers.expect("Sealpost headers").event_id)
        .collect();
    assert_eq!(ids, sent.iter().map(|r| r.event_id).collect::<Vec<_>>());
    sub.settle(got.into_iter().map(|m| (m, Settlement::Ack)).collect())
        .await
        .unwrap();
    let mut floor = 0;
    for _ in 0..100 {
        floor = sub.watermarks().await.expect("consumer info is allowed")[0].1;
        if floor == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(floor, 2, "both acks reached the server");

    // Another consumer's durable: a clear error naming the subject.
    let e =
        match NatsSubscription::subscribe(&consumer, "ORDERS", "billing", Duration::from_secs(30))
            .await
        {
            Ok(_) => panic!("the consumer may not open another consumer"),
            Err(e) => e.to_string(),
        };
    assert!(e.contains("may not open consumer `billing`"), "{e}");
    assert!(e.contains("$JS.API.CONSUMER.INFO.ORDERS.billing"), "{e}");

    // It cannot forge an upstream event: the publish is refused, and Sealpost's adapter says
    // NotPermitted (a refusal, never retried).
    let forged = request(&d, b"{\"forged\":true}");
    match consumer
        .send_batch(vec![forged.clone()], later())
        .await
        .remove(0)
    {
        SendResult::Refused {
            kind: RefusalKind::NotPermitted,
            detail,
        } => {
            assert!(
                detail.to_lowercase().contains("permissions violation"),
                "{detail}"
            );
            assert!(
                detail.contains(&subject("ORDERS", forged.event_id, 0)),
                "{detail}"
            );
            assert!(detail.contains("docs/security.md"), "{detail}");
        }
        other => panic!("a consumer's publish must be refused: {other:?}"),
    }
    let w = Witness::connect(&server, "fulfilment").await;
    let sp = subject("ORDERS", EventId([9; 16]), 0);
    assert!(w
        .js
        .publish(sp.clone(), "{}".into())
        .await
        .unwrap()
        .await
        .is_err());
    w.assert_refused(&sp).await;

    // Nor purge or delete the stream, nor delete its consumer.
    let stream =
        w.js.get_stream("ORDERS")
            .await
            .expect("stream info is allowed");
    assert!(stream.purge().await.is_err());
    w.assert_refused("$JS.API.STREAM.PURGE.ORDERS").await;
    assert!(w.js.delete_stream("ORDERS").await.is_err());
    w.assert_refused("$JS.API.STREAM.DELETE.ORDERS").await;
    assert!(stream.delete_consumer("fulfilment").await.is_err());
    w.assert_refused("$JS.API.CONSUMER.DELETE.ORDERS.fulfilment")
        .await;
    assert_eq!(
        admin_view(&admin, "ORDERS").await.0,
        2,
        "nothing forged, nothing purged"
    );
    let admin_stream = admin.js.get_stream("ORDERS").await.unwrap();
    assert!(
        admin_stream.consumer_info("fulfilment").await.is_ok(),
        "the consumer is still there"
    );
}

/// The subscription requests the next batch while the caller applies the last one. Across
/// batches the stream's order holds; a subscription reopened while a batch it requested
/// ahead is in the client loses none of it: those messages come back after the ack wait
/// (delivered a second time), and every message is taken in the end.
#[tokio::test]
async fn a_batch_requested_ahead_keeps_order_and_a_reopen_loses_none_of_it() {
    use sealpost_core::subscription::{FetchLimits, Settlement, Subscription};
    use sealpost_nats::NatsSubscription;

    let topic = topic("AHEAD");
    let (nats, _guard) = connect(&topic).await;
    let d = destination(CLUSTER, &topic);
    let sent: Vec<SendRequest> = (0..60)
        .map(|i| request(&d, format!("{{\"n\":{i}}}").as_bytes()))
        .collect();
    for o in nats.send_batch(sent.clone(), later()).await {
        assert!(matches!(o, SendResult::Receipt(_)), "{o:?}");
    }
    let limits = FetchLimits {
        messages_max: 10,
        bytes_max: 1 << 20,
        wait_ms: 500,
    };
    let mut sub = NatsSubscription::subscribe(&nats, &topic, "ahead", Duration::from_secs(1))
        .await
        .expect("subscribe");

    // Three batches in a row: the first 30 messages in the stream's order.
    let mut taken = Vec::new();
    while taken.len() < 30 {
        let batch = sub.fetch(limits).await.expect("fetch");
        assert!(!batch.is_empty(), "the stream holds 60 messages");
        let seqs: Vec<u64> = batch.iter().map(|m| sub.read(m).sequence).collect();
        taken.extend(seqs);
        sub.settle(batch.into_iter().map(|m| (m, Settlement::Ack)).collect())
            .await
            .unwrap();
    }
    assert_eq!(
        taken,
        (1..=30).collect::<Vec<u64>>(),
        "in the stream's order"
    );

    // The batch requested ahead (31..=40) reaches the client, and the reopen drops it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sub.reconnect().await.expect("reopen");
    let mut redelivered = 0;
    let until = Instant::now() + Duration::from_secs(30);
    while taken.len() < 60 && Instant::now() < until {
        let batch = sub.fetch(limits).await.expect("fetch");
        for m in &batch {
            let r = sub.read(m);
            if r.delivered > 1 {
                redelivered += 1;
            }
            if !taken.contains(&r.sequence) {
                taken.push(r.sequence);
            }
        }
        sub.settle(batch.into_iter().map(|m| (m, Settlement::Ack)).collect())
            .await
            .unwrap();
    }
    taken.sort_unstable();
    assert_eq!(taken, (1..=60).collect::<Vec<u64>>(), "every message taken");
    assert!(
        redelivered >= 1,
        "what the request ahead held came back after the ack wait"
    );
}
