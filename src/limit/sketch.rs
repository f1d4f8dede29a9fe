//! The keys a limit throttles most, recently: a Space-Saving summary (Metwally, Agrawal and
//! El Abbadi, 2005) of [`COUNTERS`] counters with exponential decay, fed with denials only.
//!
//! # Guarantee
//! Over the denials counted since the last decay step, every key denied more than `N / k`
//! times (N denials in all, k = [`COUNTERS`]) holds a counter, and a counter's `count` is
//! never below the key's true count nor above it by more than its `error`. A new key that finds
//! every counter taken replaces the one with the smallest count and inherits that count as its
//! error, which is what makes the bound hold with a fixed number of counters.
//!
//! # Recent
//! Every [`HALF_LIFE`] (60 s) all counts and errors are halved (lazily, by the next denial or
//! read), and counters that reach zero are freed: a key's weight halves every minute, so the
//! summary shows the last few minutes (a denial from 5 minutes ago weighs 1/32 of one now).
//!
//! # Cost and memory
//! A denial costs one pass over the counters at most: a key denied often drifts to the front
//! (a count that passes the one before it trades places with it, one place a denial) and is
//! found in a few comparisons; a new key takes the smallest count found on the way. `top`
//! sorts a copy. (Kept sorted, a denial could swap up to k counters when many counts tie, as
//! they do in a flood of distinct keys.) No
//! allocation after a limit's first denial, which makes the counters and the label buffers at
//! their final size (a limit that never denies holds nothing). Memory per limit, whatever the
//! number of keys: k × 48 bytes of counters and k × 25 bytes of label slots (4.6 KiB), plus
//! with `show_keys` k × [`LABEL_BYTES`] of label text (8 KiB more).

use crate::limit::{KeyHash, Span, Timestamp};

/// Counters per limit (k): a key with more than 1/k of the recent denials is always listed.
pub const COUNTERS: usize = 64;

/// A key's text (`show_keys: true`) is capped at this many bytes, escaped.
pub const LABEL_BYTES: usize = 128;

/// Counts halve every this long.
pub const HALF_LIFE: Span = Span::from_micros(60_000_000);

/// One counter: a key, its (over-)count, the bound of the over-count and its label's buffer.
#[derive(Clone, Copy, Debug)]
struct Counter {
    key: u128,
    count: u64,
    error: u64,
    /// Index of this key's label in [`Sketch::labels`] (labels stay put; counters move).
    label: u8,
}

/// One key as [`Sketch::top`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hitter {
    pub key: KeyHash,
    /// Denials counted (decayed), at most `error` more than the key's own.
    pub count: u64,
    /// How much of `count` may belong to keys this counter held before.
    pub error: u64,
    /// The key's text, when the limit shows keys.
    pub label: Option<String>,
}

/// The heavy-hitter summary of one limit's denials.
#[derive(Debug)]
pub struct Sketch {
    counters: Vec<Counter>,
    /// One buffer per counter slot, made with [`LABEL_BYTES`] of room (empty without labels).
    labels: Vec<String>,
    /// Labels not held by a counter.
    free: Vec<u8>,
    labelled: bool,
    /// Counts were last halved at this time (a multiple of [`HALF_LIFE`]).
    decayed_at: Timestamp,
}

impl Sketch {
    /// An empty summary; `labelled`: keep each key's text (`show_keys: true`).
    /// Allocates nothing until the first denial (a limit that never denies costs nothing).
    pub fn new(labelled: bool) -> Sketch {
        Sketch { counters: Vec::new(), labels: Vec::new(), free: Vec::new(), labelled, decayed_at: Timestamp::ZERO }
    }

    /// Makes the counters and label buffers at their final size, once.
    #[cold]
    fn warm(&mut self) {
        self.counters.reserve_exact(COUNTERS);
        let labelled = self.labelled;
        self.labels =
            (0..COUNTERS).map(|_| if labelled { String::with_capacity(LABEL_BYTES) } else { String::new() }).collect();
        // Popped from the end: slot 0 first.
        self.free = (0..COUNTERS as u8).rev().collect();
    }

