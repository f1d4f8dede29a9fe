//! In-process store: 64 shards of `Mutex<HashMap<KeyHash, State>>`, no global lock. Invariants:
//! an entry exists only while its state is not back to initial (a full bucket = no entry), at
//! most `max_keys` entries exist, and a state that is not initial is never dropped.
//!
//! # Key bound and overflow
//! `max_keys` is split over the shards (shard `i` holds at most `max_keys / 64`, plus one for
//! the first `max_keys % 64` shards), so `len() <= max_keys` always. A shard is picked by the top
//! 6 bits of the key hash; the map hashes with the low 64 bits as they are (keys are digests).
//!
//! When a new key finds its shard full, the shard first drops the entries that are back to
//! initial at `now` (a sweep, at most once per 50 ms and never before the earliest moment one
//! of its entries can be idle, so a flood of new keys cannot make every request O(shard)). If
//! still full, the new key is decided against the shard's one **overflow state**, shared by
//! every key that found no room: stricter than a bucket of its own, never looser. A key that
//! later gets a slot starts from a copy of the overflow state while that is not initial, so a
//! client throttled through the overflow cannot come back with a full bucket either. Memory is
//! therefore bounded by `max_keys` entries of 48 bytes (key 16 + state 32) plus the hash
//! table's slack (capacity is a power of two, load ≤ 7/8), the sliding log's queues excepted.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::limit::algo::{debit_in_place, decide_in_place, refund_in_place};
use crate::limit::store::DigestHasher;
use crate::limit::{Algorithm, Decision, KeyHash, Span, State, Timestamp};

/// Number of shards; a power of two, picked by the hash's top bits.
pub const SHARDS: usize = 64;
const SHARD_BITS: u32 = SHARDS.trailing_zeros();

/// Minimum time between two sweeps of one shard.
const SWEEP_GAP: Span = Span::from_micros(50_000);

/// The sharded, bounded map of per-key states for one limit.
#[derive(Debug)]
pub struct LocalStore {
    alg: Algorithm,
    max_keys: usize,
    shards: Box<[Padded]>,
}

/// A shard on its own cache lines, so two threads on neighbouring shards do not contend.
#[derive(Debug)]
#[repr(align(128))]
struct Padded(Mutex<Shard>);

#[derive(Debug)]
struct Shard {
    map: HashMap<u128, State, DigestHasher>,
    cap: usize,
    /// Shared by new keys that found the shard full; `None` = initial.
    overflow: Option<State>,
    /// No sweep before this time: nothing can have become idle earlier.
    next_sweep: Timestamp,
}

impl LocalStore {
    /// A store for `alg` holding at most `max_keys` keys (0 = every key shares the overflow).
    pub fn new(alg: Algorithm, max_keys: usize) -> Self {
        let shards = (0..SHARDS)
            .map(|i| {
                let cap = max_keys / SHARDS + usize::from(i < max_keys % SHARDS);
                Padded(Mutex::new(Shard { map: HashMap::default(), cap, overflow: None, next_sweep: Timestamp::ZERO }))
            })
            .collect();
        Self { alg, max_keys, shards }
    }

    /// Decides one request of `cost` for `key` at `now`.
    pub fn decide(&self, key: KeyHash, now: Timestamp, cost: u64) -> Decision {
        self.lock(key).decide(&self.alg, key.0, now, cost)
    }

    /// [`LocalStore::decide`] with other parameters of the same algorithm: a plan limit keeps
    /// one state per client and decides it with the parameters of the client's tier.
    pub fn decide_as(&self, alg: &Algorithm, key: KeyHash, now: Timestamp, cost: u64) -> Decision {
        self.lock(key).decide(alg, key.0, now, cost)
    }

    /// [`LocalStore::refund`] with the parameters of a plan tier.
    pub fn refund_as(&self, alg: &Algorithm, key: KeyHash, now: Timestamp, cost: u64) {
        self.lock(key).refund(alg, key.0, now, cost);
    }

    /// [`LocalStore::debit`] with the parameters of a plan tier.
    pub fn debit_as(&self, alg: &Algorithm, key: KeyHash, now: Timestamp, cost: u64) {
        self.lock(key).debit(alg, key.0, now, cost);
    }

    /// Undoes an admission of `cost` for `key` made at `now` (see [`crate::limit::refund`]).
    /// A key without an entry was decided against its shard's overflow state: refund that.
    pub fn refund(&self, key: KeyHash, now: Timestamp, cost: u64) {
        self.lock(key).refund(&self.alg, key.0, now, cost);
    }

    /// Charges `cost` more for `key` at `now` (see [`crate::limit::debit`]); a key without an
    /// entry and no room for one charges its shard's overflow state.
    pub fn debit(&self, key: KeyHash, now: Timestamp, cost: u64) {
        self.lock(key).debit(&self.alg, key.0, now, cost);
    }

