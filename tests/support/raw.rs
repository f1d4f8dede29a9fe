//! Raw-socket helpers for framing tests: an upstream that records the exact bytes of every
//! connection and answers with scripted bytes, a raw client, and a strict parser that accepts
//! only canonical HTTP/1.1 messages (CRLF line ends, `name: value` fields, at most one framing
//! field: one `content-length` of plain digits or one `transfer-encoding: chunked`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// How long a raw read waits before a test calls it a hang. Generous: it only bounds failures.
pub const READ_BOUND: Duration = Duration::from_secs(5);

/// One parsed HTTP/1.1 message.
#[derive(Clone, PartialEq, Eq)]
pub struct Msg {
    /// The request line or status line, without its CRLF.
    pub start: String,
    /// Fields in order, names as sent.
    pub headers: Vec<(String, String)>,
    /// The body, with the chunked coding (if any) removed.
    pub body: Vec<u8>,
    /// The body came chunked.
    pub chunked: bool,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fields: Vec<String> = self.headers.iter().map(|(n, v)| format!("{n}: {v}")).collect();
        write!(
            f,
            "[{} | {} | {:?}{}]",
            self.start,
            fields.join(" | "),
            self.body_str(),
            if self.chunked { " (chunked)" } else { "" }
        )
    }
}

impl Msg {
    /// The values of every field named `name` (case-insensitive).
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str()).collect()
    }

    /// The value of the only field named `name`; panics if there are several.
    pub fn header(&self, name: &str) -> Option<&str> {
        let all = self.all(name);
        assert!(all.len() <= 1, "{name} appears {} times in {self:?}", all.len());
        all.first().copied()
    }

    /// The status code of a response.
    pub fn status(&self) -> u16 {
        self.start.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0)
    }

    pub fn body_str(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// What kind of message is being read, for the body-length rules of RFC 9112 §6.3.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Request,
    /// A response; `head`: it answers a HEAD request.
    Response {
        head: bool,
    },
}

/// A message parsed from the front of a buffer, or the need for more bytes.
#[derive(Debug)]
pub enum Parsed {
    /// The message and how many bytes it took.
    Complete(Msg, usize),
    Partial,
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Parses one canonical message from the front of `buf`; `eof`: no more bytes will come (a
/// response without length then ends here). Anything not canonical is an error naming why.
pub fn parse(buf: &[u8], kind: Kind, eof: bool) -> Result<Parsed, String> {
    let end = match buf.windows(4).position(|w| w == b"\r\n\r\n") {
        Some(i) => i,
        None => {
            check_line_ends(buf)?;
            if eof && !buf.is_empty() {
                return Err(format!("connection ended inside a head: {:?}", String::from_utf8_lossy(buf)));
            }
            return Ok(Parsed::Partial);
        }
    };
    let head = &buf[..end];
    check_line_ends(head)?;
    let head = std::str::from_utf8(head).map_err(|_| "head is not UTF-8".to_owned())?;
    let mut lines = head.split("\r\n");
    let start = lines.next().unwrap_or_default().to_owned();
    check_start(&start, kind)?;
    let mut headers = Vec::new();
    for line in lines {
        let (name, value) = line.split_once(": ").ok_or_else(|| format!("field without `: `: {line:?}"))?;
        if name.is_empty() || !name.bytes().all(is_tchar) {
            return Err(format!("bad field name {name:?}"));
        }
        if value.starts_with([' ', '\t']) || value.ends_with([' ', '\t']) {
            return Err(format!("field {name} has padding: {value:?}"));
        }
        if value.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f) {
            return Err(format!("field {name} has a control byte: {value:?}"));
        }
        headers.push((name.to_owned(), value.to_owned()));
    }
    let mut msg = Msg { start, headers, body: Vec::new(), chunked: false };
    let cl = msg.all("content-length");
    let te = msg.all("transfer-encoding");
    if cl.len() > 1 {
        return Err(format!("{} content-length fields: {cl:?}", cl.len()));
    }
    if te.len() > 1 {
        return Err(format!("{} transfer-encoding fields: {te:?}", te.len()));
    }
    if !cl.is_empty() && !te.is_empty() {
        return Err("both content-length and transfer-encoding".to_owned());
    }
    if let Some(te) = te.first() {
        if *te != "chunked" {
            return Err(format!("transfer-encoding is not exactly `chunked`: {te:?}"));
        }
    }
    let length = match cl.first() {
        Some(v) => {
            let canonical =
                !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) && (*v == "0" || !v.starts_with('0'));
            if !canonical {
                return Err(format!("content-length is not canonical digits: {v:?}"));
            }
            Some(v.parse::<usize>().map_err(|e| format!("content-length {v}: {e}"))?)
        }
        None => None,
    };
    let chunked = !te.is_empty();
    let at = end + 4;
    let no_body = match kind {
        Kind::Request => !chunked && length.is_none(),
        Kind::Response { head } => {
            let status = msg.status();
            head || (100..200).contains(&status) || status == 204 || status == 304
        }
    };
    if no_body {
        return Ok(Parsed::Complete(msg, at));
    }
    if chunked {
        msg.chunked = true;
        return Ok(match parse_chunks(&buf[at..])? {
            Some((body, used)) => {
                msg.body = body;
                Parsed::Complete(msg, at + used)
            }
            None if eof => return Err("connection ended inside a chunked body".to_owned()),
            None => Parsed::Partial,
        });
    }
    match length {
        Some(n) if buf.len() - at >= n => {
            msg.body = buf[at..at + n].to_vec();
            Ok(Parsed::Complete(msg, at + n))
        }
        Some(n) if eof => Err(format!("connection ended {} bytes into a {n}-byte body", buf.len() - at)),
        Some(_) => Ok(Parsed::Partial),
        // A response without length runs to the end of the connection.
        None if eof => {
            msg.body = buf[at..].to_vec();
            Ok(Parsed::Complete(msg, buf.len()))
        }
        None => Ok(Parsed::Partial),
    }
}

