//! The access log: what one request did, written as one line when it is answered.

use super::*;
use crate::trace::{self, Exchange};
use opentelemetry_proto::tonic::common::v1::KeyValue;

/// Which stale copy, if any, answered a request (for the access log).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Stale {
    No,
    Throttled,
    UpstreamError,
}

/// The facts of one request for the access log.
pub(super) struct Access<'a> {
    pub(super) lane: &'a Lane,
    pub(super) route: &'a str,
    pub(super) method: Method,
    pub(super) path: String,
    pub(super) note: Note,
    pub(super) upstream: Option<(u16, Duration)>,
    /// A group's server that took the request (its address) and the tries it took.
    pub(super) served: Option<(&'a str, u32)>,
    pub(super) stale: Stale,
    /// The kind of error tollgate answered, if it did.
    pub(super) error: Option<&'static str>,
    /// What lay under that error, where it is known (a connect or I/O error, in words).
    pub(super) cause: Option<std::sync::Arc<str>>,
    pub(super) request_id: Option<&'a RequestId>,
    /// A gRPC call: tollgate's own answers are gRPC statuses, never stale copies.
    pub(super) grpc: bool,
    /// A sampled request's span (`tracing:`); boxed, so that an untraced request's future
    /// carries a pointer only.
    pub(super) trace: Option<Box<trace::Span>>,
    /// What only the access log needs (`tollgate replay` reads it); boxed, and made only
    /// when the log is on, so that an unlogged request's future carries a pointer only.
    pub(super) extra: Option<Box<Extra>>,
}

/// The access log's facts beyond the phases' own: enough to decide the request again.
#[derive(Default)]
pub(super) struct Extra {
    /// The canonical host the route matched against.
    host: Option<String>,
    /// The raw query string.
    query: Option<String>,
    /// The instant the limits decided at (µs since the epoch): the log's own timestamp is
    /// taken later, when the line is written; replay needs the decision's `now` to be exact.
    at_us: Option<u64>,
    /// `log.access_keys`: per limit `name|key spec|digest`, `;`-separated.
    keys: Option<String>,
    /// The consumer the route's `auth` verified (never the credential).
    consumer: Option<Box<str>>,
    /// What the route's steps did, as `step=what` words (`cors=origin_refused`).
    steps: String,
}

impl Extra {
    /// Notes the decision's instant and, with `log.access_keys`, each limit's key digest
    /// (hashed exactly as the limit hashes it, so the raw material never reaches the log).
    #[cold]
    #[inline(never)]
    pub(super) fn decided(&mut self, now: crate::limit::Timestamp, keys_of: Option<&[Limit]>, ctx: &KeyCtx<'_>) {
        use std::fmt::Write;
        self.at_us = Some(now.as_micros());
        let Some(limits) = keys_of else { return };
        let mut out = String::with_capacity(limits.len() * 64);
        for (i, l) in limits.iter().enumerate() {
            let spec = l.config.key.parts().iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
            let sep = if i > 0 { ";" } else { "" };
            let _ = write!(out, "{sep}{}|{spec}|{:032x}", l.config.name, l.config.key.hash(ctx).0);
        }
        self.keys = Some(out);
    }
}

impl<'a> Access<'a> {
    /// Notes the consumer `auth` verified, for the log line and the span (never the
    /// credential).
    pub(super) fn identified(&mut self, consumer: &str) {
        if let Some(extra) = self.extra.as_deref_mut() {
            extra.consumer = Some(consumer.into());
        }
        if let Some(span) = self.trace.as_mut() {
            span.attributes.push(trace::text("enduser.id", consumer));
        }
    }

    /// Where the route's steps note what they did for the line (nowhere when the log is off).
    pub(super) fn notes(&mut self) -> crate::step::Notes<'_> {
        crate::step::Notes(self.extra.as_deref_mut().map(|x| &mut x.steps))
    }

    /// `logging`: the access log is on, so the path is worth copying (the span's too).
    pub(super) fn new(
        lane: &'a Lane,
        route: &'a Route,
        parts: &Parts,
        logging: bool,
        request_id: Option<&'a RequestId>,
        trace: Option<Box<trace::Span>>,
    ) -> Access<'a> {
        let extra = logging.then(|| {
            let host = crate::target::host(&parts.headers).map(str::to_owned);
            Box::new(Extra { host, query: parts.uri.query().map(str::to_owned), ..Extra::default() })
        });
        let logging = logging || trace.is_some();
        Access {
            lane,
            route: &route.name,
            method: parts.method.clone(),
            path: if logging { parts.uri.path().to_owned() } else { String::new() },
            note: Note::default(),
            upstream: None,
            served: None,
            stale: Stale::No,
            error: None,
            cause: None,
            request_id,
            grpc: false,
            trace,
            extra,
        }
    }

    /// `peer`: the client's address (the socket's, or the one a PROXY header carried).
    pub(super) fn emit(&self, status: u16, took: Duration, peer: std::net::IpAddr) {
        let limit = self.note.limit.and_then(|i| self.lane.gate.limits().get(i)).map(|l| l.config.name.as_str());
        let extra = self.extra.as_deref();
        tracing::info!(
            target: "tollgate::access",
            route = self.route,
            %peer,
            method = %self.method,
            host = extra.and_then(|x| x.host.as_deref()),
            path = %self.path,
            query = extra.and_then(|x| x.query.as_deref()),
            status,
            duration_ms = took.as_secs_f64() * 1e3,
            upstream_status = self.upstream.map(|u| u.0),
            upstream_ms = self.upstream.map(|u| u.1.as_secs_f64() * 1e3),
            upstream_server = self.served.map(|s| s.0),
            upstream_tries = self.served.map(|s| s.1),
            limit,
            remaining = self.note.remaining,
            retry_after = self.note.retry_after_secs,
            delayed_ms = self.note.delayed_us as f64 / 1e3,
            error = self.error,
            cause = self.cause.as_deref(),
            stale = match self.stale {
                Stale::No => "no",
                Stale::Throttled => "throttled",
                Stale::UpstreamError => "upstream_error",
            },
            request_id = self.request_id.map(RequestId::as_str),
            at_us = extra.and_then(|x| x.at_us),
            keys = extra.and_then(|x| x.keys.as_deref()),
            consumer = extra.and_then(|x| x.consumer.as_deref()),
            steps = extra.map(|x| x.steps.as_str()).filter(|s| !s.is_empty()),
        );
    }
}

