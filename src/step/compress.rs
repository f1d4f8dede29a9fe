//! `compression`: a route's answers encoded for the client that asks (gzip, brotli, zstd by
//! `Accept-Encoding`), as they stream. The mechanism (negotiation, which answers, their
//! fields, the streaming encoder) is the `compress` room's; this file puts it on the route's
//! steps: the request side keeps what the answer side needs of the request, the answer side
//! encodes every answer of the route it may (stale copies included: they are stored as the
//! upstream sent them and encoded per client), counts what it did and says it in words.

use http::Response;
use prometheus_client::metrics::counter::Counter;

use super::{Answered, Arrival, Arrived, Build, Builtin, Flow, Notes, Seen};
use crate::body::Body;
use crate::compress::{Asked, Compress, Counters, Origin, Outcome};
use crate::config::compression::{Coding, CompressionConfig};
use crate::config::{Config, Route};

pub(crate) struct Compression {
    inner: Compress,
    counts: Counts,
}

/// What the answer side did, by result (`tollgate_compression_total`).
struct Counts {
    gzip: Counter,
    br: Counter,
    zstd: Counter,
    /// Sent as it is, with `Vary: Accept-Encoding` (not accepted, `HEAD`, `304`, short).
    identity: Counter,
}

impl Builtin for Compression {
    fn compile(b: &mut Build<'_>) -> Option<Compression> {
        let config = b.route.compression.clone()?;
        let route = b.route.name.as_str();
        let count = |result| b.metrics.compression(route, result);
        let counters = Counters {
            bytes_in: b.metrics.compression_bytes(route, "in"),
            bytes_out: b.metrics.compression_bytes(route, "out"),
        };
        Some(Compression {
            inner: Compress::new(config).counted(counters),
            counts: Counts { gzip: count("gzip"), br: count("br"), zstd: count("zstd"), identity: count("identity") },
        })
    }

    fn describe(route: &Route, config: &Config) -> Option<String> {
        match (&route.compression, &config.compression) {
            (Some(c), _) => Some(describe(c)),
            (None, Some(_)) => Some("compression: none (this route turns the default off)".to_owned()),
            (None, None) => None,
        }
    }

    fn arrive<'a>(&'a self, a: &'a mut Arrival<'_>, seen: &mut Seen) -> Arrived<'a> {
        seen.compression = Some(Asked::new(&a.parts.method, &a.parts.headers));
        Arrived::Now(Flow::Next)
    }

    fn answer(&self, seen: &mut Seen, resp: &mut Response<Body>, from: Answered, notes: &mut Notes<'_>) {
        let origin = match from {
            Answered::Upstream | Answered::Responder | Answered::Stale => Origin::Upstream,
            Answered::Own => Origin::Own,
            Answered::Tunnel => Origin::Tunnel,
        };
        // Set by the request side, which runs before any step that may answer or refuse; else
        // as a request without the field.
        let asked = seen.compression.unwrap_or_default();
        match self.inner.apply(&asked, origin, resp) {
            Outcome::Encode(c) => {
                let count = match c {
                    Coding::Gzip => &self.counts.gzip,
                    Coding::Br => &self.counts.br,
                    Coding::Zstd => &self.counts.zstd,
                };
                count.inc();
                notes.add("compression", c.token());
            }
            Outcome::Identity(_) => {
                self.counts.identity.inc();
            }
            Outcome::Skip(_) => {}
        }
    }
}

/// A route's `compression` in words: the codings in the server's order, what is encoded, how
/// a stream is sent.
fn describe(c: &CompressionConfig) -> String {
    let codings: Vec<String> = c.encodings.iter().map(|&e| format!("{} {}", e.token(), c.levels.of(e))).collect();
    let types: Vec<String> = c.types.iter().map(ToString::to_string).collect();
    let size = match c.min_size {
        0 => "of any size".to_owned(),
        n if n % (1 << 20) == 0 => format!("of {} MiB or more", n >> 20),
        n if n % (1 << 10) == 0 => format!("of {} KiB or more", n >> 10),
        n => format!("of {n} bytes or more"),
    };
    format!(
        "compression: {} (by Accept-Encoding's weights, this order among equal ones) for {} answers {size} \
         (or of unknown length), with Vary: Accept-Encoding; event streams flushed per event; never HEAD, 206, \
         no-transform, already encoded or tollgate's own answers",
        codings.join(", "),
        types.join(", ")
    )
}
