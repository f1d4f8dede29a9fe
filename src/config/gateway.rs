//! The gateway parts of a route's config: `match.headers`, `match.query`, `rewrite`,
//! `request_headers`, `response_headers`, and the top-level `request_id`. Raw mirrors here,
//! validated into data: patterns are checked here with the builders below and kept as text;
//! the `route` room compiles them again with the same builders at `Proxy::build`, and the
//! `forward` room its header rules.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use http::HeaderName;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::rules::{HeaderRules, Piece, Template, REFUSED};
use super::{key, Invalid, Seg};

/// Conditions of one route (headers and query together).
pub const MAX_CONDITIONS: usize = 32;
/// Rules of one list (`remove`, `set` or `add`) of one route.
pub const MAX_RULES: usize = 64;

/// Compiled size bound of one pattern (and of its lazy DFA's cache), so a config cannot make
/// a route cost unbounded memory.
pub const REGEX_SIZE: usize = 256 << 10;

/// What one header or query parameter must look like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueMatch {
    /// Byte for byte (case-sensitive, as Envoy's `exact`).
    Exact(Box<[u8]>),
    /// `true`: the field is there (any value, empty included); `false`: it is not.
    Present(bool),
    /// The whole value matches this pattern (checked by [`value_regex`]).
    Regex(String),
}

/// `match.headers` and `match.query` of a route.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Conditions {
    pub headers: Vec<(HeaderName, ValueMatch)>,
    pub query: Vec<(String, ValueMatch)>,
}

/// `rewrite.path_regex` of a route (checked by [`path_regex`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathRewrite {
    pub pattern: String,
    /// The replacement in the `regex` crate's syntax (`$1`, `${name}`, `$$`); each `$` names
    /// a group of the pattern.
    pub replace: String,
}

/// A condition's pattern compiled for whole-value matching (wrapped in `^(?:…)$`), bounded by
/// [`REGEX_SIZE`].
///
/// # Errors
/// The pattern does not parse, or compiles larger than the bound.
pub fn value_regex(pattern: &str) -> Result<regex::bytes::Regex, String> {
    regex::bytes::RegexBuilder::new(&format!("^(?:{pattern})$"))
        .size_limit(REGEX_SIZE)
        .dfa_size_limit(REGEX_SIZE)
        .build()
        .map_err(|e| format!("`{pattern}` is not a regular expression the `regex` crate accepts: {e}"))
}

/// A rewrite's pattern compiled, bounded by [`REGEX_SIZE`].
///
/// # Errors
/// The pattern does not parse, or compiles larger than the bound.
pub fn path_regex(pattern: &str) -> Result<regex::Regex, String> {
    regex::RegexBuilder::new(pattern)
        .size_limit(REGEX_SIZE)
        .dfa_size_limit(REGEX_SIZE)
        .build()
        .map_err(|e| format!("`{pattern}` is not a regular expression the `regex` crate accepts: {e}"))
}

/// `request_id:` at the top level.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRequestId {
    #[serde(default = "yes")]
    enabled: bool,
    header: Option<String>,
}

fn yes() -> bool {
    true
}

impl Default for RawRequestId {
    fn default() -> Self {
        RawRequestId { enabled: true, header: None }
    }
}

impl RawRequestId {
    /// The field of request ids, `None` when they are off.
    pub(super) fn validate(self) -> Result<Option<HeaderName>, Invalid> {
        if !self.enabled {
            return Ok(None);
        }
        match self.header {
            None => Ok(Some(crate::request_id::DEFAULT_HEADER)),
            Some(h) => {
                let at = || vec![key("request_id"), key("header")];
                let name =
                    HeaderName::from_bytes(h.as_bytes()).map_err(|_| (at(), format!("`{h}` is not a header name")))?;
                if name == crate::request_id::DEFAULT_HEADER {
                    return Ok(Some(crate::request_id::DEFAULT_HEADER));
                }
                if REFUSED.contains(&name)
                    || name == crate::request_id::TRACEPARENT
                    || name == crate::request_id::TRACESTATE
                {
                    return Err((
                        at(),
                        format!("`{h}` cannot carry request ids; expected a field of your own such as x-request-id"),
                    ));
                }
                Ok(Some(name))
            }
        }
    }
}

