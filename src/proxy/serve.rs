//! The request path: one request, in phases over one context: *route* (`handle_peer`),
//! *admit*, *forward* (or the last hop's or the responder's own answer), *settle*, then
//! *finish* and *log* (`serve` runs them in order; each phase is a function here).
//!
//! One concept, though over 600 lines: the request path.

use super::*;

/// Counts a request in `requests_in_flight` until dropped: when it is answered, or when the
/// client goes away first and hyper drops the request's future.
pub(super) struct InFlight<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl InFlight<'_> {
    fn enter(metrics: &Metrics) -> InFlight<'_> {
        metrics.in_flight().inc();
        InFlight(metrics.in_flight())
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Proxy {
    /// Serves one request. Never fails: every problem is an answer from [`answer`].
    ///
    /// The target is decided, the route found and the head taken apart before the returned
    /// future exists, and the future holds the request in one place only: hyper moves it by
    /// value per request, so its size is copying work.
    pub fn handle(self: Arc<Proxy>, req: Request<Incoming>, peer: SocketAddr) -> impl Future<Output = Response<Body>> {
        self.handle_peer(req, Peer::plain(peer))
    }

    /// [`Proxy::handle`] for a client whose connection came through the `listen` room (TLS,
    /// a PROXY header): `peer` says who it is.
    // Inlined into both callers, as `handle` was into its one: measured, the request path's
    // framing and target checks otherwise stop being inlined (+1.8 % instructions per 429).
    #[inline(always)]
    // Generic over the body: hyper's goes in as it is, an HTTP/3 stream's already wrapped.
    pub fn handle_peer<B: Into<Inbound>>(
        self: Arc<Proxy>,
        req: Request<B>,
        peer: Peer,
    ) -> impl Future<Output = Response<Body>> {
        let started = self.config.log.access.then(Instant::now);
        let (mut parts, body) = req.into_parts();
        let body = body.into();
        let routed = crate::framing::check(&mut parts)
            .map_err(Error::from)
            .and_then(|()| target::decide(&mut parts))
            .and_then(|t| {
                let (path, query) = (t.path(&parts), parts.uri.query());
                let found =
                    route::find(&self.config.routes, &self.conditions, &parts.method, &parts.headers, path, query);
                found.map(|i| (i, t)).ok_or(Error::NoRoute)
            })
            // Boxed: the future keeps its arguments to the end, and an unrouted request is rare.
            .map_err(Box::new);
        self.serve(routed, parts, body, peer, started)
    }

    /// The routed request, in phases over one [`Ctx`]: *route* (done by the caller; a miss is
    /// answered here), *admit* ([`Proxy::admit`]), *forward* (or answer at the last hop, or
    /// from the responder), *settle* ([`Proxy::settle`]), then *finish* and *log*
    /// ([`Proxy::finish`]). One future holding the head once (see [`Proxy::handle`]): the
    /// forwarded request is made from it in this block, so no phase takes the head by value.
    // Not an `async fn`: its arguments would be kept twice in the future, as arguments and as
    // locals (376 bytes); captured by an `async move` block, each is kept once.
    #[allow(clippy::manual_async_fn)]
    fn serve(
        self: Arc<Proxy>,
        routed: Result<(usize, Target), Box<Error>>,
        mut parts: Parts,
        body: Inbound,
        peer: Peer,
        started: Option<Instant>,
    ) -> impl Future<Output = Response<Body>> {
        async move {
            let this = &*self;
            let _in_flight = InFlight::enter(&this.metrics);
            let mut ctx = Ctx::new(this, &parts, &peer);
            // A body that an answer made before reading it leaves here (see `body::unread`).
            let unread = crate::body::unread::Unread::of(&body, &parts);
            let mut body = Some(body);
            let (idx, mut target) = match routed {
                Ok(found) => found,
                Err(e) => {
                    let resp = this.unrouted(&e, &parts, &mut ctx, started);
                    return match unread.left(&mut body, true) {
                        Some(left) => Box::pin(left.settle(resp)).await,
                        None => resp,
                    };
                }
            };
            let (route, lane) = (&this.config.routes[idx], &this.lanes[idx]);
            let span = this.tracer.as_deref().and_then(|t| Proxy::trace_start(t, &parts));
            let mut log = Access::new(lane, route, &parts, this.config.log.access, ctx.id.as_ref(), span);
            log.grpc = ctx.grpc;
            let version = parts.version;
            // What the route's steps learn of the request for its answers (a 429's too).
            let mut seen = step::Seen::default();
            let (mut resp, from) = 'answer: {
                // The step that answers once the limits admit the request (a counted preflight).
                let mut after_limits = None;
                // *Arrive*: the route's steps, if it has any.
                if !lane.steps.is_empty() {
                    match self.arrive(route, lane, &mut parts, &target, &ctx, &mut seen, &mut log).await {
                        (Flow::Next, _) => {}
                        (Flow::Answer(here), _) => break 'answer (here, Answered::Own),
                        (Flow::Stored(hit), _) => break 'answer (hit, Answered::Stale),
                        (Flow::Refuse(e), _) => {
                            break 'answer (
                                this.refused(route, lane, &e, Some(&parts), version, &mut log),
                                Answered::Own,
                            )
                        }
                        (Flow::AfterLimits, i) => after_limits = Some(i),
                    }
                }
                let admission = match this.admit(route, lane, &mut parts, &mut target, &ctx, &mut log).await {
                    Ok(a) => a,
                    Err(e) => {
                        break 'answer (this.refused(route, lane, &e, Some(&parts), version, &mut log), Answered::Own)
                    }
                };
                if let Some(i) = after_limits {
                    let (mut resp, from) = lane.steps.admitted(i, &parts, &mut seen);
                    // A metered cache hit says what it spent, as the upstream's answer would.
                    if let (Some(mut a), Answered::Stale) = (admission, from) {
                        lane.gate.decorate(&mut a, &mut resp);
                    }
                    break 'answer (resp, from);
                }
                // A copy of the head, only when a stale copy could be stored or served for it.
                let head = this.wants_copy(route, lane, &parts).then(|| Box::new(parts.clone()));
                match this.last_hop(lane, &mut parts) {
                    Ok(None) => {}
                    Ok(Some(here)) => break 'answer (here, Answered::Own),
                    Err(e) => break 'answer (this.refused(route, lane, &e, None, version, &mut log), Answered::Own),
                }
                let (resp, from) = match &*this.backends[this.backend_of(route, lane, &parts, &target, &peer)] {
                    Backend::Respond(r) => match this.responder(r, &parts, &mut body).await {
                        Ok(resp) => (resp, Answered::Responder),
                        Err(e) => {
                            break 'answer (this.refused(route, lane, &e, None, version, &mut log), Answered::Own)
                        }
                    },
                    backend => {
                        let Some(strip) = strip_len(route, parts.uri.path(), target.path(&parts)) else {
                            let e = Error::BadRequest(STRIP_PARAMS);
                            break 'answer (
                                this.refused(route, lane, &e, Some(&parts), version, &mut log),
                                Answered::Own,
                            );
                        };
                        let request_values = this.values(&lane.request_headers, route, &parts, &target, &ctx);
                        let down = ctx.downstream(lane, request_values.as_deref());
                        let key = this.hash_key(backend, route, &parts, &target, &peer);
                        // An upgrade (HTTP/1.1 `Upgrade`, or an HTTP/2 CONNECT): hyper leaves an
                        // `OnUpgrade` in the request's (usually empty) extensions.
                        let upgrade = parts.extensions.get::<hyper::upgrade::OnUpgrade>().is_some();
                        match log.trace.as_mut() {
                            // The upstream's parent is the exchange's client span.
                            Some(span) => Proxy::trace_upstream(span, this.config.upstream(route), &mut parts, strip),
                            // Not sampled: the upstream is told so, and follows.
                            None if this.tracer.is_some() => crate::trace::unsampled(&mut parts.headers),
                            None => {}
                        }
                        let Some(req) = body.take().map(|body| Request::from_parts(parts, body)) else {
                            let e = Error::Internal("the request body was taken before it was forwarded");
                            break 'answer (this.refused(route, lane, &e, None, version, &mut log), Answered::Own);
                        };
                        let sent = Instant::now();
                        let out = match backend {
                            // Boxed: rare, and its future would enlarge every request's.
                            Backend::Http(fwd) if upgrade => {
                                Box::pin(Proxy::upgrade(route, lane, fwd, req, strip, &down)).await
                            }
                            // Boxed: its future would otherwise enlarge every HTTP/1 request's.
                            Backend::Http(fwd) if fwd.is_h2() => Box::pin(fwd.forward_h2(req, strip, &down)).await,
                            Backend::Http(fwd) => fwd.forward(req, strip, &down).await,
                            // Boxed: a group's future stays out of every single-server request's.
                            Backend::Group(g) if upgrade => {
                                Box::pin(Proxy::upgrade_group(route, lane, g, req, strip, &down, key)).await
                            }
                            Backend::Group(g) => Box::pin(g.forward(req, strip, &down, key)).await,
                            Backend::Respond(_) => Err(Error::Internal("a responder reached the forwarding step")),
                        };
                        lane.upstream_took(&mut log, out.as_ref().map_or(0, |r| r.status().as_u16()), sent.elapsed());
                        if let (Backend::Group(g), Some((server, tries))) = (backend, ctx.served.get()) {
                            log.served = Some((g.server_name(server).unwrap_or_else(|| Arc::from("?")), tries));
                        }
                        match out {
                            Ok(resp) => (resp, Answered::Upstream),
                            Err(e) => {
                                let refused = this.refused(route, lane, &e, head.as_deref(), version, &mut log);
                                break 'answer (refused, Answered::Own);
                            }
                        }
                    }
                };
                let mut resp = resp;
                let tunnel = this.settle(route, lane, admission, head.as_deref(), &mut resp, &mut log).await;
                (resp, if tunnel { Answered::Tunnel } else { from })
            };
            if let Some(left) = unread.left(&mut body, log.error.is_some()) {
                resp = Box::pin(left.settle(resp)).await;
            }
            // A stale copy stood in for what was answered.
            let from = if log.stale == Stale::No { from } else { Answered::Stale };
            this.finish(lane, &mut resp, from, &mut seen, ctx.id_field(), &mut log, (started, peer.addr.ip()));
            resp
        }
    }

    /// *Finish* and *log*: what every answer of the route carries (the request id, the answer
    /// side of its steps), its count, then the access log line.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        lane: &Lane,
        resp: &mut Response<Body>,
        from: Answered,
        seen: &mut step::Seen,
        id_field: Option<(&http::HeaderName, http::HeaderValue)>,
        log: &mut Access<'_>,
        (started, peer): (Option<Instant>, std::net::IpAddr),
    ) {
        if let Some((name, id)) = id_field {
            set_id(resp.headers_mut(), name, id);
        }
        if lane.steps.answers() {
            lane.steps.answer(seen, resp, from, log.notes());
        }
        lane.metrics.response(resp.status().as_u16());
        if let Some(started) = started {
            log.emit(resp.status().as_u16(), started.elapsed(), peer);
        }
        if let Some(span) = log.trace.take() {
            self.trace_end(*span, log, resp.status().as_u16(), peer);
        }
    }

    /// A routed request's span, if `tracer` samples it, with the facts of its head that the
    /// access log does not keep (the server's address and the protocol).
    #[cold]
    fn trace_start(tracer: &crate::trace::Tracer, parts: &Parts) -> Option<Box<crate::trace::Span>> {
        let mut span = tracer.start(&parts.headers)?;
        let host = parts.headers.get(http::header::HOST).and_then(|h| h.to_str().ok());
        if let Some(authority) = host.and_then(|h| h.parse::<http::uri::Authority>().ok()) {
            span.attributes.push(crate::trace::text("server.address", authority.host()));
            if let Some(port) = authority.port_u16() {
                span.attributes.push(crate::trace::int("server.port", i64::from(port)));
            }
        }
        let version = match parts.version {
            http::Version::HTTP_09 => "0.9",
            http::Version::HTTP_10 => "1.0",
            http::Version::HTTP_2 => "2",
            http::Version::HTTP_3 => "3",
            _ => "1.1",
        };
        span.attributes.push(crate::trace::text("network.protocol.version", version));
        Some(span)
    }

    /// A traced request's upstream exchange starts: the `traceparent` naming its client span,
    /// and where it goes (a group's server is known once one answered).
    #[cold]
    fn trace_upstream(span: &mut crate::trace::Span, up: &crate::config::Upstream, parts: &mut Parts, strip: usize) {
        let target = match &up.kind {
            crate::config::UpstreamKind::Http(h) => Some(crate::trace::Target {
                scheme: if h.tls.is_some() { "https" } else { "http" },
                authority: h.authority.clone(),
                path_and_query: forward::origin_form(&h.base_path, &parts.uri, strip),
            }),
            crate::config::UpstreamKind::Respond(_) => None,
        };
        parts.headers.insert(crate::request_id::TRACEPARENT, span.upstream_starts(target));
    }

    /// Ends a traced request's span with the facts of its log line.
    #[cold]
    fn trace_end(&self, span: crate::trace::Span, log: &Access<'_>, status: u16, peer: std::net::IpAddr) {
        let Some(tracer) = &self.tracer else { return };
        let (attributes, exchange) = log.span(status, peer);
        let name = format!("{} {}", log.method, log.route);
        tracer.finish(span, name, status, attributes, exchange);
    }

    /// The answer to a request no route took (a bad target, no route), logged.
    fn unrouted(&self, e: &Error, parts: &Parts, ctx: &mut Ctx<'_>, started: Option<Instant>) -> Response<Body> {
        if started.is_some() {
            let (method, path, status) = (&parts.method, parts.uri.path(), e.status().as_u16());
            let peer = ctx.peer.addr.ip();
            tracing::info!(target: "tollgate::access", %peer, %method, path, status, error = e.kind(), request_id = ctx.request_id());
        }
        let mut resp = if ctx.grpc {
            self.unrouted.respond_grpc(e)
        } else {
            self.unrouted.respond(e, &parts.method, parts.uri.path(), parts.version)
        };
        if let Some((name, id)) = ctx.id_field() {
            set_id(resp.headers_mut(), name, id);
        }
        resp
    }

    /// A route's header rule values for this request. They read the request as the client
    /// sent it (its head is not changed before it is forwarded; `{path}` is the client's path
    /// after a rewrite too).
    #[inline(always)]
    fn values(
        &self,
        rules: &Option<Arc<forward::rules::HeaderRules>>,
        route: &Route,
        parts: &Parts,
        target: &Target,
        ctx: &Ctx<'_>,
    ) -> RenderedValues {
        let rules = rules.as_ref().filter(|r| r.is_dynamic())?;
        Some(self.render(rules, route, parts, target, ctx))
    }

    #[cold]
    fn render(
        &self,
        rules: &forward::rules::HeaderRules,
        route: &Route,
        parts: &Parts,
        target: &Target,
        ctx: &Ctx<'_>,
    ) -> forward::rules::Values {
        rules.render(&forward::rules::Vars {
            route: &route.name,
            headers: &parts.headers,
            path: target.path(parts),
            request_id: ctx.request_id(),
            peer: ctx.peer.addr.ip(),
            trusted: &self.trusted,
        })
    }

    /// *Admit*: the route's method rule and path rewrite, then its limits and cap; waits
    /// out a shaping delay. `None`: the route has no gate.
    async fn admit(
        &self,
        route: &Route,
        lane: &Lane,
        parts: &mut Parts,
        target: &mut Target,
        ctx: &Ctx<'_>,
        log: &mut Access<'_>,
    ) -> Result<Option<Admission>, Error> {
        // TRACE reflects the request, credentials and all: not taken unless the route lists
        // it (nginx refuses it too).
        if parts.method == Method::TRACE && !takes_trace(route) {
            return Err(Error::MethodNotAllowed);
        }
        if let Some(rw) = &lane.rewrite {
            if let Some(path) = rw.apply(target.path(parts)) {
                target.rewrite(parts, &path)?;
            }
        }
        if lane.gate.is_open() {
            return Ok(None);
        }
        // The key's context lives for the decision only, and the decision is moved out
        // before any wait: the request's future keeps neither across another await (each
        // would take a slot of its own in it).
        let checked = {
            let key = self.key_ctx(route, parts, target, ctx.peer);
            let now = self.clock.now();
            if let Some(extra) = log.extra.as_deref_mut() {
                extra.decided(now, self.config.log.access_keys.then(|| lane.gate.limits()), &key);
            }
            lane.gate.check(&key, now).await
        };
        let admission = checked?;
        log.note = admission.note;
        let wait = admission.wait();
        if !wait.is_zero() {
            Box::pin(tokio::time::sleep(wait)).await;
        }
        Ok(Some(admission))
    }

    /// *Arrive*: the route's steps, in order, before its limits (see [`crate::step`]): what
    /// they decided, and which step decided it. The identity `auth` verified goes in the log
    /// line and the span.
    #[allow(clippy::too_many_arguments)]
    async fn arrive(
        self: &Arc<Self>,
        route: &Route,
        lane: &Lane,
        parts: &mut Parts,
        target: &Target,
        ctx: &Ctx<'_>,
        seen: &mut step::Seen,
        log: &mut Access<'_>,
    ) -> (Flow, u8) {
        let decided = {
            let mut arrival = step::Arrival {
                parts: &mut *parts,
                target,
                route: &route.name,
                request_id: ctx.id.as_ref(),
                peer: ctx.peer.addr.ip(),
                trusted: &self.trusted,
                clock: &*self.clock,
                notes: log.notes(),
                refresh: &Refresher { proxy: self, peer: ctx.peer.addr },
            };
            lane.steps.arrive(&mut arrival, seen).await
        };
        // Only the log line and the span keep it: no lookup when neither is made.
        if log.extra.is_some() || log.trace.is_some() {
            if let Some(id) = identity(parts) {
                log.identified(&id.consumer);
            }
        }
        decided
    }

    /// What limit keys (and a `hash` group's balancing) read of the request.
    #[inline(always)]
    fn key_ctx<'k>(&'k self, route: &'k Route, parts: &'k Parts, target: &'k Target, peer: &'k Peer) -> KeyCtx<'k> {
        KeyCtx {
            route: &route.name,
            client_ip: self.trusted.client_ip(peer.addr.ip(), &parts.headers),
            path: target.path(parts),
            parts,
            tls_client: peer.tls_client(),
            known: None,
        }
    }

    /// The upstream that takes the request: the route's own, or the one its `split` chooses.
    #[inline(always)]
    fn backend_of(&self, route: &Route, lane: &Lane, parts: &Parts, target: &Target, peer: &Peer) -> usize {
        match &lane.split {
            None => route.upstream,
            Some(split) => self.split_to(split, route, parts, target, peer),
        }
    }

    #[inline(never)]
    fn split_to(
        &self,
        split: &forward::split::Chooser,
        route: &Route,
        parts: &Parts,
        target: &Target,
        peer: &Peer,
    ) -> usize {
        split.choose(&parts.headers, |spec| self.key_ctx(route, parts, target, peer).key(spec).0 as u64)
    }

    /// `balance: hash`: the request's key, as a limit keys it (0 for other backends).
    #[inline(always)]
    fn hash_key(&self, backend: &Backend, route: &Route, parts: &Parts, target: &Target, peer: &Peer) -> u64 {
        let Backend::Group(group) = backend else { return 0 };
        group.hash_key().map_or(0, |spec| self.key_ctx(route, parts, target, peer).key(spec).0 as u64)
    }

    /// `Max-Forwards` on `OPTIONS` and `TRACE`: the answer tollgate gives as the last hop, if
    /// it is one (the field is lowered by one otherwise).
    fn last_hop(&self, lane: &Lane, parts: &mut Parts) -> Result<Option<Response<Body>>, Error> {
        if !matches!(parts.method, Method::OPTIONS | Method::TRACE) || !forward::hop::last(&mut parts.headers)? {
            return Ok(None);
        }
        Ok(Some(if parts.method == Method::OPTIONS { lane.answers.options() } else { lane.answers.trace(parts) }))
    }

    /// The built-in responder's answer, once it has read the whole request, as any server
    /// does (a body that breaks its framing is refused, not answered); a client that waits for
    /// `100 Continue` gets the final answer instead (RFC 9110 §10.1.1), as nginx's `return`
    /// gives it.
    async fn responder(
        &self,
        r: &forward::Respond,
        parts: &Parts,
        body: &mut Option<Inbound>,
    ) -> Result<Response<Body>, Error> {
        let waits =
            parts.headers.get(http::header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        // A body not asked for stays where it is (see `body::unread`).
        if let Some(body) = body.take_if(|b| !waits && !http_body::Body::is_end_stream(b)) {
            // Boxed: rare on the paths that are measured, and its future would enlarge theirs.
            Box::pin(forward::read_to_end(body, r.max_body, self.config.server.body_read_timeout)).await?;
        }
        Ok(forward::respond(r).await)
    }

    /// *Settle*: a cost taken from the response is debited or refunded now that the head is
    /// here; a stale copy is kept (or stands in for a 5xx); the RateLimit fields go on; the
    /// body (or the tunnel) holds the concurrency slot until it ends. True when the answer
    /// starts a tunnel.
    async fn settle(
        &self,
        route: &Route,
        lane: &Lane,
        mut admission: Option<Admission>,
        head: Option<&Parts>,
        resp: &mut Response<Body>,
        log: &mut Access<'_>,
    ) -> bool {
        // Boxed, so that routes without one carry no larger future.
        if let Some(a) = admission.as_mut().filter(|a| Gate::owes(a)) {
            Box::pin(lane.gate.settle(a, resp.headers(), self.clock.now())).await;
        }
        if let Some(head) = head {
            let answered = std::mem::replace(resp, Response::new(Body::empty()));
            *resp = self.after_upstream(route, lane, head, answered, log);
        }
        let mut permit = None;
        if let Some(mut a) = admission {
            lane.gate.decorate(&mut a, resp);
            permit = a.permit;
        }
        if let Some(p) = &mut permit {
            p.answered(resp.status());
        }
        // A 200 too: the answer to an HTTP/2 extended CONNECT (RFC 8441).
        let mut tunnel = false;
        if matches!(resp.status().as_u16(), 101 | 200) {
            // The tunnel holds the concurrency slot and its tunnel slot for its life.
            if let Some(pending) = resp.extensions_mut().remove::<forward::tunnel::Pending>() {
                pending.start(route.tunnels.idle_timeout, lane.metrics.tunnels.clone(), permit.take());
                tunnel = true;
            }
        }
        if let Some(permit) = permit {
            resp.body_mut().hold(permit.into());
        }
        tunnel
    }
}

