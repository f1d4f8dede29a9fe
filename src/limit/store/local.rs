//! In-process store: 64 shards of `Mutex<HashMap<KeyHash, State>>`, no global lock. Invariants:
//! a state back to initial (a full bucket = no entry) is dropped when its key is next decided
//! or by the next sweep of its shard, at most `max_keys` entries exist, and a state that is not
//! initial is never dropped.
//!
//! # Forgetting idle keys
//! A key that never comes back is not decided again, so shards sweep: a shard drops the
//! entries that are back to initial when a new key arrives and the shard holds twice the
//! entries its last sweep left (at least [`SWEEP_MIN`]), or is full. A sweep costs O(entries)
//! once per doubling, as a hash table's own growth does: O(1) per new key amortized, and
//! nothing at all for a key that has an entry. So the entries of a shard stay below twice the
//! keys that still hold state (plus [`SWEEP_MIN`]), whatever the churn of keys, and a table
//! left four times larger than needed is shrunk. Reading the live count ([`LocalStore::live`],
//! for the metric) sweeps first, so it counts only keys that still hold state.
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

/// A shard sweeps on a new key once it holds this many entries (or twice what its last
/// sweep left, if more).
pub const SWEEP_MIN: usize = 16;

/// The sharded, bounded map of per-key states for one limit.
#[derive(Debug)]
pub struct LocalStore {
    alg: Algorithm,
    /// A state is dropped by a sweep only if idle under each of these: `alg`, and for a plan
    /// limit the parameters of every tier (one state per client, decided with its tier's).
    idle_under: Box<[Algorithm]>,
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
    /// A new key sweeps once the map holds this many entries: twice what the last sweep left.
    sweep_at: usize,
}

impl LocalStore {
    /// A store for `alg` holding at most `max_keys` keys (0 = every key shares the overflow).
    pub fn new(alg: Algorithm, max_keys: usize) -> Self {
        Self::with_tiers(alg, max_keys, std::iter::empty())
    }

    /// A store for `alg` that also decides keys with the parameters of `tiers` (a plan limit:
    /// one state per client, decided with its tier's parameters). Sweeps keep a state until it
    /// is idle under every one of them.
    pub fn with_tiers(alg: Algorithm, max_keys: usize, tiers: impl IntoIterator<Item = Algorithm>) -> Self {
        let mut idle_under = vec![alg.clone()];
        for t in tiers {
            if !idle_under.contains(&t) {
                idle_under.push(t);
            }
        }
        let shards = (0..SHARDS)
            .map(|i| {
                let cap = max_keys / SHARDS + usize::from(i < max_keys % SHARDS);
                Padded(Mutex::new(Shard {
                    map: HashMap::default(),
                    cap,
                    overflow: None,
                    next_sweep: Timestamp::ZERO,
                    sweep_at: SWEEP_MIN,
                }))
            })
            .collect();
        Self { alg, idle_under: idle_under.into(), max_keys, shards }
    }

    /// Decides one request of `cost` for `key` at `now`.
    pub fn decide(&self, key: KeyHash, now: Timestamp, cost: u64) -> Decision {
        self.lock(key).decide(&self.alg, &self.idle_under, key.0, now, cost)
    }

    /// [`LocalStore::decide`] with other parameters of the same algorithm: a plan limit keeps
    /// one state per client and decides it with the parameters of the client's tier.
    pub fn decide_as(&self, alg: &Algorithm, key: KeyHash, now: Timestamp, cost: u64) -> Decision {
        self.lock(key).decide(alg, &self.idle_under, key.0, now, cost)
    }

    /// [`LocalStore::refund`] with the parameters of a plan tier.
    pub fn refund_as(&self, alg: &Algorithm, key: KeyHash, now: Timestamp, cost: u64) {
        self.lock(key).refund(alg, key.0, now, cost);
    }

    /// [`LocalStore::debit`] with the parameters of a plan tier.
    pub fn debit_as(&self, alg: &Algorithm, key: KeyHash, now: Timestamp, cost: u64) {
        self.lock(key).debit(alg, &self.idle_under, key.0, now, cost);
    }

    /// Undoes an admission of `cost` for `key` made at `now` (see [`crate::limit::refund`]).
    /// A key without an entry was decided against its shard's overflow state: refund that.
    pub fn refund(&self, key: KeyHash, now: Timestamp, cost: u64) {
        self.lock(key).refund(&self.alg, key.0, now, cost);
    }

