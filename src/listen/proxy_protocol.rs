//! The PROXY protocol (HAProxy's, v1 text and v2 binary) that L4 balancers put in front of a
//! connection to pass the client's address. Read only from trusted peers; exactly the header
//! is consumed (peeked first, so the bytes after it stay in the socket for TLS or HTTP).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::config::ProxyProtocol;

/// v2's fixed signature (the first 12 bytes).
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// A v1 header is at most 107 bytes, CRLF included.
const V1_MAX: usize = 107;
/// Address and TLV bytes of a v2 header accepted at most (TLVs are skipped).
const V2_MAX_LEN: usize = 4096;

/// Why a connection was closed before it was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderRefused {
    /// The listener wants a header and the peer is not in `trusted_proxies`, or an untrusted
    /// peer sent one.
    Untrusted,
    /// A header that is not v1 or v2, or not the version the listener takes.
    Malformed,
    /// The peer closed or the read failed.
    Closed,
}

impl HeaderRefused {
    pub fn as_str(self) -> &'static str {
        match self {
            HeaderRefused::Untrusted => "untrusted",
            HeaderRefused::Malformed => "malformed",
            HeaderRefused::Closed => "closed",
        }
    }
}

enum Seen {
    V1,
    V2,
    None,
}

/// What the first bytes say, once enough of them are there.
async fn sniff(stream: &TcpStream, buf: &mut [u8; V1_MAX]) -> Result<(Seen, usize), HeaderRefused> {
    loop {
        let n = stream.peek(buf).await.map_err(|_| HeaderRefused::Closed)?;
        if n == 0 {
            return Err(HeaderRefused::Closed);
        }
        let b = &buf[..n];
        let v1 = b"PROXY ";
        if b.len() >= v1.len() && b.starts_with(v1) {
            return Ok((Seen::V1, n));
        }
        if b.len() >= V2_SIGNATURE.len() && b.starts_with(&V2_SIGNATURE) {
            return Ok((Seen::V2, n));
        }
        let may_become = |whole: &[u8]| b.len() < whole.len() && whole.starts_with(b);
        if !may_become(v1) && !may_become(&V2_SIGNATURE) {
            return Ok((Seen::None, n));
        }
        // A prefix of either: wait for more (rare: a header comes in one segment).
        stream.readable().await.map_err(|_| HeaderRefused::Closed)?;
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Reads the header `mode` asks for from a `trusted` peer; `Ok(None)`: no header (allowed
/// by `optional`), the socket address stands. The caller bounds it in time.
///
/// # Errors
/// [`HeaderRefused`]: the connection is to be closed.
pub async fn read(
    stream: &mut TcpStream,
    mode: ProxyProtocol,
    trusted: bool,
) -> Result<Option<SocketAddr>, HeaderRefused> {
    let mut buf = [0u8; V1_MAX];
    if !trusted && mode != ProxyProtocol::Optional {
        return Err(HeaderRefused::Untrusted);
    }
    let (seen, n) = sniff(stream, &mut buf).await?;
    match (seen, mode, trusted) {
        (Seen::None, ProxyProtocol::Optional, _) => Ok(None),
        (Seen::V1 | Seen::V2, _, false) => Err(HeaderRefused::Untrusted),
        (Seen::V1, ProxyProtocol::V1 | ProxyProtocol::Optional, true) => v1(stream, &buf[..n]).await,
        (Seen::V2, ProxyProtocol::V2 | ProxyProtocol::Optional, true) => v2(stream).await,
        _ => Err(HeaderRefused::Malformed),
    }
}

async fn v1(stream: &mut TcpStream, peeked: &[u8]) -> Result<Option<SocketAddr>, HeaderRefused> {
    let line = match peeked.windows(2).position(|w| w == b"\r\n") {
        Some(end) => {
            let mut line = vec![0u8; end + 2];
            stream.read_exact(&mut line).await.map_err(|_| HeaderRefused::Closed)?;
            line
        }
        None => {
            // Not all there yet: one byte at a time, so nothing after the header is taken.
            let mut line = Vec::with_capacity(V1_MAX);
            while !line.ends_with(b"\r\n") {
                if line.len() >= V1_MAX {
                    return Err(HeaderRefused::Malformed);
                }
                line.push(stream.read_u8().await.map_err(|_| HeaderRefused::Closed)?);
            }
            line
        }
    };
    parse_v1(&line).ok_or(HeaderRefused::Malformed)
}

/// `PROXY TCP4 src dst sport dport\r\n` (or `TCP6`, or `UNKNOWN …`: the socket address).
pub fn parse_v1(line: &[u8]) -> Option<Option<SocketAddr>> {
    let text = std::str::from_utf8(line.strip_suffix(b"\r\n")?).ok()?;
    let mut parts = text.split(' ');
    if parts.next()? != "PROXY" {
        return None;
    }
    let family = parts.next()?;
    if family == "UNKNOWN" {
        return Some(None);
    }
    let (src, _dst, sport) = (parts.next()?, parts.next()?, parts.next()?);
    let _dport: u16 = parts.next()?.parse().ok()?;
    if parts.next().is_some() {
        return None;
    }
    let ip: IpAddr = match family {
        "TCP4" => IpAddr::V4(src.parse().ok()?),
        "TCP6" => IpAddr::V6(src.parse().ok()?),
        _ => return None,
    };
    Some(Some(SocketAddr::new(ip, sport.parse().ok()?)))
}

async fn v2(stream: &mut TcpStream) -> Result<Option<SocketAddr>, HeaderRefused> {
    let mut head = [0u8; 16];
    stream.read_exact(&mut head).await.map_err(|_| HeaderRefused::Closed)?;
    let len = usize::from(u16::from_be_bytes([head[14], head[15]]));
    if len > V2_MAX_LEN {
        return Err(HeaderRefused::Malformed);
    }
    let mut rest = vec![0u8; len];
    stream.read_exact(&mut rest).await.map_err(|_| HeaderRefused::Closed)?;
    parse_v2(&head, &rest).ok_or(HeaderRefused::Malformed)
}

/// The 16-byte fixed part and the address block of a v2 header.
pub fn parse_v2(head: &[u8; 16], rest: &[u8]) -> Option<Option<SocketAddr>> {
    if head[..12] != V2_SIGNATURE || head[12] >> 4 != 2 {
        return None;
    }
    match head[12] & 0x0f {
        0 => return Some(None), // LOCAL: the balancer's own health check
        1 => {}
        _ => return None,
    }
    match head[13] {
        // TCP or UDP over IPv4
        0x11 | 0x12 if rest.len() >= 12 => {
            let ip = Ipv4Addr::new(rest[0], rest[1], rest[2], rest[3]);
            Some(Some(SocketAddr::new(ip.into(), u16::from_be_bytes([rest[8], rest[9]]))))
        }
        0x21 | 0x22 if rest.len() >= 36 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&rest[..16]);
            Some(Some(SocketAddr::new(Ipv6Addr::from(o).into(), u16::from_be_bytes([rest[32], rest[33]]))))
        }
        // UNSPEC, or a UNIX socket: the socket address stands.
        0x00 | 0x31 | 0x32 => Some(None),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_lines() {
        let a = parse_v1(b"PROXY TCP4 192.0.2.7 10.0.0.1 56324 443\r\n").unwrap().unwrap();
        assert_eq!(a, "192.0.2.7:56324".parse().unwrap());
        let a = parse_v1(b"PROXY TCP6 2001:db8::1 ::1 1 2\r\n").unwrap().unwrap();
        assert_eq!(a.ip(), "2001:db8::1".parse::<IpAddr>().unwrap());
        assert_eq!(parse_v1(b"PROXY UNKNOWN\r\n"), Some(None));
        for bad in [&b"PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n"[..], b"PROXY TCP9 a b 1 2\r\n", b"GET / HTTP/1.1\r\n"] {
            assert_eq!(parse_v1(bad), None);
        }
    }

    #[test]
    fn v2_headers() {
        let mut head = [0u8; 16];
        head[..12].copy_from_slice(&V2_SIGNATURE);
        head[12] = 0x21;
        head[13] = 0x11;
        let rest = [198, 51, 100, 9, 10, 0, 0, 1, 0x30, 0x39, 1, 187];
        assert_eq!(parse_v2(&head, &rest), Some(Some("198.51.100.9:12345".parse().unwrap())));
        head[12] = 0x20;
        assert_eq!(parse_v2(&head, &rest), Some(None));
        head[12] = 0x11;
        assert_eq!(parse_v2(&head, &rest), None);
    }
}
