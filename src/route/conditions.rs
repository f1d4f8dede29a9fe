//! Header and query conditions of a route (`match.headers`, `match.query`) and its regex
//! rewrite, compiled from the config's at `Proxy::build` (never per request). Every condition
//! must hold; a route without any has `None` and pays one branch. Regexes are the `regex`
//! crate's (linear time, no backtracking), anchored so they must match the whole value, and
//! built with the config's builders, which checked them when the config loaded.

use http::header::{HeaderMap, HeaderName};

use crate::config;

/// What one header or query parameter must look like.
#[derive(Debug, Clone)]
pub enum ValueMatch {
    /// Byte for byte (case-sensitive, as Envoy's `exact`).
    Exact(Box<[u8]>),
    /// `true`: the field is there (any value, empty included); `false`: it is not.
    Present(bool),
    /// The whole value matches (the pattern is wrapped in `^(?:…)$`).
    Regex(regex::bytes::Regex),
    /// Nothing matches: a pattern that could not be compiled (a config built without
    /// validation), so the route takes no request rather than every one.
    Never,
}

impl ValueMatch {
    /// `value`: the field's value, `None` when absent.
    fn accepts(&self, value: Option<&[u8]>) -> bool {
        match (self, value) {
            (ValueMatch::Present(want), v) => *want == v.is_some(),
            (ValueMatch::Exact(e), Some(v)) => **e == *v,
            (ValueMatch::Regex(r), Some(v)) => r.is_match(v),
            (ValueMatch::Never, _) | (_, None) => false,
        }
    }

    /// Compiles `pattern` for whole-value matching, with bounds on its compiled size so a
    /// config cannot make a route cost unbounded memory.
    ///
    /// # Errors
    /// The pattern does not parse, or compiles larger than the bound.
    pub fn regex(pattern: &str) -> Result<ValueMatch, String> {
        crate::config::gateway::value_regex(pattern).map(ValueMatch::Regex)
    }

    /// The config's condition compiled; a pattern that does not compile matches nothing.
    fn compile(m: &config::ValueMatch, route: &str) -> ValueMatch {
        match m {
            config::ValueMatch::Exact(v) => ValueMatch::Exact(v.clone()),
            config::ValueMatch::Present(p) => ValueMatch::Present(*p),
            config::ValueMatch::Regex(r) => ValueMatch::regex(r).unwrap_or_else(|e| {
                tracing::error!(route, "{e}; the condition matches nothing");
                ValueMatch::Never
            }),
        }
    }
}

/// A query parameter value longer than this is present but matches no value (a bound on the
/// stack buffer it is decoded into).
const MAX_QUERY_VALUE: usize = 4096;

/// The conditions of one route beyond host, path and method.
#[derive(Debug, Clone, Default)]
pub struct Conditions {
    /// A header that appears several times matches when any of its values does.
    pub headers: Vec<(HeaderName, ValueMatch)>,
    /// The first parameter of that (decoded) name decides, as for `query:` limit keys.
    pub query: Vec<(String, ValueMatch)>,
}

impl Conditions {
    /// Conditions no request meets.
    pub fn never() -> Conditions {
        Conditions { headers: vec![(http::header::HOST, ValueMatch::Never)], query: Vec::new() }
    }

    /// The conditions of `route` in the config, compiled.
    pub fn compile(c: &config::Conditions, route: &str) -> Conditions {
        Conditions {
            headers: c.headers.iter().map(|(n, m)| (n.clone(), ValueMatch::compile(m, route))).collect(),
            query: c.query.iter().map(|(n, m)| (n.clone(), ValueMatch::compile(m, route))).collect(),
        }
    }

    /// Do all conditions hold for a request with these headers and query string?
    pub fn matches(&self, headers: &HeaderMap, query: Option<&str>) -> bool {
        self.headers.iter().all(|(name, m)| {
            let mut values = headers.get_all(name).iter().peekable();
            match m {
                ValueMatch::Present(want) => *want == values.peek().is_some(),
                _ => values.any(|v| m.accepts(Some(v.as_bytes()))),
            }
        }) && self.query.iter().all(|(name, m)| {
            let mut buf = [0u8; MAX_QUERY_VALUE];
            match crate::request_key::query_value(query, name, &mut buf) {
                None => m.accepts(None),
                Some(n) if n < buf.len() => m.accepts(Some(&buf[..n])),
                Some(_) => matches!(m, ValueMatch::Present(true)),
            }
        })
    }
}

/// `rewrite.path_regex`: the path routes see, rewritten with `$1`-style captures.
#[derive(Debug, Clone)]
pub struct PathRewrite {
    pub pattern: regex::Regex,
    /// The replacement in the `regex` crate's syntax (`$1`, `${name}`, `$$`).
    pub replace: String,
}