impl Proxy {
    /// The tunnel slot of an upgrade the route tunnels (`upgrades:`) to a backend that can:
    /// taken first, it goes with the tunnel, or back on any other answer.
    fn tunnel_slot<B>(
        route: &Route,
        lane: &Lane,
        tunnels: bool,
        req: &Request<B>,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Error> {
        let wanted = tunnels
            && !route.upgrades.is_empty()
            && forward::tunnel::wanted(req.headers(), req.extensions(), req.version(), &route.upgrades).is_some();
        if !wanted {
            return Ok(None);
        }
        lane.tunnels.clone().try_acquire_owned().map(Some).map_err(|_| Error::TooManyTunnels)
    }

    /// An upgrade (HTTP/1.1 `Upgrade`, or an HTTP/2 CONNECT) to a single server: a tunnel
    /// when the route allows one, else an ordinary request without `Upgrade`.
    async fn upgrade(
        route: &Route,
        lane: &Lane,
        fwd: &HttpForwarder,
        req: Request<Inbound>,
        strip: usize,
        down: &Downstream<'_>,
    ) -> Result<Response<Body>, Error> {
        if let Some(slot) = Proxy::tunnel_slot(route, lane, fwd.tunnels(), &req)? {
            fwd.upgrade(req, strip, down, &route.upgrades, slot).await
        } else if is_extended_connect(&req) {
            Err(Error::BadRequest(UNTUNNELLED_CONNECT))
        } else if fwd.is_h2() {
            fwd.forward_h2(req, strip, down).await
        } else {
            fwd.forward(req, strip, down).await
        }
    }

    /// [`Proxy::upgrade`] to a group of servers.
    async fn upgrade_group(
        route: &Route,
        lane: &Lane,
        group: &forward::group::Group,
        req: Request<Inbound>,
        strip: usize,
        down: &Downstream<'_>,
        key: u64,
    ) -> Result<Response<Body>, Error> {
        if let Some(slot) = Proxy::tunnel_slot(route, lane, group.tunnels(), &req)? {
            group.upgrade(req, strip, down, &route.upgrades, slot, key).await
        } else if is_extended_connect(&req) {
            Err(Error::BadRequest(UNTUNNELLED_CONNECT))
        } else {
            group.forward(req, strip, down, key).await
        }
    }
}

impl Lane {
    /// The upstream exchange's status (0: none came) and time, for the metric and the log.
    fn upstream_took(&self, log: &mut Access<'_>, status: u16, took: Duration) {
        self.metrics.upstream_seconds.observe(took);
        log.upstream = Some((status, took));
    }

