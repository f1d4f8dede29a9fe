//! tollgate: a fast HTTP reverse proxy with throttling built in.
//!
//! # Layout
//! A request flows one way through a few rooms, each owning one concept:
//!
//! - [`config`]: YAML → validated, typed config; every error with line, column and field path.
//! - [`server`]: accept loop, HTTP/1.1 + h2c, timeouts, graceful shutdown.
//! - [`route`]: first-match routing.
//! - [`proxy`]: the compiled config that serves a request end to end.
//! - [`limit`]: algorithms, keys and the stores (local, Redis) that keep per-key state.
//! - [`forward`]: pooled upstream client, header rewriting, built-in responder.
//! - [`body`], [`problem`]: the response body type and problem+json answers.
#![forbid(unsafe_code)]

pub mod body;
pub mod config;
pub mod forward;
pub mod limit;
pub mod problem;
pub mod proxy;
pub mod route;
pub mod server;
