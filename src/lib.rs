//! tollgate: a fast HTTP reverse proxy with throttling built in.

pub mod limit;