    /// Keeps a 429 in the route's ring of last throttled requests (the dashboard's): a copy
    /// of a few bytes, skipped when another one is being kept at that moment.
    // Out of line: `refused` answers every kind of failure, and stays as it was for the others.
    #[inline(never)]
    fn note_throttled(&self, d: &crate::answer::Denied, id: Option<&RequestId>) {
        let limit = d.limits.first().map_or(0, |l| l.0);
        let id = id.map_or(&[][..], RequestId::as_bytes);
        self.metrics.throttles.record(crate::timer::now_ms(), limit, d.retry_after_secs, id);
    }
}

/// What every phase of one request reads: who sent it and under which id.
struct Ctx<'a> {
    peer: &'a Peer,
    /// Whether the peer is a trusted proxy: decided once, read by the request id and the
    /// forwarding fields.
    peer_trusted: bool,
    /// The request's id, made as it enters; only a trusted proxy's own is read, so the
    /// common case looks up no field.
    id: Option<RequestId>,
    /// The field that carries it (`request_id.header`).
    id_name: Option<&'a http::HeaderName>,
    /// gRPC runs on HTTP/2 only: an HTTP/1 request costs one comparison here.
    grpc: bool,
    /// Which server of a group took the request (see [`forward::Served`]).
    served: forward::Served,
}

