//! HTTP/2 written to hurt, in raw frames: rapid reset, CONTINUATION flood, HPACK bomb,
//! SETTINGS and PING floods, more streams than allowed, window overflows. Each attack ends
//! its own connection (with the GOAWAY code RFC 9113 asks for, where it asks) while another
//! client keeps being served, and the proxy's memory stays bounded (the proxy runs in a
//! process of its own, where nothing else counts).

use std::time::Duration;

use tokio::io::AsyncWriteExt;

use crate::support::process::Process;

use raw::{frame, Ending, Raw};

/// Frames written by hand over a `TcpStream`; `h2`'s client would refuse to send most of
/// these.
pub mod raw {
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    pub const HEADERS: u8 = 1;
    pub const RST_STREAM: u8 = 3;
    pub const SETTINGS: u8 = 4;
    pub const PING: u8 = 6;
    pub const GOAWAY: u8 = 7;
    pub const WINDOW_UPDATE: u8 = 8;
    pub const CONTINUATION: u8 = 9;

    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;

    pub const NO_ERROR: u32 = 0;
    pub const FLOW_CONTROL_ERROR: u32 = 3;
    pub const REFUSED_STREAM: u32 = 7;
    pub const CANCEL: u32 = 8;
    pub const ENHANCE_YOUR_CALM: u32 = 11;

    pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len()).unwrap();
        assert!(len < 1 << 24);
        let mut f = Vec::with_capacity(9 + payload.len());
        f.extend_from_slice(&len.to_be_bytes()[1..]);
        f.push(kind);
        f.push(flags);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// HPACK for `GET http://localhost{path}`, no Huffman, nothing indexed.
    pub fn request_block(path: &str) -> Vec<u8> {
        let mut b = vec![0x82, 0x86]; // :method GET, :scheme http (static table)
        b.push(0x04); // :path, literal without indexing, name from the static table
        b.push(u8::try_from(path.len()).unwrap());
        b.extend_from_slice(path.as_bytes());
        b.push(0x01); // :authority, likewise
        b.push(9);
        b.extend_from_slice(b"localhost");
        b
    }

    pub struct Frame {
        pub kind: u8,
        pub flags: u8,
        pub stream: u32,
        pub payload: Vec<u8>,
    }

    #[derive(Debug, PartialEq, Eq)]
    pub enum Ending {
        /// GOAWAY with this error code.
        GoAway(u32),
        /// Closed without a GOAWAY.
        Closed,
        /// Still open at the deadline.
        Open,
    }

    pub struct Raw {
        pub s: TcpStream,
        buf: Vec<u8>,
        /// ACK the server's PINGs (and SETTINGS) while reading.
        pub answer_pings: bool,
        pub pings_seen: usize,
        /// (stream, error code) of every RST_STREAM read.
        pub resets: Vec<(u32, u32)>,
        /// Streams whose response HEADERS were read.
        pub answered: Vec<u32>,
    }

    impl Raw {
        /// Connects and sends the preface and an empty SETTINGS frame.
        pub async fn connect(addr: SocketAddr) -> Raw {
            let s = TcpStream::connect(addr).await.unwrap();
            Raw::on(s).await
        }

        pub async fn on(mut s: TcpStream) -> Raw {
            s.write_all(PREFACE).await.unwrap();
            s.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
            Raw { s, buf: Vec::new(), answer_pings: true, pings_seen: 0, resets: Vec::new(), answered: Vec::new() }
        }

        /// Writes `bytes`; the server may have closed already, which is not an error here.
        pub async fn send(&mut self, bytes: &[u8]) -> bool {
            self.s.write_all(bytes).await.is_ok()
        }

        /// The next frame, or None once the connection is closed or `deadline` passed
        /// (`Err(())`).
        pub async fn next(&mut self, deadline: Instant) -> Result<Option<Frame>, ()> {
            loop {
                if self.buf.len() >= 9 {
                    let len = usize::from(self.buf[0]) << 16 | usize::from(self.buf[1]) << 8 | usize::from(self.buf[2]);
                    if self.buf.len() >= 9 + len {
                        let f = Frame {
                            kind: self.buf[3],
                            flags: self.buf[4],
                            stream: u32::from_be_bytes(self.buf[5..9].try_into().unwrap()) & 0x7fff_ffff,
                            payload: self.buf[9..9 + len].to_vec(),
                        };
                        self.buf.drain(..9 + len);
                        return Ok(Some(f));
                    }
                }
                let mut chunk = [0u8; 16 * 1024];
                match tokio::time::timeout_at(deadline.into(), self.s.read(&mut chunk)).await {
                    Err(_) => return Err(()),
                    Ok(Ok(0) | Err(_)) => return Ok(None),
                    Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
                }
            }
        }

        /// Reads until the connection ends, answering as a client would; returns how.
        pub async fn ending(&mut self, within: Duration) -> Ending {
            let deadline = Instant::now() + within;
            let mut goaway = None;
            loop {
                let f = match self.next(deadline).await {
                    Err(()) => return Ending::Open,
                    Ok(None) => return goaway.map_or(Ending::Closed, Ending::GoAway),
                    Ok(Some(f)) => f,
                };
                match f.kind {
                    GOAWAY => {
                        let code = u32::from_be_bytes(f.payload[4..8].try_into().unwrap());
                        // A graceful GOAWAY (NO_ERROR) may precede the final one.
                        if goaway.is_none() || code != NO_ERROR {
                            goaway = Some(code);
                        }
                    }
                    PING if f.flags & ACK == 0 => {
                        self.pings_seen += 1;
                        if self.answer_pings {
                            let _ = self.send(&frame(PING, ACK, 0, &f.payload)).await;
                        }
                    }
                    SETTINGS if f.flags & ACK == 0 && self.answer_pings => {
                        let _ = self.send(&frame(SETTINGS, ACK, 0, &[])).await;
                    }
                    RST_STREAM => {
                        let code = u32::from_be_bytes(f.payload[..4].try_into().unwrap());
                        self.resets.push((f.stream, code));
                    }
                    HEADERS => self.answered.push(f.stream),
                    _ => {}
                }
            }
        }
    }
}

