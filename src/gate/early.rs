//! What a limit remembers of the keys it denied: the instant each was told to come back and
//! the wait it was told, so that a key back sooner (an early retry) is counted and, with
//! `early_retry: { penalty: double }`, denied and told twice that wait.
//!
//! Per limit and per instance, bounded, with no global lock: [`SHARDS`] maps, each behind its
//! own lock and holding at most its share of [`MAX_KEYS`]. A shard's latest deadline sits
//! beside it in an atomic: while no deadline of the shard is ahead, a request reads that one
//! word (relaxed) and takes no lock, so keys of a limit that denied nobody lately cost
//! nothing more. Entries past their deadline are dropped when next met (a look-up, or a
//! denial in a full shard, which then also drops an eighth of its keys if it is still full).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::limit::store::DigestHasher;
use crate::limit::{KeyHash, Span, Timestamp};

/// Shards of one limit's table: a power of two, chosen by the key's high bits.
pub const SHARDS: usize = 64;

/// The most keys one limit remembers (or its `max_keys`, when lower): ~48 bytes each.
pub const MAX_KEYS: usize = 65_536;

const MICROS_PER_SEC: u64 = 1_000_000;

/// What a denied key was told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Told {
    /// When it may come back (µs): its denial's instant plus the Retry-After sent.
    pub deadline: u64,
    /// The Retry-After sent, in seconds.
    pub wait_secs: u64,
}

/// One limit's denied keys, with what each was told.
pub struct Early {
    shards: Box<[Shard]>,
    per_shard: usize,
}

/// A cache line of its own: a denial in one shard does not slow reads of the others.
#[repr(align(64))]
struct Shard {
    /// The latest deadline held (µs): from then on every entry has expired.
    until: AtomicU64,
    map: Mutex<HashMap<u128, Told, DigestHasher>>,
}

impl Early {
    /// A table remembering at most `max_keys` keys (capped at [`MAX_KEYS`]), give or take
    /// the rounding of its shares.
    pub fn new(max_keys: usize) -> Early {
        let per_shard = max_keys.clamp(1, MAX_KEYS).div_ceil(SHARDS);
        let shards =
            (0..SHARDS).map(|_| Shard { until: AtomicU64::new(0), map: Mutex::new(HashMap::default()) }).collect();
        Early { shards, per_shard }
    }

    fn shard(&self, key: KeyHash) -> &Shard {
        // The high bits: the map hashes with the low 64.
        &self.shards[(key.0 >> 122) as usize % SHARDS]
    }

    /// What `key` was told, when its deadline is still ahead of `now`: it is back early.
    #[inline]
    pub fn told(&self, key: KeyHash, now: Timestamp) -> Option<Told> {
        let shard = self.shard(key);
        let now = now.as_micros();
        if now >= shard.until.load(Ordering::Relaxed) {
            return None;
        }
        self.lookup(shard, key, now)
    }

    #[cold]
    #[inline(never)]
    fn lookup(&self, shard: &Shard, key: KeyHash, now: u64) -> Option<Told> {
        let mut map = lock(shard);
        match map.get(&key.0) {
            Some(t) if t.deadline > now => Some(*t),
            Some(_) => {
                map.remove(&key.0);
                None
            }
            None => None,
        }
    }

    /// Remembers that `key` was told at `now` to wait `wait_secs`.
    #[cold]
    #[inline(never)]
    pub fn remember(&self, key: KeyHash, now: Timestamp, wait_secs: u64) {
        let shard = self.shard(key);
        let now = now.as_micros();
        let deadline = now.saturating_add(wait_secs.saturating_mul(MICROS_PER_SEC));
        let mut map = lock(shard);
        // Written under the shard's lock only: a load and a store, no read-modify-write.
        let until = shard.until.load(Ordering::Relaxed);
        if now >= until {
            // Every entry has expired.
            map.clear();
        }
        if map.len() >= self.per_shard && !map.contains_key(&key.0) {
            map.retain(|_, t| t.deadline > now);
            // Still full of waiting keys (many clients denied within a period): make room for
            // an eighth more at once, so the scan is paid once per that many denials and not
            // on every one. Which keys go does not matter much: their next early retries go
            // uncounted, and unpenalised.
            let keep = self.per_shard - self.per_shard.div_ceil(8);
            let mut excess = map.len().saturating_sub(keep);
            if excess > 0 {
                map.retain(|_, _| {
                    let keep = excess == 0;
                    excess = excess.saturating_sub(1);
                    keep
                });
            }
        }
        map.insert(key.0, Told { deadline, wait_secs });
        if deadline > until {
            shard.until.store(deadline, Ordering::Relaxed);
        }
    }

