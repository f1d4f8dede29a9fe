//! A route's steps: the work a route declares besides routing, limits and forwarding, each
//! in one file of this room with its compiled form, its request side, its answer side, its
//! counters and its `explain` line, and registered once, in [`builtins!`] below. The request
//! path (`proxy::serve`) runs a route's steps without knowing any of them:
//!
//! - *arrive*, in the declared order, before the route's limits: a step may let the request
//!   on, answer it at once ([`Flow::Answer`], e.g. a CORS preflight), refuse it
//!   ([`Flow::Refuse`], e.g. bad credentials), or have it answered once the limits admit it
//!   ([`Flow::AfterLimits`]). The first that does not let it on ends the request side.
//! - *answer*, in the reverse order, on every answer of the route: the upstream's, the
//!   responder's, a stale copy, tollgate's own refusals and a step's own answer. A step sees
//!   where the answer came from ([`Answered`]) and may change its fields or wrap its body.
//!
//! What a step learns of the request for its answer side is kept in [`Seen`], inline in the
//! request's future (nothing is allocated per request for it). Built-in steps are an enum,
//! dispatched statically; a route without steps has an empty slice and pays one length check
//! per side. Steps of programs that embed tollgate are registered by name ([`register`]) and
//! listed under a route's `extensions:`; they cost a virtual call on the routes that use them.
//!
//! Invariants: a step never forwards; the answer side runs once per answer; configs are data
//! (`config::cors`, `config::auth`...), compiled here at `Proxy::build`.

mod auth;
mod cache;
mod compress;
mod cors;
mod extension;
mod headers;

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderValue, Response};

use crate::answer::Error;
use crate::body::Body;
use crate::config::{Config, Route};
use crate::limit::{Clock, RedisClient};
use crate::metrics::Metrics;
use crate::request_key::TrustedProxies;
use crate::target::Target;

pub use extension::{register, Answer, Step, Value};

/// Where an answer came from, as the answer side sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answered {
    /// The upstream's, forwarded.
    Upstream,
    /// The built-in responder's (`respond:`).
    Responder,
    /// A stored copy of an upstream's answer: a cache hit (`cache:`), or a stale copy standing
    /// in for a refusal or a failure.
    Stale,
    /// One tollgate made itself: a refusal (`429`, `401`, `503`...), a step's own answer, the
    /// last hop's.
    Own,
    /// The start of a tunnel (`101`, or a CONNECT's `200`): what follows is no HTTP answer.
    Tunnel,
}

/// What the request side decided.
pub(crate) enum Flow {
    /// On to the next step, then the limits.
    Next,
    /// Answered now, never forwarded; the answer side of every step still runs.
    Answer(Response<Body>),
    /// Answered now by a stored copy (a cache hit): as [`Flow::Answer`], but the answer side
    /// sees it as [`Answered::Stale`] (encoded for the client like the upstream's).
    Stored(Response<Body>),
    /// Refused: the answer room renders the error (a stale copy may stand in).
    Refuse(Error),
    /// Answered by this step once the route's limits admit the request (never forwarded); no
    /// later step's request side runs (a CORS preflight carries no credentials to check).
    AfterLimits,
}

/// A step's request side: decided now, or after a wait (a key set to fetch, a store to ask).
// Returned by value and matched at once, never kept across an await: boxing the answer would
// allocate for each early answer instead.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Arrived<'a> {
    Now(Flow),
    Later(Pin<Box<dyn Future<Output = Flow> + Send + 'a>>),
}

/// What a step's request side reads of the request.
pub(crate) struct Arrival<'a> {
    /// The head as the client sent it (the target decided); a step may change it.
    pub parts: &'a mut Parts,
    pub target: &'a Target,
    pub route: &'a str,
    pub request_id: Option<&'a crate::request_id::RequestId>,
    pub peer: IpAddr,
    pub trusted: &'a TrustedProxies,
    /// The limits' clock (tests pass a manual one).
    pub clock: &'a dyn Clock,
    /// The access log line's `steps` field, when the log is on.
    pub notes: Notes<'a>,
    /// Sends a request of the step's own through the route in the background.
    pub refresh: &'a dyn Refresh,
}

