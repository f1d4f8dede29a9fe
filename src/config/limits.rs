//! The `limits:` and `concurrency:` parts of a route: serde mirror and validation into
//! [`crate::limit::Algorithm`] values that cannot hold an invalid parameter.

use std::fmt;
use std::num::NonZeroU64;
use std::time::Duration;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::forms::{by_form, read_map, Forms};
use super::units::{Dur, Rate};
use super::{key, Invalid, Seg};
use crate::limit::algo::{Kind, Written};
use crate::limit::{self, Algorithm, Calendar, CalendarUnit, KeyPart, KeySpec, Span};

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    pub(super) name: Option<String>,
    algorithm: Kind,
    pub(super) rate: Option<Rate>,
    pub(super) burst: Option<u64>,
    max_delay: Option<Dur>,
    warmup: Option<Dur>,
    #[serde(default = "route_key")]
    key: KeyList,
    #[serde(default)]
    store: StoreKind,
    #[serde(default)]
    cost: RawCost,
    #[serde(default)]
    mode: Mode,
    lease: Option<u64>,
    max_keys: Option<usize>,
    /// Fixed window only: `utc` or an IANA zone; windows align to its calendar.
    calendar: Option<String>,
    /// Rate and burst come from the client's tier (`plans.tiers`).
    #[serde(default)]
    pub(super) plan: bool,
    /// The admin listener lists this limit's most throttled keys as text (capped, escaped),
    /// not as their digests.
    #[serde(default)]
    show_keys: bool,
    /// `early_retry: { penalty: double }`: a key back before its Retry-After waits longer.
    #[serde(default)]
    early_retry: RawEarlyRetry,
}

/// `early_retry: { penalty: double }`; `{}` or `penalty: none` is the default, off.
#[derive(Deserialize, Clone, Default)]
#[serde(deny_unknown_fields)]
struct RawEarlyRetry {
    #[serde(default)]
    penalty: Penalty,
}

/// What an early retry costs the client.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default, Hash)]
#[serde(rename_all = "snake_case")]
enum Penalty {
    #[default]
    None,
    /// Denied, and told twice the wait it was last told (capped at the limit's period).
    Double,
}

fn route_key() -> KeyList {
    KeyList(vec!["route".to_owned()])
}

/// `cost: 3`, or `cost: { estimate: 1, response_header: x-tokens-used }`.
#[derive(Clone)]
enum RawCost {
    Fixed(u64),
    Response(RawResponseCost),
}

impl Default for RawCost {
    fn default() -> Self {
        RawCost::Fixed(1)
    }
}

