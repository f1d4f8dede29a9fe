//! The five algorithms as pure functions: `(params, state, now, cost) -> (Decision, state)`.
//! No I/O, no clock: both stores run this same math. Invariants: integer µs ([`Timestamp`]s for
//! points in time, [`Span`]s for lengths), saturating arithmetic (u128 for products), a denial
//! never changes the quota, and a state that is back to its initial value is reported as `None`
//! so stores can forget it (a full bucket = no entry).
//!
//! Each submodule opens with the exact state, formulas and rounding, written for the author of
//! the Redis Lua port, which must reproduce them bit for bit.
//!
//! Each algorithm is one [`Rule`] in its own file, with its Lua script beside it: its math and
//! every fact the rest of tollgate asks of it (its config name and fields, the longest wait,
//! its period, RateLimit-Policy numbers, Redis fallback share, script arguments, explain
//! words, admin parameters). [`Algorithm`]'s methods reach them through one exhaustive match,
//! [`with_rule!`]; ARCHITECTURE.md's "Adding a limit algorithm" lists what a new one touches.

pub mod fixed;
pub mod gcra;
pub mod leaky;
pub mod log;
pub mod sliding;

#[cfg(test)]
mod props;

/// Times and decisions written with plain µs, for the tests of `limit`.
#[cfg(test)]
pub(crate) mod expect {
    use std::num::NonZeroU64;

    use super::super::{Decision, NonZeroSpan, Span, Timestamp};

    pub fn nz(n: u64) -> NonZeroU64 {
        NonZeroU64::new(n).expect("non-zero")
    }

    pub fn nzs(us: u64) -> NonZeroSpan {
        NonZeroSpan::from_micros(us).expect("non-zero")
    }

    pub fn us(n: u64) -> Span {
        Span::from_micros(n)
    }

    pub fn at(n: u64) -> Timestamp {
        Timestamp::from_micros(n)
    }

    pub fn allow(remaining: u64, reset: u64) -> Decision {
        Decision::Allow { remaining, reset: Span::from_micros(reset) }
    }

    pub fn delay(wait: u64, remaining: u64, reset: u64) -> Decision {
        Decision::Delay { wait: Span::from_micros(wait), remaining, reset: Span::from_micros(reset) }
    }

    pub fn deny(retry_after: u64, reset: u64) -> Decision {
        Decision::Deny { retry_after: Span::from_micros(retry_after), reset: Span::from_micros(reset) }
    }
}

use std::fmt;
use std::num::NonZeroU64;

use super::{Calendar, Decision, NonZeroSpan, Span, Timestamp};

/// Algorithm with validated parameters (constructed from config; invalid ones cannot exist).
/// Each variant's math and facts are its [`Rule`], in its own file; [`with_rule!`] is the one
/// match that reaches them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// GCRA. `interval` = time per token (period / quantity, rounded down to whole µs, >= 1 µs),
    /// `burst` = capacity. A zero `warmup` disables warm-up.
    TokenBucket { interval: NonZeroSpan, burst: NonZeroU64, warmup: Span },
    /// Constant outflow of one unit per `interval`; wait at most `max_delay` (0 = strict meter).
    LeakyBucket { interval: NonZeroSpan, max_delay: Span },
    /// `limit` units per `window` aligned to the clock (window start = now - now % window), or
    /// with a `calendar` per calendar hour, day or month in a time zone (`window` is then the
    /// longest such window: the longest Retry-After and the RateLimit-Policy `w`).
    FixedWindow { window: NonZeroSpan, limit: NonZeroU64, calendar: Option<Calendar> },
    /// Counter approximation: prev * (window - elapsed) / window + cur.
    SlidingWindow { window: NonZeroSpan, limit: NonZeroU64 },
    /// Exact log of admitted (timestamp, cost) within the last `window`.
    SlidingLog { window: NonZeroSpan, limit: NonZeroU64 },
}

/// Per-key state of one algorithm. Small and `Clone`; the sliding log is boxed so that the
/// common states stay 32 bytes in the store's map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    TokenBucket(gcra::Gcra),
    LeakyBucket(leaky::Meter),
    FixedWindow(fixed::Window),
    SlidingWindow(sliding::Counter),
    SlidingLog(Box<log::Log>),
}