impl<'a> Ctx<'a> {
    fn new(proxy: &'a Proxy, parts: &Parts, peer: &'a Peer) -> Ctx<'a> {
        let peer_trusted = proxy.trusted.is_trusted(peer.addr.ip());
        let id = proxy.config.request_id.as_ref().map(|name| RequestId::decide(name, &parts.headers, peer_trusted));
        let id_name = proxy.config.request_id.as_ref();
        let grpc = parts.version == http::Version::HTTP_2 && forward::grpc::is_grpc(&parts.headers);
        Ctx { peer, peer_trusted, id, id_name, grpc, served: forward::Served::default() }
    }

    /// The id's field and value, for the forwarded request and the answer (made for each:
    /// the future keeps the id once, and a value made twice costs what sharing one did).
    fn id_field(&self) -> Option<(&'a http::HeaderName, http::HeaderValue)> {
        self.id_name.zip(self.id.as_ref().map(RequestId::value))
    }

    /// The id as text, for the log and rule values.
    fn request_id(&self) -> Option<&str> {
        self.id.as_ref().map(RequestId::as_str)
    }

    /// What the forwarded request says of its client; `values`: the route's request header
    /// rule values.
    #[inline(always)]
    fn downstream<'d>(&'d self, lane: &'d Lane, values: Option<&'d [HeaderValue]>) -> Downstream<'d> {
        Downstream {
            peer: self.peer.addr.ip(),
            peer_trusted: self.peer_trusted,
            https: self.peer.tls.is_some(),
            request_id: self.id_field(),
            rules: lane.request_headers.as_deref().map(|r| (r, values.unwrap_or_default())),
            served: &self.served,
        }
    }
}

