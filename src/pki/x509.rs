//! The few facts tollgate reads from a certificate: its validity period, its DNS names
//! (SAN, else the subject's CN) and a short identity for `key: tls_client`. A minimal DER
//! walk over the fixed shape of RFC 5280's TBSCertificate; every read is bounds-checked and
//! anything unexpected is `None`, never a panic. Signatures are rustls' business, not ours.

/// What a certificate says about itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// Seconds since the unix epoch.
    pub not_before: i64,
    pub not_after: i64,
    /// DNS names of the subjectAltName extension, lower-case.
    pub dns_names: Vec<String>,
    /// Other SAN entries (email, URI, IP) in text form.
    pub other_names: Vec<String>,
    /// The subject's commonName, if any.
    pub common_name: Option<String>,
    /// The serial number's content bytes, and the authority key identifier's `keyIdentifier`
    /// (what an ACME server's renewal information names a certificate by, RFC 9773).
    pub serial: Vec<u8>,
    pub authority_key_id: Option<Vec<u8>>,
}

impl Facts {
    /// The names a server certificate answers for: its SAN DNS names, else its CN.
    pub fn served_names(&self) -> Vec<String> {
        if !self.dns_names.is_empty() {
            return self.dns_names.clone();
        }
        self.common_name.iter().map(|c| c.to_ascii_lowercase()).collect()
    }

    /// The client identity for limits: the first SAN entry (DNS, email, URI, IP), else the CN.
    pub fn identity(&self) -> Option<String> {
        self.dns_names.first().or(self.other_names.first()).or(self.common_name.as_ref()).cloned()
    }
}

/// One DER element: tag, and its content.
struct Tlv<'a> {
    tag: u8,
    body: &'a [u8],
}

/// Reads one element off the front of `input`; returns it and the rest.
fn next(input: &[u8]) -> Option<(Tlv<'_>, &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((Tlv { tag, body: &rest[..len] }, &rest[len..]))
}

const SEQUENCE: u8 = 0x30;
const OID_SAN: &[u8] = &[0x55, 0x1d, 0x11];
const OID_CN: &[u8] = &[0x55, 0x04, 0x03];
const OID_AKI: &[u8] = &[0x55, 0x1d, 0x23];

/// Parses a DER certificate.
pub fn parse(der: &[u8]) -> Option<Facts> {
    let (cert, _) = next(der)?;
    if cert.tag != SEQUENCE {
        return None;
    }
    let (tbs, _) = next(cert.body)?;
    if tbs.tag != SEQUENCE {
        return None;
    }
    let mut rest = tbs.body;
    let (mut el, r) = next(rest)?;
    rest = r;
    if el.tag == 0xa0 {
        // [0] EXPLICIT version
        (el, rest) = next(rest)?;
    }
    if el.tag != 0x02 {
        return None; // serialNumber
    }
    let serial = el.body.to_vec();
    let (_signature, r) = next(rest)?;
    let (_issuer, r) = next(r)?;
    let (validity, r) = next(r)?;
    let (subject, r) = next(r)?;
    let (_spki, mut r) = next(r)?;
    let (nb, after) = next(validity.body)?;
    let (na, _) = next(after)?;
    let mut facts = Facts {
        not_before: time(&nb)?,
        not_after: time(&na)?,
        common_name: common_name(subject.body),
        serial,
        ..Facts::default()
    };
    while let Some((el, more)) = next(r) {
        r = more;
        if el.tag == 0xa3 {
            let (exts, _) = next(el.body)?;
            let mut list = exts.body;
            while let Some((ext, more)) = next(list) {
                list = more;
                let (oid, mut inner) = next(ext.body)?;
                if oid.body != OID_SAN && oid.body != OID_AKI {
                    continue;
                }
                let (mut value, more) = next(inner)?;
                inner = more;
                if value.tag == 0x01 {
                    (value, _) = next(inner)?; // critical flag
                }
                let (seq, _) = next(value.body)?;
                if oid.body == OID_SAN {
                    san(seq.body, &mut facts);
                } else if let Some((id, _)) = next(seq.body).filter(|(id, _)| id.tag == 0x80) {
                    // AuthorityKeyIdentifier ::= SEQUENCE { keyIdentifier [0] IMPLICIT OCTET STRING, ... }
                    facts.authority_key_id = Some(id.body.to_vec());
                }
            }
        }
    }
    Some(facts)
}