impl<'de> Deserialize<'de> for RawCost {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawCost;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a whole number, or { estimate: N, response_header: NAME }")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawCost, E> {
                Ok(RawCost::Fixed(v))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<RawCost, A::Error> {
                RawResponseCost::deserialize(de::value::MapAccessDeserializer::new(map)).map(RawCost::Response)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct RawResponseCost {
    estimate: u64,
    response_header: String,
}

/// Where a limit keeps its state.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default, Hash)]
#[serde(rename_all = "snake_case")]
pub enum StoreKind {
    #[default]
    Local,
    Redis,
}

/// `enforce` rejects; `shadow` decides, counts and logs, and never rejects.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Enforce,
    Shadow,
}

/// `key: client_ip` or `key: [client_ip, header:X-Tenant]`.
#[derive(Clone)]
pub(super) struct KeyList(pub(super) Vec<String>);

impl<'de> Deserialize<'de> for KeyList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeyList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a key (route, client_ip, path, header:NAME, query:NAME) or a list of them")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyList, E> {
                Ok(KeyList(vec![v.to_owned()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KeyList, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(s);
                }
                Ok(KeyList(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// A validated limit.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LimitConfig {
    pub name: String,
    pub algorithm: Algorithm,
    /// As written, for messages and `explain`.
    pub rate: Rate,
    pub key: KeySpec,
    pub store: StoreKind,
    /// Units charged at admission (with `response_cost`: the estimate).
    pub cost: u64,
    /// The response header whose number is the request's real cost: the difference from
    /// `cost` is debited (or refunded) when the response head arrives.
    pub response_cost: Option<http::HeaderName>,
    /// `plan: true`: the parameters per tier (`algorithm` is then the default tier's, or the
    /// first tier's that names this limit).
    pub plan: Option<std::sync::Arc<crate::limit::plan::PlanTiers>>,
    pub mode: Mode,
    /// Redis only: tokens taken per call and spent locally.
    pub lease: Option<NonZeroU64>,
    /// Local store: the bound on live keys.
    pub max_keys: usize,
    /// `show_keys: true`: the admin listener shows the most throttled keys as text (kept in
    /// the limit's heavy-hitter summary only, never in the store).
    pub show_keys: bool,
    /// `early_retry: { penalty: double }`: a key back before the Retry-After it was told is
    /// denied, and told twice that wait (see `gate::early`). Enforced limits only.
    pub early_penalty: bool,
}

/// Requests in flight on a route.
#[derive(Debug, Clone, PartialEq)]
pub struct Concurrency {
    /// The cap; with `adaptive`, its upper bound.
    pub max: usize,
    /// Wait this long for a free slot before answering 503; zero answers at once.
    pub max_wait: Duration,
    /// A limit that follows the upstream's latency (see `gate::adaptive`).
    pub adaptive: Option<Adaptive>,
}

/// The parameters of an adaptive limit, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Adaptive {
    pub min: usize,
    pub max: usize,
    /// The shortest window of answers between two updates.
    pub window: Duration,
    /// Which percentile of a window's round-trip times is its sample (0 < p ≤ 100).
    pub percentile: f64,
    /// A sample this many times the baseline still counts as unloaded (≥ 1).
    pub tolerance: f64,
    /// Share of the new estimate taken each window (0 < s ≤ 1).
    pub smoothing: f64,
    /// Windows at `min` after which the baseline is relearned.
    pub relearn: u32,
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            min: 4,
            max: 1000,
            window: Duration::from_millis(100),
            percentile: 50.0,
            tolerance: 1.25,
            smoothing: 0.2,
            relearn: 5,
        }
    }
}

/// `concurrency: 8` or `concurrency: { max, max_wait, adaptive }`.
pub enum RawConcurrency {
    Max(usize),
    Full(RawConcurrencyFull),
}

impl Forms for RawConcurrency {
    const EXPECTING: &'static str = "a count, or `{ max: N, max_wait: DURATION }` or `{ adaptive: { min, max } }`";
    fn number(n: u64) -> Option<Self> {
        usize::try_from(n).ok().map(RawConcurrency::Max)
    }
    fn map<'de, M: MapAccess<'de>>(map: M) -> Option<Result<Self, M::Error>> {
        Some(read_map(map).map(RawConcurrency::Full))
    }
}
by_form!(RawConcurrency);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConcurrencyFull {
    max: Option<usize>,
    max_wait: Option<Dur>,
    adaptive: Option<RawAdaptive>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdaptive {
    min: Option<usize>,
    max: Option<usize>,
    window: Option<Dur>,
    percentile: Option<f64>,
    tolerance: Option<f64>,
    smoothing: Option<f64>,
    relearn: Option<u32>,
}

pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// The largest adaptive `max`: far above any useful limit, far below the semaphore's bound.
const ADAPTIVE_MAX: usize = 1 << 32;

impl RawAdaptive {
    fn validate(self, at: &[Seg]) -> Result<Adaptive, Invalid> {
        let d = Adaptive::default();
        let field = |f: &str| {
            let mut p = at.to_vec();
            p.push(Seg::Key(f.to_owned()));
            p
        };
        let a = Adaptive {
            min: self.min.unwrap_or(d.min),
            max: self.max.unwrap_or(d.max),
            window: self.window.map_or(d.window, |w| w.0),
            percentile: self.percentile.unwrap_or(d.percentile),
            tolerance: self.tolerance.unwrap_or(d.tolerance),
            smoothing: self.smoothing.unwrap_or(d.smoothing),
            relearn: self.relearn.unwrap_or(d.relearn),
        };
        if a.min == 0 {
            return Err((field("min"), "min must be at least 1".to_owned()));
        }
        if a.max < a.min || a.max > ADAPTIVE_MAX {
            return Err((field("max"), format!("max must be between min ({}) and {ADAPTIVE_MAX}", a.min)));
        }
        if a.window < Duration::from_millis(1) || a.window > Duration::from_secs(60) {
            return Err((field("window"), "window must be between 1ms and 60s".to_owned()));
        }
        if !(a.percentile > 0.0 && a.percentile <= 100.0) {
            return Err((field("percentile"), "percentile must be above 0 and at most 100".to_owned()));
        }
        if !(1.0..=10.0).contains(&a.tolerance) {
            return Err((field("tolerance"), "tolerance must be between 1 and 10".to_owned()));
        }
        if !(a.smoothing > 0.0 && a.smoothing <= 1.0) {
            return Err((field("smoothing"), "smoothing must be above 0 and at most 1".to_owned()));
        }
        if a.relearn == 0 {
            return Err((field("relearn"), "relearn must be at least 1 window".to_owned()));
        }
        Ok(a)
    }
}

impl RawConcurrency {
    pub fn validate(self, at: Vec<Seg>) -> Result<Concurrency, Invalid> {
        let (max, max_wait, adaptive) = match self {
            RawConcurrency::Max(m) => (m, Duration::ZERO, None),
            RawConcurrency::Full(f) => {
                let max_wait = f.max_wait.map_or(Duration::ZERO, |d| d.0);
                match (f.max, f.adaptive) {
                    (Some(_), Some(_)) => {
                        return Err((
                            at,
                            "give either `max` or `adaptive: { min, max }`, not both (an adaptive limit's \
                             bound is its own `max`)"
                                .to_owned(),
                        ))
                    }
                    (None, None) => return Err((at, "expected `max: N` or `adaptive: { min, max }`".to_owned())),
                    (Some(m), None) => (m, max_wait, None),
                    (None, Some(a)) => {
                        let mut p = at.clone();
                        p.push(Seg::Key("adaptive".to_owned()));
                        let a = a.validate(&p)?;
                        (a.max, max_wait, Some(a))
                    }
                }
            }
        };
        if max == 0 {
            return Err((at, "concurrency must be at least 1".to_owned()));
        }
        // The cap is a tokio semaphore, which cannot count more permits (it would panic).
        if max > tokio::sync::Semaphore::MAX_PERMITS {
            return Err((
                at,
                format!(
                    "concurrency {max} is more than the {} requests in flight a route can count; leave \
                     `concurrency` out for no cap",
                    tokio::sync::Semaphore::MAX_PERMITS
                ),
            ));
        }
        Ok(Concurrency { max, max_wait, adaptive })
    }
}

/// Names of routes and limits: metric label values, Redis key parts, RateLimit policy names.
pub(super) fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= super::MAX_NAME_BYTES
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if ok {
        return Ok(());
    }
    Err(format!(
        "`{}` is not a name; expected 1 to {} letters, digits, `-`, `_` or `.`",
        name.escape_debug(),
        super::MAX_NAME_BYTES
    ))
}

fn span(d: Dur) -> Span {
    Span::from_duration(d.0)
}

impl RawLimit {
    /// `at(field)` is the path of a field of this limit; `index` names unnamed limits.
    pub fn validate(self, index: usize, at: &dyn Fn(&str) -> Vec<Seg>) -> Result<LimitConfig, Invalid> {
        let rate = self.rate.ok_or_else(|| {
            (at("rate"), "`rate` is required (or `plan: true`, with the rate of each tier in `plans.tiers`)".to_owned())
        })?;
        let name = self.name.unwrap_or_else(|| format!("limit-{index}"));
        check_name(&name).map_err(|e| (at("name"), e))?;
        // A field only some algorithms read ([`limit::algo::Rule::FIELDS`]) is refused on the others.
        let kind = self.algorithm;
        let only = |field: &str, set: bool| -> Result<(), Invalid> {
            if set && !kind.fields().contains(&field) {
                return Err((at(field), format!("`{field}` applies to {} only", Kind::reading(field))));
            }
            Ok(())
        };
        only("burst", self.burst.is_some())?;
        only("warmup", self.warmup.is_some())?;
        only("max_delay", self.max_delay.is_some())?;
        if self.lease.is_some() && self.store != StoreKind::Redis {
            return Err((at("lease"), "`lease` applies to limits with `store: redis` only".to_owned()));
        }
        only("calendar", self.calendar.is_some())?;
        let calendar = match &self.calendar {
            None => None,
            Some(zone) => {
                let unit = match (rate.month, rate.period.as_secs(), rate.period.subsec_nanos()) {
                    (true, ..) => CalendarUnit::Month,
                    (false, 3_600, 0) => CalendarUnit::Hour,
                    (false, 86_400, 0) => CalendarUnit::Day,
                    _ => {
                        return Err((
                            at("rate"),
                            format!(
                                "a calendar window is one hour, day or month: write the rate per h, d or month, not {}",
                                rate
                            ),
                        ))
                    }
                };
                Some(Calendar::new(zone, unit).map_err(|e| (at("calendar"), e))?)
            }
        };

        let written = Written {
            rate: &rate,
            quantity: rate.quantity,
            period: rate.period_micros(),
            burst: self.burst,
            warmup: self.warmup.map(span),
            max_delay: self.max_delay.map(span),
            calendar,
        };
        let algorithm = kind.build(&written).map_err(|(field, e)| (at(field), e))?;
        let (cost, response_cost) = match self.cost {
            RawCost::Fixed(n) => (n, None),
            RawCost::Response(r) => {
                let name = http::HeaderName::from_bytes(r.response_header.as_bytes()).map_err(|_| {
                    (
                        at("cost"),
                        format!("`{}` is not a header name (response_header)", r.response_header.escape_debug()),
                    )
                })?;
                (r.estimate, Some(name))
            }
        };
        if cost == 0 {
            return Err((at("cost"), "cost must be at least 1".to_owned()));
        }
        let max = limit::max_cost(&algorithm);
        if cost > max {
            return Err((
                at("cost"),
                format!("cost {cost} can never be admitted: this limit admits at most {max} at once"),
            ));
        }
        if self.key.0.is_empty() {
            return Err((at("key"), "expected at least one key part".to_owned()));
        }
        let mut parts = Vec::with_capacity(self.key.0.len());
        for p in &self.key.0 {
            parts.push(p.parse::<KeyPart>().map_err(|e| (at("key"), e.to_string()))?);
        }
        let key = KeySpec::new(parts).map_err(|e| (at("key"), e.to_string()))?;
        let lease = match self.lease {
            None => None,
            Some(n) => Some(NonZeroU64::new(n).ok_or_else(|| (at("lease"), "lease must be at least 1".to_owned()))?),
        };
        let max_keys = self.max_keys.unwrap_or(DEFAULT_MAX_KEYS);
        if max_keys == 0 {
            return Err((at("max_keys"), "max_keys must be at least 1".to_owned()));
        }
        Ok(LimitConfig {
            name,
            algorithm,
            rate,
            key,
            store: self.store,
            cost,
            response_cost,
            plan: None,
            mode: self.mode,
            lease,
            max_keys,
            show_keys: self.show_keys,
            early_penalty: self.early_retry.penalty == Penalty::Double,
        })
    }
}

pub(super) fn limit_path(route: usize, limit: usize, field: &str) -> Vec<Seg> {
    vec![key("routes"), Seg::Index(route), key("limits"), Seg::Index(limit), key(field)]
}

/// The config spelling of an algorithm: `token_bucket`, `leaky_bucket`, …
pub fn algorithm_name(alg: &Algorithm) -> &'static str {
    alg.name()
}
