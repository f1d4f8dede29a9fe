//! The RateLimit header fields (draft-ietf-httpapi-ratelimit-headers, structured-field
//! syntax) and `Retry-After` seconds: how a limit's parameters and a decision are written
//! down. Pure rendering; the gate decides and the answer module builds the 429.

use http::header::{HeaderName, HeaderValue};

use crate::limit::{longest_wait, Algorithm, Span};

pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// Whole seconds, rounded up, at least 1: a client that waits this long is admitted.
pub fn retry_after_secs(wait: Span) -> u64 {
    wait.as_secs_ceil().max(1)
}

/// `Retry-After` seconds of a denial of `alg` that must wait `wait`: [`retry_after_secs`],
/// capped at the longest wait the algorithm can need ([`longest_wait`], rounded up), so that
/// a client waiting the number sent is always admitted. That cap is not the period `w`: a
/// sliding window's request can have to wait well into the next window (up to two windows),
/// a warming token bucket up to three refills, a leaky bucket the slots of its largest cost.
pub fn retry_after_capped(alg: &Algorithm, wait: Span) -> u64 {
    retry_after_secs(wait).min(retry_after_secs(longest_wait(alg)))
}

/// The longest wait a penalised early retry is told (`early_retry: { penalty: double }`):
/// the limit's period in whole seconds ([`Algorithm::period`]: a window; the time a token
/// bucket takes to refill fully; the time a leaky bucket's queue takes to drain).
pub fn penalty_cap_secs(alg: &Algorithm) -> u64 {
    retry_after_secs(alg.period())
}

/// `q` and `w` of an algorithm's RateLimit-Policy item ([`Algorithm::policy`]). A
/// `Decision::Never` (a cost no wait makes fit) is answered with `w`.
pub fn policy_numbers(alg: &Algorithm) -> (u64, u64) {
    alg.policy()
}

/// Appends one list member: the policy name as a structured-field String. Names are
/// validated to `[A-Za-z0-9._-]` at load, so nothing needs escaping.
pub fn item(out: &mut String, name: &str) {
    if !out.is_empty() {
        out.push_str(", ");
    }
    out.push('"');
    out.push_str(name);
    out.push('"');
}

/// Appends `;key=value` to the current member.
pub fn param(out: &mut String, key: &str, value: u64) {
    out.push(';');
    out.push_str(key);
    out.push('=');
    out.push_str(itoa::Buffer::new().format(value));
}

/// `RateLimit-Policy` for these limits (name, algorithm); `None` when there are none.
pub fn policy<'a>(limits: impl Iterator<Item = (&'a str, &'a Algorithm)>) -> Option<HeaderValue> {
    let mut out = String::new();
    for (name, alg) in limits {
        let (q, w) = policy_numbers(alg);
        item(&mut out, name);
        param(&mut out, "q", q);
        param(&mut out, "w", w);
    }
    (!out.is_empty()).then(|| HeaderValue::try_from(out).ok()).flatten()
}

/// The start of a limit's `RateLimit` member, `"name";r=`: rendered once per limit, at load.
pub fn member_head(name: &str) -> Box<str> {
    let mut out = String::with_capacity(name.len() + 5);
    item(&mut out, name);
    out.push_str(";r=");
    out.into_boxed_str()
}

/// The `RateLimit` field being written for one answer: on the stack unless many limits apply.
pub type Field = smallvec::SmallVec<[u8; 96]>;

/// Appends the `RateLimit` member of one limit whose [`member_head`] is `head`: `r` remaining
/// now, `t` seconds until full.
pub fn state(out: &mut Field, head: &str, remaining: u64, reset: Span) {
    if !out.is_empty() {
        out.extend_from_slice(b", ");
    }
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(itoa::Buffer::new().format(remaining).as_bytes());
    out.extend_from_slice(b";t=");
    out.extend_from_slice(itoa::Buffer::new().format(reset.as_secs_ceil()).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::NonZeroSpan;
    use std::num::NonZeroU64;

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        let secs = |us| retry_after_secs(Span::from_micros(us));
        assert_eq!(secs(0), 1);
        assert_eq!(secs(1), 1);
        assert_eq!(secs(1_000_000), 1);
        assert_eq!(secs(1_000_001), 2);
        assert_eq!(secs(2_500_000), 3);
    }

    #[test]
    fn policy_lists_quota_and_window() {
        let nz = |n| NonZeroU64::new(n).unwrap();
        let nzs = |us| NonZeroSpan::from_micros(us).unwrap();
        let tb = Algorithm::TokenBucket { interval: nzs(100_000), burst: nz(20), warmup: Span::ZERO };
        let fw = Algorithm::FixedWindow { window: nzs(60_000_000), limit: nz(100), calendar: None };
        let v = policy([("a", &tb), ("b", &fw)].into_iter()).unwrap();
        assert_eq!(v, "\"a\";q=20;w=2, \"b\";q=100;w=60");
        assert!(policy(std::iter::empty()).is_none());
        let mut s = Field::new();
        state(&mut s, &member_head("a"), 3, Span::from_micros(1_500_000));
        state(&mut s, &member_head("b.c-d_e"), 0, Span::from_micros(60_000_000));
        assert_eq!(std::str::from_utf8(&s).unwrap(), "\"a\";r=3;t=2, \"b.c-d_e\";r=0;t=60");
    }
}
