//! `tollgate explain`: each route's limits in plain words, with the Retry-After a client
//! sees when it overruns them — the real algorithm decides that request, not a restatement.

mod gateway;

pub use gateway::describe as describe_gateway;

use std::fmt::Write;
use std::time::Duration;

use crate::config::units::Dur;
use crate::config::{CertSource, Config, LimitConfig, Mode, StoreKind};
use crate::limit::{self, Decision, KeyPart, NonZeroSpan, Span};
use crate::ratelimit::retry_after_secs;

fn dur(d: Span) -> String {
    Dur(Duration::from_micros(d.as_micros())).to_string()
}

fn who(limit: &LimitConfig) -> String {
    let parts: Vec<String> = limit
        .key
        .parts()
        .iter()
        .map(|p| match p {
            KeyPart::Route => "the whole route".to_owned(),
            KeyPart::ClientIp => "client IP".to_owned(),
            KeyPart::Path => "path".to_owned(),
            KeyPart::Header(h) => format!("header {h}"),
            KeyPart::Query(q) => format!("query parameter {q}"),
            KeyPart::TlsClient => "TLS client certificate".to_owned(),
            KeyPart::Consumer => "verified consumer".to_owned(),
            KeyPart::Claim(c) => format!("verified claim {c}"),
            KeyPart::Cookie(c) => format!("cookie {c}"),
        })
        .collect();
    if parts.len() == 1 && parts[0] == "the whole route" {
        "for the whole route".to_owned()
    } else {
        format!("per {}", parts.join(" + "))
    }
}

/// How a split route chooses its side, in plain words.
fn describe_split(s: &crate::config::split::Split) -> String {
    let mut out = match &s.sticky {
        None => "each request drawn by weight".to_owned(),
        Some(k) => {
            let parts: Vec<String> = k.parts().iter().map(ToString::to_string).collect();
            format!(
                "sticky by {}: the same key always goes to the same side (while the weights stay)",
                parts.join(" + ")
            )
        }
    };
    if let Some(o) = &s.overrides {
        let values: Vec<String> =
            o.values.iter().map(|(v, i)| format!("{} -> {}", v.to_str().unwrap_or("?"), s.sides[*i].name)).collect();
        out.push_str(&format!("; header {} chooses: {}", o.header, values.join(", ")));
    }
    out.push_str("; limits and stale copies are the route's, whichever side answers");
    out
}

/// A group's servers and policies in plain words. Their health is live state: a running
/// instance shows it at `/config` and `/readyz`.
fn describe_group(
    g: &crate::config::group::GroupConfig,
    https: bool,
    dns: &crate::config::group::DnsConfig,
) -> Vec<String> {
    use crate::config::group::Resolve;
    let scheme = if https { "https" } else { "http" };
    let servers: Vec<String> = g
        .servers
        .iter()
        .map(|s| {
            let weight = if s.weight == 1 { String::new() } else { format!(" (weight {})", s.weight) };
            match s.resolve {
                Resolve::Fixed => format!("{scheme}://{}{weight}", s.authority),
                Resolve::Addresses => format!(
                    "every A/AAAA address of {} on port {}{weight}",
                    s.authority.host(),
                    s.authority.port_u16().unwrap_or(80)
                ),
                Resolve::Srv => format!("the SRV records of {} (host, port, weight)", s.authority.host()),
            }
        })
        .collect();
    let mut out = vec![format!(
        "{} server(s), balanced by {}: {} (health now: see /config on the admin listener)",
        servers.len(),
        crate::config::group::describe_balance(&g.balance),
        servers.join(", ")
    )];
    if g.servers.iter().any(|s| s.resolve != Resolve::Fixed) {
        let asked = if dns.nameservers.is_empty() {
            "the name servers of /etc/resolv.conf".to_owned()
        } else {
            dns.nameservers.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        };
        out.push(format!(
            "names looked up at {asked} again when their TTL ends (at least {} apart, at most {}); a failed lookup keeps the last good servers, a name never resolved gives none (503 while no other server can take requests)",
            Dur(dns.min_ttl),
            Dur(dns.max_ttl)
        ));
    }
    let r = &g.retry;
    if r.attempts > 1 {
        out.push(format!(
            "up to {} tries in all, each retry on a server not yet tried, on {}{}; retries at most {} % of requests plus {}/s (10 s window)",
            r.attempts,
            r.on.names().join(", "),
            r.per_try_timeout.map_or(String::new(), |t| format!(", each try within {}", Dur(t))),
            (f64::from(r.ratio) * 1000.0).round() / 10.0,
            r.min_per_s
        ));
    } else {
        out.push("no retries".to_owned());
    }
    let o = &g.outlier;
    if o.consecutive_failures > 0 {
        out.push(format!(
            "a server is ejected after {} consecutive failures for {} (growing to {}), at most {} % of the group",
            o.consecutive_failures,
            Dur(o.base_ejection_time),
            Dur(o.max_ejection_time),
            o.max_ejected_percent
        ));
    }
    if let Some(h) = &g.health {
        out.push(format!(
            "health check GET {} every {} (timeout {}): down after {} failures, up after {} passes, expecting {}-{}",
            h.path,
            Dur(h.interval),
            Dur(h.timeout),
            h.unhealthy,
            h.healthy,
            h.expect.0,
            h.expect.1
        ));
    }
    out
}