/// One algorithm: its math over its own per-key state, and what the rest of tollgate asks of
/// it. Implemented once per algorithm, in its file, on a copy of its parameters (the fields of
/// its [`Algorithm`] variant); every item is required, so a new algorithm that leaves one out
/// does not compile.
pub trait Rule: Sized + Into<Algorithm> {
    /// The config's name for it (`algorithm: token_bucket`).
    const NAME: &'static str;
    /// Its entry in [`Kind`].
    const KIND: Kind;
    /// The limit fields it reads besides `rate` (`burst`, `max_delay`, …): the config refuses
    /// such a field on an algorithm that does not list it.
    const FIELDS: &'static [&'static str];
    /// Its decisions may be a [`Decision::Delay`] (a wait the gate sleeps; replay counts them).
    const DELAYS: bool;
    /// It may be a plan limit's, whose parameters change with the client's tier under one key.
    const PLANS: bool;
    /// The Redis store may lease units of it to spend locally (`lease: N`).
    const LEASES: bool;
    /// Its Redis script: a Lua port of the same math, in the `.lua` file beside its own
    /// (`include_str!`); the store prepends its prelude. The script's opening comment says
    /// its `ARGV`: op, cost, then what [`Rule::script_args`] passes, then the deadline and
    /// the tests' optional `now`.
    const SCRIPT: &'static str;

    /// Its per-key state ([`State`] holds it through [`Slot`]).
    type State: Slot;

    /// Its parameters from what a limit's config writes, checked (with [`Rule::check_exact`]),
    /// or the field to blame and why.
    fn build(w: &Written<'_>) -> Result<Algorithm, Unfit>;
    /// Checks that it computes exactly in u64 µs (the local store): the spans it adds to `now`
    /// stay below [`EXACT_SPAN`], or every request would silently be admitted.
    fn check_exact(&self) -> Result<(), String>;
    /// Checks that its Redis script computes exactly in Lua's doubles: every intermediate
    /// stays below [`LUA_EXACT`], and spans added to `now` below [`LUA_SPAN`]
    /// (see [`lua_too_big`] for the message).
    fn check_script(&self) -> Result<(), String>;
    /// Passes its script's arguments after op and cost, in `ARGV` order: its parameters (spans
    /// in µs, counts in units), and what `call` adds that it reads.
    fn script_args(&self, call: &Call, arg: &mut impl FnMut(u64));

    /// The state after `n` requests of `cost` at one instant (0) from the initial one, written
    /// in closed form (a burst may be 10^18 long; see [`Rule::overrun`]).
    fn after_burst(&self, n: u64, cost: u64) -> Self::State;
    /// Its words in `tollgate explain`: what it admits for requests of `cost`, in `words`'
    /// units, and what the request after a burst gets (from [`Rule::overrun`]).
    fn describe(&self, cost: u64, words: &impl Words) -> String;
    /// Its parameters as the admin listener's limit table shows them, by name.
    fn params(&self) -> Vec<(&'static str, Param)>;

    /// The decision on request `n + 1` of a burst: `n` requests of `cost` at one instant,
    /// then one more, decided by the real algorithm on the state [`Rule::after_burst`] writes
    /// down. At one instant every algorithm admits while the quota lasts and then denies
    /// without changing its state, and each admission adds the same amount, so `k` admissions
    /// leave `k · cost` counted (a token bucket's `tat` moves by `cost · interval`, three
    /// times that while warming up).
    fn overrun(&self, n: u64, cost: u64) -> Decision {
        let mut st = self.after_burst(n, cost);
        self.decide(&mut st, Timestamp::ZERO, cost)
    }

    /// One decision (see the module docs of each algorithm for the exact math).
    fn decide(&self, st: &mut Self::State, now: Timestamp, cost: u64) -> Decision;
    /// Undoes an admission of `cost` made at `now` (never gives back more than it took).
    fn refund(&self, st: &mut Self::State, now: Timestamp, cost: u64);
    /// Charges `cost` (at least 1) more without a decision; a debt stays below [`MAX_DEBT`].
    fn debit(&self, st: &mut Self::State, now: Timestamp, cost: u64);
    /// True if at `now` the state is equivalent to the initial one (it may be forgotten).
    fn is_idle(&self, st: &Self::State, now: Timestamp) -> bool;
    /// Earliest time the state is idle, absent further traffic (for sweeps).
    fn idle_at(&self, st: &Self::State) -> Timestamp;

    /// Largest cost it can ever admit at once; a larger one is always [`Decision::Never`].
    fn max_cost(&self) -> u64;
    /// The longest `retry_after` a denial can carry for a cost it admits, absent a debit.
    fn longest_wait(&self) -> Span;
    /// How long it takes to forget a full quota: its window, a bucket's full refill, a leaky
    /// bucket's queue draining. An early retry's penalty is capped at it.
    fn period(&self) -> Span;
    /// `q` and `w` of its RateLimit-Policy item: the quota, and the seconds it is for (at
    /// least 1).
    fn policy(&self) -> (u64, u64);
    /// The parameters of the in-process fallback of a Redis limit that `instances` proxies
    /// share: rates and limits divided by `instances` (see [`share`]), so that they all
    /// falling back together admit about what Redis would have.
    fn fallback(&self, instances: NonZeroU64) -> Algorithm;
}

/// How `tollgate explain` writes what an algorithm says of itself ([`Rule::describe`]): the
/// algorithm chooses the sentence, explain the units.
pub trait Words {
    /// A duration in human units (`1.5s`).
    fn span(&self, d: Span) -> String;
    /// Requests a second at one every `interval`.
    fn per_second(&self, interval: NonZeroSpan) -> String;
    /// What a request's cost adds to a sentence: nothing for 1, else ` (each request costs 3)`.
    fn costs(&self, cost: u64) -> String;
    /// What a request with this decision gets: `gets 429 with Retry-After: 2`, `waits 100ms`.
    fn decision(&self, d: Decision) -> String;
}

/// One parameter of an algorithm, for the admin listener's limit table ([`Rule::params`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Param {
    Span(Span),
    Count(u64),
    Calendar(Option<Calendar>),
}

