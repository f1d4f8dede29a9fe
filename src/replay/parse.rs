//! The log formats `tollgate replay` reads, each line to one [`Record`]: tollgate's own JSON
//! access log, nginx `combined` (optionally with `$msec` appended), and JSON lines or CSV
//! with named columns for anything else. A line that cannot be read is an error with its
//! number, never skipped in silence.

use std::borrow::Cow;
use std::net::IpAddr;

use http::{HeaderName, Method};
use serde::Deserialize;

use crate::limit::Identity;

/// What one logged request says, as far as limits read it.
#[derive(Debug, Clone)]
pub struct Record {
    /// The decision's instant, µs since the epoch.
    pub at_us: u64,
    pub ip: IpAddr,
    pub method: Method,
    pub host: Option<String>,
    pub path: String,
    pub query: Option<String>,
    /// Headers the log carries (named columns `header:NAME`).
    pub headers: Vec<(HeaderName, String)>,
    pub status: Option<u16>,
    pub id: Option<String>,
    /// The consumer the route's `auth` verified, as the log names it (its claims are not
    /// logged): what `key: consumer` reads in replay.
    pub identity: Option<Identity>,
    /// What tollgate decided live (its own log only).
    pub live: Option<Live>,
    /// The route that took it live (tollgate's own log).
    pub route: Option<String>,
    /// Each limit's key as the live proxy hashed it (`log.access_keys: true`): what replay
    /// decides on where the log lacks the key's material (a client behind a balancer, a header).
    pub keys: Vec<LoggedKey>,
}

/// One limit's key on a line of tollgate's log: `name|key spec|digest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedKey {
    pub limit: Box<str>,
    /// The key's parts as the config writes them, comma-separated (`route,client_ip`).
    pub spec: Box<str>,
    pub digest: u128,
}

/// The `keys` field: `name|spec|digest` per limit, `;`-separated. A limit name has no `|` or
/// `;`, a digest is 32 hex digits; a spec's parts (a query parameter's name) may hold either.
pub fn logged_keys(text: &str) -> Result<Vec<LoggedKey>, String> {
    let bad = || format!("`keys` is not `name|spec|digest;…`: {text:?}");
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (limit, after) = rest.split_once('|').ok_or_else(bad)?;
        // The digest: the first `|` followed by 32 hex digits and the end or a `;`.
        let b = after.as_bytes();
        let at = (0..b.len())
            .find(|&i| {
                b[i] == b'|'
                    && b.get(i + 1..i + 33).is_some_and(|d| d.iter().all(u8::is_ascii_hexdigit))
                    && matches!(b.get(i + 33), None | Some(b';'))
            })
            .ok_or_else(bad)?;
        let digest = u128::from_str_radix(&after[at + 1..at + 33], 16).map_err(|_| bad())?;
        out.push(LoggedKey { limit: limit.into(), spec: after[..at].into(), digest });
        rest = after.get(at + 34..).unwrap_or("");
    }
    Ok(out)
}

/// A decision as tollgate's access log recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Live {
    Admitted,
    Delayed,
    Throttled,
}

impl std::fmt::Display for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Live::Admitted => "admitted",
            Live::Delayed => "delayed",
            Live::Throttled => "throttled",
        })
    }
}

/// A log format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// tollgate's JSON access log (`log: { format: json, access: true }`).
    Tollgate,
    /// nginx `combined`, optionally with `$msec` as a last field.
    Nginx,
    /// One JSON object a line, fields named by [`Columns`].
    Json(Columns),
    /// CSV with a header row, columns named by [`Columns`].
    Csv(Columns),
}

/// Which source field holds each fact: `ts=time,ip=remote,method=verb,path=uri,...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Columns {
    pub ts: String,
    pub ip: String,
    pub method: String,
    pub path: String,
    pub host: Option<String>,
    pub query: Option<String>,
    pub status: Option<String>,
    pub id: Option<String>,
    pub consumer: Option<String>,
    pub headers: Vec<(HeaderName, String)>,
}