impl Access<'_> {
    /// The server span's attributes and the upstream exchange, from the facts the log line
    /// is written from (the HTTP semantic conventions, then tollgate's own).
    #[cold]
    pub(super) fn span(&self, status: u16, peer: std::net::IpAddr) -> (Vec<KeyValue>, Option<Exchange>) {
        let mut a = Vec::with_capacity(20);
        a.push(trace::text("http.request.method", self.method.as_str()));
        a.push(trace::text("http.route", self.route));
        a.push(trace::text("url.path", self.path.as_str()));
        a.push(trace::int("http.response.status_code", i64::from(status)));
        a.push(trace::address("client.address", peer));
        a.push(trace::text("tollgate.route", self.route));
        if let Some(id) = self.request_id {
            a.push(trace::text("tollgate.request_id", id.as_str()));
        }
        let limits = self.lane.gate.limits();
        if let Some(limit) = self.note.limit.and_then(|i| limits.get(i)) {
            a.push(trace::text("tollgate.limit", limit.config.name.as_str()));
        }
        let decision = match self.error {
            Some("throttled") => Some("deny"),
            _ if self.note.delayed_us > 0 => Some("delay"),
            _ if self.note.limit.is_some() => Some("allow"),
            _ => None,
        };
        if let Some(decision) = decision {
            a.push(trace::text("tollgate.limit.decision", decision));
        }
        if let Some(remaining) = self.note.remaining {
            a.push(trace::int("tollgate.limit.remaining", i64::try_from(remaining).unwrap_or(i64::MAX)));
        }
        if self.note.delayed_us > 0 {
            a.push(trace::float("tollgate.limit.wait_ms", self.note.delayed_us as f64 / 1e3));
        }
        if let Some(secs) = self.note.retry_after_secs {
            a.push(trace::int("tollgate.retry_after", i64::try_from(secs).unwrap_or(i64::MAX)));
        }
        let shadowed = |l: &&Limit| l.config.mode == crate::config::Mode::Shadow;
        let shadow = limits.iter().filter(shadowed).map(|l| l.config.name.as_str());
        if limits.iter().any(|l| shadowed(&l)) {
            a.push(trace::texts("tollgate.limit.shadow", shadow));
        }
        if self.lane.gate.has_cap() {
            let capped = if self.error == Some("over_capacity") { "refused" } else { "admitted" };
            a.push(trace::text("tollgate.concurrency", capped));
        }
        if self.stale != Stale::No {
            let why = if self.stale == Stale::Throttled { "throttled" } else { "upstream_error" };
            a.push(trace::text("tollgate.cache", "stale"));
            a.push(trace::text("tollgate.cache.stale_reason", why));
        }
        if let Some(kind) = self.error {
            a.push(trace::text("error.type", kind));
        }
        if let Some(cause) = &self.cause {
            a.push(trace::text("tollgate.cause", &**cause));
        }
        let exchange = self.upstream.map(|(upstream_status, took)| {
            let mut c = Vec::with_capacity(4);
            c.push(trace::text("http.request.method", self.method.as_str()));
            c.push(trace::text("tollgate.upstream", self.lane.upstream.as_str()));
            if let Some((server, tries)) = self.served {
                c.push(trace::text("tollgate.upstream.server", server));
                c.push(trace::int("tollgate.upstream.retries", i64::from(tries.saturating_sub(1))));
            }
            if upstream_status != 0 {
                c.push(trace::int("http.response.status_code", i64::from(upstream_status)));
            }
            Exchange { attributes: c, took, status: upstream_status }
        });
        if exchange.is_some() {
            a.push(trace::text("tollgate.upstream", self.lane.upstream.as_str()));
        }
        (a, exchange)
    }
}
