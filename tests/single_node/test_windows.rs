//! Window semantics over a real socket with a manual clock (SPEC §4):
//! opening, rounding to the nearest second, expiry, reopening, and counter
//! identity across rule changes.

use crate::util;

use std::sync::Arc;
use tollgate::rules::RuleSet;
use util::{manual_clock, request, TestOptions, TestServer};

fn start(ini: &str) -> (TestServer, Arc<tollgate::clock::ManualClock>) {
    let clock = manual_clock();
    let server = TestServer::start(
        RuleSet::from_ini(ini).unwrap(),
        TestOptions {
            clock: clock.clone(),
            ..TestOptions::default()
        },
    );
    (server, clock)
}

#[test]
fn windows_open_round_expire_and_reopen() {
    let (server, clock) =
        start("[op=a]\ncreditLimit=2\nresetSeconds=2\n[default]\ncreditLimit=0\n");
    let mut s = server.connect();
    assert_eq!(request(&mut s, "HIT op=a"), "OK true 1 2");
    clock.advance_ms(300);
    assert_eq!(request(&mut s, "HIT op=a"), "OK true 0 2");
    clock.advance_ms(310); // 0.61 s after opening
    assert_eq!(request(&mut s, "HIT op=a"), "OK false 0 1");
    clock.advance_ms(900); // 1.51 s
    assert_eq!(request(&mut s, "HIT op=a"), "OK false 0 0");
    clock.advance_ms(489); // 1.999 s: still the same window
    assert_eq!(request(&mut s, "HIT op=a"), "OK false 0 0");
    clock.advance_ms(1); // 2.000 s: expired, the next hit opens a new window
    assert_eq!(request(&mut s, "HIT op=a"), "OK true 1 2");
    assert_eq!(request(&mut s, "HIT op=a"), "OK true 0 2");
}

#[test]
fn always_allow_and_always_deny_touch_no_counter() {
    let (server, _clock) = start("[op=allow]\ncreditLimit=7\nresetSeconds=0\n[op=deny]\ncreditLimit=0\nresetSeconds=60\n[default]\ncreditLimit=0\nresetSeconds=0\n");
    let mut s = server.connect();
    for _ in 0..3 {
        assert_eq!(request(&mut s, "HIT op=allow"), "OK true 7 0");
        assert_eq!(request(&mut s, "HIT op=deny"), "OK false 0 -1");
        assert_eq!(request(&mut s, "HIT other=1"), "OK false 0 -1");
    }
    assert_eq!(server.store.live_keys(), 0);
}

#[test]
fn changing_a_rules_limit_or_period_starts_fresh_counters_and_keeping_it_keeps_them() {
    let (server, _clock) =
        start("[op=a]\ncreditLimit=3\nresetSeconds=60\n[default]\ncreditLimit=0\n");
    let mut s = server.connect();
    assert_eq!(request(&mut s, "HIT op=a"), "OK true 2 60");
    assert_eq!(request(&mut s, "HIT op=a"), "OK true 1 60");
    // Same identity (label and comment changes do not matter): counting continues.
    server.engine.replace_rules(
        RuleSet::from_ini(
            "[op=a]\ncreditLimit=3\nresetSeconds=60\nlabel=renamed\n[default]\ncreditLimit=0\n",
        )
        .unwrap(),
    );
    assert_eq!(request(&mut s, "HIT op=a"), "OK true 0 60");
    // A new limit is a new counter, as in divvy.
    server.engine.replace_rules(
        RuleSet::from_ini("[op=a]\ncreditLimit=4\nresetSeconds=60\n[default]\ncreditLimit=0\n")
            .unwrap(),
    );
    assert_eq!(request(&mut s, "HIT op=a"), "OK true 3 60");
}
