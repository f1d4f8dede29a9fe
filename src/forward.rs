//! Sends an admitted request on: to an upstream through a pooled keep-alive HTTP/1.1
//! connection (or, for `protocol: h2c` and `h2`, as a stream on a shared HTTP/2 connection,
//! see [`h2`]; for `auto` over TLS, on whichever ALPN chose), an upgrade on a connection of
//! its own that becomes a [`tunnel`] after a `101`, or to the built-in responder. Failures are returned as [`Error`]s with their
//! source (the client's body, or the upstream); the answer module writes the response.
//!
//! One concept, though over 600 lines: sending one request upstream (the forwarder, its
//! preparation of the request and its reading of the answer).

pub mod connector;
pub mod faults;
pub mod framing;
pub mod group;
pub mod grpc;
pub mod h2;
pub mod headers;
pub mod hop;
pub mod pool;
pub mod rules;
pub mod split;
pub mod tunnel;

use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;

use pool::Pool;

use crate::answer::{Cause, Error, UpstreamFailure};
use crate::body::{Body, ClientBodyError, Inbound, Lease, RequestBody, UpstreamConn};
use crate::config::{HttpUpstream, Responder};

/// Per-request facts the forwarder needs from the downstream side.
/// Fields [`HttpForwarder::prepare`] may add to a request (`TE`, `Host`, three
/// `X-Forwarded-*`, `Via`, the request id) and the RateLimit fields and id its response gets.
const ADDED_FIELDS: usize = 10;

pub struct Downstream<'a> {
    pub peer: IpAddr,
    pub peer_trusted: bool,
    /// The client came over TLS.
    pub https: bool,
    /// The request id and the field that carries it, set on the forwarded request.
    pub request_id: Option<(&'a http::HeaderName, HeaderValue)>,
    /// The route's request header rules with their values for this request, applied last.
    pub rules: Option<(&'a rules::HeaderRules, &'a [HeaderValue])>,
    /// Where a group notes which server took the request, and after how many tries.
    pub served: &'a Served,
}

/// Where a route sends admitted requests: one of the config's upstreams, compiled.
pub enum Backend {
    Http(Box<HttpForwarder>),
    /// `servers:`: a group with balancing, health and retries.
    Group(Arc<group::Group>),
    Respond(Respond),
}

impl Backend {
    /// Forwards `req` as an ordinary request (never an upgrade) to an HTTP upstream, as the
    /// request path does (see [`HttpForwarder::forward`]); `key`: a group's hash key.
    ///
    /// # Errors
    /// As [`HttpForwarder::forward`]; the responder is no upstream to forward to.
    pub async fn send(
        &self,
        req: Request<Inbound>,
        strip: usize,
        down: &Downstream<'_>,
        key: u64,
    ) -> Result<Response<Body>, Error> {
        match self {
            Backend::Http(fwd) if fwd.is_h2() => fwd.forward_h2(req, strip, down).await,
            Backend::Http(fwd) => fwd.forward(req, strip, down).await,
            Backend::Group(g) => g.forward(req, strip, down, key).await,
            Backend::Respond(_) => Err(Error::Internal("a request was sent to the built-in responder")),
        }
    }
}

/// Which server of a group took a request, after how many tries (for the access log and the
/// trace): written by the group as it goes, read once the exchange is over.
#[derive(Debug, Default)]
pub struct Served {
    server: std::sync::atomic::AtomicU32,
    /// 0: no group took the request.
    tries: std::sync::atomic::AtomicU32,
}

impl Served {
    /// The `tries`-th try goes to the group's server at index `server`.
    pub fn record(&self, server: usize, tries: u32) {
        self.server.store(u32::try_from(server).unwrap_or(u32::MAX), Ordering::Relaxed);
        self.tries.store(tries, Ordering::Relaxed);
    }

    /// The last server tried and the number of tries, if a group took the request.
    pub fn get(&self) -> Option<(usize, u32)> {
        let tries = self.tries.load(Ordering::Relaxed);
        (tries > 0).then(|| (self.server.load(Ordering::Relaxed) as usize, tries))
    }
}

/// `auto`: what ALPN chose on the newest connection, so the next request looks in that pool first.
const LEARNED_NONE: u8 = 0;
const LEARNED_H1: u8 = 1;
const LEARNED_H2: u8 = 2;

