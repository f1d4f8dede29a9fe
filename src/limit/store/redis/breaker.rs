//! Circuit breaker in front of Redis: after `failures` consecutive failed calls it opens for
//! `cooldown`, then lets one probe call through; a good probe closes it. Lock-free (atomics);
//! state changes are logged once each, other failures at most once per second.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What the breaker says about the next call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// Closed: call Redis.
    Call,
    /// Half-open: this call is the one probe.
    Probe,
    /// Open: do not call Redis; it may be tried again in about this long.
    Open(Duration),
}

/// The breaker's state, for metrics and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

#[derive(Debug)]
pub struct Breaker {
    threshold: u32,
    cooldown: Duration,
    epoch: Instant,
    /// Consecutive failures while closed.
    failures: AtomicU32,
    /// Monotonic µs since `epoch` until which the breaker is open; 0 = closed.
    open_until: AtomicU64,
    probing: AtomicBool,
    /// Monotonic µs of the last failure log line.
    logged: AtomicU64,
}

impl Breaker {
    pub fn new(threshold: u32, cooldown: Duration) -> Breaker {
        Breaker {
            threshold: threshold.max(1),
            cooldown,
            epoch: Instant::now(),
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            logged: AtomicU64::new(0),
        }
    }

    fn mono(&self) -> u64 {
        // +1 so that 0 never means "now" (0 is "closed").
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX).saturating_add(1)
    }

    fn cooldown_us(&self) -> u64 {
        u64::try_from(self.cooldown.as_micros()).unwrap_or(u64::MAX).max(1)
    }

    pub fn pass(&self) -> Pass {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return Pass::Call;
        }
        let now = self.mono();
        if now < until {
            return Pass::Open(Duration::from_micros(until - now));
        }
        // One probe at a time; the others keep failing fast until it answers.
        if self.probing.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            Pass::Probe
        } else {
            Pass::Open(self.cooldown)
        }
    }

    pub fn state(&self) -> BreakerState {
        match self.open_until.load(Ordering::Acquire) {
            0 => BreakerState::Closed,
            until if self.mono() < until => BreakerState::Open,
            _ => BreakerState::HalfOpen,
        }
    }

    pub fn success(&self, pass: Pass) {
        self.failures.store(0, Ordering::Relaxed);
        if pass == Pass::Probe || self.open_until.load(Ordering::Acquire) != 0 {
            if self.open_until.swap(0, Ordering::AcqRel) != 0 {
                tracing::info!("redis store: recovered, breaker closed");
            }
            self.probing.store(false, Ordering::Release);
        }
    }

    /// Redis answered a fresh connection's handshake: if open, the next call is the probe,
    /// without waiting out the rest of the cooldown (a handshake alone does not close it: in a
    /// cluster it may come from a node other than the one the calls need).
    pub fn probe_now(&self) {
        let until = self.open_until.load(Ordering::Acquire);
        if until != 0 {
            let _ =
                self.open_until.compare_exchange(until, self.mono().min(until), Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Records a failure; `what` is only logged (rate-limited).
    pub fn failure(&self, pass: Pass, what: &dyn std::fmt::Display) {
        let now = self.mono();
        if pass == Pass::Probe {
            self.open_until.store(now.saturating_add(self.cooldown_us()), Ordering::Release);
            self.probing.store(false, Ordering::Release);
            self.log(now, what, "probe failed, breaker stays open");
            return;
        }
        let n = self.failures.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        if n >= self.threshold
            && self
                .open_until
                .compare_exchange(0, now.saturating_add(self.cooldown_us()), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            tracing::warn!(
                "redis store: {n} consecutive failures (last: {what}); breaker open for {:?}",
                self.cooldown
            );
            self.logged.store(now, Ordering::Relaxed);
            return;
        }
        self.log(now, what, "call failed");
    }

    /// At most one line per second, whoever wins the race writes it.
    fn log(&self, now: u64, what: &dyn std::fmt::Display, ctx: &str) {
        let last = self.logged.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= 1_000_000)
            && self.logged.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            match super::noise::take_held_back() {
                0 => tracing::warn!("redis store: {ctx}: {what}"),
                n => tracing::warn!("redis store: {ctx}: {what} ({n} lines of the redis client held back)"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_then_probes_once_and_closes_on_success() {
        let b = Breaker::new(3, Duration::from_millis(30));
        for _ in 0..2 {
            assert_eq!(b.pass(), Pass::Call);
            b.failure(Pass::Call, &"boom");
        }
        assert_eq!(b.state(), BreakerState::Closed);
        b.failure(Pass::Call, &"boom");
        assert!(matches!(b.pass(), Pass::Open(_)));
        assert_eq!(b.state(), BreakerState::Open);
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert_eq!(b.pass(), Pass::Probe);
        assert!(matches!(b.pass(), Pass::Open(_)), "only one probe at a time");
        b.failure(Pass::Probe, &"still down");
        assert_eq!(b.state(), BreakerState::Open);
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(b.pass(), Pass::Probe);
        b.success(Pass::Probe);
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.pass(), Pass::Call);
    }

    #[test]
    fn a_fresh_connection_makes_the_next_call_the_probe() {
        let b = Breaker::new(1, Duration::from_secs(3600));
        b.probe_now();
        assert_eq!(b.pass(), Pass::Call, "closed: nothing to probe");
        b.failure(Pass::Call, &"x");
        assert!(matches!(b.pass(), Pass::Open(_)));
        b.probe_now();
        assert_eq!(b.pass(), Pass::Probe, "no waiting out the hour");
        assert!(matches!(b.pass(), Pass::Open(_)), "still one probe at a time");
        b.failure(Pass::Probe, &"x");
        assert!(matches!(b.pass(), Pass::Open(_)));
    }

    #[test]
    fn a_success_resets_the_consecutive_count() {
        let b = Breaker::new(2, Duration::from_secs(10));
        b.failure(Pass::Call, &"x");
        b.success(Pass::Call);
        b.failure(Pass::Call, &"x");
        assert_eq!(b.state(), BreakerState::Closed);
    }
}
