//! tollgate: a fast HTTP reverse proxy with throttling built in.
//!
//! # Layout
//! A request flows one way through a few rooms, each owning one concept:
//!
//! - [`config`]: YAML → validated, typed config (data only: each room compiles its part at
//!   `Proxy::build`); every error with line, column and field path.
//! - [`instance`]: one running tollgate (listener, admin, reloader), for `run` and `bench` alike.
//! - [`listen`]: the edge of a connection before HTTP: PROXY protocol header, TLS (SNI
//!   certificates, ALPN, client certificates); yields the [`peer::Peer`].
//! - [`server`]: accept loop, protocol detection, HTTP/1.1 + h2c, timeouts, graceful shutdown.
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz`, `/config` on the admin listener.
//! - [`reload`]: SIGHUP / file-change reloads that keep unchanged limits' state.
//! - [`framing`]: request framing checks beyond hyper's (smuggling): refused with `400`.
//! - [`target`]: one authority and one normalised path per request, decided before routing.
//! - [`route`]: first-match routing, header and query conditions, path rewrites.
//! - [`request_id`]: the request id every answer, log line and forwarded request carries.
//! - [`proxy`]: the compiled config that serves a request end to end.
//! - [`gate`]: a route's limits and concurrency cap: admit or refuse.
//! - [`answer`]: every answer tollgate makes itself (problem+json), from typed errors.
//! - [`ratelimit`]: the RateLimit header fields and `Retry-After` seconds.
//! - [`limit`]: decisions, the five algorithms as pure functions, keys, stores (local, Redis).
//! - [`forward`]: pooled upstream client (HTTP/1.1, or shared HTTP/2 connections for `h2c`
//!   and `h2`, or either by ALPN for `auto`), tunnels after a `101` (also for RFC 8441
//!   WebSockets over HTTP/2), header rewriting, built-in responder; `forward::group`: a
//!   `servers:` upstream's balancing, health and budgeted retries.
//! - [`body`]: the body types at both edges, with their read deadlines.
//! - [`cache`]: stale copies of good GET answers, served when throttled or the upstream fails.
//! - [`metrics`]: the Prometheus registry and per-route, per-limit handles.
//! - [`pki`]: certificate and key files read and checked, x509 facts, the TLS configs made
//!   from them; [`peer`]: who a client is (address, TLS facts).
//! - [`timer`]: the coarse clock for long timeouts; [`workers`]: which worker thread runs.
//! - [`explain`]: limits in plain words for `tollgate explain`; [`bench`]: the harness candidate.
//! - [`calibrate`]: `tollgate calibrate`, an open-loop load test that finds the knee and
//!   suggests limits (not on the request path).
#![forbid(unsafe_code)]

pub mod admin;
pub mod answer;
pub mod bench;
pub mod body;
pub mod cache;
pub mod calibrate;
pub mod config;
pub mod explain;
pub mod forward;
pub mod framing;
#[doc(hidden)]
pub mod fuzzing;
pub mod gate;
pub mod instance;
pub mod limit;
pub mod listen;
pub mod metrics;
pub mod peer;
pub mod pki;
pub mod proxy;
pub mod ratelimit;
pub mod reload;
pub mod request_id;
pub mod route;
pub mod server;
pub mod target;
pub mod timer;
pub mod workers;
