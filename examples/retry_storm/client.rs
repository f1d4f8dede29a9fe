//! The clients: an open-loop population whose every intended request goes through two naive
//! layers of retries (an app retrying an SDK call that retries itself), with no jitter and no
//! backoff. A `429` or `503` with `Retry-After` is honoured by the SDK layer (it sleeps the
//! wait before its own next try); the app layer retries at once. Every try is an attempt,
//! whatever its answer. No try starts after the intended request's deadline, and no try
//! waits past it: a success is always in time.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// The answer to one try, as the client sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx in time.
    Ok,
    /// A `429` or `503` carrying `Retry-After`, in seconds.
    Throttled(Duration),
    /// Another status, or no connection.
    Failed,
    /// No answer within the try's timeout.
    TimedOut,
}

/// How one intended request is retried.
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    /// Tries of the outer (app) layer, each one a whole SDK call.
    pub app_tries: u32,
    /// Tries of the inner (SDK) layer per app try.
    pub sdk_tries: u32,
    /// Each try's timeout.
    pub timeout: Duration,
    /// The intended request's own deadline, from its scheduled time.
    pub deadline: Duration,
    /// Whether the SDK sleeps a `Retry-After` before its next try.
    pub honour_retry_after: bool,
}

/// What became of one intended request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub attempts: u32,
    pub ok: bool,
    pub throttled: u32,
    pub failed: u32,
    pub timed_out: u32,
}

/// The time the model reads and sleeps on: tokio's in a run, a manual one in the tests.
pub trait Clock {
    fn now(&self) -> Instant;
    fn sleep_until(&self, t: Instant) -> impl Future<Output = ()>;
}

/// tokio's clock.
pub struct Tokio;

impl Clock for Tokio {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep_until(&self, t: Instant) -> impl Future<Output = ()> {
        tokio::time::sleep_until(t)
    }
}

/// Runs one intended request due at `due`: `attempt(timeout)` makes one try with that timeout.
pub async fn intended<C, F, Fut>(clock: &C, policy: &Policy, due: Instant, mut attempt: F) -> Tally
where
    C: Clock,
    F: FnMut(Duration) -> Fut,
    Fut: Future<Output = Outcome>,
{
    let end = due + policy.deadline;
    let mut tally = Tally::default();
    for _app in 0..policy.app_tries {
        for sdk in 0..policy.sdk_tries {
            let left = end.saturating_duration_since(clock.now());
            if left.is_zero() {
                return tally;
            }
            tally.attempts += 1;
            match attempt(policy.timeout.min(left)).await {
                Outcome::Ok => {
                    tally.ok = true;
                    return tally;
                }
                Outcome::Throttled(wait) => {
                    tally.throttled += 1;
                    if policy.honour_retry_after && sdk + 1 < policy.sdk_tries {
                        clock.sleep_until(end.min(clock.now() + wait)).await;
                    }
                }
                Outcome::Failed => tally.failed += 1,
                Outcome::TimedOut => tally.timed_out += 1,
            }
        }
    }
    tally
}

/// The intended load: `base` requests a second, `spike` from `spike_at` for `spike_for`.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct Profile {
    pub base: f64,
    pub spike: f64,
    pub spike_at_s: f64,
    pub spike_for_s: f64,
    pub duration_s: f64,
}

impl Profile {
    pub fn rate_at(&self, t: f64) -> f64 {
        if t >= self.spike_at_s && t < self.spike_at_s + self.spike_for_s {
            self.spike
        } else {
            self.base
        }
    }

