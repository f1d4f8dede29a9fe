//! What RFC 9114 asks of an HTTP/3 request's head that the `h3` crate lets through: it turns
//! the decoded fields into a `Request` keeping the last of a repeated pseudo-header, ignoring
//! where pseudo-headers stand and any `:status`, and passing connection-specific fields on.
//! Such a request is malformed (§4.1.2), and tollgate refuses it as HTTP/2 does: nothing of it
//! is forwarded.
//!
//! [`pseudo_headers`] reads the order and names of the fields from the encoded field section
//! (QPACK, RFC 9204 §4.5) before `h3` decodes it: names only, with the static table's
//! pseudo-header entries and the HPACK Huffman code (RFC 7541 Appendix B, the same in QPACK).
//! A section that refers to the dynamic table is left to `h3`, whose decoder refuses it
//! (tollgate offers no dynamic table). [`connection_fields`] reads the decoded fields.

use http::header::{self, HeaderMap};

/// The pseudo-headers a request may carry, one bit each; `:status` is a response's.
const AUTHORITY: u8 = 1;
const PATH: u8 = 2;
const METHOD: u8 = 4;
const SCHEME: u8 = 8;
const PROTOCOL: u8 = 16;
const STATUS: u8 = 32;

/// What a field line's name is, as far as the pseudo-header rules care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Name {
    /// A regular field.
    Regular,
    /// A pseudo-header (its bit).
    Pseudo(u8),
    /// A name starting with `:` that RFC 9114 does not define (`h3` refuses it).
    UnknownPseudo,
}

/// The first problem with the pseudo-headers of the encoded field section `section`, if any:
/// one after a regular field (§4.3), one repeated (§4.3.1), or `:status` (§4.3). `None` also
/// when the section is one that `h3` refuses itself (dynamic table references, bad encoding).
pub(super) fn pseudo_headers(section: &[u8]) -> Option<&'static str> {
    let mut r = Reader { buf: section };
    // The prefix: Required Insert Count, then the sign bit and Delta Base (RFC 9204 §4.5.1).
    if r.int(8)? != 0 {
        return None;
    }
    r.int(7)?;
    let (mut seen, mut regular) = (0u8, false);
    while let Some(&first) = r.buf.first() {
        let name = match first {
            // Indexed field line (§4.5.2): `1T` then the index; T = 1 is the static table.
            b if b & 0x80 != 0 => {
                if b & 0x40 == 0 {
                    return None;
                }
                static_name(r.int(6)?)?
            }
            // Literal field line with name reference (§4.5.4): `01NT`, the index, the value.
            b if b & 0x40 != 0 => {
                if b & 0x10 == 0 {
                    return None;
                }
                let name = static_name(r.int(4)?)?;
                r.string(7)?;
                name
            }
            // Literal field line with literal name (§4.5.6): `001NH`, the name, the value.
            b if b & 0x20 != 0 => {
                let name = r.name()?;
                r.string(7)?;
                name
            }
            // Post-base references (§4.5.3, §4.5.5): the dynamic table.
            _ => return None,
        };
        let bit = match name {
            Name::Regular => {
                regular = true;
                continue;
            }
            Name::UnknownPseudo => return None,
            Name::Pseudo(bit) => bit,
        };
        if regular {
            return Some("malformed HTTP/3 request: a pseudo-header field after a regular field");
        }
        if bit == STATUS {
            return Some("malformed HTTP/3 request: `:status`, a response's pseudo-header");
        }
        if seen & bit != 0 {
            return Some("malformed HTTP/3 request: a pseudo-header field repeated");
        }
        seen |= bit;
    }
    None
}

