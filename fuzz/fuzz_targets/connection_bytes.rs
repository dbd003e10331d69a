//! Fuzzes the whole request path on a byte stream, as a connection sees it:
//! framing into lines, parsing, matching the embedded default rules, the
//! memory store and reply encoding. Every reply must be one well-formed line.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};
use tollgate::engine::{Engine, Outcome};

fn engine() -> &'static Arc<Engine> {
    static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let store = Arc::new(tollgate::store::MemoryStore::new(
            tollgate::store::MemoryStoreConfig {
                stripes: 16,
                live_keys_max: 10_000,
            },
        ));
        Arc::new(Engine::new(
            tollgate::rules::RuleSet::embedded_default(),
            Arc::new(tollgate::store::MemoryBackend { store }),
            Arc::new(tollgate::clock::SystemClock),
            tollgate::metrics::Metrics::new(),
            Default::default(),
        ))
    })
}

fuzz_target!(|data: &[u8]| {
    let engine = engine();
    let mut rest = data;
    let mut out = Vec::new();
    while let Some((line, used)) = tollgate::protocol::split_line(rest) {
        rest = &rest[used..];
        out.clear();
        match engine.execute(line, engine.arrival()) {
            Outcome::Now(reply) => {
                reply.encode(&mut out);
                assert!(out.ends_with(b"\n"));
                assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 1);
                if reply.closes_connection() {
                    break;
                }
            }
            Outcome::Later(_) | Outcome::Deferred(_) => {
                unreachable!("the memory backend answers at once")
            }
        }
    }
});
