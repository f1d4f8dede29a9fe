//! Plans: which tier a client is on, and so which parameters its `plan: true` limits have.
//! The client → tier map is a file (read with the config, so a reload re-reads it) or a Redis
//! hash read through a local cache with a TTL. Invariant: a plan limit keeps one state per
//! client, whatever its tier (the state is keyed by the limit's key, never by the tier), so a
//! client that changes tier keeps what it spent: window counts are units already, and a token
//! bucket's state records the interval it was charged at (see [`super::algo::gcra::rescale`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::{Algorithm, KeyPart, RedisClient};

/// A tier's index in [`Plans::tiers`].
pub type TierId = u16;

/// A tier: a name, and whether its clients are refused outright.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tier {
    pub name: String,
    pub deny: bool,
}

/// Where the client → tier map lives.
#[derive(Clone, Debug)]
pub enum Clients {
    /// Read from a YAML file with the config: client value → tier.
    File { path: PathBuf, map: HashMap<Box<[u8]>, TierId, foldhash::fast::RandomState> },
    /// `HGET hash <client value>` → tier name, cached locally for `cache`.
    Redis { hash: String, cache: Duration },
}

/// The validated `plans:` section.
#[derive(Clone, Debug)]
pub struct Plans {
    /// The request value that names a client.
    pub of: KeyPart,
    pub tiers: Vec<Tier>,
    /// The tier of a client not in the map, and of a request without the value.
    pub default: TierId,
    pub clients: Clients,
    /// `tier_claim`: a verified token's claim that names the tier itself (a tier it does not
    /// name falls back to the map).
    pub tier_claim: Option<String>,
}

impl Plans {
    /// The id of the tier called `name`.
    pub fn tier(&self, name: &str) -> Option<TierId> {
        self.tiers.iter().position(|t| t.name == name).and_then(|i| TierId::try_from(i).ok())
    }
}

/// The parameters of one `plan: true` limit in each tier (by [`TierId`]); `None`: that tier
/// is not limited by it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PlanTiers {
    pub algorithms: Vec<Option<Algorithm>>,
}

/// Finds a request's tier: the file map, or the Redis hash behind its cache.
pub struct Directory {
    plans: Arc<Plans>,
    redis: Option<(Arc<RedisClient>, TierCache)>,
}

/// Client value → tier, as read from the Redis hash, for the configured TTL.
type TierCache = moka::sync::Cache<Box<[u8]>, TierId, foldhash::fast::RandomState>;

impl Directory {
    /// `client` is needed for `clients: { redis_hash }` (config validation requires `redis:`);
    /// without one every client gets the default tier.
    pub fn new(plans: Arc<Plans>, client: Option<Arc<RedisClient>>) -> Directory {
        let redis = match (&plans.clients, client) {
            (Clients::Redis { cache, .. }, Some(c)) => {
                let cache = moka::sync::Cache::builder()
                    .max_capacity(100_000)
                    .time_to_live(*cache)
                    .build_with_hasher(foldhash::fast::RandomState::default());
                Some((c, cache))
            }
            _ => None,
        };
        Directory { plans, redis }
    }

    pub fn plans(&self) -> &Plans {
        &self.plans
    }

    /// The tier of a client whose `of` value is `value` (`None`: the request has none).
    pub async fn tier(&self, value: Option<&[u8]>) -> TierId {
        match self.lookup(value) {
            Lookup::Tier(t) => t,
            Lookup::Fetch(v) => self.fetch(v).await,
        }
    }

    /// The tier when it is known without waiting: from the file, or the Redis cache.
    pub fn lookup(&self, value: Option<&[u8]>) -> Lookup {
        let Some(value) = value else { return Lookup::Tier(self.plans.default) };
        match &self.plans.clients {
            Clients::File { map, .. } => Lookup::Tier(map.get(value).copied().unwrap_or(self.plans.default)),
            Clients::Redis { .. } => match &self.redis {
                None => Lookup::Tier(self.plans.default),
                Some((_, cache)) => match cache.get(value) {
                    Some(t) => Lookup::Tier(t),
                    None => Lookup::Fetch(value.into()),
                },
            },
        }
    }

    /// Reads a client's tier from the Redis hash (a cache miss) and caches it.
    pub async fn fetch(&self, value: Box<[u8]>) -> TierId {
        let (Clients::Redis { hash, .. }, Some((client, cache))) = (&self.plans.clients, &self.redis) else {
            return self.plans.default;
        };
        match client.hget(hash, &value).await {
            Some(found) => {
                let t = found.and_then(|name| self.plans.tier(&name)).unwrap_or(self.plans.default);
                cache.insert(value, t);
                t
            }
            // Redis did not answer: the default tier, not cached, so the next request asks again.
            None => self.plans.default,
        }
    }
}

/// What [`Directory::lookup`] found.
pub enum Lookup {
    Tier(TierId),
    /// Not cached: [`Directory::fetch`] this client value.
    Fetch(Box<[u8]>),
}