/// Every `\n` is preceded by `\r` and every `\r` followed by `\n`.
fn check_line_ends(head: &[u8]) -> Result<(), String> {
    for (i, &b) in head.iter().enumerate() {
        let bad = match b {
            b'\n' => i == 0 || head[i - 1] != b'\r',
            b'\r' => head.get(i + 1).is_some_and(|&n| n != b'\n'),
            0 => true,
            _ => false,
        };
        if bad {
            return Err(format!("bare CR, bare LF or NUL at byte {i}: {:?}", String::from_utf8_lossy(head)));
        }
    }
    Ok(())
}

fn check_start(start: &str, kind: Kind) -> Result<(), String> {
    let parts: Vec<&str> = start.split(' ').collect();
    let ok = match kind {
        Kind::Request => {
            parts.len() == 3
                && !parts[0].is_empty()
                && parts[0].bytes().all(is_tchar)
                && !parts[1].is_empty()
                && parts[2] == "HTTP/1.1"
        }
        Kind::Response { .. } => {
            parts.len() >= 2
                && (parts[0] == "HTTP/1.1" || parts[0] == "HTTP/1.0")
                && parts[1].len() == 3
                && parts[1].bytes().all(|b| b.is_ascii_digit())
        }
    };
    if ok {
        Ok(())
    } else {
        Err(format!("not a canonical start line: {start:?}"))
    }
}

/// A strict chunked body: hex sizes without extensions, CRLF after each chunk, no trailers.
/// `None` until the last chunk and the final CRLF are in `buf`.
fn parse_chunks(buf: &[u8]) -> Result<Option<(Vec<u8>, usize)>, String> {
    let mut body = Vec::new();
    let mut at = 0;
    loop {
        let Some(eol) = buf[at..].windows(2).position(|w| w == b"\r\n") else { return Ok(None) };
        let line = &buf[at..at + eol];
        if line.is_empty() || line.len() > 16 || !line.iter().all(u8::is_ascii_hexdigit) {
            return Err(format!("not a canonical chunk size line: {:?}", String::from_utf8_lossy(line)));
        }
        let size = usize::from_str_radix(std::str::from_utf8(line).unwrap_or("x"), 16).map_err(|e| e.to_string())?;
        at += eol + 2;
        if size == 0 {
            return Ok(match buf.get(at..at + 2) {
                Some(b"\r\n") => Some((body, at + 2)),
                Some(_) => return Err("trailers or garbage after the last chunk".to_owned()),
                None => None,
            });
        }
        if buf.len() < at + size + 2 {
            return Ok(None);
        }
        body.extend_from_slice(&buf[at..at + size]);
        if &buf[at + size..at + size + 2] != b"\r\n" {
            return Err("chunk data not followed by CRLF".to_owned());
        }
        at += size + 2;
    }
}

/// The complete messages on one connection and the unfinished bytes after them.
pub type Received = (Vec<Msg>, Vec<u8>);