impl PathRewrite {
    /// The config's rewrite compiled.
    ///
    /// # Errors
    /// The pattern does not compile (only in a config built without validation).
    pub fn compile(rw: &config::PathRewrite) -> Result<PathRewrite, String> {
        let pattern = crate::config::gateway::path_regex(&rw.pattern)?;
        Ok(PathRewrite { pattern, replace: rw.replace.clone() })
    }

    /// The rewritten path, or `None` when the pattern does not match (the path is then
    /// forwarded unchanged, as nginx's `rewrite` does). A result without a leading `/` gets one.
    pub fn apply(&self, path: &str) -> Option<String> {
        let caps = self.pattern.captures(path)?;
        let mut out = String::with_capacity(path.len() + self.replace.len());
        caps.expand(&self.replace, &mut out);
        if !out.starts_with('/') {
            out.insert(0, '/');
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(HeaderName::from_bytes(n.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn on(name: &str, m: ValueMatch) -> Conditions {
        Conditions { headers: vec![(HeaderName::from_bytes(name.as_bytes()).unwrap(), m)], query: vec![] }
    }

    #[test]
    fn exact_is_case_sensitive_and_any_repeat_may_match() {
        let c = on("X-Api-Version", ValueMatch::Exact((*b"2").into()));
        assert!(c.matches(&headers(&[("x-api-version", "2")]), None));
        assert!(!c.matches(&headers(&[("x-api-version", "20")]), None));
        assert!(c.matches(&headers(&[("x-api-version", "1"), ("x-api-version", "2")]), None));
        assert!(!c.matches(&headers(&[]), None));
        let c = on("x-tier", ValueMatch::Exact((*b"gold").into()));
        assert!(!c.matches(&headers(&[("x-tier", "Gold")]), None));
    }

    #[test]
    fn regex_must_match_the_whole_value() {
        let c = on("user-agent", ValueMatch::regex("curl/.*").unwrap());
        assert!(c.matches(&headers(&[("user-agent", "curl/8.5")]), None));
        assert!(!c.matches(&headers(&[("user-agent", "not curl/8.5")]), None));
        let c = on("user-agent", ValueMatch::regex("curl|wget").unwrap());
        assert!(!c.matches(&headers(&[("user-agent", "curlx")]), None), "alternation stays inside the anchors");
        assert!(c.matches(&headers(&[("user-agent", "wget")]), None));
        assert!(ValueMatch::regex("(").is_err());
        assert!(ValueMatch::regex("(a?){100}{100}{100}").is_err(), "compiled size is bounded");
    }

    #[test]
    fn presence_and_absence() {
        let present = on("authorization", ValueMatch::Present(true));
        let absent = on("authorization", ValueMatch::Present(false));
        let with = headers(&[("authorization", "")]);
        assert!(present.matches(&with, None) && !absent.matches(&with, None));
        assert!(!present.matches(&headers(&[]), None) && absent.matches(&headers(&[]), None));
    }

    #[test]
    fn query_reads_the_first_decoded_parameter() {
        let c = Conditions { headers: vec![], query: vec![("beta".into(), ValueMatch::Exact((*b"1 2").into()))] };
        assert!(c.matches(&HeaderMap::new(), Some("a=b&beta=1%202&beta=3")));
        assert!(!c.matches(&HeaderMap::new(), Some("beta=3&beta=1%202")));
        assert!(!c.matches(&HeaderMap::new(), None));
        let c = Conditions { headers: vec![], query: vec![("debug".into(), ValueMatch::Present(false))] };
        assert!(c.matches(&HeaderMap::new(), Some("a=1")));
        assert!(!c.matches(&HeaderMap::new(), Some("a=1&debug")));
        let long = format!("v={}", "x".repeat(MAX_QUERY_VALUE + 1));
        let c = Conditions { headers: vec![], query: vec![("v".into(), ValueMatch::regex("x*").unwrap())] };
        assert!(!c.matches(&HeaderMap::new(), Some(&long)), "an over-long value matches no value");
    }

    #[test]
    fn rewrite_expands_captures() {
        let r = PathRewrite { pattern: regex::Regex::new("^/api/v2/(.*)$").unwrap(), replace: "/$1".into() };
        assert_eq!(r.apply("/api/v2/users/7").as_deref(), Some("/users/7"));
        assert_eq!(r.apply("/api/v1/users").as_deref(), None);
        let r =
            PathRewrite { pattern: regex::Regex::new("^/old/(?P<rest>.*)$").unwrap(), replace: "new/${rest}".into() };
        assert_eq!(r.apply("/old/a").as_deref(), Some("/new/a"));
    }
}
