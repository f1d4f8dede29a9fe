//! X-Forwarded-For / Forwarded chains behind trusted proxies: the first untrusted hop.
//! Invariants: `tollgate::fuzzing::client_ip`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzzing::client_ip(data));
