//! Early retries in a replay: per route and limit, the keys that came back before the
//! Retry-After they were told, read from the gate's own counter after each decision, and
//! said in words as `tollgate explain` says things; both configs' side by side for
//! `--compare`.

use std::fmt::Write;

use serde::Serialize;

use super::report::{label, Keys};
use super::{Engine, KeyCounts};
use crate::limit::Algorithm;
use crate::request_key::KeyCtx;

/// Early retries (a key back before the Retry-After it was told), per route and limit: read
/// from each limit's own counter after every decision, so they are the gate's count, with
/// the key each one came from.
pub(crate) struct Eager {
    /// Per route, per limit: the counter's last value and the count per key.
    seen: Vec<Vec<(u64, KeyCounts)>>,
}

impl Eager {
    pub(crate) fn new(e: &Engine) -> Eager {
        Eager {
            seen: (0..e.route_count()).map(|i| e.limits(i).iter().map(|_| (0, KeyCounts::new())).collect()).collect(),
        }
    }

    /// After a decision on route `i` (records are decided one at a time).
    pub(crate) fn seen(&mut self, e: &Engine, i: usize, ctx: &KeyCtx<'_>, hashed: &mut Keys) {
        for (j, (l, (last, keys))) in e.limits(i).iter().zip(&mut self.seen[i]).enumerate() {
            let now = l.metrics.early_retries.get();
            if now > *last {
                let key = hashed.of(j, l, ctx);
                keys.entry(key).or_insert_with(|| (0, label(e, i, j, ctx))).0 += now - *last;
                *last = now;
            }
        }
    }

    /// What limit `j` of route `i` saw, in words.
    pub(crate) fn report(&self, e: &Engine, i: usize, j: usize) -> EarlyRetries {
        let (times, keys) = &self.seen[i][j];
        let most = keys.values().max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(&a.1)));
        let l = &e.limits(i)[j].config;
        let mut r = EarlyRetries {
            times: *times,
            clients: keys.len() as u64,
            most_eager: most.map(|(n, k)| (k.clone(), *n)),
            words: String::new(),
        };
        r.words = r.said(l.early_penalty && l.mode == crate::config::Mode::Enforce, &l.algorithm);
        r
    }
}

/// Early retries of one limit: requests of keys back before the Retry-After they were told.
#[derive(Debug, Serialize, Clone, PartialEq, Eq)]
pub struct EarlyRetries {
    pub times: u64,
    /// Keys that came back early.
    pub clients: u64,
    /// The key back early most often, and how often.
    pub most_eager: Option<(String, u64)>,
    /// The same in words, as `tollgate explain` says things.
    pub words: String,
}

impl EarlyRetries {
    fn said(&self, penalty: bool, alg: &Algorithm) -> String {
        if self.times == 0 {
            return "no client came back before its Retry-After".into();
        }
        let times = |n: u64| if n == 1 { "once".to_owned() } else { format!("{n} times") };
        let mut s = if self.clients == 1 {
            format!("1 client came back before its Retry-After, {}", times(self.times))
        } else {
            format!("{} clients came back before their Retry-After, {}", self.clients, times(self.times))
        };
        if let Some((key, n)) = self.most_eager.as_ref().filter(|_| self.clients > 1) {
            let _ = write!(s, "; the most eager, {key}, {}", times(*n));
        } else if let Some((key, _)) = &self.most_eager {
            let _ = write!(s, " ({key})");
        }
        if penalty {
            let _ = write!(
                s,
                "; each was refused and told twice its last wait (up to {} s)",
                crate::ratelimit::penalty_cap_secs(alg)
            );
        }
        s
    }
}

/// Early retries of one limit under both configs (matched by route and limit name); `None`
/// where a config has no such limit.
#[derive(Debug, Serialize)]
pub struct EarlyDiff {
    pub route: String,
    pub limit: String,
    pub current: Option<EarlyRetries>,
    pub candidate: Option<EarlyRetries>,
}

/// The limits of either config that saw early retries, with what each config's saw.
pub(crate) fn diff(a: (&Engine, &Eager), b: (&Engine, &Eager)) -> Vec<EarlyDiff> {
    let mut rows: Vec<EarlyDiff> = Vec::new();
    for (side, (e, eager)) in [a, b].into_iter().enumerate() {
        for i in 0..e.route_count() {
            for (j, l) in e.limits(i).iter().enumerate() {
                let (route, limit) = (&e.route(i).name, &l.config.name);
                let at = match rows.iter().position(|r| (&r.route, &r.limit) == (route, limit)) {
                    Some(at) => at,
                    None => {
                        let row =
                            EarlyDiff { route: route.clone(), limit: limit.clone(), current: None, candidate: None };
                        rows.push(row);
                        rows.len() - 1
                    }
                };
                let seen = Some(eager.report(e, i, j));
                if side == 0 {
                    rows[at].current = seen;
                } else {
                    rows[at].candidate = seen;
                }
            }
        }
    }
    rows.retain(|r| [&r.current, &r.candidate].iter().any(|s| s.as_ref().is_some_and(|s| s.times > 0)));
    rows
}
