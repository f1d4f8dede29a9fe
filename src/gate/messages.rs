//! A route's message limits (`message_limits:`): limits decided per message of a stream (a
//! gRPC call, a WebSocket tunnel) instead of per request. Each is a [`Limit`] with its own
//! store, decided as a request limit is (every limit of the message's direction must admit;
//! a denial refunds what the others admitted); the keys are read once, from the request that
//! opened the stream. A [`Meter`] is one stream's view: the body room's [`Watch`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use super::Limit;
use crate::body::watch::{Deciding, Refusal, Verdict, Watch};
use crate::config::messages::{Action, MessageLimit, MessageLimits};
use crate::config::{LimitConfig, Mode, Route};
use crate::limit::{Clock, Decision, KeyHash, Span, Store};
use crate::metrics::{Metrics, StreamMessageMetrics};
use crate::request_key::KeyCtx;

/// A route's message limits, compiled.
pub struct Messages {
    route: Box<str>,
    limits: Vec<(Limit, MessageLimit)>,
    max_message_size: u64,
    clock: Arc<dyn Clock>,
    grpc: StreamMessageMetrics,
    websocket: StreamMessageMetrics,
    /// Each stream's end gets an access log line.
    log: bool,
}

/// The protocol of a metered stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    WebSocket,
}

impl Protocol {
    fn as_str(self) -> &'static str {
        match self {
            Protocol::Grpc => "grpc",
            Protocol::WebSocket => "websocket",
        }
    }
}

impl Messages {
    /// `store_for` gives each limit its store (as the gate's limits get theirs).
    pub fn new(
        route: &Route,
        config: &MessageLimits,
        metrics: &Metrics,
        clock: Arc<dyn Clock>,
        log: bool,
        store_for: &mut dyn FnMut(&LimitConfig) -> Arc<Store>,
    ) -> Messages {
        let limits = config
            .limits
            .iter()
            .map(|m| {
                let store = store_for(&m.limit);
                (Limit::new(m.limit.clone(), store, metrics.limit(&route.name, &m.limit.name)), m.clone())
            })
            .collect();
        Messages {
            route: route.name.as_str().into(),
            limits,
            max_message_size: config.max_message_size,
            clock,
            grpc: metrics.stream_messages(&route.name, Protocol::Grpc.as_str()),
            websocket: metrics.stream_messages(&route.name, Protocol::WebSocket.as_str()),
            log,
        }
    }

    /// The limits, with how each counts (for the admin listener and reloads).
    pub fn limits(&self) -> impl Iterator<Item = &Limit> {
        self.limits.iter().map(|(l, _)| l)
    }

    /// Whether any limit counts messages going towards the upstream (`up`) or the client.
    pub fn counts(&self, up: bool) -> bool {
        self.limits.iter().any(|(_, m)| m.direction.counts(up))
    }

    /// The meter of one stream opened by the request `ctx` reads.
    pub fn meter(self: &Arc<Self>, ctx: &KeyCtx<'_>, protocol: Protocol, request_id: Option<&str>) -> Meter {
        let keys = self.limits.iter().map(|(l, _)| ctx.key(&l.config.key)).collect();
        Meter(Arc::new(Metered {
            messages: self.clone(),
            keys,
            protocol,
            request_id: request_id.map(Box::from),
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
            delayed: AtomicU64::new(0),
        }))
    }

    fn too_large(&self, len: u64) -> Refusal {
        Refusal {
            reason: format!(
                "route `{}`: a message of {len} bytes is over max_message_size ({} bytes)",
                self.route, self.max_message_size
            ),
            retry_after: Duration::ZERO,
            too_large: true,
        }
    }

    fn metrics(&self, protocol: Protocol) -> &StreamMessageMetrics {
        match protocol {
            Protocol::Grpc => &self.grpc,
            Protocol::WebSocket => &self.websocket,
        }
    }
}

/// One stream's checks: its keys, and what it sent.
#[derive(Clone)]
pub struct Meter(Arc<Metered>);

struct Metered {
    messages: Arc<Messages>,
    keys: SmallVec<[KeyHash; 2]>,
    protocol: Protocol,
    request_id: Option<Box<str>>,
    /// Messages passed towards the upstream, and towards the client.
    up: AtomicU64,
    down: AtomicU64,
    /// Messages held back.
    delayed: AtomicU64,
}

impl Watch for Meter {
    fn counts(&self, up: bool) -> bool {
        self.0.messages.counts(up)
    }

    fn max_message_size(&self) -> u64 {
        self.0.messages.max_message_size
    }

    fn message(&self, up: bool, len: u64, waited: Duration) -> Deciding {
        let m = self.0.clone();
        Box::pin(async move { m.decide(up, len, waited).await })
    }