/// A pooled client for one upstream.
pub struct HttpForwarder {
    name: String,
    pool: Arc<Pool>,
    /// `protocol: h2c` or `h2`: requests go as streams on shared HTTP/2 connections instead;
    /// `auto` over TLS: those whose connection chose `h2` by ALPN do.
    h2: Option<h2::H2Pool>,
    /// `auto` over TLS: `LEARNED_*`.
    auto: Option<AtomicU8>,
    /// An `https://` upstream.
    tls: bool,
    authority: http::uri::Authority,
    authority_value: HeaderValue,
    base_path: String,
    timeout: Duration,
    read_timeout: Duration,
    body_read_timeout: Duration,
    preserve_host: bool,
}

impl HttpForwarder {
    /// `body_read_timeout`: how long a client may pause mid-body (`server.body_read_timeout`);
    /// `workers`: the worker threads, each with its own share of the idle connections.
    pub fn new(
        name: &str,
        cfg: &HttpUpstream,
        body_read_timeout: Duration,
        metrics: &crate::metrics::Metrics,
        workers: usize,
    ) -> HttpForwarder {
        HttpForwarder::at(name, cfg, cfg.authority.as_str(), body_read_timeout, metrics, workers)
    }

    /// [`HttpForwarder::new`] for a server reached at `connect` (`host:port`, an address a
    /// name resolved to) that stands for `cfg.authority` (its `Host`, `:authority`).
    pub fn at(
        name: &str,
        cfg: &HttpUpstream,
        connect: &str,
        body_read_timeout: Duration,
        metrics: &crate::metrics::Metrics,
        workers: usize,
    ) -> HttpForwarder {
        if cfg.tls.as_ref().is_some_and(|t| t.insecure_skip_verify) {
            tracing::warn!(
                upstream = name,
                "tls_insecure_skip_verify: the upstream's certificate is not verified (for development only)"
            );
        }
        use crate::config::UpstreamProtocol;
        let connector = connector::Connector::new(
            connect.to_owned(),
            cfg.connect_timeout,
            cfg.tls.as_ref().map(|t| {
                connector::TlsClient::build(t).map(Arc::new).map_err(|e| {
                    tracing::error!(upstream = name, "{e}; its connections fail");
                    Arc::from(e)
                })
            }),
        );
        HttpForwarder {
            name: name.to_owned(),
            h2: (cfg.protocol != UpstreamProtocol::Http1).then(|| h2::H2Pool::new(connector.clone(), cfg.h2.clone())),
            auto: (cfg.protocol == UpstreamProtocol::Auto).then(|| AtomicU8::new(LEARNED_NONE)),
            tls: cfg.tls.is_some(),
            pool: Arc::new(Pool::new(
                connector,
                cfg.pool_idle_timeout,
                cfg.pool_max_idle,
                metrics.upstream_read_timeouts(name),
                workers,
            )),
            authority: cfg.authority.clone(),
            authority_value: HeaderValue::from_str(cfg.authority.as_str()).unwrap_or(HeaderValue::from_static("")),
            base_path: cfg.base_path.clone(),
            timeout: cfg.timeout,
            read_timeout: cfg.read_timeout,
            body_read_timeout,
            preserve_host: cfg.preserve_host,
        }
    }

    /// Whether upgrades can be tunnelled to this upstream: HTTP/1.1 ones, and `auto` ones (on
    /// a connection of its own offering only `http/1.1`). An `h2c` or `h2` upstream would need
    /// extended CONNECT (RFC 8441).
    pub fn tunnels(&self) -> bool {
        self.h2.is_none() || self.auto.is_some()
    }

    /// `protocol: h2c`, `h2`, or `auto` over TLS: requests go through [`HttpForwarder::forward_h2`].
    pub fn is_h2(&self) -> bool {
        self.h2.is_some()
    }

