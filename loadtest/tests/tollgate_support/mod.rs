//! A real Tollgate, in-process, for the token-bucket tests: the line protocol (with droplet's
//! `TAKE`/`QUERY` commands) and droplet's WebSocket endpoint on 127.0.0.1 port 0, one serving thread
//! each, sharing one set of buckets on the real clock. Built from the `tollgate` library the way
//! `tollgate serve --droplet-listen` assembles it, so the generator meets the production code paths.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;

use tollgate::clock::{Clock, SystemClock};
use tollgate::droplet::{
    Buckets, BucketsConfig, DropletServer, DropletServerConfig, LineCommands, RunningDroplet,
};
use tollgate::engine::{Engine, UnavailablePolicy};
use tollgate::metrics::Metrics;
use tollgate::rules::RuleSet;
use tollgate::server::{Limits, RunningServer, Server, ServerConfig};
use tollgate::store::{MemoryBackend, MemoryStore, MemoryStoreConfig};

/// How long shutdown waits for open connections, in milliseconds.
const DRAIN_TIMEOUT_MS: u64 = 1_000;

pub struct Tollgate {
    /// The divvy line protocol (HIT, TAKE, QUERY).
    pub line_addr: SocketAddr,
    /// droplet's WebSocket endpoint.
    pub droplet_addr: SocketAddr,
    pub buckets: Arc<Buckets>,
    line: Option<RunningServer>,
    droplet: Option<RunningDroplet>,
}

impl Tollgate {
    /// Start both front ends; `message_bytes_max` bounds droplet messages (a larger one is closed
    /// with code 1009).
    pub fn start(message_bytes_max: usize) -> Tollgate {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let buckets = Arc::new(Buckets::new(BucketsConfig::default()));
        let store = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
        let engine = Arc::new(
            Engine::new(
                RuleSet::embedded_default(),
                Arc::new(MemoryBackend { store }),
                Arc::clone(&clock),
                Metrics::new(),
                UnavailablePolicy::Error,
            )
            .with_extension(Arc::new(LineCommands::new(Arc::clone(&buckets)))),
        );
        let line = Server::bind(
            ServerConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                threads: 1,
                limits: Limits::default(),
                drain_timeout_ms: DRAIN_TIMEOUT_MS,
            },
            engine,
        )
        .expect("bind the line protocol on port 0")
        .spawn()
        .expect("spawn the line protocol's thread");
        let droplet = DropletServer::bind(
            DropletServerConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                threads: 1,
                message_bytes_max,
                drain_timeout_ms: DRAIN_TIMEOUT_MS,
                ..DropletServerConfig::default()
            },
            Arc::clone(&buckets),
            clock,
        )
        .expect("bind the droplet endpoint on port 0")
        .spawn()
        .expect("spawn the droplet endpoint's thread");
        Tollgate {
            line_addr: line.local_addr,
            droplet_addr: droplet.local_addr,
            buckets,
            line: Some(line),
            droplet: Some(droplet),
        }
    }

    /// The balances of `bucket` now, in droplet's period order (`None` for a period not set).
    pub fn balances(&self, bucket: &str) -> Option<[Option<i32>; 6]> {
        self.buckets
            .query(bucket.as_bytes(), SystemClock.now_ms())
            .map(|b| b.0)
    }
}

impl Drop for Tollgate {
    fn drop(&mut self) {
        if let Some(d) = self.droplet.take() {
            d.stop();
        }
        if let Some(l) = self.line.take() {
            l.stop();
        }
    }
}
