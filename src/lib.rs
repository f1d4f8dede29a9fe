//! tollgate: a fast HTTP reverse proxy with throttling built in.
//!
//! # Layout
//! A request flows one way through a few rooms, each owning one concept; `ARCHITECTURE.md`
//! gives their layers and the edges allowed between them (`tests/it/layers.rs` checks them):
//!
//! - [`config`]: YAML → validated, typed config (data only: each room compiles its part at
//!   `Proxy::build`); every error with line, column and field path.
//! - [`instance`]: one running tollgate (listener, admin, reloader), for `run` and `bench` alike;
//!   `instance::process`: the process shape of `tollgate run` (workers, sockets, signals).
//! - [`listen`]: the edge of a connection before HTTP: PROXY protocol header, TLS (SNI
//!   certificates, ALPN, client certificates); yields the [`peer::Peer`].
//! - [`server`]: accept loop, protocol detection, HTTP/1.1 + h2c, timeouts, graceful shutdown.
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz`, `/config` on the admin listener.
//! - [`acme`]: certificates tollgate gets and renews itself (an ACME CA, its local CA), their
//!   storage and locks, HTTP-01 answers; fed to the listeners' SNI stores.
//! - [`reload`]: SIGHUP / file-change reloads that keep unchanged limits' state.
//! - [`framing`]: request framing checks beyond hyper's (smuggling): refused with `400`.
//! - [`target`]: one authority and one normalised path per request, decided before routing.
//! - [`route`]: first-match routing, header and query conditions, path rewrites.
//! - [`request_id`]: the request id every answer, log line and forwarded request carries.
//! - [`proxy`]: the compiled config that serves a request end to end, in phases (route, admit,
//!   forward, settle, finish and log: `proxy/serve.rs`).
//! - [`jwt`]: bearer tokens (compact JWS) and JSON Web Key Sets, parsed and verified (pure,
//!   no I/O, the time given).
//! - [`auth`]: who a request is: a JWT or an API key verified once, between route and
//!   admit, yielding the `Identity` that limit keys and plans read.
//! - [`step`]: a route's steps (`response_headers`, `cors`, `auth`, and the `extensions` a
//!   program that embeds tollgate registers), run in a declared order on the request's way in
//!   and on every answer's way out.
//! - [`gate`]: a route's limits and concurrency cap: admit or refuse.
//! - [`answer`]: every answer tollgate makes itself (problem+json), from typed errors.
//! - [`ratelimit`]: the RateLimit header fields and `Retry-After` seconds.
//! - [`limit`]: decisions, the five algorithms as pure functions, keys, stores (local, Redis).
//! - [`forward`]: pooled upstream client (HTTP/1.1, or shared HTTP/2 connections for `h2c`
//!   and `h2`, or either by ALPN for `auto`), tunnels after a `101` (also for RFC 8441
//!   WebSockets over HTTP/2), header rewriting, built-in responder; `forward::group`: a
//!   `servers:` upstream's balancing, health and budgeted retries.
//! - [`body`]: the body types at both edges, with their read deadlines.
//! - [`compress`]: answers encoded on their way back (gzip, brotli, zstd) by `Accept-Encoding`,
//!   streamed, flushed per event.
//! - [`cache`]: stale copies of good GET answers, served when throttled or the upstream fails.
//! - [`metrics`]: the Prometheus registry and per-route, per-limit handles.
//! - [`pki`]: certificate and key files read and checked, x509 facts, the TLS configs made
//!   from them; [`peer`]: who a client is (address, TLS facts).
//! - [`timer`]: the coarse clock for long timeouts; [`workers`]: which worker thread runs.
//! - [`explain`]: limits in plain words for `tollgate explain`; [`bench`]: the harness candidate.
//! - [`calibrate`]: `tollgate calibrate`, an open-loop load test that finds the knee and
//!   suggests limits (not on the request path).
//! - [`trust`]: `tollgate trust`, the local CA's root printed or installed for the system and
//!   the browsers.
//! - [`replay`]: `tollgate replay`, a log run through a candidate config's routes and limits
//!   on the log's own clock (not on the request path).
#![forbid(unsafe_code)]

// The façade: what the binary, the benches, the fuzz targets and the integration tests use.
// Every other room is private to the crate, so the compiler sees what nothing calls.
pub mod bench;
pub mod calibrate;
pub mod config;
pub mod explain;
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
pub mod instance;
pub mod limit;
pub mod replay;
pub mod step;
pub mod trust;

pub use admin::{effective as effective_config, serve as serve_admin, Readiness};
pub use pki::x509;
pub use proxy::{Proxy, Shared};
pub use ratelimit::retry_after_capped;
pub use reload::{LogSwitch, Reloader};
pub use request_key::{KeyCtx, TrustedProxies};
pub use server::{serve, serve_all};
pub use timer::now_ms as coarse_now_ms;

mod acme;
mod admin;
mod answer;
mod auth;
mod body;
mod cache;
mod compress;
mod forward;
mod framing;
// Under test, for the property tests and regressions beside the entry points.
#[cfg(all(test, not(fuzzing)))]
#[allow(unused_imports, dead_code)]
mod fuzzing;
mod gate;
mod jwt;
mod listen;
mod metrics;
mod peer;
mod pki;
mod proxy;
mod ratelimit;
mod reload;
mod request_id;
mod request_key;
mod route;
mod server;
mod target;
mod timer;
mod trace;
mod workers;