/// How far above its resident memory before an attack the proxy's may peak during it. The
/// proxy runs in a process of its own, where no other test's memory counts: the attacks
/// here peak 10-160 KiB above it.
const PEAK_BOUND_KIB: u64 = 8 << 10;

const CONFIG: &str = "upstreams: { d: { respond: { body: ok } }, slow: { respond: { body: late, latency: 5s } } }\nroutes:\n  - { match: { path_prefix: /slow }, upstream: slow }\n  - { upstream: d }\n";

fn config(server: &str) -> String {
    format!("server: {{ {server} }}\n{CONFIG}")
}

/// Another client is served, over HTTP/1.1 and h2c, within a generous bound.
async fn others_are_served(addr: std::net::SocketAddr) {
    let h1 = tokio::time::timeout(Duration::from_secs(5), crate::support::get(addr, "/")).await;
    assert!(matches!(&h1, Ok((s, _, b)) if s.is_success() && b == "ok"), "HTTP/1.1 client not served: {h1:?}");
    let h2 = tokio::time::timeout(Duration::from_secs(5), async {
        let mut send = crate::support::h2(addr).await;
        let req = http::Request::get("http://x/").body(crate::support::full("")).unwrap();
        let resp = send.send_request(req).await.unwrap();
        http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes()
    })
    .await;
    assert!(matches!(&h2, Ok(b) if b == "ok"), "h2c client not served: {h2:?}");
}

/// Starts the proxy in a process of its own with `server` settings, and serves one client
/// over HTTP/1.1 and h2c (what their first use allocates is not the attack's).
async fn proxy(server: &str) -> Process {
    let tg = Process::start(&config(server)).await;
    others_are_served(tg.addr).await;
    tg
}

