//! `tollgate replay`: a logged day of traffic run through a candidate config's routes and
//! limits on a virtual clock, to see whom a limit would throttle before it is deployed.
//!
//! Nothing here re-implements a decision: each record is routed by [`crate::route::find`]
//! after [`crate::target::decide`], and decided by the route's real [`Gate`] over local
//! stores, at the record's own instant (the clock is the log's: no sockets, no sleeping).
//! A Redis limit is replayed with the local store's math, which the Lua scripts match exactly
//! (both run one table of vectors in the tests); `--fallback` replays it as the local fallback
//! of one of `instances` proxies would decide instead.
//!
//! Records are decided in timestamp order: a log is written when answers end, so a slow or
//! delayed request's line comes after later decisions; [`REORDER_US`] of log bounds the
//! reordering, so memory stays flat however long the log.

pub mod chart;
pub mod early;
pub mod parse;
pub mod report;

use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use http::{HeaderValue, Request, Version};

use crate::answer::Error;
use crate::config::{Config, Route, StoreKind};
use crate::gate::{Gate, Limit};
use crate::limit::store::redis::fallback_algorithm;
use crate::limit::{Algorithm, KeyHash, KeyPart, LocalStore, Store, Timestamp};
use crate::metrics::Metrics;
use crate::request_key::{KeyCtx, TrustedProxies};
use crate::route::{self, Conditions};

pub use parse::{Columns, Format, Live, LoggedKey, Record};
pub use report::{Compare, Report};

/// How far back in log time a line may be from the latest decided one and still be decided
/// in order (10 s: longer than any upstream timeout plus a leaky-bucket wait in practice).
pub const REORDER_US: u64 = 10_000_000;

/// How one request would be answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No route takes it.
    NoRoute,
    /// The head is refused before routing (the live proxy answers 400).
    Refused,
    /// Admitted now (or the route has no limits).
    Admitted,
    /// Admitted after a leaky-bucket wait of this many µs.
    Delayed(u64),
    /// Answered 429 by these limits (indices in the route), with this Retry-After.
    Throttled { limits: Vec<usize>, retry_after_secs: u64 },
}

impl Verdict {
    /// The live log's word for it, where the log says.
    pub fn live(&self) -> Option<Live> {
        match self {
            Verdict::Admitted => Some(Live::Admitted),
            Verdict::Delayed(_) => Some(Live::Delayed),
            Verdict::Throttled { .. } => Some(Live::Throttled),
            Verdict::NoRoute | Verdict::Refused => None,
        }
    }
}

/// The options of one replay.
#[derive(Debug, Clone)]
pub struct Options {
    pub format: Format,
    /// Redis limits as the local fallback decides them (parameters divided by `instances`).
    pub fallback: bool,
    /// Keys shown per limit.
    pub top: usize,
}

/// One config compiled for replay: its routes, their conditions and gates over fresh local
/// stores; the concurrency cap is left out (the log cannot say how long requests were held).
pub struct Engine {
    routes: Vec<Route>,
    conditions: Vec<Option<Box<Conditions>>>,
    gates: Vec<Gate>,
    trusted: TrustedProxies,
    /// Per route, per limit: which of its key parts the log cannot give (header, tls_client,
    /// claim, consumer when not logged, client_ip behind trusted proxies in tollgate's log).
    pub(crate) missing: Vec<Vec<Vec<String>>>,
    /// Per route, per limit: its key spec as tollgate's log writes it (`route,client_ip`), to
    /// find the limit's logged key on a line.
    specs: Vec<Vec<String>>,
    /// The client IP is read from the log's `peer` behind trusted proxies: the balancer's.
    pub(crate) peer_is_balancer: bool,
    /// Reading tollgate's own log (its `keys` field can stand in for missing material).
    pub(crate) own_log: bool,
    /// Whether the log names consumers (a route with `auth` refused those without one).
    consumers: bool,
    /// Redis limits replayed with the local math (route, limit).
    pub(crate) redis: Vec<(String, String)>,
    pub(crate) fallback: Option<u64>,
}

