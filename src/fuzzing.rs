//! Entry points for the fuzz targets (`fuzz/`) and their property tests: each function feeds
//! hostile bytes to one parser and panics when an invariant breaks, which is how a fuzzer
//! reports. Not an API: hidden from the docs, changed whenever the parsers change.
//!
//! Inputs other than config and Redis replies are a small text framing, so that seed corpora
//! are real request heads that a person can read and write:
//!
//! ```text
//! GET /api/users?id=7 HTTP/1.1     request line (a response's status line is ignored)
//! host: api.example.com            one field line; a repeated name is a second field
//! @peer: 10.0.0.4                  `@` lines set up the check (@key, @peer, @trusted, @received)
//! ```
//!
//! Lines end at `\n` (a `\r` before it is dropped); a field value is trimmed of spaces and
//! tabs like HTTP/1 parsers do. Field names and values that `http` refuses are skipped, since
//! hyper refuses such a request before tollgate sees it.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use http::header::{HeaderMap, HeaderName, HeaderValue, CACHE_CONTROL, DATE, EXPIRES, FORWARDED, HOST, VARY};
use http::request::Parts;
use http::{Method, Request, Uri, Version};
use ipnet::IpNet;
use redis::FromRedisValue;

pub use crate::cache::fuzzing::{cache_control, http_date, list_items, vary_names, CacheControl};
use crate::config::Config;
use crate::limit::key::MAX_PART_BYTES;
use crate::limit::{Decision, KeyPart, KeySpec};
use crate::request_key::{KeyCtx, TrustedProxies};

/// RFC 9111 §1.2.2: delta-seconds are capped at 2^31.
const DELTA_MAX: u64 = 1 << 31;

/// Reads a Redis script reply (`{kind, wait_or_retry_after, remaining, reset, granted}`).
pub fn decode_reply(reply: &[i64]) -> Option<(Decision, u64)> {
    crate::limit::store::redis::decode_reply(reply)
}

/// One input in the text framing (see the module docs).
#[derive(Debug, Default, Clone)]
pub struct Head {
    pub start: Vec<u8>,
    pub fields: Vec<(Vec<u8>, Vec<u8>)>,
    pub meta: Vec<(String, String)>,
}

impl Head {
    /// Splits `data` into lines; never fails.
    pub fn parse(data: &[u8]) -> Head {
        let mut lines = data.split(|&b| b == b'\n').map(|l| l.strip_suffix(b"\r").unwrap_or(l));
        let mut head = Head { start: lines.next().unwrap_or_default().to_vec(), ..Head::default() };
        for line in lines {
            let (name, value) = match line.iter().position(|&b| b == b':') {
                Some(i) => (&line[..i], trim(&line[i + 1..])),
                None => (line, &[][..]),
            };
            match name.strip_prefix(b"@") {
                Some(meta) => head.meta.push((lossy(meta).trim().to_owned(), lossy(value))),
                None => head.fields.push((name.to_vec(), value.to_vec())),
            }
        }
        head
    }

    /// The value of setting `@name`, if given.
    pub fn meta(&self, name: &str) -> Option<&str> {
        self.meta.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The fields `http` accepts, in order.
    pub fn headers(&self) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in &self.fields {
            if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
                map.append(n, v);
            }
        }
        map
    }

    /// The request, if its target is a URI `http` accepts. A missing or unknown method is
    /// GET, a missing or unknown version HTTP/1.1.
    pub fn request(&self) -> Option<Parts> {
        let mut words = self.start.split(|&b| b == b' ').filter(|w| !w.is_empty());
        let method = words.next().and_then(|m| Method::from_bytes(m).ok()).unwrap_or(Method::GET);
        let uri = Uri::try_from(words.next().unwrap_or(b"/")).ok()?;
        let version = match words.next() {
            Some(b"HTTP/0.9") => Version::HTTP_09,
            Some(b"HTTP/1.0") => Version::HTTP_10,
            Some(b"HTTP/2" | b"HTTP/2.0") => Version::HTTP_2,
            Some(b"HTTP/3" | b"HTTP/3.0") => Version::HTTP_3,
            _ => Version::HTTP_11,
        };
        Some(request(method, uri, version, self.headers()))
    }
}

