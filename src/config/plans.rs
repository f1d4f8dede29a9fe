//! The `plans:` section and `plan: true` limits: tiers validated into [`Plans`], each plan
//! limit validated once per tier that names it (so a tier's bad rate is reported at the tier's
//! own line), and the clients file read beside the config.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

use super::forms::{by_form, read_map, Forms};
use super::limits::{check_name, RawLimit};
use super::units::{Dur, Rate};
use super::{key, Invalid, LimitConfig, Seg};
use crate::limit::plan::{Clients, PlanTiers, Plans, Tier, TierId};
use crate::limit::{Algorithm, KeyPart};

/// At most this many tiers (ids are u16; RateLimit-Policy values are rendered per tier).
pub const MAX_TIERS: usize = 64;

/// A clients file larger than this is refused (it is read whole at every reload).
pub const MAX_CLIENTS_BYTES: u64 = 64 << 20;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlans {
    of: String,
    clients: RawClients,
    default: String,
    tiers: BTreeMap<String, RawTier>,
    tier_claim: Option<String>,
}

/// `clients:`: a file, or `{ redis_hash, cache }`.
enum RawClients {
    File(String),
    Redis(RawRedisClients),
}

impl Forms for RawClients {
    const EXPECTING: &'static str = "a clients file, or `{ redis_hash: NAME, cache: DURATION }`";
    fn text(s: &str) -> Option<Self> {
        Some(RawClients::File(s.to_owned()))
    }
    fn map<'de, M: MapAccess<'de>>(map: M) -> Option<Result<Self, M::Error>> {
        Some(read_map(map).map(RawClients::Redis))
    }
}
by_form!(RawClients);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRedisClients {
    redis_hash: String,
    cache: Dur,
}

/// `deny`, or a map from plan limit name to its parameters in this tier.
enum RawTier {
    Deny,
    Limits(BTreeMap<String, RawTierLimit>),
}

