//! `Accept-Encoding` (RFC 9110 §12.5.3): the weights a client gives each coding, and the
//! choice among the codings a route offers.
//!
//! - No field: identity only (the RFC allows any coding, but clients that send none, curl
//!   without `--compressed` among them, would get bytes they cannot read).
//! - An empty field: identity only.
//! - `*` gives its weight to every coding not named; `x-gzip` is `gzip` (§8.4.1.3).
//! - Highest weight wins; among equal weights, the route's order of `encodings` (the server's
//!   preference). A coding with `q=0` is refused.
//! - Identity wins only when the client names it with a higher weight than every coding it
//!   accepts; `identity;q=0` (or `*;q=0` without `identity`) refuses it.
//! - A member that does not parse (a bad `q`) is left out, as if it were not there.

use http::HeaderValue;

use crate::config::compression::Coding;

/// Weights in thousandths (`q=0.5` is 500).
type Q = u16;

/// A member the field does not name.
const ABSENT: Q = Q::MAX;

/// Where each member's weight is kept.
const GZIP: usize = 0;
const BR: usize = 1;
const ZSTD: usize = 2;
const IDENTITY: usize = 3;
const STAR: usize = 4;

/// What a request's `Accept-Encoding` says; 12 bytes, kept for the answer in the request's
/// future.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    /// Weights by member ([`GZIP`]...), [`ABSENT`] when not named.
    q: [Q; 5],
    /// The request had the field.
    present: bool,
}

impl Default for Accepted {
    fn default() -> Accepted {
        Accepted { q: [ABSENT; 5], present: false }
    }
}

/// The outcome of negotiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    Encode(Coding),
    /// Send the answer as it is.
    Identity,
}

impl Accepted {
    /// Reads every `Accept-Encoding` line of a request.
    pub fn parse<'a>(lines: impl IntoIterator<Item = &'a HeaderValue>) -> Accepted {
        let mut a = Accepted::default();
        for line in lines {
            a.present = true;
            for member in line.as_bytes().split(|&b| b == b',') {
                a.member(member);
            }
        }
        a
    }

    fn member(&mut self, member: &[u8]) {
        let mut parts = member.split(|&b| b == b';');
        let name = trim(parts.next().unwrap_or_default());
        if name.is_empty() {
            return;
        }
        let mut q = 1000;
        for param in parts {
            let param = trim(param);
            let Some((k, v)) =
                param.iter().position(|&b| b == b'=').map(|i| (trim(&param[..i]), trim(&param[i + 1..])))
            else {
                return;
            };
            if k.eq_ignore_ascii_case(b"q") {
                match qvalue(v) {
                    Some(v) => q = v,
                    None => return,
                }
            }
        }
        let slot = if name.eq_ignore_ascii_case(b"gzip") || name.eq_ignore_ascii_case(b"x-gzip") {
            GZIP
        } else if name.eq_ignore_ascii_case(b"br") {
            BR
        } else if name.eq_ignore_ascii_case(b"zstd") {
            ZSTD
        } else if name.eq_ignore_ascii_case(b"identity") {
            IDENTITY
        } else if name == b"*" {
            STAR
        } else {
            return;
        };
        // Named twice (`gzip` and `x-gzip`): the first one counts.
        if self.q[slot] == ABSENT {
            self.q[slot] = q;
        }
    }

    fn named(&self, slot: usize) -> Option<Q> {
        Some(self.q[slot]).filter(|&q| q != ABSENT)
    }

    /// The weight the client gives `coding`.
    pub fn weight(&self, coding: Coding) -> Q {
        let slot = match coding {
            Coding::Gzip => GZIP,
            Coding::Br => BR,
            Coding::Zstd => ZSTD,
        };
        self.named(slot).or(self.named(STAR)).unwrap_or(0)
    }

    /// True when the client refuses an answer without a coding.
    pub fn refuses_identity(&self) -> bool {
        match self.named(IDENTITY) {
            Some(q) => q == 0,
            None => self.named(STAR) == Some(0),
        }
    }

    /// The coding to send among `offered` (the server's preference first).
    pub fn choose(&self, offered: &[Coding]) -> Choice {
        if !self.present {
            return Choice::Identity;
        }
        let mut best: Option<(Coding, Q)> = None;
        for &c in offered {
            let q = self.weight(c);
            if q > 0 && best.is_none_or(|(_, b)| q > b) {
                best = Some((c, q));
            }
        }
        match best {
            Some((_, q)) if self.named(IDENTITY).is_some_and(|i| i > q) => Choice::Identity,
            Some((c, _)) => Choice::Encode(c),
            None => Choice::Identity,
        }
    }
}

fn trim(s: &[u8]) -> &[u8] {
    s.trim_ascii()
}

