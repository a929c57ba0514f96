//! Contracts (R26): the payload schemas of each event type, registered in the outbox
//! database, evolved without breaking readers.
//!
//! An integration event is a projection with a contract, not a serialized domain object. A
//! contract here is an **Avro schema** (a record) per event type and version, with the
//! meaning of each field written beside its type: a field may carry a `"contract"` object
//! with `unit`, `time_zone`, `null_meaning`, `unique`, `ordering_key` and `delete`. A field
//! whose type allows `null` must say what null means; a `local-timestamp-*` field must name
//! its time zone.
//!
//! Registering a version ([`register`], `sealpost schema register`) checks it against **every**
//! registered version of its event type, in both directions: *new readers of history* (the
//! new schema reading what each older one wrote) and *old readers of new events* (each older
//! schema reading what the new one writes). The verdict on types is the Avro specification's
//! schema resolution as the `apache-avro` crate implements it (a reader's default fills a
//! missing field, an enum's default takes an unknown symbol, `int` widens to `long`); on top
//! of it the check names the rule a change broke and refuses what Avro would let through
//! silently:
//!
//! | rule | example | who breaks |
//! |---|---|---|
//! | `rename` | `amount` removed and `total` (same type) added | both: the value is lost to each side |
//! | `removed-field-without-default` | `currency` (no default) removed | old readers of new events |
//! | `added-field-without-default` | `channel` (no default) added | new readers of history |
//! | `narrowing` | `long` → `int`, nullable → required | new readers of history |
//! | `widening` | `int` → `long`, required → nullable | old readers of new events |
//! | `enum-symbol-without-default` | symbol `REFUNDED` added, old readers' enum has no default | old readers of new events |
//! | `enum-symbol-removed` | symbol removed, the new enum has no default | new readers of history |
//! | `unit-changed`, `time-zone-changed`, `null-meaning-changed`, `unique-changed`, `ordering-key-changed`, `delete-changed` | cents → euros in the same `long` | every reader: same bytes, another meaning |
//! | `incompatible` | anything else Avro's resolution refuses | as Avro says |
//!
//! A rename migrates through a new field written and read in parallel over a deprecation
//! window: add the new field with a default, move readers, then remove the old one (with its
//! default) in a later version.
//!
//! A route opts in (`sealpost migrate --route ... --contracts required`): `enqueue` then
//! refuses an event whose `payload_schema` is not `EVENT_TYPE@VERSION` of a registered version
//! of its own event type, or whose payload is not one Avro datum of that schema (binary
//! encoding, no header). A consumer reads any version into its own with a [`Reader`].
//!
//! This module is pure: the registry in the outbox database (`sealpost::contract`), `enqueue`'s
//! check and the simulator's registrar and consumers decide with these same functions.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use crate::encoding::Digest;
use crate::envelope::{NewEvent, SCHEMA_DOMAIN};
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::schema::{EnumSchema, RecordField, RecordSchema};
use apache_avro::schema_compatibility::{Compatibility, SchemaCompatibility};
use apache_avro::types::Value;
use apache_avro::writer::datum::GenericDatumWriter;
use apache_avro::Schema;

/// The Avro crate this module speaks (its `types::Value` is what [`Reader::read`] returns and
/// [`SchemaVersion::encode`] takes), re-exported so a service uses the same version.
pub use apache_avro;

/// The field attribute that holds a field's contract annotations.
pub const ANNOTATION: &str = "contract";

/// The annotations a field's `"contract"` object may hold.
pub const ANNOTATION_KEYS: [&str; 6] = [
    "unit",
    "time_zone",
    "null_meaning",
    "unique",
    "ordering_key",
    "delete",
];

/// Domain of a registered schema text's fingerprint.
const FINGERPRINT_DOMAIN: &str = "sealpost.contract.v1";

/// Why a schema, a registration, a payload or a read was refused.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    /// The text is not an Avro record schema.
    #[error("the schema for `{event_type}` is not a valid Avro record schema: {reason}")]
    Parse {
        /// Event type.
        event_type: String,
        /// Why.
        reason: String,
    },
    /// A field's contract annotations are missing or malformed.
    #[error("the schema for `{event_type}`, field `{field}`: {reason}")]
    Annotation {
        /// Event type.
        event_type: String,
        /// Dotted path of the field.
        field: String,
        /// What is wrong and what to write.
        reason: String,
    },
    /// The version breaks readers of registered versions; nothing was registered.
    #[error("{} breaking change(s) for `{event_type}`, nothing registered:\n{}", breaches.len(), breaches.iter().map(|b| format!("  {b}")).collect::<Vec<_>>().join("\n"))]
    Breaking {
        /// Event type.
        event_type: String,
        /// Every rule broken, against which version, in which direction.
        breaches: Vec<Breach>,
    },
    /// No such version is registered.
    #[error("no version {version} of `{event_type}` is registered; list them with `sealpost schema list --event-type {event_type}`")]
    NotRegistered {
        /// Event type.
        event_type: String,
        /// Version asked for.
        version: u32,
    },
    /// No version of the payload's schema is known to this reader.
    #[error("payload schema digest {digest} is not a registered version of `{event_type}` known to this reader; reload the reader (`sealpost::contract::load_reader`) after registering a version")]
    UnknownWriter {
        /// Event type.
        event_type: String,
        /// The delivery's schema digest.
        digest: String,
    },
    /// A `payload_schema` that is not `EVENT_TYPE@VERSION`.
    #[error("payload_schema `{0}` is not `EVENT_TYPE@VERSION` (e.g. `order.created@2`); the route checks contracts, so name a registered version")]
    BadId(String),
    /// The payload is not one datum of its schema.
    #[error("the payload does not match `{id}`: {reason}")]
    Payload {
        /// Schema id.
        id: String,
        /// Avro's words.
        reason: String,
    },
    /// A registered version fails to parse (edited behind the registry's back?).
    #[error("registered schema `{id}` does not parse: {reason}")]
    Corrupt {
        /// Schema id.
        id: String,
        /// Why.
        reason: String,
    },
}

