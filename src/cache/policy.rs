//! What HTTP caching rules say about one response: `Cache-Control` directives, freshness
//! lifetime (RFC 9111 §4.2.1) and the IMF-fixdate form of HTTP-date. Pure functions of header
//! values; "now" is always a parameter.

use http::header::{self, HeaderMap};

/// Delta-seconds that overflow are capped here (RFC 9111 §1.2.2 suggests 2^31).
const DELTA_MAX: u64 = 1 << 31;

/// The `Cache-Control` directives tollgate acts on; the first occurrence of each wins.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Directives {
    pub no_store: bool,
    pub no_cache: bool,
    pub private: bool,
    pub must_revalidate: bool,
    pub proxy_revalidate: bool,
    pub max_age: Option<u64>,
    pub s_maxage: Option<u64>,
    pub stale_if_error: Option<u64>,
    pub stale_while_revalidate: Option<u64>,
    pub public: bool,
    /// Request directives: `max-stale` (without a value: any staleness, `u64::MAX`),
    /// `min-fresh`, `only-if-cached`.
    pub max_stale: Option<u64>,
    pub min_fresh: Option<u64>,
    pub only_if_cached: bool,
}

impl Directives {
    /// Parses every `Cache-Control` field line of `headers`.
    pub fn parse(headers: &HeaderMap) -> Directives {
        let mut d = Directives::default();
        for line in headers.get_all(header::CACHE_CONTROL) {
            for item in list_items(line.as_bytes()) {
                let (name, value) = match item.iter().position(|&b| b == b'=') {
                    Some(i) => (trim(&item[..i]), Some(unquote(trim(&item[i + 1..])))),
                    None => (item, None),
                };
                d.apply(name, value);
            }
        }
        d
    }

    fn apply(&mut self, name: &[u8], value: Option<&[u8]>) {
        let is = |s: &str| name.eq_ignore_ascii_case(s.as_bytes());
        // A qualified `no-cache="f"` / `private="f"` would allow storing without field `f`;
        // treating it like the unqualified form is the conservative reading.
        if is("no-store") {
            self.no_store = true;
        } else if is("no-cache") {
            self.no_cache = true;
        } else if is("private") {
            self.private = true;
        } else if is("must-revalidate") {
            self.must_revalidate = true;
        } else if is("proxy-revalidate") {
            self.proxy_revalidate = true;
        } else if is("max-age") {
            // An invalid max-age makes the response stale (RFC 9111 §4.2.1), not fresh forever.
            self.max_age.get_or_insert(value.and_then(delta_seconds).unwrap_or(0));
        } else if is("s-maxage") {
            self.s_maxage.get_or_insert(value.and_then(delta_seconds).unwrap_or(0));
        } else if is("stale-if-error") && self.stale_if_error.is_none() {
            self.stale_if_error = value.and_then(delta_seconds);
        } else if is("stale-while-revalidate") && self.stale_while_revalidate.is_none() {
            self.stale_while_revalidate = value.and_then(delta_seconds);
        } else if is("public") {
            self.public = true;
        } else if is("max-stale") && self.max_stale.is_none() {
            self.max_stale = Some(value.map_or(Some(u64::MAX), delta_seconds).unwrap_or(0));
        } else if is("min-fresh") && self.min_fresh.is_none() {
            self.min_fresh = value.and_then(delta_seconds);
        } else if is("only-if-cached") {
            self.only_if_cached = true;
        }
    }

    /// True when a shared cache may use the response after it turned stale at all
    /// (RFC 9111 §4.2.4: `must-revalidate`, `proxy-revalidate` and `s-maxage` forbid it).
    pub fn allows_stale(&self) -> bool {
        !(self.must_revalidate || self.proxy_revalidate || self.s_maxage.is_some())
    }
}

