//! What a producer's string may hold so that every broker can carry it: the rules `enqueue`
//! checks before anything is written, and the adapters check again before a message leaves
//! (a row written before these rules existed, or by hand, must be refused alone, never take
//! its batch down with it).
//!
//! The strings of an event (event type, aggregate type and id, tenant, payload schema name)
//! travel as message headers on every broker ([`crate::port::WireEnvelope`]) and the routing
//! key as the AMQP routing key and the Kafka record key. So one set of rules holds for every
//! broker, the strictest each one has:
//! * no control characters (Unicode `Cc`: U+0000–U+001F, U+007F–U+009F). NATS headers are
//!   lines (a CR or LF ends the header and the client refuses it), PostgreSQL `text` holds no
//!   NUL, and a terminal or a log line should not be steered by a producer;
//! * at most [`WIRE_STRING_BYTES_MAX`] bytes: an AMQP short string (routing key, exchange
//!   name) holds 255 bytes, and a header of 64 KiB per message is a mistake, not an
//!   identifier;
//! * the identifying strings are not empty;
//! * a routing key has no whitespace and no wildcard (`*`, `>`, `#`): a consumer binding to
//!   exactly that key in NATS or RabbitMQ could not name it.

/// Longest producer string, in bytes (an AMQP short string).
pub const WIRE_STRING_BYTES_MAX: usize = 255;

/// Which rule a string broke.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireRule {
    /// The string is empty and must not be.
    Empty,
    /// A control character (CR, LF, NUL, ESC, ...) at this byte offset.
    ControlCharacter {
        /// Byte offset of the character.
        at: usize,
        /// The character's code point.
        code: u32,
    },
    /// Longer than the limit.
    TooLong {
        /// Length in bytes.
        len: usize,
        /// Limit in bytes.
        max: usize,
    },
    /// Whitespace in a routing key.
    Whitespace {
        /// Byte offset of the character.
        at: usize,
    },
    /// A wildcard character in a routing key.
    Wildcard {
        /// The character.
        ch: char,
        /// Byte offset of the character.
        at: usize,
    },
}

/// A producer string that no broker could carry: which field, and which rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` {rule}")]
pub struct FieldError {
    /// The field's name (`aggregate_id`, `routing_key`, ...).
    pub field: &'static str,
    /// The rule it broke.
    pub rule: WireRule,
}

impl std::fmt::Display for WireRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireRule::Empty => write!(f, "is empty; it identifies the event and must be set"),
            WireRule::ControlCharacter { at, code } => write!(
                f,
                "contains the control character U+{code:04X} at byte {at}; producer strings travel as broker headers, where CR, LF, NUL and other control characters are not allowed: encode the value (e.g. percent-encoding) before enqueue"
            ),
            WireRule::TooLong { len, max } => write!(
                f,
                "is {len} bytes, more than the {max} bytes every broker carries (an AMQP short string); use a shorter identifier and put the rest in the payload"
            ),
            WireRule::Whitespace { at } => write!(
                f,
                "contains whitespace at byte {at}; a routing key is one token (consumers bind to it exactly)"
            ),
            WireRule::Wildcard { ch, at } => write!(
                f,
                "contains the wildcard `{ch}` at byte {at}; NATS and RabbitMQ bindings treat `*`, `>` and `#` as wildcards, so no consumer could bind to this key exactly"
            ),
        }
    }
}

/// What a field may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldKind {
    /// An identifier that must be set (event type, aggregate type and id, schema name).
    Required,
    /// May be empty (tenant of a single-tenant service).
    Optional,
    /// A routing key or topic: may be empty, one token, no wildcard.
    Key,
}

/// Checks one string against the rules of its kind.
pub fn check_field(field: &'static str, value: &str, kind: FieldKind) -> Result<(), FieldError> {
    let fail = |rule| Err(FieldError { field, rule });
    if kind == FieldKind::Required && value.is_empty() {
        return fail(WireRule::Empty);
    }
    if value.len() > WIRE_STRING_BYTES_MAX {
        return fail(WireRule::TooLong {
            len: value.len(),
            max: WIRE_STRING_BYTES_MAX,
        });
    }
    for (at, ch) in value.char_indices() {
        if ch.is_control() {
            return fail(WireRule::ControlCharacter {
                at,
                code: u32::from(ch),
            });
        }
        if kind == FieldKind::Key {
            if ch.is_whitespace() {
                return fail(WireRule::Whitespace { at });
            }
            if matches!(ch, '*' | '>' | '#') {
                return fail(WireRule::Wildcard { ch, at });
            }
        }
    }
    Ok(())
}

/// Checks every producer string of a new event and its routing key (what `enqueue` runs
/// before it writes anything).
pub fn check_new_event(
    ev: &crate::envelope::NewEvent<'_>,
    routing_key: &str,
) -> Result<(), FieldError> {
    check_field("event_type", ev.event_type, FieldKind::Required)?;
    check_field("aggregate_type", ev.aggregate_type, FieldKind::Required)?;
    check_field("aggregate_id", ev.aggregate_id, FieldKind::Required)?;
    check_field("payload_schema", ev.payload_schema, FieldKind::Required)?;
    check_field("tenant", ev.tenant, FieldKind::Optional)?;
    check_field("routing_key", routing_key, FieldKind::Key)
}

