//! Any bytes as a config file: loaded, or an error positioned inside the text.
//! Invariants: `tollgate::fuzzing::config`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzzing::config(data));
