//! Where per-key state lives. Each configured limit owns one [`Store`], so a config reload can
//! keep the `Arc<Store>` of an unchanged limit. Invariant: every backend runs the same pure math
//! from [`super::algo`]; a backend only decides where the state is kept and how it is locked.
//!
//! An enum rather than a trait object: two backends (a `Redis` variant comes next), static
//! dispatch, no boxing on the hot path.

pub mod local;

pub use local::LocalStore;

use super::{Algorithm, Decision, KeyHash, Micros};

/// A store failure (none yet for the local store; the Redis store will add variants).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {}

/// The state store of one limit.
#[derive(Debug)]
pub enum Store {
    /// In-process, sharded, bounded.
    Local(LocalStore),
}

impl Store {
    /// Decides one request of `cost` for `key` at `now`.
    ///
    /// # Errors
    /// [`StoreError`] only from a remote store; the local store never fails.
    pub async fn decide(&self, key: KeyHash, now: Micros, cost: u64) -> Result<Decision, StoreError> {
        match self {
            Store::Local(s) => Ok(s.decide(key, now, cost)),
        }
    }

    /// Undoes an admission of `cost` for `key` made at `now` (see [`super::refund`]).
    ///
    /// # Errors
    /// [`StoreError`] only from a remote store.
    pub async fn refund(&self, key: KeyHash, now: Micros, cost: u64) -> Result<(), StoreError> {
        match self {
            Store::Local(s) => {
                s.refund(key, now, cost);
                Ok(())
            }
        }
    }

    pub fn algorithm(&self) -> &Algorithm {
        match self {
            Store::Local(s) => s.algorithm(),
        }
    }
}