    fn too_large(&self, len: u64) -> Refusal {
        let messages = &*self.0.messages;
        messages.metrics(self.0.protocol).too_large.inc();
        messages.too_large(len)
    }

    fn ended(&self, why: &str) {
        let m = &self.0;
        if !m.messages.log {
            return;
        }
        tracing::info!(
            target: "tollgate::access",
            route = &*m.messages.route,
            stream = m.protocol.as_str(),
            messages_up = m.up.load(Ordering::Relaxed),
            messages_down = m.down.load(Ordering::Relaxed),
            messages_delayed = m.delayed.load(Ordering::Relaxed),
            end = why,
            request_id = m.request_id.as_deref(),
        );
    }
}

impl Metered {
    async fn decide(&self, up: bool, len: u64, waited: Duration) -> Verdict {
        let messages = &*self.messages;
        let metrics = messages.metrics(self.protocol);
        if len > messages.max_message_size {
            metrics.too_large.inc();
            return Verdict::Refuse(messages.too_large(len));
        }
        let now = messages.clock.now();
        let mut admitted: SmallVec<[(usize, u64); 4]> = SmallVec::new();
        let mut wait = Span::ZERO;
        let mut denied: Option<(usize, Span)> = None;
        for (i, (limit, m)) in messages.limits.iter().enumerate() {
            if !m.direction.counts(up) {
                continue;
            }
            let key = self.keys[i];
            let cost = m.cost(len);
            let decision = match limit.decide_cost(key, now, cost).await {
                Ok(d) => d,
                Err(e) => {
                    // `on_error: deny`: the store cannot decide, and the stream fails closed.
                    tracing::debug!(route = &*messages.route, limit = %limit.config.name, error = %e, "message limit store unavailable");
                    self.refund(&admitted, now).await;
                    metrics.refused.inc();
                    return Verdict::Refuse(Refusal {
                        reason: format!(
                            "route `{}`: message limit `{}` cannot be checked right now",
                            messages.route, limit.config.name
                        ),
                        retry_after: Duration::from_secs(1),
                        too_large: false,
                    });
                }
            };
            let enforced = limit.config.mode == Mode::Enforce;
            match decision {
                Decision::Allow { .. } => {
                    limit.metrics.allowed.inc();
                    admitted.push((i, cost));
                }
                Decision::Delay { wait: w, .. } => {
                    limit.metrics.delayed.inc();
                    admitted.push((i, cost));
                    wait = wait.max(w);
                }
                Decision::Deny { .. } | Decision::Never { .. } if !enforced => {
                    limit.metrics.shadow_throttled.inc();
                }
                Decision::Deny { retry_after, .. } => {
                    limit.metrics.throttled.inc();
                    denied = Some((i, retry_after));
                    break;
                }
                Decision::Never { reset } => {
                    limit.metrics.throttled.inc();
                    denied = Some((i, reset));
                    break;
                }
            }
        }
        if let Some((i, retry_after)) = denied {
            self.refund(&admitted, now).await;
            let (limit, m) = &messages.limits[i];
            let after = Duration::from_micros(retry_after.as_micros().max(1));
            if m.action == Action::Delay && waited + after <= m.max_delay {
                self.delayed.fetch_add(1, Ordering::Relaxed);
                metrics.delayed.inc();
                return Verdict::Again { after };
            }
            metrics.refused.inc();
            return Verdict::Refuse(Refusal {
                reason: format!(
                    "route `{}`: message limit `{}` ({} per key) admits no more messages now",
                    messages.route, limit.config.name, limit.config.rate
                ),
                retry_after: after,
                too_large: false,
            });
        }
        if up {
            self.up.fetch_add(1, Ordering::Relaxed);
        } else {
            self.down.fetch_add(1, Ordering::Relaxed);
        }
        let after = Duration::from_micros(wait.as_micros());
        if after.is_zero() {
            metrics.passed.inc();
        } else {
            self.delayed.fetch_add(1, Ordering::Relaxed);
            metrics.delayed.inc();
        }
        Verdict::Pass { after }
    }