impl Columns {
    /// Parses `--columns`: `fact=source` pairs, comma-separated; facts not named keep
    /// their own name as the source (`ts`, `ip`, `method`, `path`; `host`, `query`,
    /// `status`, `id` only when named).
    ///
    /// # Errors
    /// An unknown fact or a bad header name.
    pub fn parse(spec: &str) -> Result<Columns, String> {
        let mut c = Columns {
            ts: "ts".into(),
            ip: "ip".into(),
            method: "method".into(),
            path: "path".into(),
            host: None,
            query: None,
            status: None,
            id: None,
            consumer: None,
            headers: Vec::new(),
        };
        for pair in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (fact, source) =
                pair.split_once('=').ok_or_else(|| format!("column {pair:?}: expected fact=source"))?;
            let source = source.trim().to_owned();
            match fact.trim() {
                "ts" => c.ts = source,
                "ip" => c.ip = source,
                "method" => c.method = source,
                "path" => c.path = source,
                "host" => c.host = Some(source),
                "query" => c.query = Some(source),
                "status" => c.status = Some(source),
                "id" => c.id = Some(source),
                "consumer" => c.consumer = Some(source),
                other => match other.strip_prefix("header:") {
                    Some(h) => c.headers.push((
                        HeaderName::from_bytes(h.trim().as_bytes()).map_err(|_| format!("bad header name {h:?}"))?,
                        source,
                    )),
                    None => {
                        return Err(format!(
                            "unknown column {other:?}: expected ts, ip, method, path, host, query, status, id, consumer or header:NAME"
                        ))
                    }
                },
            }
        }
        Ok(c)
    }
}

/// What a line gave.
#[derive(Debug)]
pub enum Parsed {
    Request(Box<Record>),
    /// A line of the log that is no request (another target of tollgate's log, a blank line).
    Other,
}

/// A line of tollgate's JSON log. Fields are borrowed where the line has no escapes.
#[derive(Deserialize)]
struct TollgateLine<'a> {
    #[serde(borrow)]
    timestamp: Option<Cow<'a, str>>,
    #[serde(borrow)]
    target: Option<Cow<'a, str>>,
    #[serde(borrow)]
    fields: Option<Fields<'a>>,
}

#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(borrow)]
    peer: Option<Cow<'a, str>>,
    #[serde(borrow)]
    method: Option<Cow<'a, str>>,
    #[serde(borrow)]
    host: Option<Cow<'a, str>>,
    #[serde(borrow)]
    path: Option<Cow<'a, str>>,
    #[serde(borrow)]
    query: Option<Cow<'a, str>>,
    status: Option<u16>,
    #[serde(borrow)]
    error: Option<Cow<'a, str>>,
    delayed_ms: Option<f64>,
    #[serde(borrow)]
    request_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    consumer: Option<Cow<'a, str>>,
    at_us: Option<u64>,
    #[serde(borrow)]
    route: Option<Cow<'a, str>>,
    #[serde(borrow)]
    keys: Option<Cow<'a, str>>,
}

/// Parses one line in `format` (`header`: a CSV file's column names).
///
/// # Errors
/// Why the line is not a request of that format.
pub fn line(format: &Format, text: &str, header: &[String]) -> Result<Parsed, String> {
    let text = text.trim_end_matches(['\r', '\n']);
    if text.trim().is_empty() {
        return Ok(Parsed::Other);
    }
    match format {
        Format::Tollgate => tollgate(text),
        Format::Nginx => nginx(text).map(|r| Parsed::Request(Box::new(r))),
        Format::Json(c) => json(c, text).map(|r| Parsed::Request(Box::new(r))),
        Format::Csv(c) => csv(c, text, header).map(|r| Parsed::Request(Box::new(r))),
    }
}

fn tollgate(text: &str) -> Result<Parsed, String> {
    let l: TollgateLine<'_> = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    if l.target.as_deref() != Some("tollgate::access") {
        return Ok(Parsed::Other);
    }
    let f = l.fields.ok_or("an access line without `fields`")?;
    let at_us = match (f.at_us, l.timestamp.as_deref()) {
        (Some(us), _) => us,
        (None, Some(ts)) => timestamp(ts)?,
        (None, None) => return Err("no timestamp".into()),
    };
    let ip = f.peer.as_deref().ok_or("no `peer`")?.parse().map_err(|_| "`peer` is not an IP address")?;
    let method = method(f.method.as_deref().ok_or("no `method`")?)?;
    let live = match (f.error.as_deref(), f.delayed_ms) {
        (Some("throttled"), _) => Some(Live::Throttled),
        (Some(_), _) => None,
        (None, Some(d)) if d > 0.0 => Some(Live::Delayed),
        (None, _) => Some(Live::Admitted),
    };
    Ok(Parsed::Request(Box::new(Record {
        at_us,
        ip,
        method,
        host: f.host.map(Cow::into_owned),
        path: f.path.ok_or("no `path`")?.into_owned(),
        query: f.query.map(Cow::into_owned),
        headers: Vec::new(),
        status: f.status,
        id: f.request_id.map(Cow::into_owned),
        identity: f.consumer.as_deref().map(identity),
        live,
        route: f.route.map(Cow::into_owned),
        keys: f.keys.as_deref().map(logged_keys).transpose()?.unwrap_or_default(),
    })))
}

