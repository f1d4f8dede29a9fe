//! A route's gateway conditions and rules in words, for `tollgate explain`.

use std::fmt::Write;

use crate::config::{HeaderRules, Route, ValueMatch};

fn condition(what: &str, m: &ValueMatch) -> String {
    match m {
        ValueMatch::Exact(v) => format!("{what} is exactly `{}`", String::from_utf8_lossy(v)),
        ValueMatch::Present(true) => format!("{what} is present"),
        ValueMatch::Present(false) => format!("{what} is absent"),
        ValueMatch::Regex(p) => format!("{what} matches `{p}` (the whole value)"),
    }
}

fn rules(direction: &str, r: &HeaderRules) -> String {
    format!("{direction}: {}", r.describe())
}

/// Lines (without indentation) for `r`'s conditions, rewrite and request header rules; none
/// when it has none of them. (Response header rules are a step: `step::describe`.)
pub fn describe(r: &Route) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(c) = &r.conditions {
        let mut all: Vec<String> = c.headers.iter().map(|(n, m)| condition(&format!("header {n}"), m)).collect();
        all.extend(c.query.iter().map(|(n, m)| condition(&format!("query parameter {n} (its first value)"), m)));
        out.push(format!("only when {}", all.join(" and ")));
    }
    if let Some(rw) = &r.rewrite {
        let mut s = String::new();
        let _ = write!(
            s,
            "the upstream gets the path rewritten: `{}` -> `{}` (the query kept; unchanged when it does not match)",
            rw.pattern, rw.replace
        );
        out.push(s);
    }
    if let Some(rq) = &r.request_headers {
        out.push(rules("to the request it forwards, tollgate", rq));
    }
    out
}