/// Parses all of `bytes` as canonical messages of one kind; the remainder (an unfinished
/// message) is returned as is.
pub fn parse_all(mut bytes: &[u8], kind: Kind) -> Result<Received, String> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        match parse(bytes, kind, false)? {
            Parsed::Complete(msg, used) => {
                out.push(msg);
                bytes = &bytes[used..];
            }
            Parsed::Partial => break,
        }
    }
    Ok((out, bytes.to_vec()))
}

/// What a scripted upstream does after writing its reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Then {
    /// Wait for the next request on this connection.
    KeepAlive,
    /// Close the connection.
    Close,
    /// Keep the connection open and silent (still recording what arrives).
    Hang,
}

/// The scripted answer to one request.
pub struct Reply {
    pub bytes: Vec<u8>,
    pub then: Then,
}

impl Reply {
    pub fn new(bytes: impl Into<Vec<u8>>, then: Then) -> Reply {
        Reply { bytes: bytes.into(), then }
    }

    /// A canonical `200` whose body is the request's method and target, so a client can tell
    /// its own answer from anyone else's.
    pub fn echo(req: &Msg) -> Reply {
        let body = echo_body(req);
        Reply::new(format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len()), Then::KeepAlive)
    }
}

/// `METHOD target` of a request line: the body of [`Reply::echo`].
pub fn echo_body(req: &Msg) -> String {
    req.start.rsplit_once(' ').map_or(req.start.as_str(), |(line, _)| line).to_owned()
}

/// The request a scripted upstream is answering.
pub struct Hit<'a> {
    /// Which connection, counted from 0 in accept order.
    pub conn: usize,
    /// Which request on that connection, from 0.
    pub nth: usize,
    pub req: &'a Msg,
}