/// Freshness lifetime in seconds as a shared cache computes it: `s-maxage`, else `max-age`,
/// else `Expires` − `Date`, else 0 (no heuristic freshness). A missing `Date` counts as
/// `received` (unix seconds); an unparsable `Expires` means already expired.
pub(super) fn freshness_lifetime(d: &Directives, headers: &HeaderMap, received: u64) -> u64 {
    if let Some(s) = d.s_maxage.or(d.max_age) {
        return s;
    }
    let Some(expires) = headers.get(header::EXPIRES) else {
        return 0;
    };
    let Some(expires) = http_date(expires.as_bytes()) else {
        return 0;
    };
    let date = headers.get(header::DATE).and_then(|v| http_date(v.as_bytes())).unwrap_or(received);
    expires.saturating_sub(date)
}

/// Status codes a cache may give a heuristic lifetime (RFC 9110 §15.1).
pub(super) fn heuristically_cacheable(status: http::StatusCode) -> bool {
    matches!(status.as_u16(), 200 | 203 | 204 | 300 | 301 | 308 | 404 | 405 | 410 | 414 | 501)
}

/// Whether an answer with `status` may be stored at all (RFC 9111 §3): a final status the
/// cache understands, heuristically cacheable or with an explicit lifetime (or `public`).
/// Never a partial answer (`206`: ranges are not combined) or a `304`.
pub(super) fn storable_status(status: http::StatusCode, explicit: bool) -> bool {
    let code = status.as_u16();
    if !(200..600).contains(&code) || code == 206 || code == 304 {
        return false;
    }
    heuristically_cacheable(status) || explicit
}

/// A heuristic lifetime: `percent` of the time between `Last-Modified` and `Date` (or
/// receipt), at most `max` seconds; 0 without a usable `Last-Modified` (RFC 9111 §4.2.2).
pub(super) fn heuristic_lifetime(headers: &HeaderMap, received: u64, percent: u8, max: u64) -> u64 {
    let Some(modified) = headers.get(header::LAST_MODIFIED).and_then(|v| http_date(v.as_bytes())) else {
        return 0;
    };
    let date = headers.get(header::DATE).and_then(|v| http_date(v.as_bytes())).unwrap_or(received);
    (date.saturating_sub(modified).saturating_mul(u64::from(percent)) / 100).min(max)
}

