//! Fuzzes Envoy's rate limit requests on arbitrary gRPC message bytes: the
//! decoder accepts or refuses them, never panics; a decoded request is
//! mapped to divvy operations (or refused whole), each operation is decided
//! by a real engine on the memory backend, and the statuses and the response
//! are built and encoded, without panicking and without an answer beyond the
//! request's bounds; the response bytes the server writes by hand decode to
//! prost's response of the same statuses.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};
use tollgate::clock::ManualClock;
use tollgate::engine::{Engine, OperationOutcome, UnavailablePolicy};
use tollgate::envoy::mapping::{
    decode_request, descriptor_status, encode_response, operations, response,
};
use tollgate::envoy::EnvoyLimits;
use tollgate::metrics::Metrics;
use tollgate::rules::RuleSet;
use tollgate::store::{MemoryBackend, MemoryStore, MemoryStoreConfig};

const RULES: &str = "\
[domain=edge path=/login]
creditLimit = 3
resetSeconds = 60
actorField = ip

[domain=edge path=/api/*]
creditLimit = 5
resetSeconds = 30
matchPolicy = canary

[domain=closed]
creditLimit = 0
resetSeconds = 60

[domain=* user=u*]
creditLimit = 2
resetSeconds = 1
actorField = user

[default]
creditLimit = 10
resetSeconds = 0
";

fn engine() -> &'static Arc<Engine> {
    static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let store = Arc::new(MemoryStore::new(MemoryStoreConfig {
            stripes: 4,
            live_keys_max: 10_000,
        }));
        Arc::new(Engine::new(
            RuleSet::from_ini(RULES).expect("the fuzz rules are valid"),
            Arc::new(MemoryBackend { store }),
            Arc::new(ManualClock::new(1_700_000_000_000)),
            Metrics::new(),
            UnavailablePolicy::Error,
        ))
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(request) = decode_request(data) else {
        return;
    };
    let limits = EnvoyLimits {
        descriptors_max: 8,
        entries_per_descriptor_max: 8,
        hits_addend_max: 16,
    };
    let Ok(operations) = operations(&request, &limits) else {
        return;
    };
    assert_eq!(operations.len(), request.descriptors.len());
    let engine = engine();
    let mut statuses = Vec::new();
    let mut answers = Vec::new();
    for operation in &operations {
        assert!(operation.hits >= 1 && u64::from(operation.hits) <= limits.hits_addend_max);
        let arrival = engine.arrival();
        let OperationOutcome::Now(answer) = engine.decide_operation(
            &operation.pairs(&request),
            operation.hits,
            operation.peek,
            arrival,
        ) else {
            panic!("the memory backend decides at once");
        };
        statuses.push(descriptor_status(&answer).expect("the memory backend does not fail"));
        answers.push(answer);
    }
    // The bytes the server sends are prost's encoding of the statuses.
    let mut encoded = Vec::new();
    encode_response(&answers, &mut encoded).expect("the memory backend does not fail");
    let expected = response(statuses);
    assert_eq!(decode_like(&expected, &encoded[5..]), expected);
});

/// `bytes` decoded as a message of `like`'s type.
fn decode_like<M: prost::Message + Default>(_like: &M, bytes: &[u8]) -> M {
    M::decode(bytes).expect("the encoded response decodes")
}
