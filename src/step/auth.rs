//! `auth`: a route's credentials (a JWT or an API key) verified once, before the limits, into
//! the identity that limit keys and plans read (kept in the head's extensions). The checking
//! itself is the `auth` room's; this file puts it on the route's steps and says it in words.

use std::fmt::Write;

use super::{Arrival, Arrived, Build, Builtin, Flow, Seen};
use crate::config::auth::{ApiKeys, AuthConfig, Credential, Jwks, Method};
use crate::config::{Config, Route};
use crate::jwt::Alg;

pub(crate) struct Auth(crate::auth::Auth);

impl Auth {
    pub(crate) fn inner(&self) -> &crate::auth::Auth {
        &self.0
    }
}

impl Builtin for Auth {
    fn compile(b: &mut Build<'_>) -> Option<Auth> {
        let config = b.route.auth.as_deref()?;
        let plans = b.config.plans.as_deref();
        Some(Auth(crate::auth::Auth::new(config, b.route, plans, b.redis, b.metrics, b.remote_for)))
    }

    fn describe(route: &Route, _: &Config) -> Option<String> {
        route.auth.as_deref().map(describe)
    }

    const ANSWERS: bool = false;

    /// Boxed: only routes with `auth` carry its future (as before the seam); a route with
    /// `failures` has a future of its own, so that one without pays nothing for it.
    fn arrive<'a>(&'a self, a: &'a mut Arrival<'_>, _: &mut Seen) -> Arrived<'a> {
        // Token times (`exp`, `nbf`) in whole seconds of the limits' clock.
        let now = i64::try_from(a.clock.now().as_micros() / 1_000_000).unwrap_or(i64::MAX);
        match a.failures {
            None => Arrived::Later(Box::pin(async move {
                match self.0.check(a.parts, now).await {
                    Ok(id) => {
                        a.parts.extensions.insert(id);
                        Flow::Next
                    }
                    Err(e) => Flow::Refuse(e),
                }
            })),
            Some(failures) => Arrived::Later(Box::pin(self.guarded(a, failures, now))),
        }
    }
}

impl Auth {
    /// The check behind the route's failure limit: a client over it is refused before its
    /// credential is read, and a failed credential is charged to it.
    async fn guarded(&self, a: &mut Arrival<'_>, failures: crate::gate::Failures<'_>, now: i64) -> Flow {
        if let Err(e) = failures.admits(&key_ctx(a), a.clock.now()).await {
            return Flow::Refuse(e);
        }
        match self.0.check(a.parts, now).await {
            Ok(id) => {
                a.parts.extensions.insert(id);
                Flow::Next
            }
            Err(e) => {
                if crate::auth::is_failure(&e) {
                    failures.failed(&key_ctx(a), a.clock.now()).await;
                }
                Flow::Refuse(e)
            }
        }
    }
}

/// What a failure limit's key reads of the request: what the route's limits read, less the
/// identity (which a failure limit's key never names).
fn key_ctx<'k>(a: &'k Arrival<'_>) -> crate::request_key::KeyCtx<'k> {
    crate::request_key::KeyCtx {
        route: a.route,
        client_ip: a.trusted.client_ip(a.peer, &a.parts.headers),
        path: a.target.path(a.parts),
        parts: a.parts,
        tls_client: a.tls_client,
        known: None,
    }
}

/// A route's `auth` in words: what is verified, where it is read, what a client without it gets.
fn describe(a: &AuthConfig) -> String {
    let from = |c: &Credential| match c {
        c if c.is_bearer() => "a bearer token in Authorization".to_owned(),
        Credential::Header(h) => format!("header {h}"),
        Credential::Query(q) => format!("query parameter {q}"),
        Credential::Cookie(c) => format!("cookie {c}"),
    };
    let mut out = match &a.method {
        Method::Jwt(j) => {
            let algs: Vec<&str> =
                Alg::ALL.into_iter().filter(|x| j.rules.algorithms.contains(*x)).map(Alg::as_str).collect();
            let keys = match &j.keys {
                Jwks::File { path, .. } => format!("the key set {}", path.display()),
                Jwks::Url { url, .. } => format!("the key set at {url} (read again in the background)"),
                Jwks::Secret { path, .. } => format!("the HS256 secret in {}", path.display()),
            };
            let mut s = format!("auth: a JWT ({}) from {}, verified with {keys}", algs.join(", "), from(&j.from));
            if !j.rules.issuers.is_empty() {
                let _ = write!(s, ", issued by {}", j.rules.issuers.join(" or "));
            }
            if !j.rules.audiences.is_empty() {
                let _ = write!(s, ", for {}", j.rules.audiences.join(" or "));
            }
            let _ = write!(
                s,
                "; exp and nbf with {}s of leeway; the consumer is claim `{}`",
                j.rules.leeway_secs, j.rules.consumer_claim
            );
            s
        }
        Method::ApiKey(k) => {
            let store = match &k.keys {
                ApiKeys::File { path, consumers } => format!("{} ({} keys)", path.display(), consumers.len()),
                ApiKeys::Redis { hash, .. } => format!("the Redis hash {hash}"),
            };
            format!("auth: an API key from {}, found by its SHA-256 in {store}", from(&k.from))
        }
    };
    out.push_str(if a.optional {
        "; a request without one passes as consumer `anonymous`, a bad one gets 401"
    } else {
        "; a request without a valid one gets 401"
    });
    // Only a JWT names its audience, and only a route that lists audiences checks it.
    if matches!(&a.method, Method::Jwt(j) if !j.rules.audiences.is_empty()) {
        out.push_str(" (403 for a valid token meant for another audience)");
    }
    if !a.claims_to_headers.is_empty() {
        let names: Vec<String> = a.claims_to_headers.iter().map(|(c, h)| format!("{c} as {h}")).collect();
        let _ = write!(out, "; forwards {} (a client's own copies removed)", names.join(", "));
    }
    if a.strip_credentials {
        out.push_str("; the credential is not forwarded");
    }
    if let Some(f) = &a.failures {
        let (q, w) = crate::ratelimit::policy_numbers(&f.algorithm);
        let key: Vec<String> = f.key.parts().iter().map(ToString::to_string).collect();
        let store = match f.store {
            crate::config::StoreKind::Local => "in this instance",
            crate::config::StoreKind::Redis => "shared through Redis",
        };
        let shadow = if f.mode == crate::config::Mode::Shadow { " (shadow: counted and logged only)" } else { "" };
        let _ = write!(
            out,
            "; failed credentials limited by `{}`{shadow} ({}, {q} per {w}s by {}, {store}): a client over it gets \
             429 before its credential is read, and its successes are not counted",
            f.name,
            crate::config::algorithm_name(&f.algorithm),
            key.join(" + "),
        );
    }
    out
}