/// The first connection-specific field in `headers` (RFC 9114 §4.2): `Connection`,
/// `Keep-Alive`, `Proxy-Connection`, `Transfer-Encoding`, `Upgrade`, or a `TE` other than
/// `trailers`. HTTP/3 frames messages itself; such a field would mean something else to an
/// HTTP/1.1 upstream.
pub(super) fn connection_fields(headers: &HeaderMap) -> Option<&'static str> {
    if headers.contains_key(header::CONNECTION) {
        return Some("malformed HTTP/3 request: a `Connection` field");
    }
    if headers.contains_key("keep-alive") || headers.contains_key("proxy-connection") {
        return Some("malformed HTTP/3 request: a `Keep-Alive` or `Proxy-Connection` field");
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        return Some("malformed HTTP/3 request: a `Transfer-Encoding` field");
    }
    if headers.contains_key(header::UPGRADE) {
        return Some("malformed HTTP/3 request: an `Upgrade` field");
    }
    if headers.get_all(header::TE).iter().any(|v| !v.as_bytes().eq_ignore_ascii_case(b"trailers")) {
        return Some("malformed HTTP/3 request: a `TE` field other than `trailers`");
    }
    None
}

/// The name of static table entry `index` (RFC 9204 Appendix A); `None` past its end.
fn static_name(index: u64) -> Option<Name> {
    Some(match index {
        0 => Name::Pseudo(AUTHORITY),
        1 => Name::Pseudo(PATH),
        15..=21 => Name::Pseudo(METHOD),
        22 | 23 => Name::Pseudo(SCHEME),
        24..=28 | 63..=71 => Name::Pseudo(STATUS),
        2..=98 => Name::Regular,
        _ => return None,
    })
}

/// The longest pseudo-header name (`:authority`, `:protocol`): a longer name is no such one.
const LONGEST: usize = 10;

fn pseudo(name: &[u8]) -> Name {
    match name {
        b":authority" => Name::Pseudo(AUTHORITY),
        b":path" => Name::Pseudo(PATH),
        b":method" => Name::Pseudo(METHOD),
        b":scheme" => Name::Pseudo(SCHEME),
        b":protocol" => Name::Pseudo(PROTOCOL),
        b":status" => Name::Pseudo(STATUS),
        _ => Name::UnknownPseudo,
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl Reader<'_> {
    /// A prefixed integer (RFC 7541 §5.1) whose first byte keeps its low `bits` bits.
    fn int(&mut self, bits: u32) -> Option<u64> {
        let (&first, rest) = self.buf.split_first()?;
        self.buf = rest;
        let max = (1u64 << bits) - 1;
        let mut value = u64::from(first) & max;
        if value < max {
            return Some(value);
        }
        let mut shift = 0u32;
        loop {
            let (&b, rest) = self.buf.split_first()?;
            self.buf = rest;
            // QUIC's integers end below 2^62: a longer run is malformed.
            if shift > 56 {
                return None;
            }
            value = value.checked_add(u64::from(b & 0x7f) << shift)?;
            shift += 7;
            if b & 0x80 == 0 {
                return Some(value);
            }
        }
    }

    /// A string literal whose first byte keeps the Huffman flag above a `bits`-bit length:
    /// skipped, its bytes returned.
    fn string(&mut self, bits: u32) -> Option<(bool, &[u8])> {
        let huffman = self.buf.first()? & (1 << bits) != 0;
        let len = usize::try_from(self.int(bits)?).ok()?;
        if len > self.buf.len() {
            return None;
        }
        let (bytes, rest) = self.buf.split_at(len);
        self.buf = rest;
        Some((huffman, bytes))
    }

    /// A literal name (§4.5.6: the Huffman flag, then a 3-bit prefix length), as far as it
    /// can be a pseudo-header.
    fn name(&mut self) -> Option<Name> {
        let (huffman, bytes) = self.string(3)?;
        let mut buf = [0u8; LONGEST + 1];
        let name = if huffman {
            let n = huffman_prefix(bytes, &mut buf)?;
            &buf[..n]
        } else {
            &bytes[..bytes.len().min(buf.len())]
        };
        Some(match name.first() {
            Some(b':') if name.len() <= LONGEST => pseudo(name),
            Some(b':') => Name::UnknownPseudo,
            _ => Name::Regular,
        })
    }
}

/// The bit lengths of the HPACK Huffman code's 257 symbols (RFC 7541 Appendix B; the last is
/// EOS). The code is canonical: ordered by length, then by symbol, each code the one after the
/// previous, shifted left by the difference in length. So these lengths are the whole table.
const CODE_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28,
    28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12,
    10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6,
    5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22,
    22, 23, 22, 23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22, 21, 20,
    22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28,
    27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28,
    27, 27, 27, 27, 27, 26, 30,
];