/// The units `explain` writes an algorithm's words in ([`limit::algo::Rule::describe`]).
struct Units;

impl limit::algo::Words for Units {
    fn span(&self, d: Span) -> String {
        dur(d)
    }

    fn per_second(&self, interval: NonZeroSpan) -> String {
        per_second(interval)
    }

    fn costs(&self, cost: u64) -> String {
        if cost == 1 {
            String::new()
        } else {
            format!(" (each request costs {cost})")
        }
    }

    fn decision(&self, d: Decision) -> String {
        retry_note(d)
    }
}

/// [`Units`] for a message limit: a message over it is told its exact wait (a gRPC pushback
/// in milliseconds, a WebSocket frame held back), never a 429's whole seconds.
struct MessageUnits;

impl limit::algo::Words for MessageUnits {
    fn span(&self, d: Span) -> String {
        Units.span(d)
    }

    fn per_second(&self, interval: NonZeroSpan) -> String {
        Units.per_second(interval)
    }

    fn costs(&self, cost: u64) -> String {
        Units.costs(cost)
    }

    fn decision(&self, d: Decision) -> String {
        match d {
            Decision::Deny { retry_after, .. } => format!("is over it (admitted again after {})", dur(retry_after)),
            d => retry_note(d),
        }
    }
}

fn retry_note(d: Decision) -> String {
    match d {
        Decision::Deny { retry_after, .. } => format!("gets 429 with Retry-After: {}", retry_after_secs(retry_after)),
        // Not for a configured cost: config validation refuses one the limit never admits.
        Decision::Never { .. } => "is never admitted (its cost is above what the limit admits at once)".to_owned(),
        Decision::Delay { wait, .. } => format!("waits {}", dur(wait)),
        Decision::Allow { .. } => "is admitted".to_owned(),
    }
}

/// A route's message limits in words: what is counted, each limit (its algorithm's words, told
/// of messages), and what a stream over it gets.
fn describe_messages(m: &crate::config::messages::MessageLimits) -> Vec<String> {
    use crate::config::messages::{Action, Direction};
    let mut lines = vec![format!(
        "message limits, counted per message of a stream: a gRPC call's length-prefixed messages, a WebSocket's \
         data messages (control frames pass uncounted); a message over {} ends its stream (gRPC RESOURCE_EXHAUSTED, \
         WebSocket close 1009)",
        bytes(m.max_message_size)
    )];
    // The request words of `describe`, told of messages; a refused message gets no 429.
    for l in &m.limits {
        let way = match l.direction {
            Direction::Client => "from the client",
            Direction::Upstream => "from the upstream",
            Direction::Both => "both ways",
        };
        let cost = match l.bytes_per_unit {
            Some(unit) => format!(" (a unit per started {} of a message)", bytes(unit.get())),
            None => String::new(),
        };
        let words = describe_in(&l.limit, &MessageUnits).replace("requests", "messages").replace("request", "message");
        let then = match l.action {
            Action::Close => "over it, the stream ends: a gRPC call with RESOURCE_EXHAUSTED and \
                              grpc-retry-pushback-ms, a WebSocket with close 1008 naming the limit"
                .to_owned(),
            Action::Delay => format!(
                "over it, a message is held back until the limit admits it, at most {}; one that would wait longer \
                 ends the stream as over the limit",
                Dur(l.max_delay)
            ),
        };
        lines.push(format!("  messages {way}{cost}, {words}; {then}"));
    }
    lines
}

