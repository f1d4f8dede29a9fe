//! A route's header rules (`request_headers`, `response_headers`): `remove`, then `set`
//! (replaces), then `add` (appends). Values may name request facts — `{route}`,
//! `{client_ip}`, `{host}`, `{path}`, `{request_id}`, `{header:NAME}` — read from the request
//! as the client sent it, before any rule changed it. A value without variables is a ready
//! `HeaderValue` from load time, so a static rule costs one map operation per request.
//!
//! A value that comes out empty does not send the field: `set` then only removes (nginx's
//! `proxy_set_header X ""`), `add` does nothing.

use std::net::IpAddr;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};

use crate::config::rules::{Piece, Template};
use crate::request_key::TrustedProxies;

/// The rules of one direction of one route, compiled from the config's at `Proxy::build`.
#[derive(Debug, Clone, Default)]
pub struct HeaderRules {
    remove: Vec<HeaderName>,
    set: Vec<(HeaderName, Template)>,
    add: Vec<(HeaderName, Template)>,
    /// Some value names a variable.
    dynamic: bool,
}

/// The request facts a value may name.
pub struct Vars<'a> {
    pub route: &'a str,
    /// The request's head as the client sent it (`{header:NAME}`, `{host}`, `{client_ip}`).
    pub headers: &'a HeaderMap,
    /// The normalised path the client asked for, before any rewrite, without the query.
    pub path: &'a str,
    pub request_id: Option<&'a str>,
    pub peer: IpAddr,
    pub trusted: &'a TrustedProxies,
}

/// The values of a rule set's variable templates for one request, in rule order (on the
/// heap: the request's future holds them across the upstream's answer, and stays small).
pub type Values = Vec<HeaderValue>;

impl HeaderRules {
    pub fn new(rules: &crate::config::rules::HeaderRules) -> HeaderRules {
        let mut out = HeaderRules {
            remove: rules.remove.clone(),
            set: rules.set.clone(),
            add: rules.add.clone(),
            dynamic: false,
        };
        let dynamic = out.templates().any(|(_, t)| matches!(t, Template::Dynamic(_)));
        out.dynamic = dynamic;
        out
    }

    fn templates(&self) -> impl Iterator<Item = (&HeaderName, &Template)> {
        self.set.iter().chain(&self.add).map(|(n, t)| (n, t))
    }

    /// Some value names a variable: [`HeaderRules::render`] must run while the request is at hand.
    pub fn is_dynamic(&self) -> bool {
        self.dynamic
    }

    /// Renders every value with variables, reading `vars`.
    pub fn render(&self, vars: &Vars<'_>) -> Values {
        let mut out = Values::new();
        for (_, t) in self.templates() {
            if let Template::Dynamic(pieces) = t {
                out.push(render(pieces, vars));
            }
        }
        out
    }

    /// Applies the rules to `headers`; `values` are [`HeaderRules::render`]'s for this request
    /// (empty when no value has variables).
    pub fn apply(&self, headers: &mut HeaderMap, values: &[HeaderValue]) {
        for name in &self.remove {
            headers.remove(name);
        }
        let mut rendered = values.iter();
        let mut value = |t: &Template| match t {
            Template::Static(v) => Some(v.clone()),
            Template::Dynamic(_) => rendered.next().cloned(),
        };
        for (name, t) in &self.set {
            match value(t).filter(|v| !v.is_empty()) {
                Some(v) => {
                    headers.insert(name.clone(), v);
                }
                None => {
                    headers.remove(name);
                }
            }
        }
        for (name, t) in &self.add {
            if let Some(v) = value(t).filter(|v| !v.is_empty()) {
                headers.append(name.clone(), v);
            }
        }
    }
}

fn render(pieces: &[Piece], vars: &Vars<'_>) -> HeaderValue {
    let mut out: Vec<u8> = Vec::with_capacity(64);
    for p in pieces {
        match p {
            Piece::Text(t) => out.extend_from_slice(t.as_bytes()),
            Piece::Route => out.extend_from_slice(vars.route.as_bytes()),
            Piece::Path => out.extend_from_slice(vars.path.as_bytes()),
            Piece::RequestId => out.extend_from_slice(vars.request_id.unwrap_or("").as_bytes()),
            Piece::Host => out.extend_from_slice(crate::target::host(vars.headers).unwrap_or("").as_bytes()),
            Piece::ClientIp => {
                use std::io::Write;
                // Canonical: an IPv4-mapped IPv6 address is written as IPv4, as in X-Forwarded-For.
                let _ = write!(out, "{}", vars.trusted.client_ip(vars.peer, vars.headers).to_canonical());
            }
            Piece::Header(name) => {
                if let Some(v) = vars.headers.get(name) {
                    out.extend_from_slice(v.as_bytes());
                }
            }
        }
    }
    // Every piece is a valid value, and so is their concatenation; the check stays for safety.
    HeaderValue::from_maybe_shared(Bytes::from(out)).unwrap_or(HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(remove: &[&str], set: &[(&str, &str)], add: &[(&str, &str)]) -> HeaderRules {
        let name = |n: &str| HeaderName::from_bytes(n.as_bytes()).unwrap();
        HeaderRules::new(&crate::config::rules::HeaderRules {
            remove: remove.iter().map(|n| name(n)).collect(),
            set: set.iter().map(|(n, v)| (name(n), Template::parse(v).unwrap())).collect(),
            add: add.iter().map(|(n, v)| (name(n), Template::parse(v).unwrap())).collect(),
        })
    }

    #[test]
    fn remove_then_set_then_add_with_values_read_before_any_change() {
        let r = rules(
            &["x-token"],
            &[("x-user", "u-{header:x-token}"), ("x-route", "{route}"), ("x-empty", "{header:x-missing}")],
            &[("x-via", "tg"), ("x-via", "{path}")],
        );
        let mut h = HeaderMap::new();
        h.insert("x-token", HeaderValue::from_static("abc"));
        h.insert("x-route", HeaderValue::from_static("client's"));
        h.insert("x-empty", HeaderValue::from_static("client's"));
        h.insert("x-via", HeaderValue::from_static("first"));
        h.insert("host", HeaderValue::from_static("api.example.com:8080"));
        let trusted = TrustedProxies::default();
        let vars = Vars {
            route: "r1",
            headers: &h,
            path: "/p",
            request_id: Some("id"),
            peer: "10.0.0.1".parse().unwrap(),
            trusted: &trusted,
        };
        let values = r.render(&vars);
        r.apply(&mut h, &values);
        assert!(h.get("x-token").is_none());
        assert_eq!(h["x-user"], "u-abc");
        assert_eq!(h["x-route"], "r1");
        assert!(h.get("x-empty").is_none(), "an empty value removes what `set` would replace");
        let via: Vec<_> = h.get_all("x-via").iter().collect();
        assert_eq!(via, ["first", "tg", "/p"]);
    }

    #[test]
    fn host_and_client_ip() {
        let r = rules(&[], &[("x-h", "{host}"), ("x-ip", "{client_ip}")], &[]);
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("api.example.com:8080"));
        h.insert("x-forwarded-for", HeaderValue::from_static("203.0.113.7"));
        let trusted = TrustedProxies::new(vec!["10.0.0.0/8".parse().unwrap()]);
        let vars = Vars {
            route: "r",
            headers: &h,
            path: "/",
            request_id: None,
            peer: "10.1.1.1".parse().unwrap(),
            trusted: &trusted,
        };
        let values = r.render(&vars);
        r.apply(&mut h, &values);
        assert_eq!(h["x-h"], "api.example.com");
        assert_eq!(h["x-ip"], "203.0.113.7");
    }
}