/// Runs `attack` on one connection while other clients are served, and checks that the
/// proxy's memory stayed bounded throughout.
async fn survive<T: Send + 'static>(tg: &Process, attack: impl std::future::Future<Output = T> + Send + 'static) -> T {
    let before = tg.start_peak_rss();
    let attack = tokio::spawn(attack);
    tokio::time::sleep(Duration::from_millis(100)).await;
    others_are_served(tg.addr).await;
    let ending = tokio::time::timeout(Duration::from_secs(20), attack).await.expect("the attack ended").unwrap();
    others_are_served(tg.addr).await;
    let peak = tg.peak_rss_kib().saturating_sub(before);
    eprintln!("the proxy's RSS peaked {peak} KiB above its {before} KiB before the attack");
    assert!(peak < PEAK_BOUND_KIB, "the proxy's RSS peaked {} MiB above its start", peak >> 10);
    ending
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_gets_enhance_your_calm() {
    let tg = proxy("").await;
    let addr = tg.addr;
    let ending = survive(&tg, async move {
        let mut c = Raw::connect(addr).await;
        let block = raw::request_block("/slow");
        let mut burst = Vec::new();
        for i in 0..5_000u32 {
            let id = 2 * i + 1;
            burst.extend(frame(raw::HEADERS, raw::END_HEADERS | raw::END_STREAM, id, &block));
            burst.extend(frame(raw::RST_STREAM, 0, id, &raw::CANCEL.to_be_bytes()));
        }
        c.send(&burst).await;
        c.ending(Duration::from_secs(10)).await
    })
    .await;
    assert_eq!(ending, Ending::GoAway(raw::ENHANCE_YOUR_CALM));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_flood_gets_goaway() {
    let tg = proxy("").await;
    let addr = tg.addr;
    let ending = survive(&tg, async move {
        let mut c = Raw::connect(addr).await;
        // A head that never ends: HEADERS without END_HEADERS, then CONTINUATIONs of
        // small valid fields, none with END_HEADERS.
        let mut flood = frame(raw::HEADERS, raw::END_STREAM, 1, &raw::request_block("/"));
        let field = [0x00, 0x01, b'x', 0x01, b'y']; // x: y, literal without indexing
        for _ in 0..100_000 {
            flood.extend(frame(raw::CONTINUATION, 0, 1, &field));
        }
        c.send(&flood).await;
        c.ending(Duration::from_secs(10)).await
    })
    .await;
    assert_eq!(ending, Ending::GoAway(raw::ENHANCE_YOUR_CALM));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hpack_bomb_gets_goaway() {
    let tg = proxy("").await;
    let addr = tg.addr;
    let ending = survive(&tg, async move {
        let mut c = Raw::connect(addr).await;
        // One 4000-byte field into the dynamic table, then 12,000 one-byte references to
        // it: 12 KiB on the wire, 48 MB decoded.
        let mut block = raw::request_block("/");
        block.extend([0x40, 0x01, b'x', 0x7f]); // literal with incremental indexing, new name `x`
        let mut rest = 4000 - 127;
        while rest >= 128 {
            block.push(u8::try_from(rest % 128).unwrap() | 0x80);
            rest /= 128;
        }
        block.push(u8::try_from(rest).unwrap());
        block.extend(std::iter::repeat_n(b'a', 4000));
        block.extend(std::iter::repeat_n(0xbe, 12_000)); // indexed: the first dynamic entry (62)
        c.send(&frame(raw::HEADERS, raw::END_HEADERS | raw::END_STREAM, 1, &block)).await;
        c.ending(Duration::from_secs(10)).await
    })
    .await;
    assert_eq!(ending, Ending::GoAway(raw::ENHANCE_YOUR_CALM));
}

/// Floods `unit` frames without reading a byte of the answers; returns once a write fails
/// (the server closed the connection) or after `within`.
async fn flood_without_reading(addr: std::net::SocketAddr, unit: Vec<u8>, within: Duration) -> Ending {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    // A small window of our own, so the server's answers back up sooner.
    socket.set_recv_buffer_size(4096).unwrap();
    let s = socket.connect(addr).await.unwrap();
    let mut c = Raw::on(s).await;
    let chunk: Vec<u8> = unit.iter().copied().cycle().take(unit.len() * (64 * 1024 / unit.len())).collect();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, c.s.write_all(&chunk)).await {
            Err(_) => return Ending::Open,
            Ok(Err(_)) => return Ending::Closed,
            Ok(Ok(())) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settings_flood_that_reads_no_acks_is_closed() {
    let tg = proxy("send_timeout: 1s").await;
    let addr = tg.addr;
    let ending =
        survive(&tg, flood_without_reading(addr, frame(raw::SETTINGS, 0, 0, &[]), Duration::from_secs(15))).await;
    assert_eq!(ending, Ending::Closed, "a SETTINGS flood kept its connection");
    assert!(tg.metric("tollgate_connection_timeouts_total{kind=\"send\"}").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ping_flood_that_reads_no_acks_is_closed() {
    let tg = proxy("send_timeout: 1s").await;
    let addr = tg.addr;
    let ending =
        survive(&tg, flood_without_reading(addr, frame(raw::PING, 0, 0, &[7; 8]), Duration::from_secs(15))).await;
    assert_eq!(ending, Ending::Closed, "a PING flood kept its connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_the_limit_are_refused_and_then_the_connection() {
    let tg = proxy("h2: { max_concurrent_streams: 4, max_local_error_reset_streams: 20 }").await;
    let addr = tg.addr;
    let (ending, resets, answered) = {
        let attack = async move {
            let mut c = Raw::connect(addr).await;
            let block = raw::request_block("/slow");
            let mut burst = Vec::new();
            for i in 0..40u32 {
                burst.extend(frame(raw::HEADERS, raw::END_HEADERS | raw::END_STREAM, 2 * i + 1, &block));
            }
            c.send(&burst).await;
            let ending = c.ending(Duration::from_secs(10)).await;
            (ending, c.resets, c.answered)
        };
        survive(&tg, attack).await
    };
    let refused = resets.iter().filter(|(_, code)| *code == raw::REFUSED_STREAM).count();
    assert!(refused >= 10, "only {refused} streams refused: {resets:?}");
    assert!(resets.iter().all(|(id, _)| *id > 7), "an admitted stream was reset: {resets:?}");
    assert!(answered.iter().all(|id| *id <= 7), "a stream past the limit was served: {answered:?}");
    assert_eq!(ending, Ending::GoAway(raw::ENHANCE_YOUR_CALM));
    others_are_served(tg.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_update_overflow_is_a_flow_control_error() {
    let tg = proxy("").await;
    let addr = tg.addr;
    // The connection window: 65,535 + 2^31-1 overflows; a connection error (RFC 9113 §6.9.1).
    let ending = survive(&tg, async move {
        let mut c = Raw::connect(addr).await;
        c.send(&frame(raw::WINDOW_UPDATE, 0, 0, &0x7fff_ffffu32.to_be_bytes())).await;
        c.ending(Duration::from_secs(10)).await
    })
    .await;
    assert_eq!(ending, Ending::GoAway(raw::FLOW_CONTROL_ERROR));
    // A stream's window: a stream error; the connection serves on.
    let mut c = Raw::connect(addr).await;
    c.send(&frame(raw::HEADERS, raw::END_HEADERS | raw::END_STREAM, 1, &raw::request_block("/slow"))).await;
    c.send(&frame(raw::WINDOW_UPDATE, 0, 1, &0x7fff_ffffu32.to_be_bytes())).await;
    c.send(&frame(raw::HEADERS, raw::END_HEADERS | raw::END_STREAM, 3, &raw::request_block("/"))).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !(c.resets.contains(&(1, raw::FLOW_CONTROL_ERROR)) && c.answered.contains(&3)) {
        let f = c.next(deadline).await.expect("answers within 10 s").expect("the connection stays open");
        match f.kind {
            raw::RST_STREAM => c.resets.push((f.stream, u32::from_be_bytes(f.payload[..4].try_into().unwrap()))),
            raw::HEADERS => c.answered.push(f.stream),
            raw::SETTINGS if f.flags & raw::ACK == 0 => {
                c.send(&frame(raw::SETTINGS, raw::ACK, 0, &[])).await;
            }
            raw::GOAWAY => panic!("a stream's window overflow closed the connection"),
            _ => {}
        }
    }
}