/// The identity *auth* verified, kept in the head's extensions (`None` on routes without
/// `auth`: their head has no extensions map, so this is one comparison).
#[inline(always)]
fn identity(parts: &Parts) -> Option<&Identity> {
    parts.extensions.get::<Box<Identity>>().map(|id| &**id)
}

/// Whether `route` takes `TRACE`: only when its `methods:` list it.
fn takes_trace(route: &Route) -> bool {
    route.methods.as_ref().is_some_and(|m| m.contains(&Method::TRACE))
}

impl Proxy {
    fn wants_copy(&self, route: &Route, lane: &Lane, parts: &Parts) -> bool {
        if route.stale_on_limit.is_none() && route.stale_on_upstream_error.is_none() {
            return false;
        }
        match parts.method {
            Method::GET => self.cache.may_store(parts, lane.keyed_on_credentials),
            Method::HEAD => route.stale_on_upstream_error.is_some(),
            _ => false,
        }
    }

    /// The answer to a request that was refused or failed: a stale copy when the route allows
    /// one for this kind of failure and `head` is known, else the error's own answer.
    fn refused(
        &self,
        route: &Route,
        lane: &Lane,
        e: &Error,
        head: Option<&Parts>,
        version: http::Version,
        log: &mut Access,
    ) -> Response<Body> {
        log.error = Some(e.kind());
        log.cause = e.cause().cloned();
        if let Error::Throttled(d) = e {
            lane.note_throttled(d, log.request_id);
            log.note = if log.grpc {
                Note { retry_after_secs: Some(d.retry_after_secs), ..log.note }
            } else {
                if let Some(span) = log.trace.as_mut() {
                    let limits = lane.gate.limits();
                    let names = d.limits.iter().filter_map(|l| limits.get(l.0)).map(|l| l.config.name.as_str());
                    span.attributes.push(crate::trace::texts("tollgate.limit.denied", names));
                }
                Note {
                    limit: d.limits.first().map(|l| l.0),
                    remaining: Some(0),
                    retry_after_secs: Some(d.retry_after_secs),
                    delayed_us: 0,
                }
            };
        }
        if log.grpc {
            // A gRPC client reads the answer from grpc-status; a stale copy is never one.
            return lane.answers.respond_grpc(e);
        }
        if let (Some(reason), Some(parts)) = (e.stale_reason(), head) {
            let max_age = match reason {
                StaleReason::Throttled => route.stale_on_limit,
                StaleReason::UpstreamError { .. } => route.stale_on_upstream_error,
            };
            if let Some(stale) = max_age.and_then(|max_age| self.stale(lane, parts, reason, max_age, log)) {
                return stale;
            }
        }
        let (method, path) = head.map_or((&Method::GET, ""), |p| (&p.method, p.uri.path()));
        lane.answers.respond(e, method, path, version)
    }

