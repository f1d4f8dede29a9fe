//! `servers:` of an upstream: a group of servers with balancing, retries, passive ejection
//! and active health checks. The serde mirror and its validation; the runtime is
//! [`crate::forward::group`].

use std::time::Duration;

use serde::de::MapAccess;
use serde::Deserialize;

use super::forms::{by_form, read_map, Forms};
use super::limits::KeyList;
use super::units::Dur;
use super::{key, Invalid, Seg};
use crate::limit::{KeyPart, KeySpec};

/// Servers in one group.
pub const MAX_SERVERS: usize = 256;
/// The largest `weight`: a round-robin schedule holds one slot per unit of weight.
pub const MAX_WEIGHT: u32 = 100;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    url: String,
    weight: Option<u32>,
    resolve: Option<RawResolve>,
}

/// `resolve: true` (A and AAAA) or `resolve: srv`.
pub enum RawResolve {
    Flag(bool),
    Name(String),
}

impl Forms for RawResolve {
    const EXPECTING: &'static str = "`true` (A and AAAA records), `srv` or `false`";
    fn flag(b: bool) -> Option<Self> {
        Some(RawResolve::Flag(b))
    }
    fn text(s: &str) -> Option<Self> {
        Some(RawResolve::Name(s.to_owned()))
    }
}
by_form!(RawResolve);

/// The top-level `dns:` section: how `resolve:` servers are found.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawDns {
    #[serde(default)]
    nameservers: Vec<String>,
    min_ttl: Option<Dur>,
    max_ttl: Option<Dur>,
    timeout: Option<Dur>,
    #[serde(default)]
    required: bool,
}

/// `balance: least_request | round_robin` or `balance: { hash: <key> }`.
pub enum RawBalance {
    Name(String),
    Hash(RawHash),
}

impl Forms for RawBalance {
    const EXPECTING: &'static str = "least_request, round_robin or `{ hash: KEY }`";
    fn text(s: &str) -> Option<Self> {
        Some(RawBalance::Name(s.to_owned()))
    }
    fn map<'de, M: MapAccess<'de>>(map: M) -> Option<Result<Self, M::Error>> {
        Some(read_map(map).map(RawBalance::Hash))
    }
}
by_form!(RawBalance);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHash {
    hash: KeyList,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRetry {
    attempts: Option<u32>,
    on: Option<Vec<RawRetryOn>>,
    per_try_timeout: Option<Dur>,
    budget: Option<RawBudget>,
}

/// A retry condition: a name or a status code.
pub enum RawRetryOn {
    Status(u16),
    Name(String),
}

impl Forms for RawRetryOn {
    const EXPECTING: &'static str = "a retry condition: connect_failure, reset_before_response, 502, 503 or 504";
    fn text(s: &str) -> Option<Self> {
        Some(RawRetryOn::Name(s.to_owned()))
    }
    fn number(n: u64) -> Option<Self> {
        Some(u16::try_from(n).map_or_else(|_| RawRetryOn::Name(n.to_string()), RawRetryOn::Status))
    }
}
by_form!(RawRetryOn);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    ratio: Option<f32>,
    min_per_s: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealth {
    path: String,
    interval: Option<Dur>,
    timeout: Option<Dur>,
    healthy: Option<u32>,
    unhealthy: Option<u32>,
    expect: Option<RawExpect>,
}

/// `expect: 200` or `expect: 200-399`.
pub enum RawExpect {
    Status(u16),
    Range(String),
}

impl Forms for RawExpect {
    const EXPECTING: &'static str = "a status code (200) or a range of them (200-399)";
    fn text(s: &str) -> Option<Self> {
        Some(RawExpect::Range(s.to_owned()))
    }
    fn number(n: u64) -> Option<Self> {
        Some(u16::try_from(n).map_or_else(|_| RawExpect::Range(n.to_string()), RawExpect::Status))
    }
}
by_form!(RawExpect);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOutlier {
    consecutive_failures: Option<u32>,
    base_ejection_time: Option<Dur>,
    max_ejection_time: Option<Dur>,
    max_ejected_percent: Option<u32>,
}

/// The group fields of one upstream, before validation.
pub struct RawGroup {
    pub servers: Vec<RawServer>,
    pub balance: Option<RawBalance>,
    pub retry: Option<RawRetry>,
    pub health: Option<RawHealth>,
    pub outlier: Option<RawOutlier>,
}

/// A validated group.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupConfig {
    pub servers: Vec<GroupServer>,
    pub balance: Balance,
    pub retry: Retry,
    pub health: Option<Health>,
    pub outlier: Outlier,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupServer {
    /// `host:port`, the port explicit (for `resolve: srv`, the port is the records').
    pub authority: http::uri::Authority,
    /// 1..=[`MAX_WEIGHT`] (for `resolve: srv`, the records' weights instead).
    pub weight: u32,
    pub resolve: Resolve,
}

/// Whether a server is one fixed address or the addresses DNS gives for its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolve {
    /// One server: the name (if any) is resolved by the system at each new connection.
    Fixed,
    /// Every A and AAAA address of the name is a server (on the URL's port), followed by TTL.
    Addresses,
    /// The SRV records of the name give each server's host, port and weight.
    Srv,
}