impl Engine {
    /// Compiles `config`'s routes and limits for replay.
    pub fn new(config: &Config, fallback: bool, logged: &Logged) -> Engine {
        let metrics = Metrics::new();
        let instances = config.redis.as_ref().map_or(1, |r| r.instances.get());
        let mut redis = Vec::new();
        let mut missing = Vec::new();
        let mut specs = Vec::new();
        // tollgate's `peer` is the socket's address (or a PROXY header's): behind trusted
        // proxies, the balancer's. Another log's address column is taken as the client's.
        let peer_is_balancer = logged.own && !config.trusted_proxies.is_empty();
        let mut gates = Vec::new();
        let mut conditions = Vec::new();
        for r in &config.routes {
            let mut route = r.clone();
            route.concurrency = None;
            let mut store_for = |l: &crate::config::LimitConfig| -> Arc<Store> {
                let alg: Algorithm = if l.store == StoreKind::Redis && fallback {
                    fallback_algorithm(
                        &l.algorithm,
                        config.redis.as_ref().map_or(std::num::NonZeroU64::MIN, |r| r.instances),
                    )
                } else {
                    l.algorithm.clone()
                };
                let tiers = l.plan.iter().flat_map(|p| p.algorithms.iter().flatten().cloned());
                Arc::new(Store::Local(LocalStore::with_tiers(alg, l.max_keys, tiers)))
            };
            gates.push(Gate::new(&route, &metrics, &mut store_for));
            conditions.push(route::compile(&route).0);
            for l in &route.limits {
                if l.store == StoreKind::Redis {
                    redis.push((route.name.clone(), l.name.clone()));
                }
            }
            missing.push(
                route
                    .limits
                    .iter()
                    .map(|l| {
                        l.key
                            .parts()
                            .iter()
                            .filter(|p| match p {
                                KeyPart::Header(h) => !logged.headers.contains(h),
                                KeyPart::Cookie(_) => !logged.headers.contains(&http::header::COOKIE),
                                KeyPart::Consumer => !logged.consumers,
                                KeyPart::ClientIp => peer_is_balancer,
                                // Not in a log line: a client certificate, a token's claims.
                                KeyPart::TlsClient | KeyPart::Claim(_) => true,
                                _ => false,
                            })
                            .map(ToString::to_string)
                            .collect()
                    })
                    .collect(),
            );
            specs.push(route.limits.iter().map(|l| spec_text(&l.key)).collect());
        }
        Engine {
            routes: config.routes.clone(),
            conditions,
            gates,
            trusted: TrustedProxies::new(config.trusted_proxies.clone()),
            missing,
            specs,
            peer_is_balancer,
            own_log: logged.own,
            consumers: logged.consumers,
            redis,
            fallback: fallback.then_some(instances),
        }
    }

    /// The route's limits, compiled: its own, not the failure limit of its `auth` (a log
    /// line does not say whether a credential failed, and the admission never checks it).
    pub(crate) fn limits(&self, route: usize) -> &[Limit] {
        let all = self.gates[route].limits();
        &all[..self.routes[route].limits.len().min(all.len())]
    }

    pub(crate) fn route(&self, i: usize) -> &Route {
        &self.routes[i]
    }

    pub(crate) fn route_count(&self) -> usize {
        self.routes.len()
    }