    /// Gives back what the limits in `admitted` charged for a message that is not sent now.
    async fn refund(&self, admitted: &[(usize, u64)], now: crate::limit::Timestamp) {
        for &(i, cost) in admitted {
            let (limit, _) = &self.messages.limits[i];
            limit.refund(None, self.keys[i], now, cost).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{ManualClock, Timestamp};

    fn messages(yaml: &str, clock: Arc<ManualClock>) -> Arc<Messages> {
        let yaml = format!(
            "listen: 127.0.0.1:1\nupstreams:\n  up: {{ respond: {{ status: 200 }} }}\nroutes:\n  - name: r\n    upstream: up\n    message_limits:\n{yaml}"
        );
        let config = crate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap();
        let route = &config.routes[0];
        let m = route.message_limits.as_ref().unwrap();
        Arc::new(Messages::new(route, m, &Metrics::new(), clock, false, &mut |l| Limit::local_store(l)))
    }

    fn meter(m: &Arc<Messages>) -> Meter {
        let parts = http::Request::new(()).into_parts().0;
        m.meter(&KeyCtx::test(&parts), Protocol::WebSocket, None)
    }

    #[tokio::test]
    async fn over_the_limit_a_stream_is_refused_naming_the_limit_and_its_wait() {
        let clock = Arc::new(ManualClock::new(Timestamp::from_micros(1_000_000_000)));
        let m = messages("      limits: [ { name: chat, algorithm: fixed_window, rate: 2/s } ]\n", clock.clone());
        let s = meter(&m);
        for _ in 0..2 {
            assert_eq!(s.message(true, 10, Duration::ZERO).await, Verdict::Pass { after: Duration::ZERO });
        }
        // Messages towards the client are not counted by a `client` limit.
        assert_eq!(s.message(false, 10, Duration::ZERO).await, Verdict::Pass { after: Duration::ZERO });
        let Verdict::Refuse(r) = s.message(true, 10, Duration::ZERO).await else { panic!("admitted") };
        assert!(r.reason.contains("`chat`"), "{}", r.reason);
        assert_eq!(r.retry_after, Duration::from_secs(1));
        clock.advance(Span::from_secs(1));
        assert_eq!(s.message(true, 10, Duration::ZERO).await, Verdict::Pass { after: Duration::ZERO });
    }

    #[tokio::test]
    async fn with_action_delay_a_message_waits_within_max_delay_then_is_refused() {
        let clock = Arc::new(ManualClock::new(Timestamp::from_micros(1_000_000_000)));
        let m = messages(
            "      limits: [ { name: t, algorithm: token_bucket, rate: 10/s, burst: 1, action: delay, max_delay: 250ms } ]\n",
            clock.clone(),
        );
        let s = meter(&m);
        assert_eq!(s.message(true, 1, Duration::ZERO).await, Verdict::Pass { after: Duration::ZERO });
        // The next token comes in 100 ms: wait, then ask again.
        assert_eq!(s.message(true, 1, Duration::ZERO).await, Verdict::Again { after: Duration::from_millis(100) });
        // Held 200 ms already: 100 ms more is past 250 ms.
        assert!(matches!(s.message(true, 1, Duration::from_millis(200)).await, Verdict::Refuse(_)));
        clock.advance(Span::from_micros(100_000));
        assert_eq!(s.message(true, 1, Duration::from_millis(100)).await, Verdict::Pass { after: Duration::ZERO });
    }

    #[tokio::test]
    async fn a_denial_gives_back_what_the_other_limits_charged() {
        let clock = Arc::new(ManualClock::new(Timestamp::from_micros(1_000_000_000)));
        let m = messages(
            "      limits:\n        - { name: wide, algorithm: fixed_window, rate: 3/s }\n        - { name: narrow, algorithm: fixed_window, rate: 1/s }\n",
            clock,
        );
        let s = meter(&m);
        assert!(matches!(s.message(true, 1, Duration::ZERO).await, Verdict::Pass { .. }));
        for _ in 0..5 {
            assert!(matches!(s.message(true, 1, Duration::ZERO).await, Verdict::Refuse(_)));
        }
        let wide = m.limits().next().unwrap();
        assert_eq!(wide.metrics.allowed.get(), 6);
        let parts = http::Request::new(()).into_parts().0;
        let key = KeyCtx::test(&parts).key(&wide.config.key);
        let Ok(Decision::Allow { remaining, .. }) = wide.peek(key, Timestamp::from_micros(1_000_000_000)).await else {
            panic!("denied")
        };
        // One more would leave one: only the first message stays charged.
        assert_eq!(remaining, 1);
    }

    #[tokio::test]
    async fn a_message_over_the_cap_is_refused_as_too_large() {
        let clock = Arc::new(ManualClock::new(Timestamp::from_micros(1_000_000_000)));
        let m = messages(
            "      max_message_size: 1KiB\n      limits: [ { name: l, algorithm: fixed_window, rate: 100/s } ]\n",
            clock,
        );
        let s = meter(&m);
        assert!(matches!(s.message(true, 1024, Duration::ZERO).await, Verdict::Pass { .. }));
        let Verdict::Refuse(r) = s.message(true, 1025, Duration::ZERO).await else { panic!("admitted") };
        assert!(r.too_large && r.reason.contains("max_message_size"), "{r:?}");
    }
}
