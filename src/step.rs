//! A route's steps: the work a route declares besides routing, limits and forwarding, each
//! in one file of this room with its compiled form, its request side, its answer side, its
//! counters and its `explain` line, and registered once, in [`builtins!`] below. The request
//! path (`proxy::serve`) runs a route's steps without knowing any of them:
//!
//! - *arrive*, in the declared order, before the route's limits;
//! - *answer*, in the reverse order, on every answer of the route: the upstream's, the
//!   responder's, a stale copy, tollgate's own refusals. A step sees where the answer came
//!   from ([`Answered`]) and may change its fields or wrap its body.
//!
//! What a step learns of the request for its answer side is kept in [`Seen`], inline in the
//! request's future (nothing is allocated per request for it). Built-in steps are an enum,
//! dispatched statically; a route without steps has an empty slice and pays one length check
//! per side.
//!
//! Invariants: a step never forwards; the answer side runs once per answer; configs are data
//! (`config::gateway`...), compiled here at `Proxy::build`.

mod compress;
mod headers;

use std::net::IpAddr;

use http::request::Parts;
use http::Response;

use crate::body::Body;
use crate::config::{Config, Route};
use crate::limit::TrustedProxies;
use crate::target::Target;

/// Where an answer came from, as the answer side sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answered {
    /// The upstream's, forwarded.
    Upstream,
    /// The built-in responder's (`respond:`).
    Responder,
    /// A stale copy of an upstream's answer, standing in for a refusal or a failure.
    Stale,
    /// One tollgate made itself: a refusal (`429`, `401`, `503`...), the last hop's.
    Own,
    /// The start of a tunnel (`101`, or a CONNECT's `200`): what follows is no HTTP answer.
    Tunnel,
}

/// What a step's request side reads of the request.
pub(crate) struct Arrival<'a> {
    /// The head as the client sent it (the target decided); a step may change it.
    pub parts: &'a mut Parts,
    pub target: &'a Target,
    pub route: &'a str,
    pub request_id: Option<&'a str>,
    pub peer: IpAddr,
    pub trusted: &'a TrustedProxies,
}

/// What the request side of a route's steps leaves for their answer side, for one request.
/// Inline in the request's future: each field is one step's, and small.
#[derive(Default)]
pub(crate) struct Seen {
    /// `response_headers`: its values with variables, rendered from the request as it came.
    headers: Option<crate::forward::rules::Values>,
    /// `compression`: the request's `Accept-Encoding`, and whether it is a `HEAD` or `CONNECT`.
    compression: Option<crate::compress::Asked>,
}

/// What compiling a route's steps reads (at `Proxy::build`).
pub(crate) struct Build<'a> {
    pub route: &'a Route,
    pub metrics: &'a crate::metrics::Metrics,
}

/// One built-in step: its compiled form is made from its config, and it may act on either
/// side (each side does nothing unless the step says otherwise).
trait Builtin: Sized {
    /// The route's step, if its config has it.
    fn compile(b: &mut Build<'_>) -> Option<Self>;

    /// The step's `explain` line, from the route's config (no proxy is built for `explain`).
    fn describe(route: &Route, config: &Config) -> Option<String>;

    fn arrive(&self, a: &mut Arrival<'_>, seen: &mut Seen) {
        let _ = (a, seen);
    }

    fn answer(&self, seen: &mut Seen, resp: &mut Response<Body>, from: Answered) {
        let _ = (seen, resp, from);
    }
}

/// The built-in steps, in the order their request side runs (the answer side runs in the
/// reverse order, as in Envoy's filter chain, so the first to see the request is the last to
/// touch its answer). Adding a step is a line here, its file, and its config.
macro_rules! builtins {
    ($($(#[$doc:meta])* $variant:ident($ty:ty),)*) => {
        enum Kind {
            $($(#[$doc])* $variant(Box<$ty>),)*
        }

        impl Kind {
            fn compile(b: &mut Build<'_>, out: &mut Vec<Kind>) {
                $(if let Some(s) = <$ty as Builtin>::compile(b) {
                    out.push(Kind::$variant(Box::new(s)));
                })*
            }

            fn describe(route: &Route, config: &Config, out: &mut Vec<String>) {
                $(out.extend(<$ty as Builtin>::describe(route, config));)*
            }

            fn arrive(&self, a: &mut Arrival<'_>, seen: &mut Seen) {
                match self {
                    $(Kind::$variant(s) => s.arrive(a, seen),)*
                }
            }

            fn answer(&self, seen: &mut Seen, resp: &mut Response<Body>, from: Answered) {
                match self {
                    $(Kind::$variant(s) => s.answer(seen, resp, from),)*
                }
            }
        }
    };
}

builtins! {
    /// `response_headers`: first on the way in (its values read the request as it came), so
    /// last on the way out (the route's own rules have the last word on every answer).
    Headers(headers::Headers),
    /// `compression`: on the way out after every other step but `response_headers` (whose
    /// rules have the last word, on `Vary` too).
    Compression(compress::Compression),
}

/// A route's compiled steps (empty for most routes).
pub(crate) struct Steps(Box<[Kind]>);

impl Steps {
    pub(crate) fn new(b: &mut Build<'_>) -> Steps {
        let mut out = Vec::new();
        Kind::compile(b, &mut out);
        Steps(out.into_boxed_slice())
    }

    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The request side, in order.
    pub(crate) fn arrive(&self, a: &mut Arrival<'_>, seen: &mut Seen) {
        for step in self.0.iter() {
            step.arrive(a, seen);
        }
    }

    /// The answer side, in the reverse order, on `resp`.
    pub(crate) fn answer(&self, seen: &mut Seen, resp: &mut Response<Body>, from: Answered) {
        for step in self.0.iter().rev() {
            step.answer(seen, resp, from);
        }
    }
}

/// The `explain` lines of `route`'s steps, in their order.
pub(crate) fn describe(route: &Route, config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    Kind::describe(route, config, &mut out);
    out
}
