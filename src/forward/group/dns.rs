//! Servers found by DNS (`resolve:`): a group's task asks for each name's A and AAAA records
//! (or its SRV records, then their targets' addresses), again when the answer's TTL ends
//! (held between `dns.min_ttl` and `dns.max_ttl`), and every address becomes a server of the
//! group, joining balancing, ejection and health checks like a fixed one.
//!
//! Invariants: a failed lookup (or one with no records) keeps the name's last good servers;
//! a name that never resolved gives no server (the group's requests get 503 while nothing
//! else can take them), never a panic; servers that stay keep their pools and health.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::TokioResolver;

use super::{Group, Place};
use crate::config::group::{DnsConfig, GroupConfig, GroupServer, Resolve, MAX_SERVERS, MAX_WEIGHT};
use crate::metrics::DnsMetrics;

/// After a record's expiry, the next lookup waits this much more: the resolver's own cache
/// holds the answer up to the expiry itself.
const PAST_EXPIRY: Duration = Duration::from_millis(20);
/// Failed lookups are tried again sooner than a TTL, backing off up to this.
const MAX_RETRY: Duration = Duration::from_secs(30);

/// The DNS client of the groups' `resolve:` servers (one per config).
pub struct Resolver {
    inner: TokioResolver,
    cfg: DnsConfig,
}

impl Resolver {
    /// A resolver asking `cfg.nameservers`, or those of `/etc/resolv.conf` when none are given.
    ///
    /// # Errors
    /// The system's resolver configuration cannot be read.
    pub fn new(cfg: &DnsConfig) -> Result<Resolver, String> {
        let mut builder = if cfg.nameservers.is_empty() {
            TokioResolver::builder_tokio().map_err(|e| format!("reading the system's DNS configuration: {e}"))?
        } else {
            let mut c = ResolverConfig::new();
            for &addr in &cfg.nameservers {
                c.add_name_server(NameServerConfig::new(addr, Protocol::Udp));
                c.add_name_server(NameServerConfig::new(addr, Protocol::Tcp));
            }
            TokioResolver::builder_with_config(c, TokioConnectionProvider::default())
        };
        let opts = builder.options_mut();
        opts.timeout = cfg.timeout;
        opts.attempts = 2;
        opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        Ok(Resolver { inner: builder.build(), cfg: cfg.clone() })
    }

    /// The servers `server` stands for now, sorted, and how long the answer holds.
    async fn find(&self, server: &GroupServer) -> Result<(Vec<Place>, Duration), String> {
        let name = server.authority.host();
        let from: Arc<str> = Arc::from(name);
        let mut places = Vec::new();
        let valid = match server.resolve {
            Resolve::Fixed => return Err("a fixed server is not looked up".to_owned()),
            Resolve::Addresses => {
                let port = server.authority.port_u16().unwrap_or(80);
                let (ips, valid) = self.addresses(name).await?;
                for ip in ips {
                    let connect = SocketAddr::new(ip, port).to_string();
                    places.push(Place {
                        connect: Arc::from(connect),
                        authority: server.authority.clone(),
                        weight: server.weight,
                        from: Some(from.clone()),
                    });
                }
                valid
            }
            Resolve::Srv => {
                let srv = self.inner.srv_lookup(name).await.map_err(|e| e.to_string())?;
                let mut valid = srv.as_lookup().valid_until();
                let records: Vec<_> = srv.iter().collect();
                // RFC 2782: the lowest priority value is used while it has records.
                let Some(first) = records.iter().map(|r| r.priority()).min() else {
                    return Err("no SRV records".to_owned());
                };
                let chosen: Vec<_> = records.into_iter().filter(|r| r.priority() == first).collect();
                let weights = srv_weights(&chosen.iter().map(|r| r.weight()).collect::<Vec<_>>());
                let mut failed = None;
                for (r, weight) in chosen.iter().zip(weights) {
                    let target = r.target().to_utf8();
                    let host = target.trim_end_matches('.');
                    let Ok(authority) = format!("{host}:{}", r.port()).parse::<http::uri::Authority>() else {
                        failed = Some(format!("SRV target `{host}` is not a host name"));
                        continue;
                    };
                    match self.addresses(&target).await {
                        Ok((ips, until)) => {
                            valid = valid.min(until);
                            for ip in ips {
                                places.push(Place {
                                    connect: Arc::from(SocketAddr::new(ip, r.port()).to_string()),
                                    authority: authority.clone(),
                                    weight,
                                    from: Some(from.clone()),
                                });
                            }
                        }
                        Err(e) => failed = Some(format!("SRV target `{host}`: {e}")),
                    }
                }
                if places.is_empty() {
                    return Err(failed.unwrap_or_else(|| "no SRV records".to_owned()));
                }
                valid
            }
        };
        places.sort_by(|a, b| a.connect.cmp(&b.connect));
        places.dedup_by(|a, b| a.connect == b.connect);
        Ok((places, valid.saturating_duration_since(std::time::Instant::now())))
    }

