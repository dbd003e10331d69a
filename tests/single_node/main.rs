//! One server, in process or as the `tollgate` binary, over real sockets: the
//! line protocol (framing, errors, pipelining), windows and algorithms on a
//! manual clock, the limits against bad clients, reload, the command line,
//! observability, droplet's two front ends, Envoy's rate limit service (gRPC),
//! and the published Node clients.
//! Every in-process server starts through `App`, as the binary does (`util`).

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../util/mod.rs"]
mod util;

mod test_algorithms;
mod test_cli;
mod test_concurrency;
mod test_droplet_lines;
mod test_droplet_node;
mod test_droplet_websocket;
mod test_envoy;
mod test_limits;
mod test_node_clients;
mod test_observability;
mod test_observability_cli;
mod test_protocol;
mod test_reload;
mod test_rule_mistakes;
mod test_windows;
