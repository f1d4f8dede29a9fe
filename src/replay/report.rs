//! What a replay found, per route and limit, and the difference between two configs: the
//! tallies kept while records are decided, the report they become (serialisable for
//! `--json`), and its text form.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use serde::Serialize;

use super::early::{Eager, EarlyDiff, EarlyRetries};
use super::{Engine, KeyCounts, Live, Options, ReadStats, Record, Series, Verdict};
use crate::gate::Limit;
use crate::limit::Algorithm;
use crate::request_key::KeyCtx;

/// Counts of one limit of a route.
#[derive(Default)]
struct LimitTally {
    throttled: u64,
    delayed: u64,
    keys: KeyCounts,
    /// Requests decided on the key the log recorded (`log.access_keys`).
    from_log: u64,
    /// Requests decided without the material their key needs (one shared "missing" key).
    lacking: u64,
}

/// Counts of one route.
#[derive(Default)]
struct RouteTally {
    requests: u64,
    admitted: u64,
    delayed: u64,
    wait_us: u64,
    wait_max_us: u64,
    throttled: u64,
    retry_after: BTreeMap<u64, u64>,
    /// With `stale_on_limit`: the last admitted `200` of a GET, by host, path and query.
    copies: HashMap<u64, u64>,
    stale: u64,
    limits: Vec<LimitTally>,
}

/// The counts kept while records are decided.
pub struct Tally {
    routes: Vec<RouteTally>,
    series: Series,
    top: usize,
    no_route: u64,
    refused: u64,
    live_total: u64,
    live_agree: u64,
    live_differ: Vec<String>,
    eager: Eager,
}

impl Tally {
    pub(crate) fn new(e: &Engine, top: usize) -> Tally {
        let routes = (0..e.route_count())
            .map(|i| RouteTally {
                limits: e.limits(i).iter().map(|_| LimitTally::default()).collect(),
                ..RouteTally::default()
            })
            .collect();
        Tally {
            routes,
            series: Series::new(),
            top,
            no_route: 0,
            refused: 0,
            live_total: 0,
            live_agree: 0,
            live_differ: Vec::new(),
            eager: Eager::new(e),
        }
    }

    /// A routed record's verdict, with its key context (keys are read only for denials).
    pub(crate) fn seen(&mut self, e: &Engine, i: usize, ctx: &KeyCtx<'_>, r: &Record, v: &Verdict) {
        let route = e.route(i);
        let mut keys = Keys::new(e.limits(i).len());
        self.eager.seen(e, i, ctx, &mut keys);
        let t = &mut self.routes[i];
        t.requests += 1;
        for (j, lt) in t.limits.iter_mut().enumerate() {
            if ctx.known(j).is_some() {
                lt.from_log += 1;
            } else if !e.missing[i][j].is_empty() {
                lt.lacking += 1;
            }
        }
        let copy = route.stale_on_limit.filter(|_| r.method == http::Method::GET).map(|age| {
            let id = xxhash_rust::xxh3::xxh3_64(
                format!("{}\0{}\0{}", r.host.as_deref().unwrap_or(""), r.path, r.query.as_deref().unwrap_or(""))
                    .as_bytes(),
            );
            (id, u64::try_from(age.as_micros()).unwrap_or(u64::MAX))
        });
        match v {
            Verdict::Admitted | Verdict::Delayed(_) => {
                if let Verdict::Delayed(us) = v {
                    t.delayed += 1;
                    t.wait_us += us;
                    t.wait_max_us = t.wait_max_us.max(*us);
                    for (l, lt) in e.limits(i).iter().zip(&mut t.limits) {
                        if Algorithm::delays(&l.config.algorithm) {
                            lt.delayed += 1;
                        }
                    }
                } else {
                    t.admitted += 1;
                }
                if let (Some((id, _)), Some(200)) = (copy, r.status) {
                    t.copies.insert(id, r.at_us);
                }
            }
            Verdict::Throttled { limits, retry_after_secs } => {
                t.throttled += 1;
                *t.retry_after.entry(*retry_after_secs).or_default() += 1;
                if let Some((id, age)) = copy {
                    if t.copies.get(&id).is_some_and(|at| r.at_us.saturating_sub(*at) <= age) {
                        t.stale += 1;
                    }
                }
                for &l in limits {
                    let (limit, lt) = (&e.limits(i)[l], &mut t.limits[l]);
                    lt.throttled += 1;
                    let key = keys.of(l, limit, ctx);
                    lt.keys.entry(key).or_insert_with(|| (0, label(e, i, l, ctx))).0 += 1;
                }
            }
            Verdict::NoRoute | Verdict::Refused => {}
        }
    }

