//! A server with both droplet front ends for the droplet tests: the line
//! protocol (with `TAKE`/`QUERY`) and the WebSocket endpoint, on 127.0.0.1
//! port 0, sharing one set of buckets and one clock, as
//! `tollgate serve --droplet-listen` starts them.

use super::{on_clock, test_config, TestServer};
use std::net::SocketAddr;
use std::sync::Arc;
use tollgate::clock::Clock;
use tollgate::droplet::{Buckets, DropletConfig};
use tollgate::rules::RuleSet;

pub struct DropletTestServer {
    /// The line protocol (divvy port); stopping it stops both endpoints.
    pub line: TestServer,
    /// The WebSocket endpoint.
    pub droplet_addr: SocketAddr,
    pub buckets: Arc<Buckets>,
}

impl DropletTestServer {
    pub fn start(clock: Arc<dyn Clock>) -> DropletTestServer {
        Self::start_with(clock, DropletConfig::default())
    }

    /// `droplet.listen` is replaced by 127.0.0.1 port 0.
    pub fn start_with(clock: Arc<dyn Clock>, droplet: DropletConfig) -> DropletTestServer {
        let config = tollgate::app::ServeConfig {
            droplet: DropletConfig {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                ..droplet
            },
            ..test_config(RuleSet::embedded_default())
        };
        let line = TestServer::start_app(config, on_clock(clock));
        DropletTestServer {
            droplet_addr: line
                .app
                .droplet_addr()
                .expect("the droplet endpoint serves"),
            buckets: Arc::clone(line.app.buckets()),
            line,
        }
    }

    /// Stops both endpoints (droplet's connections get close code 1001).
    pub fn stop(self) {
        self.line.stop();
    }

    pub fn ws_url(&self) -> String {
        format!("ws://{}/", self.droplet_addr)
    }
}
