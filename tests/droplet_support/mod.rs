//! Starting a server with both droplet front ends for the droplet tests: the
//! line protocol (with `TAKE`/`QUERY`) and the WebSocket endpoint, on
//! 127.0.0.1 port 0, sharing one set of buckets and one clock.
#![allow(dead_code)]

use crate::common::TestServer;
use std::net::SocketAddr;
use std::sync::Arc;
use tollgate::clock::Clock;
use tollgate::droplet::{
    Buckets, BucketsConfig, DropletServer, DropletServerConfig, LineCommands, RunningDroplet,
};
use tollgate::engine::{Engine, UnavailablePolicy};
use tollgate::metrics::Metrics;
use tollgate::rules::RuleSet;
use tollgate::server::Limits;
use tollgate::store::{MemoryBackend, MemoryStore, MemoryStoreConfig};

pub struct DropletTestServer {
    /// The line protocol (divvy port).
    pub line: TestServer,
    /// The WebSocket endpoint.
    pub droplet_addr: SocketAddr,
    pub buckets: Arc<Buckets>,
    running: Option<RunningDroplet>,
}

impl DropletTestServer {
    pub fn start(clock: Arc<dyn Clock>) -> DropletTestServer {
        Self::start_with(
            clock,
            BucketsConfig::default(),
            DropletServerConfig::default(),
        )
    }

    pub fn start_with(
        clock: Arc<dyn Clock>,
        buckets: BucketsConfig,
        mut config: DropletServerConfig,
    ) -> DropletTestServer {
        let buckets = Arc::new(Buckets::new(buckets));
        let store = Arc::new(MemoryStore::new(MemoryStoreConfig::default()));
        let engine = Arc::new(
            Engine::new(
                RuleSet::embedded_default(),
                Arc::new(MemoryBackend {
                    store: Arc::clone(&store),
                }),
                Arc::clone(&clock),
                Metrics::new(),
                UnavailablePolicy::Error,
            )
            .with_extension(Arc::new(LineCommands::new(Arc::clone(&buckets)))),
        );
        let line = TestServer::start_engine(engine, store, 2, Limits::default(), 2_000);
        config.listen = "127.0.0.1:0".parse().unwrap();
        config.threads = 2;
        config.drain_timeout_ms = 2_000;
        let server =
            DropletServer::bind(config, Arc::clone(&buckets), clock).expect("bind on port 0");
        let running = server.spawn().expect("spawn droplet threads");
        DropletTestServer {
            line,
            droplet_addr: running.local_addr,
            buckets,
            running: Some(running),
        }
    }

    /// Stops the WebSocket endpoint (the line protocol keeps serving).
    pub fn stop_droplet(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop();
        }
    }

    pub fn ws_url(&self) -> String {
        format!("ws://{}/", self.droplet_addr)
    }
}

impl Drop for DropletTestServer {
    fn drop(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop();
        }
    }
}