    /// Forwards `req`, dropping the first `strip` bytes of its path (the route's prefix).
    ///
    /// The head is rewritten before the returned future exists, and the request lives in
    /// one place only while it waits: futures on the request path are moved several times
    /// by value, so every byte kept out of them is a byte not copied per request.
    ///
    /// # Errors
    /// [`Error::Upstream`] when the upstream cannot be reached or fails before its response
    /// head; [`Error::ClientBody`] when the client's body fails first.
    // Inlined into the request flow, as it was before `upgrade` and HTTP/2 made it larger:
    // out of line, the request and the future are copied in and out (measured: ~350
    // instructions a request).
    #[inline(always)]
    pub fn forward<'a>(
        &'a self,
        req: Request<Inbound>,
        strip: usize,
        down: &Downstream<'_>,
    ) -> impl Future<Output = Result<Response<Body>, Error>> + 'a {
        let prepared = self.prepare(req, strip, down);
        async move {
            let req = prepared?;
            // A ready pooled connection takes the request now: hyper moves it into the
            // connection's queue at once, so this future holds only the wait for the answer.
            // Otherwise (the pool is empty, or its connection's task has not yet run since
            // its last answer) a boxed future waits or connects first.
            let answered = match self.pool.take_ready() {
                Some(mut conn) => {
                    let answer = conn.send.send_request(req);
                    // The connection's own deadline times the answer: no timer entry per request.
                    conn.deadline.arm_for(self.timeout);
                    match Within::new(answer, &conn.deadline).await {
                        Ok(Ok(resp)) => Ok(Ok((resp, conn))),
                        Ok(Err(e)) => Ok(Err(self.failed(&e))),
                        Err(elapsed) => Err(elapsed),
                    }
                }
                None => crate::timer::timeout(self.timeout, Box::pin(self.exchange(req))).await,
            };
            match answered {
                Ok(Ok((resp, conn))) => self.accept(resp, conn),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(Error::Upstream(UpstreamFailure::Timeout)),
            }
        }
    }

    /// The response as it goes to the client: framing checked ([`framing`]), hop-by-hop
    /// fields out, `Via` in, the body streaming from the leased connection. A refused answer
    /// drops its connection, and so does one whose framing needed repair.
    fn accept(&self, resp: Response<Incoming>, conn: UpstreamConn) -> Result<Response<Body>, Error> {
        let (mut parts, body) = resp.into_parts();
        let reuse = framing::check_response(parts.status, &mut parts.headers)?;
        headers::strip_hop_by_hop(&mut parts.headers);
        headers::append_via(&mut parts.headers, parts.version);
        parts.version = Version::HTTP_11;
        let lease = Lease { conn, home: self.pool.clone(), reuse: reuse == framing::Reuse::Yes };
        Ok(Response::from_parts(parts, Body::upstream(body, lease, self.read_timeout)))
    }

    /// Forwards an upgrade request (see [`tunnel::wanted`]) on a connection of its own, with
    /// `Connection: upgrade` and `Upgrade:` the protocols it asks for that `allowed` lists. A
    /// `101` naming one of them comes back with an empty body and a [`tunnel::Pending`] in its
    /// extensions (holding `held`), to be started once the client has it; any other answer
    /// is an ordinary response (its connection is closed after it; `held` is dropped).
    ///
    /// An HTTP/2 extended CONNECT for `websocket` (RFC 8441) goes upstream as the HTTP/1.1
    /// handshake: `GET`, a `Sec-WebSocket-Key` of tollgate's (its `Sec-WebSocket-Version`
    /// passed on, `13` if it sent none); the `101` must carry the matching
    /// `Sec-WebSocket-Accept`, and becomes the `200` that opens the tunnel on the client's
    /// stream. A `2xx` that switched nothing is refused (it would open a tunnel to nothing).
    ///
    /// # Errors
    /// As [`HttpForwarder::forward`]; a `101` to a protocol not offered, or (RFC 8441) with a
    /// wrong accept, or a `2xx` to it, is a bad response.
    pub async fn upgrade<H: Send + 'static>(
        &self,
        mut req: Request<Inbound>,
        strip: usize,
        down: &Downstream<'_>,
        allowed: &[HeaderValue],
        held: H,
    ) -> Result<Response<Body>, Error> {
        let protocols = tunnel::wanted(req.headers(), req.extensions(), req.version(), allowed)
            .ok_or(Error::Internal("an upgrade request changed on its way"))?;
        let extended = req.version() == Version::HTTP_2;
        // An HTTP/2 CONNECT's stream stays counted as open (the connection is not idle) for
        // as long as the tunnel it becomes.
        let stream = req.extensions_mut().remove::<crate::body::StreamHold>();
        let mut req = self.prepare(req, strip, down)?;
        // Taken out of the request: the client's socket (or HTTP/2 stream), once hyper has
        // written our 101 (or 200).
        let client = hyper::upgrade::on(&mut req);
        let key = if extended {
            *req.method_mut() = http::Method::GET;
            let key = tunnel::websocket_key().ok_or(Error::Internal("no random bytes for a WebSocket key"))?;
            let h = req.headers_mut();
            h.insert(header::SEC_WEBSOCKET_KEY, key.clone());
            h.entry(header::SEC_WEBSOCKET_VERSION).or_insert(HeaderValue::from_static("13"));
            Some(key)
        } else {
            None
        };
        let h = req.headers_mut();
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, protocols.clone());
        let exchange = async { self.send_on(self.pool.connect_for_upgrade().await, req).await };
        let (mut resp, conn) = match tokio::time::timeout(self.timeout, exchange).await {
            Ok(answered) => answered?,
            Err(_) => return Err(Error::Upstream(UpstreamFailure::Timeout)),
        };
        if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
            if extended && resp.status().is_success() {
                return Err(Error::Upstream(UpstreamFailure::BadResponse(
                    "a WebSocket handshake answered with a success that switched no protocol",
                )));
            }
            let (mut parts, body) = resp.into_parts();
            framing::check_response(parts.status, &mut parts.headers)?;
            headers::strip_hop_by_hop(&mut parts.headers);
            headers::append_via(&mut parts.headers, parts.version);
            parts.version = Version::HTTP_11;
            let lease = Lease { conn, home: self.pool.clone(), reuse: false };
            return Ok(Response::from_parts(parts, Body::upstream(body, lease, self.read_timeout)));
        }
        let chosen = tunnel::chosen(resp.headers(), &protocols)
            .ok_or(Error::Upstream(UpstreamFailure::BadResponse("a 101 to a protocol that was not offered")))?;
        if key.as_ref().is_some_and(|key| !tunnel::accepts(resp.headers(), key)) {
            return Err(Error::Upstream(UpstreamFailure::BadResponse(
                "a 101 whose Sec-WebSocket-Accept does not answer the key",
            )));
        }
        let upstream = hyper::upgrade::on(&mut resp);
        let (mut parts, _) = resp.into_parts();
        headers::strip_hop_by_hop(&mut parts.headers);
        if extended {
            // RFC 8441 §5: the stream is the WebSocket once the CONNECT has its 2xx.
            parts.status = http::StatusCode::OK;
            parts.headers.remove(header::SEC_WEBSOCKET_ACCEPT);
        } else {
            parts.headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            parts.headers.insert(header::UPGRADE, chosen);
        }
        headers::append_via(&mut parts.headers, parts.version);
        parts.version = Version::HTTP_11;
        parts.extensions.insert(tunnel::Pending::new(client, upstream, (held, stream)));
        // The connection's task ends by handing its socket to `upstream`.
        drop(conn);
        Ok(Response::from_parts(parts, Body::empty()))
    }

    /// A request as a stream on a shared HTTP/2 connection: `:scheme` and `:authority` set
    /// (the `Host` the upstream would have got), the response streamed on with its trailers.
    /// A gRPC call's `grpc-timeout` shortens the wait for the head. For `auto`, see
    /// [`HttpForwarder::auto_leg`].
    pub async fn forward_h2(
        &self,
        req: Request<Inbound>,
        strip: usize,
        down: &Downstream<'_>,
    ) -> Result<Response<Body>, Error> {
        let mut req = self.prepare(req, strip, down)?;
        self.h2_target(&mut req)?;
        self.h2_exchange(req, false).await.map_err(|f| f.error)
    }

    /// The target in absolute form for HTTP/2, from parts made at load: `:scheme` is the
    /// upstream's (what the request is to it, as `Host` is the client's), `:authority` the
    /// `Host` the upstream would have got: the client's when `preserve_host` kept it (taken
    /// out of the fields), else this upstream's own (`prepare` set no `Host` then).
    fn h2_target(&self, req: &mut Request<RequestBody>) -> Result<(), Error> {
        let authority = match req.headers_mut().remove(header::HOST) {
            Some(host) => http::uri::Authority::try_from(host.as_bytes())
                .map_err(|_| Error::BadRequest("the Host field cannot be forwarded over HTTP/2"))?,
            None => self.authority.clone(),
        };
        self.h2_authority(req, authority)?;
        *req.version_mut() = Version::HTTP_2;
        Ok(())
    }

    /// `req`'s target under this upstream's scheme and `authority`, its path and query kept.
    pub(crate) fn h2_authority(
        &self,
        req: &mut Request<RequestBody>,
        authority: http::uri::Authority,
    ) -> Result<(), Error> {
        let mut parts = std::mem::take(req.uri_mut()).into_parts();
        parts.scheme = Some(if self.tls { http::uri::Scheme::HTTPS } else { http::uri::Scheme::HTTP });
        parts.authority = Some(authority);
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(PathAndQuery::from_static("/"));
        }
        *req.uri_mut() =
            Uri::from_parts(parts).map_err(|_| Error::BadRequest("the request path cannot be forwarded"))?;
        Ok(())
    }

    /// This upstream's own authority as the request's (a group's retry on another server).
    pub(crate) fn h2_own_authority(&self, req: &mut Request<RequestBody>) -> Result<(), Error> {
        self.h2_authority(req, self.authority.clone())
    }

    /// A prepared HTTP/2 request ([`HttpForwarder::h2_target`]) as a stream on a shared
    /// connection, or, for `auto` when ALPN chose HTTP/1.1, as an HTTP/1.1 request (see
    /// [`HttpForwarder::auto_leg`]); the response streamed on with its trailers. A gRPC
    /// call's `grpc-timeout` shortens the wait for the head. A connection that turns out to
    /// take no new streams (closed, or GOAWAY received) is dropped and the request tried once
    /// more on another. The request comes back when it never left (no connection could be
    /// had, or none took it), and, with `keep` (a group that may retry), when the upstream
    /// refused its stream unprocessed.
    async fn h2_exchange(&self, req: Request<RequestBody>, keep: bool) -> Result<Response<Body>, group::Failed> {
        let Some(h2) = &self.h2 else {
            return Err(group::Failed { error: Error::Internal("an HTTP/1 upstream was sent a stream"), unsent: None });
        };
        let wait = grpc::timeout(req.headers()).map_or(self.timeout, |t| t.min(self.timeout));
        let exchange = async {
            let mut req = req;
            let mut again = true;
            loop {
                let leg = match &self.auto {
                    Some(learned) => self.auto_leg(h2, learned).await,
                    None => h2.checkout().await.map(|(send, stream)| Leg::H2(send, stream)),
                };
                let leg = match leg {
                    Ok(leg) => leg,
                    Err(e) => return Err(group::Failed { error: self.connect_failed(&e), unsent: Some(req) }),
                };
                return match leg {
                    Leg::H2(send, stream) => match h2::exchange(send, req, keep).await {
                        Ok((resp, pump)) => Ok(Answered::H2(resp, pump, stream)),
                        Err(h2::Failure::Unsent(unsent, e)) => {
                            h2::close(&stream);
                            if std::mem::take(&mut again) {
                                req = unsent;
                                continue;
                            }
                            Err(group::Failed { error: self.h2_failed(&e), unsent: Some(unsent) })
                        }
                        Err(h2::Failure::Client(e)) => Err(group::Failed { error: Error::ClientBody(e), unsent: None }),
                        Err(h2::Failure::Upstream { error, unsent }) => {
                            Err(group::Failed { error: self.h2_failed(&error), unsent })
                        }
                    },
                    Leg::H1(mut conn) => match conn.send.try_send_request(h1_form(req)).await {
                        Ok(resp) => Ok(Answered::H1(resp, conn)),
                        Err(mut e) => {
                            let unsent = e.take_message();
                            Err(group::Failed { error: self.failed(e.error()), unsent })
                        }
                    },
                };
            }
        };
        // The coarse wheel for waits of a second or more: no tokio timer entry per stream.
        let failed = |error| group::Failed { error, unsent: None };
        match crate::timer::timeout(wait, exchange).await {
            Ok(Ok(Answered::H2(resp, pump, stream))) => {
                let (mut parts, body) = resp.into_parts();
                framing::check_response(parts.status, &mut parts.headers).map_err(|bad| failed(bad.into()))?;
                headers::strip_hop_by_hop(&mut parts.headers);
                headers::append_via(&mut parts.headers, parts.version);
                parts.version = Version::HTTP_11;
                Ok(Response::from_parts(parts, Body::h2(body, pump, stream, self.read_timeout)))
            }
            Ok(Ok(Answered::H1(resp, conn))) => self.accept(resp, conn).map_err(failed),
            Ok(Err(f)) => Err(f),
            Err(_) => Err(failed(Error::Upstream(UpstreamFailure::Timeout))),
        }
    }

    /// Whose fault a failed stream was, and what kind of failure: a response h2 refused as
    /// malformed, else a broken stream or connection.
    fn h2_failed(&self, e: &::h2::Error) -> Error {
        tracing::debug!(upstream = %self.name, error = %e, "upstream stream failed");
        Error::Upstream(if h2::malformed(e) {
            UpstreamFailure::BadResponse("the response head is malformed")
        } else {
            UpstreamFailure::Broken(Cause::of(e))
        })
    }

    /// `auto` over TLS: a stream on an open HTTP/2 connection with room, or an idle HTTP/1.1
    /// connection (the pool ALPN chose last is looked in first), else a new connection
    /// offering `h2` and `http/1.1`, which joins the pool of the protocol ALPN chose.
    async fn auto_leg(&self, h2: &h2::H2Pool, learned: &AtomicU8) -> Result<Leg, pool::ConnectError> {
        let known = learned.load(Ordering::Relaxed);
        if known != LEARNED_H1 {
            if let Some((send, stream)) = h2.ready() {
                return Ok(Leg::H2(send, stream));
            }
        }
        if known != LEARNED_H2 {
            if let Some(conn) = self.pool.idle().await {
                return Ok(Leg::H1(conn));
            }
        }
        // Unless the upstream is known to speak HTTP/1.1, a burst opens one connection, not
        // one each: the others find room on it once it joined the h2 pool.
        let _one = if known == LEARNED_H1 { None } else { Some(h2.connecting().await) };
        if known != LEARNED_H1 {
            if let Some((send, stream)) = h2.ready() {
                return Ok(Leg::H2(send, stream));
            }
        }
        let connected = match h2.connector().connect(connector::Alpn::Either).await {
            Ok(c) => c,
            // The upstream refuses a new connection, but an open one may still carry it.
            Err(e) => return h2.any().map(|(send, stream)| Leg::H2(send, stream)).ok_or(e),
        };
        if connected.is_h2() {
            learned.store(LEARNED_H2, Ordering::Relaxed);
            let (send, stream) = h2.adopt(connected).await?;
            Ok(Leg::H2(send, stream))
        } else {
            learned.store(LEARNED_H1, Ordering::Relaxed);
            let send = connector::Connector::http1_on(connected).await?;
            Ok(Leg::H1(UpstreamConn { send, deadline: crate::timer::Deadline::new() }))
        }
    }

    /// A connection that could not be had, logged.
    fn connect_failed(&self, e: &pool::ConnectError) -> Error {
        tracing::debug!(upstream = %self.name, error = %e, "upstream connect failed");
        Error::Upstream(match e {
            pool::ConnectError::NotH2 => UpstreamFailure::NotH2,
            _ => UpstreamFailure::Connect(Cause::of(e)),
        })
    }

    /// The request as it goes upstream: target, version, hop-by-hop fields, forwarding
    /// fields, `Via`, `Host`, a malformed trace context dropped, the request id, then the
    /// route's header rules (which may override any of these but the framing fields).
    // Inlined: moved in and out of a call, the request is copied twice (measured: 600
    // instructions a request once `upgrade` became its second caller).
    #[inline(always)]
    fn prepare(
        &self,
        req: Request<Inbound>,
        strip: usize,
        down: &Downstream<'_>,
    ) -> Result<Request<RequestBody>, Error> {
        let (mut parts, body) = req.into_parts();
        let received = parts.version;
        parts.uri = self
            .upstream_uri(&parts.uri, strip)
            .map_err(|_| Error::BadRequest("the request path cannot be forwarded"))?;
        parts.version = Version::HTTP_11;
        let h = &mut parts.headers;
        // HTTP/2 upstreams get `te: trailers` on (gRPC needs it); it is the only TE HTTP/2 has.
        let h2 = self.h2.is_some();
        let trailers = h2 && grpc::te_trailers(h);
        let seen = headers::strip_hop_by_hop(h);
        // Room for what is added below, in one step. An HTTP/1 client's map was sized by an
        // earlier message of its connection and has it; an HTTP/2 stream's map was sized by
        // its own fields, and would grow here and again when the response (parsed into this
        // same map by hyper's client) gets its RateLimit fields.
        h.reserve(ADDED_FIELDS);
        if trailers {
            h.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        // The one authority of the request (see `crate::target`) is in `Host`. Kept (the
        // default), the upstream has it there; replaced by the upstream's own, it goes on in
        // `X-Forwarded-Host`. An HTTP/2 upstream's own goes in `:authority` instead
        // ([`HttpForwarder::h2_target`]).
        let replaced = if self.preserve_host && h.contains_key(header::HOST) {
            None
        } else if h2 {
            h.remove(header::HOST)
        } else {
            h.insert(header::HOST, self.authority_value.clone())
        };
        headers::add_forwarding_proto(h, down.peer, down.peer_trusted, replaced.as_ref(), down.https, seen);
        headers::append_via(h, received);
        if seen.trace() {
            crate::request_id::check_trace_context(h);
        }
        if let Some((name, id)) = &down.request_id {
            h.insert(*name, id.clone());
        }
        if let Some((rules, values)) = down.rules {
            rules.apply(h, values);
        }
        Ok(Request::from_parts(parts, RequestBody::new(body, self.body_read_timeout)))
    }

    /// A pooled connection, and the response head on it.
    #[allow(clippy::manual_async_fn)] // an `async fn` would hold `req` twice: argument and local
    fn exchange(
        &self,
        req: Request<RequestBody>,
    ) -> impl Future<Output = Result<(Response<Incoming>, UpstreamConn), Error>> + '_ {
        async move { self.send_on(self.pool.checkout().await, req).await }
    }

    /// `req` on a connection just taken or opened (or the failure to get one), each failure
    /// told by whose fault it was.
    async fn send_on(
        &self,
        conn: Result<UpstreamConn, pool::ConnectError>,
        req: Request<RequestBody>,
    ) -> Result<(Response<Incoming>, UpstreamConn), Error> {
        let mut conn = conn.map_err(|e| self.connect_failed(&e))?;
        match conn.send.send_request(req).await {
            Ok(resp) => Ok((resp, conn)),
            Err(e) => Err(self.failed(&e)),
        }
    }

    /// Whose fault a failed exchange was: the client's body, or the upstream's.
    fn failed(&self, e: &hyper::Error) -> Error {
        if let Some(client) = ClientBodyError::behind(e) {
            return Error::ClientBody(client);
        }
        tracing::debug!(upstream = %self.name, error = %e, "upstream request failed");
        Error::Upstream(if e.is_parse_too_large() {
            UpstreamFailure::BadResponse("the response head is too large")
        } else if e.is_parse() || e.is_parse_status() {
            UpstreamFailure::BadResponse("the response head is malformed")
        } else {
            UpstreamFailure::Broken(Cause::of(e))
        })
    }

    /// The origin-form target sent upstream: base path, the path less its first `strip`
    /// bytes (the route's prefix), the query. Without a rewrite the parsed target is reused.
    fn upstream_uri(&self, uri: &Uri, strip: usize) -> Result<Uri, http::Error> {
        let path = uri.path().get(strip..).unwrap_or("");
        if self.base_path.is_empty() && strip == 0 && path.starts_with('/') {
            if let Some(pq) = uri.path_and_query() {
                return Ok(Uri::from(pq.clone()));
            }
        }
        Ok(Uri::from(PathAndQuery::try_from(origin_form(&self.base_path, uri, strip))?))
    }
}

