//! A stream's messages checked as they pass: what a route's message limits plug in (a gRPC
//! call's bodies, a WebSocket tunnel). This room frames the messages; whoever implements
//! [`Watch`] decides on them.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// What becomes of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It passes after `after` (zero: at once); its place is taken already.
    Pass { after: Duration },
    /// Hold it for `after`, then ask again.
    Again { after: Duration },
    /// The stream ends.
    Refuse(Refusal),
}

/// Why a stream is ended, and what its client is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// A sentence naming the limit (or the size cap).
    pub reason: String,
    /// When the client may try again (zero: no wait helps, or not known).
    pub retry_after: Duration,
    /// The message was larger than the cap (rather than over a limit).
    pub too_large: bool,
}

/// A decision on one message, to be awaited (at once for a local store).
pub type Deciding = Pin<Box<dyn Future<Output = Verdict> + Send>>;

/// The checks on one stream's messages.
pub trait Watch: Send + Sync + 'static {
    /// Whether messages going towards the upstream (`up`), or the client, are counted at all.
    fn counts(&self, up: bool) -> bool;
    /// The largest message the stream may carry.
    fn max_message_size(&self) -> u64;
    /// One message of `len` bytes going `up` (towards the upstream) or down; `waited`: how
    /// long it was held already.
    fn message(&self, up: bool, len: u64, waited: Duration) -> Deciding;
    /// A message found longer than [`Watch::max_message_size`] as it went on (a WebSocket
    /// message's later frames), `len` bytes so far: counted, and the refusal it gets.
    fn too_large(&self, len: u64) -> Refusal;
    /// The stream ended, for `why`.
    fn ended(&self, why: &str);
}
