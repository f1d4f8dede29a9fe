//! Every answer tollgate makes itself, in one place. The other rooms return an [`Error`] that
//! says what went wrong and whose fault it was ([`Source`]); this module turns it into the
//! client's answer (status, `application/problem+json` body, `Retry-After` where it applies),
//! the metric label and the access-log field. No other room builds an error page.
//!
//! Problem types are the IANA-registered ones where one exists (`quota-exceeded`,
//! `temporary-reduced-capacity`), and tollgate's own under a base URI (`problems.type_base`,
//! by default [`crate::config::DEFAULT_PROBLEM_TYPE_BASE`], a URN: the project owns no domain
//! to put documents under) otherwise.
//!
//! Answers that repeat (a flood of 429s or 503s on one route) are rendered once and cloned.
//!
//! One concept, though over 600 lines: every answer tollgate makes itself, and the table of
//! their kinds.

mod doc;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use prometheus_client::metrics::counter::Counter;
use smallvec::SmallVec;

use crate::body::Body;
use crate::metrics::Metrics;
use crate::ratelimit;
use doc::Doc;

pub use crate::body::ClientBodyError as ClientBody;

/// IANA's registry of problem types (RFC 9457 §4.2).
pub const IANA_BASE: &str = "https://iana.org/assignments/http-problem-types#";

pub const CONTENT_TYPE: HeaderValue = HeaderValue::from_static("application/problem+json");

/// A route's 429 is kept for each Retry-After of 1 to this many seconds.
const CACHED_SECS: usize = 64;

/// Whose fault a failure is; it decides what may follow (stale-if-error only for upstream
/// failures) and how it is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The client's request or connection.
    Downstream,
    /// The upstream: connect, timeout, broken connection, a response that cannot be passed on.
    Upstream,
    /// The shared limit store (Redis) with `on_error: deny`.
    Store,
    /// tollgate's own rules: no route, throttled, over capacity.
    Policy,
    /// A fault of tollgate itself.
    Internal,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Downstream => "downstream",
            Source::Upstream => "upstream",
            Source::Store => "store",
            Source::Policy => "policy",
            Source::Internal => "internal",
        }
    }
}

/// The underlying cause of a failure (an I/O or protocol error, in words), kept with the
/// error for the access log and debug logs; never part of what the client is told. It
/// describes and does not decide: any two causes compare equal.
#[derive(Debug, Clone, Default)]
pub struct Cause(Option<Arc<str>>);

impl Cause {
    pub fn of(e: &dyn std::fmt::Display) -> Cause {
        Cause(Some(Arc::from(e.to_string())))
    }

    pub fn text(&self) -> Option<&Arc<str>> {
        self.0.as_ref()
    }
}

impl PartialEq for Cause {
    fn eq(&self, _: &Cause) -> bool {
        true
    }
}

impl Eq for Cause {}

/// What went wrong upstream before a response head could be passed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamFailure {
    /// No connection could be made (refused, unreachable, connect timeout): 502.
    Connect(Cause),
    /// `protocol: h2`: the upstream's TLS handshake did not choose `h2` by ALPN: 502, counted
    /// and typed as [`UpstreamFailure::Connect`], with a detail of its own.
    NotH2,
    /// No response head within the upstream's `timeout`: 504.
    Timeout,
    /// The connection broke before a response head arrived: 502.
    Broken(Cause),
    /// The response head cannot be passed on (framing, an unasked-for 101): 502.
    BadResponse(&'static str),
    /// No server of a group may take requests (all ejected or failing their checks): 503
    /// with Retry-After no shorter than the earliest re-admission. `unresolved`: the group has
    /// no server at all, its `resolve:` names having given no address yet.
    Unavailable { retry_after_secs: u32, unresolved: bool },
}

/// Why a stale copy is wanted (the answer a stale copy stands in for); it decides the `Cache-Status` and whether the response's
/// `stale-if-error` applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleReason {
    /// The gate rejected the request; nothing went upstream.
    Throttled,
    /// The upstream failed; `status` is what it answered, or what tollgate would answer for a
    /// failure without a response (502 connect failure, 504 timeout).
    UpstreamError { status: u16 },
}

/// The limits that denied a request: (limit index in the route, its Retry-After seconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied {
    pub limits: SmallVec<[(usize, u64); 2]>,
    /// The longest of their waits: the request is admissible after all of them.
    pub retry_after_secs: u64,
    /// The client's own `RateLimit-Policy` when it is not the route's (a plan tier's).
    pub policy: Option<Box<HeaderValue>>,
}

