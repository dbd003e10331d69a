//! The workspace declares the oldest Rust it builds with (`rust-version`).
//! This machine's CI has one toolchain, newer than that, so the promise is
//! checked in parts: clippy's `incompatible_msrv` lint (on in CI) refuses
//! standard-library items newer than `rust-version` in our code, and this
//! test refuses a locked dependency that declares a newer `rust-version`
//! than ours (the usual way a lockfile update breaks an MSRV). Where a
//! toolchain of exactly `rust-version` is installed, tests/run-all.sh also
//! builds with it.

use std::process::Command;

/// `1.88` → `(1, 88, 0)`.
fn version(text: &str) -> (u64, u64, u64) {
    let mut parts = text.split('.').map(|part| part.parse().unwrap_or(0));
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

#[test]
fn no_locked_dependency_needs_a_newer_rust_than_the_declared_one() {
    let output = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .arg("--manifest-path")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .output()
        .expect("run cargo metadata");
    assert!(
        output.status.success(),
        "cargo metadata (offline: every locked package must be in cargo's cache; \
         `cargo fetch --locked` puts them there, as tests/run-all.sh does): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let packages = metadata["packages"].as_array().unwrap();
    let declared = env!("CARGO_PKG_RUST_VERSION");
    assert!(
        !declared.is_empty(),
        "the workspace declares no rust-version"
    );
    let newer: Vec<String> = packages
        .iter()
        .filter_map(|package| {
            let needs = package["rust_version"].as_str()?;
            (version(needs) > version(declared)).then(|| {
                format!(
                    "{} {} needs Rust {needs}",
                    package["name"].as_str().unwrap_or("?"),
                    package["version"].as_str().unwrap_or("?")
                )
            })
        })
        .collect();
    assert!(
        newer.is_empty(),
        "the workspace declares rust-version {declared}, but:\n{}",
        newer.join("\n")
    );
}
