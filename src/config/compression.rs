//! `compression:` (top level: the default of every route; per route: its own, or `none`):
//! which content codings answers may be encoded with, in the server's order of preference,
//! at what level each, from what size, and for which media types.

use serde::Deserialize;

use super::units::Size;
use super::{key, Invalid, Seg};

/// A content coding tollgate encodes answers with (RFC 9110 §8.4.1; `zstd`: RFC 8878, `br`:
/// RFC 7932).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Coding {
    Zstd,
    Br,
    Gzip,
}

impl Coding {
    /// The token in `Accept-Encoding` and `Content-Encoding`.
    pub fn token(self) -> &'static str {
        match self {
            Coding::Zstd => "zstd",
            Coding::Br => "br",
            Coding::Gzip => "gzip",
        }
    }

    fn parse(s: &str) -> Option<Coding> {
        match s {
            "zstd" => Some(Coding::Zstd),
            "br" => Some(Coding::Br),
            "gzip" => Some(Coding::Gzip),
            _ => None,
        }
    }

    /// The levels `check` accepts: zlib's 1-9; brotli's 0-9 (10 and 11 spend about a hundred
    /// times the CPU of 9, seconds a megabyte: for files made once, not for every answer);
    /// zstd's 1-19 (20-22 need windows of 32 MiB and more per answer).
    pub fn levels(self) -> (i32, i32) {
        match self {
            Coding::Gzip => (1, 9),
            Coding::Br => (0, 9),
            Coding::Zstd => (1, 19),
        }
    }
}

/// The server's preference when a client accepts several codings with the same weight: zstd
/// first (at its level 3 it makes gzip's level-6 ratio at a fraction of the CPU), brotli next
/// (the best ratio at level 4-5 for text), gzip last (every client has it).
pub const DEFAULT_ENCODINGS: [Coding; 3] = [Coding::Zstd, Coding::Br, Coding::Gzip];

/// Levels: gzip 4 and brotli 4 (about gzip-6's ratio at half its CPU with zlib-rs), zstd 3
/// (zstd's own default). Measured in benchmarks/log/2026-12-06-issue-45-compression.md.
pub const DEFAULT_LEVELS: Levels = Levels { gzip: 4, br: 4, zstd: 3 };

/// Answers known to be shorter than this are sent as they are: a few hundred bytes gain little
/// and cost a whole encoder's set-up.
pub const DEFAULT_MIN_SIZE: u64 = 1024;

/// Text, JSON, JavaScript, XML and SVG: what compresses well and is not compressed already.
/// `application/grpc` is not among them (gRPC compresses its own messages).
pub const DEFAULT_TYPES: [&str; 9] = [
    "text/*",
    "application/json",
    "application/*+json",
    "application/javascript",
    "application/x-javascript",
    "application/xml",
    "application/*+xml",
    "application/x-ndjson",
    "image/svg+xml",
];

/// More `types` entries than this is a list that should be a pattern.
pub const MAX_TYPES: usize = 64;

/// A route's compression, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompressionConfig {
    /// Offered codings, the server's preference first; never empty.
    pub encodings: Vec<Coding>,
    pub levels: Levels,
    /// Answers whose `Content-Length` is below this are not compressed.
    pub min_size: u64,
    /// Media types compressed; an answer of another type (or none) passes as it is.
    pub types: Vec<MediaRange>,
}

impl Default for CompressionConfig {
    fn default() -> Self {
        CompressionConfig {
            encodings: DEFAULT_ENCODINGS.to_vec(),
            levels: DEFAULT_LEVELS,
            min_size: DEFAULT_MIN_SIZE,
            types: DEFAULT_TYPES.iter().filter_map(|t| MediaRange::parse(t).ok()).collect(),
        }
    }
}

/// The level of each coding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Levels {
    pub gzip: i32,
    pub br: i32,
    pub zstd: i32,
}

impl Levels {
    pub fn of(&self, coding: Coding) -> i32 {
        match coding {
            Coding::Gzip => self.gzip,
            Coding::Br => self.br,
            Coding::Zstd => self.zstd,
        }
    }
}

/// A media type pattern: `text/html`, `text/*`, `application/*+json`, lower-case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaRange {
    pub kind: String,
    pub sub: Sub,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sub {
    /// `type/subtype`.
    Exact(String),
    /// `type/*`.
    Any,
    /// `type/*+suffix` (RFC 6839 structured syntax suffixes): the suffix, with its `+`.
    Suffix(String),
}

impl MediaRange {
    pub fn parse(s: &str) -> Result<MediaRange, String> {
        let bad = || format!("`{s}`: expected a media type such as text/html, text/* or application/*+json");
        let lower = s.trim().to_ascii_lowercase();
        let (kind, sub) = lower.split_once('/').ok_or_else(bad)?;
        let token =
            |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b));
        if !token(kind) {
            return Err(bad());
        }
        let sub = match sub {
            "*" => Sub::Any,
            s if s.starts_with("*+") && token(&s[2..]) => Sub::Suffix(s[1..].to_owned()),
            s if token(s) => Sub::Exact(s.to_owned()),
            _ => return Err(bad()),
        };
        Ok(MediaRange { kind: kind.to_owned(), sub })
    }

    /// Whether the media type `kind/sub` (no parameters; any case) is in this range.
    pub fn matches(&self, kind: &str, sub: &str) -> bool {
        self.kind.eq_ignore_ascii_case(kind)
            && match &self.sub {
                Sub::Any => true,
                Sub::Exact(s) => s.eq_ignore_ascii_case(sub),
                Sub::Suffix(x) => {
                    sub.len() > x.len() && sub.as_bytes()[sub.len() - x.len()..].eq_ignore_ascii_case(x.as_bytes())
                }
            }
    }
}