/// A rule a schema change broke (see the module documentation's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rule {
    /// A field removed and another of the same type added.
    Rename,
    /// A field without default removed.
    RemovedFieldWithoutDefault,
    /// A field without default added.
    AddedFieldWithoutDefault,
    /// A type that cannot hold every value the old one held.
    Narrowing,
    /// A type the old readers cannot read.
    Widening,
    /// An enum symbol added where the old readers' enum has no default.
    EnumSymbolWithoutDefault,
    /// An enum symbol removed where the new enum has no default.
    EnumSymbolRemoved,
    /// A field's `unit` changed.
    UnitChanged,
    /// A field's `time_zone` changed.
    TimeZoneChanged,
    /// A field's `null_meaning` changed.
    NullMeaningChanged,
    /// A field's `unique` changed.
    UniqueChanged,
    /// A field's `ordering_key` changed.
    OrderingKeyChanged,
    /// A field's `delete` semantics changed.
    DeleteChanged,
    /// Anything else Avro's schema resolution refuses.
    Incompatible,
}

impl Rule {
    /// The rule's name, as printed.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Rename => "rename",
            Rule::RemovedFieldWithoutDefault => "removed-field-without-default",
            Rule::AddedFieldWithoutDefault => "added-field-without-default",
            Rule::Narrowing => "narrowing",
            Rule::Widening => "widening",
            Rule::EnumSymbolWithoutDefault => "enum-symbol-without-default",
            Rule::EnumSymbolRemoved => "enum-symbol-removed",
            Rule::UnitChanged => "unit-changed",
            Rule::TimeZoneChanged => "time-zone-changed",
            Rule::NullMeaningChanged => "null-meaning-changed",
            Rule::UniqueChanged => "unique-changed",
            Rule::OrderingKeyChanged => "ordering-key-changed",
            Rule::DeleteChanged => "delete-changed",
            Rule::Incompatible => "incompatible",
        }
    }

    /// What to do instead.
    pub fn advice(self) -> &'static str {
        match self {
            Rule::Rename => "add the new field with a default, write both over a deprecation window, and remove the old one (with a default) in a later version",
            Rule::RemovedFieldWithoutDefault => "give the field a default in a version first, so old readers fill it in, then remove it",
            Rule::AddedFieldWithoutDefault => "give the new field a default, so new readers of history fill it in",
            Rule::Narrowing => "keep the wider type, or add a new field of the narrower type beside it",
            Rule::Widening => "add a new field of the wider type beside the old one, written in parallel",
            Rule::EnumSymbolWithoutDefault => "give the enum a default (the readers' unknown branch) in a version that readers take up before the new symbol is added",
            Rule::EnumSymbolRemoved => "keep the symbol, or give the enum a default for history's values",
            Rule::UnitChanged | Rule::TimeZoneChanged | Rule::NullMeaningChanged | Rule::UniqueChanged | Rule::OrderingKeyChanged | Rule::DeleteChanged => "the bytes stay readable but mean something else: add a new field with the new meaning and write both over a deprecation window",
            Rule::Incompatible => "make the change as an added field with a default",
        }
    }

    fn of_annotation(key: &str) -> Rule {
        match key {
            "unit" => Rule::UnitChanged,
            "time_zone" => Rule::TimeZoneChanged,
            "null_meaning" => Rule::NullMeaningChanged,
            "unique" => Rule::UniqueChanged,
            "ordering_key" => Rule::OrderingKeyChanged,
            _ => Rule::DeleteChanged,
        }
    }
}

/// Who a breach breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The new schema cannot read what a registered version wrote.
    NewReadersOfHistory,
    /// A registered version cannot read what the new schema writes.
    OldReadersOfNewEvents,
    /// Both.
    Both,
    /// Every reader reads the bytes and misreads them.
    Meaning,
}

impl Direction {
    fn words(self) -> &'static str {
        match self {
            Direction::NewReadersOfHistory => "new readers of history",
            Direction::OldReadersOfNewEvents => "old readers of new events",
            Direction::Both => "new readers of history and old readers of new events",
            Direction::Meaning => "every reader, silently",
        }
    }

    fn covers(self, other: Direction) -> bool {
        self == other || self == Direction::Both
    }
}

/// One broken rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breach {
    /// The rule.
    pub rule: Rule,
    /// Dotted path of the field (empty for the record itself).
    pub field: String,
    /// The registered version it breaks against.
    pub against: u32,
    /// Who it breaks.
    pub direction: Direction,
    /// What changed.
    pub detail: String,
}

impl fmt::Display for Breach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} (against version {}; breaks {}); {}",
            self.rule.name(),
            self.detail,
            self.against,
            self.direction.words(),
            self.rule.advice()
        )
    }
}

/// A schema version: registered, or a candidate (`version` 0).
#[derive(Clone, Debug)]
pub struct SchemaVersion {
    /// Event type.
    pub event_type: String,
    /// Version (1, 2, ...; 0 for a candidate not registered yet).
    pub version: u32,
    /// The schema text as registered (normalized JSON).
    pub text: String,
    /// Fingerprint of `text`.
    pub fingerprint: Digest,
    schema: Arc<Schema>,
}

impl SchemaVersion {
    /// The id producers put in `NewEvent::payload_schema`: `EVENT_TYPE@VERSION`.
    pub fn id(&self) -> String {
        schema_id(&self.event_type, self.version)
    }

    /// The digest the sealed envelope carries for this version (`payload_schema_digest`).
    pub fn digest(&self) -> Digest {
        Digest::of_bytes(SCHEMA_DOMAIN, self.id().as_bytes())
    }

    /// The parsed Avro schema.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// Annotation `key` (one of [`ANNOTATION_KEYS`]) of the record's field `field`, if the
    /// field has it: what a reader takes the field's values to mean (e.g. its `unit`).
    pub fn annotation(&self, field: &str, key: &str) -> Option<&serde_json::Value> {
        let f = record_of(&self.schema)?
            .fields
            .iter()
            .find(|f| f.name == field)?;
        f.custom_attributes.get(ANNOTATION)?.as_object()?.get(key)
    }

