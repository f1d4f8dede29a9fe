//! A request head with a key spec: hashing reads only the named, capped material.
//! Invariants: `tollgate::fuzzing::key`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzzing::key(data));