impl std::fmt::Display for MediaRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.sub {
            Sub::Exact(s) => write!(f, "{}/{s}", self.kind),
            Sub::Any => write!(f, "{}/*", self.kind),
            Sub::Suffix(x) => write!(f, "{}/*{x}", self.kind),
        }
    }
}

/// `compression:` on a route: `none`, or its own.
pub enum RawRouteCompression {
    Word(String),
    Own(Box<RawCompression>),
}

// By hand, not `untagged`: a mistake inside the map keeps its own field and message.
impl<'de> Deserialize<'de> for RawRouteCompression {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawRouteCompression;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("`none` or a map of encodings, levels, min_size, types")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(RawRouteCompression::Word(v.to_owned()))
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
                // YAML 1.1 reads `off` and `no` as false.
                Ok(RawRouteCompression::Word(if v { "true" } else { "off" }.to_owned()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let raw = RawCompression::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(RawRouteCompression::Own(Box::new(raw)))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawCompression {
    encodings: Option<Vec<String>>,
    levels: Option<RawLevels>,
    min_size: Option<Size>,
    types: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLevels {
    gzip: Option<i32>,
    br: Option<i32>,
    zstd: Option<i32>,
}

impl RawRouteCompression {
    /// `None`: the route has `compression: none`.
    pub fn validate(self, at: &[Seg]) -> Result<Option<CompressionConfig>, Invalid> {
        match self {
            RawRouteCompression::Word(w) if w == "none" => Ok(None),
            RawRouteCompression::Word(w) => Err((
                at.to_vec(),
                format!(
                    "`{w}`: expected `none` or a map (`{{}}` for the defaults) of encodings, levels, min_size, types"
                ),
            )),
            RawRouteCompression::Own(raw) => raw.validate(at).map(Some),
        }
    }
}

impl RawCompression {
    pub fn validate(self, at: &[Seg]) -> Result<CompressionConfig, Invalid> {
        let path = |rest: &[Seg]| {
            let mut p = at.to_vec();
            p.extend_from_slice(rest);
            p
        };
        let mut out = CompressionConfig::default();
        if let Some(list) = self.encodings {
            if list.is_empty() {
                return Err((
                    path(&[key("encodings")]),
                    "expected at least one of zstd, br, gzip (`compression: none` turns compression off)".to_owned(),
                ));
            }
            out.encodings.clear();
            for (i, name) in list.iter().enumerate() {
                let at = || path(&[key("encodings"), Seg::Index(i)]);
                let coding = Coding::parse(name.trim()).ok_or_else(|| {
                    (at(), format!("`{name}` is not a coding tollgate encodes with; expected zstd, br or gzip"))
                })?;
                if out.encodings.contains(&coding) {
                    return Err((at(), format!("`{name}` is listed twice")));
                }
                out.encodings.push(coding);
            }
        }
        if let Some(levels) = self.levels {
            for (coding, level) in [(Coding::Gzip, levels.gzip), (Coding::Br, levels.br), (Coding::Zstd, levels.zstd)] {
                let Some(level) = level else { continue };
                let (lo, hi) = coding.levels();
                if !(lo..=hi).contains(&level) {
                    return Err((
                        path(&[key("levels"), key(coding.token())]),
                        format!("level {level}: {} takes {lo} to {hi}", coding.token()),
                    ));
                }
                match coding {
                    Coding::Gzip => out.levels.gzip = level,
                    Coding::Br => out.levels.br = level,
                    Coding::Zstd => out.levels.zstd = level,
                }
            }
        }
        if let Some(size) = self.min_size {
            out.min_size = size.0;
        }
        if let Some(types) = self.types {
            if types.is_empty() {
                return Err((
                    path(&[key("types")]),
                    "expected at least one media type (`compression: none` turns compression off)".to_owned(),
                ));
            }
            if types.len() > MAX_TYPES {
                return Err((
                    path(&[key("types"), Seg::Index(MAX_TYPES)]),
                    format!(
                        "{} media types; at most {MAX_TYPES} are accepted (use text/* or application/*+json)",
                        types.len()
                    ),
                ));
            }
            out.types.clear();
            for (i, t) in types.iter().enumerate() {
                let range = MediaRange::parse(t).map_err(|e| (path(&[key("types"), Seg::Index(i)]), e))?;
                if !out.types.contains(&range) {
                    out.types.push(range);
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_ranges_parse_and_match() {
        let r = MediaRange::parse("Application/*+JSON").unwrap();
        assert!(r.matches("application", "problem+json"));
        assert!(!r.matches("application", "json"));
        assert!(!r.matches("text", "x+json"));
        assert!(MediaRange::parse("text/*").unwrap().matches("text", "event-stream"));
        assert!(MediaRange::parse("text/html").unwrap().matches("text", "html"));
        assert!(!MediaRange::parse("text/html").unwrap().matches("text", "plain"));
        for bad in ["text", "/html", "text/", "text/ html", "*/*+", "text/*+"] {
            assert!(MediaRange::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(MediaRange::parse("application/*+xml").unwrap().to_string(), "application/*+xml");
    }

    #[test]
    fn defaults_are_valid_and_ordered() {
        let c = CompressionConfig::default();
        assert_eq!(c.types.len(), DEFAULT_TYPES.len());
        assert_eq!(c.encodings, [Coding::Zstd, Coding::Br, Coding::Gzip]);
        for coding in DEFAULT_ENCODINGS {
            let (lo, hi) = coding.levels();
            assert!((lo..=hi).contains(&DEFAULT_LEVELS.of(coding)));
        }
    }
}
