//! The built-in responder's faults, for load tests of a client: a latency distribution, a
//! share of error answers, connections reset mid-answer, a body of a given size, a slow body,
//! and a seed that makes the draws repeat. Validated here into [`Faults`]; a responder that
//! uses none of them has no `Faults` at all (its answers cost what they did before).

use std::time::Duration;

use http::StatusCode;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::units::{Dur, Size};
use super::{key, Invalid, Seg};

/// What the responder does beyond its fixed answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    /// Each answer's latency drawn from a distribution (a fixed one is the responder's own
    /// `latency`).
    pub latency: Option<Latency>,
    /// This share of answers is an error with `status`.
    pub errors: Option<ErrorShare>,
    /// This share of answers is cut: the head and half the body are sent, then the connection
    /// (HTTP/1.1) or the stream (HTTP/2) is reset.
    pub resets: f64,
    /// The body is this many bytes (instead of `body`).
    pub body_size: Option<u64>,
    /// The body is sent `bytes` at a time, one piece every `every`.
    pub drip: Option<Drip>,
    /// The random draws start from this seed (each worker from its own, derived from it).
    pub seed: Option<u64>,
}

/// A latency distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Latency {
    Uniform {
        min: Duration,
        max: Duration,
    },
    /// Mean `p50`, with `p99` 2.326 standard deviations above it; a draw below zero is zero.
    Normal {
        p50: Duration,
        p99: Duration,
    },
    /// The logarithm is normal: median `p50`, and `p99` 2.326 of its standard deviations above.
    LogNormal {
        p50: Duration,
        p99: Duration,
    },
}

