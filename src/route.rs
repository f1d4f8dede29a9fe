//! First-match routing: routes are tried in file order, the first whose host, path, method
//! and header/query [`conditions`] all match wins. Matching allocates nothing; it sees the
//! target as [`crate::target`] decided it.

pub mod conditions;

pub use conditions::{Conditions, PathRewrite};

use http::{HeaderMap, Method};

use crate::config::{PathMatch, Route};
use crate::target;

/// Does `route` accept this request, its conditions aside?
#[cfg(test)]
pub fn matches(route: &Route, method: &Method, host: Option<&str>, path: &str) -> bool {
    place_matches(route, host, path) && takes(route, method)
}

/// Do the route's host and path match?
fn place_matches(route: &Route, host: Option<&str>, path: &str) -> bool {
    if let Some(m) = &route.host {
        match host {
            Some(h) if m.matches(h) => {}
            _ => return false,
        }
    }
    route.path.matches(path)
}

/// Does the route take `method`?
fn takes(route: &Route, method: &Method) -> bool {
    match &route.methods {
        None => true,
        Some(list) => list.iter().any(|m| m == method),
    }
}

/// The method a CORS preflight asks about (`OPTIONS` with `Origin` and
/// `Access-Control-Request-Method`), if this is one.
fn preflight_method(method: &Method, headers: &HeaderMap) -> Option<Method> {
    if method != Method::OPTIONS || !headers.contains_key(http::header::ORIGIN) {
        return None;
    }
    let asked = headers.get(http::header::ACCESS_CONTROL_REQUEST_METHOD)?;
    Method::from_bytes(asked.as_bytes()).ok()
}

/// Index of the first route that accepts the request: `conditions` are the routes' own,
/// compiled ([`compile`]), `path` is the normalised path ([`target::Target::path`]), `query`
/// the raw query string; the host is the canonical `Host`, read only once a route asks.
/// Header and query conditions run last, only on a route whose host, path and method matched.
/// A CORS preflight is taken by a route with `cors` that takes the method it asks about (its
/// `methods:` need not list `OPTIONS`, which the step answers).
pub fn find(
    routes: &[Route],
    conditions: &[Option<Box<Conditions>>],
    method: &Method,
    headers: &HeaderMap,
    path: &str,
    query: Option<&str>,
) -> Option<usize> {
    let mut host = None;
    // Read once a route with `cors` turns out not to take the method itself.
    let mut preflight = None;
    routes.iter().zip(conditions).position(|(r, c)| {
        let host = if r.host.is_some() { *host.get_or_insert_with(|| target::host(headers)) } else { None };
        place_matches(r, host, path)
            && (takes(r, method)
                || (r.cors.is_some()
                    && preflight
                        .get_or_insert_with(|| preflight_method(method, headers))
                        .as_ref()
                        .is_some_and(|m| takes(r, m))))
            && c.as_ref().is_none_or(|c| c.matches(headers, query))
    })
}

/// A route's conditions and rewrite compiled from its config (at `Proxy::build`). A rewrite
/// whose pattern does not compile (only in a config built without validation) makes the
/// route take no request: logged, rather than forwarding paths it was to rewrite.
pub fn compile(r: &Route) -> (Option<Box<Conditions>>, Option<Box<PathRewrite>>) {
    let conditions = r.conditions.as_deref().map(|c| Box::new(Conditions::compile(c, &r.name)));
    match r.rewrite.as_deref().map(PathRewrite::compile) {
        None => (conditions, None),
        Some(Ok(rw)) => (conditions, Some(Box::new(rw))),
        Some(Err(e)) => {
            tracing::error!(route = r.name, "{e}; the route takes no request");
            (Some(Box::new(Conditions::never())), None)
        }
    }
}

