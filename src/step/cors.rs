//! `cors`: which origins' pages may call the route from a browser (the Fetch standard's CORS
//! protocol). A preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is
//! answered here and never forwarded, by default without spending the route's limits. Every
//! answer of the route to an allowed origin carries `Access-Control-Allow-Origin` (and
//! `-Credentials`, and `-Expose-Headers` naming `Retry-After`, `RateLimit`, `RateLimit-Policy`
//! and the request id field), tollgate's own `429`, `401` and `503` included, so that the
//! page can read why it was refused and when to come back.
//!
//! Invariants: an origin that is not allowed gets no CORS field (its preflight a `403`), and
//! is named in the log line (`cors=origin_refused`); `*` never goes with credentials (the
//! config refuses it); `null` (an opaque origin) is allowed only by an explicit `null` entry,
//! never by a pattern; an answer that depends on `Origin` says so in `Vary`; on a route with
//! `cors`, tollgate owns the `Access-Control-*` fields (the upstream's are replaced).

use http::header::{
    HeaderMap, HeaderName, HeaderValue, ACCESS_CONTROL_ALLOW_CREDENTIALS, ACCESS_CONTROL_ALLOW_HEADERS,
    ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN, ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE,
    ACCESS_CONTROL_REQUEST_HEADERS, ACCESS_CONTROL_REQUEST_METHOD, ORIGIN, RETRY_AFTER, VARY,
};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use prometheus_client::metrics::counter::Counter;

use super::{Answered, Arrival, Arrived, Build, Builtin, Flow, Notes, Seen};
use crate::answer::Error;
use crate::body::Body;
use crate::config::cors::{Allow, CorsConfig, OriginRule, Origins};
use crate::config::{Config, Route};

const ANY: HeaderValue = HeaderValue::from_static("*");
const TRUE: HeaderValue = HeaderValue::from_static("true");

/// The fields tollgate owns on a route with `cors` (an upstream's copies are removed).
const OWNED: [HeaderName; 6] = [
    ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_ALLOW_CREDENTIALS,
    ACCESS_CONTROL_EXPOSE_HEADERS,
    ACCESS_CONTROL_ALLOW_METHODS,
    ACCESS_CONTROL_ALLOW_HEADERS,
    ACCESS_CONTROL_MAX_AGE,
];

/// Longer `Origin` values are not compared (a serialized origin is a scheme, a host of at most
/// 253 bytes and a port).
const MAX_ORIGIN: usize = 512;

/// Why a preflight is refused (the `403`'s detail; the log line's `cors` note).
const ORIGIN_REFUSED: (&str, &str) = ("origin_refused", "the page's origin may not call this route");
const METHOD_REFUSED: (&str, &str) = ("method_refused", "the method the page asks for is not allowed here");
const HEADERS_REFUSED: (&str, &str) = ("headers_refused", "a field the page asks to send is not allowed here");

pub(crate) struct Cors {
    origins: Matcher,
    credentials: bool,
    methods: Allow<Method>,
    /// `Access-Control-Allow-Methods` of a preflight: the list (`None`: the method asked, echoed).
    allow_methods: Option<HeaderValue>,
    headers: Allow<HeaderName>,
    /// `Access-Control-Allow-Headers`: the list (`None`: the fields asked, echoed).
    allow_headers: Option<HeaderValue>,
    expose: HeaderValue,
    max_age: HeaderValue,
    limit_preflights: bool,
    /// The answer depends on `Origin` (any origin list but `*`).
    vary: bool,
    counts: Counts,
}

/// The route's `tollgate_steps_total{step="cors"}` counters.
struct Counts {
    allowed: Counter,
    refused: Counter,
    preflight: Counter,
    preflight_refused: Counter,
}

/// `*.example.com`, compiled.
struct Wildcard {
    /// `None`: http and https.
    scheme: Option<Box<str>>,
    /// `.example.com`.
    suffix: Box<str>,
    /// `None`: the scheme's own port.
    port: Option<u16>,
}