/// The canonical code's decoding table, built once: per length, the first code, how many codes
/// that long, and where their symbols start in `symbols` (sorted by length, then value).
struct Canonical {
    first: [u32; 31],
    count: [u16; 31],
    offset: [u16; 31],
    symbols: [u16; 257],
}

fn canonical() -> &'static Canonical {
    static TABLE: std::sync::OnceLock<Canonical> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut c = Canonical { first: [0; 31], count: [0; 31], offset: [0; 31], symbols: [0; 257] };
        for &len in &CODE_LENGTHS {
            c.count[usize::from(len)] += 1;
        }
        let (mut code, mut at) = (0u32, 0u16);
        for len in 1..31 {
            code = (code + u32::from(c.count[len - 1])) << 1;
            c.first[len] = code;
            c.offset[len] = at;
            at += c.count[len];
        }
        let mut next = c.offset;
        for (symbol, &len) in CODE_LENGTHS.iter().enumerate() {
            let slot = &mut next[usize::from(len)];
            c.symbols[usize::from(*slot)] = u16::try_from(symbol).unwrap_or(256);
            *slot += 1;
        }
        c
    })
}

/// Decodes the Huffman-coded string `bytes` into `out`, stopping once `out` is full: the
/// number of bytes written, or `None` for a code that is not valid (EOS inside the string,
/// padding longer than 7 bits or not all ones).
fn huffman_prefix(bytes: &[u8], out: &mut [u8]) -> Option<usize> {
    let table = canonical();
    let (mut code, mut len, mut n) = (0u32, 0usize, 0usize);
    for &byte in bytes {
        for shift in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> shift) & 1);
            len += 1;
            if len > 30 {
                return None;
            }
            let index = code.wrapping_sub(table.first[len]);
            if code >= table.first[len] && index < u32::from(table.count[len]) {
                let symbol = table.symbols[usize::from(table.offset[len]) + index as usize];
                let byte = u8::try_from(symbol).ok()?;
                out[n] = byte;
                n += 1;
                if n == out.len() {
                    return Some(n);
                }
                (code, len) = (0, 0);
            }
        }
    }
    // What is left is padding: the most significant bits of EOS, all ones, under a byte.
    (len < 8 && code == (1 << len) - 1).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(hex: &str) -> Option<String> {
        let bytes: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        let mut out = [0u8; 64];
        huffman_prefix(&bytes, &mut out).map(|n| String::from_utf8_lossy(&out[..n]).into_owned())
    }

    #[test]
    fn huffman_strings_of_rfc_7541_appendix_c4_decode() {
        assert_eq!(decode("f1e3c2e5f23a6ba0ab90f4ff").as_deref(), Some("www.example.com"));
        assert_eq!(decode("a8eb10649cbf").as_deref(), Some("no-cache"));
        assert_eq!(decode("25a849e95ba97d7f").as_deref(), Some("custom-key"));
        assert_eq!(decode("25a849e95bb8e8b4bf").as_deref(), Some("custom-value"));
        // C.6.1's date and location: long and rare codes.
        assert_eq!(
            decode("d07abe941054d444a8200595040b8166e082a62d1bff").as_deref(),
            Some("Mon, 21 Oct 2013 20:13:21 GMT")
        );
        assert_eq!(decode("9d29ad171863c78f0b97c8e9ae82ae43d3").as_deref(), Some("https://www.example.com"));
        // Padding of a full byte, or padding that is not all ones, is an error.
        assert_eq!(decode("a8eb10649cbfff"), None);
        assert_eq!(decode("a8eb10649cbe"), None);
    }

    /// A field section of `lines`, after a zero prefix.
    fn section(lines: &[&[u8]]) -> Vec<u8> {
        let mut s = vec![0, 0];
        for l in lines {
            s.extend_from_slice(l);
        }
        s
    }

    /// A literal field line with a literal name, not Huffman-coded.
    fn literal(name: &str, value: &str) -> Vec<u8> {
        assert!(name.len() < 7 && value.len() < 127);
        let mut l = vec![0x20 | name.len() as u8];
        l.extend_from_slice(name.as_bytes());
        l.push(value.len() as u8);
        l.extend_from_slice(value.as_bytes());
        l
    }

    // Static entries: 17 `:method GET`, 23 `:scheme https`, 1 `:path /`, 0 `:authority`,
    // 25 `:status 200`, 31 `accept-encoding`.
    const GET: u8 = 0xc0 | 17;
    const HTTPS: u8 = 0xc0 | 23;
    const SLASH: u8 = 0xc0 | 1;
    const STATUS_200: u8 = 0xc0 | 25;
    const ACCEPT_ENCODING: u8 = 0xc0 | 31;
    /// `:authority` by name reference with the value `a`.
    const AUTH_A: &[u8] = &[0x50, 0x01, b'a'];

    #[test]
    fn a_well_formed_head_passes() {
        let s = section(&[&[GET, HTTPS], AUTH_A, &[SLASH, ACCEPT_ENCODING], &literal("x-a", "1")]);
        assert_eq!(pseudo_headers(&s), None);
    }

    #[test]
    fn pseudo_headers_out_of_place_repeated_or_of_a_response_are_found() {
        let after = section(&[&[GET, HTTPS], AUTH_A, &[ACCEPT_ENCODING, SLASH]]);
        assert_eq!(
            pseudo_headers(&after),
            Some("malformed HTTP/3 request: a pseudo-header field after a regular field")
        );
        let twice = section(&[&[GET, HTTPS], AUTH_A, &[SLASH], &literal(":path", "/admin")]);
        assert_eq!(pseudo_headers(&twice), Some("malformed HTTP/3 request: a pseudo-header field repeated"));
        let status = section(&[&[GET, HTTPS], AUTH_A, &[SLASH, STATUS_200]]);
        assert!(pseudo_headers(&status).unwrap().contains(":status"));
        // A Huffman-coded literal `:path` (`b9 58 d3 3f`: `:path` in the HPACK code).
        let hidden = section(&[&[GET, HTTPS, SLASH], AUTH_A, &[0x28 | 4, 0xb9, 0x58, 0xd3, 0x3f, 1, b'/']]);
        assert_eq!(pseudo_headers(&hidden), Some("malformed HTTP/3 request: a pseudo-header field repeated"));
    }

    #[test]
    fn sections_h3_refuses_itself_are_left_to_it() {
        // A Required Insert Count (the dynamic table), a dynamic reference, a cut-off line.
        assert_eq!(pseudo_headers(&[1, 0, GET]), None);
        assert_eq!(pseudo_headers(&section(&[&[0x80 | 2]])), None);
        assert_eq!(pseudo_headers(&section(&[&[0x50, 0x09, b'a']])), None);
        assert_eq!(pseudo_headers(&section(&[&literal(":nope", "1")])), None);
        assert_eq!(pseudo_headers(&[]), None);
    }

    #[test]
    fn connection_specific_fields_are_found() {
        let mut h = HeaderMap::new();
        assert_eq!(connection_fields(&h), None);
        h.insert(header::TE, "trailers".parse().unwrap());
        assert_eq!(connection_fields(&h), None);
        h.append(header::TE, "gzip".parse().unwrap());
        assert!(connection_fields(&h).unwrap().contains("TE"));
        for name in ["connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"] {
            let mut h = HeaderMap::new();
            h.insert(http::HeaderName::from_static(name), "x".parse().unwrap());
            assert!(connection_fields(&h).is_some(), "{name}");
        }
    }
}
