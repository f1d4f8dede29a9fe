//! `cors:` (top level: the default of every route; per route: its own, or `none`): which
//! origins' pages may call a route from a browser, with which methods and request fields, what
//! they may read of the answers, whether with credentials, and how long a preflight holds.
//! Data only: the `step` room compiles it (patterns, the fields' values) at `Proxy::build`.

use std::fmt;
use std::time::Duration;

use http::{HeaderName, Method};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::units::Dur;
use super::{key, Invalid, Seg};

/// How long a browser keeps a preflight's answer unless `max_age` says otherwise.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(600);
/// The longest `max_age` (Firefox's own cap; Chromium keeps two hours at most).
pub const MAX_MAX_AGE: Duration = Duration::from_secs(86_400);
/// Entries of one list (`origins`, `methods`, `headers`, `expose`).
pub const MAX_ENTRIES: usize = 256;

/// A route's `cors`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorsConfig {
    pub origins: Origins,
    /// The methods a page may use beyond GET, HEAD and POST (which need no preflight).
    pub methods: Allow<Method>,
    /// Request fields a page may send (beyond the CORS-safelisted ones).
    pub headers: Allow<HeaderName>,
    /// Answer fields a page may read, besides the ones tollgate always exposes
    /// (`Retry-After`, `RateLimit`, `RateLimit-Policy`, the request id field).
    pub expose: Allow<HeaderName>,
    /// Pages may send cookies or HTTP authentication and read the answers.
    pub credentials: bool,
    /// `Access-Control-Max-Age` of a preflight's answer (whole seconds).
    pub max_age: Duration,
    /// Preflights go through the route's limits (they spend quota); by default they do not.
    pub limit_preflights: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origins {
    /// `*`: every origin (never with credentials).
    Any,
    List(Vec<OriginRule>),
}

/// One entry of `origins`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OriginRule {
    /// A serialized origin (`https://app.example.com`, `http://localhost:3000`): lower case,
    /// the scheme's default port left out, as browsers send it. `null` is the opaque origin
    /// (sandboxed frames, `file:` pages), matched only by this exact entry.
    Exact(String),
    /// `*.example.com` or `https://*.example.com:8443`: any host below the domain.
    Wildcard {
        /// `None`: http and https.
        scheme: Option<String>,
        /// `.example.com`.
        suffix: String,
        /// `None`: the scheme's default port (no port in the origin).
        port: Option<u16>,
    },
    /// `{ regex: "..." }` over the whole origin (checked with the builder the step compiles it with).
    Regex(String),
}

/// `*` (any) or a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allow<T> {
    Any,
    List(Vec<T>),
}