/// `origins`, compiled.
enum Matcher {
    Any,
    List {
        /// Serialized origins, lower case (browsers send them so).
        exact: Vec<Box<[u8]>>,
        /// An explicit `null` entry.
        null: bool,
        wildcards: Vec<Wildcard>,
        regexes: Vec<regex::bytes::Regex>,
    },
}

impl Matcher {
    fn new(origins: &Origins, route: &str) -> Matcher {
        let Origins::List(rules) = origins else { return Matcher::Any };
        let (mut exact, mut null, mut wildcards, mut regexes) = (Vec::new(), false, Vec::new(), Vec::new());
        for r in rules {
            match r {
                OriginRule::Exact(o) if o == "null" => null = true,
                OriginRule::Exact(o) => exact.push(o.as_bytes().into()),
                OriginRule::Wildcard { scheme, suffix, port } => wildcards.push(Wildcard {
                    scheme: scheme.as_deref().map(Into::into),
                    suffix: suffix.as_str().into(),
                    port: *port,
                }),
                // Checked with the same builder at load; one that fails here allows nothing.
                OriginRule::Regex(p) => match crate::config::gateway::value_regex(p) {
                    Ok(re) => regexes.push(re),
                    Err(e) => tracing::error!(route, "cors: {e}; it allows no origin"),
                },
            }
        }
        Matcher::List { exact, null, wildcards, regexes }
    }

    fn allows(&self, origin: &[u8]) -> bool {
        let Matcher::List { exact, null, wildcards, regexes } = self else { return true };
        if origin.len() > MAX_ORIGIN {
            return false;
        }
        // The opaque origin: only by name, never by a pattern that happens to match it.
        if origin == b"null" {
            return *null;
        }
        if exact.iter().any(|e| e.eq_ignore_ascii_case(origin)) {
            return true;
        }
        if !wildcards.is_empty() {
            if let Some((scheme, host, port)) = split(origin) {
                let below = |suffix: &str| {
                    host.len() > suffix.len()
                        && host.as_bytes()[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix.as_bytes())
                };
                let hit = wildcards.iter().any(|w| {
                    let scheme_ok = match &w.scheme {
                        Some(s) => scheme.eq_ignore_ascii_case(s),
                        None => scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https"),
                    };
                    scheme_ok && w.port == port && below(&w.suffix)
                });
                if hit {
                    return true;
                }
            }
        }
        regexes.iter().any(|re| re.is_match(origin))
    }
}

/// A serialized origin's scheme, host and port (`None`: not one).
fn split(origin: &[u8]) -> Option<(&str, &str, Option<u16>)> {
    let text = std::str::from_utf8(origin).ok()?;
    let (scheme, rest) = text.split_once("://")?;
    let (host, port) = crate::config::cors::split_port(rest)?;
    Some((scheme, host, port))
}

/// `names` joined as one field value (`None` when empty).
fn list<T: AsRef<str>>(names: &[T]) -> Option<HeaderValue> {
    let text = names.iter().map(AsRef::as_ref).collect::<Vec<_>>().join(", ");
    (!text.is_empty()).then(|| HeaderValue::try_from(text).ok()).flatten()
}

