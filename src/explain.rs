//! `tollgate explain`: each route's limits in plain words, with the Retry-After a client
//! sees when it overruns them — computed by running the real algorithm, not restated.

use std::fmt::Write;
use std::time::Duration;

use crate::config::units::Dur;
use crate::config::{Config, LimitConfig, Mode, StoreKind};
use crate::limit::{self, Algorithm, Decision, KeyPart, State};
use crate::ratelimit::retry_after_secs;

fn dur(us: u64) -> String {
    Dur(Duration::from_micros(us)).to_string()
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
        })
        .collect();
    if parts.len() == 1 && parts[0] == "the whole route" {
        "for the whole route".to_owned()
    } else {
        format!("per {}", parts.join(" + "))
    }
}

/// Runs `n` requests of `cost` at one instant and returns the decision of the next one.
fn overrun(alg: &Algorithm, n: u64, cost: u64) -> Decision {
    let mut state: Option<State> = None;
    for _ in 0..n {
        let (_, next) = limit::decide(alg, state.as_ref(), 0, cost);
        state = next;
    }
    limit::decide(alg, state.as_ref(), 0, cost).0
}

fn retry_note(d: Decision) -> String {
    match d {
        Decision::Deny { retry_after, .. } => format!("gets 429 with Retry-After: {}", retry_after_secs(retry_after)),
        Decision::Delay { wait, .. } => format!("waits {}", dur(wait)),
        Decision::Allow { .. } => "is admitted".to_owned(),
    }
}

/// One line describing `limit`.
pub fn describe(limit: &LimitConfig) -> String {
    let c = limit.cost;
    let per_request = if c == 1 { String::new() } else { format!(" (each request costs {c})") };
    let body = match &limit.algorithm {
        Algorithm::TokenBucket { interval, burst, warmup } => {
            let b = burst.get();
            let fits = b / c;
            let mut s = format!(
                "bursts of {b}{per_request}, then {} requests/s (one every {}); request {} of a burst {}",
                per_second(interval.get()),
                dur(interval.get()),
                fits + 1,
                retry_note(overrun(&limit.algorithm, fits, c))
            );
            if *warmup > 0 {
                let _ = write!(
                    s,
                    "; after idling (bucket full again) it starts at a third of that rate and burst and ramps up over {}",
                    dur(*warmup)
                );
            }
            s
        }
        Algorithm::LeakyBucket { interval, max_delay } => {
            let t = interval.get();
            if *max_delay == 0 {
                format!(
                    "a strict meter of one request every {} ({} requests/s){per_request}: a request sooner than that {}",
                    dur(t),
                    per_second(t),
                    retry_note(overrun(&limit.algorithm, 1, c))
                )
            } else {
                let queue = max_delay / t + 1;
                format!(
                    "smoothed to one request every {} ({} requests/s){per_request}: up to {queue} waiting requests are delayed (at most {}), request {} {}",
                    dur(t),
                    per_second(t),
                    dur(*max_delay),
                    queue / c + 1,
                    retry_note(overrun(&limit.algorithm, queue / c, c))
                )
            }
        }
        Algorithm::FixedWindow { window, limit: n } => format!(
            "{n} per {} window aligned to the clock{per_request}; request {} {}; across a window boundary up to {} can pass in a moment",
            dur(window.get()),
            n.get() / c + 1,
            retry_note(overrun(&limit.algorithm, n.get() / c, c)),
            2 * n.get()
        ),
        Algorithm::SlidingWindow { window, limit: n } => format!(
            "about {n} in any {} (sliding window counter){per_request}; request {} of a burst {}",
            dur(window.get()),
            n.get() / c + 1,
            retry_note(overrun(&limit.algorithm, n.get() / c, c))
        ),
        Algorithm::SlidingLog { window, limit: n } => format!(
            "exactly {n} in any {} (sliding log){per_request}; request {} of a burst {}",
            dur(window.get()),
            n.get() / c + 1,
            retry_note(overrun(&limit.algorithm, n.get() / c, c))
        ),
    };
    let mut line = format!("{} `{}`: {body}", who(limit), limit.name);
    if limit.store == StoreKind::Redis {
        line.push_str("; shared by all instances through Redis");
    }
    if limit.mode == Mode::Shadow {
        line.push_str(" [shadow: counted and logged, never rejects]");
    }
    line
}

fn per_second(interval_us: u64) -> String {
    let per_sec = 1_000_000.0 / interval_us as f64;
    if (per_sec - per_sec.round()).abs() < 1e-9 {
        format!("{}", per_sec.round() as u64)
    } else {
        format!("{per_sec:.3}")
    }
}

/// The whole explanation of `config`.
pub fn explain(config: &Config) -> String {
    let mut out = String::new();
    for r in &config.routes {
        let _ = writeln!(out, "route `{}` -> upstream `{}`", r.name, config.upstream(r).name);
        if r.limits.is_empty() && r.concurrency.is_none() {
            let _ = writeln!(out, "  no limits");
        }
        for l in &r.limits {
            let _ = writeln!(out, "  {}", describe(l));
        }
        if let Some(c) = &r.concurrency {
            let wait = if c.max_wait.is_zero() {
                "at once".to_owned()
            } else {
                format!("after waiting up to {}", Dur(c.max_wait))
            };
            let _ =
                writeln!(out, "  at most {} requests in flight; the next gets 503 with Retry-After: 1 {wait}", c.max);
        }
        if r.limits.len() > 1 {
            let _ = writeln!(out, "  every limit must admit; a request one limit rejects costs nothing in the others");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn explained(limits: &str) -> String {
        let yaml = format!("upstreams: {{ d: {{ respond: {{}} }} }}\nroutes:\n  - upstream: d\n    limits:\n{limits}");
        explain(&Config::from_yaml(Path::new("t.yaml"), &yaml).unwrap())
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
