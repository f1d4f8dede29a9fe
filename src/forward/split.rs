//! A route's split between upstreams (`routes[].split`): which upstream takes a request. A
//! tester's override header first, then the sticky key (the same key always lands on the
//! same side while the weights stay), else a draw by weight. Each choice is counted per
//! side and reason (`tollgate_route_split_requests_total`).
//!
//! The choice is a lookup and a random number (or the key's hash): no lock, no allocation.
//! A reload that changes the weights builds a new chooser; requests in flight keep the
//! upstream they were given.

use http::{HeaderMap, HeaderName, HeaderValue};
use prometheus_client::metrics::counter::Counter;

use crate::config::split::Split;
use crate::limit::KeySpec;
use crate::metrics::Metrics;

/// How a request's side was chosen (the metric's `by` label).
const BY: [&str; 3] = ["weight", "sticky", "override"];

struct Arm {
    /// Index into the proxy's backends (the config's upstreams).
    backend: usize,
    /// The end of its share on `0..total`: a draw below it (and above the previous arm's)
    /// lands here.
    until: u32,
    /// By `BY`.
    chosen: [Counter; 3],
}

pub struct Chooser {
    arms: Vec<Arm>,
    total: u32,
    sticky: Option<KeySpec>,
    overrides: Option<(HeaderName, Vec<(HeaderValue, usize)>)>,
}

impl Chooser {
    pub fn new(split: &Split, route: &str, metrics: &Metrics) -> Chooser {
        let mut until = 0;
        let arms = split
            .sides
            .iter()
            .map(|s| {
                until += s.weight;
                Arm { backend: s.upstream, until, chosen: BY.map(|by| metrics.split(route, &s.name, by)) }
            })
            .collect();
        Chooser {
            arms,
            total: until,
            sticky: split.sticky.clone(),
            overrides: split.overrides.as_ref().map(|o| (o.header.clone(), o.values.clone())),
        }
    }

    /// The backend for a request with `headers`; `key` hashes the request's sticky key
    /// (called only for a sticky split without an override).
    pub fn choose(&self, headers: &HeaderMap, key: impl FnOnce(&KeySpec) -> u64) -> usize {
        let (arm, by) = self.pick(headers, key);
        let arm = &self.arms[arm];
        arm.chosen[by].inc();
        arm.backend
    }

    /// The side's index and how it was chosen.
    fn pick(&self, headers: &HeaderMap, key: impl FnOnce(&KeySpec) -> u64) -> (usize, usize) {
        if let Some((name, values)) = &self.overrides {
            if let Some(v) = headers.get(name) {
                if let Some(&(_, side)) = values.iter().find(|(w, _)| w == v) {
                    return (side, 2);
                }
            }
        }
        match &self.sticky {
            Some(spec) => (self.side_at(point(key(spec), self.total)), 1),
            None => (self.side_at(fastrand::u32(..self.total)), 0),
        }
    }

    /// The side whose share holds `p` (< total); a side of weight 0 holds none.
    fn side_at(&self, p: u32) -> usize {
        self.arms.iter().position(|a| p < a.until).unwrap_or(0)
    }
}

/// A key's place on `0..total`: its hash spread (splitmix64's finaliser) and reduced. Keys
/// keep their place when the weights change, so moving 10 % of the share moves about 10 %
/// of the keys.
fn point(hash: u64, total: u32) -> u32 {
    let mut z = hash.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    // Lemire's multiply-shift: uniform enough on 0..total, no division.
    (((z >> 32) * u64::from(total)) >> 32) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::split::{Override, Side};

    fn split(weights: &[u32], sticky: bool) -> Split {
        Split {
            sides: weights
                .iter()
                .enumerate()
                .map(|(i, &w)| Side { upstream: 10 + i, name: format!("u{i}"), weight: w })
                .collect(),
            sticky: sticky.then(|| KeySpec::new(vec![crate::limit::KeyPart::ClientIp]).unwrap()),
            overrides: Some(Override {
                header: HeaderName::from_static("x-canary"),
                values: vec![(HeaderValue::from_static("always"), 1), (HeaderValue::from_static("u0"), 0)],
            }),
        }
    }

    #[test]
    fn draws_follow_the_weights() {
        let c = Chooser::new(&split(&[90, 10], false), "r", &Metrics::new());
        let h = HeaderMap::new();
        let canary = (0..20_000).filter(|_| c.choose(&h, |_| 0) == 11).count();
        // 10 % of 20,000, within 5 standard deviations (σ ≈ 42).
        assert!((1_790..2_210).contains(&canary), "{canary}");
    }

    #[test]
    fn a_sticky_key_stays_on_its_side_and_a_weight_change_moves_only_its_share() {
        let before = Chooser::new(&split(&[90, 10], true), "r", &Metrics::new());
        let after = Chooser::new(&split(&[50, 50], true), "r", &Metrics::new());
        let h = HeaderMap::new();
        let (mut moved, mut canary) = (0, 0);
        for k in 0..10_000u64 {
            let side = before.choose(&h, |_| k);
            assert!((0..20).all(|_| before.choose(&h, |_| k) == side), "key {k} moved");
            canary += usize::from(side == 11);
            if after.choose(&h, |_| k) != side {
                // Only from the big side to the one that grew.
                assert_eq!(side, 10, "key {k} left the canary");
                moved += 1;
            }
        }
        assert!((800..1_200).contains(&canary), "{canary} keys on the 10 % side");
        assert!((3_600..4_400).contains(&moved), "{moved} keys moved for 40 % of the share");
    }

    #[test]
    fn the_override_header_wins_over_weight_and_key() {
        let c = Chooser::new(&split(&[100, 0], true), "r", &Metrics::new());
        let mut h = HeaderMap::new();
        assert_eq!(c.choose(&h, |_| 7), 10, "weight 0 takes nothing by itself");
        h.insert("x-canary", HeaderValue::from_static("always"));
        assert_eq!(c.choose(&h, |_| 7), 11);
        h.insert("x-canary", HeaderValue::from_static("u0"));
        assert_eq!(c.choose(&h, |_| 7), 10);
        h.insert("x-canary", HeaderValue::from_static("nonsense"));
        assert_eq!(c.choose(&h, |_| 7), 10, "an unknown value is ignored");
    }
}