impl Builtin for Cors {
    fn compile(b: &mut Build<'_>) -> Option<Cors> {
        let c = b.route.cors.as_deref()?;
        let route = b.route.name.as_str();
        let count = |result| b.metrics.step(route, "cors", result);
        let allow_methods = match &c.methods {
            Allow::Any => None,
            Allow::List(l) => list(&l.iter().map(Method::as_str).collect::<Vec<_>>()),
        };
        let allow_headers = match &c.headers {
            Allow::Any => None,
            Allow::List(l) => list(&l.iter().map(HeaderName::as_str).collect::<Vec<_>>()),
        };
        Some(Cors {
            origins: Matcher::new(&c.origins, route),
            credentials: c.credentials,
            methods: c.methods.clone(),
            allow_methods,
            headers: c.headers.clone(),
            allow_headers,
            expose: match &c.expose {
                Allow::Any => ANY,
                Allow::List(extra) => {
                    let names = exposed(b.config.request_id.as_ref(), extra);
                    list(&names.iter().map(HeaderName::as_str).collect::<Vec<_>>()).unwrap_or(ANY)
                }
            },
            max_age: HeaderValue::from(c.max_age.as_secs()),
            limit_preflights: c.limit_preflights,
            vary: c.origins != Origins::Any,
            counts: Counts {
                allowed: count("allowed"),
                refused: count("refused"),
                preflight: count("preflight"),
                preflight_refused: count("preflight_refused"),
            },
        })
    }

    fn describe(route: &Route, config: &Config) -> Option<String> {
        route.cors.as_deref().map(|c| describe(c, config.request_id.as_ref()))
    }

    fn arrive<'a>(&'a self, a: &'a mut Arrival<'_>, seen: &mut Seen) -> Arrived<'a> {
        let Some(origin) = a.parts.headers.get(ORIGIN) else { return Arrived::Now(Flow::Next) };
        let allowed = self.origins.allows(origin.as_bytes()).then(|| match self.origins {
            // `*` is never sent with credentials: the config refuses the pair.
            Matcher::Any => ANY,
            Matcher::List { .. } => origin.clone(),
        });
        let preflight =
            a.parts.method == Method::OPTIONS && a.parts.headers.contains_key(ACCESS_CONTROL_REQUEST_METHOD);
        if !preflight {
            if allowed.is_some() {
                self.counts.allowed.inc();
            } else {
                self.counts.refused.inc();
                a.notes.add("cors", ORIGIN_REFUSED.0);
            }
            seen.cors = allowed;
            return Arrived::Now(Flow::Next);
        }
        let refused = match allowed {
            None => Some(ORIGIN_REFUSED),
            Some(_) => self.refusal(&a.parts.headers),
        };
        if let Some((label, why)) = refused {
            self.counts.preflight_refused.inc();
            a.notes.add("cors", label);
            return Arrived::Now(Flow::Refuse(Error::CorsRefused(why)));
        }
        self.counts.preflight.inc();
        a.notes.add("cors", "preflight");
        seen.cors = allowed;
        Arrived::Now(if self.limit_preflights { Flow::AfterLimits } else { Flow::Answer(self.preflight(a.parts)) })
    }

    fn admitted(&self, parts: &Parts, _: &mut Seen) -> (Response<Body>, Answered) {
        (self.preflight(parts), Answered::Own)
    }

    fn answer(&self, seen: &mut Seen, resp: &mut Response<Body>, from: Answered, _: &mut Notes<'_>) {
        if from == Answered::Tunnel {
            return;
        }
        let h = resp.headers_mut();
        if matches!(from, Answered::Upstream | Answered::Responder | Answered::Stale) {
            for name in &OWNED {
                h.remove(name);
            }
        }
        if let Some(origin) = seen.cors.take() {
            h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
            if self.credentials {
                h.insert(ACCESS_CONTROL_ALLOW_CREDENTIALS, TRUE);
            }
            h.insert(ACCESS_CONTROL_EXPOSE_HEADERS, self.expose.clone());
        }
        if self.vary {
            vary(h, "Origin");
        }
    }
}

