//! Copying a response as it streams: a [`Pending`] record is the body's [`Tap`]. Every frame
//! passes on the moment the body yields it; the copy is stored only if the body ends cleanly
//! within the entry's byte budget. A failed copy never touches the response itself.

use bytes::Bytes;

use super::{Cache, Stored};
use crate::body::Tap;

/// A response that is being copied; built by [`Cache`] only.
pub(super) struct Pending {
    pub cache: Cache,
    pub primary: u128,
    /// Everything but the body; `weight` counts the head so far. Taken when stored.
    pub stored: Option<Stored>,
    pub buf: Vec<u8>,
    /// Body bytes this entry may still take.
    pub budget: usize,
    /// Stored (or refused for its length): nothing to count when dropped.
    pub done: bool,
    /// The miss other requests for this key wait on: they are let go when this copy is
    /// stored or given up (when this record drops).
    pub flight: Option<super::Flight>,
}

impl Tap for Pending {
    fn data(&mut self, data: &Bytes) -> bool {
        // Over budget: stop copying; the response keeps streaming.
        if data.len() > self.budget {
            return false;
        }
        self.budget -= data.len();
        self.buf.extend_from_slice(data);
        true
    }

    fn end(mut self: Box<Self>) {
        self.done = true;
        let Some(mut stored) = self.stored.take() else { return };
        let mut buf = std::mem::take(&mut self.buf);
        // A body shorter or longer than its Content-Length was cut or is broken.
        let declared = stored.headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok());
        if declared.is_some_and(|n| n.trim().parse::<usize>().ok() != Some(buf.len())) {
            self.cache.abandoned();
            return;
        }
        buf.shrink_to_fit();
        stored.weight = stored.weight.saturating_add(buf.len());
        stored.body = Bytes::from(buf);
        self.cache.insert(self.primary, stored);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // Dropped before its end: the body failed, or the client went away.
        if !self.done {
            self.cache.abandoned();
        }
    }
}
