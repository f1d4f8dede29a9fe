//! What the gate tells a client: the denial (its limits and spread waits) and the RateLimit
//! fields of an admitted request.

use super::*;

impl Gate {
    /// The enforced limits that denied, with their waits.
    #[inline]
    pub(super) fn denied(&self, decided: &[Decided], tier: Option<TierId>) -> Denied {
        let limits: SmallVec<[(usize, u64); 2]> = decided
            .iter()
            .filter_map(|d| {
                let limit = &self.limits[d.limit];
                let secs = match d.decision {
                    Decision::Deny { retry_after, .. } => limit.retry_after_secs(retry_after),
                    Decision::Never { .. } => limit.never_secs(tier),
                    Decision::Allow { .. } | Decision::Delay { .. } => return None,
                };
                limit.enforced().then_some((d.limit, secs))
            })
            .collect();
        let mut limits = limits;
        if self.spread > 0 {
            // Round robin over 0..=spread: a wave of denials in the same second is told to come
            // back evenly over the next `spread` seconds, each still after its honest wait.
            let extra = self.next.fetch_add(1, Ordering::Relaxed) % (self.spread + 1);
            for l in &mut limits {
                l.1 += extra;
            }
        }
        let retry_after_secs = limits.iter().map(|l| l.1).max().unwrap_or(1);
        // A plan tier's own policy (the route's is the answers' default).
        let policy = tier.and_then(|t| self.tier_policies.get(usize::from(t))?.clone()).map(Box::new);
        Denied { limits, retry_after_secs, policy }
    }

    #[inline]
    pub(super) fn ratelimit_admitted(&self, decided: &[Decided]) -> Option<HeaderValue> {
        self.policy.as_ref()?;
        // Written on the stack and copied once into the field's value.
        let mut out = ratelimit::Field::new();
        for d in decided {
            let limit = &self.limits[d.limit];
            if !limit.enforced() {
                continue;
            }
            let (remaining, reset) = match d.decision {
                Decision::Allow { remaining, reset } | Decision::Delay { remaining, reset, .. } => (remaining, reset),
                Decision::Deny { reset, .. } | Decision::Never { reset } => (0, reset),
            };
            ratelimit::state(&mut out, &limit.ratelimit_head, remaining, reset);
        }
        // Sensitive, as request ids are: a remaining count changes with every answer, so
        // HPACK should not index it (see `RequestId::value`).
        if out.is_empty() {
            return None;
        }
        let mut v = HeaderValue::from_bytes(&out).ok()?;
        v.set_sensitive(true);
        Some(v)
    }

    /// Puts the RateLimit headers of an admitted request on its answer.
    #[inline]
    pub fn decorate(&self, admission: &mut Admission, resp: &mut Response<Body>) {
        let policy = match admission.tier() {
            Some(t) => self.tier_policies.get(usize::from(t)).and_then(Option::as_ref),
            None => self.policy.as_ref(),
        };
        if let (Some(policy), Some(rl)) = (policy, admission.ratelimit.take()) {
            let h = resp.headers_mut();
            h.insert(RATELIMIT_POLICY, policy.clone());
            h.insert(RATELIMIT, rl);
        }
    }
}