/// The path sent upstream, possibly without its leading `/` (the caller adds it):
/// `strip_prefix` removes the matched prefix, so `/api/` on `/api/users` leaves `users`.
pub fn upstream_path<'a>(route: &Route, path: &'a str) -> &'a str {
    match &route.path {
        PathMatch::Prefix(p) if route.strip_prefix => path.get(p.len()..).unwrap_or(""),
        _ => path,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HostMatch;

    fn route(host: Option<HostMatch>, path: PathMatch, methods: Option<Vec<Method>>) -> Route {
        Route {
            name: "r".into(),
            host,
            path,
            methods,
            upstream: 0,
            strip_prefix: false,
            limits: vec![],
            concurrency: None,
            ratelimit_headers: true,
            stale_on_limit: None,
            stale_on_upstream_error: None,
            retry_after_spread: 0,
            conditions: None,
            rewrite: None,
            request_headers: None,
            response_headers: None,
            upgrades: vec![],
            tunnels: crate::config::Tunnels { idle_timeout: std::time::Duration::from_secs(1), max: 1 },
            auth: None,
            auth_own: false,
            split: None,
            compression: None,
            cors: None,
            extensions: Vec::new(),
            cache: None,
        }
    }

    #[test]
    fn host_exact_and_wildcard_ignore_case_and_port() {
        let exact = route(Some(HostMatch::Exact("api.example.com".into())), PathMatch::Prefix("/".into()), None);
        let wild = route(Some(HostMatch::Suffix(".example.com".into())), PathMatch::Prefix("/".into()), None);
        let get = Method::GET;
        assert!(matches(&exact, &get, Some("API.example.com"), "/"));
        assert!(!matches(&exact, &get, Some("www.example.com"), "/"));
        assert!(matches(&wild, &get, Some("a.b.Example.com"), "/"));
        assert!(!matches(&wild, &get, Some("example.com"), "/"));
        assert!(!matches(&wild, &get, None, "/"));
    }

    #[test]
    fn path_and_methods() {
        let r = route(None, PathMatch::Exact("/x".into()), Some(vec![Method::GET]));
        assert!(matches(&r, &Method::GET, None, "/x"));
        assert!(!matches(&r, &Method::POST, None, "/x"));
        assert!(!matches(&r, &Method::GET, None, "/x/y"));
    }

    #[test]
    fn a_preflight_is_routed_by_the_method_it_asks_about_on_routes_with_cors() {
        let cors = crate::config::cors::CorsConfig {
            origins: crate::config::cors::Origins::Any,
            methods: crate::config::cors::Allow::Any,
            headers: crate::config::cors::Allow::Any,
            expose: crate::config::cors::Allow::Any,
            credentials: false,
            max_age: std::time::Duration::ZERO,
            limit_preflights: false,
        };
        let mut with = route(None, PathMatch::Prefix("/".into()), Some(vec![Method::PUT]));
        with.cors = Some(std::sync::Arc::new(cors));
        let without = route(None, PathMatch::Prefix("/".into()), Some(vec![Method::PUT]));
        let mut h = HeaderMap::new();
        h.insert("origin", http::HeaderValue::from_static("https://a.example"));
        h.insert("access-control-request-method", http::HeaderValue::from_static("PUT"));
        let find_one = |r: &Route, m: &Method, h: &HeaderMap| find(std::slice::from_ref(r), &[None], m, h, "/", None);
        assert_eq!(find_one(&with, &Method::OPTIONS, &h), Some(0));
        assert_eq!(find_one(&without, &Method::OPTIONS, &h), None);
        h.insert("access-control-request-method", http::HeaderValue::from_static("DELETE"));
        assert_eq!(find_one(&with, &Method::OPTIONS, &h), None);
        h.insert("access-control-request-method", http::HeaderValue::from_static("PUT"));
        h.remove("origin");
        assert_eq!(find_one(&with, &Method::OPTIONS, &h), None, "no Origin: no preflight");
    }

    #[test]
    fn strips_prefix() {
        let mut r = route(None, PathMatch::Prefix("/api/".into()), None);
        r.strip_prefix = true;
        assert_eq!(upstream_path(&r, "/api/users"), "users");
        assert_eq!(upstream_path(&r, "/api/"), "");
        let mut r = route(None, PathMatch::Prefix("/api".into()), None);
        r.strip_prefix = true;
        assert_eq!(upstream_path(&r, "/api/users"), "/users");
        assert_eq!(upstream_path(&r, "/api"), "");
        assert_eq!(upstream_path(&r, "/apix"), "x");
    }

    #[test]
    fn conditions_and_rewrites_compile_from_the_config_and_a_bad_pattern_takes_no_request() {
        use crate::config::{Conditions as Data, PathRewrite as Rewrite, ValueMatch as Value};
        let on = |m: Value| Data { headers: vec![(http::HeaderName::from_static("x-v"), m)], query: vec![] };
        let mut h = HeaderMap::new();
        h.insert("x-v", http::HeaderValue::from_static("v2"));
        let find_in = |r: &Route| {
            let (conditions, rewrite) = compile(r);
            (find(std::slice::from_ref(r), &[conditions], &Method::GET, &h, "/a/b", None), rewrite)
        };
        let mut r = route(None, PathMatch::Prefix("/".into()), None);
        r.conditions = Some(Box::new(on(Value::Regex("v[0-9]".into()))));
        r.rewrite = Some(Box::new(Rewrite { pattern: "^/a/(.*)$".into(), replace: "/$1".into() }));
        let (found, rewrite) = find_in(&r);
        assert_eq!(found, Some(0));
        assert_eq!(rewrite.and_then(|rw| rw.apply("/a/b")).as_deref(), Some("/b"));
        r.conditions = Some(Box::new(on(Value::Regex("v[3-9]".into()))));
        assert_eq!(find_in(&r).0, None);
        // Only a config built without validation has these: the route takes nothing.
        r.conditions = Some(Box::new(on(Value::Regex("(".into()))));
        assert_eq!(find_in(&r).0, None);
        r.conditions = None;
        r.rewrite = Some(Box::new(Rewrite { pattern: "(".into(), replace: "/".into() }));
        let (found, rewrite) = find_in(&r);
        assert_eq!((found, rewrite.is_none()), (None, true));
    }
}
