//! Promises about the workspace itself rather than the server's behaviour:
//! the library's modules depend on each other one way only
//! (docs/architecture.md), the cluster's files stay under 800 lines each,
//! and the declared `rust-version` covers every locked dependency. All read
//! files; nothing here starts a server.

// A test stops at the first thing that is not as it should be.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod test_file_size;
mod test_layering;
mod test_rust_version;