/// Checks the strings a message carries to the wire (what an adapter runs before it encodes
/// a message): the envelope's headers, the routing key and the topic. An empty header is
/// carried as it is (emptiness is a producer rule, checked at enqueue); what no wire can
/// carry is refused.
pub fn check_request(r: &crate::port::SendRequest) -> Result<(), FieldError> {
    let e = &r.envelope;
    check_field("event_type", &e.event_type, FieldKind::Optional)?;
    check_field("aggregate_type", &e.aggregate_type, FieldKind::Optional)?;
    check_field("aggregate_id", &e.aggregate_id, FieldKind::Optional)?;
    check_field("tenant", &e.tenant, FieldKind::Optional)?;
    check_field("routing_key", &r.destination.routing_key, FieldKind::Key)?;
    check_field("topic", &r.destination.topic, FieldKind::Required)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::NewEvent;

    fn event<'a>(aggregate_id: &'a str, event_type: &'a str, tenant: &'a str) -> NewEvent<'a> {
        NewEvent {
            aggregate_type: "order",
            aggregate_id,
            aggregate_version: 1,
            event_type,
            payload_schema: "order.created.v1",
            payload: b"{}",
            tenant,
            occurred_at_ms: 1,
            creating_txid: 0,
        }
    }

    /// The hostile strings of issue 20's measurement, each with the field and rule it breaks.
    #[test]
    fn hostile_producer_strings_are_refused_with_the_field_and_the_rule() {
        let long_tenant = "t".repeat(64 * 1024);
        let long_key = "k".repeat(300);
        let cases: Vec<(NewEvent<'_>, &str, &str, WireRule)> = vec![
            (
                event("o-1\r\n", "order.created.v1", "t-1"),
                "k",
                "aggregate_id",
                WireRule::ControlCharacter { at: 3, code: 0x0d },
            ),
            (
                event("o-1", "order.created\n", "t-1"),
                "k",
                "event_type",
                WireRule::ControlCharacter { at: 13, code: 0x0a },
            ),
            (
                event("o-\u{7}\u{1b}[31m", "order.created.v1", "t-1"),
                "k",
                "aggregate_id",
                WireRule::ControlCharacter { at: 2, code: 0x07 },
            ),
            (
                event("o-1", "order.created.v1", "t-1"),
                &long_key,
                "routing_key",
                WireRule::TooLong { len: 300, max: 255 },
            ),
            (
                event("o-1", "order.created.v1", &long_tenant),
                "k",
                "tenant",
                WireRule::TooLong {
                    len: 65_536,
                    max: 255,
                },
            ),
            (
                event("", "order.created.v1", "t-1"),
                "k",
                "aggregate_id",
                WireRule::Empty,
            ),
            (
                event("o-1", "order.created.v1", "t-1"),
                "a b",
                "routing_key",
                WireRule::Whitespace { at: 1 },
            ),
            (
                event("o-1", "order.created.v1", "t-1"),
                "orders.*",
                "routing_key",
                WireRule::Wildcard { ch: '*', at: 7 },
            ),
            (
                event("o-1", "order.created.v1", "t-1"),
                "orders.>",
                "routing_key",
                WireRule::Wildcard { ch: '>', at: 7 },
            ),
            (
                event("o-1", "order.created.v1", "t\0"),
                "k",
                "tenant",
                WireRule::ControlCharacter { at: 1, code: 0 },
            ),
            (
                event("o-1", "order.created.v1", "t-1\u{85}"),
                "k",
                "tenant",
                WireRule::ControlCharacter { at: 3, code: 0x85 },
            ),
        ];
        for (ev, key, field, rule) in cases {
            assert_eq!(
                check_new_event(&ev, key),
                Err(FieldError { field, rule }),
                "{field}"
            );
        }
    }

    #[test]
    fn ordinary_strings_pass_unicode_included() {
        for (ev, key) in [
            (event("o-42", "order.created.v1", "t-1"), "t-1.order.o-42"),
            (event("bestellung-ä-東京", "order.created.v1", ""), ""),
            (
                event(&"a".repeat(255), "order.created.v1", &"t".repeat(255)),
                &"k".repeat(255) as &str,
            ),
        ] {
            assert_eq!(check_new_event(&ev, key), Ok(()));
        }
    }

    #[test]
    fn the_message_names_the_field_the_character_and_what_to_do() {
        let e = check_new_event(&event("o\n", "t", "x"), "k").unwrap_err();
        let m = e.to_string();
        assert!(m.starts_with("`aggregate_id` contains the control character U+000A at byte 1"));
        assert!(m.contains("encode the value"), "{m}");
    }
}