/// The origin-form target an upstream with `base_path` gets for `uri` less the first `strip`
/// bytes of its path (the route's prefix), with its query.
pub(crate) fn origin_form(base_path: &str, uri: &Uri, strip: usize) -> String {
    let path = uri.path().get(strip..).unwrap_or("");
    let query = uri.query();
    let slash = if path.starts_with('/') { "" } else { "/" };
    let mut pq = String::with_capacity(base_path.len() + path.len() + 2 + query.map_or(0, str::len));
    pq.push_str(base_path);
    pq.push_str(slash);
    pq.push_str(path);
    if let Some(q) = query {
        pq.push('?');
        pq.push_str(q);
    }
    pq
}

/// Where a request to an HTTP/2 (or `auto`) upstream goes.
enum Leg {
    H2(h2::Send, h2::Stream),
    H1(UpstreamConn),
}

/// The response head on its leg.
enum Answered {
    H2(Response<::h2::RecvStream>, Option<crate::body::h2::Pump>, h2::Stream),
    H1(Response<Incoming>, UpstreamConn),
}

/// An HTTP/2-form request ([`HttpForwarder::h2_target`]) back in HTTP/1.1's: `Host` from
/// the `:authority`, the target in origin form, no `TE` (for `auto` when ALPN chose HTTP/1.1).
fn h1_form(mut req: Request<RequestBody>) -> Request<RequestBody> {
    let uri = std::mem::take(req.uri_mut());
    if let Some(host) = uri.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()) {
        req.headers_mut().insert(header::HOST, host);
    }
    *req.uri_mut() = uri.path_and_query().map_or_else(|| Uri::from_static("/"), |pq| Uri::from(pq.clone()));
    *req.version_mut() = Version::HTTP_11;
    // `te: trailers` is for HTTP/2 (and a hop-by-hop field in HTTP/1.1).
    req.headers_mut().remove(header::TE);
    req
}