impl Cors {
    /// Why an allowed origin's preflight is refused, if it is: a method or a field it asks
    /// for that the route does not allow (GET, HEAD and POST always are, as for browsers).
    fn refusal(&self, h: &HeaderMap) -> Option<(&'static str, &'static str)> {
        let asked = h.get(ACCESS_CONTROL_REQUEST_METHOD).map(HeaderValue::as_bytes).unwrap_or_default();
        let method_ok = match &self.methods {
            Allow::Any => Method::from_bytes(asked).is_ok(),
            Allow::List(l) => {
                matches!(asked, b"GET" | b"HEAD" | b"POST") || l.iter().any(|m| m.as_str().as_bytes() == asked)
            }
        };
        if !method_ok {
            return Some(METHOD_REFUSED);
        }
        if let Allow::List(allowed) = &self.headers {
            for value in h.get_all(ACCESS_CONTROL_REQUEST_HEADERS) {
                let Ok(text) = value.to_str() else { return Some(HEADERS_REFUSED) };
                let ok = text
                    .split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .all(|n| allowed.iter().any(|a| a.as_str().eq_ignore_ascii_case(n)));
                if !ok {
                    return Some(HEADERS_REFUSED);
                }
            }
        }
        None
    }

    /// The `204` to an allowed preflight (the origin's fields are added on the answer side).
    fn preflight(&self, parts: &Parts) -> Response<Body> {
        let mut resp = Response::new(Body::empty());
        *resp.status_mut() = StatusCode::NO_CONTENT;
        let asked = |name| parts.headers.get(name).cloned();
        let h = resp.headers_mut();
        match &self.allow_methods {
            Some(list) => {
                h.insert(ACCESS_CONTROL_ALLOW_METHODS, list.clone());
            }
            None => {
                if let Some(m) = asked(ACCESS_CONTROL_REQUEST_METHOD) {
                    h.insert(ACCESS_CONTROL_ALLOW_METHODS, m);
                }
                vary(h, "Access-Control-Request-Method");
            }
        }
        match &self.allow_headers {
            Some(list) => {
                h.insert(ACCESS_CONTROL_ALLOW_HEADERS, list.clone());
            }
            None if self.headers == Allow::Any => {
                // `*` would not cover `Authorization`, nor anything with credentials: echoed.
                if let Some(fields) = asked(ACCESS_CONTROL_REQUEST_HEADERS) {
                    h.insert(ACCESS_CONTROL_ALLOW_HEADERS, fields);
                }
                vary(h, "Access-Control-Request-Headers");
            }
            None => {}
        }
        h.insert(ACCESS_CONTROL_MAX_AGE, self.max_age.clone());
        resp
    }
}

/// The fields every allowed page may read: why it was throttled and when to come back (a
/// browser hides `Retry-After` from a cross-origin script unless told), the request id, and
/// the route's own `extra`.
fn exposed(request_id: Option<&HeaderName>, extra: &[HeaderName]) -> Vec<HeaderName> {
    let mut names = vec![RETRY_AFTER, crate::ratelimit::RATELIMIT, crate::ratelimit::RATELIMIT_POLICY];
    names.extend(request_id.cloned());
    for n in extra {
        if !names.contains(n) {
            names.push(n.clone());
        }
    }
    names
}

/// Adds `name` to the answer's `Vary`, unless it is there already or `Vary` is `*`.
fn vary(h: &mut HeaderMap, name: &'static str) {
    for value in h.get_all(VARY) {
        let text = value.to_str().unwrap_or_default();
        if text.split(',').map(str::trim).any(|t| t == "*" || t.eq_ignore_ascii_case(name)) {
            return;
        }
    }
    h.append(VARY, HeaderValue::from_static(name));
}