    /// Every record's verdict: the per-second series and, for tollgate's own log, whether
    /// the live decision is reproduced.
    pub(crate) fn count(&mut self, r: &Record, v: &Verdict) {
        let sec = self.series.entry(r.at_us / 1_000_000).or_default();
        match v {
            Verdict::Admitted | Verdict::Delayed(_) => sec.0 += 1,
            Verdict::Throttled { .. } => sec.1 += 1,
            Verdict::NoRoute => self.no_route += 1,
            Verdict::Refused => self.refused += 1,
        }
        if let (Some(live), Some(now)) = (r.live, v.live()) {
            self.live_total += 1;
            if live == now {
                self.live_agree += 1;
            } else if self.live_differ.len() < 20 {
                self.live_differ.push(format!("{}: live {live}, replay {now}", r.id.as_deref().unwrap_or("-")));
            }
        }
    }

    pub(crate) fn finish(self, e: &Engine, stats: ReadStats, o: &Options) -> Report {
        let top = self.top;
        let eager = &self.eager;
        // Why live decisions may not be reproduced: requests whose keys lacked material.
        let mut why = Vec::new();
        for (i, t) in self.routes.iter().enumerate() {
            for (j, lt) in t.limits.iter().enumerate().filter(|(_, lt)| lt.lacking > 0) {
                why.push(format!(
                    "route {} limit {}: {} requests decided without their key ({})",
                    e.route(i).name,
                    e.limits(i)[j].config.name,
                    lt.lacking,
                    lacking_words(e, &e.missing[i][j])
                ));
            }
        }
        let routes: Vec<RouteReport> = self
            .routes
            .into_iter()
            .enumerate()
            .map(|(i, t)| RouteReport {
                route: e.route(i).name.clone(),
                requests: t.requests,
                admitted: t.admitted,
                delayed: t.delayed,
                wait_ms_total: t.wait_us as f64 / 1e3,
                wait_ms_max: t.wait_max_us as f64 / 1e3,
                throttled: t.throttled,
                throttled_share: share(t.throttled, t.requests),
                retry_after: t.retry_after.into_iter().collect(),
                stale_instead_of_429: e.route(i).stale_on_limit.map(|_| t.stale),
                limits: e
                    .limits(i)
                    .iter()
                    .zip(t.limits)
                    .enumerate()
                    .map(|(j, (l, lt))| LimitReport {
                        limit: l.config.name.clone(),
                        rate: l.config.rate.to_string(),
                        key: l.config.key.parts().iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
                        shadow: !matches!(l.config.mode, crate::config::Mode::Enforce),
                        throttled: lt.throttled,
                        throttled_share: share(lt.throttled, t.requests),
                        delayed: lt.delayed,
                        keys_affected: lt.keys.len() as u64,
                        top_keys: top_keys(lt.keys, top),
                        keys_from_log: lt.from_log,
                        requests_without_key: lt.lacking,
                        key_parts_not_in_log: if lt.lacking > 0 { e.missing[i][j].clone() } else { Vec::new() },
                        early_retries: eager.report(e, i, j),
                    })
                    .collect(),
            })
            .collect();
        let mut notes = Vec::new();
        if !e.redis.is_empty() {
            let how = match e.fallback {
                Some(n) => format!(
                    "as the local fallback of one of {n} instances decides them (rates and limits divided by {n})"
                ),
                None => {
                    "with the local store's math, which the Redis scripts match exactly (tested against each other)"
                        .into()
                }
            };
            let names: Vec<String> = e.redis.iter().map(|(r, l)| format!("{r}/{l}")).collect();
            notes.push(format!("Redis limits ({}) are replayed {how}.", names.join(", ")));
        }
        if routes_miss(&routes) {
            notes.push(
                "Some keys read parts the log does not have (listed per limit): a request without them is \
                 decided on one shared \"missing\" key, where the live proxy had each client's own. In \
                 tollgate's log, `log.access_keys: true` records each limit's key (its digest), and replay \
                 decides on it."
                    .into(),
            );
        }
        notes.push(
            "Concurrency caps are not replayed (the log cannot say how long requests were held); \
             stale answers count throttled GETs whose route has `stale_on_limit` and whose path had a 200 \
             admitted within its max age."
                .into(),
        );
        let _ = o;
        Report {
            lines: stats,
            no_route: self.no_route,
            refused: self.refused,
            live: (self.live_total > 0).then_some(LiveCheck {
                requests: self.live_total,
                reproduced: self.live_agree,
                differ: self.live_differ,
                why,
            }),
            routes,
            notes,
            series: self.series,
        }
    }
}