    /// Live keys (entries whose state is not known to be initial), for a metric.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(&s.0).map.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn algorithm(&self) -> &Algorithm {
        &self.alg
    }

    /// The configured key bound.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// Drops every entry that is back to initial at `now` (for an optional periodic task, so
    /// that `len()` follows live traffic); returns how many were dropped.
    pub fn sweep(&self, now: Timestamp) -> usize {
        self.shards.iter().map(|s| lock(&s.0).sweep(&self.alg, now)).sum()
    }

    fn lock(&self, key: KeyHash) -> MutexGuard<'_, Shard> {
        // Top bits pick the shard; the map uses the low bits, so the two stay independent.
        let i = (key.0 >> (128 - SHARD_BITS)) as usize;
        lock(&self.shards[i % SHARDS].0)
    }
}

/// A poisoned shard holds plain data that every decision leaves consistent: keep using it.
fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shard {
    fn decide(&mut self, alg: &Algorithm, key: u128, now: Timestamp, cost: u64) -> Decision {
        if let Some(st) = self.map.get_mut(&key) {
            let d = decide_in_place(alg, st, now, cost);
            if st.is_idle(alg, now) {
                self.map.remove(&key);
            }
            return d;
        }
        if self.map.len() >= self.cap && now >= self.next_sweep {
            self.sweep(alg, now);
        }
        if self.overflow.as_ref().is_some_and(|o| o.is_idle(alg, now)) {
            self.overflow = None;
        }
        if self.map.len() < self.cap {
            // A throttled overflow means this key may have been throttled through it.
            let mut st = match &self.overflow {
                Some(o) => o.clone(),
                None => State::initial(alg),
            };
            let d = decide_in_place(alg, &mut st, now, cost);
            if !st.is_idle(alg, now) {
                self.map.insert(key, st);
            }
            return d;
        }
        let st = self.overflow.get_or_insert_with(|| State::initial(alg));
        let d = decide_in_place(alg, st, now, cost);
        if st.is_idle(alg, now) {
            self.overflow = None;
        }
        d
    }

    fn debit(&mut self, alg: &Algorithm, key: u128, now: Timestamp, cost: u64) {
        if let Some(st) = self.map.get_mut(&key) {
            debit_in_place(alg, st, now, cost);
            return;
        }
        if self.map.len() >= self.cap && now >= self.next_sweep {
            self.sweep(alg, now);
        }
        if self.map.len() < self.cap {
            let mut st = self.overflow.clone().unwrap_or_else(|| State::initial(alg));
            debit_in_place(alg, &mut st, now, cost);
            if !st.is_idle(alg, now) {
                self.map.insert(key, st);
            }
            return;
        }
        let st = self.overflow.get_or_insert_with(|| State::initial(alg));
        debit_in_place(alg, st, now, cost);
    }

    fn refund(&mut self, alg: &Algorithm, key: u128, now: Timestamp, cost: u64) {
        let slot = match self.map.get_mut(&key) {
            Some(st) => st,
            None => match self.overflow.as_mut() {
                Some(o) => o,
                None => return,
            },
        };
        refund_in_place(alg, slot, now, cost);
        if slot.is_idle(alg, now) && self.map.remove(&key).is_none() {
            self.overflow = None;
        }
    }

    /// Drops idle entries; schedules the next sweep at the earliest time one can be idle.
    fn sweep(&mut self, alg: &Algorithm, now: Timestamp) -> usize {
        let before = self.map.len();
        let mut earliest = Timestamp::MAX;
        self.map.retain(|_, st| {
            let idle = st.is_idle(alg, now);
            if !idle {
                earliest = earliest.min(st.idle_at(alg));
            }
            !idle
        });
        self.next_sweep = earliest.max(now + SWEEP_GAP);
        before - self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;

    use super::*;
    use crate::limit::NonZeroSpan;

    fn nz(n: u64) -> NonZeroU64 {
        NonZeroU64::new(n).expect("non-zero")
    }

    fn nzs(us: u64) -> NonZeroSpan {
        NonZeroSpan::from_micros(us).expect("non-zero")
    }

    fn at(us: u64) -> Timestamp {
        Timestamp::from_micros(us)
    }

    /// One token per 1 000 µs, burst 1: any admitted key stays live for 1 ms.
    fn tb() -> Algorithm {
        Algorithm::TokenBucket { interval: nzs(1_000), burst: nz(1), warmup: Span::ZERO }
    }

    /// Key `n` in shard `shard`.
    fn key(shard: usize, n: u64) -> KeyHash {
        KeyHash(((shard as u128) << 122) | u128::from(n))
    }

    #[test]
    fn forgets_states_back_to_initial() {
        let s = LocalStore::new(tb(), 1_000);
        assert!(s.decide(key(3, 1), at(0), 1).is_admitted());
        assert_eq!(s.len(), 1);
        // Refilled: the next decision finds a full bucket and leaves no entry behind.
        assert!(s.decide(key(3, 1), at(1_000), 0).is_admitted());
        assert_eq!(s.len(), 0);
        assert!(s.decide(key(3, 2), at(5), 1).is_admitted());
        assert_eq!(s.sweep(at(999)), 0);
        assert_eq!(s.sweep(at(1_005)), 1);
        assert!(s.is_empty());
    }

    #[test]
    fn never_holds_more_than_max_keys() {
        let s = LocalStore::new(tb(), 130);
        for n in 0..10_000u64 {
            s.decide(KeyHash(u128::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)), at(0), 1);
        }
        assert_eq!(s.len(), 130);
    }

    #[test]
    fn new_keys_beyond_the_bound_share_the_overflow_state() {
        // 64 keys: one per shard. Shard 0 holds one key.
        let s = LocalStore::new(tb(), 64);
        assert!(s.decide(key(0, 1), at(0), 1).is_admitted());
        assert!(s.decide(key(0, 2), at(0), 1).is_admitted(), "first overflow user");
        assert!(!s.decide(key(0, 3), at(0), 1).is_admitted(), "overflow is shared");
        assert!(s.decide(key(1, 3), at(0), 1).is_admitted(), "other shards unaffected");
        assert_eq!(s.len(), 2);
        // Refund of a key without an entry goes to the overflow, where it was admitted.
        s.refund(key(0, 2), at(0), 1);
        assert!(s.decide(key(0, 3), at(0), 1).is_admitted());
    }

    #[test]
    fn throttled_client_never_comes_back_with_a_full_bucket() {
        let sec = 1_000_000;
        let alg = Algorithm::TokenBucket { interval: nzs(sec), burst: nz(1), warmup: Span::ZERO };
        let s = LocalStore::new(alg, 64);
        // A is throttled and holds shard 0's only slot; a flood of new keys cannot evict it.
        assert!(s.decide(key(0, 1), at(0), 1).is_admitted());
        for n in 2..1_000 {
            s.decide(key(0, n), at(10), 1);
        }
        assert!(!s.decide(key(0, 1), at(sec / 2), 1).is_admitted());
        assert_eq!(s.sweep(at(sec / 2)), 0, "a throttled key is never dropped");
        // B (key 2) was admitted through the overflow at t=10. Once A is idle B gets A's slot,
        // but starts from the overflow's state, not a full bucket.
        assert!(!s.decide(key(0, 2), at(sec + 5), 1).is_admitted());
        assert_eq!(s.len(), 1);
        assert!(s.decide(key(0, 2), at(sec + 10), 1).is_admitted());
    }

    #[test]
    fn sweeps_are_rate_limited_and_scheduled() {
        let s = LocalStore::new(tb(), 64);
        assert!(s.decide(key(0, 1), at(0), 1).is_admitted());
        // Full at t=10: the sweep finds nothing and schedules the next one at >= 1_000.
        assert!(s.decide(key(0, 2), at(10), 1).is_admitted()); // overflow
        let next = lock(&s.shards[0].0).next_sweep;
        assert_eq!(next, at(10) + SWEEP_GAP);
        // Before that, a new key goes to the overflow even though key 1 became idle.
        assert!(!s.decide(key(0, 3), at(1_005), 1).is_admitted());
        assert_eq!(s.len(), 1);
        assert!(s.decide(key(0, 4), next, 1).is_admitted());
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn shards_by_the_top_bits() {
        let s = LocalStore::new(tb(), 64 * 100);
        for shard in 0..SHARDS {
            for n in 0..50 {
                s.decide(key(shard, n), at(0), 1);
            }
        }
        for shard in s.shards.iter() {
            assert_eq!(lock(&shard.0).map.len(), 50);
        }
    }

    #[test]
    fn concurrent_decisions_on_one_key_never_over_admit() {
        let alg = Algorithm::TokenBucket { interval: nzs(1_000_000), burst: nz(1_000), warmup: Span::ZERO };
        let s = LocalStore::new(alg, 10);
        let admitted: usize = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..2)
                .map(|_| sc.spawn(|| (0..5_000).filter(|_| s.decide(key(7, 7), at(0), 1).is_admitted()).count()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        assert_eq!(admitted, 1_000);
    }

    #[test]
    fn zero_max_keys_puts_everyone_in_the_overflow() {
        let s = LocalStore::new(tb(), 0);
        assert!(s.decide(key(5, 1), at(0), 1).is_admitted());
        assert!(!s.decide(key(5, 2), at(0), 1).is_admitted());
        assert!(s.is_empty());
    }
}
