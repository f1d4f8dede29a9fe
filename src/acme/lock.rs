//! One instance orders a given certificate at a time: a lock in Redis (`SET NX PX`, released
//! by its holder only) when the config has `redis:`, else a lock file in the certificate's
//! storage folder (created exclusively). Both expire, so an instance that dies holding one
//! holds it up for [`TTL`] at most. An instance that finds the lock taken waits and then
//! reads the certificate the holder stored.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::limit::RedisClient;

/// How long a lock lasts if its holder never releases it (an order takes seconds to a
/// minute; the manager gives one up after [`super::ORDER_TIMEOUT`]).
pub const TTL: Duration = Duration::from_secs(600);

/// Where locks are taken.
#[derive(Clone)]
pub enum Locks {
    Redis(Arc<RedisClient>),
    Files,
}

/// A lock this instance holds; [`Locks::release`] gives it back.
pub enum Held {
    Redis { key: String, token: String },
    File { path: PathBuf, token: String },
}

impl Locks {
    /// Takes the lock of the certificate `id` (stored in `folder`) for `token` (this
    /// instance's), if no one holds it; `now` in unix seconds (a lock file's expiry).
    ///
    /// # Errors
    /// Redis did not answer, or the folder cannot be written.
    pub async fn take(&self, id: &str, folder: &Path, token: &str, now: i64) -> Result<Option<Held>, String> {
        match self {
            Locks::Redis(client) => {
                // A hash tag: the key lives on one node of a cluster.
                let key = format!("tollgate:acme:{{{id}}}:lock");
                let taken = client.set_nx(&key, token, TTL).await.map_err(|e| format!("redis: {e}"))?;
                Ok(taken.then(|| Held::Redis { key, token: token.to_owned() }))
            }
            Locks::Files => {
                let path = folder.join("order.lock");
                let token = token.to_owned();
                tokio::task::spawn_blocking(move || take_file(&path, &token, now))
                    .await
                    .map_err(|e| format!("lock file: {e}"))?
            }
        }
    }

    /// Gives `held` back (only if it is still this instance's).
    pub async fn release(&self, held: Held) {
        match (self, held) {
            (Locks::Redis(client), Held::Redis { key, token }) => {
                if let Err(e) = client.del_if(&key, &token).await {
                    tracing::warn!(error = %e, "cannot release an ACME lock in Redis; it expires by itself");
                }
            }
            (_, Held::File { path, token }) => {
                let _ = tokio::task::spawn_blocking(move || release_file(&path, &token)).await;
            }
            (Locks::Files, Held::Redis { .. }) => {}
        }
    }
}

/// The lock file's content: the holder's token and when the lock expires (unix seconds).
fn take_file(path: &Path, token: &str, now: i64) -> Result<Option<Held>, String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        super::storage::folder(dir)?;
    }
    let expires = now + i64::try_from(TTL.as_secs()).unwrap_or(600);
    for _ in 0..2 {
        match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path) {
            Ok(mut f) => {
                f.write_all(format!("{token} {expires}\n").as_bytes())
                    .map_err(|e| format!("{}: cannot write: {e}", path.display()))?;
                return Ok(Some(Held::File { path: path.to_owned(), token: token.to_owned() }));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let held = std::fs::read_to_string(path).unwrap_or_default();
                let until = held.split_whitespace().nth(1).and_then(|t| t.parse::<i64>().ok());
                // A lock past its time (its holder died), or one half written: taken over.
                if until.is_some_and(|u| u > now) {
                    return Ok(None);
                }
                if until.is_none() && modified_secs_ago(path).is_some_and(|s| s < 5) {
                    return Ok(None);
                }
                let _ = std::fs::remove_file(path);
            }
            Err(e) => return Err(format!("{}: cannot create: {e}", path.display())),
        }
    }
    Ok(None)
}

fn modified_secs_ago(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok()?.modified().ok()?.elapsed().ok().map(|d| d.as_secs())
}

fn release_file(path: &Path, token: &str) {
    let held = std::fs::read_to_string(path).unwrap_or_default();
    if held.split_whitespace().next() == Some(token) {
        let _ = std::fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_file_is_held_by_one_until_released_or_expired() {
        let dir = std::env::temp_dir().join(format!("tollgate-lock-{}-{:08x}", std::process::id(), fastrand::u32(..)));
        let path = dir.join("order.lock");
        let now = 1_800_000_000;
        let a = take_file(&path, "a", now).unwrap();
        assert!(a.is_some());
        assert!(take_file(&path, "b", now).unwrap().is_none(), "held by a");
        release_file(&path, "b");
        assert!(path.exists(), "b cannot release a's lock");
        release_file(&path, "a");
        assert!(take_file(&path, "b", now).unwrap().is_some());
        let later = now + i64::try_from(TTL.as_secs()).unwrap() + 1;
        assert!(take_file(&path, "c", later).unwrap().is_some(), "an expired lock is taken over");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