    /// Counts one denial of `key` at `now`. `label` writes the key's text into the buffer it
    /// is given, capped by [`push_escaped`]; it is called only when the key takes a counter,
    /// and only for a labelled summary.
    pub fn record(&mut self, key: KeyHash, now: Timestamp, label: impl FnOnce(&mut String)) {
        if self.labels.is_empty() {
            self.warm();
        }
        self.decay(now);
        // One pass: the key's counter, or the smallest count (the one a new key takes when
        // every counter is held). A counter that passes the one before it trades places with
        // it, one place a denial: keys denied often drift to the front, where they are found
        // in a few comparisons, and no denial moves more than two counters.
        let mut min = 0;
        for i in 0..self.counters.len() {
            let c = &self.counters[i];
            if c.key == key.0 {
                self.counters[i].count += 1;
                if i > 0 && self.counters[i - 1].count < self.counters[i].count {
                    self.counters.swap(i - 1, i);
                }
                return;
            }
            if c.count < self.counters[min].count {
                min = i;
            }
        }
        let i = match self.free.pop() {
            Some(slot) => {
                self.counters.push(Counter { key: key.0, count: 1, error: 0, label: slot });
                self.counters.len() - 1
            }
            None => {
                // Full: the smallest count gives its counter to the new key.
                let c = &mut self.counters[min];
                *c = Counter { key: key.0, count: c.count + 1, error: c.count, label: c.label };
                min
            }
        };
        if self.labelled {
            let buf = &mut self.labels[usize::from(self.counters[i].label)];
            buf.clear();
            label(buf);
        }
    }

    /// The `n` keys with the highest counts at `now`, highest first.
    pub fn top(&mut self, n: usize, now: Timestamp) -> Vec<Hitter> {
        self.decay(now);
        let mut by_count: Vec<&Counter> = self.counters.iter().collect();
        by_count.sort_by_key(|c| std::cmp::Reverse(c.count));
        by_count
            .into_iter()
            .take(n)
            .map(|c| Hitter {
                key: KeyHash(c.key),
                count: c.count,
                error: c.error,
                label: self.labelled.then(|| self.labels[usize::from(c.label)].clone()),
            })
            .collect()
    }

    /// The key whose label is `text` (labelled summaries only).
    pub fn find_label(&self, text: &str) -> Option<KeyHash> {
        if !self.labelled {
            return None;
        }
        self.counters.iter().find(|c| self.labels[usize::from(c.label)] == text).map(|c| KeyHash(c.key))
    }

    /// Forgets `key` (its state was reset: its past denials no longer say anything).
    pub fn forget(&mut self, key: KeyHash) {
        if let Some(i) = self.counters.iter().position(|c| c.key == key.0) {
            let c = self.counters.swap_remove(i);
            self.free.push(c.label);
        }
    }