fn trim(s: &[u8]) -> &[u8] {
    let ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = s.iter().position(|b| !ows(b)).unwrap_or(s.len());
    let end = s.iter().rposition(|b| !ows(b)).map_or(start, |i| i + 1);
    &s[start..end]
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn request(method: Method, uri: Uri, version: Version, headers: HeaderMap) -> Parts {
    let mut parts = Request::new(()).into_parts().0;
    (parts.method, parts.uri, parts.version, parts.headers) = (method, uri, version, headers);
    parts
}

fn copy(parts: &Parts) -> Parts {
    request(parts.method.clone(), parts.uri.clone(), parts.version, parts.headers.clone())
}

// ---------------------------------------------------------------------------------------------
// Config

/// Any bytes (as the UTF-8 the loader would read) → a config or an error positioned inside
/// the text; an accepted config compiles and explains without a panic.
pub fn config(data: &[u8]) {
    check_config(&String::from_utf8_lossy(data));
}

pub fn check_config(text: &str) {
    match Config::from_yaml(Path::new("fuzz.yaml"), text) {
        Ok(config) => {
            for route in &config.routes {
                assert!(route.upstream < config.upstreams.len(), "route {} names no upstream", route.name);
            }
            let _ = crate::explain::explain(&config);
            drop(crate::proxy::Proxy::new(config));
        }
        Err(e) => {
            assert!(!e.message.is_empty(), "an error without a message: {e:?}");
            let inside = within(text, e.line, e.column);
            assert!(inside, "{}:{} is outside the text: {e}\n{text:?}", e.line, e.column);
            let _ = e.to_string();
        }
    }
}

/// True when 1-based `line`:`column` (in characters) is inside `text` or just past a line's
/// end. The two YAML readers disagree on line breaks (libyaml, behind serde_yaml, also breaks
/// at U+0085, U+2028 and U+2029; yaml-rust2 only at CR and LF), so either reading counts.
fn within(text: &str, line: usize, column: usize) -> bool {
    let narrow = |c: char| c == '\n' || c == '\r';
    let wide = |c: char| narrow(c) || matches!(c, '\u{85}' | '\u{2028}' | '\u{2029}');
    let fits = |is_break: &dyn Fn(char) -> bool| {
        let mut lines = Vec::new();
        let mut rest = text;
        while let Some(i) = rest.find(is_break) {
            lines.push(&rest[..i]);
            let skip =
                if rest[i..].starts_with("\r\n") { 2 } else { rest[i..].chars().next().map_or(1, char::len_utf8) };
            rest = &rest[i + skip..];
        }
        lines.push(rest);
        line >= 1 && column >= 1 && lines.get(line - 1).is_some_and(|l| column <= l.chars().count() + 1)
    };
    fits(&narrow) || fits(&wide)
}

// ---------------------------------------------------------------------------------------------
// Keys

/// A request head, `@key` (a key spec; default: every part the request has) and `@peer`.
pub fn key(data: &[u8]) {
    let head = Head::parse(data);
    if let Some(parts) = head.request() {
        let peer = head.meta("peer").and_then(|p| p.trim().parse().ok()).unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        check_key(head.meta("key"), &parts, peer);
    }
}

/// Hashing never fails and reads only what the spec names, each part capped; a spec that
/// parses prints back to itself.
pub fn check_key(spec: Option<&str>, parts: &Parts, peer: IpAddr) {
    let spec = match spec.map(KeySpec::parse) {
        Some(Ok(spec)) => {
            let printed: Vec<String> = spec.parts().iter().map(ToString::to_string).collect();
            let again = KeySpec::parse(&printed.join(", "));
            assert_eq!(again.as_ref(), Ok(&spec), "{printed:?} does not parse back");
            spec
        }
        _ => every_part(parts),
    };
    let hash = |p: &Parts| {
        KeyCtx { route: "fuzz", client_ip: peer, path: p.uri.path(), parts: p, tls_client: None, known: None }
            .key(&spec)
    };
    let digest = hash(parts);
    assert_eq!(hash(parts), digest, "hashing is deterministic");

    let unrelated = HeaderName::from_static("x-fuzz-unrelated");
    if !spec.parts().contains(&KeyPart::Header(unrelated.clone())) {
        let mut more = copy(parts);
        more.headers.append(unrelated, HeaderValue::from_static("1"));
        assert_eq!(hash(&more), digest, "a field the spec does not name changed the key");
    }
    for part in spec.parts() {
        let KeyPart::Header(name) = part else { continue };
        let mut capped = copy(parts);
        capped.headers.remove(name);
        let mut budget = MAX_PART_BYTES;
        for v in parts.headers.get_all(name) {
            let keep = &v.as_bytes()[..v.len().min(budget)];
            budget -= keep.len();
            let keep = HeaderValue::from_bytes(keep).expect("a prefix of a valid value is valid");
            capped.headers.append(name.clone(), keep);
        }
        assert_eq!(hash(&capped), digest, "bytes past the cap of {name} changed the key");
        if !parts.headers.contains_key(name) {
            let mut empty = copy(parts);
            empty.headers.append(name.clone(), HeaderValue::from_static(""));
            assert_ne!(hash(&empty), digest, "a missing {name} and an empty one share a key");
        }
    }
}

/// Route, client IP, path, every field name and every query parameter name of `parts`.
fn every_part(parts: &Parts) -> KeySpec {
    let mut all = vec![KeyPart::Route, KeyPart::ClientIp, KeyPart::Path];
    all.extend(parts.headers.keys().map(|n| KeyPart::Header(n.clone())));
    for pair in parts.uri.query().unwrap_or("").split('&') {
        let name = pair.split_once('=').map_or(pair, |(k, _)| k);
        if !name.is_empty() {
            all.push(KeyPart::Query(name.to_owned()));
        }
    }
    KeySpec::new(all).expect("never empty")
}

// ---------------------------------------------------------------------------------------------
// Client IP

/// A bearer token: the compact JWS parser and the verifier never panic, a parsed token's
/// signed bytes are the input's first two parts, and nothing unsigned verifies.
pub fn jwt(data: &[u8]) {
    use crate::jwt::{self, Alg, Algs, KeySet, Refusal, Rules};
    if let Ok(parsed) = jwt::parse(data) {
        assert!(data.starts_with(parsed.signed), "the signed bytes are not the token's prefix");
        assert_eq!(parsed.signed.iter().filter(|&&b| b == b'.').count(), 1, "signed bytes are two parts");
    }
    let rules = Rules {
        algorithms: Alg::ALL.into_iter().fold(Algs::default(), Algs::with),
        issuers: Vec::new(),
        audiences: vec!["api".into()],
        leeway_secs: 30,
        consumer_claim: "sub".into(),
        keep: vec!["org_id".into()],
    };
    // A secret no input can know: whatever the bytes, none verifies, and none panics.
    let keys = KeySet::hmac(b"fuzzing: a secret no input holds, 32+ bytes");
    let verified = jwt::verify(data, &keys, &rules, 1_800_000_000);
    assert!(verified.is_err(), "an input verified against a secret it cannot know");
    assert_ne!(verified, Err(Refusal::Audience), "an unsigned input reached the audience check");
    let _ = KeySet::from_jwks(data);
}

/// `X-Forwarded-For` / `Forwarded` fields, `@peer` and `@trusted` (comma-separated CIDRs).
pub fn client_ip(data: &[u8]) {
    let head = Head::parse(data);
    let peer = head.meta("peer").and_then(|p| p.trim().parse().ok()).unwrap_or(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)));
    let nets: Vec<IpNet> = match head.meta("trusted") {
        Some(list) => list.split(',').filter_map(|n| n.trim().parse().ok()).collect(),
        None => ["10.0.0.0/8", "127.0.0.0/8", "::1/128", "fd00::/8"].iter().filter_map(|n| n.parse().ok()).collect(),
    };
    check_client_ip(&nets, peer, &head.headers());
}

