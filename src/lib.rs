//! Tollgate: a rate-limit and quota server that speaks divvy's line protocol
//! (and droplet's, and Envoy's rate limit service over gRPC), keeps counters in memory on a thread-per-core runtime, and
//! can run as a Raft-replicated cluster or on divvy's Redis.
//!
//! The request path runs one way: [`protocol`] (bytes → command) →
//! [`rules`] (command → evaluated rules) → [`store`] (counters, via a
//! backend) with [`limiter`] (pure algorithms) → [`engine`] (the reply) →
//! [`server`] (sockets, threads, shutdown). Binaries are thin wrappers.

pub mod app;
pub mod cli;
pub mod client;
pub mod clock;
pub mod cluster;
pub mod droplet;
pub mod engine;
pub mod envoy;
pub mod limiter;
pub mod metrics;
pub mod observability;
pub mod protocol;
pub mod rules;
pub mod server;
pub mod stable_hash;
pub mod store;
