//! Misses in flight: the first miss for a key goes to the upstream and holds a [`Flight`];
//! later misses for the same key wait on it (bounded by their caller) and look again once it
//! is stored or given up. Sharded by key: no lock is shared by every miss, and none is held
//! across an await.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use super::Cache;

const SHARDS: usize = 16;

/// The misses in flight of one shard of keys, each with the receiver its waiters clone.
type Shard = Mutex<HashMap<u128, watch::Receiver<()>>>;

pub(super) struct Flights {
    shards: Box<[Shard]>,
}

impl Flights {
    pub fn new() -> Flights {
        Flights { shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect() }
    }

    fn shard(&self, primary: u128) -> &Shard {
        &self.shards[(primary as usize) % SHARDS]
    }
}

/// The miss that went forward for a key; dropped when its copy is stored or given up, which
/// lets the waiting requests go.
pub struct Flight {
    cache: Cache,
    primary: u128,
    _done: watch::Sender<()>,
}

impl Drop for Flight {
    fn drop(&mut self) {
        let shard = self.cache.inner.flights.shard(self.primary);
        shard.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.primary);
        // `_done` drops after this: the waiters' `changed()` ends once the key is free.
    }
}

/// What a miss does: go forward (and hold the flight), or wait for the one that did.
pub enum Joined {
    Lead(Flight),
    Wait(watch::Receiver<()>),
}

impl Joined {
    /// Waits up to `bound` for the flight to land; `true` when it did (the copy, if any, is
    /// in the store), `false` on timeout.
    pub async fn landed(rx: &mut watch::Receiver<()>, bound: Duration) -> bool {
        // The sender never sends: `changed` ends with an error when it is dropped.
        tokio::time::timeout(bound, rx.changed()).await.is_ok()
    }
}

impl Cache {
    /// Joins the misses in flight for `primary`: the first one leads.
    pub fn join(&self, primary: u128) -> Joined {
        let mut map = self.inner.flights.shard(primary).lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(rx) = map.get(&primary) {
            return Joined::Wait(rx.clone());
        }
        let (tx, rx) = watch::channel(());
        map.insert(primary, rx);
        drop(map);
        Joined::Lead(Flight { cache: self.clone(), primary, _done: tx })
    }
}