/// The client is the peer unless the peer is trusted; it is always in canonical form; what a
/// client writes left of its own address never changes the answer; a trusted hop appended on
/// the right changes it at most to that hop.
pub fn check_client_ip(nets: &[IpNet], peer: IpAddr, headers: &HeaderMap) {
    let trusted = TrustedProxies::new(nets.to_vec());
    let client = trusted.client_ip(peer, headers);
    assert_eq!(client, client.to_canonical(), "not canonical");
    if !trusted.is_trusted(peer) {
        assert_eq!(client, peer.to_canonical(), "an untrusted peer's fields were believed");
        return;
    }
    let xff = HeaderName::from_static("x-forwarded-for");
    let field = if headers.contains_key(&xff) { xff } else { FORWARDED };
    let spoof =
        if field == FORWARDED { "for=198.51.100.7, for=unknown, for=10.0.0.9" } else { "198.51.100.7, junk, 10.0.0.9" };
    if !trusted.is_trusted(client) {
        // The client wrote a first field line of its own.
        let mut spoofed = HeaderMap::new();
        spoofed.append(field.clone(), HeaderValue::from_static(spoof));
        for (name, value) in headers {
            spoofed.append(name.clone(), value.clone());
        }
        assert_eq!(trusted.client_ip(peer, &spoofed), client, "text left of the client changed the answer");
    }
    if let Some(net) = nets.first() {
        let hop = net.addr();
        let text = match (hop, field == FORWARDED) {
            (IpAddr::V6(a), true) => format!("for=\"[{a}]:443\""),
            (a, true) => format!("for={a}"),
            (a, false) => a.to_string(),
        };
        let mut appended = headers.clone();
        appended.append(field, HeaderValue::from_str(&text).expect("an address is a valid value"));
        let now = trusted.client_ip(peer, &appended);
        assert!(now == client || now == hop.to_canonical(), "appending hop {hop} moved the client to {now}");
    }
}

