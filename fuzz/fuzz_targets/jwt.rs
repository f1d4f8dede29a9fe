//! A bearer token (compact JWS) and, the same bytes, a JSON Web Key Set: parsing and
//! verifying never panic, and nothing verifies without the key. Invariants: `tollgate::fuzzing::jwt`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzzing::jwt(data));