    /// A name's A and AAAA addresses, and until when they hold.
    async fn addresses(&self, name: &str) -> Result<(Vec<IpAddr>, std::time::Instant), String> {
        let found = self.inner.lookup_ip(name).await.map_err(|e| e.to_string())?;
        let ips: Vec<IpAddr> = found.iter().collect();
        if ips.is_empty() {
            return Err("no A or AAAA records".to_owned());
        }
        Ok((ips, found.valid_until()))
    }
}

/// SRV weights (0–65535) as group weights (1–[`MAX_WEIGHT`]): kept when they fit, else
/// scaled to the largest; a weight of 0 (RFC 2782: rarely chosen) is the smallest, 1.
fn srv_weights(w: &[u16]) -> Vec<u32> {
    let max = u32::from(w.iter().copied().max().unwrap_or(0));
    w.iter()
        .map(|&x| {
            let x = u32::from(x);
            if max <= MAX_WEIGHT {
                x.max(1)
            } else {
                (x * MAX_WEIGHT / max).max(1)
            }
        })
        .collect()
}

/// When to look a name up again after an answer valid for `ttl`: at its expiry, but never
/// sooner than `min_ttl` nor later than `max_ttl`.
pub(super) fn next_lookup(ttl: Duration, cfg: &DnsConfig) -> Duration {
    ttl.saturating_add(PAST_EXPIRY).clamp(cfg.min_ttl, cfg.max_ttl)
}

/// When to try again after `failures` failed lookups in a row: `min_ttl`, doubling, at most
/// 30 s (or `max_ttl` if shorter).
pub(super) fn retry_in(failures: u32, cfg: &DnsConfig) -> Duration {
    let cap = MAX_RETRY.min(cfg.max_ttl).max(cfg.min_ttl);
    cfg.min_ttl.saturating_mul(1 << failures.saturating_sub(1).min(16)).min(cap)
}

/// What DNS last gave for one `servers:` entry.
#[derive(Debug, Clone, Default)]
pub(crate) struct Found {
    /// The entry as configured (to match it across a reload).
    server: Option<GroupServer>,
    /// The last good answer's servers, sorted; `None`: never resolved (or a fixed entry).
    pub(super) places: Option<Vec<Place>>,
}

impl Found {
    /// One per entry of `cfg.servers`; an entry that `previous` (the same upstream before a
    /// reload) had resolved starts from its last good servers.
    pub(super) fn start(cfg: &GroupConfig, previous: Option<&Group>) -> Vec<Found> {
        let before = previous.map(|p| p.found.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone());
        cfg.servers
            .iter()
            .map(|s| {
                if s.resolve == Resolve::Fixed {
                    return Found::default();
                }
                let places = before
                    .as_ref()
                    .and_then(|b| b.iter().find(|f| f.server.as_ref() == Some(s)))
                    .and_then(|f| f.places.clone());
                Found { server: Some(s.clone()), places }
            })
            .collect()
    }
}

/// The group's servers: fixed ones as listed, each resolved entry's in its place; an address
/// given twice is one server; at most [`MAX_SERVERS`].
pub(super) fn places(cfg: &GroupConfig, found: &[Found]) -> Vec<Place> {
    let mut out: Vec<Place> = Vec::with_capacity(cfg.servers.len());
    for (s, f) in cfg.servers.iter().zip(found) {
        let one;
        let these = match s.resolve {
            Resolve::Fixed => {
                one = [Place {
                    connect: Arc::from(s.authority.as_str()),
                    authority: s.authority.clone(),
                    weight: s.weight,
                    from: None,
                }];
                &one[..]
            }
            _ => f.places.as_deref().unwrap_or_default(),
        };
        for p in these {
            if out.len() < MAX_SERVERS && !out.iter().any(|o| o.connect == p.connect) {
                out.push(p.clone());
            }
        }
    }
    out
}

/// How `/config`, logs and metrics name a `resolve:` entry: its name, with the port for
/// A/AAAA (`api.internal:8080`), as written for SRV (`_http._tcp.api.internal`).
pub(crate) fn label(s: &GroupServer) -> String {
    match s.resolve {
        Resolve::Srv => s.authority.host().to_owned(),
        _ => s.authority.to_string(),
    }
}

impl Group {
    /// The task that finds the group's `resolve:` servers; it ends with the group.
    pub(super) fn start_discovery(self: &Arc<Self>, resolver: Arc<Resolver>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let entries: Vec<(usize, GroupServer)> =
            self.cfg.servers.iter().cloned().enumerate().filter(|(_, s)| s.resolve != Resolve::Fixed).collect();
        let metrics: Vec<DnsMetrics> =
            entries.iter().map(|(_, s)| self.make.metrics.dns(&self.name, &label(s))).collect();
        {
            let found = self.found.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for ((i, _), m) in entries.iter().zip(&metrics) {
                m.servers.set(found[*i].places.as_ref().map_or(0, |p| p.len() as i64));
            }
        }
        let group = Arc::downgrade(self);
        rt.spawn(async move {
            let start = tokio::time::Instant::now();
            let mut due = vec![start; entries.len()];
            let mut failures = vec![0u32; entries.len()];
            let mut answered = vec![false; entries.len()];
            loop {
                let Some((k, at)) = due.iter().copied().enumerate().min_by_key(|&(_, t)| t) else { return };
                tokio::time::sleep_until(at).await;
                if group.strong_count() == 0 {
                    return;
                }
                let (i, server) = &entries[k];
                // The group is not held while DNS answers: a reload may drop it meanwhile.
                let looked = resolver.find(server).await;
                let Some(g) = group.upgrade() else { return };
                let wait = g.apply(*i, server, looked, &metrics[k], &mut failures[k], &resolver.cfg);
                due[k] = tokio::time::Instant::now() + wait;
                if !std::mem::replace(&mut answered[k], true) {
                    g.answered.send_modify(|n| *n += 1);
                }
            }
        });
    }