/// What one script call adds to an algorithm's parameters (each algorithm passes what it reads).
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// Units to lease (the store's `l` op; 0 otherwise).
    pub lease: u64,
    /// The store decides a plan limit's tier (the state records the parameters it was charged at).
    pub plan: bool,
    /// This instance's clock (a calendar window's boundaries around it).
    pub local: Timestamp,
}

/// The field of a limit to blame (`rate`, `burst`, …) and a sentence for the user.
pub type Unfit = (&'static str, String);

/// What a limit's config writes, for an algorithm to build its parameters from: the rate
/// (`quantity` per `period`) and the fields only some algorithms read ([`Rule::FIELDS`]; the
/// config has refused them on the others already).
pub struct Written<'a> {
    /// The rate as written, for messages.
    pub rate: &'a dyn fmt::Display,
    pub quantity: u64,
    /// The rate's period, in µs.
    pub period: u64,
    pub burst: Option<u64>,
    pub warmup: Option<Span>,
    pub max_delay: Option<Span>,
    /// Calendar windows in a zone (the config checked the rate is per hour, day or month).
    pub calendar: Option<Calendar>,
}

impl Written<'_> {
    /// Time per unit: the period over the quantity, rounded down to whole µs, at least 1 µs.
    pub fn interval(&self) -> Result<NonZeroSpan, Unfit> {
        NonZeroSpan::from_micros(self.period.checked_div(self.quantity).unwrap_or(0))
            .ok_or_else(|| ("rate", format!("{} is faster than one per microsecond; use a lower rate", self.rate)))
    }

    /// A window: the calendar's longest, or the period.
    pub fn window(&self) -> Result<NonZeroSpan, Unfit> {
        match &self.calendar {
            Some(c) => Ok(c.longest()),
            None => NonZeroSpan::from_micros(self.period)
                .ok_or_else(|| ("rate", "the window must be at least 1us".to_owned())),
        }
    }

    /// The quantity, as a window's limit.
    pub fn limit(&self) -> Result<NonZeroU64, Unfit> {
        NonZeroU64::new(self.quantity).ok_or_else(|| ("rate", "the limit must be at least 1".to_owned()))
    }
}

/// The algorithms add spans to `now` in u64 µs and saturate rather than overflow; a limit
/// whose spans could saturate would silently admit everything. Spans must stay below this,
/// which leaves `now` (µs since 1970) room until the year 146,000.
pub const EXACT_SPAN: u128 = 1 << 63;

/// Every value a Redis script computes with must stay below this: Lua numbers are IEEE doubles.
pub const LUA_EXACT: u64 = 1 << 53;

/// Durations a script adds to `now` must stay below this, leaving room for `now` (µs since
/// the epoch stays below 2^52 until the year 2112).
pub const LUA_SPAN: u128 = 1 << 52;

/// [`Rule::check_exact`] of the window algorithms: `start + 2·window` (the roll's next
/// window) stays below [`EXACT_SPAN`].
pub fn window_exact(window: NonZeroSpan) -> Result<(), String> {
    if 2 * u128::from(window.as_micros()) >= EXACT_SPAN {
        return Err("the window is too long to compute exactly (2 × window must stay below 2^63 µs)".to_owned());
    }
    Ok(())
}

