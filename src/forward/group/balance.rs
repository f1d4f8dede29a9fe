//! Which server of a group takes a try: least request (P2C over in-flight × decayed peak
//! latency), smooth weighted round robin, or weighted rendezvous hashing; never a server the
//! request already tried, nor one that is ejected or failing its checks.

use std::sync::atomic::Ordering;

use super::{Group, Member, Set, Tried};
use crate::config::group::Balance;

/// Peak-EWMA latency decays over this (as tower's and Finagle's default).
const DECAY_MS: f64 = 10_000.0;

impl Group {
    pub(super) fn eligible(set: &Set, i: usize, tried: &Tried, now: u64) -> bool {
        let m = &set.members[i];
        !tried.has(i) && m.up.load(Ordering::Relaxed) && m.ejected_until.load(Ordering::Relaxed) <= now
    }

    /// The server for the next try, `None` when no untried server may take one.
    pub(super) fn pick(&self, set: &Set, key: u64, tried: &Tried, now: u64) -> Option<usize> {
        let n = set.members.len();
        if n == 0 {
            return None;
        }
        let ok = |i: usize| Group::eligible(set, i, tried, now);
        match &self.cfg.balance {
            Balance::LeastRequest => {
                if n == 1 {
                    return ok(0).then_some(0);
                }
                let a = fastrand::usize(..n);
                let mut b = fastrand::usize(..n - 1);
                if b >= a {
                    b += 1;
                }
                match (ok(a), ok(b)) {
                    (true, true) => Some(if cost(set, a, now) <= cost(set, b, now) { a } else { b }),
                    (true, false) => Some(a),
                    (false, true) => Some(b),
                    (false, false) => {
                        (0..n).filter(|&i| ok(i)).min_by(|&x, &y| cost(set, x, now).total_cmp(&cost(set, y, now)))
                    }
                }
            }
            Balance::RoundRobin => {
                let len = set.schedule.len();
                let start = self.next.fetch_add(1, Ordering::Relaxed);
                (0..len).map(|k| usize::from(set.schedule[(start + k) % len])).find(|&i| ok(i))
            }
            Balance::Hash(_) => (0..n).filter(|&i| ok(i)).max_by(|&x, &y| {
                let score = |i: usize| rendezvous(key, set.members[i].seed, set.members[i].weight);
                score(x).total_cmp(&score(y))
            }),
        }
    }
}

/// Least-request load: requests waiting × decayed peak latency, per unit of weight.
fn cost(set: &Set, i: usize, now: u64) -> f64 {
    let m = &set.members[i];
    let waiting = m.metrics.in_flight.get().max(0) as f64;
    (waiting + 1.0) * (decayed(m, now, 0.0) + 1.0) / f64::from(m.weight)
}

/// The peak-EWMA latency of `m` at `now`, after a sample of `sample_us` (0: none, decay only).
pub(super) fn decayed(m: &Member, now: u64, sample_us: f64) -> f64 {
    let est = f64::from_bits(m.ewma_us.load(Ordering::Relaxed));
    if sample_us > est {
        return sample_us;
    }
    let elapsed = now.saturating_sub(m.ewma_at.load(Ordering::Relaxed)) as f64;
    let decay = (-elapsed / DECAY_MS).exp();
    est * decay + sample_us * (1.0 - decay)
}

/// A server's weighted rendezvous score for `key`: -w / ln(u), u uniform in (0, 1) from the
/// key and the server's seed. The highest score owns the key.
fn rendezvous(key: u64, seed: u64, weight: u32) -> f64 {
    let u = ((mix(key ^ seed) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -f64::from(weight) / u.ln()
}

/// A 64-bit finaliser (splitmix64): spreads nearby keys over the whole range.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Smooth weighted round robin (as nginx): each server as often as its weight, spread out.
pub(super) fn smooth_round_robin(weights: &[u32]) -> Vec<u16> {
    let total: i64 = weights.iter().map(|&w| i64::from(w)).sum();
    let mut current = vec![0i64; weights.len()];
    let mut out = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
    for _ in 0..total {
        for (c, &w) in current.iter_mut().zip(weights) {
            *c += i64::from(w);
        }
        let Some((best, _)) = current.iter().enumerate().max_by_key(|&(i, &c)| (c, std::cmp::Reverse(i))) else {
            break;
        };
        current[best] -= total;
        out.push(u16::try_from(best).unwrap_or(0));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_serves_each_server_by_its_weight_spread_out() {
        let s = smooth_round_robin(&[5, 1, 1]);
        assert_eq!(s.len(), 7);
        assert_eq!(s.iter().filter(|&&i| i == 0).count(), 5);
        // nginx's smooth order: the heavy server never takes all its turns in a row.
        assert_eq!(s, vec![0, 0, 1, 0, 2, 0, 0]);
    }

    /// The owner of `key` among servers given as (seed, weight), as `pick` chooses it.
    fn owner(key: u64, seeds: &[(u64, u32)]) -> usize {
        let score = |&(seed, w): &(u64, u32)| rendezvous(key, seed, w);
        (0..seeds.len()).max_by(|&x, &y| score(&seeds[x]).total_cmp(&score(&seeds[y]))).unwrap()
    }

    #[test]
    fn removing_one_server_moves_only_its_keys() {
        let seeds: Vec<(u64, u32)> =
            (0..5).map(|i| (xxhash_rust::xxh3::xxh3_64(format!("10.0.0.{i}:80").as_bytes()), 1)).collect();
        let keys = 20_000u64;
        let before: Vec<usize> = (0..keys).map(|k| owner(mix(k), &seeds)).collect();
        // Server 2 leaves.
        let rest: Vec<(u64, u32)> = seeds.iter().enumerate().filter(|(i, _)| *i != 2).map(|(_, s)| *s).collect();
        let index_of = |j: usize| if j >= 2 { j + 1 } else { j };
        let mut moved = 0;
        for k in 0..keys {
            let after = index_of(owner(mix(k), &rest));
            if before[k as usize] != 2 {
                assert_eq!(after, before[k as usize], "key {k} moved though its server stayed");
            } else {
                moved += 1;
            }
        }
        // Its own share, about 1/5 of the keys, and nothing else.
        assert!((3_000..5_000).contains(&moved), "{moved} keys moved");
        // Each server holds about a fifth.
        for s in 0..5 {
            let held = before.iter().filter(|&&o| o == s).count();
            assert!((3_200..4_800).contains(&held), "server {s} holds {held}");
        }
    }

    #[test]
    fn weights_share_hash_keys_in_proportion() {
        let seeds = [(1u64, 3u32), (2, 1)];
        let heavy = (0..20_000u64).filter(|&k| owner(mix(k), &seeds) == 0).count();
        assert!((14_000..16_000).contains(&heavy), "{heavy}");
    }
}
