//! Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService`)
//! on divvy's rules: the gRPC API that Envoy, Istio, Contour, Emissary and
//! Gloo call for every request they rate-limit, served on `--grpc-listen`
//! beside the line protocol and droplet's WebSocket, through the same
//! [`Engine`](crate::engine::Engine), rules and counters. [`mapping`] turns a
//! request into divvy operations and decisions into Envoy's statuses (pure,
//! fuzzed); [`server`] serves HTTP/2 on the thread-per-core acceptor. The
//! message types come from the `envoy-types` crate (docs/architecture.md says
//! why); docs/envoy.md documents the mapping.

pub mod http2;
pub mod mapping;
pub mod server;
pub mod wire;

pub use mapping::{EnvoyLimits, MappingError, Operation};
pub use server::{bind, GrpcServer, GrpcServerConfig};

use std::net::SocketAddr;

/// envoyproxy/ratelimit's gRPC port, `--grpc-listen`'s default address.
pub const GRPC_PORT: u16 = 8081;

/// The gRPC endpoint as `tollgate serve` configures it (the serving threads,
/// connection limit and drain are the line protocol's).
#[derive(Debug, Clone)]
pub struct GrpcConfig {
    /// Serve Envoy's rate limit service here; `None`: not served.
    pub listen: Option<SocketAddr>,
    /// Largest request message accepted, in bytes; a larger one is answered
    /// `RESOURCE_EXHAUSTED`.
    pub message_bytes_max: usize,
    /// Most concurrent HTTP/2 streams (calls) per connection.
    pub streams_per_connection_max: u32,
    /// A connection that sends nothing for this long after connecting is
    /// closed, in milliseconds.
    pub first_byte_timeout_ms: u64,
    /// A connection silent this long is pinged, and closed when as long
    /// again passes without a byte (also the bound on one write), in
    /// milliseconds.
    pub keep_alive_ms: u64,
    /// Bounds on a request's shape (descriptors, entries, `hits_addend`).
    pub limits: EnvoyLimits,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        GrpcConfig {
            listen: None,
            message_bytes_max: 64 * 1024,
            streams_per_connection_max: 1024,
            first_byte_timeout_ms: 10_000,
            keep_alive_ms: 20_000,
            limits: EnvoyLimits::default(),
        }
    }
}
