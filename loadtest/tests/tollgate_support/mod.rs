//! A real Tollgate, in-process, for the token-bucket and Envoy tests: the line protocol (with
//! droplet's `TAKE`/`QUERY` commands), droplet's WebSocket endpoint and Envoy's rate limit service
//! (gRPC) on 127.0.0.1 port 0, one serving thread each, sharing one set of buckets and counters on
//! the real clock, with the embedded default rules. Started by the `tollgate` library's `App`, as
//! `tollgate serve --droplet-listen --grpc-listen` starts it, so the generator meets the production
//! code paths.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;

use tollgate::app::{App, RunningApp, ServeConfig};
use tollgate::clock::{Clock, SystemClock};
use tollgate::droplet::{Buckets, DropletConfig};
use tollgate::engine::Engine;
use tollgate::envoy::GrpcConfig;

/// How long shutdown waits for open connections, in milliseconds.
const DRAIN_TIMEOUT_MS: u64 = 1_000;

pub struct Tollgate {
    /// The divvy line protocol (HIT, TAKE, QUERY).
    pub line_addr: SocketAddr,
    /// droplet's WebSocket endpoint.
    pub droplet_addr: SocketAddr,
    /// Envoy's rate limit service.
    pub grpc_addr: SocketAddr,
    pub buckets: Arc<Buckets>,
    pub engine: Arc<Engine>,
    /// Stops every endpoint when dropped.
    app: RunningApp,
}

impl Tollgate {
    /// Start both front ends; `message_bytes_max` bounds droplet messages (a larger one is closed
    /// with code 1009).
    pub fn start(message_bytes_max: usize) -> Tollgate {
        Self::start_with(message_bytes_max, GrpcConfig::default())
    }

    /// As [`Tollgate::start`], the gRPC endpoint configured by `grpc` (its address replaced).
    pub fn start_with(message_bytes_max: usize, grpc: GrpcConfig) -> Tollgate {
        let config = ServeConfig {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            threads: Some(1),
            drain_timeout_ms: DRAIN_TIMEOUT_MS,
            droplet: DropletConfig {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                message_bytes_max,
                ..DropletConfig::default()
            },
            grpc: GrpcConfig {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                ..grpc
            },
            ..ServeConfig::default()
        };
        let app = App::build(config)
            .expect("build Tollgate on port 0")
            .spawn()
            .expect("serve");
        Tollgate {
            line_addr: app.local_addr(),
            droplet_addr: app.droplet_addr().expect("the droplet endpoint serves"),
            grpc_addr: app.grpc_addr().expect("the gRPC endpoint serves"),
            buckets: Arc::clone(app.buckets()),
            engine: Arc::clone(app.engine()),
            app,
        }
    }

    /// The balances of `bucket` now, in droplet's period order (`None` for a period not set).
    pub fn balances(&self, bucket: &str) -> Option<[Option<i32>; 6]> {
        self.buckets
            .query(bucket.as_bytes(), SystemClock.now_ms())
            .map(|b| b.0)
    }
}