    /// Charges `cost` more for `key` at `now` (see [`crate::limit::debit`]); a key without an
    /// entry and no room for one charges its shard's overflow state.
    pub fn debit(&self, key: KeyHash, now: Timestamp, cost: u64) {
        self.lock(key).debit(&self.alg, &self.idle_under, key.0, now, cost);
    }

    /// What deciding `cost` for `key` at `now` would answer, with `alg` (a plan tier's, or the
    /// store's), changing nothing: the key's state, else its shard's overflow state (what a key
    /// without an entry is decided against), else a fresh one. For the admin listener.
    pub fn peek(&self, alg: Option<&Algorithm>, key: KeyHash, now: Timestamp, cost: u64) -> Decision {
        let alg = alg.unwrap_or(&self.alg);
        let shard = self.lock(key);
        let state = shard.map.get(&key.0).or(shard.overflow.as_ref());
        crate::limit::decide(alg, state, now, cost).0
    }

    /// Forgets `key`'s state (an operator lets the client through); whether it held one. A key
    /// decided against its shard's overflow state has no state of its own to forget.
    pub fn reset(&self, key: KeyHash) -> bool {
        self.lock(key).map.remove(&key.0).is_some()
    }

    /// Entries held: keys whose state was not back to initial when last seen (some may be
    /// by now; see [`LocalStore::live`]).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(&s.0).map.len()).sum()
    }

    /// Keys that still hold state at `now` (for the metric): sweeps first.
    pub fn live(&self, now: Timestamp) -> usize {
        self.sweep(now);
        self.len()
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

    /// Drops every entry that is back to initial at `now`; returns how many were dropped.
    pub fn sweep(&self, now: Timestamp) -> usize {
        self.shards.iter().map(|s| lock(&s.0).sweep(&self.idle_under, now)).sum()
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
    fn decide(&mut self, alg: &Algorithm, idle_under: &[Algorithm], key: u128, now: Timestamp, cost: u64) -> Decision {
        if let Some(st) = self.map.get_mut(&key) {
            let d = decide_in_place(alg, st, now, cost);
            if st.is_idle(alg, now) {
                self.map.remove(&key);
            }
            return d;
        }
        self.sweep_for_new_key(idle_under, now);
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

    fn debit(&mut self, alg: &Algorithm, idle_under: &[Algorithm], key: u128, now: Timestamp, cost: u64) {
        if let Some(st) = self.map.get_mut(&key) {
            debit_in_place(alg, st, now, cost);
            return;
        }
        self.sweep_for_new_key(idle_under, now);
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

    /// Before a new key takes an entry: a sweep if the shard is full or has doubled since the
    /// last one, and something can be idle by now.
    fn sweep_for_new_key(&mut self, idle_under: &[Algorithm], now: Timestamp) {
        if self.map.len() >= self.cap.min(self.sweep_at) && now >= self.next_sweep {
            self.sweep(idle_under, now);
        }
    }

    /// Drops the entries idle under every algorithm of `idle_under`; schedules the next sweep
    /// at the earliest time one can be idle, and the next on a new key at twice what is left.
    /// A table left four times larger than its entries need is shrunk.
    fn sweep(&mut self, idle_under: &[Algorithm], now: Timestamp) -> usize {
        let before = self.map.len();
        let mut earliest = Timestamp::MAX;
        self.map.retain(|_, st| {
            let idle = idle_under.iter().all(|alg| st.is_idle(alg, now));
            if !idle {
                let at = idle_under.iter().map(|alg| st.idle_at(alg)).max().unwrap_or(Timestamp::ZERO);
                earliest = earliest.min(at);
            }
            !idle
        });
        let left = self.map.len();
        // Nothing left (`earliest` untouched): the next new keys are swept like any others,
        // after the gap; never "no sweep before the end of time".
        self.next_sweep = if left == 0 { now + SWEEP_GAP } else { earliest.max(now + SWEEP_GAP) };
        self.sweep_at = left.saturating_mul(2).max(SWEEP_MIN);
        if self.map.capacity() > left.saturating_add(SWEEP_MIN).saturating_mul(4) {
            self.map.shrink_to(left.saturating_mul(2));
        }
        before - left
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{nz, nzs};
    use crate::limit::{Clock, ManualClock};

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

    /// Key `n`, spread over the shards as digests are.
    fn spread(n: u64) -> KeyHash {
        KeyHash(u128::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
    }

    #[test]
    fn keys_back_to_initial_are_not_counted_live() {
        let s = LocalStore::new(tb(), 100_000);
        let clock = ManualClock::new(at(5_000));
        for n in 0..1_000 {
            assert!(s.decide(spread(n), clock.now(), 1).is_admitted());
        }
        assert_eq!(s.live(clock.now()), 1_000);
        clock.advance(Span::from_micros(999));
        assert_eq!(s.live(clock.now()), 1_000, "not yet refilled");
        // Every bucket has refilled: none of these keys holds state any more.
        clock.advance(Span::from_micros(1));
        assert_eq!(s.live(clock.now()), 0);
        assert_eq!(s.len(), 0);
    }

    #[test]
    fn a_churn_of_new_keys_holds_about_the_live_ones() {
        // One new key a millisecond, each holding state for a second: about 1,000 live keys
        // at any time, 200,000 keys in all, none ever decided twice.
        let alg = Algorithm::TokenBucket { interval: nzs(1_000_000), burst: nz(1), warmup: Span::ZERO };
        let s = LocalStore::new(alg, 1_000_000);
        let clock = ManualClock::new(at(0));
        let mut most = 0;
        for n in 0..200_000 {
            clock.advance(Span::from_micros(1_000));
            assert!(s.decide(spread(n), clock.now(), 1).is_admitted());
            if n % 500 == 0 {
                most = most.max(s.len());
            }
        }
        println!("churn: at most {most} entries for about 1,000 live keys");
        // At most twice the live keys per shard, plus the sweep threshold.
        assert!(most <= 2 * 1_100 + SHARDS * SWEEP_MIN, "{most} entries for about 1,000 live keys");
        assert!(s.len() >= 900, "keys that still hold state are kept: {}", s.len());
        clock.advance(Span::from_micros(1_000_000));
        assert_eq!(s.live(clock.now()), 0);
    }

    /// A sweep that leaves a shard empty (a quiet spell, or a scrape of the key gauge while
    /// every key is idle) must not end its sweeps: new keys after it are forgotten too, and
    /// the shard never fills up to share its overflow state between strangers.
    #[test]
    fn a_shard_emptied_by_a_sweep_keeps_forgetting_keys() {
        let s = LocalStore::new(tb(), 64 * 1_000);
        let clock = ManualClock::new(at(0));
        assert!(s.decide(spread(0), clock.now(), 1).is_admitted());
        clock.advance(Span::from_micros(10_000));
        assert_eq!(s.live(clock.now()), 0, "every shard swept empty");
        // Then a churn: a new key every 100 µs, each holding state for 1 ms.
        let mut most = 0;
        for n in 1..200_000 {
            clock.advance(Span::from_micros(100));
            assert!(s.decide(spread(n), clock.now(), 1).is_admitted(), "key {n} shares a full shard's overflow");
            most = most.max(s.len());
        }
        // About 10 keys live at a time: each shard holds at most its sweep threshold, plus what
        // arrives within a sweep gap (500 keys over all shards).
        assert!(most <= SHARDS * 2 * SWEEP_MIN + 1_000, "{most} entries for about 10 live keys");
    }

    #[test]
    fn a_table_emptied_by_a_sweep_gives_its_memory_back() {
        let s = LocalStore::new(tb(), 1_000_000);
        for n in 0..100_000 {
            s.decide(spread(n), at(0), 1);
        }
        let capacity = |s: &LocalStore| s.shards.iter().map(|sh| lock(&sh.0).map.capacity()).sum::<usize>();
        assert!(capacity(&s) >= 100_000);
        assert_eq!(s.live(at(1_000)), 0);
        assert!(capacity(&s) <= SHARDS * 4 * SWEEP_MIN, "{}", capacity(&s));
    }

    #[test]
    fn a_plan_store_keeps_a_state_until_idle_in_every_tier() {
        // Tier parameters: the same bucket refilling in 1 ms (the store's) or in 10 ms.
        let slow = Algorithm::TokenBucket { interval: nzs(10_000), burst: nz(1), warmup: Span::ZERO };
        let s = LocalStore::with_tiers(tb(), 1_000, [slow.clone()]);
        assert!(s.decide_as(&slow, key(2, 1), at(0), 1).is_admitted());
        assert_eq!(s.live(at(1_000)), 1, "idle for the store's parameters, not for its tier's");
        assert!(!s.decide_as(&slow, key(2, 1), at(5_000), 1).is_admitted());
        assert_eq!(s.live(at(10_000)), 0);
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