/// [`Rule::params`] of the window algorithms: `window` and `limit`.
pub fn window_params(window: NonZeroSpan, limit: NonZeroU64) -> Vec<(&'static str, Param)> {
    vec![("window", Param::Span(window.get())), ("limit", Param::Count(limit.get()))]
}

/// `a × b`, exact.
pub fn product(a: u64, b: u64) -> u128 {
    u128::from(a) * u128::from(b)
}

/// The refusal of [`Rule::check_script`]: `what` bound is exceeded.
pub fn lua_too_big(what: &str) -> Result<(), String> {
    Err(format!(
        "with `store: redis` {what} (Redis scripts compute in doubles, exact only below 2^53); \
         use smaller parameters or `store: local`"
    ))
}

/// `n / instances`, at least 1: one instance's share of a count.
pub fn share(n: NonZeroU64, instances: NonZeroU64) -> NonZeroU64 {
    NonZeroU64::new(n.get() / instances.get()).unwrap_or(NonZeroU64::MIN)
}

/// A state type of one algorithm, and its variant of [`State`] (see [`slot!`]).
pub trait Slot: Default + Clone {
    fn of(st: &State) -> Option<&Self>;
    fn of_mut(st: &mut State) -> Option<&mut Self>;
    /// The state of this type in `st`, which is first reset to the initial one if it has
    /// another algorithm's shape (a plan's client that moved to a tier of another algorithm).
    fn fit(st: &mut State) -> &mut Self;
    fn into_state(self) -> State;
}

/// `slot!(Variant => Type)` (or `=> box Type` for a boxed variant): the [`Slot`] of `Type`.
macro_rules! slot {
    ($variant:ident => box $ty:ty) => {
        $crate::limit::algo::slot!(@ $variant, $ty, Box::new);
    };
    ($variant:ident => $ty:ty) => {
        $crate::limit::algo::slot!(@ $variant, $ty, std::convert::identity);
    };
    (@ $variant:ident, $ty:ty, $wrap:expr) => {
        impl $crate::limit::algo::Slot for $ty {
            fn of(st: &$crate::limit::algo::State) -> Option<&Self> {
                if let $crate::limit::algo::State::$variant(s) = st {
                    Some(s)
                } else {
                    None
                }
            }
            fn of_mut(st: &mut $crate::limit::algo::State) -> Option<&mut Self> {
                if let $crate::limit::algo::State::$variant(s) = st {
                    Some(s)
                } else {
                    None
                }
            }
            fn fit(st: &mut $crate::limit::algo::State) -> &mut Self {
                loop {
                    if let $crate::limit::algo::State::$variant(s) = st {
                        return s;
                    }
                    *st = $crate::limit::algo::State::$variant(Default::default());
                }
            }
            fn into_state(self) -> $crate::limit::algo::State {
                $crate::limit::algo::State::$variant($wrap(self))
            }
        }
    };
}
pub(crate) use slot;

/// The one match over the algorithms: runs `$body` with `$r` bound to the [`Rule`] of `$alg`
/// (a `&Algorithm`), a copy of its parameters. Each arm compiles `$body` for its own rule, so
/// every call is static. A new algorithm gets its arm here, and nowhere else.
macro_rules! with_rule {
    ($alg:expr, $r:ident => $body:expr) => {
        match $alg {
            Algorithm::TokenBucket { interval, burst, warmup } => {
                let $r = gcra::TokenBucket { interval: *interval, burst: *burst, warmup: *warmup };
                $body
            }
            Algorithm::LeakyBucket { interval, max_delay } => {
                let $r = leaky::LeakyBucket { interval: *interval, max_delay: *max_delay };
                $body
            }
            Algorithm::FixedWindow { window, limit, calendar } => {
                let $r = fixed::FixedWindow { window: *window, limit: *limit, calendar: calendar.as_ref() };
                $body
            }
            Algorithm::SlidingWindow { window, limit } => {
                let $r = sliding::SlidingWindow { window: *window, limit: *limit };
                $body
            }
            Algorithm::SlidingLog { window, limit } => {
                let $r = log::SlidingLog { window: *window, limit: *limit };
                $body
            }
        }
    };
}

