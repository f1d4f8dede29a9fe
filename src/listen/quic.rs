//! The edge steps of an HTTP/3 listener's new QUIC connections: which are let in (a Retry
//! asked of new clients when handshakes come faster than `quic.retry_above` a second, a
//! bound on new connections a second from one address), and the [`Peer`] a connection makes.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::peer::{Peer, TlsPeer};

/// Addresses followed in one second at most: past this, new addresses are refused until the
/// second ends (a flood of spoofed sources meets Retry first, so this is rarely reached).
pub const MAX_TRACKED: usize = 65_536;

/// What to do with a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    /// Ask the client to prove its address (a Retry packet).
    Retry,
    /// Refuse it: too many new connections from its address this second.
    Refuse,
}

/// The counts of the current second: handshakes, and new connections by address (hashed
/// with a per-process key, so a client chooses neither where its count lands nor how much
/// memory it takes). Owned by the endpoint's one accept loop: no lock.
pub struct Admission {
    started: Instant,
    second: u64,
    handshakes: u32,
    per_ip: HashMap<u64, u32, foldhash::fast::FixedState>,
    hasher: foldhash::fast::FixedState,
}

impl Default for Admission {
    fn default() -> Admission {
        Admission {
            started: Instant::now(),
            second: 0,
            handshakes: 0,
            per_ip: HashMap::default(),
            hasher: foldhash::fast::FixedState::with_seed(fastrand::u64(..)),
        }
    }
}

impl Admission {
    /// The verdict on a new connection from `ip` at `now`; `validated`: its address is proven
    /// (it came back with a Retry token). Only connections let in are counted against `ip`.
    pub fn check(&mut self, ip: IpAddr, validated: bool, now: Instant, retry_above: u32, per_ip: u32) -> Verdict {
        let second = now.saturating_duration_since(self.started).as_secs();
        if second != self.second {
            self.second = second;
            self.handshakes = 0;
            self.per_ip.clear();
            // After a burst, the table's room goes back.
            if self.per_ip.capacity() > 4_096 {
                self.per_ip.shrink_to(1_024);
            }
        }
        if !validated && self.handshakes >= retry_above {
            return Verdict::Retry;
        }
        let key = self.hasher.hash_one(ip);
        let full = self.per_ip.len() >= MAX_TRACKED;
        match self.per_ip.get_mut(&key) {
            Some(n) if *n >= per_ip => return Verdict::Refuse,
            Some(n) => *n += 1,
            None if full => return Verdict::Refuse,
            None => {
                self.per_ip.insert(key, 1);
            }
        }
        self.handshakes = self.handshakes.saturating_add(1);
        Verdict::Accept
    }
}

/// The [`Peer`] of a QUIC connection: its UDP source, the SNI it asked for and the client
/// certificate's identity (once the handshake has it).
pub fn peer(conn: &quinn::Connection) -> Peer {
    let sni = conn
        .handshake_data()
        .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|d| d.server_name)
        .map(String::into_boxed_str);
    let client = conn
        .peer_identity()
        .and_then(|i| i.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok())
        .and_then(|certs| certs.first().and_then(|c| super::x509::parse(c)))
        .and_then(|f| f.identity())
        .map(String::into_boxed_str);
    Peer { addr: conn.remote_address(), tls: Some(Arc::new(TlsPeer { sni, h2: false, client })) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn handshakes_past_the_rate_get_a_retry_and_one_address_is_bounded_per_second() {
        let mut a = Admission::default();
        let t0 = a.started;
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let other: IpAddr = "192.0.2.2".parse().unwrap();
        assert_eq!(a.check(ip, false, t0, 3, 2), Verdict::Accept);
        assert_eq!(a.check(ip, false, t0, 3, 2), Verdict::Accept);
        assert_eq!(a.check(ip, true, t0, 3, 2), Verdict::Refuse, "a third connection from one address this second");
        assert_eq!(a.check(other, false, t0, 3, 2), Verdict::Accept);
        assert_eq!(a.check(other, false, t0, 3, 2), Verdict::Retry, "the fourth handshake of the second");
        assert_eq!(a.check(other, true, t0, 3, 2), Verdict::Accept, "a validated address is not asked again");
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(a.check(ip, false, t1, 3, 2), Verdict::Accept, "a new second starts new counts");
    }

    #[test]
    fn the_table_of_addresses_is_bounded() {
        let mut a = Admission::default();
        let t0 = a.started;
        for i in 0..MAX_TRACKED as u32 {
            let ip = IpAddr::from(std::net::Ipv4Addr::from(i));
            assert_eq!(a.check(ip, true, t0, 0, 1), Verdict::Accept);
        }
        let late = IpAddr::from(std::net::Ipv4Addr::from(u32::MAX));
        assert_eq!(a.check(late, true, t0, 0, 1), Verdict::Refuse);
        assert_eq!(a.per_ip.len(), MAX_TRACKED);
    }
}
