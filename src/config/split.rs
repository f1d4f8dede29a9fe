//! `routes[].split`: a route that sends to several upstreams by weight (a canary, a gradual
//! rollout), with stickiness by a key and an override header for testers. The serde mirror
//! and its validation; the choice per request is [`crate::forward::split`].

use std::collections::BTreeMap;

use http::{HeaderName, HeaderValue};
use serde::Deserialize;

use super::limits::KeyList;
use super::{key, Invalid, Seg};
use crate::limit::{KeyPart, KeySpec};

/// Sides of one split.
pub const MAX_SIDES: usize = 16;
/// The largest weight of a side (so `999` against `1` is a 0.1 % canary).
pub const MAX_SIDE_WEIGHT: u32 = 1000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSplit {
    upstreams: Vec<RawSide>,
    sticky: Option<KeyList>,
    #[serde(rename = "override")]
    overrides: Option<RawOverride>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSide {
    name: String,
    weight: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOverride {
    header: String,
    #[serde(default)]
    values: BTreeMap<String, String>,
}

/// A validated split.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    /// In the order written; the first is the route's `upstream` for what names one.
    pub sides: Vec<Side>,
    /// Requests with the same key go to the same side (while the weights stay).
    pub sticky: Option<KeySpec>,
    pub overrides: Option<Override>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Side {
    /// Index into [`super::Config::upstreams`].
    pub upstream: usize,
    pub name: String,
    /// 0..=[`MAX_SIDE_WEIGHT`]; a side of weight 0 takes only overridden requests.
    pub weight: u32,
}

/// A request header that chooses the side: a value listed in `values` picks its side, and a
/// value naming a side's upstream picks that one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    pub header: HeaderName,
    /// (value, side index), as written.
    pub values: Vec<(HeaderValue, usize)>,
}

impl RawSplit {
    /// `at(field)` is the path of a field under `routes[i].split`; `upstream(name)` finds an
    /// upstream's index; `identity`: the route verifies credentials (for `consumer` keys).
    pub fn validate(
        self,
        at: &dyn Fn(&[&str]) -> Vec<Seg>,
        upstream: &dyn Fn(&str) -> Option<usize>,
        known: &[&str],
        identity: bool,
    ) -> Result<Split, Invalid> {
        if self.upstreams.len() < 2 {
            return Err((at(&["upstreams"]), "expected at least two upstreams to split between".to_owned()));
        }
        if self.upstreams.len() > MAX_SIDES {
            return Err((at(&["upstreams"]), format!("{} upstreams; at most {MAX_SIDES}", self.upstreams.len())));
        }
        let mut sides: Vec<Side> = Vec::with_capacity(self.upstreams.len());
        for (i, s) in self.upstreams.iter().enumerate() {
            let here = |f: &str| {
                let mut p = at(&["upstreams"]);
                p.push(Seg::Index(i));
                p.push(key(f));
                p
            };
            let idx = upstream(&s.name).ok_or_else(|| {
                (here("name"), format!("unknown upstream `{}`; expected one of: {}", s.name, known.join(", ")))
            })?;
            if sides.iter().any(|o| o.upstream == idx) {
                return Err((here("name"), format!("`{}` is listed twice", s.name)));
            }
            if s.weight > MAX_SIDE_WEIGHT {
                return Err((here("weight"), format!("weight {}; expected 0 to {MAX_SIDE_WEIGHT}", s.weight)));
            }
            sides.push(Side { upstream: idx, name: s.name.clone(), weight: s.weight });
        }
        if sides.iter().all(|s| s.weight == 0) {
            return Err((at(&["upstreams"]), "every weight is 0; at least one side must take requests".to_owned()));
        }
        let sticky = match self.sticky {
            None => None,
            Some(list) => {
                let mut parts = Vec::with_capacity(list.0.len());
                for p in &list.0 {
                    parts.push(p.parse::<KeyPart>().map_err(|e| (at(&["sticky"]), e.to_string()))?);
                }
                if !identity && parts.iter().any(KeyPart::needs_identity) {
                    return Err((
                        at(&["sticky"]),
                        "`consumer` and `claim:` keys need the route's `auth`; this route verifies no credential"
                            .to_owned(),
                    ));
                }
                Some(KeySpec::new(parts).map_err(|e| (at(&["sticky"]), e.to_string()))?)
            }
        };
        let overrides = match self.overrides {
            None => None,
            Some(o) => {
                let header = HeaderName::from_bytes(o.header.as_bytes())
                    .map_err(|_| (at(&["override", "header"]), format!("`{}` is not a valid header name", o.header)))?;
                let mut values = Vec::with_capacity(o.values.len() + sides.len());
                for (v, side) in &o.values {
                    let here = || at(&["override", "values", v]);
                    let Some(i) = sides.iter().position(|s| s.name == *side) else {
                        let names: Vec<&str> = sides.iter().map(|s| s.name.as_str()).collect();
                        return Err((
                            here(),
                            format!("`{side}` is not a side of this split; expected one of: {}", names.join(", ")),
                        ));
                    };
                    let value =
                        HeaderValue::from_str(v).map_err(|_| (here(), format!("`{v}` is not a header value")))?;
                    values.push((value, i));
                }
                // A side's own name chooses it too, unless a listed value says otherwise.
                for (i, s) in sides.iter().enumerate() {
                    if let Ok(v) = HeaderValue::from_str(&s.name) {
                        if !values.iter().any(|(w, _)| *w == v) {
                            values.push((v, i));
                        }
                    }
                }
                Some(Override { header, values })
            }
        };
        Ok(Split { sides, sticky, overrides })
    }
}

impl Split {
    /// `api-v1 90 %, api-v2 10 %`.
    pub fn shares(&self) -> String {
        let total: u32 = self.sides.iter().map(|s| s.weight).sum();
        let share = |w: u32| {
            let pct = f64::from(w) * 100.0 / f64::from(total.max(1));
            if (pct - pct.round()).abs() < 1e-9 {
                format!("{pct:.0} %")
            } else {
                format!("{pct:.1} %")
            }
        };
        self.sides.iter().map(|s| format!("{} {}", s.name, share(s.weight))).collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::Config;

    fn config(route: &str) -> Result<Config, crate::config::ConfigError> {
        let yaml = format!(
            "upstreams:\n  v1: {{ url: http://a:1 }}\n  v2: {{ url: http://b:1 }}\nroutes:\n  - name: api\n{route}"
        );
        Config::from_yaml(Path::new("s.yaml"), &yaml)
    }

    #[test]
    fn a_split_names_its_sides_and_the_first_is_the_route_upstream() {
        let c = config(
            "    split:\n      upstreams: [{ name: v2, weight: 90 }, { name: v1, weight: 10 }]\n      sticky: [client_ip, header:x-user]\n      override: { header: x-canary, values: { always: v1 } }\n",
        )
        .unwrap();
        let r = &c.routes[0];
        let s = r.split.as_ref().unwrap();
        assert_eq!(c.upstreams[r.upstream].name, "v2");
        assert_eq!(s.shares(), "v2 90 %, v1 10 %");
        let o = s.overrides.as_ref().unwrap();
        let values: Vec<(&str, usize)> = o.values.iter().map(|(v, i)| (v.to_str().unwrap(), *i)).collect();
        assert_eq!(values, [("always", 1), ("v2", 0), ("v1", 1)]);
    }

    #[test]
    fn broken_splits_name_the_field() {
        let cases: &[(&str, &str, &str)] = &[
            ("    upstream: v1\n    split: { upstreams: [] }\n", "routes[0].split", "either"),
            ("    strip_prefix: false\n", "routes[0]", "split"),
            ("    split: { upstreams: [{ name: v1, weight: 1 }] }\n", "routes[0].split.upstreams", "two"),
            (
                "    split: { upstreams: [{ name: v1, weight: 1 }, { name: v3, weight: 1 }] }\n",
                "routes[0].split.upstreams[1].name",
                "unknown upstream `v3`",
            ),
            (
                "    split: { upstreams: [{ name: v1, weight: 0 }, { name: v2, weight: 0 }] }\n",
                "routes[0].split.upstreams",
                "every weight is 0",
            ),
            (
                "    split: { upstreams: [{ name: v1, weight: 1001 }, { name: v2, weight: 0 }] }\n",
                "routes[0].split.upstreams[0].weight",
                "0 to 1000",
            ),
            (
                "    split: { upstreams: [{ name: v1, weight: 1 }, { name: v1, weight: 1 }] }\n",
                "routes[0].split.upstreams[1].name",
                "twice",
            ),
            (
                "    split: { upstreams: [{ name: v1, weight: 1 }, { name: v2, weight: 1 }], sticky: consumer }\n",
                "routes[0].split.sticky",
                "auth",
            ),
            (
                "    split: { upstreams: [{ name: v1, weight: 1 }, { name: v2, weight: 1 }], override: { header: x, values: { on: v3 } } }\n",
                "routes[0].split.override.values.on",
                "not a side",
            ),
        ];
        for (route, path, word) in cases {
            match config(route) {
                Ok(_) => panic!("should be refused:\n{route}"),
                Err(e) => {
                    assert_eq!(e.path, *path, "{route}: {}", e.message);
                    assert!(e.message.contains(word), "{route}: {}", e.message);
                }
            }
        }
    }
}
