//! Rate-limit decisions: the algorithms as pure functions of (params, state, now, cost), the
//! clock, request keys and the stores that keep per-key state. Time is integer microseconds,
//! typed: a [`Timestamp`] is a point in time, a [`Span`] a length of time, and all arithmetic
//! on them saturates; a rejected request never consumes quota.
//!
//! # Layout
//! - [`algo`]: the five algorithms ([`Algorithm`], [`State`], [`decide`], [`refund`]), each an
//!   [`algo::Rule`] in its own file with its Lua script beside it.
//! - [`calendar`]: [`Calendar`] windows (hour, day, month in a time zone) for fixed windows.
//! - [`time`]: [`Timestamp`], [`Span`], [`NonZeroSpan`].
//! - [`clock`]: [`Clock`], [`SystemClock`], [`ManualClock`].
//! - [`key`]: [`KeySpec`] and the encoding of a key's material into a [`KeyHash`] (the
//!   material is read from a request by the `request_key` room).
//! - [`plan`]: [`plan::Plans`] (client → tier) and the tier parameters of `plan: true` limits.
//! - [`sketch`]: [`sketch::Sketch`], the keys a limit denied most recently (heavy hitters).
//! - [`store`]: [`Store`]: [`LocalStore`] (a sharded in-process map) or [`RedisStore`] (shared).

pub mod algo;
pub mod calendar;
pub mod clock;
pub mod key;
pub mod plan;
pub mod sketch;
pub mod store;
pub mod time;

pub use algo::{debit, decide, longest_wait, max_cost, refund, Algorithm, State};
pub use calendar::{Calendar, CalendarUnit};
pub use clock::{Clock, ManualClock, SystemClock};
pub use key::{Identity, KeyError, KeyHash, KeyPart, KeySpec};
pub use store::{LocalStore, RedisClient, RedisConfig, RedisStore, Store, StoreError};
pub use time::{NonZeroSpan, Span, Timestamp};

/// The outcome of one decision. A value, not an error: only a store failure is an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Admitted now. `remaining`: units still admissible now; `reset`: time until the quota is
    /// fully restored.
    Allow { remaining: u64, reset: Span },
    /// Admitted after waiting `wait` (leaky bucket). The slot is already taken.
    Delay { wait: Span, remaining: u64, reset: Span },
    /// Rejected, nothing consumed. The same request retried after `retry_after` with no other
    /// traffic in between IS admitted (this is the contract behind an honest Retry-After).
    Deny { retry_after: Span, reset: Span },
    /// Rejected, nothing consumed, and no wait helps: the cost exceeds [`max_cost`], what the
    /// limit can admit at once. Config validation keeps configured costs below that.
    Never { reset: Span },
}

impl Decision {
    /// True for `Allow` and `Delay` (the request goes through, possibly later).
    pub fn is_admitted(&self) -> bool {
        matches!(self, Decision::Allow { .. } | Decision::Delay { .. })
    }
}