/// Why tollgate answers a request itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The request head cannot be served as sent (path, host, framing): 400, and the
    /// connection is closed, since what follows on it cannot be trusted.
    BadRequest(&'static str),
    /// The client's request body failed before an answer's head was sent: 400.
    ClientBody(ClientBody),
    /// No route matches: 404.
    NoRoute,
    /// The route's limits deny the request: 429.
    Throttled(Denied),
    /// The route's concurrency cap is full: 503.
    OverCapacity,
    /// The route's tunnels (`tunnels.max`) are all open: an upgrade is refused with 503.
    TooManyTunnels,
    /// The route does not take this method (`TRACE` unless listed in `methods:`): 405 with
    /// `Allow`.
    MethodNotAllowed,
    /// The request body is longer than the route reads (`respond.max_body`, the bound): 413.
    TooLarge(u64),
    /// The client's plan tier is `deny`: 403.
    Forbidden,
    /// Limit `limit`'s store cannot decide and its policy refuses: 503.
    StoreUnavailable { limit: usize, retry_after_secs: u64 },
    /// The upstream failed: 502 or 504.
    Upstream(UpstreamFailure),
    /// tollgate itself failed: 500.
    Internal(&'static str),
    /// The route's `auth` takes no request without good credentials, and this one had none
    /// or bad ones: 401 with a `WWW-Authenticate` challenge.
    Unauthenticated(Challenge),
    /// A verified token for another audience: 403 (RFC 6750's `insufficient_scope`).
    WrongAudience(Challenge),
    /// The store of API keys cannot answer, or a key set URL was never read: 503.
    AuthUnavailable,
    /// A CORS preflight the route's `cors` does not allow (the origin, the method or a field
    /// it asks for; the reason is the detail): 403, without CORS fields.
    CorsRefused(&'static str),
}

/// What a refused client is told about its credentials (RFC 6750 §3 for bearer tokens).
/// Two words, so that every `Error` stays as small as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge {
    /// `Bearer` for tokens, `ApiKey` for API keys.
    pub scheme: &'static str,
    pub why: &'static Why,
}

/// Why credentials were refused.
#[derive(Debug, PartialEq, Eq)]
pub struct Why {
    /// The metric label (`missing`, `expired`, `bad_signature`...).
    pub reason: &'static str,
    /// A sentence for the client (printable ASCII without quotes); `None` when no
    /// credential was sent (RFC 6750 §3.1: no error code then).
    pub description: Option<&'static str>,
}

/// What one kind of answer is: the one row a new kind adds (status, whose fault, metric
/// label, problem type, gRPC status). The variant's data (details, waits) is read apart.
struct Kind {
    /// The metric label and access-log field.
    label: &'static str,
    status: StatusCode,
    source: Source,
    /// The problem type's base (`None`: the configured one), name and title.
    problem: (Option<&'static str>, &'static str, &'static str),
    /// The gRPC status of a call's answer (see [`grpc_status`]).
    grpc: u8,
}

const fn kind(
    label: &'static str,
    status: StatusCode,
    source: Source,
    problem: (Option<&'static str>, &'static str, &'static str),
    grpc: u8,
) -> Kind {
    Kind { label, status, source, problem, grpc }
}

use StatusCode as S;

/// Every kind, in [`Error::kind_index`]'s order; metric handles are resolved once per route.
const KINDS: [Kind; 20] = [
    kind("bad_request", S::BAD_REQUEST, Source::Downstream, (None, "bad-request", "Bad request"), 13),
    kind("client_body", S::BAD_REQUEST, Source::Downstream, (None, "bad-request-body", "Bad request body"), 13),
    kind("no_route", S::NOT_FOUND, Source::Policy, (None, "no-route", "No route matches this request"), 12),
    kind(
        "throttled",
        S::TOO_MANY_REQUESTS,
        Source::Policy,
        (Some(IANA_BASE), "quota-exceeded", "Too many requests"),
        8,
    ),
    kind(
        "over_capacity",
        S::SERVICE_UNAVAILABLE,
        Source::Policy,
        (Some(IANA_BASE), "temporary-reduced-capacity", "Too many requests in flight"),
        14,
    ),
    kind(
        "too_many_tunnels",
        S::SERVICE_UNAVAILABLE,
        Source::Policy,
        (Some(IANA_BASE), "temporary-reduced-capacity", "Too many tunnels"),
        14,
    ),
    kind(
        "store_unavailable",
        S::SERVICE_UNAVAILABLE,
        Source::Store,
        (Some(IANA_BASE), "temporary-reduced-capacity", "Rate limit store unavailable"),
        14,
    ),
    kind(
        "upstream_connect",
        S::BAD_GATEWAY,
        Source::Upstream,
        (None, "upstream-unreachable", "Upstream unreachable"),
        14,
    ),
    kind("upstream_timeout", S::GATEWAY_TIMEOUT, Source::Upstream, (None, "upstream-timeout", "Upstream timed out"), 4),
    kind("upstream_broken", S::BAD_GATEWAY, Source::Upstream, (None, "upstream-failed", "Upstream failed"), 14),
    kind(
        "upstream_bad_response",
        S::BAD_GATEWAY,
        Source::Upstream,
        (None, "upstream-bad-response", "Upstream sent an invalid response"),
        14,
    ),
    kind("internal", S::INTERNAL_SERVER_ERROR, Source::Internal, (None, "internal", "Internal error"), 13),
    kind("forbidden", S::FORBIDDEN, Source::Policy, (None, "plan-denied", "Forbidden by the client's plan"), 7),
    kind(
        "upstream_unavailable",
        S::SERVICE_UNAVAILABLE,
        Source::Upstream,
        (None, "upstream-unavailable", "No upstream server available"),
        14,
    ),
    kind(
        "method_not_allowed",
        S::METHOD_NOT_ALLOWED,
        Source::Policy,
        (None, "method-not-allowed", "Method not allowed"),
        12,
    ),
    kind(
        "content_too_large",
        S::PAYLOAD_TOO_LARGE,
        Source::Downstream,
        (None, "content-too-large", "Content too large"),
        8,
    ),
    kind(
        "unauthenticated",
        S::UNAUTHORIZED,
        // Not `Downstream`: the connection is fine, and stays open.
        Source::Policy,
        (None, "unauthenticated", "Credentials missing or not valid"),
        16,
    ),
    kind("wrong_audience", S::FORBIDDEN, Source::Policy, (None, "wrong-audience", "Token for another audience"), 7),
    kind(
        "auth_unavailable",
        S::SERVICE_UNAVAILABLE,
        Source::Store,
        (Some(IANA_BASE), "temporary-reduced-capacity", "Credentials cannot be checked now"),
        14,
    ),
    kind("cors_refused", S::FORBIDDEN, Source::Policy, (None, "cors-refused", "Cross-origin request not allowed"), 7),
];

impl Error {
    fn kind_index(&self) -> usize {
        match self {
            Error::BadRequest(_) => 0,
            Error::ClientBody(_) => 1,
            Error::NoRoute => 2,
            Error::Throttled(_) => 3,
            Error::OverCapacity => 4,
            Error::TooManyTunnels => 5,
            Error::StoreUnavailable { .. } => 6,
            Error::Upstream(UpstreamFailure::Connect(_) | UpstreamFailure::NotH2) => 7,
            Error::Upstream(UpstreamFailure::Timeout) => 8,
            Error::Upstream(UpstreamFailure::Broken(_)) => 9,
            Error::Upstream(UpstreamFailure::BadResponse(_)) => 10,
            Error::Internal(_) => 11,
            Error::Forbidden => 12,
            Error::Upstream(UpstreamFailure::Unavailable { .. }) => 13,
            Error::MethodNotAllowed => 14,
            Error::TooLarge(_) => 15,
            Error::Unauthenticated(_) => 16,
            Error::WrongAudience(_) => 17,
            Error::AuthUnavailable => 18,
            Error::CorsRefused(_) => 19,
        }
    }

    fn row(&self) -> &'static Kind {
        &KINDS[self.kind_index()]
    }

    pub fn source(&self) -> Source {
        self.row().source
    }

    /// The metric label and access-log field.
    pub fn kind(&self) -> &'static str {
        self.row().label
    }

    pub fn status(&self) -> StatusCode {
        self.row().status
    }

    /// What lay under the failure, where it is known (for the access log).
    pub fn cause(&self) -> Option<&Arc<str>> {
        match self {
            Error::Upstream(UpstreamFailure::Connect(c) | UpstreamFailure::Broken(c)) => c.text(),
            _ => None,
        }
    }

    /// Seconds the client should wait before trying again, where tollgate knows them.
    pub fn retry_after_secs(&self) -> Option<u64> {
        match self {
            Error::Throttled(d) => Some(d.retry_after_secs),
            Error::OverCapacity => Some(1),
            Error::StoreUnavailable { retry_after_secs, .. } => Some(*retry_after_secs),
            Error::AuthUnavailable => Some(1),
            Error::Upstream(UpstreamFailure::Unavailable { retry_after_secs, .. }) => {
                Some(u64::from(*retry_after_secs))
            }
            _ => None,
        }
    }

    /// Whether a stale copy may stand in for this answer: throttled (`on_limit.stale`) or the
    /// upstream failed (`on_upstream_error.stale`). Never for the client's own faults.
    pub fn stale_reason(&self) -> Option<StaleReason> {
        match self {
            Error::Throttled(_) | Error::OverCapacity => Some(StaleReason::Throttled),
            Error::Upstream(_) => Some(StaleReason::UpstreamError { status: self.status().as_u16() }),
            _ => None,
        }
    }
}

/// A rendered answer, cloned per use (headers and body share their buffers).
#[derive(Clone)]
struct Rendered {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Rendered {
    /// `id_field`: the field of request ids, held first (empty) so that each request's id
    /// replaces its value in place (see `proxy::serve::set_id`).
    fn new(status: StatusCode, body: Bytes, retry_after: Option<u64>, id_field: Option<&HeaderName>) -> Rendered {
        let mut headers = HeaderMap::with_capacity(6);
        if let Some(field) = id_field {
            headers.insert(field.clone(), HeaderValue::from_static(""));
        }
        headers.insert(header::CONTENT_TYPE, CONTENT_TYPE);
        // Only a 404 may be stored by a cache without being told it is fresh (RFC 9110
        // §15.1); the other statuses tollgate answers with may not, a 429 never (RFC 6585).
        if status == StatusCode::NOT_FOUND {
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
        if let Some(secs) = retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        Rendered { status, headers, body }
    }

    fn response(&self) -> Response<Body> {
        self.clone().into_response()
    }

    fn into_response(self) -> Response<Body> {
        let mut resp = Response::new(Body::full(self.body));
        *resp.status_mut() = self.status;
        *resp.headers_mut() = self.headers;
        resp
    }
}

/// What the answers of one route say about it, with the answers that never change rendered
/// once. Built with the route; a reload builds new ones.
pub struct RouteAnswers {
    name: String,
    limits: Vec<String>,
    policy: Option<HeaderValue>,
    alone: Option<(usize, HeaderValue)>,
    upstream: Option<(String, Duration)>,
    /// `Allow`: the methods the route takes (a 405, and `OPTIONS` at the last hop).
    allow: HeaderValue,
    type_base: Arc<str>,
    counters: [Counter; KINDS.len()],
    /// The 429 of a single denying limit, by limit and Retry-After seconds − 1.
    too_many: Box<[[OnceLock<Rendered>; CACHED_SECS]]>,
    /// The answers without variable parts, by kind.
    fixed: [OnceLock<Rendered>; KINDS.len()],
    /// The field of request ids: rendered answers hold it (empty), so setting each request's
    /// id on a clone replaces a value instead of growing the map.
    id_field: Option<HeaderName>,
}

/// Facts of a route needed to build its answers.
pub struct RouteFacts<'a> {
    pub name: &'a str,
    /// Limit names, in the route's order (denials name them by index).
    pub limits: Vec<String>,
    /// `RateLimit-Policy`, when the route sends RateLimit headers.
    pub policy: Option<HeaderValue>,
    /// A limit whose `429` carries a `RateLimit-Policy` of its own instead (by index): one
    /// that the route's admitted answers do not report (the failure limit of its `auth`).
    pub alone: Option<(usize, HeaderValue)>,
    /// Name and response timeout of an `http` upstream.
    pub upstream: Option<(&'a str, Duration)>,
    /// The methods the route takes (`None`: all but `TRACE`).
    pub methods: Option<&'a [http::Method]>,
}

/// `Allow` of a route that lists no methods: every method it forwards (`TRACE` only when
/// listed, `CONNECT` only as a tunnel).
const ALLOW_ALL: HeaderValue = HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS");

fn allow(methods: Option<&[http::Method]>) -> HeaderValue {
    let Some(methods) = methods else { return ALLOW_ALL };
    let list: Vec<&str> = methods.iter().map(http::Method::as_str).collect();
    HeaderValue::try_from(list.join(", ")).unwrap_or(ALLOW_ALL)
}

impl RouteAnswers {
    /// Answers for `facts`' route (or, with `None`, for requests no route took).
    pub fn new(facts: Option<RouteFacts<'_>>, type_base: Arc<str>, metrics: &Metrics) -> RouteAnswers {
        let (name, limits, policy, alone, upstream, allow) = match facts {
            Some(f) => (
                f.name.to_owned(),
                f.limits,
                f.policy,
                f.alone,
                f.upstream.map(|(n, t)| (n.to_owned(), t)),
                allow(f.methods),
            ),
            None => (String::new(), Vec::new(), None, None, None, ALLOW_ALL),
        };
        let label = if name.is_empty() { "-" } else { name.as_str() };
        let counters = KINDS.each_ref().map(|kind| metrics.error(label, kind.source.as_str(), kind.label));
        let too_many = (0..limits.len()).map(|_| std::array::from_fn(|_| OnceLock::new())).collect();
        RouteAnswers {
            name,
            limits,
            policy,
            alone,
            upstream,
            allow,
            type_base,
            counters,
            too_many,
            fixed: std::array::from_fn(|_| OnceLock::new()),
            id_field: None,
        }
    }

    /// Answers that make room for a request id in `field` (see `crate::request_id`).
    pub fn with_request_id(mut self, field: Option<HeaderName>) -> RouteAnswers {
        self.id_field = field;
        self
    }

    /// The client's answer to `err`, counted. `method` and `path` are the request's, named in
    /// a 404's detail; `version` is the client's (HTTP/2 has no `Connection` field).
    pub fn respond(&self, err: &Error, method: &http::Method, path: &str, version: http::Version) -> Response<Body> {
        self.counters[err.kind_index()].inc();
        let mut resp = match err {
            Error::Throttled(denied) => self.too_many(denied),
            Error::NoRoute => {
                self.render(err, &format!("no route matches {method} {}", truncated(path))).into_response()
            }
            Error::BadRequest(why) => self.render(err, why).into_response(),
            Error::CorsRefused(_) => self.render(err, &self.detail(err)).into_response(),
            Error::StoreUnavailable { limit, retry_after_secs } => {
                let detail = format!(
                    "route `{}`: limit `{}` cannot be checked right now; retry after {retry_after_secs} s",
                    self.name,
                    self.limit_name(*limit)
                );
                self.render(err, &detail).into_response()
            }
            Error::Unauthenticated(c) | Error::WrongAudience(c) => self.refuse_credentials(err, c),
            // Its Retry-After changes: rendered each time (rare, and never on the pass path).
            Error::Upstream(UpstreamFailure::Unavailable { .. }) => self.render(err, &self.detail(err)).into_response(),
            _ => self.fixed[err.kind_index()].get_or_init(|| self.render(err, &self.detail(err))).response(),
        };
        if err.source() == Source::Downstream && version < http::Version::HTTP_2 {
            // What follows a bad request or body on this connection cannot be trusted.
            resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }

    /// `OPTIONS` at the last hop (`Max-Forwards: 0`): `200` with the route's `Allow`.
    pub fn options(&self) -> Response<Body> {
        let mut resp = Response::new(Body::empty());
        resp.headers_mut().insert(header::ALLOW, self.allow.clone());
        resp
    }

    /// `TRACE` at the last hop (`Max-Forwards: 0`) of a route that takes it: `200` with the
    /// request head as `message/http` (RFC 9110 §9.3.8), less the fields that carry
    /// credentials.
    pub fn trace(&self, head: &http::request::Parts) -> Response<Body> {
        let mut text = format!("{} {} {:?}\r\n", head.method, head.uri, head.version);
        for (name, value) in &head.headers {
            if [header::AUTHORIZATION, header::PROXY_AUTHORIZATION, header::COOKIE].contains(name) {
                continue;
            }
            text.push_str(name.as_str());
            text.push_str(": ");
            text.push_str(&String::from_utf8_lossy(value.as_bytes()));
            text.push_str("\r\n");
        }
        text.push_str("\r\n");
        let mut resp = Response::new(Body::full(Bytes::from(text)));
        resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("message/http"));
        resp
    }

    /// The answer to a gRPC call (`content-type: application/grpc*`), counted: HTTP 200 with
    /// the status in `grpc-status` (Trailers-Only), a `grpc-message`, and
    /// `grpc-retry-pushback-ms` where tollgate knows when to retry (gRFC A6). See
    /// [`grpc_status`] for the mapping.
    pub fn respond_grpc(&self, err: &Error) -> Response<Body> {
        self.counters[err.kind_index()].inc();
        let message = match err {
            Error::Throttled(denied) => {
                let names: Vec<&str> = denied.limits.iter().map(|(i, _)| self.limit_name(*i)).collect();
                format!(
                    "route `{}`: limit `{}` admits no more requests now; retry after {} s",
                    self.name,
                    names.join("` and `"),
                    denied.retry_after_secs
                )
            }
            Error::NoRoute => "no route matches this call".to_owned(),
            Error::StoreUnavailable { limit, .. } => {
                format!("route `{}`: limit `{}` cannot be checked right now", self.name, self.limit_name(*limit))
            }
            _ => self.detail(err),
        };
        let mut resp = Response::new(Body::empty());
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert(GRPC_STATUS, HeaderValue::from(u16::from(grpc_status(err))));
        if let Ok(v) = HeaderValue::try_from(grpc_message(&message)) {
            h.insert(GRPC_MESSAGE, v);
        }
        if let Some(secs) = err.retry_after_secs() {
            h.insert(GRPC_PUSHBACK, HeaderValue::from(secs.saturating_mul(1000)));
        }
        resp
    }

    fn limit_name(&self, i: usize) -> &str {
        self.limits.get(i).map_or("?", String::as_str)
    }

    fn upstream_name(&self) -> &str {
        self.upstream.as_ref().map_or("?", |u| u.0.as_str())
    }

    /// The detail of answers that never change for this route.
    fn detail(&self, err: &Error) -> String {
        let up = self.upstream_name();
        match err {
            Error::ClientBody(e) => format!("the request body could not be read: {e}"),
            Error::OverCapacity => {
                format!("route `{}` has reached its limit of requests in flight; retry shortly", self.name)
            }
            Error::TooManyTunnels => format!("route `{}` has reached its limit of open tunnels", self.name),
            Error::Upstream(UpstreamFailure::Connect(_)) => format!("could not connect to upstream `{up}`"),
            Error::Upstream(UpstreamFailure::NotH2) => format!(
                "could not connect to upstream `{up}`: it is `protocol: h2`, and its TLS handshake did not choose \
                 HTTP/2 (ALPN `h2`)"
            ),
            Error::Upstream(UpstreamFailure::Broken(_)) => {
                format!("upstream `{up}` closed the connection without a response")
            }
            Error::Upstream(UpstreamFailure::Timeout) => {
                let t = self.upstream.as_ref().map_or(Duration::ZERO, |u| u.1);
                format!("upstream `{up}` sent no response within {t:?}")
            }
            Error::Upstream(UpstreamFailure::BadResponse(why)) => {
                format!("upstream `{up}` sent a response that cannot be passed on: {why}")
            }
            Error::Upstream(UpstreamFailure::Unavailable { retry_after_secs, unresolved: false }) => format!(
                "no server of upstream `{up}` can take requests now (ejected or failing health checks); retry after {retry_after_secs} s"
            ),
            Error::Upstream(UpstreamFailure::Unavailable { retry_after_secs, unresolved: true }) => format!(
                "upstream `{up}` has no server yet: its names have not resolved in DNS; retry after {retry_after_secs} s"
            ),
            Error::Internal(why) => format!("tollgate failed to serve the request: {why}"),
            Error::Forbidden => format!("route `{}`: this client's plan does not allow requests", self.name),
            Error::BadRequest(why) => (*why).to_owned(),
            Error::MethodNotAllowed => format!("route `{}` does not take this method", self.name),
            Error::TooLarge(max) => format!("route `{}` reads request bodies of at most {max} bytes", self.name),
            Error::AuthUnavailable => format!("route `{}`: credentials cannot be checked right now", self.name),
            Error::CorsRefused(why) => format!("route `{}`: {why}", self.name),
            Error::Unauthenticated(c) | Error::WrongAudience(c) => {
                format!("route `{}`: {}", self.name, c.why.description.unwrap_or("credentials are required"))
            }
            Error::NoRoute | Error::Throttled(_) | Error::StoreUnavailable { .. } => String::new(),
        }
    }

    /// A 401 or 403 for the route's credentials, with its `WWW-Authenticate` challenge (the
    /// realm is the route's name).
    fn refuse_credentials(&self, err: &Error, c: &Challenge) -> Response<Body> {
        let mut rendered = self.render(err, &self.detail(err));
        let mut v = format!("{} realm=\"{}\"", c.scheme, self.name);
        if let Some(description) = c.why.description {
            let code = if matches!(err, Error::WrongAudience(_)) { "insufficient_scope" } else { "invalid_token" };
            v.push_str(&format!(", error=\"{code}\", error_description=\"{description}\""));
        }
        if let Ok(v) = HeaderValue::try_from(v) {
            rendered.headers.insert(header::WWW_AUTHENTICATE, v);
        }
        rendered.into_response()
    }

    fn render(&self, err: &Error, detail: &str) -> Rendered {
        let (base, name, title) = err.row().problem;
        let base = base.unwrap_or(&self.type_base);
        let status = err.status();
        let mut doc = Doc::new(base, name, title, status.as_u16(), detail);
        if let Error::Upstream(_) = err {
            doc.string("upstream", self.upstream_name());
        }
        if let Some(secs) = err.retry_after_secs() {
            doc.number("retry-after", secs);
        }
        let mut rendered = Rendered::new(status, doc.finish(), err.retry_after_secs(), self.id_field.as_ref());
        if *err == Error::MethodNotAllowed {
            rendered.headers.insert(header::ALLOW, self.allow.clone());
        }
        rendered
    }

    /// The 429. When one limit denies, a clone of the answer rendered for that limit and wait.
    fn too_many(&self, denied: &Denied) -> Response<Body> {
        let secs = denied.retry_after_secs;
        let slot = usize::try_from(secs.saturating_sub(1)).ok().filter(|&s| s < CACHED_SECS);
        match (&denied.limits[..], slot) {
            ([(limit, _)], Some(slot)) if *limit < self.too_many.len() && denied.policy.is_none() => {
                self.too_many[*limit][slot].get_or_init(|| self.render_too_many(denied)).response()
            }
            _ => self.render_too_many(denied).into_response(),
        }
    }

    fn render_too_many(&self, denied: &Denied) -> Rendered {
        let secs = denied.retry_after_secs;
        let names = || denied.limits.iter().map(|(i, _)| self.limit_name(*i));
        let mut detail = format!("route `{}`: ", self.name);
        for (n, name) in names().enumerate() {
            if n > 0 {
                detail.push_str(" and ");
            }
            detail.push_str("limit `");
            detail.push_str(name);
            detail.push('`');
        }
        detail.push_str(if denied.limits.len() > 1 { " admit" } else { " admits" });
        detail.push_str(" no more requests now; retry after ");
        detail.push_str(itoa::Buffer::new().format(secs));
        detail.push_str(" s");
        let err = Error::Throttled(denied.clone());
        let (base, name, title) = err.row().problem;
        let mut doc = Doc::new(base.unwrap_or(&self.type_base), name, title, 429, &detail);
        doc.strings("violated-policies", names());
        doc.number("retry-after", secs);
        let mut rendered =
            Rendered::new(StatusCode::TOO_MANY_REQUESTS, doc.finish(), Some(secs), self.id_field.as_ref());
        let alone = match (&self.alone, &denied.limits[..]) {
            (Some((i, policy)), [(limit, _)]) if i == limit => Some(policy),
            _ => None,
        };
        if let Some(policy) = denied.policy.as_deref().or(alone).or(self.policy.as_ref()) {
            let mut rl = String::with_capacity(48);
            for (i, wait) in &denied.limits {
                ratelimit::item(&mut rl, self.limit_name(*i));
                ratelimit::param(&mut rl, "r", 0);
                ratelimit::param(&mut rl, "t", *wait);
            }
            rendered.headers.insert(ratelimit::RATELIMIT_POLICY, policy.clone());
            if let Ok(v) = HeaderValue::try_from(rl) {
                rendered.headers.insert(ratelimit::RATELIMIT, v);
            }
        }
        rendered
    }
}

const GRPC_STATUS: header::HeaderName = header::HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: header::HeaderName = header::HeaderName::from_static("grpc-message");
const GRPC_PUSHBACK: header::HeaderName = header::HeaderName::from_static("grpc-retry-pushback-ms");

/// The trailers that end a gRPC call a message limit refused (see `body::grpc`):
/// `RESOURCE_EXHAUSTED`, the reason, and `grpc-retry-pushback-ms` when waiting helps (gRFC A6:
/// none means do not retry, as for a message over the size cap).
pub fn grpc_refused(r: &crate::body::watch::Refusal) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(GRPC_STATUS, HeaderValue::from_static("8"));
    if let Ok(v) = HeaderValue::try_from(grpc_message(&r.reason)) {
        h.insert(GRPC_MESSAGE, v);
    }
    if !r.retry_after.is_zero() {
        let ms = u64::try_from(r.retry_after.as_millis()).unwrap_or(u64::MAX).max(1);
        h.insert(GRPC_PUSHBACK, HeaderValue::from(ms));
    }
    h
}

/// The Trailers-Only answer to a gRPC call a message limit refused before its upstream
/// answered: HTTP 200 with [`grpc_refused`]'s fields.
pub fn grpc_refused_answer(r: &crate::body::watch::Refusal) -> Response<Body> {
    let mut resp = Response::new(Body::empty());
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.extend(grpc_refused(r));
    resp
}

/// The gRPC status code of tollgate's answer to a call: throttled is `RESOURCE_EXHAUSTED`
/// (8); over capacity, an unavailable limit store and a failed upstream are `UNAVAILABLE`
/// (14), which clients may retry; an upstream that sent no head in time is
/// `DEADLINE_EXCEEDED` (4); no route is `UNIMPLEMENTED` (12); a plan's `deny` tier is
/// `PERMISSION_DENIED` (7); a method the route does not take is `UNIMPLEMENTED` (12), a body
/// over the route's bound `RESOURCE_EXHAUSTED` (8); a bad request and tollgate's
/// own faults are `INTERNAL` (13), as gRPC maps HTTP 400 and 500.
pub fn grpc_status(err: &Error) -> u8 {
    err.row().grpc
}

/// `grpc-message`: percent-encoded UTF-8, printable ASCII other than `%` as is.
fn grpc_message(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(b"0123456789ABCDEF"[usize::from(b >> 4)]));
            out.push(char::from(b"0123456789ABCDEF"[usize::from(b & 0xf)]));
        }
    }
    out
}