    /// Decides `r` at its own instant; `keys_of` is called with the key context of a routed
    /// request (the report reads the keys of denials from it).
    pub fn decide(&self, r: &Record, mut seen: impl FnMut(usize, &KeyCtx<'_>, &Verdict)) -> Verdict {
        let Some(mut parts) = head(r) else { return Verdict::Refused };
        let Ok(target) = crate::target::decide(&mut parts) else { return Verdict::Refused };
        let path = target.path(&parts);
        let found = route::find(&self.routes, &self.conditions, &parts.method, &parts.headers, path, parts.uri.query());
        let Some(i) = found else { return Verdict::NoRoute };
        if self.routes[i].auth.as_ref().is_some_and(|a| !a.optional) && r.identity.is_none() && self.consumers {
            // No consumer logged on a route that asks for credentials: refused live (401).
            return Verdict::Refused;
        }
        let known = self.known(i, r);
        let ctx = KeyCtx {
            route: &self.routes[i].name,
            client_ip: self.trusted.client_ip(r.ip, &parts.headers),
            path,
            parts: &parts,
            tls_client: None,
            known: (!known.is_empty()).then_some(&known),
        };
        let now = Timestamp::from_micros(r.at_us);
        let verdict = match ready(self.gates[i].check(&ctx, now)) {
            Some(Ok(a)) if a.note.delayed_us > 0 => Verdict::Delayed(a.note.delayed_us),
            Some(Ok(_)) => Verdict::Admitted,
            Some(Err(Error::Throttled(d))) => Verdict::Throttled {
                limits: d.limits.iter().map(|l| l.0).collect(),
                retry_after_secs: d.retry_after_secs,
            },
            // Local stores answer at once and the cap is left out: nothing else is reached.
            Some(Err(_)) | None => Verdict::Refused,
        };
        seen(i, &ctx, &verdict);
        verdict
    }
}

impl Engine {
    /// The keys of route `i`'s limits that the record's line logged (`log.access_keys`): a
    /// limit of the same name, keyed on the same parts, on the same route when its key names
    /// the route. Only limits whose material the log lacks need them, but the live proxy's own
    /// digest is the right one for any.
    fn known(&self, i: usize, r: &Record) -> Vec<Option<KeyHash>> {
        if r.keys.is_empty() {
            return Vec::new();
        }
        let route = &self.routes[i];
        let same_route = r.route.as_deref().is_none_or(|name| name == route.name);
        route
            .limits
            .iter()
            .zip(&self.specs[i])
            .map(|(l, spec)| {
                let names_route = l.key.parts().contains(&KeyPart::Route);
                r.keys
                    .iter()
                    .find(|k| *k.limit == *l.name && *k.spec == **spec && (same_route || !names_route))
                    .map(|k| KeyHash(k.digest))
            })
            .collect()
    }
}

/// A key spec as tollgate's log writes it: its parts, comma-separated.
pub(crate) fn spec_text(spec: &crate::limit::KeySpec) -> String {
    spec.parts().iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}

/// The request head a record describes, as the live proxy would have received it.
fn head(r: &Record) -> Option<http::request::Parts> {
    let (mut parts, ()) = Request::new(()).into_parts();
    parts.method = r.method.clone();
    parts.uri = match &r.query {
        Some(q) => format!("{}?{q}", r.path).parse().ok()?,
        None => r.path.parse().ok()?,
    };
    match &r.host {
        Some(h) => {
            parts.headers.insert(http::header::HOST, HeaderValue::from_str(h).ok()?);
        }
        // A log without hosts: as an HTTP/1.0 request without one, which routes by path.
        None => parts.version = Version::HTTP_10,
    }
    for (name, value) in &r.headers {
        parts.headers.append(name.clone(), HeaderValue::from_str(value).ok()?);
    }
    // Where `auth` puts the identity it verified.
    if let Some(id) = &r.identity {
        parts.extensions.insert(Box::new(id.clone()));
    }
    Some(parts)
}

/// Polls `f` once: a gate over local stores decides without waiting.
fn ready<F: Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

/// A line that could not be read: its file, number and why.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BadLine {
    pub file: String,
    pub line: u64,
    pub why: String,
}

/// A record waiting in the reorder buffer, smallest instant first.
struct Pending {
    at_us: u64,
    seq: u64,
    record: Box<Record>,
}

impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        (self.at_us, self.seq) == (o.at_us, o.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.at_us, o.seq).cmp(&(self.at_us, self.seq))
    }
}