    /// The scheduled send times, in seconds from the start: open loop, evenly spaced at each
    /// moment's rate.
    pub fn schedule(&self) -> Vec<f64> {
        let mut out = Vec::new();
        let mut t = 0.0;
        while t < self.duration_s {
            out.push(t);
            let r = self.rate_at(t);
            if r <= 0.0 {
                break;
            }
            t += 1.0 / r;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};

    fn policy() -> Policy {
        Policy {
            app_tries: 3,
            sdk_tries: 3,
            timeout: Duration::from_secs(1),
            deadline: Duration::from_secs(30),
            honour_retry_after: true,
        }
    }

    /// A clock that only moves when told: sleeping moves it to the sleep's end at once.
    struct Manual(Cell<Instant>);

    impl Clock for Manual {
        fn now(&self) -> Instant {
            self.0.get()
        }

        fn sleep_until(&self, t: Instant) -> impl Future<Output = ()> {
            self.0.set(self.0.get().max(t));
            std::future::ready(())
        }
    }

    /// Plays `answers` in turn (the last one forever), each taking `took` of the manual clock
    /// (a timeout: the try's whole timeout); returns the tally and when each try was sent.
    async fn play(p: &Policy, answers: &[Outcome], took: Duration) -> (Tally, Vec<Duration>) {
        let start = Instant::now();
        let clock = Manual(Cell::new(start));
        let sent = RefCell::new(Vec::new());
        let tally = intended(&clock, p, start, |timeout| {
            let n = sent.borrow().len();
            sent.borrow_mut().push(clock.now() - start);
            let answer = answers[n.min(answers.len() - 1)];
            clock.0.set(clock.now() + if answer == Outcome::TimedOut { timeout } else { took });
            std::future::ready(answer)
        })
        .await;
        (tally, sent.into_inner())
    }

    #[tokio::test]
    async fn two_layers_of_three_tries_make_nine_attempts_when_every_try_times_out() {
        let (t, sent) = play(&policy(), &[Outcome::TimedOut], Duration::ZERO).await;
        assert_eq!(t, Tally { attempts: 9, ok: false, throttled: 0, failed: 0, timed_out: 9 });
        // No jitter, no backoff: each try goes at the previous one's timeout.
        let gaps: Vec<Duration> = sent.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|g| *g == Duration::from_secs(1)), "{gaps:?}");
    }

    #[tokio::test]
    async fn a_success_stops_the_retries_at_once() {
        let answers = [Outcome::TimedOut, Outcome::Failed, Outcome::Ok];
        let (t, _) = play(&policy(), &answers, Duration::from_millis(5)).await;
        assert_eq!(t, Tally { attempts: 3, ok: true, throttled: 0, failed: 1, timed_out: 1 });
    }

    #[tokio::test]
    async fn the_sdk_sleeps_retry_after_and_the_app_layer_does_not() {
        let wait = Duration::from_secs(2);
        let (t, sent) = play(&policy(), &[Outcome::Throttled(wait)], Duration::ZERO).await;
        assert_eq!((t.attempts, t.throttled, t.ok), (9, 9, false));
        let gaps: Vec<u64> = sent.windows(2).map(|w| (w[1] - w[0]).as_secs()).collect();
        // Within an SDK call the wait is slept; between app tries it is not.
        assert_eq!(gaps, [2, 2, 0, 2, 2, 0, 2, 2]);
        let (naive, sent) =
            play(&Policy { honour_retry_after: false, ..policy() }, &[Outcome::Throttled(wait)], Duration::ZERO).await;
        assert_eq!(naive.attempts, 9);
        assert!(sent.iter().all(|s| s.is_zero()), "{sent:?}");
    }

    #[tokio::test]
    async fn no_try_starts_or_waits_past_the_deadline() {
        let p = Policy { deadline: Duration::from_millis(2500), ..policy() };
        let (t, sent) = play(&p, &[Outcome::TimedOut], Duration::ZERO).await;
        // Tries at 0 s, 1 s and 2 s; the third is cut to the 0.5 s left.
        assert_eq!((t.attempts, t.timed_out), (3, 3));
        assert_eq!(sent.last().copied(), Some(Duration::from_secs(2)));
    }

    #[test]
    fn the_schedule_follows_the_profile() {
        let p = Profile { base: 100.0, spike: 300.0, spike_at_s: 1.0, spike_for_s: 1.0, duration_s: 3.0 };
        let s = p.schedule();
        let in_second = |k: f64| s.iter().filter(|t| **t >= k && **t < k + 1.0).count();
        // Float steps may put one due time on either side of a second's edge.
        assert!((99..=101).contains(&in_second(0.0)), "{}", in_second(0.0));
        assert!((299..=301).contains(&in_second(1.0)), "{}", in_second(1.0));
        assert!((99..=101).contains(&in_second(2.0)), "{}", in_second(2.0));
    }
}