// ---------------------------------------------------------------------------------------------
// Cache-Control, Vary, HTTP-date

/// A response head: `Cache-Control`, `Vary`, `Expires`, `Date` fields; `@received`.
pub fn cache_fields(data: &[u8]) {
    let head = Head::parse(data);
    let received = head.meta("received").and_then(|r| r.trim().parse().ok()).unwrap_or(1_700_000_000);
    check_cache_fields(&head.headers(), received);
}

/// Directive values are capped; the first occurrence of each wins; list items are trimmed and
/// split only outside quotes; a date that parses prints back to itself; `Vary` names are
/// unique and every item is among them, unless the response must not be stored.
pub fn check_cache_fields(headers: &HeaderMap, received: u64) {
    let cc = cache_control(headers, received);
    for v in [cc.max_age, cc.s_maxage, cc.stale_if_error].into_iter().flatten() {
        assert!(v <= DELTA_MAX, "delta-seconds {v} above 2^31");
    }
    assert_eq!(cc.allows_stale, !(cc.must_revalidate || cc.proxy_revalidate || cc.s_maxage.is_some()));
    if let Some(s) = cc.s_maxage.or(cc.max_age) {
        assert_eq!(cc.lifetime, s, "the lifetime is not s-maxage, else max-age");
    }
    let mut max_age = None;
    let mut no_store = false;
    for line in headers.get_all(CACHE_CONTROL) {
        for item in checked_items(line.as_bytes()) {
            // Spaces around `=` are not in the grammar; the policy reads `max-age = 5` as
            // `max-age=5` (for `no-store`, the side of caution).
            let (name, value) = match item.iter().position(|&b| b == b'=') {
                Some(i) => (trim(&item[..i]), Some(&item[i + 1..])),
                None => (item, None),
            };
            no_store |= name.eq_ignore_ascii_case(b"no-store");
            if name.eq_ignore_ascii_case(b"max-age") && max_age.is_none() {
                max_age = Some(value.and_then(delta).unwrap_or(0));
            }
        }
    }
    assert_eq!(cc.max_age, max_age, "max-age is not the first one's value");
    assert_eq!(cc.no_store, no_store);
    for value in headers.get_all(DATE).iter().chain(headers.get_all(EXPIRES)) {
        check_http_date(value.as_bytes());
    }
    let items: Vec<&[u8]> = headers.get_all(VARY).iter().flat_map(|v| checked_items(v.as_bytes())).collect();
    match vary_names(headers) {
        Some(names) => {
            for (i, n) in names.iter().enumerate() {
                assert!(!names[..i].contains(n), "{n} twice in {names:?}");
            }
            for item in &items {
                let name = HeaderName::from_bytes(item).expect("a stored Vary names valid fields");
                assert!(names.contains(&name), "{name} missing from {names:?}");
            }
            assert!(names.len() <= items.len());
        }
        None => assert!(
            items.iter().any(|i| *i == b"*" || HeaderName::from_bytes(i).is_err()),
            "a Vary without `*` or a bad name was refused: {items:?}"
        ),
    }
}