/// A request a step sends in the background through the request path (routed, limited and
/// forwarded like a client's, from the same client): a cache's revalidation while it serves
/// a stale copy. `flight` is held until its answer is read to the end.
pub(crate) trait Refresh: Send + Sync {
    fn refresh(&self, head: Parts, flight: crate::cache::Flight);
}

/// Where steps say what they did for the access log (`cors=origin_refused`); a no-op when the
/// log is off.
pub(crate) struct Notes<'a>(pub Option<&'a mut String>);

impl Notes<'_> {
    pub(crate) fn add(&mut self, step: &str, what: &str) {
        if let Some(line) = self.0.as_deref_mut() {
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(step);
            line.push('=');
            line.push_str(what);
        }
    }
}

/// What the request side of a route's steps leaves for their answer side, for one request.
/// Inline in the request's future: each field is one step's, and small.
#[derive(Default)]
pub(crate) struct Seen {
    /// `response_headers`: its values with variables, rendered from the request as it came.
    headers: Option<crate::forward::rules::Values>,
    /// `compression`: the request's `Accept-Encoding`, and whether it is a `HEAD` or `CONNECT`.
    compression: Option<crate::compress::Asked>,
    /// CORS: the `Access-Control-Allow-Origin` this request's answers carry (`None`: no
    /// CORS fields, for a request without `Origin` or from an origin not allowed).
    cors: Option<HeaderValue>,
    /// `cache`: what the request found and what its answer does to the store (boxed: only
    /// requests of a route with a cache have one).
    cache: Option<Box<cache::Seen>>,
}

/// What compiling a route's steps reads (at `Proxy::build`).
pub(crate) struct Build<'a> {
    pub config: &'a Config,
    pub route: &'a Route,
    pub metrics: &'a Metrics,
    pub redis: Option<&'a Arc<RedisClient>>,
    /// The shared key set of a JWT `jwks` URL (one per URL, kept across reloads).
    pub remote_for: &'a mut dyn FnMut(&http::Uri, Duration) -> Arc<crate::auth::remote::Remote>,
    /// The store of copies (`cache:`), shared by every route.
    pub cache: &'a crate::cache::Cache,
}

/// One built-in step: its compiled form is made from its config, and it may act on either
/// side (each side does nothing unless the step says otherwise).
trait Builtin: Sized {
    /// The route's step, if its config has it.
    fn compile(b: &mut Build<'_>) -> Option<Self>;

    /// The step's `explain` line, from the route's config (no proxy is built for `explain`).
    fn describe(route: &Route, config: &Config) -> Option<String>;

    /// Whether [`Builtin::answer`] does anything: a route whose steps all say no skips the
    /// answer side.
    const ANSWERS: bool = true;

    fn arrive<'a>(&'a self, a: &'a mut Arrival<'_>, seen: &mut Seen) -> Arrived<'a> {
        let _ = (a, seen);
        Arrived::Now(Flow::Next)
    }

    /// The answer of a request this step's request side put off with [`Flow::AfterLimits`],
    /// now that the limits admitted it, and where it comes from.
    fn admitted(&self, parts: &Parts, seen: &mut Seen) -> (Response<Body>, Answered) {
        let _ = (parts, seen);
        (Response::new(Body::empty()), Answered::Own)
    }

    fn answer(&self, seen: &mut Seen, resp: &mut Response<Body>, from: Answered, notes: &mut Notes<'_>) {
        let _ = (seen, resp, from, notes);
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
            fn answers(&self) -> bool {
                match self {
                    $(Kind::$variant(_) => <$ty as Builtin>::ANSWERS,)*
                }
            }

            fn compile(b: &mut Build<'_>, out: &mut Vec<Kind>) {
                $(if let Some(s) = <$ty as Builtin>::compile(b) {
                    out.push(Kind::$variant(Box::new(s)));
                })*
            }

            fn describe(route: &Route, config: &Config, out: &mut Vec<String>) {
                $(out.extend(<$ty as Builtin>::describe(route, config));)*
            }

            fn arrive<'a>(&'a self, a: &'a mut Arrival<'_>, seen: &mut Seen) -> Arrived<'a> {
                match self {
                    $(Kind::$variant(s) => s.arrive(a, seen),)*
                }
            }

            fn admitted(&self, parts: &Parts, seen: &mut Seen) -> (Response<Body>, Answered) {
                match self {
                    $(Kind::$variant(s) => s.admitted(parts, seen),)*
                }
            }

            fn answer(&self, seen: &mut Seen, resp: &mut Response<Body>, from: Answered, notes: &mut Notes<'_>) {
                match self {
                    $(Kind::$variant(s) => s.answer(seen, resp, from, notes),)*
                }
            }
        }
    };
}

