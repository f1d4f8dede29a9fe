//! The algorithms' Lua scripts (each beside its algorithm, `src/limit/algo/*.lua`, its
//! arguments passed by [`Algorithm::script_args`]) behind this store's prelude, their calls and
//! reply decoding, and the precision bound: Lua numbers are doubles, so every intermediate of a
//! script must stay below 2^53 for the port to agree bit for bit with `crate::limit::algo`.

use redis::{Cmd, Script};

use crate::limit::algo::Call;
use crate::limit::{Algorithm, Decision, Span, Timestamp};

/// Prepended to every algorithm's script (a Redis script cannot include another).
const PRELUDE: &str = include_str!("prelude.lua");

/// What one script call does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Decide,
    /// Decide without writing: what a decision would answer now (the admin listener's read).
    Peek,
    /// Token bucket only: take at least `cost`, at most this many units.
    Lease(u64),
    Refund,
    /// Charge `cost` more without a decision (a response cost above its estimate).
    Debit,
}

/// One algorithm's script, ready to call.
#[derive(Debug)]
pub struct AlgScript {
    /// The Lua source (`SCRIPT LOAD` when Redis does not know the SHA) and its SHA1.
    code: String,
    script: Script,
    /// The parameters the calls pass.
    alg: Algorithm,
    /// A plan limit's tier: token-bucket states carry their interval (see the script).
    plan: bool,
}

impl AlgScript {
    pub fn new(alg: &Algorithm) -> AlgScript {
        let code = format!("{PRELUDE}{}", alg.script());
        AlgScript { script: Script::new(&code), code, alg: alg.clone(), plan: false }
    }

    /// The script of one tier of a plan limit: token-bucket states carry their interval.
    pub fn for_plan(mut self) -> AlgScript {
        self.plan = true;
        self
    }

    /// SHA1 of the script (what EVALSHA sends).
    pub fn sha(&self) -> &str {
        self.script.get_hash()
    }

    /// `SCRIPT LOAD` of this script (after a `NOSCRIPT`).
    pub fn load_cmd(&self) -> Cmd {
        let mut c = redis::cmd("SCRIPT");
        c.arg("LOAD").arg(&self.code);
        c
    }

    /// The EVALSHA call for `op` on `key`; `now` only from tests (production: Redis TIME).
    /// `local` is this instance's clock: a calendar window's boundaries around it are passed
    /// (the script picks the one holding Redis' time; clocks apart by more than a window
    /// are not expected). `deadline`: Redis' time (µs) past which a writing call changes
    /// nothing (0: none).
    pub fn invocation(
        &self,
        key: &[u8],
        op: Op,
        cost: u64,
        local: Timestamp,
        deadline: i64,
        now: Option<Timestamp>,
    ) -> Invocation<'_> {
        let mut inv = redis::cmd("EVALSHA");
        let (code, lease) = match op {
            Op::Decide => ("d", 0),
            Op::Peek => ("p", 0),
            Op::Lease(n) => ("l", n),
            Op::Refund => ("r", 0),
            Op::Debit => ("b", 0),
        };
        inv.arg(self.sha()).arg(1).arg(key).arg(code).arg(cost);
        self.alg.script_args(&Call { lease, plan: self.plan, local }, &mut |v| {
            inv.arg(v);
        });
        inv.arg(deadline);
        if let Some(now) = now {
            inv.arg(now.as_micros());
        }
        Invocation { evalsha: inv, script: self }
    }
}

/// One script call: its `EVALSHA`, and the script to load when Redis answers `NOSCRIPT`.
pub struct Invocation<'a> {
    pub evalsha: Cmd,
    pub script: &'a AlgScript,
}

/// A decision reply `{kind, wait_or_retry_after, remaining, reset, granted}` (the script's
/// final `now` taken off by the client) → the decision and
/// the units granted (more than the cost only for a lease). `None` if malformed. No kind says
/// "never": the store answers a cost above `max_cost` with `Decision::Never` itself, without
/// calling a script.
pub fn decode(reply: &[i64]) -> Option<(Decision, u64)> {
    let &[kind, a, remaining, reset, granted] = reply else {
        return None;
    };
    let u = |v: i64| u64::try_from(v).ok();
    let (a, remaining, reset, granted) = (u(a)?, u(remaining)?, u(reset)?, u(granted)?);
    let (a, reset) = (Span::from_micros(a), Span::from_micros(reset));
    let d = match kind {
        0 => Decision::Allow { remaining, reset },
        1 => Decision::Delay { wait: a, remaining, reset },
        2 => Decision::Deny { retry_after: a, reset },
        _ => return None,
    };
    Some((d, granted))
}

pub use crate::limit::algo::LUA_EXACT;

/// Checks that `alg` runs exactly in Lua (all intermediates < 2^53); config validation calls
/// this for every `store: redis` limit. Each algorithm states its bounds
/// ([`crate::limit::algo::Rule::check_script`]).
///
/// # Errors
/// A sentence for the user naming the bound that is exceeded.
pub fn check_precision(alg: &Algorithm) -> Result<(), String> {
    alg.check_script()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::algo::expect::{nz, nzs, us};

    #[test]
    fn every_script_opens_with_its_contract() {
        for kind in crate::limit::algo::Kind::ALL {
            let code = format!("{PRELUDE}{}", kind.script());
            for part in ["KEYS[1]", "ARGV[1]", "ARGV[2]", "deadline", "optional now", "Reply"] {
                assert!(code.contains(part), "missing {part}");
            }
        }
    }

    #[test]
    fn decodes_all_three_kinds_and_rejects_garbage() {
        assert_eq!(decode(&[0, 0, 4, 100, 1]), Some((Decision::Allow { remaining: 4, reset: us(100) }, 1)));
        assert_eq!(
            decode(&[1, 7, 0, 100, 1]),
            Some((Decision::Delay { wait: us(7), remaining: 0, reset: us(100) }, 1))
        );
        assert_eq!(decode(&[2, 9, 0, 50, 0]), Some((Decision::Deny { retry_after: us(9), reset: us(50) }, 0)));
        assert_eq!(decode(&[3, 0, 0, 0, 0]), None);
        assert_eq!(decode(&[0, -1, 0, 0, 0]), None);
        assert_eq!(decode(&[0, 0, 0]), None);
    }

    #[test]
    fn precision_bound_accepts_realistic_and_rejects_huge_configs() {
        let day = 86_400_000_000;
        let sw = |limit| Algorithm::SlidingWindow { window: nzs(day), limit: nz(limit) };
        assert!(check_precision(&sw(34_000)).is_ok());
        assert!(check_precision(&sw(35_000)).unwrap_err().contains("limit × window"));
        let tb = |t, b, w| Algorithm::TokenBucket { interval: nzs(t), burst: nz(b), warmup: us(w) };
        assert!(check_precision(&tb(10_000, 200, 30_000_000)).is_ok());
        assert!(check_precision(&tb(1_000_000, 10, 3_600_000_000)).is_err());
        assert!(check_precision(&tb(1, u64::MAX / 4, 0)).is_err());
        let lb = Algorithm::LeakyBucket { interval: nzs(1), max_delay: us(1 << 51) };
        assert!(check_precision(&lb).is_err());
    }
}
