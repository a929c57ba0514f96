#!/usr/bin/env python3
"""Independent reference implementation of Sealpost's canonical encoding (docs/encoding.md).

Prints the fixed vectors that `crates/sealpost-core/src/envelope.rs` asserts. Two
implementations agreeing byte for byte is the point: run `python3 docs/encoding_reference.py`
and compare with the Rust test.
"""
import hashlib
import struct


def canonical(domain, fields):
    h = hashlib.sha256()
    h.update(domain.encode() + b"\0")
    last = 0
    for tag, value in fields:
        assert tag > last
        last = tag
        if isinstance(value, int):
            value = struct.pack(">Q", value)
        elif isinstance(value, str):
            value = value.encode()
        h.update(bytes([tag]) + struct.pack(">I", len(value)) + value)
    return h.digest()


def destination(cluster, topic, key, alg, gen, ser, dur, ack):
    return canonical("sealpost.destination.v1", [
        (1, cluster), (2, topic), (3, key), (4, alg), (5, gen), (6, ser), (7, dur), (8, ack)])


dest = destination("nats-local", "ORDERS", "tenant-7.order.o-42", "none", 19, "json.v1", "file", "stream")
payload = b'{"order":"o-42","total_cents":1999}'
pd = canonical("sealpost.payload.v1", [(1, payload)])
sd = canonical("sealpost.schema.v1", [(1, b"order.created.v1")])
event_id = bytes.fromhex("019000000000" "7fff" "bfff" "ffffffffffff")
env = canonical("sealpost.envelope.v1", [
    (1, event_id), (2, 1), (3, "order"), (4, "o-42"), (5, 17), (6, "order.created.v1"),
    (7, sd), (8, pd), (9, "tenant-7"), (10, 1_700_000_000_000), (11, 4242), (12, dest)])
print("destination", dest.hex())
print("payload    ", pd.hex())
print("envelope   ", env.hex())
# The signed claim of that event's first copy (member 0): what a dispatcher's Ed25519
# signature covers (crates/sealpost-core/src/signature.rs, "Signed envelopes" above).
claim = canonical("sealpost.signature.v1", [
    (1, event_id), (2, 0), (3, 1), (4, pd), (5, dest), (6, "order.created.v1"), (7, "order"),
    (8, "o-42"), (9, 17), (10, 1_700_000_000_000), (11, "tenant-7"), (12, sd)])
print("signature  ", claim.hex())
