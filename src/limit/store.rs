//! Where per-key state lives. Each configured limit owns one [`Store`], so a config reload can
//! keep the `Arc<Store>` of an unchanged limit. Invariant: every backend runs the same pure math
//! from [`super::algo`]; a backend only decides where the state is kept and how it is locked.
//!
//! An enum rather than a trait object: two backends (`Local`, `Redis`), static dispatch; only
//! the (much larger) Redis store is boxed, its hot path being a network round trip anyway.

pub mod local;
pub mod redis;

use std::time::Duration;

pub use local::LocalStore;
pub use redis::{RedisClient, RedisConfig, RedisStore};

use super::{Decision, KeyHash, Timestamp};

/// A store failure. The local store never fails; the Redis store fails only with
/// `on_error: deny` (the gate answers 503 with `Retry-After: retry_after`).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis store unavailable ({kind}): {message}")]
    Unavailable { kind: redis::FailureKind, retry_after: Duration, message: String },
    #[error("redis store misconfigured: {0}")]
    Config(String),
}

/// The state store of one limit.
#[derive(Debug)]
pub enum Store {
    /// In-process, sharded, bounded.
    Local(LocalStore),
    /// Shared by every instance through Redis (single node or Cluster).
    Redis(Box<RedisStore>),
}

impl Store {
    /// Decides one request of `cost` for `key` at `now`.
    ///
    /// # Errors
    /// [`StoreError`] only from a remote store; the local store never fails.
    pub async fn decide(&self, key: KeyHash, now: Timestamp, cost: u64) -> Result<Decision, StoreError> {
        match self {
            Store::Local(s) => Ok(s.decide(key, now, cost)),
            Store::Redis(s) => s.decide(key, now, cost).await,
        }
    }
}

/// Map keys that are already uniform digests ([`crate::limit::KeyHash`]): their low 64 bits
/// are the hash, with no rehashing. Shared by the local store and the Redis store's memory.
#[derive(Debug, Default)]
pub(crate) struct PassThrough(u64);

impl std::hash::Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not reached for u128 keys; a plain fold keeps it correct if it ever is.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
}

pub(crate) type DigestHasher = std::hash::BuildHasherDefault<PassThrough>;
