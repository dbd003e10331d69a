//! Tollgate on a real `redis-server` (started per test on a free port): the
//! redis backend in divvy's key layout (for `HIT` lines and Envoy's gRPC
//! calls alike), Redis failing under load, and persistence of in-memory
//! counters across restarts. Without `redis-server` these tests fail, unless
//! `TOLLGATE_SKIP_REDIS=1` outside CI (`util::redis`).

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../util/mod.rs"]
mod util;

mod test_backend;
mod test_envoy;
mod test_failures;
mod test_persist;