/// `dns:`: the resolver of `resolve:` servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsConfig {
    /// Name servers to ask (UDP, then TCP on truncation); empty: those of `/etc/resolv.conf`.
    pub nameservers: Vec<std::net::SocketAddr>,
    /// A record's TTL is followed, but never more often than this…
    pub min_ttl: Duration,
    /// …nor less often than this.
    pub max_ttl: Duration,
    /// One query's wait for an answer.
    pub timeout: Duration,
    /// `tollgate run` fails to start when a `resolve:` name has no address at start.
    pub required: bool,
}

impl Default for DnsConfig {
    fn default() -> Self {
        DnsConfig {
            nameservers: Vec::new(),
            min_ttl: Duration::from_secs(1),
            max_ttl: Duration::from_secs(300),
            timeout: Duration::from_secs(2),
            required: false,
        }
    }
}

impl RawDns {
    pub fn validate(self) -> Result<DnsConfig, Invalid> {
        let at = |f: &str| vec![key("dns"), key(f)];
        let d = DnsConfig::default();
        let mut nameservers = Vec::with_capacity(self.nameservers.len());
        for (i, n) in self.nameservers.iter().enumerate() {
            let addr = n
                .parse::<std::net::SocketAddr>()
                .or_else(|_| n.parse::<std::net::IpAddr>().map(|ip| std::net::SocketAddr::new(ip, 53)))
                .map_err(|_| {
                    let mut p = at("nameservers");
                    p.push(Seg::Index(i));
                    (p, format!("`{n}` is not an IP address; expected e.g. 10.0.0.2 or 127.0.0.1:5353"))
                })?;
            nameservers.push(addr);
        }
        let min_ttl = self.min_ttl.map_or(d.min_ttl, |v| v.0);
        let max_ttl = self.max_ttl.map_or(d.max_ttl.max(min_ttl), |v| v.0);
        if min_ttl < Duration::from_millis(100) {
            return Err((at("min_ttl"), "expected at least 100ms (a floor under each record's TTL)".to_owned()));
        }
        if max_ttl < min_ttl {
            return Err((at("max_ttl"), "shorter than `min_ttl`; expected at least as long".to_owned()));
        }
        let timeout = self.timeout.map_or(d.timeout, |v| v.0);
        if timeout.is_zero() {
            return Err((at("timeout"), "expected a duration above zero".to_owned()));
        }
        Ok(DnsConfig { nameservers, min_ttl, max_ttl, timeout, required: self.required })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Balance {
    /// Power of two choices over in-flight requests × decaying peak latency, by weight.
    LeastRequest,
    /// Weighted round robin.
    RoundRobin,
    /// Rendezvous hashing of the request's key: affinity, and removing a server moves only its keys.
    Hash(KeySpec),
}

/// Which failures may be retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetryOn {
    pub connect_failure: bool,
    pub reset_before_response: bool,
    pub status_502: bool,
    pub status_503: bool,
    /// An upstream 504, and a try that passed `per_try_timeout` (tollgate's own 504).
    pub status_504: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Retry {
    /// Tries in all, the first included (1: no retries).
    pub attempts: u32,
    pub on: RetryOn,
    /// Each try's wait for a response head; the upstream's `timeout` bounds them all together.
    pub per_try_timeout: Option<Duration>,
    /// Retries may add this share of the requests of the last 10 s…
    pub ratio: f32,
    /// …plus this many per second.
    pub min_per_s: u32,
}

impl Default for Retry {
    fn default() -> Self {
        Retry {
            attempts: 2,
            on: RetryOn { connect_failure: true, ..RetryOn::default() },
            per_try_timeout: None,
            ratio: 0.2,
            min_per_s: 3,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Path (and query) of the check, `/` first.
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    /// Consecutive passing checks that mark a server healthy again.
    pub healthy: u32,
    /// Consecutive failing checks that mark it unhealthy.
    pub unhealthy: u32,
    /// Statuses that pass, inclusive.
    pub expect: (u16, u16),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outlier {
    /// Consecutive connect failures or 5xx answers that eject a server (0: never).
    pub consecutive_failures: u32,
    /// The first ejection's length; the n-th lasts n times as long…
    pub base_ejection_time: Duration,
    /// …up to this.
    pub max_ejection_time: Duration,
    /// Passive ejection never takes out more than this share of the group.
    pub max_ejected_percent: u32,
}

impl Default for Outlier {
    fn default() -> Self {
        Outlier {
            consecutive_failures: 5,
            base_ejection_time: Duration::from_secs(30),
            max_ejection_time: Duration::from_secs(300),
            max_ejected_percent: 50,
        }
    }
}

/// `least_request`, `round_robin` or `hash: <key>`.
pub fn describe_balance(b: &Balance) -> String {
    match b {
        Balance::LeastRequest => "least_request".to_owned(),
        Balance::RoundRobin => "round_robin".to_owned(),
        Balance::Hash(k) => {
            let parts: Vec<String> = k.parts().iter().map(ToString::to_string).collect();
            format!("hash: {}", parts.join(", "))
        }
    }
}

impl RetryOn {
    /// The conditions as `retry.on` spells them.
    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.connect_failure, "connect_failure"),
            (self.reset_before_response, "reset_before_response"),
            (self.status_502, "502"),
            (self.status_503, "503"),
            (self.status_504, "504"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }
}

impl RawGroup {
    /// `at(field)` is the path of a field of this upstream. Returns the group and whether
    /// its servers are https.
    pub fn validate(self, at: &dyn Fn(&str) -> Vec<Seg>) -> Result<(GroupConfig, String, bool), Invalid> {
        let sub = |field: &str, rest: &[Seg]| {
            let mut p = at(field);
            p.extend_from_slice(rest);
            p
        };
        if self.servers.is_empty() {
            return Err((at("servers"), "expected at least one server: `- url: http://host:port`".to_owned()));
        }
        if self.servers.len() > MAX_SERVERS {
            return Err((at("servers"), format!("{} servers; at most {MAX_SERVERS} in one group", self.servers.len())));
        }
        let mut servers = Vec::with_capacity(self.servers.len());
        let mut first: Option<(String, bool)> = None;
        for (i, s) in self.servers.iter().enumerate() {
            let here = |f: &str| sub("servers", &[Seg::Index(i), key(f)]);
            let (authority, base, https) = super::parse_upstream_url(&s.url).map_err(|e| (here("url"), e))?;
            match &first {
                None => first = Some((base, https)),
                Some((b, h)) => {
                    if *h != https {
                        return Err((
                            here("url"),
                            format!(
                                "every server of a group has the same scheme; the first is {}, this one is {}",
                                if *h { "https://" } else { "http://" },
                                if https { "https://" } else { "http://" }
                            ),
                        ));
                    }
                    if *b != base {
                        return Err((
                            here("url"),
                            format!(
                                "every server of a group has the same path; the first has `{b}`, this one `{base}`"
                            ),
                        ));
                    }
                }
            }
            if servers.iter().any(|g: &GroupServer| g.authority == authority) {
                return Err((here("url"), format!("`{authority}` is listed twice")));
            }
            let weight = s.weight.unwrap_or(1);
            if !(1..=MAX_WEIGHT).contains(&weight) {
                return Err((here("weight"), format!("weight {weight}; expected 1 to {MAX_WEIGHT}")));
            }
            let resolve = match &s.resolve {
                None | Some(RawResolve::Flag(false)) => Resolve::Fixed,
                Some(RawResolve::Flag(true)) => Resolve::Addresses,
                Some(RawResolve::Name(n)) if n == "srv" => Resolve::Srv,
                Some(RawResolve::Name(n)) => {
                    return Err((here("resolve"), format!("`{n}`; expected true (A and AAAA records) or srv")))
                }
            };
            let literal = authority.host().starts_with('[') || authority.host().parse::<std::net::IpAddr>().is_ok();
            if resolve != Resolve::Fixed && literal {
                return Err((here("resolve"), format!("`{}` is an address, not a name to resolve", authority.host())));
            }
            if resolve == Resolve::Srv {
                if s.weight.is_some() {
                    return Err((
                        here("weight"),
                        "the SRV records give the weights of `resolve: srv` servers".to_owned(),
                    ));
                }
                if s.url.parse::<http::Uri>().ok().and_then(|u| u.port_u16()).is_some() {
                    return Err((
                        here("url"),
                        format!(
                            "`{}` has a port; the SRV records give the ports (e.g. http://_http._tcp.api.internal)",
                            s.url
                        ),
                    ));
                }
            }
            servers.push(GroupServer { authority, weight, resolve });
        }
        let (base, https) = first.unwrap_or_default();
        let balance = match self.balance {
            None => Balance::LeastRequest,
            Some(RawBalance::Name(n)) => match n.as_str() {
                "least_request" => Balance::LeastRequest,
                "round_robin" => Balance::RoundRobin,
                other => {
                    return Err((
                        at("balance"),
                        format!("unknown balance `{other}`; expected least_request, round_robin or {{hash: <key>}}"),
                    ))
                }
            },
            Some(RawBalance::Hash(h)) => {
                let at_hash = || sub("balance", &[key("hash")]);
                let mut parts = Vec::with_capacity(h.hash.0.len());
                for p in &h.hash.0 {
                    parts.push(p.parse::<KeyPart>().map_err(|e| (at_hash(), e.to_string()))?);
                }
                Balance::Hash(KeySpec::new(parts).map_err(|e| (at_hash(), e.to_string()))?)
            }
        };
        let retry = match self.retry {
            None => Retry::default(),
            Some(r) => validate_retry(r, &|f| sub("retry", &[key(f)]))?,
        };
        let health = self.health.map(|h| validate_health(h, &|f| sub("health", &[key(f)]))).transpose()?;
        let outlier = match self.outlier {
            None => Outlier::default(),
            Some(o) => {
                let d = Outlier::default();
                let here = |f: &str| sub("outlier", &[key(f)]);
                let base_ejection_time = o.base_ejection_time.map_or(d.base_ejection_time, |v| v.0);
                let max_ejection_time =
                    o.max_ejection_time.map_or(d.max_ejection_time.max(base_ejection_time), |v| v.0);
                if base_ejection_time.is_zero() {
                    return Err((here("base_ejection_time"), "expected a duration above zero".to_owned()));
                }
                if max_ejection_time < base_ejection_time {
                    return Err((
                        here("max_ejection_time"),
                        "shorter than `base_ejection_time`; expected at least as long".to_owned(),
                    ));
                }
                let max_ejected_percent = o.max_ejected_percent.unwrap_or(d.max_ejected_percent);
                if max_ejected_percent > 100 {
                    return Err((here("max_ejected_percent"), format!("{max_ejected_percent}; expected 0 to 100")));
                }
                Outlier {
                    consecutive_failures: o.consecutive_failures.unwrap_or(d.consecutive_failures),
                    base_ejection_time,
                    max_ejection_time,
                    max_ejected_percent,
                }
            }
        };
        Ok((GroupConfig { servers, balance, retry, health, outlier }, base, https))
    }
}

fn validate_retry(r: RawRetry, at: &dyn Fn(&str) -> Vec<Seg>) -> Result<Retry, Invalid> {
    let d = Retry::default();
    let attempts = r.attempts.unwrap_or(d.attempts);
    if !(1..=10).contains(&attempts) {
        return Err((at("attempts"), format!("{attempts}; expected 1 (no retries) to 10 tries in all")));
    }
    let on = match r.on {
        None => d.on,
        Some(list) => {
            let mut on = RetryOn::default();
            for (i, c) in list.iter().enumerate() {
                let here = || {
                    let mut p = at("on");
                    p.push(Seg::Index(i));
                    p
                };
                match c {
                    RawRetryOn::Status(502) => on.status_502 = true,
                    RawRetryOn::Status(503) => on.status_503 = true,
                    RawRetryOn::Status(504) => on.status_504 = true,
                    RawRetryOn::Name(n) if n == "502" => on.status_502 = true,
                    RawRetryOn::Name(n) if n == "503" => on.status_503 = true,
                    RawRetryOn::Name(n) if n == "504" => on.status_504 = true,
                    RawRetryOn::Name(n) if n == "connect_failure" => on.connect_failure = true,
                    RawRetryOn::Name(n) if n == "reset_before_response" => on.reset_before_response = true,
                    RawRetryOn::Status(s) => {
                        return Err((here(), format!("{s} cannot be retried; expected 502, 503 or 504")))
                    }
                    RawRetryOn::Name(n) => {
                        return Err((
                            here(),
                            format!(
                                "unknown retry condition `{n}`; expected connect_failure, reset_before_response, \
                                 502, 503 or 504"
                            ),
                        ))
                    }
                }
            }
            on
        }
    };
    let per_try_timeout = r.per_try_timeout.map(|t| t.0);
    if per_try_timeout.is_some_and(|t| t.is_zero()) {
        return Err((at("per_try_timeout"), "expected a duration above zero".to_owned()));
    }
    let (ratio, min_per_s) = match r.budget {
        None => (d.ratio, d.min_per_s),
        Some(b) => {
            let ratio = b.ratio.unwrap_or(d.ratio);
            let at_b = |f: &str| {
                let mut p = at("budget");
                p.push(key(f));
                p
            };
            if !(0.0..=1000.0).contains(&ratio) || ratio.is_nan() {
                return Err((at_b("ratio"), format!("{ratio}; expected 0 to 1000 (0.2: retries add at most 20 %)")));
            }
            let min_per_s = b.min_per_s.unwrap_or(d.min_per_s);
            if min_per_s > 1_000_000 {
                return Err((at_b("min_per_s"), format!("{min_per_s}; expected at most 1000000")));
            }
            (ratio, min_per_s)
        }
    };
    Ok(Retry { attempts, on, per_try_timeout, ratio, min_per_s })
}

fn validate_health(h: RawHealth, at: &dyn Fn(&str) -> Vec<Seg>) -> Result<Health, Invalid> {
    if !h.path.starts_with('/') || h.path.parse::<http::uri::PathAndQuery>().is_err() {
        return Err((at("path"), format!("`{}` is not a path; expected e.g. /healthz", h.path)));
    }
    let interval = h.interval.map_or(Duration::from_secs(5), |d| d.0);
    if interval < Duration::from_millis(10) {
        return Err((at("interval"), "expected at least 10ms".to_owned()));
    }
    let timeout = h.timeout.map_or(Duration::from_secs(1).min(interval), |d| d.0);
    if timeout.is_zero() {
        return Err((at("timeout"), "expected a duration above zero".to_owned()));
    }
    let count = |v: Option<u32>, f: &str, dflt: u32| match v {
        Some(0) => Err((at(f), format!("`{f}` counts consecutive checks; expected at least 1"))),
        Some(n) => Ok(n),
        None => Ok(dflt),
    };
    let healthy = count(h.healthy, "healthy", 2)?;
    let unhealthy = count(h.unhealthy, "unhealthy", 3)?;
    let expect = match h.expect {
        None => (200, 399),
        Some(RawExpect::Status(s)) => (s, s),
        Some(RawExpect::Range(r)) => parse_range(&r).map_err(|e| (at("expect"), e))?,
    };
    if expect.0 < 100 || expect.1 > 999 || expect.0 > expect.1 {
        return Err((at("expect"), format!("{}-{}: expected statuses from 100 to 999, low first", expect.0, expect.1)));
    }
    Ok(Health { path: h.path, interval, timeout, healthy, unhealthy, expect })
}

fn parse_range(r: &str) -> Result<(u16, u16), String> {
    let bad = || format!("`{r}` is not a status or a range; expected e.g. 200 or 200-399");
    match r.split_once('-') {
        None => r.trim().parse::<u16>().map(|s| (s, s)).map_err(|_| bad()),
        Some((lo, hi)) => Ok((lo.trim().parse().map_err(|_| bad())?, hi.trim().parse().map_err(|_| bad())?)),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::{Config, UpstreamKind};

    fn upstream(body: &str) -> String {
        format!("upstreams:\n  api:\n{body}routes:\n  - upstream: api\n")
    }

    fn group(body: &str) -> GroupConfig {
        let c = Config::from_yaml(Path::new("p.yaml"), &upstream(body)).unwrap_or_else(|e| panic!("{e}"));
        match &c.upstreams[0].kind {
            UpstreamKind::Http(h) => (**h.group.as_ref().expect("a group")).clone(),
            UpstreamKind::Respond(_) => panic!("not http"),
        }
    }

    /// (line, field path, a word of the message)
    fn fails(body: &str) -> (usize, String, String) {
        match Config::from_yaml(Path::new("p.yaml"), &upstream(body)) {
            Ok(_) => panic!("should be refused:\n{body}"),
            Err(e) => (e.line, e.path, e.message),
        }
    }

    #[test]
    fn a_group_with_every_field() {
        let g = group(
            "    servers:
      - { url: http://10.0.0.1:3000, weight: 3 }
      - url: http://10.0.0.2:3000
    balance: { hash: [client_ip, header:x-session] }
    retry: { attempts: 3, on: [connect_failure, reset_before_response, 502, 503, 504], per_try_timeout: 2s, budget: { ratio: 0.1, min_per_s: 5 } }
    health: { path: /healthz, interval: 2s, timeout: 500ms, healthy: 1, unhealthy: 4, expect: 200-299 }
    outlier: { consecutive_failures: 7, base_ejection_time: 10s, max_ejection_time: 1m, max_ejected_percent: 30 }
",
        );
        assert_eq!(g.servers.len(), 2);
        assert_eq!((g.servers[0].weight, g.servers[1].weight), (3, 1));
        assert_eq!(describe_balance(&g.balance), "hash: client_ip, header:x-session");
        assert_eq!(g.retry.attempts, 3);
        assert_eq!(g.retry.on.names(), ["connect_failure", "reset_before_response", "502", "503", "504"]);
        assert_eq!(g.retry.per_try_timeout, Some(Duration::from_secs(2)));
        assert_eq!((g.retry.ratio, g.retry.min_per_s), (0.1, 5));
        let h = g.health.unwrap();
        assert_eq!((h.path.as_str(), h.healthy, h.unhealthy, h.expect), ("/healthz", 1, 4, (200, 299)));
        assert_eq!(g.outlier.consecutive_failures, 7);
        assert_eq!(g.outlier.max_ejected_percent, 30);
    }

    #[test]
    fn defaults_balance_by_least_request_and_retry_connect_failures_once() {
        let g = group("    servers: [{ url: http://a:1 }, { url: http://b:2 }]\n");
        assert_eq!(g.balance, Balance::LeastRequest);
        assert_eq!(g.retry, Retry::default());
        assert_eq!(g.retry.on.names(), ["connect_failure"]);
        assert_eq!(g.outlier, Outlier::default());
        assert!(g.health.is_none());
    }

    #[test]
    fn servers_may_be_found_by_dns() {
        let g = group(
            "    servers:
      - { url: http://api.internal:8080, resolve: true, weight: 3 }
      - { url: http://_http._tcp.api.internal, resolve: srv }
      - { url: http://10.0.0.1:80, resolve: false }
",
        );
        let r: Vec<Resolve> = g.servers.iter().map(|s| s.resolve).collect();
        assert_eq!(r, [Resolve::Addresses, Resolve::Srv, Resolve::Fixed]);
        assert_eq!(g.servers[0].weight, 3);
        let c = Config::from_yaml(Path::new("p.yaml"), &upstream("    url: http://a:1\n")).unwrap();
        assert_eq!(c.dns, DnsConfig::default(), "no `dns:` section: resolv.conf, 1s to 5m");
    }

    #[test]
    fn the_dns_section_is_checked() {
        let ok = Config::from_yaml(
            Path::new("p.yaml"),
            "dns: { nameservers: [10.0.0.2, \"127.0.0.1:5353\"], min_ttl: 5s, max_ttl: 1m, timeout: 1s, required: true }\nupstreams:\n  api: { url: http://a:1 }\nroutes:\n  - upstream: api\n",
        )
        .unwrap();
        let want: Vec<std::net::SocketAddr> = vec!["10.0.0.2:53".parse().unwrap(), "127.0.0.1:5353".parse().unwrap()];
        assert_eq!(ok.dns.nameservers, want);
        assert_eq!(
            (ok.dns.min_ttl, ok.dns.max_ttl, ok.dns.required),
            (Duration::from_secs(5), Duration::from_secs(60), true)
        );
        let bad = |dns: &str| {
            let yaml = format!("dns: {dns}\nupstreams:\n  api: {{ url: http://a:1 }}\nroutes:\n  - upstream: api\n");
            match Config::from_yaml(Path::new("p.yaml"), &yaml) {
                Ok(_) => panic!("should be refused: {dns}"),
                Err(e) => (e.path, e.message),
            }
        };
        let (p, m) = bad("{ nameservers: [dns.example] }");
        assert_eq!(p, "dns.nameservers[0]");
        assert!(m.contains("not an IP address"), "{m}");
        assert_eq!(bad("{ min_ttl: 10s, max_ttl: 5s }").0, "dns.max_ttl");
        assert_eq!(bad("{ min_ttl: 1ms }").0, "dns.min_ttl");
        assert_eq!(bad("{ resolver: x }").0, "dns.resolver");
    }

    #[test]
    fn a_single_url_stays_a_single_server() {
        let c = Config::from_yaml(Path::new("p.yaml"), &upstream("    url: http://10.0.0.1:3000\n")).unwrap();
        let UpstreamKind::Http(h) = &c.upstreams[0].kind else { panic!() };
        assert!(h.group.is_none());
    }

    #[test]
    fn broken_groups_name_line_and_field() {
        let cases: &[(&str, usize, &str, &str)] = &[
            ("    url: http://a:1\n    servers: [{ url: http://b:1 }]\n", 4, "upstreams.api.servers", "either"),
            ("    servers: []\n", 3, "upstreams.api.servers", "at least one"),
            (
                "    servers:\n      - url: http://a:1\n      - url: https://b:1\n",
                5,
                "upstreams.api.servers[1].url",
                "same scheme",
            ),
            (
                "    servers:\n      - url: http://a:1\n        weight: 0\n",
                5,
                "upstreams.api.servers[0].weight",
                "1 to",
            ),
            ("    servers: [{ url: http://a:1 }, { url: http://a:1 }]\n", 3, "upstreams.api.servers[1].url", "twice"),
            ("    servers: [{ url: http://a:1 }]\n    balance: random\n", 4, "upstreams.api.balance", "least_request"),
            ("    servers: [{ url: http://a:1 }]\n    balance: { hash: ip }\n", 4, "upstreams.api.balance.hash", "ip"),
            (
                "    servers: [{ url: http://a:1 }]\n    retry: { attempts: 0 }\n",
                4,
                "upstreams.api.retry.attempts",
                "1",
            ),
            ("    servers: [{ url: http://a:1 }]\n    retry: { on: [500] }\n", 4, "upstreams.api.retry.on[0]", "500"),
            (
                "    servers: [{ url: http://a:1 }]\n    retry: { budget: { ratio: -1 } }\n",
                4,
                "upstreams.api.retry.budget.ratio",
                "0 to 1000",
            ),
            (
                "    servers: [{ url: http://a:1 }]\n    health: { path: healthz }\n",
                4,
                "upstreams.api.health.path",
                "path",
            ),
            (
                "    servers: [{ url: http://a:1 }]\n    health: { path: /h, expect: 399-200 }\n",
                4,
                "upstreams.api.health.expect",
                "low first",
            ),
            (
                "    servers: [{ url: http://a:1 }]\n    outlier: { max_ejected_percent: 101 }\n",
                4,
                "upstreams.api.outlier.max_ejected_percent",
                "0 to 100",
            ),
            ("    url: http://a:1\n    balance: round_robin\n", 4, "upstreams.api.balance", "servers"),
            ("    servers: [{ url: https://a:1 }, { url: https://b:1 }]\n", 3, "upstreams.api.servers", "server_name"),
            (
                "    servers: [{ url: http://10.0.0.1:80, resolve: true }]\n",
                3,
                "upstreams.api.servers[0].resolve",
                "an address",
            ),
            ("    servers: [{ url: http://a:80, resolve: aaaa }]\n", 3, "upstreams.api.servers[0].resolve", "srv"),
            ("    servers: [{ url: https://_https._tcp.a, resolve: srv }]\n", 3, "upstreams.api.server_name", "SRV"),
            (
                "    servers: [{ url: http://_http._tcp.a:8080, resolve: srv }]\n",
                3,
                "upstreams.api.servers[0].url",
                "SRV records give the ports",
            ),
            (
                "    servers: [{ url: http://_http._tcp.a, resolve: srv, weight: 2 }]\n",
                3,
                "upstreams.api.servers[0].weight",
                "SRV records give the weights",
            ),
        ];
        for (body, line, path, word) in cases {
            let (l, p, m) = fails(body);
            assert_eq!((l, p.as_str()), (*line, *path), "{body}: {m}");
            assert!(m.contains(word), "{body}: {m}");
        }
    }
}