/// The list items of `value`, checked: non-empty, trimmed, and (without quotes) exactly the
/// comma-separated parts.
fn checked_items(value: &[u8]) -> Vec<&[u8]> {
    let items = list_items(value);
    for item in &items {
        assert!(!item.is_empty() && trim(item) == *item, "item {item:?} of {value:?} is empty or untrimmed");
    }
    if !value.contains(&b'"') {
        let plain: Vec<&[u8]> = value.split(|&b| b == b',').map(trim).filter(|i| !i.is_empty()).collect();
        assert_eq!(items, plain, "items of {value:?}");
    }
    items
}

/// RFC 9111 delta-seconds, capped; `None` when not digits (after OWS and quotes).
fn delta(value: &[u8]) -> Option<u64> {
    let v = trim(value);
    let v = match v {
        [b'"', inner @ .., b'"'] => inner,
        _ => v,
    };
    if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0u64, |n, &b| n.saturating_mul(10).saturating_add(u64::from(b - b'0')).min(DELTA_MAX)))
}

/// A date that parses prints back to the same instant, and to the same text when it names a
/// real calendar day and no leap second (the weekday is not checked by the parser).
pub fn check_http_date(value: &[u8]) {
    let Some(t) = http_date(value) else { return };
    let printed = imf_fixdate(t);
    assert_eq!(http_date(printed.as_bytes()), Some(t), "{printed} does not parse back to {t}");
    let sent = trim(value);
    let number = |r: std::ops::Range<usize>| std::str::from_utf8(&sent[r]).ok().and_then(|d| d.parse().ok());
    let month = MONTHS.iter().position(|m| m.as_bytes() == &sent[8..11]);
    let real_day = match (number(5..7), month, number(12..16)) {
        (Some(day), Some(month), Some(year)) => day <= days_in(month, year),
        _ => false,
    };
    if real_day && &sent[23..25] != b"60" {
        assert_eq!(&sent[5..], &printed.as_bytes()[5..], "{value:?} read as {printed}");
    }
}

const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];

/// Days in month `month` (0-based) of `year`.
fn days_in(month: usize, year: u64) -> u64 {
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    match month {
        1 if leap => 29,
        1 => 28,
        3 | 5 | 8 | 10 => 30,
        _ => 31,
    }
}

/// Unix seconds → IMF-fixdate, counting years and months one by one (a different method
/// from the parser's, so the two check each other).
pub fn imf_fixdate(t: u64) -> String {
    const WEEKDAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    let (mut days, secs) = (t / 86_400, t % 86_400);
    let weekday = WEEKDAYS[(days % 7) as usize];
    let mut year = 1970;
    while days >= 337 + days_in(1, year) {
        days -= 337 + days_in(1, year);
        year += 1;
    }
    let mut month = 0;
    while days >= days_in(month, year) {
        days -= days_in(month, year);
        month += 1;
    }
    format!(
        "{weekday}, {:02} {} {year:04} {:02}:{:02}:{:02} GMT",
        days + 1,
        MONTHS[month],
        secs / 3_600,
        secs / 60 % 60,
        secs % 60
    )
}

// ---------------------------------------------------------------------------------------------
// Redis replies

/// Any bytes as a RESP reply, read the way a decision reads it; and any bytes as the integers
/// of a reply.
pub fn redis_reply(data: &[u8]) {
    if let Ok(value) = redis::parse_redis_value(data) {
        if let Ok(reply) = Vec::<i64>::from_redis_value(&value) {
            check_decode(&reply);
        }
        let _ = i64::from_redis_value(&value);
    }
    let ints: Vec<i64> =
        data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("chunks of 8"))).take(8).collect();
    check_decode(&ints);
}

