//! The real published droplet client (`droplet@1.4.0`) driven by
//! tests/node/droplet_client.js against Tollgate's droplet endpoint (see
//! tests/util/droplet_node.rs). The server runs on a manual clock that this
//! test advances when the script asks, so accrual is asserted exactly.

use crate::util;

use std::time::Duration;
use util::droplet::DropletTestServer;
use util::droplet_node::{assert_droplet_answers, run_droplet_client};

/// The whole Node conversation must finish within this.
const NODE_TIMEOUT: Duration = Duration::from_secs(20);

#[test]
fn the_published_droplet_client_gets_droplets_answers() {
    let clock = util::manual_clock();
    let server = DropletTestServer::start(clock.clone());
    let results = run_droplet_client(server.droplet_addr.port(), NODE_TIMEOUT, |ms| {
        clock.advance_ms(ms)
    });
    assert_droplet_answers(&results);
}
