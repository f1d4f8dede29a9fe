//! A route's concurrency cap: fixed (a semaphore) or adaptive, and the slot a request holds.

use super::*;

pub(super) enum Cap {
    Fixed { slots: Arc<Semaphore>, max_wait: Duration },
    Adaptive { cap: Arc<adaptive::Cap>, max_wait: Duration },
}

/// A slot of a route's concurrency cap, held until the response body ends.
pub enum Slot {
    Fixed(OwnedSemaphorePermit),
    /// Boxed: an adaptive slot carries its start time, and this type lives in every body.
    Adaptive(Box<adaptive::Held>),
}

impl Slot {
    /// The answer's status: an adaptive limit takes the round trip of one below 500 as a
    /// latency sample, and counts anything else (or a slot dropped unanswered) as a failure.
    pub fn answered(&mut self, status: http::StatusCode) {
        if let Slot::Adaptive(h) = self {
            if !status.is_server_error() {
                h.succeeded();
            }
        }
    }
}

impl From<Slot> for crate::body::Guard {
    fn from(slot: Slot) -> crate::body::Guard {
        match slot {
            Slot::Fixed(p) => crate::body::Guard::Permit(p),
            Slot::Adaptive(h) => crate::body::Guard::Boxed(h),
        }
    }
}

impl Gate {
    pub(super) async fn acquire(&self, cap: &Cap) -> Option<Slot> {
        match cap {
            Cap::Fixed { slots, max_wait } => match slots.clone().try_acquire_owned() {
                Ok(p) => Some(Slot::Fixed(p)),
                Err(_) if max_wait.is_zero() => None,
                Err(_) => Box::pin(tokio::time::timeout(*max_wait, slots.clone().acquire_owned()))
                    .await
                    .ok()?
                    .ok()
                    .map(Slot::Fixed),
            },
            Cap::Adaptive { cap, max_wait } => {
                Box::pin(cap.acquire(*max_wait)).await.map(|h| Slot::Adaptive(Box::new(h)))
            }
        }
    }
}