/// `cors:` on a route: `none`, or its own.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum RawRouteCors {
    Word(String),
    Own(Box<RawCors>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCors {
    origins: Vec<RawOrigin>,
    methods: Option<Vec<String>>,
    headers: Option<Vec<String>>,
    expose: Option<Vec<String>>,
    #[serde(default)]
    credentials: bool,
    max_age: Option<Dur>,
    #[serde(default)]
    limit_preflights: bool,
}

/// An `origins` entry: a text, or `{ regex: "..." }`.
enum RawOrigin {
    Text(String),
    Regex(String),
}

const ORIGIN_EXPECTED: &str = "an origin such as https://app.example.com, *.example.com, `*`, or `{ regex: \"...\" }`";

impl<'de> Deserialize<'de> for RawOrigin {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawOrigin;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(ORIGIN_EXPECTED)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawOrigin, E> {
                Ok(RawOrigin::Text(v.to_owned()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawOrigin, A::Error> {
                match map.next_key::<String>()?.as_deref() {
                    Some("regex") => {
                        let pattern = map.next_value()?;
                        if let Some(k) = map.next_key::<String>()? {
                            return Err(de::Error::unknown_field(&k, &["regex"]));
                        }
                        Ok(RawOrigin::Regex(pattern))
                    }
                    Some(other) => Err(de::Error::unknown_field(other, &["regex"])),
                    None => Err(de::Error::custom(format!("expected {ORIGIN_EXPECTED}"))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl RawRouteCors {
    /// `None`: the route has `cors: none`.
    pub fn validate(self, at: &[Seg]) -> Result<Option<CorsConfig>, Invalid> {
        match self {
            RawRouteCors::Word(w) if w == "none" => Ok(None),
            RawRouteCors::Word(w) => Err((at.to_vec(), format!("`{w}`: expected `none` or a map with `origins`"))),
            RawRouteCors::Own(raw) => raw.validate(at).map(Some),
        }
    }
}

impl RawCors {
    pub fn validate(self, at: &[Seg]) -> Result<CorsConfig, Invalid> {
        let path = |field: &str, i: Option<usize>| {
            let mut p = at.to_vec();
            p.push(key(field));
            p.extend(i.map(Seg::Index));
            p
        };
        for (field, len) in [
            ("origins", self.origins.len()),
            ("methods", self.methods.as_ref().map_or(0, Vec::len)),
            ("headers", self.headers.as_ref().map_or(0, Vec::len)),
            ("expose", self.expose.as_ref().map_or(0, Vec::len)),
        ] {
            if len > MAX_ENTRIES {
                return Err((path(field, None), format!("{len} entries; at most {MAX_ENTRIES} are accepted")));
            }
        }
        if self.origins.is_empty() {
            return Err((
                path("origins", None),
                "expected at least one origin whose pages may call the route (or `*` for every origin)".to_owned(),
            ));
        }
        let any = self.origins.iter().position(|o| matches!(o, RawOrigin::Text(t) if t.trim() == "*"));
        let origins = match any {
            Some(i) if self.origins.len() > 1 => {
                return Err((path("origins", Some(i)), "`*` allows every origin: list nothing beside it".to_owned()))
            }
            Some(i) if self.credentials => {
                return Err((
                    path("origins", Some(i)),
                    "`*` cannot go with `credentials: true`: every site could read answers made with your users' \
                     cookies (browsers refuse it too); list the origins"
                        .to_owned(),
                ))
            }
            Some(_) => Origins::Any,
            None => {
                let mut rules = Vec::with_capacity(self.origins.len());
                for (i, o) in self.origins.into_iter().enumerate() {
                    let rule = match o {
                        RawOrigin::Text(t) => origin_rule(&t),
                        RawOrigin::Regex(p) => {
                            super::gateway::value_regex(&p).map(|_| OriginRule::Regex(p)).map_err(|e| e.to_string())
                        }
                    };
                    let rule = rule.map_err(|e| (path("origins", Some(i)), e))?;
                    if !rules.contains(&rule) {
                        rules.push(rule);
                    }
                }
                Origins::List(rules)
            }
        };
        let methods = match self.methods {
            None => Allow::List(vec![Method::GET, Method::HEAD, Method::POST]),
            Some(list) => allow(list, |m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| format!("`{m}` is not an HTTP method"))
            })
            .map_err(|(i, e)| (path("methods", Some(i)), e))?,
        };
        let name = |n: &str| HeaderName::from_bytes(n.as_bytes()).map_err(|_| format!("`{n}` is not a header name"));
        let headers = match self.headers {
            None => Allow::List(Vec::new()),
            Some(list) => allow(list, name).map_err(|(i, e)| (path("headers", Some(i)), e))?,
        };
        let expose = match self.expose {
            None => Allow::List(Vec::new()),
            Some(list) => allow(list, name).map_err(|(i, e)| (path("expose", Some(i)), e))?,
        };
        if self.credentials && expose == Allow::Any {
            return Err((
                path("expose", None),
                "with `credentials: true`, browsers read `*` as a field named `*`: list the fields".to_owned(),
            ));
        }
        let max_age = match self.max_age {
            None => DEFAULT_MAX_AGE,
            Some(Dur(d)) if d.subsec_nanos() == 0 && d <= MAX_MAX_AGE => d,
            Some(_) => {
                return Err((path("max_age", None), format!("expected whole seconds from 0 to {}", Dur(MAX_MAX_AGE))))
            }
        };
        Ok(CorsConfig {
            origins,
            methods,
            headers,
            expose,
            credentials: self.credentials,
            max_age,
            limit_preflights: self.limit_preflights,
        })
    }
}

/// A list that is either `[*]` or entries each `parse` accepts (duplicates dropped); the
/// error's index is the entry's.
fn allow<T: PartialEq>(
    list: Vec<String>,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Allow<T>, (usize, String)> {
    if let Some(i) = list.iter().position(|e| e.trim() == "*") {
        return if list.len() == 1 {
            Ok(Allow::Any)
        } else {
            Err((i, "`*` allows any: list nothing beside it".to_owned()))
        };
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, e) in list.iter().enumerate() {
        let v = parse(e.trim()).map_err(|m| (i, m))?;
        if !out.contains(&v) {
            out.push(v);
        }
    }
    Ok(Allow::List(out))
}

/// An `origins` text: `null`, `scheme://host[:port]`, or a wildcard host.
fn origin_rule(text: &str) -> Result<OriginRule, String> {
    let t = text.trim().to_ascii_lowercase();
    if t == "null" {
        return Ok(OriginRule::Exact(t));
    }
    let (scheme, rest) = match t.split_once("://") {
        Some((s, rest)) => (Some(s), rest),
        None if t.starts_with("*.") => (None, t.as_str()),
        None => {
            return Err(format!(
                "`{text}` has no scheme; an origin is scheme://host[:port], e.g. https://{text} (or `*.example.com` \
                 for every host below a domain)"
            ))
        }
    };
    if let Some(s) = scheme {
        let ok = s.starts_with(|c: char| c.is_ascii_alphabetic())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
        if !ok {
            return Err(format!("`{text}`: `{s}` is not a scheme"));
        }
    }
    if rest.contains(['/', '?', '#', '@']) {
        return Err(format!(
            "`{text}` is not an origin: an origin is scheme://host[:port], with no path, query or user (browsers \
             send `Origin` without them)"
        ));
    }
    let (host, port) = split_port(rest).ok_or_else(|| format!("`{text}` has a port that is not 1 to 65535"))?;
    let label = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let host_ok = |h: &str| {
        let h = h.strip_prefix('[').and_then(|h| h.strip_suffix(']')).map_or(h, |ip6| ip6);
        h.parse::<std::net::Ipv6Addr>().is_ok() || (!h.is_empty() && h.split('.').all(label))
    };
    // A port equal to the scheme's default is what browsers leave out.
    let default = |s: Option<&str>| match s {
        Some("http") => Some(80),
        Some("https") => Some(443),
        _ => None,
    };
    let port = port.filter(|p| Some(*p) != default(scheme));
    if let Some(suffix) = host.strip_prefix("*.") {
        if (!suffix.contains('.') && suffix != "localhost") || !suffix.split('.').all(label) {
            return Err(format!("`{text}`: expected a wildcard such as *.example.com (a domain below a suffix)"));
        }
        return Ok(OriginRule::Wildcard { scheme: scheme.map(str::to_owned), suffix: format!(".{suffix}"), port });
    }
    if host.contains('*') {
        return Err(format!("`{text}`: a wildcard stands for whole labels at the start only, as in *.example.com"));
    }
    if !host_ok(host) {
        return Err(format!("`{text}`: `{host}` is not a host name or address"));
    }
    let scheme = scheme.unwrap_or_default();
    Ok(OriginRule::Exact(match port {
        Some(p) => format!("{scheme}://{host}:{p}"),
        None => format!("{scheme}://{host}"),
    }))
}

/// `host[:port]` → host and port; `None` when the port is not 1 to 65535. An IPv6 address
/// keeps its brackets.
pub fn split_port(s: &str) -> Option<(&str, Option<u16>)> {
    let colon = if s.starts_with('[') { s.find(']').map(|e| e + 1).filter(|&e| e < s.len()) } else { s.rfind(':') };
    match colon {
        Some(c) if s.as_bytes().get(c) == Some(&b':') => {
            let p = &s[c + 1..];
            let port =
                p.bytes().all(|b| b.is_ascii_digit()).then(|| p.parse::<u16>().ok()).flatten().filter(|&n| n != 0)?;
            Some((&s[..c], Some(port)))
        }
        _ => Some((s, None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(t: &str) -> Result<OriginRule, String> {
        origin_rule(t)
    }

    #[test]
    fn origins_are_kept_as_browsers_send_them() {
        assert_eq!(rule("HTTPS://App.Example.com"), Ok(OriginRule::Exact("https://app.example.com".into())));
        assert_eq!(rule("https://app.example.com:443"), Ok(OriginRule::Exact("https://app.example.com".into())));
        assert_eq!(rule("http://localhost:3000"), Ok(OriginRule::Exact("http://localhost:3000".into())));
        assert_eq!(rule("http://[::1]:8080"), Ok(OriginRule::Exact("http://[::1]:8080".into())));
        assert_eq!(rule("null"), Ok(OriginRule::Exact("null".into())));
        assert_eq!(
            rule("*.example.com"),
            Ok(OriginRule::Wildcard { scheme: None, suffix: ".example.com".into(), port: None })
        );
        assert_eq!(
            rule("https://*.example.com:8443"),
            Ok(OriginRule::Wildcard { scheme: Some("https".into()), suffix: ".example.com".into(), port: Some(8443) })
        );
    }

    #[test]
    fn what_is_not_an_origin_is_refused_with_why() {
        assert!(rule("app.example.com").unwrap_err().contains("has no scheme"));
        assert!(rule("https://app.example.com/").unwrap_err().contains("no path"));
        assert!(rule("https://app.example.com:0").unwrap_err().contains("port"));
        assert!(rule("https://a.*.example.com").unwrap_err().contains("at the start only"));
        assert!(rule("*.com").unwrap_err().contains("wildcard"));
        assert!(rule("https://exa mple.com").unwrap_err().contains("not a host"));
    }

    fn cors(yaml: &str) -> Result<CorsConfig, Invalid> {
        let raw: RawCors = serde_yaml::from_str(yaml).unwrap();
        raw.validate(&[key("cors")])
    }

    #[test]
    fn star_never_goes_with_credentials_or_with_other_origins() {
        let e = cors("{ origins: ['*'], credentials: true }").unwrap_err();
        assert!(e.1.contains("cannot go with `credentials: true`"), "{e:?}");
        let e = cors("{ origins: ['*', 'https://a.example'] }").unwrap_err();
        assert_eq!(e.0, vec![key("cors"), key("origins"), Seg::Index(0)]);
        let e = cors("{ origins: ['https://a.example'], expose: ['*'], credentials: true }").unwrap_err();
        assert!(e.1.contains("list the fields"), "{e:?}");
        let ok = cors("{ origins: ['*'] }").unwrap();
        assert_eq!(ok.origins, Origins::Any);
        assert_eq!(ok.methods, Allow::List(vec![Method::GET, Method::HEAD, Method::POST]));
        assert_eq!(ok.max_age, DEFAULT_MAX_AGE);
        assert!(!ok.limit_preflights);
    }

    #[test]
    fn lists_and_patterns_are_checked() {
        let c = cors("{ origins: [{ regex: '^https://pr-[0-9]+\\.example\\.com$' }], methods: [put, DELETE], headers: [X-Custom], max_age: 1h }")
            .unwrap();
        assert_eq!(c.methods, Allow::List(vec![Method::PUT, Method::DELETE]));
        assert_eq!(c.headers, Allow::List(vec![HeaderName::from_static("x-custom")]));
        assert_eq!(c.max_age, Duration::from_secs(3600));
        let e = cors("{ origins: [{ regex: '(' }] }").unwrap_err();
        assert_eq!(e.0, vec![key("cors"), key("origins"), Seg::Index(0)]);
        let e = cors("{ origins: ['https://a.example'], max_age: 1.5s }").unwrap_err();
        assert_eq!(e.0, vec![key("cors"), key("max_age")]);
        let e = cors("{ origins: ['https://a.example'], headers: ['bad header'] }").unwrap_err();
        assert_eq!(e.0, vec![key("cors"), key("headers"), Seg::Index(0)]);
    }
}
