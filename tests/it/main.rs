//! Integration tests: tollgate in-process on 127.0.0.1:0, real upstreams and clients.
//! One binary for all of them, so the suite links once.

#[path = "../support/mod.rs"]
mod support;

mod acme;
mod adaptive;
mod admin_limits;
mod auth;
mod cache;
mod calibrate;
mod cli;
mod compression;
mod cors;
mod dashboard;
mod discovery;
mod docs;
mod drain;
mod errors;
mod forwarding;
mod framing;
mod gateway;
mod groups;
mod grpc;
mod guides;
mod h2_abuse;
mod h2_upstream;
mod hops;
mod hostile_config;
mod http3;
mod layers;
mod limits;
mod listener;
mod live_reload;
mod local_ca;
mod memory;
mod operate;
mod products;
mod proxy_protocol;
mod redis;
mod replay;
mod responder;
mod semantics;
mod server;
mod splits;
mod stale;
mod steps;
mod tls;
mod tls_upstream;
mod traces;
mod tunnel;
mod upstream_framing;
mod workers;
