//! The `redis:` section: where the shared limiter state lives and what a decision does when
//! Redis does not answer. Serde mirror (unknown fields denied) → [`RedisConfig`].

use std::num::{NonZeroU32, NonZeroU64};

use serde::Deserialize;

use super::units::Dur;
use super::{key, Invalid, Seg};
use crate::limit::store::redis::{fallback_algorithm, OnError, RedisConfig, Topology};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRedis {
    /// One node: `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS.
    url: Option<String>,
    /// Redis Cluster seed nodes.
    cluster: Option<Vec<String>>,
    /// Deadline of one decision.
    timeout: Option<Dur>,
    #[serde(default)]
    on_error: RawOnError,
    /// `on_error: local` divides rates and limits by this many proxy instances.
    instances: Option<u64>,
    breaker: Option<RawBreaker>,
    /// Unspent leased units lapse after this.
    lease_ttl: Option<Dur>,
    /// Per limit: at most this many keys' denials and leases are remembered locally.
    memo_keys: Option<usize>,
    connect_timeout: Option<Dur>,
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum RawOnError {
    Allow,
    Deny,
    #[default]
    Local,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBreaker {
    /// Consecutive failures that open the breaker.
    failures: Option<u32>,
    /// How long it stays open before one probe.
    cooldown: Option<Dur>,
}

fn check_url(url: &str, at: Vec<Seg>) -> Result<String, Invalid> {
    let ok = (url.starts_with("redis://") || url.starts_with("rediss://")) && redis::parse_redis_url(url).is_some();
    if !ok {
        // Never echo credentials, also when the scheme that would mark them is missing.
        let shown = match (url.contains("://"), url.rfind('@')) {
            (false, Some(a)) => format!("***{}", &url[a..]),
            _ => super::redact(url),
        };
        return Err((at, format!("`{shown}` is not a Redis URL; expected redis://host:port or rediss://host:port")));
    }
    Ok(url.to_owned())
}

impl RawRedis {
    pub fn validate(self) -> Result<RedisConfig, Invalid> {
        let at = |field: &str| vec![key("redis"), key(field)];
        let target = match (self.url, self.cluster) {
            (Some(_), Some(_)) => return Err((at("cluster"), "give either `url` or `cluster`, not both".to_owned())),
            (None, None) => return Err((vec![key("redis")], "expected `url` or `cluster`".to_owned())),
            (Some(u), None) => Topology::Single(check_url(&u, at("url"))?),
            (None, Some(list)) if list.is_empty() => {
                return Err((at("cluster"), "expected at least one node URL".to_owned()))
            }
            (None, Some(list)) => {
                let mut urls = Vec::with_capacity(list.len());
                for (i, u) in list.iter().enumerate() {
                    urls.push(check_url(u, vec![key("redis"), key("cluster"), Seg::Index(i)])?);
                }
                Topology::Cluster(urls)
            }
        };
        let mut cfg = RedisConfig::new(target);
        if let Some(t) = self.timeout {
            if t.0.is_zero() {
                return Err((at("timeout"), "timeout must be more than 0".to_owned()));
            }
            cfg.timeout = t.0;
        }
        cfg.on_error = match self.on_error {
            RawOnError::Allow => OnError::Allow,
            RawOnError::Deny => OnError::Deny,
            RawOnError::Local => OnError::Local,
        };
        if let Some(n) = self.instances {
            cfg.instances =
                NonZeroU64::new(n).ok_or_else(|| (at("instances"), "instances must be at least 1".into()))?;
        }
        if let Some(b) = self.breaker {
            let at = |field: &str| vec![key("redis"), key("breaker"), key(field)];
            if let Some(n) = b.failures {
                cfg.breaker_failures =
                    NonZeroU32::new(n).ok_or_else(|| (at("failures"), "failures must be at least 1".to_owned()))?;
            }
            if let Some(d) = b.cooldown {
                cfg.breaker_cooldown = d.0;
            }
        }
        if let Some(d) = self.lease_ttl {
            if d.0.is_zero() {
                return Err((at("lease_ttl"), "lease_ttl must be more than 0".to_owned()));
            }
            cfg.lease_ttl = d.0;
        }
        if let Some(n) = self.memo_keys {
            cfg.memo_keys = n;
        }
        if let Some(d) = self.connect_timeout {
            cfg.connect_timeout = d.0;
        }
        Ok(cfg)
    }
}

/// Checks a `store: redis` limit: the `redis:` section exists, its numbers are exact in Lua, and
/// `lease` is only on a token bucket (the only algorithm with leases).
pub fn check_limit(limit: &super::LimitConfig, have_redis: bool, at: &dyn Fn(&str) -> Vec<Seg>) -> Result<(), Invalid> {
    if !have_redis {
        return Err((at("store"), "`store: redis` needs a top-level `redis:` section (url or cluster)".to_owned()));
    }
    crate::limit::store::redis::check_precision(&limit.algorithm).map_err(|e| (at("rate"), e))?;
    if limit.lease.is_some() && !limit.algorithm.leases() {
        return Err((at("lease"), "`lease` applies to token_bucket only".to_owned()));
    }
    Ok(())
}

/// Checks a `store: redis` limit's local fallback (`on_error: local`): its parameters are
/// divided by `instances`, so a cost that fits the shared limit may never fit the fallback,
/// and every request during an outage would be refused with a Retry-After of ages.
pub fn check_fallback(
    limit: &super::LimitConfig,
    instances: NonZeroU64,
    at: &dyn Fn(&str) -> Vec<Seg>,
) -> Result<(), Invalid> {
    let fallback = fallback_algorithm(&limit.algorithm, instances);
    let n = instances.get();
    fallback.check_exact().map_err(|e| {
        (at("rate"), format!("with `redis.on_error: local` and `instances: {n}` the local fallback: {e}"))
    })?;
    let max = crate::limit::max_cost(&fallback);
    if limit.cost > max {
        return Err((
            at("cost"),
            format!(
                "cost {} can never be admitted while Redis is down: with `redis.on_error: local` and \
                 `instances: {n}` the local fallback admits at most {max} at once; lower the cost or `instances`",
                limit.cost
            ),
        ));
    }
    Ok(())
}