/// At most 256 bytes of a request path in a detail (cut at a character boundary).
fn truncated(path: &str) -> &str {
    let mut end = path.len().min(256);
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    &path[..end]
}

#[cfg(test)]
mod tests;

/// What the admin listener refuses: a path it does not serve, a method it does not take,
/// `/readyz` while not ready (with why), a write without the admin token, a malformed request,
/// or a limit store that cannot answer.
pub enum AdminRefusal {
    NotFound,
    /// A route or limit (of `/limits/...`) that the config does not have; the detail says which.
    NoSuchLimit(String),
    MethodNotAllowed,
    /// A method other than the ones a `/limits/...` path takes (its `Allow` value).
    MethodNotAllowedHere(&'static str),
    NotReady(String),
    /// A write endpoint without the admin token (or with a wrong one, or none configured).
    Forbidden(&'static str),
    /// A request the endpoint cannot read (a malformed key, a bad `top`).
    BadRequest(String),
    /// The store could not answer (Redis down).
    StoreUnavailable(String),
}

/// The admin listener's refusal as problem+json, like every answer tollgate makes itself
/// (under tollgate's own problem types: the admin listener has no `problems.type_base`).
pub fn admin(refusal: &AdminRefusal) -> Response<Body> {
    let here: String;
    let (status, name, title, detail) = match refusal {
        AdminRefusal::NotFound => (
            StatusCode::NOT_FOUND,
            "no-route",
            "No such admin endpoint",
            "try /metrics, /healthz, /readyz, /config or /limits",
        ),
        AdminRefusal::MethodNotAllowed => (
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "Method not allowed",
            "the admin endpoints take GET and HEAD",
        ),
        AdminRefusal::NotReady(why) => (StatusCode::SERVICE_UNAVAILABLE, "not-ready", "Not ready", why.as_str()),
        AdminRefusal::NoSuchLimit(what) => (StatusCode::NOT_FOUND, "no-such-limit", "No such limit", what.as_str()),
        AdminRefusal::MethodNotAllowedHere(allow) => {
            here = format!("this endpoint takes {allow}");
            (StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed", "Method not allowed", here.as_str())
        }
        AdminRefusal::Forbidden(why) => (StatusCode::FORBIDDEN, "forbidden", "Forbidden", *why),
        AdminRefusal::BadRequest(why) => (StatusCode::BAD_REQUEST, "bad-request", "Bad request", why.as_str()),
        AdminRefusal::StoreUnavailable(why) => {
            (StatusCode::SERVICE_UNAVAILABLE, "store-unavailable", "Limit store unavailable", why.as_str())
        }
    };
    let doc = Doc::new(crate::config::DEFAULT_PROBLEM_TYPE_BASE, name, title, status.as_u16(), detail);
    let mut rendered = Rendered::new(status, doc.finish(), None, None);
    match refusal {
        AdminRefusal::MethodNotAllowed => {
            rendered.headers.insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        }
        AdminRefusal::MethodNotAllowedHere(allow) => {
            rendered.headers.insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        _ => {}
    }
    rendered.into_response()
}

/// A plain listener's `redirect_https: true` answer: `308 Permanent Redirect` to `location`
/// (the same host, path and query over HTTPS), with no body.
/// The answer to an ACME HTTP-01 validation: the key authorization, as text (RFC 8555 §8.3).
pub fn acme_http01(key_authorization: String) -> Response<Body> {
    let mut resp = Response::new(Body::full(Bytes::from(key_authorization)));
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    resp
}

pub fn redirect(location: HeaderValue) -> Response<Body> {
    let mut resp = Response::new(Body::full(Bytes::new()));
    *resp.status_mut() = StatusCode::PERMANENT_REDIRECT;
    resp.headers_mut().insert(header::LOCATION, location);
    resp
}