    /// Encodes `value` as one Avro datum of this schema (what `enqueue` expects), resolved
    /// against the schema first (a string names an enum symbol, a plain value picks its
    /// union branch, a missing field takes its default).
    pub fn encode(&self, value: Value) -> Result<Vec<u8>, ContractError> {
        let fail = |e: apache_avro::Error| ContractError::Payload {
            id: self.id(),
            reason: e.to_string(),
        };
        let value = value.resolve(&self.schema).map_err(fail)?;
        let writer = GenericDatumWriter::builder(&self.schema)
            .build()
            .map_err(fail)?;
        let mut out = Vec::new();
        writer.write_value(&mut out, value).map_err(fail)?;
        Ok(out)
    }

    /// Encodes a serde value (a struct whose fields match the schema's) as one datum.
    pub fn encode_serde<T: serde::Serialize>(&self, value: &T) -> Result<Vec<u8>, ContractError> {
        let v = apache_avro::to_value(value).map_err(|e| ContractError::Payload {
            id: self.id(),
            reason: e.to_string(),
        })?;
        self.encode(v)
    }

    /// Checks that `payload` is exactly one datum of this schema.
    pub fn validate(&self, payload: &[u8]) -> Result<(), ContractError> {
        decode(&self.schema, None, payload)
            .map(|_| ())
            .map_err(|reason| ContractError::Payload {
                id: self.id(),
                reason,
            })
    }
}

/// `EVENT_TYPE@VERSION`.
pub fn schema_id(event_type: &str, version: u32) -> String {
    format!("{event_type}@{version}")
}

/// Splits `EVENT_TYPE@VERSION`.
pub fn parse_schema_id(id: &str) -> Option<(&str, u32)> {
    let (ty, v) = id.rsplit_once('@')?;
    let n: u32 = v.parse().ok()?;
    (!ty.is_empty() && n >= 1 && n.to_string() == v).then_some((ty, n))
}

fn decode(writer: &Schema, reader: Option<&Schema>, payload: &[u8]) -> Result<Value, String> {
    let r = GenericDatumReader::builder(writer)
        .maybe_reader_schema(reader)
        .build()
        .map_err(|e| e.to_string())?;
    let mut rest = payload;
    let v = r.read_value(&mut rest).map_err(|e| e.to_string())?;
    if !rest.is_empty() {
        return Err(format!(
            "{} byte(s) left after one datum (two values, or another schema's bytes?)",
            rest.len()
        ));
    }
    Ok(v)
}

/// Parses a candidate schema for `event_type`: an Avro record whose annotations are well
/// formed, nullable fields saying what null means and local timestamps naming their zone.
pub fn parse(event_type: &str, text: &str) -> Result<SchemaVersion, ContractError> {
    let fail = |reason: String| ContractError::Parse {
        event_type: event_type.to_string(),
        reason,
    };
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| fail(format!("not JSON: {e}")))?;
    let normalized = serde_json::to_string(&json).map_err(|e| fail(e.to_string()))?;
    let schema = Schema::parse(&json).map_err(|e| fail(e.to_string()))?;
    let Schema::Record(record) = &schema else {
        return Err(fail(
            "the top level must be a record (an event is a projection with named fields)".into(),
        ));
    };
    check_annotations(event_type, "", record)?;
    Ok(SchemaVersion {
        event_type: event_type.to_string(),
        version: 0,
        fingerprint: Digest::of_bytes(FINGERPRINT_DOMAIN, normalized.as_bytes()),
        text: normalized,
        schema: Arc::new(schema),
    })
}

fn annotations(f: &RecordField) -> BTreeMap<String, serde_json::Value> {
    match f.custom_attributes.get(ANNOTATION) {
        Some(serde_json::Value::Object(m)) => {
            m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        }
        _ => BTreeMap::new(),
    }
}

fn is_nullable(s: &Schema) -> bool {
    matches!(s, Schema::Union(u) if u.is_nullable())
}

fn check_annotations(
    event_type: &str,
    prefix: &str,
    record: &RecordSchema,
) -> Result<(), ContractError> {
    for f in &record.fields {
        let path = format!("{prefix}{}", f.name);
        let fail = |reason: String| ContractError::Annotation {
            event_type: event_type.to_string(),
            field: path.clone(),
            reason,
        };
        let ann = match f.custom_attributes.get(ANNOTATION) {
            None => BTreeMap::new(),
            Some(serde_json::Value::Object(_)) => annotations(f),
            Some(other) => {
                return Err(fail(format!(
                    "`{ANNOTATION}` must be an object of {ANNOTATION_KEYS:?}, not {other}"
                )))
            }
        };
        for (k, v) in &ann {
            let ok = match k.as_str() {
                "unique" | "ordering_key" => v.is_boolean(),
                "unit" | "time_zone" | "null_meaning" | "delete" => {
                    v.as_str().is_some_and(|s| !s.trim().is_empty())
                }
                _ => {
                    return Err(fail(format!(
                        "unknown annotation `{k}`; known: {}",
                        ANNOTATION_KEYS.join(", ")
                    )))
                }
            };
            if !ok {
                return Err(fail(format!(
                    "annotation `{k}` is {v}; `unique` and `ordering_key` are true or false, the others a non-empty string"
                )));
            }
        }
        if is_nullable(&f.schema) && !ann.contains_key("null_meaning") {
            return Err(fail(format!(
                "the field may be null, so the contract must say what null means: add \"{ANNOTATION}\": {{\"null_meaning\": \"...\"}} (e.g. \"not known yet\", \"not applicable\", \"removed\")"
            )));
        }
        let local = |s: &Schema| {
            matches!(
                s,
                Schema::LocalTimestampMillis
                    | Schema::LocalTimestampMicros
                    | Schema::LocalTimestampNanos
            )
        };
        let is_local = match &f.schema {
            Schema::Union(u) => u.variants().iter().any(local),
            s => local(s),
        };
        if is_local && !ann.contains_key("time_zone") {
            return Err(fail(
                "a local timestamp has no zone of its own: name it with \"contract\": {\"time_zone\": \"Europe/Berlin\"} (or use timestamp-millis, which is UTC)".into(),
            ));
        }
        if let Some(inner) = record_of(&f.schema) {
            check_annotations(event_type, &format!("{path}."), inner)?;
        }
    }
    Ok(())
}