impl<'de> Deserialize<'de> for RawTier {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawTier;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`deny`, or a map from plan limit name to { rate, burst }")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawTier, E> {
                match v {
                    "deny" => Ok(RawTier::Deny),
                    other => Err(E::custom(format!("`{other}` is not a tier; expected `deny` or a map of limits"))),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RawTier, A::Error> {
                BTreeMap::deserialize(de::value::MapAccessDeserializer::new(map)).map(RawTier::Limits)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
struct RawTierLimit {
    rate: Rate,
    burst: Option<u64>,
}

/// The validated section, with each tier's limit entries kept for the plan limits.
pub struct Validated {
    pub plans: Plans,
    /// By tier id: limit name → (rate, burst).
    entries: Vec<BTreeMap<String, RawTierLimit>>,
    /// Names of the plan limits seen so far.
    used: Vec<String>,
}

fn tier_path(tier: &str, rest: &[&str]) -> Vec<Seg> {
    let mut p = vec![key("plans"), key("tiers"), key(tier)];
    p.extend(rest.iter().map(|r| key(r)));
    p
}

impl RawPlans {
    pub fn validate(self, has_redis: bool) -> Result<Validated, Invalid> {
        let at = |field: &str| vec![key("plans"), key(field)];
        let of: KeyPart = self.of.parse().map_err(|e: crate::limit::KeyError| (at("of"), e.to_string()))?;
        if self.tiers.is_empty() {
            return Err((at("tiers"), "expected at least one tier".to_owned()));
        }
        if self.tiers.len() > MAX_TIERS {
            return Err((at("tiers"), format!("{} tiers; at most {MAX_TIERS} are accepted", self.tiers.len())));
        }
        let mut tiers = Vec::with_capacity(self.tiers.len());
        let mut entries = Vec::with_capacity(self.tiers.len());
        for (name, tier) in self.tiers {
            check_name(&name).map_err(|e| (tier_path(&name, &[]), e))?;
            match tier {
                RawTier::Deny => {
                    tiers.push(Tier { name, deny: true });
                    entries.push(BTreeMap::new());
                }
                RawTier::Limits(map) => {
                    tiers.push(Tier { name, deny: false });
                    entries.push(map);
                }
            }
        }
        let find = |name: &str| tiers.iter().position(|t| t.name == name).and_then(|i| TierId::try_from(i).ok());
        let default = find(&self.default).ok_or_else(|| {
            let known: Vec<&str> = tiers.iter().map(|t| t.name.as_str()).collect();
            (at("default"), format!("unknown tier `{}`; expected one of: {}", self.default, known.join(", ")))
        })?;
        let clients = match self.clients {
            // Read by `load_clients` once the whole config is valid.
            RawClients::File(path) => Clients::File { path: path.into(), map: HashMap::default() },
            RawClients::Redis(r) => {
                if !has_redis {
                    return Err((at("clients"), "`redis_hash` needs a `redis:` section".to_owned()));
                }
                if r.redis_hash.is_empty() {
                    return Err((at("clients"), "`redis_hash` must name a hash".to_owned()));
                }
                Clients::Redis { hash: r.redis_hash, cache: r.cache.0 }
            }
        };
        if self.tier_claim.as_deref().is_some_and(str::is_empty) {
            return Err((at("tier_claim"), "expected a claim name".to_owned()));
        }
        let tier_claim = self.tier_claim;
        Ok(Validated { plans: Plans { of, tiers, default, clients, tier_claim }, entries, used: Vec::new() })
    }
}

impl Validated {
    /// A route's limit: as written, or for `plan: true` once per tier that names it.
    pub fn limit(
        plans: Option<&mut Validated>,
        raw: RawLimit,
        index: usize,
        at: &dyn Fn(&str) -> Vec<Seg>,
    ) -> Result<LimitConfig, Invalid> {
        if !raw.plan {
            return raw.validate(index, at);
        }
        let Some(v) = plans else {
            return Err((at("plan"), "`plan: true` needs a `plans:` section with tiers".to_owned()));
        };
        if raw.rate.is_some() || raw.burst.is_some() {
            return Err((
                at(if raw.rate.is_some() { "rate" } else { "burst" }),
                "a plan limit takes `rate` and `burst` from the client's tier in `plans.tiers`".to_owned(),
            ));
        }
        let name = raw.name.clone().unwrap_or_else(|| format!("limit-{index}"));
        let mut algorithms: Vec<Option<Algorithm>> = Vec::with_capacity(v.entries.len());
        let mut first: Option<LimitConfig> = None;
        let order = std::iter::once(usize::from(v.plans.default)).chain(0..v.entries.len());
        let mut by_tier: Vec<Option<LimitConfig>> = vec![None; v.entries.len()];
        for t in order {
            if by_tier[t].is_some() {
                continue;
            }
            let Some(entry) = v.entries[t].get(&name) else { continue };
            let tier = v.plans.tiers[t].name.clone();
            let mut r = raw.clone();
            r.rate = Some(entry.rate);
            r.burst = entry.burst;
            r.plan = false;
            let at_tier = |field: &str| match field {
                "rate" | "burst" => tier_path(&tier, &[&name, field]),
                other => at(other),
            };
            let c = r.validate(index, &at_tier)?;
            if !c.algorithm.plans() {
                return Err((at("algorithm"), "a plan limit is a token_bucket or a window algorithm".to_owned()));
            }
            if c.lease.is_some() {
                return Err((at("lease"), "a plan limit takes no lease".to_owned()));
            }
            if first.is_none() {
                first = Some(c.clone());
            }
            by_tier[t] = Some(c);
        }
        for c in &by_tier {
            algorithms.push(c.as_ref().map(|c| c.algorithm.clone()));
        }
        let Some(mut config) = first else {
            return Err((
                at("plan"),
                format!("no tier in `plans.tiers` names limit `{name}`; give it a rate in at least one tier"),
            ));
        };
        v.used.push(name);
        config.plan = Some(Arc::new(PlanTiers { algorithms }));
        Ok(config)
    }

    /// After every route: a tier entry that no plan limit took names nothing.
    ///
    /// # Errors
    /// The first such entry.
    pub fn finish(self) -> Result<Plans, Invalid> {
        for (t, entry) in self.entries.iter().enumerate() {
            if let Some(name) = entry.keys().find(|n| !self.used.contains(n)) {
                return Err((
                    tier_path(&self.plans.tiers[t].name, &[name]),
                    format!("no `plan: true` limit is named `{name}`"),
                ));
            }
        }
        Ok(self.plans)
    }
}

/// Reads the clients file of `plans` (relative paths from the config file's folder): a YAML
/// map `client: tier`. Returns warnings for entries naming no tier (those clients get the
/// default tier), each with its line.
///
/// # Errors
/// A sentence when the file cannot be read or is not such a map.
pub fn load_clients(plans: &mut Plans, config_file: &Path) -> Result<Vec<String>, String> {
    let tiers = plans.tiers.clone();
    let default = plans.default;
    let Clients::File { path, map } = &mut plans.clients else { return Ok(Vec::new()) };
    let full = if path.is_relative() {
        config_file.parent().map_or_else(|| path.clone(), |d| d.join(&*path))
    } else {
        path.clone()
    };
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(&full)
        .and_then(|f| f.take(MAX_CLIENTS_BYTES + 1).read_to_string(&mut text))
        .map_err(|e| format!("cannot read the clients file {}: {e}", full.display()))?;
    if text.len() as u64 > MAX_CLIENTS_BYTES {
        return Err(format!("the clients file {} is larger than {MAX_CLIENTS_BYTES} bytes", full.display()));
    }
    let mut pairs = Pairs::default();
    let mut parser = Parser::new_from_str(&text);
    parser.load(&mut pairs, false).map_err(|e| format!("{}: {e}", full.display()))?;
    if let Some(line) = pairs.bad {
        return Err(format!("{}:{line}: expected a map of `client: tier` with plain values", full.display()));
    }
    let mut seen = HashMap::with_capacity(pairs.pairs.len());
    for (client, _, line) in &pairs.pairs {
        if let Some(first) = seen.insert(client.as_str(), *line) {
            return Err(format!(
                "{}:{line}: client `{}` is listed twice (first on line {first}); a client may appear only once",
                full.display(),
                client.escape_debug()
            ));
        }
    }
    let mut warnings = Vec::new();
    map.clear();
    for (client, tier, line) in pairs.pairs {
        match tiers.iter().position(|t| t.name == tier).and_then(|i| TierId::try_from(i).ok()) {
            Some(t) => {
                map.insert(client.into_bytes().into_boxed_slice(), t);
            }
            None => warnings.push(format!(
                "{}:{line}: unknown tier `{tier}` for client `{}`; it gets the default tier `{}`",
                full.display(),
                client.escape_debug(),
                tiers[usize::from(default)].name
            )),
        }
    }
    Ok(warnings)
}

/// The top-level `key: value` scalars of a YAML map, with the key's line.
#[derive(Default)]
struct Pairs {
    depth: usize,
    key: Option<(String, usize)>,
    pairs: Vec<(String, String, usize)>,
    /// The line of the first thing that is not a top-level scalar pair.
    bad: Option<usize>,
}

impl MarkedEventReceiver for Pairs {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        match ev {
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                self.depth += 1;
                if self.depth > 1 || matches!(ev, Event::SequenceStart(..)) {
                    self.bad.get_or_insert(mark.line());
                }
            }
            Event::MappingEnd | Event::SequenceEnd => self.depth = self.depth.saturating_sub(1),
            Event::Scalar(v, ..) if self.depth == 1 => match self.key.take() {
                None => self.key = Some((v, mark.line())),
                Some((k, line)) => self.pairs.push((k, v, line)),
            },
            Event::Scalar(..) | Event::Alias(..) => {
                self.bad.get_or_insert(mark.line());
            }
            _ => {}
        }
    }
}
