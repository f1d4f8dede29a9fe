//! `routes[].mirror`: a copy of each of a route's forwarded requests (or of a sampled share)
//! sent to another upstream, fire-and-forget, bounded in number and in body size. The serde
//! mirror and its validation; the copies are made by the `mirror` step (`step/mirror.rs`).

use http::HeaderName;
use serde::Deserialize;

use super::respond::Share;
use super::units::Size;
use super::{Invalid, Seg};

/// `max_in_flight` when not given: copies on their way at once, per route.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 100;
/// The largest `max_in_flight`.
pub const MAX_IN_FLIGHT: usize = 100_000;
/// `max_body` when not given: bodies up to this are copied.
pub const DEFAULT_MAX_BODY: u64 = 64 << 10;
/// The largest `max_body`: each copy in flight may hold this much of its body.
pub const MAX_BODY: u64 = 16 << 20;
/// `header` when not given: the field each copy carries (with the value `1`).
pub const DEFAULT_HEADER: &str = "x-tollgate-mirror";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMirror {
    upstream: String,
    sample: Option<Share>,
    max_in_flight: Option<usize>,
    max_body: Option<Size>,
    header: Option<String>,
    compare: Option<bool>,
}

/// A validated `mirror`.
#[derive(Debug, Clone, PartialEq)]
pub struct Mirror {
    /// Index into [`super::Config::upstreams`]: an HTTP upstream, never the route's one
    /// upstream (it may be a side of its split: the requests sent there are not copied).
    pub upstream: usize,
    /// The share of forwarded requests copied, in [0, 1].
    pub sample: f64,
    /// Copies on their way at once; over this, a copy is dropped (and counted).
    pub max_in_flight: usize,
    /// Bodies up to this many bytes are copied; a longer one's copy is dropped (and counted).
    pub max_body: u64,
    /// The field each copy carries, with the value `1`.
    pub header: HeaderName,
    /// Count the copies whose status differs from the primary's.
    pub compare: bool,
}

impl RawMirror {
    /// `at(field)` is the path of a field under `routes[i].mirror`; `upstream(name)` finds an
    /// HTTP upstream's index (`Err`: the message for a name that is none); `primary`: the
    /// route's one upstream (`None` for a split).
    pub fn validate(
        self,
        at: &dyn Fn(&[&str]) -> Vec<Seg>,
        upstream: &dyn Fn(&str) -> Result<usize, String>,
        primary: Option<usize>,
    ) -> Result<Mirror, Invalid> {
        let idx = upstream(&self.upstream).map_err(|e| (at(&["upstream"]), e))?;
        if primary == Some(idx) {
            return Err((
                at(&["upstream"]),
                format!("`{}` is the route's own upstream: each request would reach it twice", self.upstream),
            ));
        }
        let max_in_flight = self.max_in_flight.unwrap_or(DEFAULT_MAX_IN_FLIGHT);
        if !(1..=MAX_IN_FLIGHT).contains(&max_in_flight) {
            return Err((at(&["max_in_flight"]), format!("{max_in_flight}; expected 1 to {MAX_IN_FLIGHT}")));
        }
        let max_body = self.max_body.map_or(DEFAULT_MAX_BODY, |s| s.0);
        if max_body > MAX_BODY {
            return Err((at(&["max_body"]), format!("{max_body} bytes; at most {} MiB", MAX_BODY >> 20)));
        }
        let name = self.header.as_deref().unwrap_or(DEFAULT_HEADER);
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| (at(&["header"]), format!("`{name}` is not a valid header name")))?;
        if super::rules::REFUSED.contains(&header) {
            return Err((at(&["header"]), format!("`{name}` is a framing or hop-by-hop field; expected another name")));
        }
        Ok(Mirror {
            upstream: idx,
            sample: self.sample.map_or(1.0, |s| s.0),
            max_in_flight,
            max_body,
            header,
            compare: self.compare.unwrap_or(true),
        })
    }
}