fn record_of(s: &Schema) -> Option<&RecordSchema> {
    match s {
        Schema::Record(r) => Some(r),
        Schema::Union(u) => {
            let mut records = u.variants().iter().filter_map(|v| match v {
                Schema::Record(r) => Some(r),
                _ => None,
            });
            let r = records.next()?;
            records.next().is_none().then_some(r)
        }
        _ => None,
    }
}

fn full(c: Result<Compatibility, apache_avro::error::CompatibilityError>) -> Result<(), String> {
    match c {
        Ok(Compatibility::Full) => Ok(()),
        Ok(Compatibility::Partial) => Err(
            "resolution may fail for some values (an enum symbol or union branch the reader lacks)"
                .into(),
        ),
        Err(e) => Err(e.to_string()),
    }
}

/// Every rule `candidate` breaks against each of `registered` (empty: compatible with all,
/// both ways).
pub fn compare(registered: &[SchemaVersion], candidate: &SchemaVersion) -> Vec<Breach> {
    let mut out = Vec::new();
    for old in registered {
        let start = out.len();
        if let (Schema::Record(o), Schema::Record(n)) = (old.schema(), candidate.schema()) {
            diff_records("", o, n, old.version, &mut out);
        }
        // Avro's own verdict, both ways: whatever it refuses that no named rule explained.
        let ours = out[start..].to_vec();
        let history = full(SchemaCompatibility::can_read(
            old.schema(),
            candidate.schema(),
        ));
        let newer = full(SchemaCompatibility::can_read(
            candidate.schema(),
            old.schema(),
        ));
        for (verdict, dir) in [
            (history, Direction::NewReadersOfHistory),
            (newer, Direction::OldReadersOfNewEvents),
        ] {
            if let Err(why) = verdict {
                if !ours.iter().any(|b| b.direction.covers(dir)) {
                    out.push(Breach {
                        rule: Rule::Incompatible,
                        field: String::new(),
                        against: old.version,
                        direction: dir,
                        detail: format!("Avro schema resolution refuses it: {why}"),
                    });
                }
            }
        }
    }
    out
}

fn diff_records(
    prefix: &str,
    old: &RecordSchema,
    new: &RecordSchema,
    against: u32,
    out: &mut Vec<Breach>,
) {
    let by_name = |r: &RecordSchema| -> HashMap<String, usize> {
        r.fields
            .iter()
            .enumerate()
            .map(|(i, f)| (f.name.clone(), i))
            .collect()
    };
    let (old_by, new_by) = (by_name(old), by_name(new));
    let mut push = |rule, field: String, direction, detail: String| {
        out.push(Breach {
            rule,
            field,
            against,
            direction,
            detail,
        })
    };
    let mut nested = Vec::new();
    for f in &old.fields {
        let Some(&j) = new_by.get(&f.name) else {
            continue;
        };
        let g = &new.fields[j];
        let path = format!("{prefix}{}", f.name);
        let (a, b) = (annotations(f), annotations(g));
        for key in ANNOTATION_KEYS {
            if let Some(was) = a.get(key) {
                if b.get(key) != Some(was) {
                    let now = b.get(key).map_or("removed".to_string(), |v| v.to_string());
                    push(
                        Rule::of_annotation(key),
                        path.clone(),
                        Direction::Meaning,
                        format!("field `{path}`: {key} {was} -> {now}"),
                    );
                }
            }
        }
        match (&f.schema, &g.schema) {
            (Schema::Enum(e), Schema::Enum(h)) => {
                enum_diff(&path, e, h, &mut push);
            }
            (x, y) if x.canonical_form() == y.canonical_form() => {}
            (x, y) => match (record_of(x), record_of(y)) {
                (Some(r), Some(s)) if is_nullable(x) == is_nullable(y) => {
                    nested.push((format!("{path}."), r, s));
                }
                _ => {
                    if full(SchemaCompatibility::can_read(x, y)).is_err() {
                        push(
                            Rule::Narrowing,
                            path.clone(),
                            Direction::NewReadersOfHistory,
                            format!("field `{path}`: {} -> {}, which cannot hold every value history holds", x.canonical_form(), y.canonical_form()),
                        );
                    }
                    if full(SchemaCompatibility::can_read(y, x)).is_err() {
                        push(
                            Rule::Widening,
                            path.clone(),
                            Direction::OldReadersOfNewEvents,
                            format!(
                                "field `{path}`: {} -> {}, which old readers cannot read",
                                x.canonical_form(),
                                y.canonical_form()
                            ),
                        );
                    }
                }
            },
        }
    }
    let removed: Vec<&RecordField> = old
        .fields
        .iter()
        .filter(|f| !new_by.contains_key(&f.name))
        .collect();
    let mut added: Vec<Option<&RecordField>> = new
        .fields
        .iter()
        .filter(|f| !old_by.contains_key(&f.name))
        .map(Some)
        .collect();
    for r in removed {
        let form = r.schema.canonical_form();
        let twin = added
            .iter_mut()
            .find(|a| a.is_some_and(|a| a.schema.canonical_form() == form));
        match twin {
            Some(slot) => {
                let a = slot.take().expect("found a Some");
                push(
                    Rule::Rename,
                    format!("{prefix}{}", r.name),
                    Direction::Both,
                    format!(
                        "field `{prefix}{}` removed and `{prefix}{}` of the same type added: a rename, each side loses the value",
                        r.name, a.name
                    ),
                );
            }
            None if r.default.is_none() => push(
                Rule::RemovedFieldWithoutDefault,
                format!("{prefix}{}", r.name),
                Direction::OldReadersOfNewEvents,
                format!(
                    "field `{prefix}{}` removed, and old readers have no default for it",
                    r.name
                ),
            ),
            None => {}
        }
    }
    for a in added.into_iter().flatten() {
        if a.default.is_none() {
            push(
                Rule::AddedFieldWithoutDefault,
                format!("{prefix}{}", a.name),
                Direction::NewReadersOfHistory,
                format!(
                    "field `{prefix}{}` added without a default; history does not have it",
                    a.name
                ),
            );
        }
    }
    for (p, r, s) in nested {
        diff_records(&p, r, s, against, out);
    }
}