/// Reads `files` in `format` and hands each record to `each` in timestamp order (within
/// [`REORDER_US`]); lines that cannot be read are returned, with their numbers.
///
/// # Errors
/// A file that cannot be opened or read.
pub fn read(files: &[PathBuf], format: &Format, mut each: impl FnMut(&Record)) -> Result<ReadStats, String> {
    let mut heap: BinaryHeap<Pending> = BinaryHeap::new();
    let mut stats = ReadStats::default();
    let mut newest = 0u64;
    let mut seq = 0u64;
    for file in files {
        let f = std::fs::File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
        let mut reader = Lines::new(f);
        let mut header: Vec<String> = Vec::new();
        let mut n = 0u64;
        loop {
            let got = reader.next().map_err(|e| format!("{}: line {}: {e}", file.display(), n + 1))?;
            let Some(bytes) = got else { break };
            n += 1;
            stats.lines += 1;
            let parsed = match std::str::from_utf8(bytes) {
                Ok(text) if matches!(format, Format::Csv(_)) && header.is_empty() => {
                    header = parse::csv_cells(text);
                    continue;
                }
                Ok(text) => parse::line(format, text, &header),
                Err(e) => Err(format!("not UTF-8: {e}")),
            };
            match parsed {
                Ok(parse::Parsed::Request(record)) => {
                    newest = newest.max(record.at_us);
                    seq += 1;
                    heap.push(Pending { at_us: record.at_us, seq, record });
                    while heap.peek().is_some_and(|p| p.at_us + REORDER_US < newest) {
                        if let Some(p) = heap.pop() {
                            stats.requests += 1;
                            each(&p.record);
                        }
                    }
                }
                Ok(parse::Parsed::Other) => stats.other += 1,
                Err(why) => {
                    stats.bad_count += 1;
                    if stats.bad.len() < 100 {
                        stats.bad.push(BadLine { file: file.display().to_string(), line: n, why });
                    }
                }
            }
        }
    }
    while let Some(p) = heap.pop() {
        stats.requests += 1;
        each(&p.record);
    }
    Ok(stats)
}

/// The longest line [`Lines`] reads.
const MAX_LINE: usize = 16 << 20;

/// The lines of a file, each a slice of one reused buffer: a line is read once, not copied
/// again into a string of its own.
struct Lines<R> {
    inner: R,
    buf: Vec<u8>,
    /// The unread bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    eof: bool,
}

impl<R: std::io::Read> Lines<R> {
    fn new(inner: R) -> Lines<R> {
        Lines::with_capacity(inner, 1 << 16)
    }

    fn with_capacity(inner: R, capacity: usize) -> Lines<R> {
        Lines { inner, buf: vec![0; capacity.max(1)], start: 0, end: 0, eof: false }
    }

    /// The next line with its `\n` (the last one may lack it), `None` at the end.
    fn next(&mut self) -> std::io::Result<Option<&[u8]>> {
        let line = loop {
            if let Some(i) = memchr::memchr(b'\n', &self.buf[self.start..self.end]) {
                break self.start..self.start + i + 1;
            }
            if self.eof {
                if self.start == self.end {
                    return Ok(None);
                }
                break self.start..self.end;
            }
            // The partial line to the front; a line as long as the buffer doubles it.
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.end == self.buf.len() {
                if self.buf.len() >= MAX_LINE {
                    return Err(std::io::Error::other("a line longer than 16 MiB: is this a log?"));
                }
                self.buf.resize((self.buf.len() * 2).min(MAX_LINE), 0);
            }
            match self.inner.read(&mut self.buf[self.end..]) {
                Ok(0) => self.eof = true,
                Ok(n) => self.end += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        };
        self.start = line.end;
        Ok(Some(&self.buf[line]))
    }
}

/// What reading the logs found.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct ReadStats {
    pub lines: u64,
    pub requests: u64,
    /// Lines of the log that are no request (other log lines, blank lines).
    pub other: u64,
    /// Lines that could not be read.
    pub bad_count: u64,
    /// The first 100 of them.
    pub bad: Vec<BadLine>,
}

/// Replays `files` against `candidate`.
///
/// # Errors
/// A log file that cannot be read.
pub fn run(candidate: &Config, files: &[PathBuf], o: &Options) -> Result<Report, String> {
    let engine = Engine::new(candidate, o.fallback, &logged(&o.format));
    let mut acc = report::Tally::new(&engine, o.top);
    let stats = read(files, &o.format, |r| {
        let v = engine.decide(r, |i, ctx, v| acc.seen(&engine, i, ctx, r, v));
        acc.count(r, &v);
    })?;
    Ok(acc.finish(&engine, stats, o))
}