/// `kinds! { Variant => rule type, … }`: [`Kind`], the algorithms as the config names them,
/// each listed once.
macro_rules! kinds {
    ($($kind:ident => $rule:ty,)+) => {
        /// An algorithm without its parameters: the config's `algorithm:` value.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum Kind {
            $($kind,)+
        }

        impl Kind {
            /// Every algorithm, in the order the config's messages list them.
            pub const ALL: &'static [Kind] = &[$(Kind::$kind,)+];

            /// The config's name ([`Rule::NAME`]).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Kind::$kind => <$rule as Rule>::NAME,)+
                }
            }

            /// The limit fields it reads besides `rate` ([`Rule::FIELDS`]).
            pub const fn fields(self) -> &'static [&'static str] {
                match self {
                    $(Kind::$kind => <$rule as Rule>::FIELDS,)+
                }
            }

            /// Its Redis script, without the store's prelude ([`Rule::SCRIPT`]).
            pub const fn script(self) -> &'static str {
                match self {
                    $(Kind::$kind => <$rule as Rule>::SCRIPT,)+
                }
            }

            /// Its parameters from a limit's config ([`Rule::build`]).
            ///
            /// # Errors
            /// The field to blame and why.
            pub fn build(self, w: &Written<'_>) -> Result<Algorithm, Unfit> {
                match self {
                    $(Kind::$kind => <$rule as Rule>::build(w),)+
                }
            }
        }
    };
}

kinds! {
    TokenBucket => gcra::TokenBucket,
    LeakyBucket => leaky::LeakyBucket,
    FixedWindow => fixed::FixedWindow<'static>,
    SlidingWindow => sliding::SlidingWindow,
    SlidingLog => log::SlidingLog,
}

impl Kind {
    /// The names of the algorithms that read `field`, for "`field` applies to … only".
    pub fn reading(field: &str) -> String {
        let names: Vec<&str> = Kind::ALL.iter().filter(|k| k.fields().contains(&field)).map(|k| k.name()).collect();
        names.join(" or ")
    }
}

impl Algorithm {
    /// Which algorithm this is.
    pub fn kind(&self) -> Kind {
        fn of<R: Rule>(_: &R) -> Kind {
            R::KIND
        }
        with_rule!(self, r => of(&r))
    }

    /// The config's name: `token_bucket`, `leaky_bucket`, …
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// Its words in `tollgate explain` for requests of `cost` ([`Rule::describe`]).
    pub fn describe(&self, cost: u64, words: &impl Words) -> String {
        with_rule!(self, r => r.describe(cost, words))
    }

    /// Its parameters, by name, for the admin listener's limit table ([`Rule::params`]).
    pub fn params(&self) -> Vec<(&'static str, Param)> {
        with_rule!(self, r => r.params())
    }

    /// The decision on request `n + 1` of a burst of `n` requests of `cost` ([`Rule::overrun`]).
    pub fn overrun(&self, n: u64, cost: u64) -> Decision {
        with_rule!(self, r => r.overrun(n, cost))
    }

    /// Its Redis script, without the store's prelude.
    pub fn script(&self) -> &'static str {
        self.kind().script()
    }

    /// Passes its script's arguments after op and cost ([`Rule::script_args`]).
    pub fn script_args(&self, call: &Call, arg: &mut impl FnMut(u64)) {
        with_rule!(self, r => r.script_args(call, arg));
    }

    /// Checks that it computes exactly in u64 µs ([`Rule::check_exact`]).
    ///
    /// # Errors
    /// A sentence naming the bound exceeded.
    pub fn check_exact(&self) -> Result<(), String> {
        with_rule!(self, r => r.check_exact())
    }

    /// Checks that its Redis script computes exactly in doubles ([`Rule::check_script`]).
    ///
    /// # Errors
    /// A sentence naming the bound exceeded.
    pub fn check_script(&self) -> Result<(), String> {
        with_rule!(self, r => r.check_script())
    }

    /// Largest cost this algorithm can ever admit at once (config validation: cost <= this).
    pub fn max_cost(&self) -> u64 {
        with_rule!(self, r => r.max_cost())
    }

    /// The longest `retry_after` a denial can carry for a cost it admits (see [`longest_wait`]).
    pub fn longest_wait(&self) -> Span {
        with_rule!(self, r => r.longest_wait())
    }

    /// How long it takes to forget a full quota (see [`Rule::period`]).
    pub fn period(&self) -> Span {
        with_rule!(self, r => r.period())
    }

    /// `q` and `w` of its RateLimit-Policy item (see [`Rule::policy`]).
    pub fn policy(&self) -> (u64, u64) {
        with_rule!(self, r => r.policy())
    }

    /// The parameters of its local fallback when `instances` proxies share it through Redis.
    pub fn fallback(&self, instances: NonZeroU64) -> Algorithm {
        with_rule!(self, r => r.fallback(instances))
    }

    /// Its decisions may be a [`Decision::Delay`].
    pub fn delays(&self) -> bool {
        fn of<R: Rule>(_: &R) -> bool {
            R::DELAYS
        }
        with_rule!(self, r => of(&r))
    }

    /// It may be a plan limit's.
    pub fn plans(&self) -> bool {
        fn of<R: Rule>(_: &R) -> bool {
            R::PLANS
        }
        with_rule!(self, r => of(&r))
    }

    /// The Redis store may lease units of it.
    pub fn leases(&self) -> bool {
        fn of<R: Rule>(_: &R) -> bool {
            R::LEASES
        }
        with_rule!(self, r => of(&r))
    }
}