    fn stale(
        &self,
        lane: &Lane,
        parts: &Parts,
        reason: StaleReason,
        max_age: Duration,
        log: &mut Access,
    ) -> Option<Response<Body>> {
        if !matches!(parts.method, Method::GET | Method::HEAD) {
            return None;
        }
        let key = lane.cache_key.as_deref().unwrap_or(&crate::cache::WHOLE_URL);
        let stale = self.cache.stale(parts, key, reason, max_age, self.wall_now())?;
        match reason {
            StaleReason::Throttled => {
                lane.metrics.stale_throttled.inc();
                log.stale = Stale::Throttled;
            }
            StaleReason::UpstreamError { .. } => {
                lane.metrics.stale_upstream_error.inc();
                log.stale = Stale::UpstreamError;
            }
        }
        Some(stale)
    }

    /// stale-if-error on an upstream 5xx; otherwise keep a copy of a good GET answer.
    fn after_upstream(
        &self,
        route: &Route,
        lane: &Lane,
        head: &Parts,
        resp: Response<Body>,
        log: &mut Access,
    ) -> Response<Body> {
        let status = resp.status().as_u16();
        if matches!(status, 500 | 502 | 503 | 504) {
            if let Some(max_age) = route.stale_on_upstream_error {
                let reason = StaleReason::UpstreamError { status };
                if let Some(stale) = self.stale(lane, head, reason, max_age, log) {
                    return stale;
                }
            }
            return resp;
        }
        // A route with a `cache:` keeps its copies in its step.
        if head.method == Method::GET && lane.cache_key.is_none() {
            return self.cache.capture(head, lane.keyed_on_credentials, resp, self.wall_now());
        }
        resp
    }
}