/// A byte count as the YAML would write it (`1MiB`, `64KiB`, `1000 bytes`).
fn bytes(n: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n != 0 && n % (1 << shift) == 0 {
            return format!("{}{unit}", n >> shift);
        }
    }
    format!("{n} bytes")
}

/// One line describing `limit`.
pub fn describe(limit: &LimitConfig) -> String {
    describe_in(limit, &Units)
}

/// One line describing `limit`, its algorithm's words in `words`.
fn describe_in(limit: &LimitConfig, words: &impl limit::algo::Words) -> String {
    let c = limit.cost;
    let body = limit.algorithm.describe(c, words);
    let mut line = format!("{} `{}`: {body}", who(limit), limit.name);
    if limit.store == StoreKind::Redis {
        line.push_str("; shared by all instances through Redis");
    }
    if let Some(h) = &limit.response_cost {
        let _ = write!(
            line,
            "; each request is admitted on an estimate of {c} and then charged the number in the response's `{h}` header (more is debited, less refunded; a debt makes the next requests wait)"
        );
    }
    if limit.early_penalty && limit.mode == Mode::Enforce {
        let _ = write!(
            line,
            "; a client back before its Retry-After is refused and told twice the wait it was last told (up to {} s)",
            crate::ratelimit::penalty_cap_secs(&limit.algorithm)
        );
    }
    if limit.mode == Mode::Shadow {
        line.push_str(" [shadow: counted and logged, never rejects]");
    }
    line
}