/// `203.0.113.7 - - [06/Dec/2026:09:53:55 +0000] "GET /a?b=1 HTTP/1.1" 200 512 "-" "curl/8" [1765014835.123]`
fn nginx(text: &str) -> Result<Record, String> {
    let (ip, rest) = text.split_once(' ').ok_or("no client address")?;
    let ip: IpAddr = ip.parse().map_err(|_| format!("{ip:?} is not an IP address"))?;
    let open = rest.find('[').ok_or("no [time_local]")?;
    let close = rest[open..].find(']').ok_or("no [time_local]")? + open;
    let local = &rest[open + 1..close];
    let rest = &rest[close + 1..];
    let q1 = rest.find('"').ok_or("no \"request\"")?;
    let q2 = rest[q1 + 1..].find('"').ok_or("no \"request\"")? + q1 + 1;
    let request = &rest[q1 + 1..q2];
    let after = rest[q2 + 1..].trim_start();
    let status = after.split(' ').next().and_then(|s| s.parse().ok());
    let mut words = request.split(' ');
    let method = method(words.next().unwrap_or_default())?;
    let target = words.next().ok_or("no request target")?;
    // `$msec` after the last quoted field, if the format appends it.
    let msec = after.rsplit_once('"').map(|(_, t)| t.trim()).filter(|t| !t.is_empty());
    let at_us = match msec {
        Some(m) => number_ts(m.parse::<f64>().map_err(|_| format!("{m:?} is not $msec"))?),
        None => {
            let t =
                jiff::Timestamp::strptime("%d/%b/%Y:%H:%M:%S %z", local).map_err(|e| format!("time {local:?}: {e}"))?;
            micros(t)
        }
    };
    let (path, query) = split_target(target);
    Ok(Record {
        at_us,
        ip,
        method,
        host: None,
        path,
        query,
        headers: Vec::new(),
        status,
        id: None,
        identity: None,
        live: None,
        route: None,
        keys: Vec::new(),
    })
}

fn json(c: &Columns, text: &str) -> Result<Record, String> {
    let v: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|e| format!("not a JSON object: {e}"))?;
    let get = |name: &str| -> Option<String> {
        match v.get(name)? {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Null => None,
            other => Some(other.to_string()),
        }
    };
    columns(c, &get)
}

fn csv(c: &Columns, text: &str, header: &[String]) -> Result<Record, String> {
    let cells = csv_cells(text);
    if cells.len() != header.len() {
        return Err(format!("{} cells where the header names {}", cells.len(), header.len()));
    }
    let get = |name: &str| -> Option<String> {
        let i = header.iter().position(|h| h == name)?;
        Some(cells[i].clone()).filter(|s| !s.is_empty())
    };
    columns(c, &get)
}

/// One CSV row: commas, and `"…"` cells with `""` for a quote.
pub fn csv_cells(text: &str) -> Vec<String> {
    let mut cells = Vec::new();
    let mut cell = String::new();
    let mut quoted = false;
    let mut chars = text.trim_end_matches(['\r', '\n']).chars().peekable();
    while let Some(ch) = chars.next() {
        match (ch, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cell.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => cells.push(std::mem::take(&mut cell)),
            (ch, _) => cell.push(ch),
        }
    }
    cells.push(cell);
    cells
}

/// A record from named fields (JSON lines, CSV).
/// A logged consumer as the identity keys read (no claims: the log has none).
fn identity(consumer: &str) -> Identity {
    Identity { consumer: consumer.into(), claims: Vec::new() }
}

fn columns(c: &Columns, get: &dyn Fn(&str) -> Option<String>) -> Result<Record, String> {
    let need = |name: &str| get(name).ok_or_else(|| format!("no {name:?}"));
    let ts = need(&c.ts)?;
    let at_us = match ts.parse::<f64>() {
        Ok(n) => number_ts(n),
        Err(_) => timestamp(&ts)?,
    };
    let ip = need(&c.ip)?;
    let ip = ip.parse().map_err(|_| format!("{ip:?} is not an IP address"))?;
    let (path, mut query) = split_target(&need(&c.path)?);
    if let Some(q) = c.query.as_deref().and_then(get) {
        query = Some(q);
    }
    let mut headers = Vec::new();
    for (name, source) in &c.headers {
        if let Some(v) = get(source) {
            headers.push((name.clone(), v));
        }
    }
    Ok(Record {
        at_us,
        ip,
        method: method(&need(&c.method)?)?,
        host: c.host.as_deref().and_then(get),
        path,
        query,
        headers,
        status: c.status.as_deref().and_then(get).and_then(|s| s.parse().ok()),
        id: c.id.as_deref().and_then(get),
        identity: c.consumer.as_deref().and_then(get).as_deref().map(identity),
        live: None,
        route: None,
        keys: Vec::new(),
    })
}