fn routes_miss(routes: &[RouteReport]) -> bool {
    routes.iter().flat_map(|r| &r.limits).any(|l| !l.key_parts_not_in_log.is_empty())
}

/// Why a key's parts are not in the log, and what gives them.
fn lacking_words(e: &Engine, parts: &[String]) -> String {
    let mut out = format!("the log has no {}", parts.join(", "));
    if e.peer_is_balancer && parts.iter().any(|p| p == "client_ip") {
        out.push_str("; behind trusted_proxies, its `peer` is the balancer, not the client");
    }
    out.push_str(if e.own_log {
        "; `log.access_keys: true` logs each limit's key"
    } else {
        "; a header is read from a column named in --columns"
    });
    out
}

fn share(n: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        n as f64 / of as f64
    }
}

fn top_keys(keys: KeyCounts, n: usize) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = keys.into_values().map(|(c, t)| (t, c)).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v.truncate(n);
    v
}

/// A key's text: `part=value` per part (`-` for a value the request lacks). The report is
/// the operator's, read from the operator's own log: the values are shown as the log has them.
/// The keys of one record's limits, each hashed once, when first asked for (the gate hashed
/// them too, but keeps them to itself).
pub(crate) struct Keys(smallvec::SmallVec<[Option<u128>; 4]>);

impl Keys {
    pub(crate) fn new(limits: usize) -> Keys {
        Keys(smallvec::smallvec![None; limits])
    }

    /// The key of limit `j` (`limit`) for `ctx` (the logged one, when the line has it).
    pub(crate) fn of(&mut self, j: usize, limit: &Limit, ctx: &KeyCtx<'_>) -> u128 {
        match self.0.get_mut(j) {
            Some(k) => *k.get_or_insert_with(|| ctx.key_of(j, &limit.config.key).0),
            None => ctx.key_of(j, &limit.config.key).0,
        }
    }
}

/// The text of limit `j`'s key on route `i`: `part=value` per part (`-` for a value the
/// request lacks, `?` for one the log lacks), and the key's digest when the log gave it (as
/// the admin listener's `/limits` names keys).
pub(super) fn label(e: &Engine, i: usize, j: usize, ctx: &KeyCtx<'_>) -> String {
    let limit = &e.limits(i)[j];
    let missing = &e.missing[i][j];
    let mut out = String::new();
    let mut buf = [0u8; crate::limit::key::MAX_PART_BYTES];
    for (n, part) in limit.config.key.parts().iter().enumerate() {
        let sep = if n > 0 { " " } else { "" };
        if missing.contains(&part.to_string()) {
            let _ = write!(out, "{sep}{part}=?");
            continue;
        }
        let value = ctx.value(part, &mut buf).map(String::from_utf8_lossy);
        let _ = write!(out, "{sep}{part}={}", value.as_deref().unwrap_or("-"));
    }
    if let Some(k) = ctx.known(j) {
        let _ = write!(out, " (key {:032x})", k.0);
    }
    out
}

/// The route and key text of a throttled verdict (empty otherwise), for `--compare`.
pub(crate) fn who(e: &Engine, i: usize, ctx: &KeyCtx<'_>, v: &Verdict) -> String {
    let route = &e.route(i).name;
    match v {
        Verdict::Throttled { limits, .. } => match limits.first().filter(|l| **l < e.limits(i).len()) {
            Some(&l) => format!("{route}\t{}\t{}", e.limits(i)[l].config.name, label(e, i, l, ctx)),
            None => format!("{route}\t-\t-"),
        },
        _ => String::new(),
    }
}

/// What a replay found.
#[derive(Debug, Serialize)]
pub struct Report {
    pub lines: ReadStats,
    pub no_route: u64,
    /// Heads the live proxy would refuse with 400 (or that cannot be a request).
    pub refused: u64,
    /// Replaying tollgate's own log: how many live decisions the replay reproduces.
    pub live: Option<LiveCheck>,
    pub routes: Vec<RouteReport>,
    pub notes: Vec<String>,
    /// Per second of log time: (admitted, throttled).
    #[serde(skip)]
    pub series: Series,
}

