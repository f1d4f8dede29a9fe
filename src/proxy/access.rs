//! The access log: what one request did, written as one line when it is answered.

use super::*;

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
    pub(super) stale: Stale,
    /// The kind of error tollgate answered, if it did.
    pub(super) error: Option<&'static str>,
    /// What lay under that error, where it is known (a connect or I/O error, in words).
    pub(super) cause: Option<std::sync::Arc<str>>,
    pub(super) request_id: Option<&'a RequestId>,
    /// A gRPC call: tollgate's own answers are gRPC statuses, never stale copies.
    pub(super) grpc: bool,
}

impl<'a> Access<'a> {
    /// `logging`: the access log is on, so the path is worth copying.
    pub(super) fn new(
        lane: &'a Lane,
        route: &'a Route,
        parts: &Parts,
        logging: bool,
        request_id: Option<&'a RequestId>,
    ) -> Access<'a> {
        Access {
            lane,
            route: &route.name,
            method: parts.method.clone(),
            path: if logging { parts.uri.path().to_owned() } else { String::new() },
            note: Note::default(),
            upstream: None,
            stale: Stale::No,
            error: None,
            cause: None,
            request_id,
            grpc: false,
        }
    }

    /// `peer`: the client's address (the socket's, or the one a PROXY header carried).
    pub(super) fn emit(&self, status: u16, took: Duration, peer: std::net::IpAddr) {
        let limit = self.note.limit.and_then(|i| self.lane.gate.limits().get(i)).map(|l| l.config.name.as_str());
        tracing::info!(
            target: "tollgate::access",
            route = self.route,
            %peer,
            method = %self.method,
            path = %self.path,
            status,
            duration_ms = took.as_secs_f64() * 1e3,
            upstream_status = self.upstream.map(|u| u.0),
            upstream_ms = self.upstream.map(|u| u.1.as_secs_f64() * 1e3),
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
        );
    }
}