/// Replays `files` against `current` and `candidate` side by side.
///
/// # Errors
/// A log file that cannot be read.
pub fn compare(current: &Config, candidate: &Config, files: &[PathBuf], o: &Options) -> Result<Compare, String> {
    let logged = logged(&o.format);
    let (a, b) = (Engine::new(current, o.fallback, &logged), Engine::new(candidate, o.fallback, &logged));
    let mut diff = report::Diff::default();
    let (mut ea, mut eb) = (early::Eager::new(&a), early::Eager::new(&b));
    let stats = read(files, &o.format, |r| {
        let mut who = (String::new(), String::new());
        let va = a.decide(r, |i, ctx, v| {
            who.0 = report::who(&a, i, ctx, v);
            ea.seen(&a, i, ctx, &mut report::Keys::new(a.limits(i).len()));
        });
        let vb = b.decide(r, |i, ctx, v| {
            who.1 = report::who(&b, i, ctx, v);
            eb.seen(&b, i, ctx, &mut report::Keys::new(b.limits(i).len()));
        });
        diff.count(&va, &vb, who);
    })?;
    Ok(diff.finish(stats, o.top, early::diff((&a, &ea), (&b, &eb))))
}

/// Runs `files` against `config` and returns each request's verdict beside what the log
/// says tollgate decided live, by request id (the exactness check).
///
/// # Errors
/// A log file that cannot be read.
pub fn verdicts(config: &Config, files: &[PathBuf]) -> Result<Vec<Checked>, String> {
    let engine = Engine::new(config, false, &logged(&Format::Tollgate));
    let mut out = Vec::new();
    read(files, &Format::Tollgate, |r| out.push((r.id.clone(), r.live, engine.decide(r, |_, _, _| {}))))?;
    Ok(out)
}

/// What a log format carries that limit keys may read, beside the request line and peer.
pub struct Logged {
    /// The headers the log carries (named columns only).
    headers: Vec<http::HeaderName>,
    /// The consumer `auth` verified: tollgate's own log has it, named columns when asked.
    consumers: bool,
    /// tollgate's own log: its `peer` is the connection's, and its `keys` the limits' keys.
    own: bool,
}

fn logged(f: &Format) -> Logged {
    match f {
        Format::Json(c) | Format::Csv(c) => Logged {
            headers: c.headers.iter().map(|h| h.0.clone()).collect(),
            consumers: c.consumer.is_some(),
            own: false,
        },
        Format::Tollgate => Logged { headers: Vec::new(), consumers: true, own: true },
        Format::Nginx => Logged { headers: Vec::new(), consumers: false, own: false },
    }
}

/// A request's id, what the log says tollgate decided live, and the replay's verdict.
pub type Checked = (Option<String>, Option<Live>, Verdict);

/// Per second (of log time), admitted and throttled counts.
pub type Series = BTreeMap<u64, (u64, u64)>;

/// A count per key, with the key's text.
pub(crate) type KeyCounts = HashMap<u128, (u64, String)>;

#[cfg(test)]
mod tests {
    use super::*;

    fn all(text: &[u8], capacity: usize) -> Vec<Vec<u8>> {
        let mut lines = Lines::with_capacity(text, capacity);
        let mut out = Vec::new();
        while let Some(l) = lines.next().unwrap() {
            out.push(l.to_vec());
        }
        out
    }

    #[test]
    fn lines_cross_buffer_edges_grow_past_it_and_keep_a_last_line_without_its_end() {
        let text = b"one\ntwo two\n\nthree three three\nlast";
        let want: Vec<&[u8]> = vec![b"one\n", b"two two\n", b"\n", b"three three three\n", b"last"];
        for capacity in [1, 2, 3, 5, 8, 64] {
            assert_eq!(all(text, capacity), want, "capacity {capacity}");
        }
        assert!(all(b"", 4).is_empty());
        assert_eq!(all(b"\n\n", 1), vec![b"\n".to_vec(), b"\n".to_vec()]);
    }

    #[test]
    fn a_line_that_is_not_utf8_is_counted_and_the_others_read() {
        let dir = std::env::temp_dir().join(format!("tollgate-replay-lines-{}", std::process::id()));
        std::fs::write(&dir, b"a,b\n1,x\n\xff\xfe\n2,y\n").unwrap();
        let format = Format::Csv(Columns::parse("ts=a,ip=b").unwrap());
        let stats = read(std::slice::from_ref(&dir), &format, |_| {}).unwrap();
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(stats.lines, 4);
        assert_eq!(stats.bad_count, 3, "two rows without the named columns, one not UTF-8: {:?}", stats.bad);
        assert!(stats.bad.iter().any(|b| b.line == 3 && b.why.starts_with("not UTF-8")), "{:?}", stats.bad);
    }
}
