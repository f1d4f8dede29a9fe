//! What an admission carries to the answer (the "ticket"): the access log's note, the slot,
//! the RateLimit state, and the costs the response settles.

use super::*;

/// What the gate decided, for the access log: the limit that bound the request (the one
/// with the fewest remaining, or the first that rejected), what it said, and any delay.
#[derive(Debug, Default, Clone, Copy)]
pub struct Note {
    pub limit: Option<usize>,
    pub remaining: Option<u64>,
    pub retry_after_secs: Option<u64>,
    pub delayed_us: u64,
}

/// An admitted request: wait [`Admission::wait`] first (leaky-bucket shaping), hold `permit`
/// until the response body ends, and put `ratelimit` on the answer. Kept at 128 bytes: it is
/// moved with the request's future, and a larger value is moved by `memcpy` calls.
#[derive(Default)]
pub struct Admission {
    pub permit: Option<Slot>,
    pub note: Note,
    pub(super) ratelimit: Option<HeaderValue>,
    /// Only on routes with plan limits or costs from the response.
    pub(super) product: Option<Box<Product>>,
}

/// What an admission of an API product route remembers.
#[derive(Default)]
pub(super) struct Product {
    /// Limits whose cost the response settles, with the key they charged.
    pub(super) owed: SmallVec<[(usize, KeyHash); 2]>,
    /// The client's plan tier, on routes with plan limits.
    pub(super) tier: Option<TierId>,
}

impl Admission {
    /// How long to wait before forwarding (leaky-bucket shaping).
    pub fn wait(&self) -> Duration {
        Duration::from_micros(self.note.delayed_us)
    }

    pub(super) fn tier(&self) -> Option<TierId> {
        self.product.as_ref().and_then(|p| p.tier)
    }
}

/// Decision of one limit for this request.
pub(super) struct Decided {
    pub(super) limit: usize,
    pub(super) key: KeyHash,
    pub(super) decision: Decision,
}

impl Gate {
    /// True when `admission` waits for its response's cost ([`Gate::settle`]).
    pub fn owes(admission: &Admission) -> bool {
        admission.product.as_ref().is_some_and(|p| !p.owed.is_empty())
    }

    /// Settles the costs taken from the response head `headers` at `now`: each limit with
    /// `cost.response_header` debits `actual − estimate` (refunds when negative). A header that
    /// is missing or not a whole number debits nothing and counts in
    /// `tollgate_response_cost_unread`. Runs once per admission.
    pub async fn settle(&self, admission: &mut Admission, headers: &HeaderMap, now: Timestamp) {
        let tier = admission.tier();
        let owed = admission.product.as_mut().map(|p| std::mem::take(&mut p.owed)).unwrap_or_default();
        for (i, key) in owed {
            let limit = &self.limits[i];
            let Some(name) = &limit.config.response_cost else { continue };
            let actual = headers.get(name).and_then(|v| v.to_str().ok()).and_then(|s| s.trim().parse::<u64>().ok());
            let Some(actual) = actual else {
                if let Some(c) = &limit.cost_unread {
                    c.inc();
                }
                continue;
            };
            let estimate = limit.config.cost;
            if actual > estimate {
                limit.debit(tier, key, now, actual - estimate).await;
            } else if actual < estimate {
                limit.refund(tier, key, now, estimate - actual).await;
            }
        }
    }
}