/// `st`'s state if it has `R`'s shape.
fn held<'s, R: Rule>(_: &R, st: &'s State) -> Option<&'s R::State> {
    R::State::of(st)
}

impl State {
    /// The initial ("never seen") state of `alg`.
    pub fn initial(alg: &Algorithm) -> State {
        fn of<R: Rule>(_: &R) -> State {
            R::State::default().into_state()
        }
        with_rule!(alg, r => of(&r))
    }

    /// True if this state has the shape `alg` expects.
    fn fits(&self, alg: &Algorithm) -> bool {
        with_rule!(alg, r => held(&r, self).is_some())
    }

    /// True if at `now` this state is equivalent to the initial one (it may be forgotten). A
    /// state of another algorithm's shape is treated as initial everywhere.
    pub fn is_idle(&self, alg: &Algorithm, now: Timestamp) -> bool {
        with_rule!(alg, r => held(&r, self).is_none_or(|s| r.is_idle(s, now)))
    }

    /// Earliest time at which this state is idle, absent further traffic (for sweeps).
    pub fn idle_at(&self, alg: &Algorithm) -> Timestamp {
        with_rule!(alg, r => held(&r, self).map_or(Timestamp::ZERO, |s| r.idle_at(s)))
    }
}

/// Pure: no I/O, no clock. `state = None` means "never seen / back to initial".
/// Returns the decision and the new state (None = back to initial value, may be evicted).
pub fn decide(alg: &Algorithm, state: Option<&State>, now: Timestamp, cost: u64) -> (Decision, Option<State>) {
    let mut st = match state {
        Some(s) if s.fits(alg) => s.clone(),
        _ => State::initial(alg),
    };
    let d = decide_in_place(alg, &mut st, now, cost);
    let next = (!st.is_idle(alg, now)).then_some(st);
    (d, next)
}

/// Undo an admission of `cost` made at or before `now` (used when a later limit of the same
/// request denies: "a rejected request consumes no quota anywhere" — the gate uses refunds).
/// Exact when called at the same `now` as the admission; later, it never refunds more than that.
pub fn refund(alg: &Algorithm, state: Option<&State>, now: Timestamp, cost: u64) -> Option<State> {
    let mut st = match state {
        Some(s) if s.fits(alg) => s.clone(),
        // Nothing recorded: nothing to give back.
        _ => return None,
    };
    refund_in_place(alg, &mut st, now, cost);
    (!st.is_idle(alg, now)).then_some(st)
}

/// Largest cost this algorithm can ever admit at once (config validation: cost <= this).
/// A larger cost is always [`Decision::Never`].
pub fn max_cost(alg: &Algorithm) -> u64 {
    alg.max_cost()
}

/// The longest `retry_after` a denial of `alg` can carry for a cost it admits (at most
/// [`max_cost`]), absent a debit: what a client may have to wait, which can be longer than the
/// limit's period. Token bucket: `burst × interval`, three times that with a warm-up (a cold
/// unit is charged up to `3 × interval`). Leaky bucket: the largest cost's slots,
/// `interval × (max_delay / interval + 1)`. Fixed window and log: one window. Sliding window:
/// two windows less 1 µs (a full window's count weighs on the next one, which the request may
/// have to wait for well into), rounded here to two.
pub fn longest_wait(alg: &Algorithm) -> Span {
    alg.longest_wait()
}

/// [`decide`] on a mutable state, without cloning (the store's hot path). A state of another
/// algorithm's shape is first reset to `alg`'s initial state.
pub fn decide_in_place(alg: &Algorithm, st: &mut State, now: Timestamp, cost: u64) -> Decision {
    with_rule!(alg, r => r.decide(Slot::fit(st), now, cost))
}

