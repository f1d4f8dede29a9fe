//! Any bytes as a RESP reply to a limit script, and as its integers.
//! Invariants: `tollgate::fuzzing::redis_reply`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzzing::redis_reply(data));
