//! A route's `message_limits:`: limits counted per message of a stream (a gRPC call's
//! length-prefixed messages, a WebSocket's data messages) rather than per request. Each entry
//! is a limit as in `limits:` (algorithm, rate, key, store, mode) with the way its messages go
//! and what a stream over it gets; `max_message_size` caps one message.

use std::time::Duration;

use serde::Deserialize;

use super::limits::{check_name, RawMessageLimit};
use super::units::Size;
use super::{key, Invalid, LimitConfig, Seg};

/// Which messages a message limit counts.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// What the client sends towards the upstream.
    #[default]
    Client,
    /// What the upstream sends towards the client.
    Upstream,
    /// Both ways, on one count.
    Both,
}

impl Direction {
    /// Whether messages going towards the upstream (`up`) or the client count.
    pub fn counts(self, up: bool) -> bool {
        match self {
            Direction::Client => up,
            Direction::Upstream => !up,
            Direction::Both => true,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Client => "client",
            Direction::Upstream => "upstream",
            Direction::Both => "both",
        }
    }
}

/// What a stream gets when a message is over the limit.
#[derive(Deserialize, Clone, Copy, PartialEq, Eq, Debug, Default, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// The stream ends: a gRPC call with `RESOURCE_EXHAUSTED`, a WebSocket with close 1008.
    #[default]
    Close,
    /// The message is held back until the limit admits it, at most `max_delay`; a message
    /// that would wait longer ends the stream as `close` does.
    Delay,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Close => "close",
            Action::Delay => "delay",
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMessageLimits {
    max_message_size: Option<Size>,
    #[serde(default)]
    limits: Vec<RawMessageLimit>,
}

/// A route's message limits, validated.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageLimits {
    /// The largest message a stream may carry, in bytes (its length as framed: a gRPC
    /// message's prefix, a WebSocket message's frames summed); a larger one ends the stream.
    pub max_message_size: u64,
    pub limits: Vec<MessageLimit>,
}

/// One limit counted per message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageLimit {
    pub limit: LimitConfig,
    pub direction: Direction,
    pub action: Action,
    /// How long `action: delay` holds a message back at most (the leaky bucket's own
    /// `max_delay` for that algorithm).
    pub max_delay: Duration,
    /// `cost: { bytes: N }`: a message costs a unit per started `N` bytes of it (else the
    /// limit's `cost` per message).
    pub bytes_per_unit: Option<std::num::NonZeroU64>,
}

impl MessageLimit {
    /// What a message of `len` bytes costs.
    pub fn cost(&self, len: u64) -> u64 {
        match self.bytes_per_unit {
            None => self.limit.cost,
            Some(unit) => len.div_ceil(unit.get()).max(1),
        }
    }
}

/// The default `max_message_size`: gRPC's own default receive limit.
pub const DEFAULT_MAX_MESSAGE_SIZE: u64 = 4 << 20;
/// The default bound of `action: delay`.
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(1);
/// The longest `action: delay` may hold a message.
const MAX_DELAY: Duration = Duration::from_secs(60);
/// Message limits on one route at most.
const MAX_MESSAGE_LIMITS: usize = 8;

impl RawMessageLimits {
    /// `route`: the route's index; `request_limits`: the names of its `limits` (a message
    /// limit's name must differ from them: they share the metric labels).
    pub(super) fn validate(self, route: usize, request_limits: &[&str]) -> Result<MessageLimits, Invalid> {
        let at = |field: &[&str]| {
            let mut p = vec![key("routes"), Seg::Index(route), key("message_limits")];
            p.extend(field.iter().map(|f| key(f)));
            p
        };
        let max_message_size = self.max_message_size.map_or(DEFAULT_MAX_MESSAGE_SIZE, |s| s.0);
        if max_message_size == 0 {
            return Err((at(&["max_message_size"]), "max_message_size must be at least 1 byte".to_owned()));
        }
        if self.limits.is_empty() {
            return Err((at(&["limits"]), "expected at least one limit".to_owned()));
        }
        if self.limits.len() > MAX_MESSAGE_LIMITS {
            return Err((at(&["limits"]), format!("at most {MAX_MESSAGE_LIMITS} message limits on one route")));
        }
        let mut limits: Vec<MessageLimit> = Vec::with_capacity(self.limits.len());
        for (j, raw) in self.limits.into_iter().enumerate() {
            let field = |f: &str| {
                let mut p = at(&["limits"]);
                p.push(Seg::Index(j));
                p.push(key(f));
                p
            };
            let (raw, fields) = raw.split();
            let limit = raw.validate(j, &field)?;
            check_name(&limit.name).map_err(|e| (field("name"), e))?;
            if request_limits.contains(&limit.name.as_str()) || limits.iter().any(|l| l.limit.name == limit.name) {
                return Err((
                    field("name"),
                    format!("limit name `{}` is used twice in this route (limits and message_limits)", limit.name),
                ));
            }
            let max_delay = fields.bound.unwrap_or(DEFAULT_MAX_DELAY);
            if max_delay > MAX_DELAY {
                return Err((field("max_delay"), format!("a message is held back at most {}s", MAX_DELAY.as_secs())));
            }
            let bytes_per_unit = match fields.bytes_per_unit {
                None => None,
                Some(b) => {
                    let unit = std::num::NonZeroU64::new(b)
                        .ok_or_else(|| (field("cost"), "cost.bytes must be at least 1 byte".to_owned()))?;
                    let largest = max_message_size.div_ceil(b);
                    let max = crate::limit::max_cost(&limit.algorithm);
                    if largest > max {
                        return Err((
                            field("cost"),
                            format!(
                                "a message of max_message_size ({max_message_size} bytes) costs {largest}, and this \
                                 limit admits at most {max} at once: raise cost.bytes or the limit, or lower \
                                 max_message_size"
                            ),
                        ));
                    }
                    Some(unit)
                }
            };
            limits.push(MessageLimit {
                limit,
                direction: fields.direction,
                action: fields.action,
                max_delay,
                bytes_per_unit,
            });
        }
        Ok(MessageLimits { max_message_size, limits })
    }
}
