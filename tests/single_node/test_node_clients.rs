//! The real published Node client of divvy (`@button/divvy-client@1.0.1`,
//! installed by `.ci/run` into tests/node) driven against a running server.
//! Missing node or node_modules is a failure, never a silent pass.

use crate::util;

use std::path::Path;
use std::process::Command;
use util::TestServer;

/// Runs `node tests/node/<script> 127.0.0.1 <port>` and parses its JSON line.
pub fn run_node_script(script: &str, port: u16) -> serde_json::Value {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/node");
    assert!(
        dir.join("node_modules").is_dir(),
        "tests/node/node_modules is missing: run `npm ci --prefix tests/node` (.ci/run does)"
    );
    let output = Command::new("node")
        .arg(dir.join(script))
        .arg("127.0.0.1")
        .arg(port.to_string())
        .current_dir(&dir)
        .output()
        .expect("`node` must be installed to run the client compatibility tests");
    assert!(
        output.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{script} printed {stdout:?}: {e}"))
}

#[test]
fn the_published_divvy_node_client_gets_divvys_answers() {
    let server = TestServer::start_default();
    let seen = run_node_script("divvy_client.js", server.addr.port());
    let ok = |allowed: bool, credit: i64, reset: i64| serde_json::json!({"isAllowed": allowed, "currentCredit": credit, "nextResetSeconds": reset});
    assert_eq!(seen["status"], ok(true, 999, 60));
    assert_eq!(
        seen["cookies"],
        serde_json::json!([
            ok(true, 2, 3600),
            ok(true, 1, 3600),
            ok(true, 0, 3600),
            ok(false, 0, 3600)
        ])
    );
    assert_eq!(seen["denied"], ok(false, 0, -1));
    assert_eq!(seen["quoted"], ok(true, 2, 3600));
    let credits: Vec<i64> = seen["pipelined_credits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_i64().unwrap())
        .collect();
    assert_eq!(credits, (949..=998).rev().collect::<Vec<i64>>());
}