/// A reply is read only when it has the documented shape, and then exactly as sent.
pub fn check_decode(reply: &[i64]) {
    let got = decode_reply(reply);
    let shaped = reply.len() == 5 && (0..=2).contains(&reply[0]) && reply[1..].iter().all(|v| *v >= 0);
    assert_eq!(got.is_some(), shaped, "{reply:?} → {got:?}");
    let Some((decision, granted)) = got else { return };
    let u = |i: usize| reply[i].unsigned_abs();
    let span = |i: usize| crate::limit::Span::from_micros(u(i));
    assert_eq!(granted, u(4));
    let expected = match reply[0] {
        0 => Decision::Allow { remaining: u(2), reset: span(3) },
        1 => Decision::Delay { wait: span(1), remaining: u(2), reset: span(3) },
        _ => Decision::Deny { retry_after: span(1), reset: span(3) },
    };
    assert_eq!(decision, expected);
}

// ---------------------------------------------------------------------------------------------
// Request target

/// A request head: the request line's target and version, and its `Host` fields.
pub fn target(data: &[u8]) {
    if let Some(parts) = Head::parse(data).request() {
        check_target(parts);
    }
}

/// When [`crate::target::decide`] accepts: one canonical `Host` (lower case, no trailing dot,
/// no empty port), a forwarded path and a matched path without `//`, `.` or `..` segments,
/// and deciding the result again changes nothing.
pub fn check_target(mut parts: Parts) {
    let version = parts.version;
    let Ok(decided) = crate::target::decide(&mut parts) else { return };
    let matched = decided.path(&parts).to_owned();
    let hosts: Vec<&HeaderValue> = parts.headers.get_all(HOST).iter().collect();
    assert!(hosts.len() <= 1, "{} Host fields", hosts.len());
    match hosts.first() {
        Some(h) => {
            let h = h.to_str().expect("a canonical host is ASCII");
            let name = crate::target::strip_port(h);
            assert!(!name.is_empty() && !name.ends_with('.') && !h.ends_with(':'), "host {h:?} is not canonical");
            assert!(!h.bytes().any(|b| b.is_ascii_uppercase()), "host {h:?} is not lower case");
            assert_eq!(crate::target::host(&parts.headers), Some(name));
        }
        None => assert!(version != Version::HTTP_11, "an HTTP/1.1 request without Host was accepted"),
    }
    if parts.uri.path() != "*" {
        check_normal(parts.uri.path(), "forwarded");
        check_normal(&matched, "matched");
        assert!(!matched.contains(';'), "the matched path {matched:?} keeps parameters");
    }
    let mut again = copy(&parts);
    let second = crate::target::decide(&mut again).expect("a decided target is decided again");
    assert_eq!(again.uri, parts.uri, "deciding twice changed the target");
    assert_eq!(again.headers.get(HOST), parts.headers.get(HOST), "deciding twice changed Host");
    assert_eq!(second.path(&again), matched, "deciding twice changed the matched path");
}

fn check_normal(path: &str, which: &str) {
    assert!(path.starts_with('/'), "the {which} path {path:?} is not absolute");
    for bad in ["//", "/./", "/../", "\\"] {
        assert!(!path.contains(bad), "the {which} path {path:?} contains {bad:?}");
    }
    assert!(!path.ends_with("/.") && !path.ends_with("/.."), "the {which} path {path:?} ends in a dot segment");
    let bytes = path.as_bytes();
    for (i, _) in path.match_indices('%') {
        let hex = bytes.get(i + 1..i + 3).unwrap_or(b"");
        assert!(
            hex.len() == 2 && hex.iter().all(|c| c.is_ascii_digit() || (b'A'..=b'F').contains(c)),
            "the {which} path {path:?} has an escape that is not upper-case hex"
        );
        let byte = u8::from_str_radix(std::str::from_utf8(hex).unwrap_or("00"), 16).unwrap_or(0);
        assert!(
            !(byte.is_ascii_alphanumeric() || b"-._~/\\\0".contains(&byte)),
            "the {which} path {path:?} keeps %{byte:02X} escaped"
        );
    }
}

#[cfg(test)]
mod props;
#[cfg(test)]
mod regressions;
