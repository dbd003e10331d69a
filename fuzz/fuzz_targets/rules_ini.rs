//! Fuzzes the INI rule loader (rust-ini plus our validation): any text loads
//! or fails with an error, never a panic, and a loaded set ends in the default rule.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(rules) = tollgate::rules::RuleSet::from_ini(text) {
            assert!(rules.rules().last().is_some_and(|r| r.operation.is_empty()));
        }
    }
});