fn enum_diff(
    path: &str,
    old: &EnumSchema,
    new: &EnumSchema,
    push: &mut impl FnMut(Rule, String, Direction, String),
) {
    let added: Vec<&String> = new
        .symbols
        .iter()
        .filter(|s| !old.symbols.contains(s))
        .collect();
    let removed: Vec<&String> = old
        .symbols
        .iter()
        .filter(|s| !new.symbols.contains(s))
        .collect();
    if !added.is_empty() && old.default.is_none() {
        push(
            Rule::EnumSymbolWithoutDefault,
            path.to_string(),
            Direction::OldReadersOfNewEvents,
            format!("field `{path}`: symbol(s) {added:?} added, and the old readers' enum has no default (no unknown branch)"),
        );
    }
    if !removed.is_empty() && new.default.is_none() {
        push(
            Rule::EnumSymbolRemoved,
            path.to_string(),
            Direction::NewReadersOfHistory,
            format!("field `{path}`: symbol(s) {removed:?} removed, and the new enum has no default for history's values"),
        );
    }
}

/// Parsed registered schemas by fingerprint (a registered version never changes), so enqueue
/// parses each once per process.
pub fn registered(
    event_type: &str,
    version: u32,
    text: &str,
) -> Result<SchemaVersion, ContractError> {
    static CACHE: OnceLock<Mutex<HashMap<Digest, Arc<Schema>>>> = OnceLock::new();
    let fingerprint = Digest::of_bytes(FINGERPRINT_DOMAIN, text.as_bytes());
    let cache = CACHE.get_or_init(Default::default);
    let hit = cache
        .lock()
        .expect("schema cache")
        .get(&fingerprint)
        .cloned();
    let schema = match hit {
        Some(s) => s,
        None => {
            let s = Arc::new(Schema::parse_str(text).map_err(|e| ContractError::Corrupt {
                id: schema_id(event_type, version),
                reason: e.to_string(),
            })?);
            let mut c = cache.lock().expect("schema cache");
            if c.len() >= 4096 {
                c.clear();
            }
            c.insert(fingerprint, s.clone());
            s
        }
    };
    Ok(SchemaVersion {
        event_type: event_type.to_string(),
        version,
        text: text.to_string(),
        fingerprint,
        schema,
    })
}

/// What registering a candidate would do, decided against the registered versions of its
/// event type (oldest first): the registered version it already is, or the breaches against
/// every registered version (both ways), and the version it would get. The registry
/// (`sealpost::contract::register`) and the simulator's registrar both decide with it.
#[derive(Debug)]
pub struct Check {
    /// The parsed candidate.
    pub candidate: SchemaVersion,
    /// The version it would get.
    pub next_version: u32,
    /// The registered version with the same text, if any (registering is then a no-op).
    pub same_as: Option<u32>,
    /// Every rule it breaks (empty: compatible both ways with every registered version).
    pub breaches: Vec<Breach>,
}

impl Check {
    /// Checks `candidate` as the next version after `registered` (oldest first).
    pub fn new(registered: &[SchemaVersion], candidate: SchemaVersion) -> Check {
        let same_as = registered
            .iter()
            .find(|v| v.fingerprint == candidate.fingerprint)
            .map(|v| v.version);
        let breaches = match same_as {
            Some(_) => Vec::new(),
            None => compare(registered, &candidate),
        };
        Check {
            next_version: registered.last().map_or(1, |v| v.version + 1),
            candidate,
            same_as,
            breaches,
        }
    }

    /// The registration this check allows: the version to store and whether it is new
    /// (`false`: the text is already registered as that version, nothing to store), or every
    /// breach when it is refused.
    pub fn registration(self) -> Result<(SchemaVersion, bool), ContractError> {
        let mut s = self.candidate;
        if let Some(v) = self.same_as {
            s.version = v;
            return Ok((s, false));
        }
        if !self.breaches.is_empty() {
            return Err(ContractError::Breaking {
                event_type: s.event_type,
                breaches: self.breaches,
            });
        }
        s.version = self.next_version;
        Ok((s, true))
    }
}

/// The registered version `enqueue` fetches for `ev` on a route that requires contracts: its
/// `payload_schema`'s (event type, version), when that names `ev`'s own event type (else
/// nothing is fetched and [`check_payload`] says what is wrong). Shared by both store flavours.
pub fn schema_to_fetch<'a>(ev: &NewEvent<'a>) -> Option<(&'a str, i32)> {
    parse_schema_id(ev.payload_schema)
        .filter(|(ty, _)| *ty == ev.event_type)
        .map(|(ty, v)| (ty, v as i32))
}

/// The enqueue check of one event on a route that requires contracts: its `payload_schema`
/// names a version of its own event type, `text` is that version's registered schema (`None`:
/// not registered), and the payload is one datum of it.
pub fn check_payload(
    event_type: &str,
    payload_schema: &str,
    text: Option<&str>,
    payload: &[u8],
) -> Result<(), ContractError> {
    let (ty, version) = parse_schema_id(payload_schema)
        .ok_or_else(|| ContractError::BadId(payload_schema.into()))?;
    if ty != event_type {
        return Err(ContractError::BadId(format!(
            "{payload_schema}` names event type `{ty}`, but the event is `{event_type}"
        )));
    }
    let text = text.ok_or_else(|| ContractError::NotRegistered {
        event_type: event_type.to_string(),
        version,
    })?;
    registered(ty, version, text)?.validate(payload)
}