    /// Forgets `key` (an operator's reset lets it through at once).
    pub fn forget(&self, key: KeyHash) {
        lock(self.shard(key)).remove(&key.0);
    }

    /// Keys remembered with a deadline after `now`.
    #[cfg(test)]
    pub fn live(&self, now: Timestamp) -> usize {
        let now = now.as_micros();
        self.shards.iter().map(|s| lock(s).values().filter(|t| t.deadline > now).count()).sum()
    }
}

impl Told {
    /// The wait of an early retry at `now` under `penalty: double`: twice the last wait
    /// told, capped at `period_secs`, and never sooner than the deadline already told (the
    /// store admits from there, so the new Retry-After stays honest).
    pub fn doubled(&self, now: Timestamp, period_secs: u64) -> Span {
        let doubled = self.wait_secs.saturating_mul(2).min(period_secs.max(1));
        let left = self.deadline.saturating_sub(now.as_micros());
        Span::from_micros(doubled.saturating_mul(MICROS_PER_SEC).max(left))
    }
}

fn lock(shard: &Shard) -> std::sync::MutexGuard<'_, HashMap<u128, Told, DigestHasher>> {
    // Plain values that every update leaves consistent: a poisoned lock is still usable.
    shard.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod gate_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_micros(secs * MICROS_PER_SEC)
    }

    #[test]
    fn a_key_is_early_until_its_deadline_and_never_after() {
        let e = Early::new(100);
        let k = KeyHash(7);
        assert_eq!(e.told(k, at(10)), None);
        e.remember(k, at(10), 5);
        assert_eq!(e.told(k, at(14)), Some(Told { deadline: 15 * MICROS_PER_SEC, wait_secs: 5 }));
        assert_eq!(e.told(k, Timestamp::from_micros(15 * MICROS_PER_SEC - 1)).map(|t| t.wait_secs), Some(5));
        assert_eq!(e.told(k, at(15)), None);
        // Past every deadline of its shard: not even looked up.
        assert_eq!(e.live(at(15)), 0);
    }

    #[test]
    fn the_table_stays_within_its_bound() {
        let e = Early::new(128);
        for i in 0..10_000u128 {
            e.remember(KeyHash(i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)), at(1), 60);
        }
        assert!(e.live(at(1)) <= 128, "{}", e.live(at(1)));
        // A full shard of waiting keys gives up an eighth of them at once, then admits more.
        let shard = e.shard(KeyHash(0));
        assert_eq!(lock(shard).len(), 2);
        e.remember(KeyHash(5), at(1), 60);
        assert_eq!(lock(shard).len(), 2, "one dropped (an eighth, rounded up), one added");
        assert!(e.told(KeyHash(5), at(2)).is_some());
        // Once every deadline has passed, a denial starts its shard afresh.
        e.remember(KeyHash(1 << 127), at(100), 1);
        let shard = e.shard(KeyHash(1 << 127));
        assert_eq!(lock(shard).len(), 1);
    }

    #[test]
    fn a_doubled_wait_is_capped_at_the_period_and_keeps_the_deadline_told() {
        let t = Told { deadline: 20 * MICROS_PER_SEC, wait_secs: 10 };
        assert_eq!(t.doubled(at(11), 60), Span::from_secs(20));
        assert_eq!(t.doubled(at(11), 15), Span::from_secs(15));
        // A cap below what is left: the deadline already told stands.
        assert_eq!(t.doubled(at(11), 5), Span::from_secs(9));
    }
}