/// [`refund`] on a mutable state, without cloning. A mismatched state is left alone.
pub fn refund_in_place(alg: &Algorithm, st: &mut State, now: Timestamp, cost: u64) {
    fn back<R: Rule>(r: &R, st: &mut State, now: Timestamp, cost: u64) {
        if let Some(s) = R::State::of_mut(st) {
            r.refund(s, now, cost);
        }
    }
    with_rule!(alg, r => back(&r, st, now, cost));
}

/// Charges `cost` more units at `now` without a decision: the part of a response's cost above
/// its estimate. It may take the quota below zero (a token bucket's `tat` beyond `now + burst
/// × interval`, a window's count beyond its limit); later requests then wait until it is
/// repaid, and their `retry_after` includes that. A debt is capped at [`MAX_DEBT`] ahead of
/// `now` (so the Redis scripts stay exact in doubles).
pub fn debit(alg: &Algorithm, state: Option<&State>, now: Timestamp, cost: u64) -> Option<State> {
    let mut st = match state {
        Some(s) if s.fits(alg) => s.clone(),
        _ => State::initial(alg),
    };
    debit_in_place(alg, &mut st, now, cost);
    (!st.is_idle(alg, now)).then_some(st)
}

/// How far ahead of `now` a debit can push a bucket's `tat` (2^51 µs, about 71 years), and the
/// most a window can count (2^51 units).
pub const MAX_DEBT: u64 = 1 << 51;

/// `now + MAX_DEBT`: the furthest a debit may push a time.
pub(crate) fn debt_cap(now: Timestamp) -> Timestamp {
    now + Span::from_micros(MAX_DEBT)
}

/// [`debit`] on a mutable state. A state of another algorithm's shape is first reset.
pub fn debit_in_place(alg: &Algorithm, st: &mut State, now: Timestamp, cost: u64) {
    if cost == 0 {
        return;
    }
    with_rule!(alg, r => r.debit(Slot::fit(st), now, cost));
}

