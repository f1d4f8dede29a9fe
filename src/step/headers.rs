//! `response_headers`: the route's rules applied to every answer of the route (tollgate's
//! own `429`s and `5xx`, stale copies and step answers included). Values with variables are
//! rendered as the request arrives, from the request as the client sent it. (The request
//! direction, `request_headers`, is applied by `forward` in its one pass over the upstream
//! head, after tollgate's own forwarding fields, which a rule may override.)

use http::Response;

use super::{Answered, Arrival, Arrived, Build, Builtin, Flow, Notes, Seen};
use crate::body::Body;
use crate::config::{Config, Route};
use crate::forward::rules::{HeaderRules, Vars};

pub(crate) struct Headers {
    rules: HeaderRules,
}

impl Builtin for Headers {
    fn compile(b: &mut Build<'_>) -> Option<Headers> {
        b.route.response_headers.as_deref().map(|r| Headers { rules: HeaderRules::new(r) })
    }

    fn describe(route: &Route, _: &Config) -> Option<String> {
        let rules = route.response_headers.as_deref()?;
        Some(format!("to every answer (its own 429s and 5xx, stale copies included), tollgate: {}", rules.describe()))
    }

    fn arrive<'a>(&'a self, a: &'a mut Arrival<'_>, seen: &mut Seen) -> Arrived<'a> {
        if self.rules.is_dynamic() {
            seen.headers = Some(render(&self.rules, a));
        }
        Arrived::Now(Flow::Next)
    }

    fn answer(&self, seen: &mut Seen, resp: &mut Response<Body>, _: Answered, _: &mut Notes<'_>) {
        self.rules.apply(resp.headers_mut(), seen.headers.as_deref().unwrap_or_default());
    }
}

#[cold]
fn render(rules: &HeaderRules, a: &Arrival<'_>) -> crate::forward::rules::Values {
    rules.render(&Vars {
        route: a.route,
        headers: &a.parts.headers,
        path: a.target.path(a.parts),
        request_id: a.request_id,
        peer: a.peer,
        trusted: a.trusted,
    })
}