/// The items of a comma-separated field value, OWS trimmed, empty items skipped. Commas
/// inside quoted strings do not split, so `no-cache="a, b"` stays one item.
pub(super) fn list_items(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = value;
    std::iter::from_fn(move || loop {
        if rest.is_empty() {
            return None;
        }
        let (mut quoted, mut escaped) = (false, false);
        let mut end = rest.len();
        for (i, &b) in rest.iter().enumerate() {
            match b {
                _ if escaped => escaped = false,
                b'\\' if quoted => escaped = true,
                b'"' => quoted = !quoted,
                b',' if !quoted => {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        let item = trim(&rest[..end]);
        rest = rest.get(end + 1..).unwrap_or(&[]);
        if !item.is_empty() {
            return Some(item);
        }
    })
}

fn trim(s: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = s.iter().position(|b| !is_ows(b)).unwrap_or(s.len());
    let end = s.iter().rposition(|b| !is_ows(b)).map_or(start, |i| i + 1);
    &s[start..end]
}

fn unquote(s: &[u8]) -> &[u8] {
    match s {
        [b'"', inner @ .., b'"'] => inner,
        _ => s,
    }
}

fn delta_seconds(s: &[u8]) -> Option<u64> {
    if s.is_empty() || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(s.iter().fold(0u64, |n, &b| n.saturating_mul(10).saturating_add(u64::from(b - b'0')).min(DELTA_MAX)))
}

/// Parses an HTTP date into unix seconds: the IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`),
/// and the obsolete forms a recipient must accept (RFC 9110 §5.6.7): RFC 850
/// (`Sunday, 06-Nov-94 08:49:37 GMT`, a two-digit year from 70 read as 19xx, below as 20xx)
/// and asctime (`Sun Nov  6 08:49:37 1994`). Anything else reads as absent.
pub(super) fn http_date(s: &[u8]) -> Option<u64> {
    let s = trim(s);
    let num = |r: std::ops::Range<usize>| -> Option<u64> {
        let d = s.get(r)?;
        let d = d.strip_prefix(b" ").unwrap_or(d);
        (!d.is_empty() && d.iter().all(u8::is_ascii_digit))
            .then(|| d.iter().fold(0, |n, &b| n * 10 + u64::from(b - b'0')))
    };
    let month = |r: std::ops::Range<usize>| -> Option<u64> {
        const MONTHS: [&[u8; 3]; 12] =
            [b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec"];
        let m = s.get(r)?;
        MONTHS.iter().position(|x| x[..] == *m).map(|i| i as u64 + 1)
    };
    // The time of day at `at` (`08:49:37`).
    let time = |at: usize| -> Option<(u64, u64, u64)> {
        (s.get(at + 2) == Some(&b':') && s.get(at + 5) == Some(&b':'))
            .then_some(())
            .and_then(|()| Some((num(at..at + 2)?, num(at + 3..at + 5)?, num(at + 6..at + 8)?)))
    };
    let (year, month, day, (hour, min, sec)) = if s.len() == 29 && &s[3..5] == b", " && &s[25..] == b" GMT" {
        // IMF-fixdate.
        if s[7] != b' ' || s[11] != b' ' || s[16] != b' ' {
            return None;
        }
        (num(12..16)?, month(8..11)?, num(5..7)?, time(17)?)
    } else if s.len() == 24 && s[3] == b' ' && s[7] == b' ' && s[10] == b' ' && s[19] == b' ' {
        // asctime: the day is padded with a space.
        (num(20..24)?, month(4..7)?, num(8..10)?, time(11)?)
    } else {
        // RFC 850: a full day name, then `, DD-Mon-YY HH:MM:SS GMT`.
        let comma = s.iter().position(|&b| b == b',')?;
        let d = &s[comma..];
        if d.len() != 24 || d[1] != b' ' || d[4] != b'-' || d[8] != b'-' || d[11] != b' ' || &d[20..] != b" GMT" {
            return None;
        }
        let yy = num(comma + 9..comma + 11)?;
        let year = if yy < 70 { 2000 + yy } else { 1900 + yy };
        (year, month(comma + 5..comma + 8)?, num(comma + 2..comma + 4)?, time(comma + 12)?)
    };
    if !(1..=31).contains(&day) || year < 1970 || hour > 23 || min > 59 || sec > 60 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some(days * 86_400 + hour * 3_600 + min * 60 + sec)
}

/// An answer's `Age` in seconds: the first member when a list was sent (RFC 9111 §5.1:
/// `Age: 7200, 0` is 7200), 0 when absent or not a number.
pub(crate) fn age(headers: &HeaderMap) -> u64 {
    let Some(v) = headers.get(http::header::AGE) else { return 0 };
    let first = v.as_bytes().split(|&b| b == b',').next().unwrap_or_default();
    delta_seconds(trim(first)).unwrap_or(0)
}

/// Days since 1970-01-01 of a proleptic Gregorian date, for years from 1970 (H. Hinnant's
/// `days_from_civil`, restricted to non-negative results).
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).saturating_sub(719_468)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn an_age_list_counts_its_first_member() {
        assert_eq!(age(&headers(&[("age", "7200, 0")])), 7200);
        assert_eq!(age(&headers(&[("age", " 30 ")])), 30);
        assert_eq!(age(&headers(&[("age", "-1")])), 0);
        assert_eq!(age(&headers(&[("age", "abc")])), 0);
        assert_eq!(age(&HeaderMap::new()), 0);
    }

    #[test]
    fn parses_imf_fixdate() {
        assert_eq!(http_date(b"Sun, 06 Nov 1994 08:49:37 GMT"), Some(784_111_777));
        assert_eq!(http_date(b"Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        assert_eq!(http_date(b"Tue, 29 Feb 2000 12:00:00 GMT"), Some(951_825_600));
        // The obsolete forms a recipient must accept (RFC 9110 §5.6.7).
        assert_eq!(http_date(b"Sunday, 06-Nov-94 08:49:37 GMT"), Some(784_111_777));
        assert_eq!(http_date(b"Sun Nov  6 08:49:37 1994"), Some(784_111_777));
        assert_eq!(http_date(b"Thursday, 01-Jan-70 00:00:00 GMT"), Some(0));
        assert_eq!(http_date(b"Tuesday, 29-Feb-00 12:00:00 GMT"), Some(951_825_600));
        assert_eq!(http_date(b"Tue Feb 29 12:00:00 2000"), Some(951_825_600));
        for bad in [
            "Sunday, 06-Nov-94 08:49:37 UTC",
            "Sun Nov 6 08:49:37 1994",
            "Sunday 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08-49-37 1994",
        ] {
            assert_eq!(http_date(bad.as_bytes()), None, "{bad}");
        }
        assert_eq!(http_date(b"0"), None);
        assert_eq!(http_date(b"Sun, 06 Nox 1994 08:49:37 GMT"), None);
    }

    #[test]
    fn first_directive_wins_and_quotes_do_not_split() {
        let d = Directives::parse(&headers(&[
            ("cache-control", "Max-Age=10, no-cache=\"set-cookie, x\""),
            ("cache-control", "max-age=99, stale-if-error=\"30\""),
        ]));
        assert_eq!(d.max_age, Some(10));
        assert!(d.no_cache);
        assert!(!d.no_store);
        assert_eq!(d.stale_if_error, Some(30));
    }

    #[test]
    fn heuristic_is_a_share_of_the_time_since_last_modified() {
        let h =
            headers(&[("date", "Sun, 06 Nov 1994 08:49:37 GMT"), ("last-modified", "Sun, 06 Nov 1994 06:49:37 GMT")]);
        assert_eq!(heuristic_lifetime(&h, 0, 10, 86_400), 720);
        assert_eq!(heuristic_lifetime(&h, 0, 10, 100), 100);
        assert_eq!(heuristic_lifetime(&HeaderMap::new(), 0, 10, 100), 0);
        assert!(storable_status(http::StatusCode::NOT_FOUND, false));
        assert!(!storable_status(http::StatusCode::FOUND, false));
        assert!(storable_status(http::StatusCode::FOUND, true));
        assert!(!storable_status(http::StatusCode::PARTIAL_CONTENT, true));
        assert!(!storable_status(http::StatusCode::NOT_MODIFIED, true));
    }

    #[test]
    fn request_directives() {
        let d = Directives::parse(&headers(&[("cache-control", "max-stale, min-fresh=5, only-if-cached")]));
        assert_eq!(d.max_stale, Some(u64::MAX));
        assert_eq!(d.min_fresh, Some(5));
        assert!(d.only_if_cached);
        let d = Directives::parse(&headers(&[("cache-control", "max-stale=7, public, stale-while-revalidate=9")]));
        assert_eq!(d.max_stale, Some(7));
        assert!(d.public);
        assert_eq!(d.stale_while_revalidate, Some(9));
    }

    #[test]
    fn invalid_max_age_means_stale() {
        let d = Directives::parse(&headers(&[("cache-control", "max-age=soon")]));
        assert_eq!(d.max_age, Some(0));
    }

    #[test]
    fn lifetime_prefers_s_maxage_then_max_age_then_expires() {
        let h = headers(&[
            ("cache-control", "max-age=60, s-maxage=120"),
            ("date", "Sun, 06 Nov 1994 08:49:37 GMT"),
            ("expires", "Sun, 06 Nov 1994 09:49:37 GMT"),
        ]);
        assert_eq!(freshness_lifetime(&Directives::parse(&h), &h, 0), 120);
        let h = headers(&[("date", "Sun, 06 Nov 1994 08:49:37 GMT"), ("expires", "Sun, 06 Nov 1994 09:49:37 GMT")]);
        assert_eq!(freshness_lifetime(&Directives::parse(&h), &h, 0), 3_600);
        let h = headers(&[("expires", "0")]);
        assert_eq!(freshness_lifetime(&Directives::parse(&h), &h, 0), 0);
        assert_eq!(freshness_lifetime(&Directives::default(), &HeaderMap::new(), 0), 0);
    }

    #[test]
    fn list_items_trims_and_skips_empty() {
        let items: Vec<&[u8]> = list_items(b" gzip ,, br\t, \"a, b\" ").collect();
        assert_eq!(items, [&b"gzip"[..], b"br", b"\"a, b\""]);
    }
}