pin_project_lite::pin_project! {
    /// `inner`, or `Err(Elapsed)` once `deadline` (armed by the caller) has passed.
    struct Within<'a, F> {
        #[pin]
        inner: F,
        deadline: &'a crate::timer::Deadline,
    }
}

impl<'a, F> Within<'a, F> {
    fn new(inner: F, deadline: &'a crate::timer::Deadline) -> Self {
        Within { inner, deadline }
    }
}

impl<F: Future> Future for Within<'_, F> {
    type Output = Result<F::Output, crate::timer::Elapsed>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = self.project();
        if let std::task::Poll::Ready(out) = this.inner.poll(cx) {
            return std::task::Poll::Ready(Ok(out));
        }
        this.deadline.poll_expired(cx).map(|()| Err(crate::timer::Elapsed))
    }
}

/// Reads a client's body to its end without keeping it, at most `max` bytes (the built-in
/// responder answers after the whole request, so a body that breaks its framing is refused).
///
/// # Errors
/// More than `max` bytes: [`Error::TooLarge`]; a body that fails or pauses past `idle`:
/// [`Error::ClientBody`].
pub async fn read_to_end(body: Inbound, max: u64, idle: Duration) -> Result<(), Error> {
    use http_body::Body as _;
    use http_body_util::BodyExt;
    if body.size_hint().lower() > max {
        return Err(Error::TooLarge(max));
    }
    let mut body = RequestBody::new(body, idle);
    let mut read = 0u64;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame.map_err(Error::ClientBody)?.data_ref() {
            read = read.saturating_add(data.len() as u64);
            if read > max {
                return Err(Error::TooLarge(max));
            }
        }
    }
    Ok(())
}

/// The built-in responder, compiled: its config and, when it has faults, their random
/// sources (a responder without faults carries nothing more than its config).
pub struct Respond {
    config: Responder,
    faults: Option<Box<faults::Live>>,
}

impl Respond {
    /// With one random source per worker of `workers` when `config` has faults.
    pub fn new(config: &Responder, workers: usize) -> Respond {
        let faults = config.faults.as_deref().map(|f| Box::new(faults::Live::new(f, workers)));
        Respond { config: config.clone(), faults }
    }
}

impl std::ops::Deref for Respond {
    type Target = Responder;
    fn deref(&self) -> &Responder {
        &self.config
    }
}

/// The built-in responder's answer: its fixed one after its fixed latency, or one drawn from
/// its faults.
pub async fn respond(r: &Respond) -> Response<Body> {
    if let Some(f) = &r.faults {
        // Boxed: its future would enlarge every answer's.
        return Box::pin(f.respond(&r.config)).await;
    }
    let r = &r.config;
    if !r.latency.is_zero() {
        Box::pin(tokio::time::sleep(r.latency)).await;
    }
    let mut resp = Response::new(Body::full(r.body.clone()));
    *resp.status_mut() = r.status;
    resp.headers_mut().clone_from(&r.headers);
    resp
}
