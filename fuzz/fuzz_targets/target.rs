//! A request line and Host fields: one canonical authority and one normalised path.
//! Invariants: `tollgate::fuzzing::target`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzzing::target(data));
