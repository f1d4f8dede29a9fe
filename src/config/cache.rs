//! `cache:` on a route (or `cache.default:` at the top level, for every route without its own):
//! an HTTP cache in front of the route's upstream (RFC 9111), on the store of `cache:`
//! (`max_bytes`, shared by every route). Data only: the `step` room compiles it at
//! `Proxy::build`, the `cache` room keeps the copies.

use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;

use super::units::{Dur, Size};
use super::{key, Invalid, Seg};

/// How long a miss waits for the same key's request already on its way, by default.
pub const DEFAULT_COALESCE_WAIT: Duration = Duration::from_secs(5);
/// The longest `coalesce_wait`: a waiting client holds a connection.
pub const MAX_COALESCE_WAIT: Duration = Duration::from_secs(60);
/// Entries of one list (`ignore_query`, `headers`).
pub const MAX_ENTRIES: usize = 64;
/// The longest heuristic lifetime accepted for `heuristic.max`.
pub const MAX_HEURISTIC: Duration = Duration::from_secs(365 * 86_400);

/// A route's `cache`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteCacheConfig {
    /// Whether a hit goes through the route's limits (spends quota): by default it does not,
    /// since a limit protects the upstream and a hit never reaches it.
    pub hits_spend_limits: bool,
    /// The largest answer this route stores (the store's `max_entry_bytes` when smaller).
    pub max_entry_bytes: Option<u64>,
    /// How long a miss waits for the same key's request already on its way (`0`: never waits,
    /// every miss is forwarded).
    pub coalesce_wait: Duration,
    /// Heuristic freshness for answers without an explicit lifetime (RFC 9111 §4.2.2); `None`
    /// (the default): such answers are stored but always revalidated.
    pub heuristic: Option<Heuristic>,
    /// Extra `stale-while-revalidate` for answers that do not say it themselves.
    pub stale_while_revalidate: Duration,
    pub key: CacheKey,
}

/// What the cache key holds besides the method family (GET and HEAD share one), host, path
/// and the request's credentials (`Authorization`, `Cookie`: a copy only ever answers them).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CacheKey {
    /// Whether the query is part of the key at all.
    pub query: bool,
    /// Query parameters left out of the key (tracking parameters such as `utm_source`).
    pub ignore_query: Vec<String>,
    /// Request fields always part of the key (beyond the answer's own `Vary`).
    pub headers: Vec<HeaderName>,
}

/// `heuristic: { percent, max }`: a fraction of the time since `Last-Modified`, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heuristic {
    pub percent: u8,
    pub max: Duration,
}

/// `cache:` on a route: `none`, or its own.
pub enum RawRouteCache {
    Word(String),
    Own(Box<RawRouteCacheMap>),
}

// By hand, not `untagged`: a mistake inside the map keeps its own field and message.
impl<'de> Deserialize<'de> for RawRouteCache {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawRouteCache;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("`none` or a map (`{}` for the defaults) of hits_spend_limits, max_entry_bytes, key...")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(RawRouteCache::Word(v.to_owned()))
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(RawRouteCache::Word(if v { "true" } else { "off" }.to_owned()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let raw = RawRouteCacheMap::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(RawRouteCache::Own(Box::new(raw)))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawRouteCacheMap {
    #[serde(default)]
    hits_spend_limits: bool,
    max_entry_bytes: Option<Size>,
    coalesce_wait: Option<Dur>,
    heuristic: Option<RawHeuristic>,
    stale_while_revalidate: Option<Dur>,
    key: Option<RawKey>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeuristic {
    percent: u8,
    max: Option<Dur>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    query: Option<bool>,
    ignore_query: Option<Vec<String>>,
    headers: Option<Vec<String>>,
}

impl RawRouteCache {
    /// `None`: the route has `cache: none`.
    pub fn validate(self, at: &[Seg]) -> Result<Option<RouteCacheConfig>, Invalid> {
        match self {
            RawRouteCache::Word(w) if w == "none" => Ok(None),
            RawRouteCache::Word(w) => {
                Err((at.to_vec(), format!("`{w}`: expected `none` or a map (`{{}}` for the defaults)")))
            }
            RawRouteCache::Own(raw) => raw.validate(at).map(Some),
        }
    }
}

impl RawRouteCacheMap {
    pub fn validate(self, at: &[Seg]) -> Result<RouteCacheConfig, Invalid> {
        let path = |rest: &[&str]| {
            let mut p = at.to_vec();
            p.extend(rest.iter().map(|f| key(f)));
            p
        };
        let coalesce_wait = self.coalesce_wait.map_or(DEFAULT_COALESCE_WAIT, |d| d.0);
        if coalesce_wait > MAX_COALESCE_WAIT {
            return Err((
                path(&["coalesce_wait"]),
                format!("at most {}s: a waiting client holds its connection", MAX_COALESCE_WAIT.as_secs()),
            ));
        }
        if self.max_entry_bytes.is_some_and(|s| s.0 == 0) {
            return Err((
                path(&["max_entry_bytes"]),
                "expected more than 0 (`cache: none` turns the cache off)".into(),
            ));
        }
        let heuristic = match self.heuristic {
            None => None,
            Some(h) => {
                if h.percent == 0 || h.percent > 100 {
                    return Err((path(&["heuristic", "percent"]), "expected 1 to 100 (RFC 9111 suggests 10)".into()));
                }
                let max = h.max.map_or(Duration::from_secs(86_400), |d| d.0);
                if max > MAX_HEURISTIC || max.is_zero() {
                    return Err((path(&["heuristic", "max"]), "expected more than 0s and at most 365d".into()));
                }
                Some(Heuristic { percent: h.percent, max })
            }
        };
        let mut key_out = CacheKey { query: true, ..CacheKey::default() };
        if let Some(k) = self.key {
            key_out.query = k.query.unwrap_or(true);
            let ignore = k.ignore_query.unwrap_or_default();
            if ignore.len() > MAX_ENTRIES {
                return Err((path(&["key", "ignore_query"]), format!("at most {MAX_ENTRIES} names")));
            }
            if !key_out.query && !ignore.is_empty() {
                return Err((
                    path(&["key", "ignore_query"]),
                    "the query is left out of the key (`query: false`): nothing to ignore".into(),
                ));
            }
            for (i, name) in ignore.iter().enumerate() {
                if name.is_empty() || name.contains(['&', '=', '#']) {
                    let mut p = path(&["key", "ignore_query"]);
                    p.push(Seg::Index(i));
                    return Err((p, format!("`{name}`: expected a query parameter name")));
                }
            }
            key_out.ignore_query = ignore;
            let headers = k.headers.unwrap_or_default();
            if headers.len() > MAX_ENTRIES {
                return Err((path(&["key", "headers"]), format!("at most {MAX_ENTRIES} names")));
            }
            for (i, h) in headers.iter().enumerate() {
                let Ok(name) = HeaderName::from_bytes(h.as_bytes()) else {
                    let mut p = path(&["key", "headers"]);
                    p.push(Seg::Index(i));
                    return Err((p, format!("`{h}` is not a field name")));
                };
                if !key_out.headers.contains(&name) {
                    key_out.headers.push(name);
                }
            }
        }
        Ok(RouteCacheConfig {
            hits_spend_limits: self.hits_spend_limits,
            max_entry_bytes: self.max_entry_bytes.map(|s| s.0),
            coalesce_wait,
            heuristic,
            stale_while_revalidate: self.stale_while_revalidate.map_or(Duration::ZERO, |d| d.0),
            key: key_out,
        })
    }
}
