//! Fuzzes the INI rule loader (the line pre-pass, rust-ini, our validation):
//! any text loads or fails with an error, never a panic; a loaded set ends in
//! the default rule; and whatever the pre-pass accepts, rust-ini reads into
//! exactly the sections and keys the pre-pass recorded.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(disagreement) = tollgate::rules::check_ini_prepass(text) {
            panic!("{disagreement}");
        }
        if let Ok(rules) = tollgate::rules::RuleSet::from_ini(text) {
            assert!(rules.rules().last().is_some_and(|r| r.operation.is_empty()));
        }
    }
});