/// `qvalue = ( "0" [ "." 0*3DIGIT ] ) / ( "1" [ "." 0*3("0") ] )`, in thousandths.
fn qvalue(v: &[u8]) -> Option<Q> {
    let (int, frac) = match v.iter().position(|&b| b == b'.') {
        Some(i) => (&v[..i], &v[i + 1..]),
        None => (v, &[][..]),
    };
    if frac.len() > 3 || !frac.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let mut thousandths: Q = 0;
    for (i, d) in frac.iter().enumerate() {
        thousandths += Q::from(d - b'0') * [100, 10, 1][i];
    }
    match int {
        b"0" => Some(thousandths),
        b"1" if thousandths == 0 => Some(1000),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Coding; 3] = [Coding::Zstd, Coding::Br, Coding::Gzip];

    fn choose(field: Option<&str>, offered: &[Coding]) -> Choice {
        let v = field.map(|f| HeaderValue::from_str(f).unwrap());
        Accepted::parse(v.as_ref()).choose(offered)
    }

    use Choice::{Encode, Identity};
    use Coding::{Br, Gzip, Zstd};

    #[test]
    fn negotiation_cases() {
        let cases: &[(Option<&str>, &[Coding], Choice)] = &[
            (None, &ALL, Identity),
            (Some(""), &ALL, Identity),
            (Some("gzip"), &ALL, Encode(Gzip)),
            (Some("GZIP"), &ALL, Encode(Gzip)),
            (Some("x-gzip"), &ALL, Encode(Gzip)),
            // Equal weights: the server's order.
            (Some("gzip, deflate, br, zstd"), &ALL, Encode(Zstd)),
            (Some("gzip, deflate, br"), &ALL, Encode(Br)),
            (Some("gzip, br"), &[Gzip, Br], Encode(Gzip)),
            // Weights beat the server's order.
            (Some("zstd;q=0.5, gzip;q=0.8, br;q=0.9"), &ALL, Encode(Br)),
            (Some("br;q=0.1, gzip"), &ALL, Encode(Gzip)),
            (Some("gzip ; q=0.5 , br ; Q=0.6"), &ALL, Encode(Br)),
            // Refused codings.
            (Some("gzip;q=0"), &ALL, Identity),
            (Some("zstd;q=0, br;q=0, gzip"), &ALL, Encode(Gzip)),
            (Some("*"), &ALL, Encode(Zstd)),
            (Some("*;q=0.5, zstd;q=0"), &ALL, Encode(Br)),
            (Some("*;q=0"), &ALL, Identity),
            (Some("deflate, compress"), &ALL, Identity),
            // Not offered by the route.
            (Some("br"), &[Gzip], Identity),
            // Identity named above every coding.
            (Some("identity;q=1, gzip;q=0.5"), &ALL, Identity),
            (Some("identity;q=0.5, gzip"), &ALL, Encode(Gzip)),
            (Some("identity;q=0, gzip;q=0.1"), &ALL, Encode(Gzip)),
            // Implicit identity does not beat a lower-weighted coding.
            (Some("gzip;q=0.5"), &ALL, Encode(Gzip)),
            // Bad members are left out.
            (Some("gzip;q=2, br"), &ALL, Encode(Br)),
            (Some("gzip;q=0.5555, br;q=0.1"), &ALL, Encode(Br)),
            (Some("gzip;q=abc"), &ALL, Identity),
            (Some("gzip;q"), &ALL, Identity),
            (Some(",, gzip ,"), &ALL, Encode(Gzip)),
            (Some("gzip;level=1;q=0.3, br;q=0.2"), &ALL, Encode(Gzip)),
        ];
        for (field, offered, want) in cases {
            assert_eq!(choose(*field, offered), *want, "{field:?} offered {offered:?}");
        }
    }

    #[test]
    fn several_lines_are_one_list() {
        let lines = [HeaderValue::from_static("gzip;q=0.2"), HeaderValue::from_static("br;q=0.3")];
        assert_eq!(Accepted::parse(&lines).choose(&ALL), Encode(Br));
    }

    #[test]
    fn identity_refusals() {
        let refuses = |f: &str| Accepted::parse(&[HeaderValue::from_str(f).unwrap()]).refuses_identity();
        assert!(refuses("identity;q=0, gzip"));
        assert!(refuses("*;q=0, gzip"));
        assert!(!refuses("*;q=0, identity, gzip"));
        assert!(!refuses("gzip"));
        assert!(!Accepted::parse(None::<&HeaderValue>).refuses_identity());
    }

    #[test]
    fn small_enough_to_keep_per_request() {
        assert_eq!(std::mem::size_of::<Accepted>(), 12);
    }

    #[test]
    fn qvalues() {
        assert_eq!(qvalue(b"1"), Some(1000));
        assert_eq!(qvalue(b"1.000"), Some(1000));
        assert_eq!(qvalue(b"0.5"), Some(500));
        assert_eq!(qvalue(b"0.05"), Some(50));
        assert_eq!(qvalue(b"0.001"), Some(1));
        assert_eq!(qvalue(b"0"), Some(0));
        assert_eq!(qvalue(b"0."), Some(0));
        for bad in [&b"1.5"[..], b"2", b"0.0001", b"", b"-0", b"0.a", b".5"] {
            assert_eq!(qvalue(bad), None, "{:?}", std::str::from_utf8(bad));
        }
    }
}