/// A consumer's view of one event type's contract: its own (reader) version, and every
/// registered version it resolves from (R26: old readers read new events, new readers read
/// history).
#[derive(Debug)]
pub struct Reader {
    event_type: String,
    reader: SchemaVersion,
    writers: HashMap<Digest, SchemaVersion>,
}

impl Reader {
    /// A reader of `event_type` at `reader_version`, resolving from every version in
    /// `registered`; refused when one of them cannot be read into the reader's version.
    pub fn new(
        event_type: &str,
        reader_version: u32,
        registered: Vec<SchemaVersion>,
    ) -> Result<Reader, ContractError> {
        let reader = registered
            .iter()
            .find(|v| v.version == reader_version)
            .cloned()
            .ok_or_else(|| ContractError::NotRegistered {
                event_type: event_type.to_string(),
                version: reader_version,
            })?;
        let mut breaches = Vec::new();
        for w in &registered {
            if let Err(why) = full(SchemaCompatibility::can_read(w.schema(), reader.schema())) {
                breaches.push(Breach {
                    rule: Rule::Incompatible,
                    field: String::new(),
                    against: w.version,
                    direction: Direction::NewReadersOfHistory,
                    detail: format!(
                        "version {} cannot be read as version {reader_version}: {why}",
                        w.version
                    ),
                });
            }
        }
        if !breaches.is_empty() {
            return Err(ContractError::Breaking {
                event_type: event_type.to_string(),
                breaches,
            });
        }
        Ok(Reader {
            event_type: event_type.to_string(),
            reader,
            writers: registered.into_iter().map(|v| (v.digest(), v)).collect(),
        })
    }

    /// The versions this reader reads, ascending.
    pub fn accepts(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.writers.values().map(|w| w.version).collect();
        v.sort_unstable();
        v
    }

    /// The reader's own version.
    pub fn version(&self) -> &SchemaVersion {
        &self.reader
    }