/// A scalar written where text is expected (`x-api-version: 2` means the text `2`).
pub(super) struct Text(pub String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor("a text value")).map(Text)
    }
}

struct ScalarVisitor(&'static str);

impl Visitor<'_> for ScalarVisitor {
    type Value = String;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<String, E> {
        Ok(v.to_string())
    }
}

/// One entry of `match.headers` / `match.query`.
pub(super) enum RawValueMatch {
    Exact(String),
    Present(bool),
    Regex(String),
}

const MATCH_EXPECTED: &str = "a value, `{ present: true|false }` or `{ regex: \"...\" }`";

impl<'de> Deserialize<'de> for RawValueMatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawValueMatch;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(MATCH_EXPECTED)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawValueMatch, E> {
                ScalarVisitor(MATCH_EXPECTED).visit_str(v).map(RawValueMatch::Exact)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<RawValueMatch, E> {
                ScalarVisitor(MATCH_EXPECTED).visit_bool(v).map(RawValueMatch::Exact)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawValueMatch, E> {
                ScalarVisitor(MATCH_EXPECTED).visit_i64(v).map(RawValueMatch::Exact)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawValueMatch, E> {
                ScalarVisitor(MATCH_EXPECTED).visit_u64(v).map(RawValueMatch::Exact)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<RawValueMatch, E> {
                ScalarVisitor(MATCH_EXPECTED).visit_f64(v).map(RawValueMatch::Exact)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawValueMatch, A::Error> {
                let Some(k) = map.next_key::<String>()? else {
                    return Err(de::Error::custom(format!("expected {MATCH_EXPECTED}")));
                };
                let out = match k.as_str() {
                    "present" => RawValueMatch::Present(map.next_value()?),
                    "regex" => RawValueMatch::Regex(map.next_value()?),
                    other => return Err(de::Error::unknown_field(other, &["present", "regex"])),
                };
                match map.next_key::<String>()?.as_deref() {
                    None => {}
                    Some("present" | "regex") => {
                        return Err(de::Error::custom("give one of `present` or `regex`, not both"))
                    }
                    Some(other) => return Err(de::Error::unknown_field(other, &["present", "regex"])),
                }
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
}

/// `rewrite:` of a route.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRewrite {
    path_regex: RawPathRegex,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPathRegex {
    pattern: String,
    replace: String,
}

/// `request_headers:` / `response_headers:` of a route.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRules {
    #[serde(default)]
    remove: Vec<String>,
    #[serde(default)]
    set: BTreeMap<String, Text>,
    #[serde(default)]
    add: BTreeMap<String, Text>,
}

/// `match.headers` and `match.query`; `at` is the path of the route's `match`.
pub(super) fn conditions(
    headers: BTreeMap<String, RawValueMatch>,
    query: BTreeMap<String, RawValueMatch>,
    at: &dyn Fn(&[&str]) -> Vec<Seg>,
) -> Result<Option<Box<Conditions>>, Invalid> {
    if headers.is_empty() && query.is_empty() {
        return Ok(None);
    }
    if headers.len() + query.len() > MAX_CONDITIONS {
        return Err((at(&["headers"]), format!("at most {MAX_CONDITIONS} header and query conditions on one route")));
    }
    let compile = |m: RawValueMatch, at: Vec<Seg>| match m {
        RawValueMatch::Exact(v) => Ok(ValueMatch::Exact(v.into_bytes().into_boxed_slice())),
        RawValueMatch::Present(p) => Ok(ValueMatch::Present(p)),
        RawValueMatch::Regex(r) => match value_regex(&r) {
            Ok(_) => Ok(ValueMatch::Regex(r)),
            Err(e) => {
                let mut at = at;
                at.push(key("regex"));
                Err((at, e))
            }
        },
    };
    let mut out = Conditions::default();
    for (name, m) in headers {
        let here = || {
            let mut p = at(&["headers"]);
            p.push(key(&name));
            p
        };
        let h =
            HeaderName::from_bytes(name.as_bytes()).map_err(|_| (here(), format!("`{name}` is not a header name")))?;
        out.headers.push((h, compile(m, here())?));
    }
    for (name, m) in query {
        let mut here = at(&["query"]);
        here.push(key(&name));
        if name.is_empty() {
            return Err((here, "a query parameter needs a name".to_owned()));
        }
        let m = compile(m, here)?;
        out.query.push((name, m));
    }
    Ok(Some(Box::new(out)))
}

/// `rewrite.path_regex`; `at` is the path of the route.
pub(super) fn rewrite(
    raw: Option<RawRewrite>,
    strip_prefix: bool,
    at: &dyn Fn(&[&str]) -> Vec<Seg>,
) -> Result<Option<Box<PathRewrite>>, Invalid> {
    let Some(raw) = raw else { return Ok(None) };
    if strip_prefix {
        return Err((at(&["rewrite"]), "give either `strip_prefix` or `rewrite`, not both".to_owned()));
    }
    let p = raw.path_regex;
    let pattern = path_regex(&p.pattern).map_err(|e| (at(&["rewrite", "path_regex", "pattern"]), e))?;
    let replace_at = || at(&["rewrite", "path_regex", "replace"]);
    if p.replace.contains(['?', '#']) || p.replace.contains(|c: char| c.is_whitespace() || c.is_control()) {
        return Err((
            replace_at(),
            format!(
                "`{}` must be a path: no `?`, `#`, spaces or control characters (the query is kept as sent)",
                p.replace
            ),
        ));
    }
    // `$n` beyond the groups expands to nothing: say so at load instead.
    let groups = pattern.captures_len();
    let mut rest = p.replace.as_str();
    while let Some(i) = rest.find('$') {
        rest = &rest[i + 1..];
        if let Some(r) = rest.strip_prefix('$') {
            rest = r;
            continue;
        }
        let name = match rest.strip_prefix('{') {
            Some(r) => r.split('}').next().unwrap_or(""),
            None => {
                let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
                &rest[..end]
            }
        };
        let known = match name.parse::<usize>() {
            Ok(n) => n < groups,
            Err(_) => pattern.capture_names().flatten().any(|g| g == name),
        };
        if !known {
            return Err((
                replace_at(),
                format!("`${name}` names no group of the pattern (write `$$` for a literal `$`)"),
            ));
        }
    }
    Ok(Some(Box::new(PathRewrite { pattern: p.pattern, replace: p.replace })))
}

/// `request_headers` / `response_headers` (`field`); `ids` says whether request ids are on.
pub(super) fn rules(
    raw: Option<RawRules>,
    field: &str,
    ids: bool,
    at: &dyn Fn(&[&str]) -> Vec<Seg>,
) -> Result<Option<Arc<HeaderRules>>, Invalid> {
    let Some(raw) = raw else { return Ok(None) };
    let name = |n: &str, here: &dyn Fn() -> Vec<Seg>| -> Result<HeaderName, Invalid> {
        let h = HeaderName::from_bytes(n.as_bytes()).map_err(|_| (here(), format!("`{n}` is not a header name")))?;
        if REFUSED.contains(&h) {
            return Err((
                here(),
                format!("`{n}` is a framing or hop-by-hop field; tollgate manages it and no rule may set or remove it"),
            ));
        }
        Ok(h)
    };
    for (list, len) in [("remove", raw.remove.len()), ("set", raw.set.len()), ("add", raw.add.len())] {
        if len > MAX_RULES {
            return Err((at(&[field, list]), format!("at most {MAX_RULES} entries")));
        }
    }
    let mut out = HeaderRules::default();
    for (i, n) in raw.remove.iter().enumerate() {
        out.remove.push(name(n, &|| {
            let mut p = at(&[field, "remove"]);
            p.push(Seg::Index(i));
            p
        })?);
    }
    for (list, entries) in [("set", raw.set), ("add", raw.add)] {
        for (n, Text(v)) in entries {
            let here = || {
                let mut p = at(&[field, list]);
                p.push(key(&n));
                p
            };
            let h = name(&n, &here)?;
            let t = Template::parse(&v).map_err(|e| (here(), e))?;
            if !ids && t.uses(&Piece::RequestId) {
                return Err((here(), "`{request_id}` needs request ids on (`request_id.enabled`)".to_owned()));
            }
            if list == "set" { &mut out.set } else { &mut out.add }.push((h, t));
        }
    }
    Ok(Some(Arc::new(out)))
}
