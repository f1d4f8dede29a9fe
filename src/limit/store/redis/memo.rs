//! A small bounded map of per-key entries that expire: the local memory of Redis denials and
//! the local leases. 16 shards of `Mutex<HashMap>`, no global lock. When a shard is full it
//! first drops expired entries; if still full the new entry is not kept (the caller degrades to
//! asking Redis, which is always correct), so memory stays bounded by `max_keys` entries.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::limit::store::DigestHasher;
use crate::limit::{KeyHash, Timestamp};

const SHARDS: usize = 16;

type Map<V> = HashMap<u128, (Timestamp, V), DigestHasher>;

pub struct Memo<V> {
    shards: Box<[Mutex<Map<V>>]>,
    cap: usize,
}

impl<V> std::fmt::Debug for Memo<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memo").field("cap", &self.cap).finish_non_exhaustive()
    }
}

impl<V> Memo<V> {
    /// At most `max_keys` entries in all (0 = remember nothing).
    pub fn new(max_keys: usize) -> Memo<V> {
        Memo { shards: (0..SHARDS).map(|_| Mutex::new(Map::default())).collect(), cap: max_keys / SHARDS }
    }

    fn shard(&self, key: KeyHash) -> MutexGuard<'_, Map<V>> {
        // Top bits pick the shard; the map hashes with the low bits.
        let i = (key.0 >> 124) as usize % SHARDS;
        // A panic while holding the lock cannot leave a half-written entry: use it anyway.
        self.shards[i].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the live entry of `key` at `now` (with its expiry time); `f` returning false
    /// removes it.
    pub fn with<R>(&self, key: KeyHash, now: Timestamp, f: impl FnOnce(&mut V, Timestamp) -> (bool, R)) -> Option<R> {
        let mut map = self.shard(key);
        let entry = map.get_mut(&key.0)?;
        if entry.0 <= now {
            map.remove(&key.0);
            return None;
        }
        let (keep, r) = f(&mut entry.1, entry.0);
        if !keep {
            map.remove(&key.0);
        }
        Some(r)
    }

    /// Remembers `v` for `key` until `until`; returns false if there was no room.
    pub fn insert(&self, key: KeyHash, now: Timestamp, until: Timestamp, v: V) -> bool {
        if until <= now {
            return false;
        }
        let mut map = self.shard(key);
        if !self.make_room(&mut map, key, now) {
            return false;
        }
        map.insert(key.0, (until, v));
        true
    }

    /// Runs `f` on the live entry of `key` and its expiry, first making one with `new`
    /// (expiring at `until`) when there is none; like [`Memo::with`], `f` says whether to keep
    /// it. `None` when there was no room.
    pub fn upsert<R>(
        &self,
        key: KeyHash,
        now: Timestamp,
        until: Timestamp,
        new: impl FnOnce() -> V,
        f: impl FnOnce(&mut V, &mut Timestamp) -> (bool, R),
    ) -> Option<R> {
        let mut map = self.shard(key);
        if map.get(&key.0).is_none_or(|e| e.0 <= now) {
            if until <= now || !self.make_room(&mut map, key, now) {
                return None;
            }
            map.insert(key.0, (until, new()));
        }
        let entry = map.get_mut(&key.0)?;
        let (keep, r) = f(&mut entry.1, &mut entry.0);
        if !keep {
            map.remove(&key.0);
        }
        Some(r)
    }

    /// Whether `key` fits in its shard, dropping expired entries when it is full.
    fn make_room(&self, map: &mut Map<V>, key: KeyHash, now: Timestamp) -> bool {
        if map.len() >= self.cap && !map.contains_key(&key.0) {
            map.retain(|_, e| e.0 > now);
        }
        map.len() < self.cap || map.contains_key(&key.0)
    }

    pub fn remove(&self, key: KeyHash) {
        self.shard(key).remove(&key.0);
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(us: u64) -> Timestamp {
        Timestamp::from_micros(us)
    }

    #[test]
    fn entries_expire_and_the_bound_holds() {
        let m: Memo<u32> = Memo::new(SHARDS * 2);
        let k = |i: u128| KeyHash(i << 124 | i);
        assert!(m.insert(k(1), at(0), at(100), 7));
        assert_eq!(m.with(k(1), at(50), |v, _| (true, *v)), Some(7));
        assert_eq!(m.with(k(1), at(100), |v, _| (true, *v)), None, "expired at `until`");
        // Same shard (top bits 0): room for two.
        assert!(m.insert(KeyHash(1), at(0), at(100), 1));
        assert!(m.insert(KeyHash(2), at(0), at(100), 2));
        assert!(!m.insert(KeyHash(3), at(0), at(100), 3), "full");
        assert!(m.insert(KeyHash(3), at(100), at(200), 3), "expired entries make room");
        assert!(m.len() <= SHARDS * 2);
        assert_eq!(m.with(KeyHash(3), at(150), |v, _| (false, *v)), Some(3));
        assert_eq!(m.with(KeyHash(3), at(150), |v, _| (true, *v)), None, "removed by f");
    }

    #[test]
    fn upsert_makes_updates_and_respects_the_bound() {
        let m: Memo<u32> = Memo::new(SHARDS);
        let k = KeyHash(9);
        assert_eq!(m.upsert(k, at(0), at(100), || 1, |v, _| (true, *v)), Some(1), "made");
        assert_eq!(
            m.upsert(
                k,
                at(10),
                at(100),
                || 5,
                |v, until| (true, {
                    *v += 1;
                    *until = at(300);
                    *v
                })
            ),
            Some(2),
            "updated"
        );
        assert_eq!(m.with(k, at(200), |v, _| (true, *v)), Some(2), "expiry moved to 300");
        assert_eq!(m.upsert(k, at(300), at(400), || 7, |v, _| (true, *v)), Some(7), "expired: made anew");
        assert_eq!(m.upsert(KeyHash(10), at(300), at(400), || 1, |v, _| (true, *v)), None, "shard full");
        assert_eq!(m.upsert(k, at(300), at(400), || 7, |v, _| (false, *v)), Some(7));
        assert_eq!(
            m.upsert(KeyHash(10), at(300), at(400), || 1, |v, _| (true, *v)),
            Some(1),
            "removed by f: room again"
        );
        assert_eq!(m.upsert(KeyHash(11), at(300), at(300), || 1, |v, _| (true, *v)), None, "already expired");
    }
}
