//! tollgate: a fast HTTP reverse proxy with throttling built in.
//!
//! # Layout
//! A request flows one way through a few rooms, each owning one concept:
//!
//! - [`config`]: YAML → validated, typed config; every error with line, column and field path.
//! - [`server`]: accept loop, HTTP/1.1 + h2c, timeouts, graceful shutdown.
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz`, `/config` on the admin listener.
//! - [`reload`]: SIGHUP / file-change reloads that keep unchanged limits' state.
//! - [`route`]: first-match routing.
//! - [`proxy`]: the compiled config that serves a request end to end.
//! - [`gate`]: a route's limits and concurrency cap; 429/503 answers and RateLimit headers.
//! - [`limit`]: decisions, the five algorithms as pure functions, keys, stores (local, Redis).
//! - [`forward`]: pooled upstream client, header rewriting, built-in responder.
//! - [`cache`]: stale copies of good GET answers, served when throttled or the upstream fails.
//! - [`metrics`]: the Prometheus registry and per-route, per-limit handles.
//! - [`explain`]: limits in plain words for `tollgate explain`.
//! - [`body`], [`problem`]: the response body type and problem+json answers.
#![forbid(unsafe_code)]

pub mod admin;
pub mod answer;
pub mod bench;
pub mod body;
pub mod cache;
pub mod config;
pub mod explain;
pub mod forward;
#[doc(hidden)]
pub mod fuzzing;
pub mod gate;
pub mod limit;
pub mod metrics;
pub mod proxy;
pub mod ratelimit;
pub mod reload;
pub mod route;
pub mod server;
pub mod target;
pub mod timer;