fn san(mut list: &[u8], facts: &mut Facts) {
    while let Some((name, more)) = next(list) {
        list = more;
        let text = || std::str::from_utf8(name.body).ok().map(str::to_owned);
        match name.tag {
            0x82 => facts.dns_names.extend(text().map(|s| s.to_ascii_lowercase())),
            0x81 | 0x86 => facts.other_names.extend(text()),
            0x87 => match name.body.len() {
                4 => {
                    let o: [u8; 4] = name.body.try_into().unwrap_or_default();
                    facts.other_names.push(std::net::Ipv4Addr::from(o).to_string());
                }
                16 => {
                    let o: [u8; 16] = name.body.try_into().unwrap_or_default();
                    facts.other_names.push(std::net::Ipv6Addr::from(o).to_string());
                }
                _ => {}
            },
            _ => {}
        }
    }
}

fn common_name(mut name: &[u8]) -> Option<String> {
    while let Some((set, more)) = next(name) {
        name = more;
        let mut attrs = set.body;
        while let Some((attr, more)) = next(attrs) {
            attrs = more;
            let (oid, rest) = next(attr.body)?;
            if oid.body == OID_CN {
                let (value, _) = next(rest)?;
                return std::str::from_utf8(value.body).ok().map(str::to_owned);
            }
        }
    }
    None
}

/// UTCTime (`YYMMDDHHMMSSZ`) or GeneralizedTime (`YYYYMMDDHHMMSSZ`) as unix seconds.
fn time(t: &Tlv<'_>) -> Option<i64> {
    let s = std::str::from_utf8(t.body).ok()?.strip_suffix('Z')?;
    let num = |s: &str| -> Option<i64> { s.bytes().all(|b| b.is_ascii_digit()).then(|| s.parse().ok()).flatten() };
    let (year, rest) = match t.tag {
        0x17 if s.len() == 12 => {
            let yy = num(&s[..2])?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, &s[2..])
        }
        0x18 if s.len() == 14 => (num(&s[..4])?, &s[4..]),
        _ => return None,
    };
    let (mo, d, h, mi, se) =
        (num(&rest[..2])?, num(&rest[2..4])?, num(&rest[4..6])?, num(&rest[6..8])?, num(&rest[8..10])?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    Some(days_from_civil(year, mo, d) * 86_400 + h * 3600 + mi * 60 + se)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `secs` (unix) as `YYYY-MM-DD` for messages.
pub fn date(secs: i64) -> String {
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(date(0), "1970-01-01");
        assert_eq!(date(days_from_civil(2024, 2, 29) * 86_400), "2024-02-29");
    }

    #[test]
    fn garbage_is_none_never_a_panic() {
        for bytes in [&[][..], &[0x30], &[0x30, 0x84, 0xff, 0xff, 0xff, 0xff], &[0x30, 0x03, 0x30, 0x01, 0x02]] {
            assert_eq!(parse(bytes), None);
        }
    }

    #[test]
    fn reads_names_and_validity_of_a_generated_certificate() {
        let mut params = rcgen::CertificateParams::new(vec!["a.example.com".into(), "*.b.example.com".into()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 2);
        params.not_after = rcgen::date_time_ymd(2060, 3, 4);
        params.distinguished_name.push(rcgen::DnType::CommonName, "the cn");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let f = parse(cert.der()).unwrap();
        assert_eq!(f.dns_names, ["a.example.com", "*.b.example.com"]);
        assert_eq!(f.common_name.as_deref(), Some("the cn"));
        assert_eq!(date(f.not_before), "2020-01-02");
        assert_eq!(date(f.not_after), "2060-03-04");
        assert_eq!(f.authority_key_id, None);
    }

    #[test]
    fn reads_the_serial_and_the_authority_key_identifier() {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = rcgen::Issuer::new(ca, ca_key);
        let mut params = rcgen::CertificateParams::new(vec!["a.example".into()]).unwrap();
        params.serial_number = Some(rcgen::SerialNumber::from(vec![0x12, 0x34, 0x56]));
        params.use_authority_key_identifier_extension = true;
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf = params.signed_by(&key, &ca).unwrap();
        let f = parse(leaf.der()).unwrap();
        assert_eq!(f.serial, [0x12, 0x34, 0x56]);
        // rcgen's key identifier: the first 20 bytes of the SHA-256 of the issuer's public key.
        let spki =
            ring::digest::digest(&ring::digest::SHA256, &rcgen::PublicKeyData::subject_public_key_info(ca.key()));
        assert_eq!(f.authority_key_id.as_deref(), Some(&spki.as_ref()[..20]));
        assert_eq!(f.dns_names, ["a.example"]);
    }
}