    /// Counters in use (at most [`COUNTERS`]).
    pub fn len(&self) -> usize {
        self.counters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    /// Bytes this summary holds on the heap: fixed once made, whatever the keys.
    pub fn heap_bytes(&self) -> usize {
        self.counters.capacity() * std::mem::size_of::<Counter>()
            + self.labels.iter().map(String::capacity).sum::<usize>()
            + self.labels.capacity() * std::mem::size_of::<String>()
            + self.free.capacity()
    }

    /// Halves every count once per [`HALF_LIFE`] passed since the last halving; frees the
    /// counters that reach zero.
    #[inline]
    fn decay(&mut self, now: Timestamp) {
        let since = (now - self.decayed_at).as_micros();
        let half = HALF_LIFE.as_micros();
        if since < half {
            return;
        }
        self.cold_decay(now, since / half);
    }

    #[cold]
    fn cold_decay(&mut self, now: Timestamp, steps: u64) {
        let half = HALF_LIFE.as_micros();
        self.decayed_at = Timestamp::from_micros(now.as_micros() - now.as_micros() % half);
        let shift = u32::try_from(steps.min(64)).unwrap_or(64);
        for c in &mut self.counters {
            c.count = c.count.checked_shr(shift).unwrap_or(0);
            c.error = c.error.checked_shr(shift).unwrap_or(0);
        }
        let free = &mut self.free;
        self.counters.retain(|c| {
            if c.count == 0 {
                free.push(c.label);
            }
            c.count > 0
        });
    }
}

/// Appends `bytes` to `out` as printable ASCII (other bytes, `\` and `"` as `\xNN`), stopping
/// before `out` would pass [`LABEL_BYTES`]; a label never grows its buffer.
pub fn push_escaped(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for &b in bytes {
        let plain = (0x20..0x7f).contains(&b) && b != b'\\' && b != b'"';
        let need = if plain { 1 } else { 4 };
        if out.len() + need > LABEL_BYTES {
            return;
        }
        if plain {
            out.push(char::from(b));
        } else {
            out.push('\\');
            out.push('x');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(s: u64) -> Timestamp {
        Timestamp::from_micros(1_000_000_000_000 + s * 1_000_000)
    }

    #[test]
    fn many_distinct_keys_never_grow_the_summary() {
        let mut s = Sketch::new(true);
        assert_eq!(s.heap_bytes(), 0, "nothing before the first denial");
        s.record(KeyHash(u128::MAX), at(1), |b| b.push_str("first"));
        let made = s.heap_bytes();
        for k in 0..20_000u128 {
            s.record(KeyHash(k * 0x9e37_79b9_7f4a_7c15), at(1), |b| {
                push_escaped(b, format!("client {k} ").repeat(20).as_bytes())
            });
        }
        assert_eq!(s.len(), COUNTERS);
        assert_eq!(s.heap_bytes(), made, "the summary allocated after it was made");
        assert!(made <= COUNTERS * (48 + 24 + 1 + LABEL_BYTES), "{made} bytes");
        assert!(s.top(1000, at(1)).iter().all(|h| h.label.as_ref().is_some_and(|l| l.len() <= LABEL_BYTES)));
    }

    #[test]
    fn the_heaviest_key_comes_first_with_its_count() {
        let mut s = Sketch::new(false);
        for i in 0..1000u128 {
            s.record(KeyHash(7), at(1), |_| {});
            s.record(KeyHash(1000 + i), at(1), |_| {});
        }
        let top = s.top(3, at(2));
        assert_eq!(top[0].key, KeyHash(7));
        assert!(top[0].count - top[0].error <= 1000 && top[0].count >= 1000, "{top:?}");
        assert!(top[1].count < top[0].count);
    }

    #[test]
    fn counts_halve_every_minute_and_old_keys_leave() {
        let mut s = Sketch::new(false);
        for _ in 0..8 {
            s.record(KeyHash(1), at(0), |_| {});
        }
        s.record(KeyHash(2), at(0), |_| {});
        assert_eq!(s.top(10, at(61)).iter().map(|h| (h.key.0, h.count)).collect::<Vec<_>>(), [(1, 4)]);
        assert_eq!(s.top(10, at(181))[0].count, 1);
        assert!(s.top(10, at(241)).is_empty());
    }

    #[test]
    fn labels_are_escaped_and_capped() {
        let mut out = String::new();
        push_escaped(&mut out, b"a\"b\\c\n\xff");
        assert_eq!(out, "a\\x22b\\x5cc\\x0a\\xff");
        let mut long = String::with_capacity(LABEL_BYTES);
        push_escaped(&mut long, &[0u8; 200]);
        assert_eq!(long.len(), LABEL_BYTES);
    }

    #[test]
    fn a_forgotten_key_frees_its_counter_and_label() {
        let mut s = Sketch::new(true);
        s.record(KeyHash(1), at(0), |b| b.push_str("one"));
        s.record(KeyHash(2), at(0), |b| b.push_str("two"));
        assert_eq!(s.find_label("two"), Some(KeyHash(2)));
        s.forget(KeyHash(2));
        assert_eq!(s.find_label("two"), None);
        s.record(KeyHash(3), at(0), |b| b.push_str("three"));
        assert_eq!(s.top(5, at(0)).iter().filter_map(|h| h.label.clone()).collect::<Vec<_>>(), ["one", "three"]);
    }

    proptest! {
        /// Space-Saving's promise: within one half-life, a key with more than 1/k of the
        /// denials holds a counter, and its count is within its error of the truth.
        #[test]
        fn a_key_with_more_than_one_kth_of_the_denials_is_listed(
            stream in proptest::collection::vec(0u128..400, 1..4000),
            heavy in 0u128..400,
            share in 1usize..40,
        ) {
            let mut s = Sketch::new(false);
            let mut truth = std::collections::HashMap::new();
            for (i, k) in stream.iter().enumerate() {
                // Every `share`-th denial is the heavy key's, on top of the random stream.
                let keys: &[u128] = if i % share == 0 { &[heavy, *k] } else { &[*k] };
                for &k in keys {
                    s.record(KeyHash(k), at(1), |_| {});
                    *truth.entry(k).or_insert(0u64) += 1;
                }
            }
            let total: u64 = truth.values().sum();
            let top = s.top(COUNTERS, at(1));
            for (k, n) in &truth {
                if *n * COUNTERS as u64 > total {
                    let h = top.iter().find(|h| h.key.0 == *k);
                    prop_assert!(h.is_some(), "key {k} with {n} of {total} denials is not listed");
                    let h = h.unwrap();
                    prop_assert!(h.count >= *n && h.count - h.error <= *n, "{h:?} for {n}");
                }
            }
            prop_assert!(top.windows(2).all(|w| w[0].count >= w[1].count));
        }
    }
}