/// The route's `cors` in words, for `explain`.
fn describe(c: &CorsConfig, request_id: Option<&HeaderName>) -> String {
    let origins = match &c.origins {
        Origins::Any => "pages of any origin".to_owned(),
        Origins::List(rules) => {
            let each: Vec<String> = rules
                .iter()
                .map(|r| match r {
                    OriginRule::Exact(o) if o == "null" => "the opaque origin `null`".to_owned(),
                    OriginRule::Exact(o) => o.clone(),
                    OriginRule::Wildcard { scheme, suffix, port } => {
                        let scheme = scheme.as_deref().map_or("http(s)".to_owned(), str::to_owned);
                        let port = port.map_or(String::new(), |p| format!(":{p}"));
                        format!("{scheme}://*{suffix}{port}")
                    }
                    OriginRule::Regex(p) => format!("origins matching `{p}`"),
                })
                .collect();
            format!("pages of {}", each.join(", "))
        }
    };
    let methods = match &c.methods {
        Allow::Any => "any method".to_owned(),
        Allow::List(l) => {
            let mut all: Vec<&str> = vec!["GET", "HEAD", "POST"];
            all.extend(l.iter().map(Method::as_str).filter(|m| !matches!(*m, "GET" | "HEAD" | "POST")));
            all.join(", ")
        }
    };
    let headers = match &c.headers {
        Allow::Any => "any request field".to_owned(),
        Allow::List(l) if l.is_empty() => "only the CORS-safelisted request fields".to_owned(),
        Allow::List(l) => l.iter().map(HeaderName::as_str).collect::<Vec<_>>().join(", "),
    };
    let read = match &c.expose {
        Allow::Any => "every answer field".to_owned(),
        Allow::List(extra) => exposed(request_id, extra).iter().map(HeaderName::as_str).collect::<Vec<_>>().join(", "),
    };
    format!(
        "cors: {origins} may call it with {methods}, sending {headers}, and read {read}{}; a preflight is \
         answered here (kept {}s by the browser){}; other origins get no CORS fields",
        if c.credentials { ", with credentials (cookies, HTTP authentication)" } else { "" },
        c.max_age.as_secs(),
        if c.limit_preflights { " once the route's limits admit it" } else { ", not counted by the route's limits" },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(origins: &[OriginRule]) -> Matcher {
        Matcher::new(&Origins::List(origins.to_vec()), "r")
    }

    #[test]
    fn origins_match_as_listed_and_null_only_by_name() {
        let m = matcher(&[
            OriginRule::Exact("https://app.example.com".into()),
            OriginRule::Wildcard { scheme: None, suffix: ".example.org".into(), port: None },
            OriginRule::Wildcard { scheme: Some("https".into()), suffix: ".example.net".into(), port: Some(8443) },
            OriginRule::Regex("https://pr-[0-9]+\\.preview\\.example\\.io|null".into()),
        ]);
        for yes in [
            "https://app.example.com",
            "https://APP.example.com",
            "http://a.example.org",
            "https://a.b.example.org",
            "https://x.example.net:8443",
            "https://pr-12.preview.example.io",
        ] {
            assert!(m.allows(yes.as_bytes()), "{yes}");
        }
        for no in [
            "https://app.example.com:8443",
            "https://example.org",
            "https://evilexample.org",
            "ftp://a.example.org",
            "http://a.example.org:8080",
            "https://x.example.net",
            "http://x.example.net:8443",
            "https://pr-x.preview.example.io",
            "https://pr-1.preview.example.io.evil.com",
            // The regex names `null`, but an opaque origin is allowed by an explicit entry only.
            "null",
        ] {
            assert!(!m.allows(no.as_bytes()), "{no}");
        }
        assert!(matcher(&[OriginRule::Exact("null".into())]).allows(b"null"));
    }

    #[test]
    fn vary_is_merged_not_repeated() {
        let mut h = HeaderMap::new();
        h.insert(VARY, HeaderValue::from_static("accept-encoding, origin"));
        vary(&mut h, "Origin");
        assert_eq!(h.get_all(VARY).iter().count(), 1);
        let mut h = HeaderMap::new();
        h.insert(VARY, HeaderValue::from_static("*"));
        vary(&mut h, "Origin");
        assert_eq!(h.get_all(VARY).iter().count(), 1);
        let mut h = HeaderMap::new();
        h.insert(VARY, HeaderValue::from_static("accept-encoding"));
        vary(&mut h, "Origin");
        let all: Vec<_> = h.get_all(VARY).iter().collect();
        assert_eq!(all, ["accept-encoding", "Origin"]);
    }
}
