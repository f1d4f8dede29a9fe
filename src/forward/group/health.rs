//! Which servers of a group may take requests: passive ejection after consecutive failures
//! (growing on repeat, never more than `max_ejected_percent` of the group), active health
//! checks, and what the group reports of them (`/config`, `/readyz`, gauges).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::{Request, Uri, Version};

use super::balance::decayed;
use super::{millis, Group, Member, ServerView, Set, Tried};
use crate::answer::{Error, UpstreamFailure};
use crate::body::RequestBody;
use crate::config::group::Health;

impl Group {
    /// A try on server `i` ended: `failed` for a connect failure, a broken exchange, a
    /// timeout or a 5xx; `took` the time to its head, when one came.
    pub(super) fn observe(&self, set: &Set, i: usize, failed: bool, took: Option<Duration>) {
        let m = &set.members[i];
        let now = self.now_ms();
        if let Some(t) = took {
            m.metrics.latency.observe(t);
            let us = t.as_secs_f64() * 1e6;
            m.ewma_us.store(decayed(m, now, us).to_bits(), Ordering::Relaxed);
            m.ewma_at.store(now, Ordering::Relaxed);
        }
        if !failed {
            m.consecutive_failures.store(0, Ordering::Relaxed);
            return;
        }
        m.metrics.failures.inc();
        let outlier = &self.cfg.outlier;
        let run = m.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if outlier.consecutive_failures == 0 || run < outlier.consecutive_failures {
            return;
        }
        let _deciding = self.ejecting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Passive ejection takes out at most `max_ejected_percent` of the group.
        let ejected = set.members.iter().filter(|o| o.ejected_until.load(Ordering::Relaxed) > now).count();
        let allowed = set.members.len() * outlier.max_ejected_percent as usize / 100;
        if ejected >= allowed || m.ejected_until.load(Ordering::Relaxed) > now {
            return;
        }
        // Repeat ejections grow; one that stayed in for `max_ejection_time` starts over.
        let last_end = m.ejected_until.load(Ordering::Relaxed);
        let max_ms = millis(outlier.max_ejection_time);
        let n = if last_end != 0 && now.saturating_sub(last_end) > max_ms {
            m.ejections.store(1, Ordering::Relaxed);
            1
        } else {
            m.ejections.fetch_add(1, Ordering::Relaxed) + 1
        };
        let length = millis(outlier.base_ejection_time).saturating_mul(u64::from(n)).min(max_ms);
        m.ejected_until.store(now.saturating_add(length), Ordering::Relaxed);
        m.consecutive_failures.store(0, Ordering::Relaxed);
        m.metrics.ejections.inc();
        tracing::warn!(
            upstream = %self.name,
            server = %m.name,
            failures = run,
            ejected_ms = length,
            "upstream server ejected after consecutive failures"
        );
    }

    /// The answer when no server may take a request: 503 with a Retry-After no shorter
    /// than the earliest re-admission (passive) or the checks that could restore one; a
    /// group without servers (its names have not resolved yet) says so.
    pub(super) fn unavailable(&self, set: &Set, now: u64) -> Error {
        if set.members.is_empty() {
            return Error::Upstream(UpstreamFailure::Unavailable { retry_after_secs: 1, unresolved: true });
        }
        let health =
            self.cfg.health.as_ref().map_or(u64::MAX, |h| millis(h.interval).saturating_mul(u64::from(h.healthy)));
        let wait_ms = set
            .members
            .iter()
            .map(|m| {
                let until = m.ejected_until.load(Ordering::Relaxed);
                let passive = until.saturating_sub(now);
                if m.up.load(Ordering::Relaxed) {
                    passive
                } else {
                    passive.max(health)
                }
            })
            .min()
            .unwrap_or(1000);
        let secs = wait_ms.div_ceil(1000).clamp(1, 86_400);
        Error::Upstream(UpstreamFailure::Unavailable { retry_after_secs: secs as u32, unresolved: false })
    }

    /// Whether some server may take requests now (`/readyz`).
    pub fn available(&self) -> bool {
        let now = self.now_ms();
        let set = self.set.load();
        (0..set.members.len()).any(|i| Group::eligible(&set, i, &Tried::default(), now))
    }

