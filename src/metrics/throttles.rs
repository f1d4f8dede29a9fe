//! The last throttled requests of a route, for the admin dashboard: a small ring of fixed
//! entries, written where a 429 is answered. Writing copies a few bytes under a lock taken
//! with `try_lock`: a 429 that meets another one being written on the same route is not
//! recorded rather than waited for, and nothing allocates once the route is built.

use std::sync::Mutex;

/// How many throttled requests a route keeps.
pub const KEPT: usize = 16;

/// The longest request id kept whole: the longest one tollgate accepts from a proxy.
const ID_BYTES: usize = 128;

/// One throttled request.
#[derive(Clone, Copy)]
pub struct Throttle {
    /// Milliseconds on the coarse clock of the timer room.
    pub at_ms: u64,
    /// The index of the limit that refused it in the route's `limits:`.
    pub limit: u16,
    pub retry_after_secs: u64,
    id_len: u8,
    id: [u8; ID_BYTES],
}

impl Throttle {
    const EMPTY: Throttle = Throttle { at_ms: 0, limit: 0, retry_after_secs: 0, id_len: 0, id: [0; ID_BYTES] };

    /// The request id ("" when the config has none, or if it was cut inside a character,
    /// which no id tollgate accepts has).
    pub fn request_id(&self) -> &str {
        std::str::from_utf8(&self.id[..usize::from(self.id_len)]).unwrap_or("")
    }
}

/// A route's ring; entries are overwritten oldest first.
pub struct Throttles {
    ring: Mutex<Ring>,
}

struct Ring {
    /// Entries written so far: the next one goes to `written % KEPT`.
    written: u64,
    slots: [Throttle; KEPT],
}

impl Default for Throttles {
    fn default() -> Self {
        Throttles { ring: Mutex::new(Ring { written: 0, slots: [Throttle::EMPTY; KEPT] }) }
    }
}

impl Throttles {
    /// Records a throttled request, unless another one is being recorded on this route right
    /// now (it is skipped: the 429 is never made to wait for the dashboard). An id longer
    /// than [`ID_BYTES`] is cut (none is: longer ones are refused where ids are read).
    pub fn record(&self, at_ms: u64, limit: usize, retry_after_secs: u64, request_id: &[u8]) {
        let Ok(mut ring) = self.ring.try_lock() else { return };
        let i = (ring.written % KEPT as u64) as usize;
        ring.written += 1;
        let slot = &mut ring.slots[i];
        let n = request_id.len().min(ID_BYTES);
        slot.at_ms = at_ms;
        slot.limit = u16::try_from(limit).unwrap_or(u16::MAX);
        slot.retry_after_secs = retry_after_secs;
        slot.id_len = n as u8;
        slot.id[..n].copy_from_slice(&request_id[..n]);
    }

    /// The kept entries, newest first (the admin listener reads them; it waits for the lock).
    pub fn recent(&self) -> Vec<Throttle> {
        let ring = self.ring.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let kept = ring.written.min(KEPT as u64);
        (1..=kept).map(|back| ring.slots[((ring.written - back) % KEPT as u64) as usize]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_entries_newest_first() {
        let t = Throttles::default();
        assert!(t.recent().is_empty());
        for i in 0..(KEPT as u64 + 3) {
            t.record(i, 1, i * 2, format!("id-{i}").as_bytes());
        }
        let recent = t.recent();
        assert_eq!(recent.len(), KEPT);
        assert_eq!(recent[0].at_ms, KEPT as u64 + 2);
        assert_eq!(recent[0].request_id(), format!("id-{}", KEPT + 2));
        assert_eq!(recent[KEPT - 1].at_ms, 3);
        assert!(recent.iter().all(|e| e.limit == 1 && e.retry_after_secs == e.at_ms * 2));
    }

    #[test]
    fn a_long_id_is_cut_not_refused() {
        let t = Throttles::default();
        let long = "x".repeat(ID_BYTES + 10);
        t.record(1, 0, 1, long.as_bytes());
        assert_eq!(t.recent()[0].request_id().len(), ID_BYTES);
    }
}
