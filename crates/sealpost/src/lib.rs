//! Sealpost: the Postgres store, broker adapters and operator tools around sealpost-core.