    /// Each server with its state now.
    pub fn servers(&self) -> Vec<ServerView> {
        let now = self.now_ms();
        self.set
            .load()
            .members
            .iter()
            .map(|m| {
                let until = m.ejected_until.load(Ordering::Relaxed);
                let (state, ejected_for_s) = if !m.up.load(Ordering::Relaxed) {
                    ("unhealthy", None)
                } else if until > now {
                    ("ejected", Some((until - now).div_ceil(1000)))
                } else {
                    ("healthy", None)
                };
                ServerView {
                    url: format!("{}://{}", self.scheme, m.name),
                    resolved_from: m.from.as_deref().map(str::to_owned),
                    weight: m.weight,
                    state,
                    ejected_for_s,
                    in_flight: m.metrics.in_flight.get(),
                    ejections: m.metrics.ejections.get(),
                }
            })
            .collect()
    }

    /// Health and ejection gauges (at scrape).
    pub fn refresh_gauges(&self) {
        let now = self.now_ms();
        for m in &self.set.load().members {
            m.metrics.healthy.set(i64::from(m.up.load(Ordering::Relaxed)));
            m.metrics.ejected.set(i64::from(m.ejected_until.load(Ordering::Relaxed) > now));
        }
    }

    /// The checker task of `member`; it ends once the member left the group (DNS no longer
    /// gives it) or the group is gone (a reload replaced it).
    pub(super) fn start_check(self: &Arc<Self>, member: &Arc<Member>, h: &Health) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let group: Weak<Group> = Arc::downgrade(self);
        let member: Weak<Member> = Arc::downgrade(member);
        let h = h.clone();
        rt.spawn(async move {
            let mut tick = tokio::time::interval(h.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let (mut passes, mut fails) = (0u32, 0u32);
            loop {
                tick.tick().await;
                let (Some(group), Some(m)) = (group.upgrade(), member.upgrade()) else { return };
                let passed = Group::check(&m, &h).await;
                if passed {
                    passes = passes.saturating_add(1);
                    fails = 0;
                    if passes >= h.healthy {
                        if !m.up.swap(true, Ordering::Relaxed) {
                            tracing::info!(upstream = %group.name, server = %m.name, "upstream server passes its health checks again");
                        }
                        // Passing checks end a passive ejection early.
                        if m.ejected_until.load(Ordering::Relaxed) > group.now_ms() {
                            m.ejected_until.store(group.now_ms(), Ordering::Relaxed);
                            m.consecutive_failures.store(0, Ordering::Relaxed);
                        }
                    }
                } else {
                    fails = fails.saturating_add(1);
                    passes = 0;
                    if fails >= h.unhealthy && m.up.swap(false, Ordering::Relaxed) {
                        tracing::warn!(upstream = %group.name, server = %m.name, "upstream server fails its health checks");
                    }
                }
            }
        });
    }

    /// One health check of `member`: `GET path` on a connection of its own (a stream for
    /// h2c), passing when the status is in `expect` within `timeout`.
    async fn check(member: &Member, h: &Health) -> bool {
        let fwd = &member.fwd;
        let run = async {
            let mut req = Request::new(RequestBody::empty());
            req.headers_mut().insert(header::HOST, fwd.authority_value.clone());
            req.headers_mut().insert(header::USER_AGENT, HeaderValue::from_static("tollgate-health-check"));
            if let Some(h2) = &fwd.h2 {
                *req.uri_mut() = Uri::builder()
                    .scheme("http")
                    .authority(fwd.authority.clone())
                    .path_and_query(h.path.as_str())
                    .build()
                    .ok()?;
                *req.version_mut() = Version::HTTP_2;
                req.headers_mut().remove(header::HOST);
                let (send, _stream) = h2.checkout().await.ok()?;
                let (resp, _) = crate::forward::h2::exchange(send, req, false).await.ok()?;
                Some(resp.status().as_u16())
            } else {
                *req.uri_mut() = h.path.parse().ok()?;
                let mut send = fwd.pool.connector().http1().await.ok()?;
                send.send_request(req).await.ok().map(|r| r.status().as_u16())
            }
        };
        match tokio::time::timeout(h.timeout, run).await {
            Ok(Some(status)) => (h.expect.0..=h.expect.1).contains(&status),
            _ => false,
        }
    }
}
