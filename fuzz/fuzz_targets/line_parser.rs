//! Fuzzes the divvy line parser on arbitrary bytes (decoded as the server
//! does: UTF-8, lossily): it must never panic, and a successful parse must
//! only hold keys and values that are substrings of the line.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let line = String::from_utf8_lossy(data);
    let parsed = tollgate::protocol::parse_line(&line);
    if let Ok(command) = &parsed {
        for (key, value) in command.pairs.iter() {
            assert!(line.contains(key) && line.contains(value));
        }
    }
});