#[derive(Debug, Serialize)]
pub struct LiveCheck {
    pub requests: u64,
    pub reproduced: u64,
    /// The first that differ, by request id.
    pub differ: Vec<String>,
    /// What the replay had to decide without: per route and limit, the requests whose key
    /// the log lacked, and why (empty when every key was there).
    pub why: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct RouteReport {
    pub route: String,
    pub requests: u64,
    pub admitted: u64,
    pub delayed: u64,
    pub wait_ms_total: f64,
    pub wait_ms_max: f64,
    pub throttled: u64,
    pub throttled_share: f64,
    /// (Retry-After seconds, 429s that carried it).
    pub retry_after: Vec<(u64, u64)>,
    /// Routes with `stale_on_limit`: 429s a stale copy would have answered instead.
    pub stale_instead_of_429: Option<u64>,
    pub limits: Vec<LimitReport>,
}

#[derive(Debug, Serialize)]
pub struct LimitReport {
    pub limit: String,
    pub rate: String,
    pub key: String,
    pub shadow: bool,
    pub throttled: u64,
    pub throttled_share: f64,
    pub delayed: u64,
    pub keys_affected: u64,
    pub top_keys: Vec<(String, u64)>,
    /// Requests decided on the key tollgate's log recorded for this limit (`log.access_keys`).
    pub keys_from_log: u64,
    /// Requests decided without the material their key needs: one shared "missing" key.
    pub requests_without_key: u64,
    /// The key parts the log lacks, when some request needed them.
    pub key_parts_not_in_log: Vec<String>,
    /// Keys back before the Retry-After they were told (the gate's count).
    pub early_retries: EarlyRetries,
}

impl Report {
    /// The report as text.
    pub fn text(&self) -> String {
        let mut o = String::new();
        let l = &self.lines;
        let _ = writeln!(
            o,
            "{} lines: {} requests, {} other lines, {} unreadable; {} without a route, {} refused heads",
            l.lines, l.requests, l.other, l.bad_count, self.no_route, self.refused
        );
        for b in &l.bad {
            let _ = writeln!(o, "  unreadable: {} line {}: {}", b.file, b.line, b.why);
        }
        if let Some(live) = &self.live {
            let _ = writeln!(o, "live decisions reproduced: {} of {}", live.reproduced, live.requests);
            for d in &live.differ {
                let _ = writeln!(o, "  differs: {d}");
            }
            for w in &live.why {
                let _ = writeln!(o, "  decided without the live key: {w}");
            }
        }
        for r in &self.routes {
            let _ = writeln!(
                o,
                "\nroute {}: {} requests, {} would get 429 ({:.2} %), {} delayed (wait total {:.1} ms, max {:.1} ms)",
                r.route,
                r.requests,
                r.throttled,
                r.throttled_share * 100.0,
                r.delayed,
                r.wait_ms_total,
                r.wait_ms_max
            );
            if !r.retry_after.is_empty() {
                let ra: Vec<String> = r.retry_after.iter().map(|(s, n)| format!("{s}s×{n}")).collect();
                let _ = writeln!(o, "  Retry-After: {}", ra.join(" "));
            }
            if let Some(stale) = r.stale_instead_of_429 {
                let _ = writeln!(o, "  stale copies instead of 429: {stale}");
            }
            for lr in &r.limits {
                let shadow = if lr.shadow { " (shadow)" } else { "" };
                let _ = writeln!(
                    o,
                    "  limit {}{shadow} ({}, key {}): {} throttled ({:.2} %), {} delayed, {} keys affected",
                    lr.limit,
                    lr.rate,
                    lr.key,
                    lr.throttled,
                    lr.throttled_share * 100.0,
                    lr.delayed,
                    lr.keys_affected
                );
                for (k, n) in &lr.top_keys {
                    let _ = writeln!(o, "    {n:>8}  {k}");
                }
                if lr.early_retries.times > 0 {
                    let _ = writeln!(o, "    early retries: {}", lr.early_retries.words);
                }
                if lr.keys_from_log > 0 {
                    let _ = writeln!(o, "    {} requests decided on the key the log recorded", lr.keys_from_log);
                }
                if !lr.key_parts_not_in_log.is_empty() {
                    let _ = writeln!(
                        o,
                        "    the log has no {}: {} requests decided on one shared missing key",
                        lr.key_parts_not_in_log.join(", "),
                        lr.requests_without_key
                    );
                }
            }
        }
        for n in &self.notes {
            let _ = writeln!(o, "\nnote: {n}");
        }
        o
    }
}

/// The difference of two configs over one log, kept while records are decided.
#[derive(Default)]
pub struct Diff {
    total: u64,
    throttled: (u64, u64),
    newly: HashMap<String, u64>,
    let_through: HashMap<String, u64>,
}

impl Diff {
    /// One record's verdicts under the current and the candidate config, with who each
    /// throttled (route, limit, key).
    pub(crate) fn count(&mut self, current: &Verdict, candidate: &Verdict, who: (String, String)) {
        self.total += 1;
        let (a, b) = (current.live() == Some(Live::Throttled), candidate.live() == Some(Live::Throttled));
        self.throttled.0 += u64::from(a);
        self.throttled.1 += u64::from(b);
        match (a, b) {
            (false, true) => *self.newly.entry(who.1).or_default() += 1,
            (true, false) => *self.let_through.entry(who.0).or_default() += 1,
            _ => {}
        }
    }