/// Requests a second at one every `interval`, with up to three decimals and no trailing zeros
/// (3/s is one every 333.333ms: "3", not "3.000").
fn per_second(interval: NonZeroSpan) -> String {
    let per_sec = 1_000_000.0 / interval.as_micros() as f64;
    let text = format!("{per_sec:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// The whole explanation of `config`.
/// Each listener in words: TLS and the names its certificates serve (never key material),
/// client certificates, PROXY header, redirect.
pub fn listeners(config: &Config) -> String {
    use crate::config::{ClientAuth, ProxyProtocol};
    let mut out = String::new();
    for l in &config.listeners {
        let _ = write!(out, "listener {}: ", l.addr);
        match &l.tls {
            None if l.redirect_https => out.push_str("HTTP, every request redirected to HTTPS (308)"),
            None => out.push_str("HTTP/1.1 and h2c"),
            Some(t) => {
                let alpn = t.managed.iter().any(
                    |m| matches!(&m.source, CertSource::Acme(a) if a.challenge == crate::config::Challenge::TlsAlpn01),
                );
                let alpn = if alpn { ", acme-tls/1 for ACME validations" } else { "" };
                let _ = write!(out, "TLS (h2, http/1.1{alpn}), handshake within {}", Dur(t.handshake_timeout));
                if let Some(ca) = &t.client_ca {
                    let how = match t.client_auth {
                        ClientAuth::Required => "required",
                        ClientAuth::Optional => "optional",
                    };
                    let _ = write!(out, ", client certificates {how} (CA {})", ca.display());
                }
            }
        }
        if let Some(q) = &l.http3 {
            let early = if q.early_data { "on, safe methods only" } else { "off" };
            let _ = write!(
                out,
                "; HTTP/3 on UDP {} (Alt-Svc on TCP answers): at most {} streams a connection, idle {}, 0-RTT {early}, a Retry past {} handshakes/s, {} new connections/s an address",
                l.addr.port(),
                q.max_concurrent_streams,
                Dur(q.idle_timeout),
                q.retry_above,
                q.new_connections_per_ip
            );
        }
        if l.acme_http {
            out.push_str("; answers ACME HTTP-01 validations (/.well-known/acme-challenge/) before anything else");
        }
        match l.proxy_protocol {
            None => {}
            Some(p) => {
                let v = match p {
                    ProxyProtocol::V1 => "v1",
                    ProxyProtocol::V2 => "v2",
                    ProxyProtocol::Optional => "v1 or v2 if present",
                };
                let _ = write!(out, "; PROXY protocol {v} from trusted_proxies only");
            }
        }
        out.push('\n');
        if let Some(loaded) = l.tls.as_ref().and_then(|t| t.loaded.as_ref()) {
            let mut seen: Vec<&str> = Vec::new();
            for (i, s) in loaded.served.iter().enumerate() {
                for name in &s.names {
                    if seen.contains(&name.as_str()) {
                        let _ = writeln!(
                            out,
                            "  warning: {name} is also named by an earlier certificate, which answers for it"
                        );
                    }
                    seen.push(name);
                }
                if s.names.is_empty() && i > 0 {
                    let _ = writeln!(
                        out,
                        "  warning: {} names no DNS name (no SAN, no CN): SNI never picks it",
                        s.cert.display()
                    );
                }
                let default = if i == 0 { " (also for clients without SNI or with an unknown name)" } else { "" };
                let _ = writeln!(
                    out,
                    "  certificate {}: serves {}{default}; valid until {}",
                    s.cert.display(),
                    s.names.join(", "),
                    crate::pki::x509::date(s.not_after)
                );
            }
        }
        if let Some(t) = &l.tls {
            for (i, m) in t.managed.iter().enumerate() {
                let default = i == 0 && t.certificates.is_empty();
                let _ = writeln!(out, "  {}", describe_managed(m, default));
            }
        }
    }
    out
}

/// Where a certificate tollgate gets itself comes from, in words.
fn describe_managed(m: &crate::config::ManagedCert, default: bool) -> String {
    use crate::config::managed::{LETSENCRYPT, LETSENCRYPT_STAGING};
    let default = if default { " (also for clients without SNI or with an unknown name)" } else { "" };
    let names = m.names.join(", ");
    match &m.source {
        CertSource::Acme(a) => {
            let ca = match a.directory.as_str() {
                LETSENCRYPT => "Let's Encrypt".to_owned(),
                LETSENCRYPT_STAGING => "Let's Encrypt's staging CA (browsers do not trust it: for trying the setup)".to_owned(),
                other => format!("the ACME CA at {other}"),
            };
            let how = match a.challenge {
                crate::config::Challenge::Http01 => "http-01 (the CA asks http://NAME/.well-known/acme-challenge/ on port 80; the plain listeners answer)",
                crate::config::Challenge::TlsAlpn01 => "tls-alpn-01 (the CA connects to NAME:443 with ALPN acme-tls/1; this listener answers)",
            };
            let eab = a.eab.as_ref().map(|e| format!(", account bound to key id {}", e.kid)).unwrap_or_default();
            format!(
                "certificate for {names}{default}: from {ca}, validated by {how}{eab}; stored in {} (shared by instances that mount it); renewed two thirds into its lifetime or in the CA's renewal window, retried with backoff on failure while the one in service stays; a self-signed placeholder until the first is issued",
                a.storage.display()
            )
        }
        CertSource::Internal(i) => format!(
            "certificate for {names}{default}: from tollgate's local CA (root {}; `tollgate trust --install` makes this machine trust it), valid {}, renewed two thirds into it",
            crate::config::managed::local_ca_folder(&i.storage).join("root.pem").display(),
            Dur(i.lifetime)
        ),
    }
}

/// A responder's faults in plain words, one line each.
fn describe_faults(f: &crate::config::respond::Faults, fixed: Duration) -> Vec<String> {
    use crate::config::respond::Latency;
    let ms = |d: Duration| Dur(d).to_string();
    let pct = |s: f64| format!("{:.3}", s * 100.0).trim_end_matches('0').trim_end_matches('.').to_owned() + " %";
    let mut out = Vec::new();
    out.push(match f.latency {
        None if fixed.is_zero() => "the responder answers at once".to_owned(),
        None => format!("the responder answers after {}", ms(fixed)),
        Some(Latency::Uniform { min, max }) => {
            format!("the responder's latency is uniform between {} and {}", ms(min), ms(max))
        }
        Some(Latency::Normal { p50, p99 }) => {
            format!("the responder's latency is normal: half the answers within {}, 99 % within {}", ms(p50), ms(p99))
        }
        Some(Latency::LogNormal { p50, p99 }) => format!(
            "the responder's latency is log-normal (a long tail): half the answers within {}, 99 % within {}",
            ms(p50),
            ms(p99)
        ),
    });
    if let Some(e) = f.errors {
        out.push(format!("{} of answers are errors: status {}", pct(e.share), e.status.as_u16()));
    }
    if f.resets > 0.0 {
        out.push(format!(
            "{} of answers are cut after half their body (the HTTP/1.1 connection closed, the HTTP/2 stream reset)",
            pct(f.resets)
        ));
    }
    if let Some(n) = f.body_size {
        out.push(format!("the body is {n} bytes"));
    }
    if let Some(d) = f.drip {
        out.push(format!("the body is sent {} bytes at a time, one piece every {}", d.bytes, ms(d.every)));
    }
    out.push(match f.seed {
        Some(s) => format!("draws from seed {s}: one worker (`server.workers: 1`) repeats the same sequence every run"),
        None => "draws from a random seed (give `seed` to repeat a run)".to_owned(),
    });
    out
}

pub fn explain(config: &Config) -> String {
    let mut out = String::new();
    if let Some(p) = &config.plans {
        let _ = writeln!(
            out,
            "plans: a client is named by {}; tiers {}; a client not in the map, or a request without the value, is `{}`",
            p.of,
            p.tiers.iter().map(|t| format!("`{}`", t.name)).collect::<Vec<_>>().join(", "),
            p.tiers.get(usize::from(p.default)).map_or("?", |t| t.name.as_str())
        );
    }
    if config.listeners.len() > 1 || config.listeners.iter().any(|l| !l.is_plain()) {
        out.push_str(&listeners(config));
    }
    for r in &config.routes {
        let sides: Vec<usize> = match &r.split {
            None => {
                let _ = writeln!(out, "route `{}` -> upstream `{}`", r.name, config.upstream(r).name);
                vec![r.upstream]
            }
            Some(s) => {
                let _ = writeln!(out, "route `{}` -> split: {}", r.name, s.shares());
                let _ = writeln!(out, "  {}", describe_split(s));
                s.sides.iter().map(|side| side.upstream).collect()
            }
        };
        for u in sides {
            let upstream = &config.upstreams[u];
            let indent = if r.split.is_some() { "    " } else { "  " };
            let mut lines = Vec::new();
            match &upstream.kind {
                crate::config::UpstreamKind::Http(h) => {
                    if let Some(g) = &h.group {
                        lines.extend(describe_group(g, h.tls.is_some(), &config.dns));
                    }
                }
                crate::config::UpstreamKind::Respond(resp) => {
                    if let Some(f) = &resp.faults {
                        lines.extend(describe_faults(f, resp.latency));
                    }
                }
            }
            if r.split.is_some() && !lines.is_empty() {
                let _ = writeln!(out, "  upstream `{}`:", upstream.name);
            }
            for line in lines {
                let _ = writeln!(out, "{indent}{line}");
            }
        }
        for line in crate::step::describe(r, config) {
            let _ = writeln!(out, "  {line}");
        }
        for line in gateway::describe(r) {
            let _ = writeln!(out, "  {line}");
        }
        if r.limits.is_empty() && r.concurrency.is_none() && r.message_limits.is_none() {
            let _ = writeln!(out, "  no limits");
        }
        for l in &r.limits {
            match (&l.plan, &config.plans) {
                (Some(plan), Some(plans)) => {
                    let _ = writeln!(out, "  plan limit `{}` ({}), by the client's tier:", l.name, who(l));
                    for (tier, alg) in plans.tiers.iter().zip(&plan.algorithms) {
                        let line = match alg {
                            _ if tier.deny => "every request is refused (403)".to_owned(),
                            None => "not limited by it".to_owned(),
                            Some(alg) => describe(&LimitConfig { algorithm: alg.clone(), ..l.clone() }),
                        };
                        let _ = writeln!(out, "    tier `{}`: {line}", tier.name);
                    }
                }
                _ => {
                    let _ = writeln!(out, "  {}", describe(l));
                }
            }
        }
        if let Some(m) = &r.message_limits {
            for line in describe_messages(m) {
                let _ = writeln!(out, "  {line}");
            }
        }
        if let Some(c) = &r.concurrency {
            let wait = if c.max_wait.is_zero() {
                "at once".to_owned()
            } else {
                format!("after waiting up to {}", Dur(c.max_wait))
            };
            match &c.adaptive {
                None => {
                    let _ = writeln!(
                        out,
                        "  at most {} requests in flight; the next gets 503 with Retry-After: 1 {wait}",
                        c.max
                    );
                }
                Some(a) => {
                    let _ = writeln!(
                        out,
                        "  an adaptive limit of {} to {} requests in flight, following the upstream's latency (p{} over {} windows, tolerance {}×); the next gets 503 with Retry-After: 1 {wait}",
                        a.min, a.max, a.percentile, Dur(a.window), a.tolerance
                    );
                }
            }
        }
        if r.limits.len() > 1 {
            let _ = writeln!(out, "  every limit must admit; a request one limit rejects costs nothing in the others");
        }
    }
    if let Some(name) = &config.request_id {
        let _ = writeln!(
            out,
            "every request has an id in {name}: a trusted proxy's well-formed one, else a new one; sent upstream, on every answer and in the access log"
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn a_group_is_described_with_its_servers_and_policies() {
        let yaml = "upstreams:
  api:
    servers: [{ url: http://10.0.0.1:3000, weight: 2 }, { url: http://10.0.0.2:3000 }]
    balance: round_robin
    retry: { attempts: 3, on: [connect_failure, 502], budget: { ratio: 0.1 } }
    health: { path: /healthz }
routes:
  - upstream: api
";
        let config = Config::from_yaml(Path::new("g.yaml"), yaml).unwrap();
        let text = explain(&config);
        let servers = "2 server(s), balanced by round_robin: http://10.0.0.1:3000 (weight 2), http://10.0.0.2:3000";
        assert!(text.contains(servers), "{text}");
        assert!(text.contains("up to 3 tries in all"), "{text}");
        assert!(text.contains("on connect_failure, 502; retries at most 10 % of requests plus 3/s"), "{text}");
        assert!(text.contains("health check GET /healthz every 5s"), "{text}");
    }

    #[test]
    fn servers_found_by_dns_are_described_with_their_lookups() {
        let yaml = "dns: { nameservers: [10.0.0.53], min_ttl: 2s }
upstreams:
  api:
    servers:
      - { url: http://10.0.0.1:3000 }
      - { url: http://api.internal:8080, resolve: true, weight: 2 }
      - { url: http://_http._tcp.api.internal, resolve: srv }
routes:
  - upstream: api
";
        let config = Config::from_yaml(Path::new("g.yaml"), yaml).unwrap();
        let text = explain(&config);
        let servers = "3 server(s), balanced by least_request: http://10.0.0.1:3000, every A/AAAA address of api.internal on port 8080 (weight 2), the SRV records of _http._tcp.api.internal (host, port, weight)";
        assert!(text.contains(servers), "{text}");
        assert!(
            text.contains("names looked up at 10.0.0.53:53 again when their TTL ends (at least 2s apart, at most 5m)"),
            "{text}"
        );
    }

    #[test]
    fn where_each_certificate_comes_from_in_plain_words() {
        let yaml = "listen:\n  - addr: 127.0.0.1:443\n    tls:\n      acme: { directory: letsencrypt-staging, names: [shop.example.com, [example.com, www.example.com]], storage: /var/lib/tg }\n  - { addr: 127.0.0.1:80, redirect_https: true }\n  - addr: 127.0.0.1:8443\n    tls: { internal: { storage: /tmp/dev, lifetime: 1d } }\nupstreams: { d: { respond: {} } }\nroutes: [{ upstream: d }]\n";
        let text = explain(&Config::from_yaml(Path::new("t.yaml"), yaml).unwrap());
        for want in [
            "certificate for shop.example.com (also for clients without SNI or with an unknown name): from Let's Encrypt's staging CA",
            "certificate for example.com, www.example.com: from Let's Encrypt's staging CA",
            "validated by http-01",
            "stored in /var/lib/tg",
            "a self-signed placeholder until the first is issued",
            "listener 127.0.0.1:80: HTTP, every request redirected to HTTPS (308); answers ACME HTTP-01 validations",
            "certificate for localhost, 127.0.0.1, ::1 (also for clients without SNI or with an unknown name): from tollgate's local CA (root /tmp/dev/local-ca/root.pem",
            "valid 24h, renewed two thirds into it",
        ] {
            assert!(text.contains(want), "missing {want:?} in:\n{text}");
        }
    }

    #[test]
    fn auth_and_http3_in_plain_words() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
        let text = explain(&Config::load(&root.join("limits-per-customer.yaml")).unwrap());
        assert!(
            text.contains("auth: a JWT (ES256) from a bearer token in Authorization, verified with the key set"),
            "{text}"
        );
        assert!(text.contains("the consumer is claim `sub`; a request without a valid one gets 401"), "{text}");
        assert!(text.contains("auth: an API key from header x-api-key, found by its SHA-256 in"), "{text}");
        assert!(text.contains("(2 keys)") && text.contains("the credential is not forwarded"), "{text}");
        // A 403 only where a token's audience is checked: a JWT route with `audiences`.
        let jwt = text.lines().filter(|l| l.contains("auth: a JWT")).collect::<Vec<_>>().join("\n");
        let keyed = text.lines().filter(|l| l.contains("auth: an API key")).collect::<Vec<_>>().join("\n");
        assert!(jwt.contains("(403 for a valid token meant for another audience)"), "{jwt}");
        assert!(!keyed.contains("403"), "{keyed}");

        let (cert, key) = (root.join("certs/demo-localhost.pem"), root.join("certs/demo-localhost.key"));
        let yaml = format!(
            "listen: [{{ addr: '127.0.0.1:8443', tls: {{ certificates: [{{ cert: '{}', key: '{}' }}] }}, http3: true, quic: {{ idle_timeout: 10s }} }}]\nupstreams: {{ d: {{ respond: {{}} }} }}\nroutes: [{{ upstream: d }}]\n",
            cert.display(),
            key.display()
        );
        let text = explain(&Config::from_yaml(Path::new("t.yaml"), &yaml).unwrap());
        assert!(
            text.contains(
                "; HTTP/3 on UDP 8443 (Alt-Svc on TCP answers): at most 100 streams a connection, idle 10s, 0-RTT off"
            ),
            "{text}"
        );
    }

    #[test]
    fn compression_in_plain_words() {
        let yaml = "compression: { levels: { gzip: 6 } }
upstreams: { d: { respond: {} } }
routes:
  - { name: own, upstream: d, compression: { encodings: [gzip, br], min_size: 10KiB, types: [text/html, application/*+json] } }
  - { name: off, upstream: d, compression: none }
  - { name: default, upstream: d }
";
        let text = explain(&Config::from_yaml(Path::new("c.yaml"), yaml).unwrap());
        assert!(
            text.contains("compression: gzip 4, br 4 (by Accept-Encoding's weights, this order among equal ones) for text/html, application/*+json answers of 10 KiB or more"),
            "{text}"
        );
        assert!(
            text.contains("route `off` -> upstream `d`\n  compression: none (this route turns the default off)"),
            "{text}"
        );
        assert!(text.contains("compression: zstd 3, br 4, gzip 6 (by"), "{text}");
        assert!(text.contains("event streams flushed per event"), "{text}");
    }

    #[test]
    fn message_limits_are_told_of_messages_and_of_what_a_stream_gets() {
        let yaml = "upstreams: { d: { respond: {} } }\nroutes:\n  - upstream: d\n    message_limits:\n      max_message_size: 1MiB\n      limits:\n        - { name: chat, algorithm: fixed_window, rate: 5/s, key: client_ip }\n        - { name: pace, algorithm: token_bucket, rate: 20000/s, burst: 1024, action: delay, max_delay: 2s, direction: both, cost: { bytes: 1KiB } }\n";
        let text = explain(&Config::from_yaml(Path::new("m.yaml"), yaml).unwrap());
        assert!(text.contains("a message over 1MiB ends its stream"), "{text}");
        assert!(text.contains("messages from the client, per client IP `chat`: 5 per 1s window"), "{text}");
        assert!(text.contains("message 6 is over it (admitted again after 1s)"), "{text}");
        // A wait below a second is told exactly (a 429's Retry-After would round it up to 1).
        assert!(text.contains("message 1025 of a burst is over it (admitted again after 50us)"), "{text}");
        assert!(text.contains("RESOURCE_EXHAUSTED and grpc-retry-pushback-ms, a WebSocket with close 1008"), "{text}");
        assert!(
            text.contains("messages both ways (a unit per started 1KiB of a message), for the whole route `pace`"),
            "{text}"
        );
        assert!(!text.contains("no limits"), "{text}");
        assert!(text.contains("held back until the limit admits it, at most 2s"), "{text}");
        assert!(!text.contains("429"), "{text}");
    }

    fn explained(limits: &str) -> String {
        let yaml = format!("upstreams: {{ d: {{ respond: {{}} }} }}\nroutes:\n  - upstream: d\n    limits:\n{limits}");
        explain(&Config::from_yaml(Path::new("t.yaml"), &yaml).unwrap())
    }

    #[test]
    fn huge_bursts_are_explained_without_simulating_them() {
        let text = explained("      - { name: big, algorithm: token_bucket, rate: 1000000/s, burst: 1000000000 }\n");
        assert!(text.contains("bursts of 1000000000, then 1000000 requests/s (one every 1us); request 1000000001 of a burst gets 429 with Retry-After: 1"), "{text}");
        // The largest burst `check` accepts at one token per µs: 3 × burst stays below 2^63.
        let largest = (1u64 << 63).div_ceil(3) - 1;
        let text = explained(&format!(
            "      - {{ name: big, algorithm: token_bucket, rate: 1000000/s, burst: {largest} }}\n"
        ));
        assert!(text.contains(&format!("request {} of a burst gets 429 with Retry-After: 1", largest + 1)), "{text}");
        let too_big = format!(
            "upstreams: {{ d: {{ respond: {{}} }} }}\nroutes:\n  - upstream: d\n    limits:\n      - {{ algorithm: token_bucket, rate: 1000000/s, burst: {} }}\n",
            largest + 1
        );
        assert!(Config::from_yaml(Path::new("t.yaml"), &too_big).is_err());
    }

    #[test]
    fn concurrency_caps_in_plain_words() {
        let explain_route = |extra: &str| {
            let yaml = format!("upstreams: {{ d: {{ respond: {{}} }} }}\nroutes:\n  - upstream: d\n{extra}");
            explain(&Config::from_yaml(Path::new("t.yaml"), &yaml).unwrap())
        };
        let text = explain_route("    concurrency: { max: 8, max_wait: 50ms }\n");
        assert!(
            text.contains(
                "at most 8 requests in flight; the next gets 503 with Retry-After: 1 after waiting up to 50ms"
            ),
            "{text}"
        );
        let text = explain_route("    concurrency: { adaptive: { min: 2, max: 64 } }\n");
        assert!(
            text.contains("an adaptive limit of 2 to 64 requests in flight, following the upstream's latency (p50 over 100ms windows, tolerance 1.25×); the next gets 503 with Retry-After: 1 at once"),
            "{text}"
        );
    }

    #[test]
    fn gateway_conditions_and_rules_in_plain_words() {
        let yaml = r#"upstreams: { d: { respond: {} } }
routes:
  - upstream: d
    match: { headers: { X-Api-Version: 2, ua: { regex: "curl/.*" } }, query: { debug: { present: false } } }
    rewrite: { path_regex: { pattern: "^/v2/(.*)$", replace: "/$1" } }
    request_headers: { remove: [x-token], set: { x-route: "{route} {{x}}" } }
    response_headers: { add: { x-id: "{request_id}" } }
"#;
        let text = explain(&Config::from_yaml(Path::new("t.yaml"), yaml).unwrap());
        for want in [
            "only when header x-api-version is exactly `2` and header ua matches `curl/.*` (the whole value) and query parameter debug (its first value) is absent",
            "the upstream gets the path rewritten: `^/v2/(.*)$` -> `/$1`",
            "to the request it forwards, tollgate: removes x-token; sets x-route: {route} {{x}}",
            "to every answer (its own 429s and 5xx, stale copies included), tollgate: adds x-id: {request_id}",
            "every request has an id in x-request-id",
        ] {
            assert!(text.contains(want), "{want}\n{text}");
        }
    }

    #[test]
    fn token_bucket_in_plain_words() {
        let text =
            explained("      - { name: pc, algorithm: token_bucket, rate: 100/s, burst: 200, key: client_ip }\n");
        assert!(
            text.contains("per client IP `pc`: bursts of 200, then 100 requests/s (one every 10ms); request 201 of a burst gets 429 with Retry-After: 1"),
            "{text}"
        );
    }

    #[test]
    fn an_early_retry_penalty_in_plain_words() {
        let text = explained(
            "      - { name: pc, algorithm: token_bucket, rate: 1/10s, burst: 6, key: client_ip, early_retry: { penalty: double } }\n      - { name: quiet, algorithm: fixed_window, rate: 1/m, mode: shadow, early_retry: { penalty: double } }\n",
        );
        let said =
            "a client back before its Retry-After is refused and told twice the wait it was last told (up to 60 s)";
        assert_eq!(text.matches(said).count(), 1, "only the enforced limit penalises:\n{text}");
    }

    #[test]
    fn windows_and_leaky_bucket_in_plain_words() {
        let text = explained(
            "      - { name: fw, algorithm: fixed_window, rate: 100/m }\n      - { name: lb, algorithm: leaky_bucket, rate: 10/s, max_delay: 500ms, key: header:x-user }\n",
        );
        assert!(text.contains("for the whole route `fw`: 100 per 1m window"), "{text}");
        assert!(text.contains("request 101 gets 429 with Retry-After: 60"), "{text}");
        assert!(text.contains("up to 200 can pass in a moment"), "{text}");
        assert!(text.contains("per header x-user `lb`: smoothed to one request every 100ms"), "{text}");
        assert!(text.contains("up to 6 waiting requests are delayed (at most 500ms), request 7 gets 429"), "{text}");
        assert!(text.contains("every limit must admit"), "{text}");
    }
}