builtins! {
    /// `response_headers`: first on the way in (its values read the request as it came), so
    /// last on the way out (the route's own rules have the last word on every answer).
    Headers(headers::Headers),
    /// `compression`: before any step that may answer or refuse (so that it knows every
    /// request's `Accept-Encoding`), on the way out after every other step but
    /// `response_headers` (whose rules have the last word, on `Vary` too).
    Compression(compress::Compression),
    /// `cors`: before credentials, which a preflight never carries.
    Cors(cors::Cors),
    /// `auth`: who the client is, for the limits' keys and plans.
    Auth(auth::Auth),
    /// `extensions`: the steps a program that embeds tollgate registered, in file order.
    Extensions(extension::Extensions),
    /// `cache`: last on the way in (a hit is served only to a request every other step let
    /// on: authenticated, CORS-checked), first on the way out (it stores the upstream's
    /// answer as sent, before any step changes or encodes it).
    Cache(cache::Cache),
}

/// A route's compiled steps (empty for most routes), and whether any has an answer side.
pub(crate) struct Steps(Box<[Kind]>, bool);

impl Steps {
    pub(crate) fn new(b: &mut Build<'_>) -> Steps {
        let mut out = Vec::new();
        Kind::compile(b, &mut out);
        let answers = out.iter().any(Kind::answers);
        Steps(out.into_boxed_slice(), answers)
    }

    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the answer side does anything on this route.
    #[inline(always)]
    pub(crate) fn answers(&self) -> bool {
        self.1
    }

    /// The request side, in order, until a step does not let the request on: what it decided,
    /// and which step decided it (a byte: a route has a handful of steps).
    pub(crate) async fn arrive(&self, a: &mut Arrival<'_>, seen: &mut Seen) -> (Flow, u8) {
        for (i, step) in (0..=u8::MAX).zip(self.0.iter()) {
            let flow = match step.arrive(a, seen) {
                Arrived::Now(flow) => flow,
                Arrived::Later(wait) => wait.await,
            };
            if !matches!(flow, Flow::Next) {
                return (flow, i);
            }
        }
        (Flow::Next, u8::MAX)
    }

    /// The answer of the request step `i` put off until the limits admitted it, and where it
    /// comes from.
    pub(crate) fn admitted(&self, i: u8, parts: &Parts, seen: &mut Seen) -> (Response<Body>, Answered) {
        match self.0.get(usize::from(i)) {
            Some(step) => step.admitted(parts, seen),
            None => (Response::new(Body::empty()), Answered::Own),
        }
    }

    /// The answer side, in the reverse order, on `resp`.
    pub(crate) fn answer(&self, seen: &mut Seen, resp: &mut Response<Body>, from: Answered, mut notes: Notes<'_>) {
        for step in self.0.iter().rev() {
            step.answer(seen, resp, from, &mut notes);
        }
    }

    /// The compiled JWT or API key check, if the route has one (its key set is shared across
    /// reloads).
    pub(crate) fn auth(&self) -> Option<&crate::auth::Auth> {
        self.0.iter().find_map(|s| match s {
            Kind::Auth(a) => Some(a.inner()),
            _ => None,
        })
    }
}

/// The `explain` lines of `route`'s steps, in their order.
pub(crate) fn describe(route: &Route, config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    Kind::describe(route, config, &mut out);
    out
}