    pub(crate) fn finish(self, stats: ReadStats, top: usize, early_retries: Vec<EarlyDiff>) -> Compare {
        let rows = |m: HashMap<String, u64>| -> (u64, Vec<Who>) {
            let total = m.values().sum();
            let mut v: Vec<Who> = m
                .into_iter()
                .map(|(k, requests)| {
                    let mut f = k.splitn(3, '\t').map(str::to_owned);
                    let mut next = || f.next().unwrap_or_default();
                    Who { route: next(), limit: next(), key: next(), requests }
                })
                .collect();
            v.sort_by(|a, b| b.requests.cmp(&a.requests).then_with(|| (&a.route, &a.key).cmp(&(&b.route, &b.key))));
            v.truncate(top);
            (total, v)
        };
        let (newly_total, newly) = rows(self.newly);
        let (through_total, let_through) = rows(self.let_through);
        Compare {
            lines: stats,
            requests: self.total,
            throttled_current: self.throttled.0,
            throttled_candidate: self.throttled.1,
            newly_throttled: newly_total,
            let_through: through_total,
            newly,
            through: let_through,
            early_retries,
        }
    }
}

/// A route and key whose requests change verdict.
#[derive(Debug, Serialize)]
pub struct Who {
    pub route: String,
    /// The limit that throttles it (the candidate's for newly throttled, the current's for
    /// let through).
    pub limit: String,
    pub key: String,
    pub requests: u64,
}

/// `--compare`: who the candidate would newly throttle, and whom it would let through.
#[derive(Debug, Serialize)]
pub struct Compare {
    pub lines: ReadStats,
    pub requests: u64,
    pub throttled_current: u64,
    pub throttled_candidate: u64,
    pub newly_throttled: u64,
    pub let_through: u64,
    /// Top keys newly throttled.
    pub newly: Vec<Who>,
    /// Top keys let through.
    pub through: Vec<Who>,
    /// Limits whose keys came back before their Retry-After, under either config.
    pub early_retries: Vec<EarlyDiff>,
}

impl Compare {
    /// The comparison as text.
    pub fn text(&self) -> String {
        let mut o = String::new();
        let l = &self.lines;
        let _ = writeln!(o, "{} lines: {} requests, {} unreadable", l.lines, l.requests, l.bad_count);
        for b in &l.bad {
            let _ = writeln!(o, "  unreadable: {} line {}: {}", b.file, b.line, b.why);
        }
        let _ = writeln!(
            o,
            "429s: current {}, candidate {}; newly throttled {}, let through {}",
            self.throttled_current, self.throttled_candidate, self.newly_throttled, self.let_through
        );
        for (title, rows) in [("newly throttled", &self.newly), ("let through", &self.through)] {
            if rows.is_empty() {
                continue;
            }
            let _ = writeln!(o, "\n{title}:");
            for w in rows {
                let _ = writeln!(o, "  {:>8}  route {} limit {}: {}", w.requests, w.route, w.limit, w.key);
            }
        }
        if !self.early_retries.is_empty() {
            let _ = writeln!(o, "\nearly retries:");
            for r in &self.early_retries {
                let _ = writeln!(o, "  route {} limit {}", r.route, r.limit);
                for (side, seen) in [("current", &r.current), ("candidate", &r.candidate)] {
                    let words = seen.as_ref().map_or("no such limit", |s| s.words.as_str());
                    let _ = writeln!(o, "    {side:<9}  {words}");
                }
            }
        }
        o
    }
}