/// The 99th percentile of the standard normal distribution.
pub const Z99: f64 = 2.326_347_874;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorShare {
    pub share: f64,
    pub status: StatusCode,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Drip {
    pub bytes: u64,
    pub every: Duration,
}

/// The longest `body_size`: bodies are made from one shared block, so this bounds only what a
/// single answer sends.
pub const MAX_BODY_SIZE: u64 = 1 << 40;

/// `latency:` as written: a duration, or a distribution.
pub(super) enum RawLatency {
    Fixed(Dur),
    Spread(RawSpread),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSpread {
    distribution: Option<Distribution>,
    p50: Option<Dur>,
    p99: Option<Dur>,
    min: Option<Dur>,
    max: Option<Dur>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Distribution {
    Fixed,
    Uniform,
    Normal,
    #[serde(alias = "log_normal")]
    LogNormal,
}

impl<'de> Deserialize<'de> for RawLatency {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawLatency;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "a duration (20ms) or a distribution ({ p50: 20ms, p99: 200ms }, { distribution: uniform, min: \
                     10ms, max: 30ms })",
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<RawLatency, E> {
                Dur::parse(s).map(RawLatency::Fixed).map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<RawLatency, E> {
                self.visit_str(&n.to_string())
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RawLatency, A::Error> {
                RawSpread::deserialize(de::value::MapAccessDeserializer::new(map)).map(RawLatency::Spread)
            }
        }
        d.deserialize_any(V)
    }
}

/// A share: `10%` or `0.1`.
#[derive(Clone, Copy)]
pub(super) struct Share(pub(super) f64);

impl<'de> Deserialize<'de> for Share {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Share;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a share: 10% or 0.1")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Share, E> {
                let t = s.trim();
                let (num, scale) = match t.strip_suffix('%') {
                    Some(n) => (n.trim(), 100.0),
                    None => (t, 1.0),
                };
                let v: f64 =
                    num.parse().map_err(|_| E::custom(format!("`{s}` is not a share; expected 10% or 0.1")))?;
                self.visit_f64(v / scale)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Share, E> {
                if (0.0..=1.0).contains(&v) {
                    Ok(Share(v))
                } else {
                    Err(E::custom(format!("{v} is not a share between 0 and 1 (0% and 100%)")))
                }
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Share, E> {
                self.visit_f64(v as f64)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawErrors {
    share: Share,
    #[serde(default = "default_error_status")]
    status: u16,
}

fn default_error_status() -> u16 {
    503
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDrip {
    bytes: Size,
    every: Dur,
}

/// The fault fields of `respond:`, as written.
pub(super) struct RawFaults {
    pub latency: Option<RawLatency>,
    pub errors: Option<RawErrors>,
    pub resets: Option<Share>,
    pub body_size: Option<Size>,
    pub drip: Option<RawDrip>,
    pub seed: Option<u64>,
}

/// The fixed latency and the faults (`None` when no field asks for one); `at` makes a field's
/// path under `respond`.
pub(super) fn validate(
    raw: RawFaults,
    at: &dyn Fn(&[&str]) -> Vec<Seg>,
) -> Result<(Duration, Option<Faults>), Invalid> {
    let mut fixed = Duration::ZERO;
    let latency = match raw.latency {
        None => None,
        Some(RawLatency::Fixed(d)) => {
            fixed = d.0;
            None
        }
        Some(RawLatency::Spread(s)) => {
            let field = |f: &str| at(&["latency", f]);
            let quantiles = s.p50.is_some() || s.p99.is_some();
            let bounds = s.min.is_some() || s.max.is_some();
            let dist = match (s.distribution, quantiles, bounds) {
                (Some(d), ..) => d,
                (None, true, false) => Distribution::LogNormal,
                (None, false, true) => Distribution::Uniform,
                (None, true, true) => {
                    return Err((at(&["latency"]), "give `p50` and `p99`, or `min` and `max`, not both".to_owned()))
                }
                (None, false, false) => {
                    return Err((
                        at(&["latency"]),
                        "give `p50` and `p99` (log-normal) or `min` and `max` (uniform)".to_owned(),
                    ))
                }
            };
            let need = |v: Option<Dur>, f: &str, d: &str| {
                v.map(|d| d.0).ok_or_else(|| (field(f), format!("a {d} latency needs `{f}`")))
            };
            let only = |set: bool, f: &str, d: &str| {
                if set {
                    Err((field(f), format!("`{f}` does not apply to a {d} latency")))
                } else {
                    Ok(())
                }
            };
            match dist {
                Distribution::Fixed => {
                    only(s.min.is_some() || s.max.is_some() || s.p99.is_some(), "p99", "fixed")?;
                    fixed = need(s.p50, "p50", "fixed")?;
                    None
                }
                Distribution::Uniform => {
                    only(quantiles, "p50", "uniform")?;
                    let (min, max) = (need(s.min, "min", "uniform")?, need(s.max, "max", "uniform")?);
                    if min > max {
                        return Err((field("max"), "`max` must be at least `min`".to_owned()));
                    }
                    Some(Latency::Uniform { min, max })
                }
                Distribution::Normal | Distribution::LogNormal => {
                    let name = if dist == Distribution::Normal { "normal" } else { "log-normal" };
                    only(bounds, "min", name)?;
                    let (p50, p99) = (need(s.p50, "p50", name)?, need(s.p99, "p99", name)?);
                    if p99 < p50 {
                        return Err((field("p99"), "`p99` must be at least `p50`".to_owned()));
                    }
                    if dist == Distribution::LogNormal && p50.is_zero() {
                        return Err((field("p50"), "a log-normal latency needs `p50` above 0".to_owned()));
                    }
                    Some(if dist == Distribution::Normal {
                        Latency::Normal { p50, p99 }
                    } else {
                        Latency::LogNormal { p50, p99 }
                    })
                }
            }
        }
    };
    let errors = match raw.errors {
        None => None,
        Some(e) => {
            let status = StatusCode::from_u16(e.status).ok().filter(|s| s.as_u16() >= 200).ok_or_else(|| {
                (at(&["errors", "status"]), format!("{} is not a status code; expected 200-999", e.status))
            })?;
            Some(ErrorShare { share: e.share.0, status })
        }
    };
    if let Some(s) = raw.body_size {
        if s.0 > MAX_BODY_SIZE {
            return Err((at(&["body_size"]), format!("at most {MAX_BODY_SIZE} bytes (1 TiB)")));
        }
    }
    let drip = match raw.drip {
        None => None,
        Some(d) if d.bytes.0 == 0 => return Err((at(&["drip", "bytes"]), "at least 1 byte at a time".to_owned())),
        Some(d) => Some(Drip { bytes: d.bytes.0, every: d.every.0 }),
    };
    let faults = Faults {
        latency,
        errors,
        resets: raw.resets.map_or(0.0, |s| s.0),
        body_size: raw.body_size.map(|s| s.0),
        drip,
        seed: raw.seed,
    };
    let none = Faults { latency: None, errors: None, resets: 0.0, body_size: None, drip: None, seed: faults.seed };
    Ok((fixed, (faults != none).then_some(faults)))
}

/// `respond.FIELD` under `upstreams.NAME`.
pub(super) fn path(base: &[Seg], fields: &[&str]) -> Vec<Seg> {
    let mut p = base.to_vec();
    p.extend(fields.iter().map(|f| key(f)));
    p
}