    /// Reads `payload`, written with the version whose digest is `schema_digest` (the
    /// envelope's `payload_schema_digest`), as the reader's version: fields the writer lacks
    /// take the reader's defaults, symbols the reader lacks its enum's default.
    pub fn read(
        &self,
        schema_digest: &Digest,
        payload: &[u8],
    ) -> Result<(u32, Value), ContractError> {
        let w = self
            .writers
            .get(schema_digest)
            .ok_or_else(|| ContractError::UnknownWriter {
                event_type: self.event_type.clone(),
                digest: schema_digest.to_prefixed_hex(),
            })?;
        let v = decode(w.schema(), Some(self.reader.schema()), payload)
            .map_err(|reason| ContractError::Payload { id: w.id(), reason })?;
        Ok((w.version, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: &str = r#"{"type": "record", "name": "OrderCreated", "fields": [
        {"name": "order_id", "type": "string", "contract": {"unique": true, "ordering_key": true}},
        {"name": "total", "type": "long", "contract": {"unit": "cents"}}]}"#;
    const V2: &str = r#"{"type": "record", "name": "OrderCreated", "fields": [
        {"name": "order_id", "type": "string", "contract": {"unique": true, "ordering_key": true}},
        {"name": "total", "type": "long", "contract": {"unit": "cents"}},
        {"name": "currency", "type": "string", "default": "EUR"}]}"#;
    const RENAMED: &str = r#"{"type": "record", "name": "OrderCreated", "fields": [
        {"name": "order_id", "type": "string", "contract": {"unique": true, "ordering_key": true}},
        {"name": "amount", "type": "long", "contract": {"unit": "cents"}},
        {"name": "currency", "type": "string", "default": "EUR"}]}"#;

    fn registered(text: &str, version: u32) -> SchemaVersion {
        let mut v = parse("order.created", text).unwrap();
        v.version = version;
        v
    }

    fn field<'a>(v: &'a Value, name: &str) -> &'a Value {
        match v {
            Value::Record(fields) => &fields.iter().find(|(n, _)| n == name).unwrap().1,
            other => panic!("a record, got {other:?}"),
        }
    }

    /// Seed 003's schema-compatibility model, on the registry's own code: a reader at version
    /// 2 accepts schemas [1, 2], fills version 1's missing field with its default, and a
    /// rename is rejected.
    #[test]
    fn the_seed_model_outputs() {
        let (v1, v2) = (registered(V1, 1), registered(V2, 2));
        assert!(
            compare(std::slice::from_ref(&v1), &v2).is_empty(),
            "an added field with a default is compatible"
        );
        let reader = Reader::new("order.created", 2, vec![v1.clone(), v2.clone()]).unwrap();
        let history = v1
            .encode(Value::Record(vec![
                ("order_id".into(), Value::String("o-7".into())),
                ("total".into(), Value::Long(1250)),
            ]))
            .unwrap();
        let (writer, read) = reader.read(&v1.digest(), &history).unwrap();
        assert_eq!(writer, 1);
        let defaults_applied = *field(&read, "currency") == Value::String("EUR".into())
            && *field(&read, "total") == Value::Long(1250);
        let renamed = parse("order.created", RENAMED).unwrap();
        let breaches = compare(&[v1, v2], &renamed);
        let rename_rejected = breaches
            .iter()
            .any(|b| b.rule == Rule::Rename && b.field == "total");
        let line = format!(
            "readerVersion={} acceptedSchemas={:?} defaultsApplied={defaults_applied} breakingRenameRejected={rename_rejected}",
            reader.version().version,
            reader.accepts()
        );
        assert_eq!(
            line,
            "readerVersion=2 acceptedSchemas=[1, 2] defaultsApplied=true breakingRenameRejected=true"
        );
        // The rename breaks both sides against both versions, and says what to do instead.
        assert_eq!(breaches.len(), 2, "{breaches:#?}");
        assert!(breaches.iter().all(|b| b.direction == Direction::Both));
        assert!(
            breaches[0].to_string().contains("deprecation window"),
            "{}",
            breaches[0]
        );
    }

    #[test]
    fn an_old_reader_reads_a_new_event_without_the_fields_it_does_not_know() {
        let (v1, v2) = (registered(V1, 1), registered(V2, 2));
        let old = Reader::new("order.created", 1, vec![v1, v2.clone()]).unwrap();
        let new_event = v2
            .encode(Value::Record(vec![
                ("order_id".into(), Value::String("o-8".into())),
                ("total".into(), Value::Long(99)),
                ("currency".into(), Value::String("USD".into())),
            ]))
            .unwrap();
        let (writer, read) = old.read(&v2.digest(), &new_event).unwrap();
        assert_eq!(writer, 2);
        assert_eq!(
            read,
            Value::Record(vec![
                ("order_id".into(), Value::String("o-8".into())),
                ("total".into(), Value::Long(99)),
            ])
        );
        // Another event type's digest is not a writer this reader knows.
        let stranger = Digest::of_bytes(SCHEMA_DOMAIN, b"payment.settled@1");
        assert!(matches!(
            old.read(&stranger, &new_event),
            Err(ContractError::UnknownWriter { .. })
        ));
    }

    #[test]
    fn a_payload_is_exactly_one_datum_of_its_schema() {
        let v1 = registered(V1, 1);
        let mut ok = v1
            .encode(Value::Record(vec![
                ("order_id".into(), Value::String("o-1".into())),
                ("total".into(), Value::Long(5)),
            ]))
            .unwrap();
        v1.validate(&ok).unwrap();
        ok.push(0);
        let e = v1.validate(&ok).unwrap_err().to_string();
        assert!(e.contains("1 byte(s) left after one datum"), "{e}");
        let e = v1
            .validate(br#"{"order_id":"o-1"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not match `order.created@1`"), "{e}");
        assert!(
            v1.validate(&[]).is_err(),
            "an empty payload is not a record"
        );
    }

    #[test]
    fn annotations_are_checked_when_a_schema_is_parsed() {
        let refused = |fields: &str| {
            let text = format!(r#"{{"type": "record", "name": "R", "fields": [{fields}]}}"#);
            parse("t", &text).unwrap_err().to_string()
        };
        let e = refused(r#"{"name": "note", "type": ["null", "string"], "default": null}"#);
        assert!(
            e.contains("field `note`") && e.contains("what null means"),
            "{e}"
        );
        let e = refused(
            r#"{"name": "at", "type": {"type": "long", "logicalType": "local-timestamp-millis"}}"#,
        );
        assert!(e.contains("time_zone"), "{e}");
        let e = refused(r#"{"name": "x", "type": "long", "contract": {"units": "cents"}}"#);
        assert!(e.contains("unknown annotation `units`"), "{e}");
        let e = refused(r#"{"name": "x", "type": "long", "contract": {"unique": "yes"}}"#);
        assert!(e.contains("true or false"), "{e}");
        let e = refused(r#"{"name": "x", "type": "long", "contract": "cents"}"#);
        assert!(e.contains("must be an object"), "{e}");
        let e = refused(
            r#"{"name": "inner", "type": {"type": "record", "name": "I", "fields": [{"name": "n", "type": ["null", "long"], "default": null}]}}"#,
        );
        assert!(
            e.contains("field `inner.n`"),
            "nested records are checked: {e}"
        );
        let e = parse("t", r#""string""#).unwrap_err().to_string();
        assert!(e.contains("must be a record"), "{e}");
        let e = parse("t", "{").unwrap_err().to_string();
        assert!(e.contains("not JSON"), "{e}");
    }

    #[test]
    fn schema_ids() {
        assert_eq!(
            parse_schema_id("order.created@2"),
            Some(("order.created", 2))
        );
        assert_eq!(parse_schema_id("a@b@3"), Some(("a@b", 3)));
        for bad in [
            "order.created.v1",
            "@2",
            "x@0",
            "x@+2",
            "x@02",
            "x@",
            "x@-1",
        ] {
            assert_eq!(parse_schema_id(bad), None, "{bad}");
        }
        let e = check_payload("order.created", "payment.settled@1", Some(V1), b"").unwrap_err();
        assert!(
            e.to_string().contains("names event type `payment.settled`"),
            "{e}"
        );
        let e = check_payload("order.created", "order.created@3", None, b"").unwrap_err();
        assert!(
            matches!(e, ContractError::NotRegistered { version: 3, .. }),
            "{e}"
        );
    }

    /// splitmix64: the property test's deterministic randomness.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    fn random_value(rng: &mut Rng, s: &Schema) -> Value {
        match s {
            Schema::Null => Value::Null,
            Schema::Int => Value::Int(rng.next() as i32),
            Schema::Long => Value::Long(rng.next() as i64),
            Schema::String => Value::String(format!("s{}", rng.below(1000))),
            Schema::Enum(e) => {
                let i = rng.below(e.symbols.len());
                Value::Enum(i as u32, e.symbols[i].clone())
            }
            Schema::Union(u) => {
                let i = rng.below(u.variants().len());
                Value::Union(i as u32, Box::new(random_value(rng, &u.variants()[i])))
            }
            Schema::Record(r) => Value::Record(
                r.fields
                    .iter()
                    .map(|f| (f.name.clone(), random_value(rng, &f.schema)))
                    .collect(),
            ),
            other => panic!("the generator makes no {other:?}"),
        }
    }

    /// A field of a random kind, with or without a default.
    fn random_field(rng: &mut Rng, name: String) -> serde_json::Value {
        use serde_json::json;
        let with_default = rng.below(2) == 0;
        let (ty, default) = match rng.below(5) {
            0 => (json!("int"), json!(0)),
            1 => (json!("long"), json!(0)),
            2 => (json!("string"), json!("")),
            3 => {
                let symbols: Vec<&str> = ["A", "B", "C", "D"][..2 + rng.below(3)].to_vec();
                let mut e = json!({"type": "enum", "name": format!("E{name}"), "symbols": symbols});
                if rng.below(2) == 0 {
                    e["default"] = json!(symbols[0]);
                }
                (e, json!(symbols[0]))
            }
            _ => (json!(["null", "long"]), json!(null)),
        };
        let mut f = json!({"name": name, "type": ty});
        if ty.is_array() {
            f["contract"] = json!({"null_meaning": "not known"});
        }
        if with_default {
            f["default"] = default;
        }
        f
    }

    /// One random change of the kinds a team makes: add, remove, rename, retype, toggle a
    /// default, add or remove an enum symbol or the enum's default, make a field nullable or
    /// required.
    fn mutate(rng: &mut Rng, schema: &serde_json::Value, n: &mut usize) -> serde_json::Value {
        use serde_json::json;
        let mut s = schema.clone();
        let fields = s["fields"].as_array_mut().expect("fields");
        *n += 1;
        if fields.is_empty() {
            fields.push(random_field(rng, format!("f{n}")));
            return s;
        }
        let i = rng.below(fields.len());
        let f = &mut fields[i];
        let default_for = |ty: &serde_json::Value| match ty.as_str() {
            Some("int") | Some("long") => json!(0),
            Some("string") => json!(""),
            _ if ty.is_array() => json!(null),
            _ => ty["symbols"][0].clone(),
        };
        match rng.below(9) {
            0 | 1 => fields.push(random_field(rng, format!("f{n}"))),
            2 => {
                fields.remove(i);
            }
            3 => f["name"] = json!(format!("f{n}")),
            4 => {
                let ty = [json!("int"), json!("long"), json!("string")][rng.below(3)].clone();
                if f.get("default").is_some() {
                    f["default"] = default_for(&ty);
                }
                f["type"] = ty;
                f.as_object_mut().expect("field").remove("contract");
            }
            5 => {
                if f.get("default").is_some() {
                    f.as_object_mut().expect("field").remove("default");
                } else {
                    f["default"] = default_for(&f["type"]);
                }
            }
            6 => {
                if let Some(symbols) = f["type"].get_mut("symbols").and_then(|v| v.as_array_mut()) {
                    let all = ["A", "B", "C", "D", "E"];
                    let missing: Vec<&str> = all
                        .iter()
                        .copied()
                        .filter(|x| !symbols.contains(&json!(x)))
                        .collect();
                    if rng.below(2) == 0 && !missing.is_empty() {
                        symbols.push(json!(missing[0]));
                    } else if symbols.len() > 1 {
                        let last = symbols.pop().expect("a symbol");
                        if f["type"].get("default") == Some(&last) {
                            f["type"]["default"] = f["type"]["symbols"][0].clone();
                        }
                        if f.get("default") == Some(&last) {
                            f["default"] = f["type"]["symbols"][0].clone();
                        }
                    }
                }
            }
            7 => {
                if f["type"].get("symbols").is_some() {
                    if f["type"].get("default").is_some() {
                        f["type"].as_object_mut().expect("enum").remove("default");
                    } else {
                        f["type"]["default"] = f["type"]["symbols"][0].clone();
                    }
                }
            }
            _ => {
                if f["type"].is_array() {
                    f["type"] = json!("long");
                    if f.get("default").is_some() {
                        f["default"] = json!(0);
                    }
                    f.as_object_mut().expect("field").remove("contract");
                } else if f["type"] == json!("long") {
                    f["type"] = json!(["null", "long"]);
                    f["contract"] = json!({"null_meaning": "not known"});
                    if f.get("default").is_some() {
                        f["default"] = json!(null);
                    }
                }
            }
        }
        s
    }

    /// The rules against Avro's own resolution on real bytes: over random evolutions, every
    /// version the check lets through is read by every reader, both ways, for random values
    /// (and a check that let a breaking change through would fail here, with the change).
    #[test]
    fn what_the_check_accepts_every_reader_reads_both_ways() {
        let mut rng = Rng(2026);
        let (mut accepted, mut refused) = (0, 0);
        let mut rules: HashMap<Rule, usize> = HashMap::new();
        for lineage in 0..60 {
            let mut n = 0;
            let mut json = serde_json::json!({"type": "record", "name": "R", "fields": []});
            let first = mutate(&mut rng, &json, &mut n);
            let mut history = vec![parse("t", &first.to_string()).unwrap()];
            history[0].version = 1;
            json = first;
            for _ in 0..40 {
                let candidate_json = mutate(&mut rng, &json, &mut n);
                let Ok(mut candidate) = parse("t", &candidate_json.to_string()) else {
                    continue;
                };
                let breaches = compare(&history, &candidate);
                if !breaches.is_empty() {
                    refused += 1;
                    for b in breaches {
                        *rules.entry(b.rule).or_default() += 1;
                    }
                    continue;
                }
                accepted += 1;
                candidate.version = history.len() as u32 + 1;
                for old in &history {
                    for (w, r) in [(old, &candidate), (&candidate, old)] {
                        for _ in 0..4 {
                            let v = random_value(&mut rng, w.schema());
                            let bytes = w.encode(v.clone()).unwrap();
                            if let Err(e) = decode(w.schema(), Some(r.schema()), &bytes) {
                                panic!(
                                    "lineage {lineage}: version {} was accepted, yet version {} cannot read {v:?} written by version {}: {e}\nwriter: {}\nreader: {}",
                                    candidate.version, r.version, w.version, w.text, r.text
                                );
                            }
                        }
                    }
                }
                history.push(candidate);
                json = candidate_json;
            }
        }
        println!("accepted {accepted}, refused {refused}, rules {rules:?}");
        assert!(accepted >= 200, "the walk must evolve: {accepted} accepted");
        for rule in [
            Rule::Rename,
            Rule::RemovedFieldWithoutDefault,
            Rule::AddedFieldWithoutDefault,
            Rule::Narrowing,
            Rule::Widening,
            Rule::EnumSymbolWithoutDefault,
            Rule::EnumSymbolRemoved,
        ] {
            assert!(
                rules.get(&rule).copied().unwrap_or(0) > 0,
                "the walk never met {rule:?}: {rules:?}"
            );
        }
    }
}