/// The decision for a cost larger than [`max_cost`]: never admissible. `reset` is the state's
/// own, as a denial at `now` would report it.
pub(crate) fn never(reset: Span) -> Decision {
    Decision::Never { reset }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{at, nz, nzs, us};

    /// What `rate: 10/s` with no other field writes.
    fn plain() -> Written<'static> {
        Written {
            rate: &"10/s",
            quantity: 10,
            period: 1_000_000,
            burst: None,
            warmup: None,
            max_delay: None,
            calendar: None,
        }
    }

    #[test]
    fn every_kind_is_named_as_the_config_reads_it_and_builds_its_own_algorithm() {
        for &k in Kind::ALL {
            let read: Kind = serde_yaml::from_str(k.name()).expect("a name the config reads");
            assert_eq!(read, k);
            let alg = k.build(&plain()).expect("10/s builds");
            assert_eq!(alg.kind(), k, "{alg:?}");
            assert_eq!(alg.name(), k.name());
        }
        let names: std::collections::HashSet<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(names.len(), Kind::ALL.len());
    }

    /// The request-by-request simulation [`Rule::after_burst`] replaces.
    fn simulated(alg: &Algorithm, n: u64, cost: u64) -> Decision {
        let mut state: Option<State> = None;
        for _ in 0..n {
            state = decide(alg, state.as_ref(), Timestamp::ZERO, cost).1;
        }
        decide(alg, state.as_ref(), Timestamp::ZERO, cost).0
    }

    #[test]
    fn closed_form_decides_as_the_simulation_does() {
        let mut algs = Vec::new();
        for (a, b) in [(1, 1), (3, 7), (10, 20), (333_333, 5), (7, 100)] {
            for warmup in [0, 1, 5_000_000].map(Span::from_micros) {
                algs.push(Algorithm::TokenBucket { interval: nzs(a), burst: nz(b), warmup });
            }
            for max_delay in [0, a, 3 * a + 1, 50 * a].map(Span::from_micros) {
                algs.push(Algorithm::LeakyBucket { interval: nzs(a), max_delay });
            }
            algs.push(Algorithm::FixedWindow { window: nzs(a * 1000), limit: nz(b), calendar: None });
            algs.push(Algorithm::SlidingWindow { window: nzs(a * 1000), limit: nz(b) });
            algs.push(Algorithm::SlidingLog { window: nzs(a * 1000), limit: nz(b) });
        }
        for alg in &algs {
            for cost in 1..=max_cost(alg).min(8) {
                for n in 0..40 {
                    assert_eq!(alg.overrun(n, cost), simulated(alg, n, cost), "{alg:?} n={n} cost={cost}");
                }
            }
        }
    }

    /// ARCHITECTURE.md's "Adding a limit algorithm" names files that exist (`<name>`: each
    /// algorithm's config name) and every item a [`Rule`] must give, so it cannot fall behind
    /// the trait.
    #[test]
    fn the_recipe_for_a_new_algorithm_names_existing_files_and_every_rule_item() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
        let recipe = text.split("### Adding a limit algorithm").nth(1).expect("the recipe");
        let recipe = recipe.split("\n## ").next().unwrap_or(recipe);
        let quoted: Vec<&str> = recipe.split('`').skip(1).step_by(2).collect();
        let files: Vec<&str> = quoted
            .iter()
            .copied()
            .filter(|q| {
                q.starts_with("src/") || q.starts_with("tests/") || q.starts_with("docs/") || q.starts_with("fuzz/")
            })
            .collect();
        assert!(files.len() >= 10, "{files:?}");
        for f in files {
            if f.contains("<name>") {
                for k in Kind::ALL {
                    let path = f.replace("<name>", k.name());
                    assert!(root.join(&path).is_file(), "{path} (from {f})");
                }
            } else if f.contains("<module>") {
                let dir = root.join(f).parent().map(std::path::Path::to_path_buf).expect("a folder");
                assert!(dir.is_dir(), "{f}");
            } else {
                assert!(root.join(f).is_file(), "{f}");
            }
        }
        // Every item the trait requires (a declaration without a body), by name.
        let source = std::fs::read_to_string(root.join("src/limit/algo.rs")).expect("algo.rs");
        let start = source.find("pub trait Rule").expect("the trait");
        let body = &source[start..start + source[start..].find("\n}\n").expect("its end")];
        let mut required = Vec::new();
        for line in body.lines().map(str::trim).filter(|l| l.ends_with(';')) {
            let name = ["const ", "type ", "fn "].iter().find_map(|k| line.strip_prefix(k));
            if let Some(rest) = name {
                let end = rest.find([':', '(', '<', ' ']).unwrap_or(rest.len());
                required.push(&rest[..end]);
            }
        }
        assert!(required.len() >= 20, "{required:?}");
        for item in required {
            assert!(quoted.contains(&item), "the recipe does not name `{item}`");
        }
        for mac in ["with_rule!", "kinds!", "slot!(Variant => State)"] {
            assert!(recipe.contains(mac), "{mac}");
        }
    }

    #[test]
    fn state_stays_small() {
        assert!(std::mem::size_of::<State>() <= 32);
    }

    #[test]
    fn pure_decide_reports_initial_as_none() {
        let alg = Algorithm::TokenBucket { interval: nzs(10), burst: nz(2), warmup: Span::ZERO };
        let (d, s) = decide(&alg, None, at(100), 1);
        assert_eq!(d, Decision::Allow { remaining: 1, reset: us(10) });
        let s = s.expect("state after admission");
        // Once the bucket has refilled the state is initial again.
        let (_, again) = decide(&alg, Some(&s), at(110), 0);
        assert_eq!(again, None);
        assert_eq!(refund(&alg, Some(&s), at(100), 1), None);
    }

    #[test]
    fn mismatched_state_is_treated_as_initial() {
        let tb = Algorithm::TokenBucket { interval: nzs(10), burst: nz(1), warmup: Span::ZERO };
        let fw = Algorithm::FixedWindow { window: nzs(100), limit: nz(1), calendar: None };
        let (_, s) = decide(&fw, None, at(5), 1);
        let (d, _) = decide(&tb, s.as_ref(), at(5), 1);
        assert!(d.is_admitted());
    }

    #[test]
    fn cost_above_max_is_never_admitted() {
        for alg in [
            Algorithm::TokenBucket { interval: nzs(10), burst: nz(3), warmup: us(50) },
            Algorithm::LeakyBucket { interval: nzs(10), max_delay: us(25) },
            Algorithm::FixedWindow { window: nzs(10), limit: nz(3), calendar: None },
            Algorithm::SlidingWindow { window: nzs(10), limit: nz(3) },
            Algorithm::SlidingLog { window: nzs(10), limit: nz(3) },
        ] {
            let m = max_cost(&alg);
            assert!(decide(&alg, None, at(1000), m).0.is_admitted(), "{alg:?}");
            let (d, s) = decide(&alg, None, at(1000), m + 1);
            assert!(matches!(d, Decision::Never { .. }), "{alg:?}: {d:?}");
            assert_eq!(s, None);
        }
    }
}
