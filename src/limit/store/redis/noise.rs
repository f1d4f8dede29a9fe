//! A cap on the redis crate's own log lines: while a node is down its cluster client warns on
//! every connection attempt (dozens of lines a second per instance). [`ClientLogCap`] lets one
//! of its lines through per second and counts the rest; the store's own failure line (itself at
//! most one a second, see the breaker) says how many were held back since.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use tracing::{Event, Subscriber};
use tracing_log::NormalizeEvent;
use tracing_subscriber::layer::{Context, Layer};

/// Lines of the redis crate held back since the store last said so (process-wide, as the
/// subscriber is).
static HELD_BACK: AtomicU64 = AtomicU64::new(0);

/// Takes the count of held-back lines (for the store's next failure line).
pub(crate) fn take_held_back() -> u64 {
    HELD_BACK.swap(0, Ordering::Relaxed)
}

/// One line per `period_ms`; lock-free.
#[derive(Debug)]
struct Cap {
    period_ms: u64,
    /// ms + 1 of the last line let through; 0 = none yet.
    last: AtomicU64,
}

impl Cap {
    /// Whether a line at `now_ms` goes out.
    fn admit(&self, now_ms: u64) -> bool {
        let last = self.last.load(Ordering::Relaxed);
        let now = now_ms.saturating_add(1);
        (last == 0 || now.saturating_sub(last) >= self.period_ms)
            && self.last.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }
}

/// A subscriber layer that passes at most one event a second from the redis crate (targets
/// `redis` and `redis::…`, its `log` records included) and every other event untouched.
#[derive(Debug)]
pub struct ClientLogCap {
    cap: Cap,
    held: &'static AtomicU64,
}

impl Default for ClientLogCap {
    fn default() -> ClientLogCap {
        ClientLogCap { cap: Cap { period_ms: 1_000, last: AtomicU64::new(0) }, held: &HELD_BACK }
    }
}

fn from_redis_crate(target: &str) -> bool {
    target.strip_prefix("redis").is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
}

fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    u64::try_from(EPOCH.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl<S: Subscriber> Layer<S> for ClientLogCap {
    fn event_enabled(&self, event: &Event<'_>, _cx: Context<'_, S>) -> bool {
        // The crate logs through `log`: such an event's own metadata says target `log`.
        let target = match event.normalized_metadata() {
            Some(m) => from_redis_crate(m.target()),
            None => from_redis_crate(event.metadata().target()),
        };
        if !target || self.cap.admit(now_ms()) {
            return true;
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        false
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    #[test]
    fn one_line_per_period_on_a_manual_clock() {
        let cap = Cap { period_ms: 1_000, last: AtomicU64::new(0) };
        let passed: Vec<u64> =
            [0, 1, 500, 999, 1_000, 1_001, 1_999, 2_500, 2_600, 10_000].into_iter().filter(|&t| cap.admit(t)).collect();
        assert_eq!(passed, [0, 1_000, 2_500, 10_000]);
    }

    #[test]
    fn only_the_redis_crate_is_capped() {
        for t in ["redis", "redis::cluster_handling::async_connection", "redis::aio"] {
            assert!(from_redis_crate(t), "{t}");
        }
        for t in ["tollgate::limit::store::redis", "redis_other", "tollgate", "rediscover"] {
            assert!(!from_redis_crate(t), "{t}");
        }
    }

    /// Counts the events that reach it.
    struct Count(Arc<AtomicU64>);

    impl<S: Subscriber> Layer<S> for Count {
        fn on_event(&self, _event: &Event<'_>, _cx: Context<'_, S>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_burst_from_the_redis_crate_is_one_line_and_a_count() {
        let seen = Arc::new(AtomicU64::new(0));
        // A count of its own: the store's failure lines take the process-wide one.
        let held: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
        let cap = ClientLogCap { held, ..ClientLogCap::default() };
        let subscriber = tracing_subscriber::registry().with(cap).with(Count(seen.clone()));
        // The crate's lines come through `log`, as in the binary (its subscriber installs this).
        let _ = tracing_log::LogTracer::init();
        tracing::subscriber::with_default(subscriber, || {
            for i in 0..100 {
                log::warn!(target: "redis::cluster_handling::async_connection", "Failed to connect to node {i}");
                tracing::warn!(target: "redis::aio", "a tracing event of the crate {i}");
                tracing::warn!(target: "tollgate::limit", "own line {i}");
                log::warn!(target: "other_crate", "another crate's line {i}");
            }
        });
        let seen = seen.load(Ordering::Relaxed);
        // 200 lines of others, and the redis crate's first (a second more only if the burst
        // took longer than one on a stalled machine).
        assert!((201..=202).contains(&seen), "{seen}");
        assert_eq!(seen - 200 + held.load(Ordering::Relaxed), 200, "every redis line passed or was counted");
    }
}
