//! The worker threads of `tollgate run` (`server.workers`).
//!
//! Each worker is a thread with a single-threaded runtime of its own, nginx's shape: a
//! connection, its requests and the upstream connections it uses stay on one thread, with no
//! work stealing and no wake-up crossing threads. Each worker accepts on its own
//! `SO_REUSEPORT` socket of every listener; the proxy's state is shared. Per-worker state
//! (the upstream pools' shards) finds its worker here.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// How many workers the process runs (1 until [`set_count`]; tests and `bench` run one).
static COUNT: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    static INDEX: Cell<usize> = const { Cell::new(0) };
}

/// Called once at start, before the proxy is built: per-worker state (the upstream
/// pools' shards) is sized by it.
pub fn set_count(n: usize) {
    COUNT.store(n.max(1), Ordering::Relaxed);
}

pub fn count() -> usize {
    COUNT.load(Ordering::Relaxed)
}

/// Marks the calling thread as worker `i`.
pub fn set_index(i: usize) {
    INDEX.with(|c| c.set(i));
}

/// The calling thread's worker (0 outside the workers).
pub fn index() -> usize {
    INDEX.with(Cell::get)
}