/// Sends a step's background request through the request path, as from the client that
/// made it necessary (`Peer` without its TLS facts).
struct Refresher<'a> {
    proxy: &'a Arc<Proxy>,
    peer: SocketAddr,
}

impl step::Refresh for Refresher<'_> {
    fn refresh(&self, head: Parts, flight: crate::cache::Flight) {
        let proxy = Arc::clone(self.proxy);
        let peer = Peer::plain(self.peer);
        tokio::spawn(async move {
            let resp = proxy.handle_peer(Request::from_parts(head, Inbound::Empty), peer).await;
            // Read to the end: the copy is taken as the answer streams.
            let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
            drop(flight);
        });
    }
}

/// A route's header rule values for one request (see [`forward::rules::HeaderRules::render`]).
type RenderedValues = Option<forward::rules::Values>;

/// Sets the request id on an answer. Tollgate's own answers are clones of a map that holds
/// the field first (empty): its value is replaced in place, with no hashing and no probing.
/// Other answers get one insert (which also drops any repeated copies an upstream sent: the
/// fast path is taken only where no field repeats).
fn set_id(headers: &mut http::HeaderMap, name: &http::HeaderName, id: http::HeaderValue) {
    if headers.len() == headers.keys_len() {
        if let Some((first, value)) = headers.iter_mut().next() {
            if first == name {
                *value = id;
                return;
            }
        }
    }
    headers.insert(name, id);
}