    /// Takes a lookup's outcome for entry `i`; returns when to look again.
    fn apply(
        self: &Arc<Self>,
        i: usize,
        server: &GroupServer,
        looked: Result<(Vec<Place>, Duration), String>,
        metrics: &DnsMetrics,
        failures: &mut u32,
        cfg: &DnsConfig,
    ) -> Duration {
        let name = label(server);
        match looked {
            Ok((places, ttl)) => {
                metrics.resolved.inc();
                metrics.servers.set(places.len() as i64);
                metrics.stale.set(0);
                if std::mem::take(failures) > 0 {
                    tracing::info!(upstream = %self.name, name, "the name resolves again");
                }
                let changed = {
                    let mut found = self.found.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    let before = found[i].places.replace(places.clone());
                    before.as_ref() != Some(&places)
                };
                if changed {
                    let servers: Vec<&str> = places.iter().map(|p| &*p.connect).collect();
                    tracing::info!(upstream = %self.name, name, servers = ?servers, "servers found by DNS");
                    self.rebuild();
                }
                next_lookup(ttl, cfg)
            }
            Err(why) => {
                metrics.failed.inc();
                *failures += 1;
                let kept = {
                    let found = self.found.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    found[i].places.as_ref().map(Vec::len)
                };
                match kept {
                    Some(n) => {
                        metrics.stale.set(1);
                        tracing::warn!(upstream = %self.name, name, error = %why, kept = n, "DNS lookup failed; the last good servers stay");
                    }
                    None => tracing::warn!(
                        upstream = %self.name,
                        name,
                        error = %why,
                        "DNS lookup failed and the name never resolved: it gives no server (requests get 503 while no other server can take them)"
                    ),
                }
                retry_in(*failures, cfg)
            }
        }
    }

    /// Waits until each `resolve:` entry had its first answer, at most `within`; returns the
    /// entries that have no server then (as `label` names them).
    pub async fn first_answers(&self, within: Duration) -> Vec<String> {
        let entries = self.cfg.servers.iter().filter(|s| s.resolve != Resolve::Fixed).count();
        if entries == 0 {
            return Vec::new();
        }
        let mut rx = self.answered.subscribe();
        let _ = tokio::time::timeout(within, rx.wait_for(|n| *n >= entries)).await;
        let found = self.found.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.cfg
            .servers
            .iter()
            .zip(found.iter())
            .filter(|(s, f)| s.resolve != Resolve::Fixed && f.places.is_none())
            .map(|(s, _)| label(s))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(min: u64, max: u64) -> DnsConfig {
        DnsConfig { min_ttl: Duration::from_secs(min), max_ttl: Duration::from_secs(max), ..DnsConfig::default() }
    }

    #[test]
    fn the_next_lookup_follows_the_ttl_within_floor_and_ceiling() {
        let c = cfg(1, 300);
        // A 30 s answer is asked again just after it expires.
        assert_eq!(next_lookup(Duration::from_secs(30), &c), Duration::from_secs(30) + PAST_EXPIRY);
        // A 0 s TTL is held to the floor, a day to the ceiling.
        assert_eq!(next_lookup(Duration::ZERO, &c), Duration::from_secs(1));
        assert_eq!(next_lookup(Duration::from_secs(86_400), &c), Duration::from_secs(300));
    }

    #[test]
    fn failed_lookups_back_off_from_the_floor_to_thirty_seconds() {
        let c = cfg(1, 300);
        let waits: Vec<u64> = (1..=8).map(|n| retry_in(n, &c).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        // A ceiling under 30 s bounds the retries too; a floor above it wins.
        assert_eq!(retry_in(10, &cfg(1, 5)), Duration::from_secs(5));
        assert_eq!(retry_in(10, &cfg(60, 600)), Duration::from_secs(60));
    }

    #[test]
    fn srv_weights_keep_their_ratio_within_the_group_range() {
        assert_eq!(srv_weights(&[3, 1]), [3, 1]);
        assert_eq!(srv_weights(&[0, 10]), [1, 10]);
        assert_eq!(srv_weights(&[1000, 500, 0]), [100, 50, 1]);
        assert_eq!(srv_weights(&[65535, 1]), [100, 1]);
    }
}
