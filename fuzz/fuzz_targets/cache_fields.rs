//! A response head: Cache-Control, Vary, Expires and Date as the stale-copy store reads them.
//! Invariants: `tollgate::fuzzing::cache_fields`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzzing::cache_fields(data));