const STRIP_PARAMS: &str = "the path has parameters inside the prefix the route strips";

const UNTUNNELLED_CONNECT: &str =
    "an extended CONNECT is tunnelled only for `websocket`, on a route whose `upgrades` lists it, to an HTTP/1.1 upstream";

/// An HTTP/2 extended CONNECT (RFC 8441): tunnelled where the route allows it, never forwarded
/// as if it were a request.
fn is_extended_connect<B>(req: &Request<B>) -> bool {
    req.extensions().get::<hyper::ext::Protocol>().is_some()
}

/// Bytes of `path` (as forwarded) that `route`'s `strip_prefix` removes, given `matched`, the
/// same path as routes see it. `None` when path parameters sit inside the stripped prefix,
/// where no byte count of the forwarded path corresponds to it.
#[inline]
fn strip_len(route: &Route, path: &str, matched: &str) -> Option<usize> {
    let kept = route::upstream_path(route, matched).len();
    let prefix = &matched[..matched.len() - kept];
    path.starts_with(prefix).then_some(prefix.len())
}

#[cfg(test)]
mod tests {
    use super::set_id;
    use http::header::{HeaderMap, HeaderName, HeaderValue};

    const ID: HeaderName = HeaderName::from_static("x-request-id");

    fn values(h: &HeaderMap) -> Vec<&str> {
        h.get_all(&ID).iter().map(|v| v.to_str().unwrap()).collect()
    }

    #[test]
    fn the_id_replaces_a_reserved_first_field_and_nothing_else() {
        // An answer of tollgate's own: the field first, empty.
        let mut own = HeaderMap::new();
        own.insert(ID, HeaderValue::from_static(""));
        own.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        set_id(&mut own, &ID, HeaderValue::from_static("abc"));
        assert_eq!(values(&own), ["abc"]);
        assert_eq!(own.len(), 2);

        // An upstream's answer with two copies of the field, the first one first: both go.
        let mut twice = HeaderMap::new();
        twice.append(ID, HeaderValue::from_static("up-1"));
        twice.append(ID, HeaderValue::from_static("up-2"));
        twice.insert(http::header::SERVER, HeaderValue::from_static("up"));
        set_id(&mut twice, &ID, HeaderValue::from_static("abc"));
        assert_eq!(values(&twice), ["abc"]);

        // An upstream's answer without it, or with it later: one value, the request's.
        let mut other = HeaderMap::new();
        other.insert(http::header::SERVER, HeaderValue::from_static("up"));
        set_id(&mut other, &ID, HeaderValue::from_static("abc"));
        assert_eq!(values(&other), ["abc"]);
        other.insert(ID, HeaderValue::from_static("up"));
        set_id(&mut other, &ID, HeaderValue::from_static("def"));
        assert_eq!(values(&other), ["def"]);
    }
}