fn method(m: &str) -> Result<Method, String> {
    Method::from_bytes(m.as_bytes()).map_err(|_| format!("{m:?} is not a method"))
}

fn split_target(target: &str) -> (String, Option<String>) {
    match target.split_once('?') {
        Some((p, q)) => (p.to_owned(), Some(q.to_owned())),
        None => (target.to_owned(), None),
    }
}

/// An RFC 3339 timestamp, to µs since the epoch.
fn timestamp(ts: &str) -> Result<u64, String> {
    ts.parse::<jiff::Timestamp>().map(micros).map_err(|e| format!("timestamp {ts:?}: {e}"))
}

fn micros(t: jiff::Timestamp) -> u64 {
    u64::try_from(t.as_microsecond()).unwrap_or(0)
}

/// A number read as seconds, ms or µs since the epoch by its size.
fn number_ts(n: f64) -> u64 {
    let us = if n >= 1e14 {
        n
    } else if n >= 1e11 {
        n * 1e3
    } else {
        n * 1e6
    };
    us.round().max(0.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(format: &Format, text: &str) -> Record {
        match line(format, text, &[]).unwrap() {
            Parsed::Request(r) => *r,
            Parsed::Other => panic!("not a request"),
        }
    }

    #[test]
    fn nginx_combined_with_and_without_msec() {
        let l = r#"203.0.113.7 - - [06/Dec/2026:09:53:55 +0100] "GET /a/b?x=1 HTTP/1.1" 429 0 "-" "curl/8.0""#;
        let r = one(&Format::Nginx, l);
        assert_eq!(r.ip.to_string(), "203.0.113.7");
        assert_eq!((r.path.as_str(), r.query.as_deref(), r.status), ("/a/b", Some("x=1"), Some(429)));
        assert_eq!(r.at_us, 1_796_547_235_000_000);
        let r = one(&Format::Nginx, &format!("{l} 1796547235.125"));
        assert_eq!(r.at_us, 1_796_547_235_125_000);
    }

    #[test]
    fn named_columns_in_csv_and_json_lines() {
        let c = Columns::parse("ts=time,ip=remote,method=verb,path=uri,header:x-api-key=key").unwrap();
        let header: Vec<String> = csv_cells("time,remote,verb,uri,key");
        let r = match line(&Format::Csv(c.clone()), r#"1796547235123,10.0.0.1,GET,"/q?a=1",k1"#, &header).unwrap() {
            Parsed::Request(r) => r,
            Parsed::Other => panic!(),
        };
        assert_eq!((r.at_us, r.query.as_deref()), (1_796_547_235_123_000, Some("a=1")));
        assert_eq!(r.headers[0].1, "k1");
        let j = r#"{"time":"2026-12-06T09:53:55.5Z","remote":"::1","verb":"POST","uri":"/x","key":"k2"}"#;
        let r = one(&Format::Json(c), j);
        assert_eq!((r.method, r.ip.to_string(), r.headers[0].1.as_str()), (Method::POST, "::1".into(), "k2"));
        assert!(r.identity.is_none(), "no consumer column named");
        let c = Columns::parse("ts=time,ip=remote,method=verb,path=uri,consumer=user").unwrap();
        let r = one(&Format::Json(c), r#"{"time":1796547235,"remote":"::1","verb":"GET","uri":"/","user":"acme"}"#);
        assert_eq!(r.identity.map(|i| i.consumer), Some("acme".into()));
    }

    #[test]
    fn logged_keys_are_read_whatever_a_spec_holds() {
        let d = "0123456789abcdef0123456789abcdef";
        let text = format!("per-ip|client_ip|{d};odd|route,query:a|b;c|{d}");
        let keys = logged_keys(&text).unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!((&*keys[0].limit, &*keys[0].spec), ("per-ip", "client_ip"));
        assert_eq!((&*keys[1].limit, &*keys[1].spec), ("odd", "route,query:a|b;c"));
        assert_eq!(keys[1].digest, 0x0123456789abcdef0123456789abcdef);
        assert!(logged_keys("per-ip|client_ip|xyz").is_err());
        assert!(logged_keys("").unwrap().is_empty());
    }

    #[test]
    fn a_bad_line_says_why() {
        assert!(line(&Format::Nginx, "nonsense", &[]).is_err());
        assert!(line(&Format::Tollgate, "{not json", &[]).is_err());
        assert!(Columns::parse("colour=red").is_err());
    }
}