type Script = Arc<dyn Fn(Hit<'_>) -> Reply + Send + Sync>;

/// What one connection to a [`RawUpstream`] carried.
#[derive(Clone, Debug, Default)]
pub struct ConnLog {
    /// Every byte received, exactly.
    pub bytes: Vec<u8>,
    /// The peer closed it (or it broke), or the script closed it.
    pub closed: bool,
}

/// An HTTP/1.1 upstream on raw sockets. It parses requests strictly (a non-canonical request
/// is recorded and never answered), answers each with its script, and records every byte.
pub struct RawUpstream {
    pub addr: SocketAddr,
    log: Arc<Mutex<Vec<ConnLog>>>,
    task: JoinHandle<()>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl RawUpstream {
    /// Answers every request with [`Reply::echo`].
    pub async fn echo() -> RawUpstream {
        RawUpstream::start(|hit| Reply::echo(hit.req)).await
    }

    pub async fn start(script: impl Fn(Hit<'_>) -> Reply + Send + Sync + 'static) -> RawUpstream {
        let script: Script = Arc::new(script);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let log: Arc<Mutex<Vec<ConnLog>>> = Arc::default();
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (log2, conns2) = (log.clone(), conns.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let idx = {
                    let mut log = log2.lock().unwrap();
                    log.push(ConnLog::default());
                    log.len() - 1
                };
                let task = tokio::spawn(serve_raw(stream, idx, log2.clone(), script.clone()));
                conns2.lock().unwrap().push(task);
            }
        });
        RawUpstream { addr, log, task, conns }
    }

    /// What every connection carried so far, in accept order.
    pub fn conns(&self) -> Vec<ConnLog> {
        self.log.lock().unwrap().clone()
    }

    pub fn connections(&self) -> usize {
        self.log.lock().unwrap().len()
    }

    /// Every complete request received, connection by connection, each parsed strictly:
    /// `Err` names the first non-canonical byte sequence. An unfinished request at the end of
    /// a connection is returned as the remainder.
    pub fn requests(&self) -> Result<Vec<Received>, String> {
        self.conns().iter().map(|c| parse_all(&c.bytes, Kind::Request)).collect()
    }

    /// Waits until `n` complete requests arrived in all (or the bound passes), then returns them
    /// flattened in connection order.
    pub async fn wait_requests(&self, n: usize) -> Result<Vec<Msg>, String> {
        let deadline = tokio::time::Instant::now() + READ_BOUND;
        loop {
            let all: Vec<Msg> = self.requests()?.into_iter().flat_map(|(m, _)| m).collect();
            if all.len() >= n || tokio::time::Instant::now() >= deadline {
                return Ok(all);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

async fn serve_raw(mut stream: TcpStream, idx: usize, log: Arc<Mutex<Vec<ConnLog>>>, script: Script) {
    let mut pending = Vec::new();
    let mut nth = 0;
    let mut silent = false;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = stream.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            log.lock().unwrap()[idx].closed = true;
            return;
        }
        log.lock().unwrap()[idx].bytes.extend_from_slice(&buf[..n]);
        if silent {
            continue;
        }
        pending.extend_from_slice(&buf[..n]);
        loop {
            match parse(&pending, Kind::Request, false) {
                Ok(Parsed::Complete(req, used)) => {
                    pending.drain(..used);
                    let reply = script(Hit { conn: idx, nth, req: &req });
                    nth += 1;
                    let _ = stream.write_all(&reply.bytes).await;
                    match reply.then {
                        Then::KeepAlive => {}
                        Then::Close => {
                            log.lock().unwrap()[idx].closed = true;
                            return;
                        }
                        Then::Hang => {
                            silent = true;
                            break;
                        }
                    }
                }
                Ok(Parsed::Partial) => break,
                // Not canonical: recorded, never answered; the test reads the bytes.
                Err(_) => {
                    silent = true;
                    break;
                }
            }
        }
    }
}

/// How a raw client's read ended without a message.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// The connection was closed (FIN or reset) with nothing unread.
    Closed,
    /// Nothing within [`READ_BOUND`].
    Silent,
    /// Bytes that are not a canonical message (or a message cut off by the close).
    Garbage(String),
}

/// A client on a raw socket.
pub struct RawClient {
    stream: TcpStream,
    buf: Vec<u8>,
    eof: bool,
}

impl RawClient {
    pub async fn connect(addr: SocketAddr) -> RawClient {
        RawClient { stream: TcpStream::connect(addr).await.unwrap(), buf: Vec::new(), eof: false }
    }

    /// Writes `bytes`; a peer that already closed is not an error here (the reads tell).
    pub async fn send(&mut self, bytes: &[u8]) {
        let _ = self.stream.write_all(bytes).await;
    }

    /// Reads more bytes; false once the connection ended.
    async fn fill(&mut self, bound: Duration) -> Result<bool, End> {
        if self.eof {
            return Ok(false);
        }
        let mut chunk = [0u8; 16 * 1024];
        match tokio::time::timeout(bound, self.stream.read(&mut chunk)).await {
            Err(_) => Err(End::Silent),
            Ok(Ok(0) | Err(_)) => {
                self.eof = true;
                Ok(false)
            }
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(true)
            }
        }
    }

    /// The next response (an interim `1xx` too), parsed strictly.
    pub async fn response(&mut self, head: bool) -> Result<Msg, End> {
        loop {
            match parse(&self.buf, Kind::Response { head }, self.eof) {
                Ok(Parsed::Complete(msg, used)) => {
                    self.buf.drain(..used);
                    return Ok(msg);
                }
                Ok(Parsed::Partial) if self.eof && self.buf.is_empty() => return Err(End::Closed),
                Ok(Parsed::Partial) => {}
                Err(e) => return Err(End::Garbage(format!("{e}; bytes: {:?}", String::from_utf8_lossy(&self.buf)))),
            }
            self.fill(READ_BOUND).await?;
        }
    }

    /// The next final response, skipping interim ones.
    pub async fn final_response(&mut self, head: bool) -> Result<Msg, End> {
        loop {
            let msg = self.response(head).await?;
            if !(100..200).contains(&msg.status()) {
                return Ok(msg);
            }
        }
    }

    /// Waits for the connection to end; `Err` if bytes arrive or it stays open.
    pub async fn closed(&mut self) -> Result<(), End> {
        while self.fill(READ_BOUND).await? {}
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(End::Garbage(String::from_utf8_lossy(&self.buf).into_owned()))
        }
    }

    /// Whether the connection is still open: true when nothing arrives within `quiet`.
    pub async fn open_after(&mut self, quiet: Duration) -> bool {
        matches!(self.fill(quiet).await, Err(End::Silent))
    }
}

/// A canonical `GET` with `Host: x`, for follow-up requests on a connection.
pub fn get_request(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").into_bytes()
}

/// Runs every case of a corpus at once and fails with the list of cases that failed.
pub async fn run_corpus<'a, C, F, Fut>(cases: &'a [C], name: fn(&C) -> &'static str, run: F)
where
    F: Fn(&'a C) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let results = futures_util::future::join_all(cases.iter().map(|c| {
        let run = &run;
        async move { (name(c), run(c).await) }
    }))
    .await;
    let failed: Vec<String> =
        results.into_iter().filter_map(|(name, r)| r.err().map(|e| format!("{name}: {e}"))).collect();
    assert!(failed.is_empty(), "{} of {} cases failed:\n{}", failed.len(), cases.len(), failed.join("\n"));
}
