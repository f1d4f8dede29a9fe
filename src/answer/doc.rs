//! A problem+json document (RFC 9457) written by hand: the members are few and known, and
//! this runs once per distinct answer, so no JSON value tree is built.

use bytes::Bytes;

pub struct Doc(String);

impl Doc {
    /// The standard members: `type` (base + name), `title`, `status`, `detail`.
    pub fn new(base: &str, name: &str, title: &str, status: u16, detail: &str) -> Doc {
        let mut d = Doc(String::with_capacity(160 + detail.len()));
        d.0.push_str("{\"type\":");
        d.quoted(&[base, name]);
        d.string("title", title);
        d.number("status", u64::from(status));
        d.string("detail", detail);
        d
    }

    fn key(&mut self, key: &str) {
        if !self.0.ends_with('{') {
            self.0.push(',');
        }
        self.quoted(&[key]);
        self.0.push(':');
    }

    /// The concatenation of `parts` as one JSON string.
    fn quoted(&mut self, parts: &[&str]) {
        self.0.push('"');
        for part in parts {
            escape_into(&mut self.0, part);
        }
        self.0.push('"');
    }

    pub fn string(&mut self, key: &str, value: &str) {
        self.key(key);
        self.quoted(&[value]);
    }

    pub fn number(&mut self, key: &str, value: u64) {
        self.key(key);
        self.0.push_str(itoa::Buffer::new().format(value));
    }

    pub fn strings<'a>(&mut self, key: &str, values: impl Iterator<Item = &'a str>) {
        self.key(key);
        self.0.push('[');
        for (i, v) in values.enumerate() {
            if i > 0 {
                self.0.push(',');
            }
            self.quoted(&[v]);
        }
        self.0.push(']');
    }

    pub fn finish(mut self) -> Bytes {
        self.0.push('}');
        Bytes::from(self.0)
    }
}

/// JSON string escaping (RFC 8259 §7): quote, backslash and control characters.
fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                out.push_str("\\u00");
                out.push(char::from(b"0123456789abcdef"[(u32::from(c) >> 4) as usize]));
                out.push(char::from(b"0123456789abcdef"[(u32::from(c) & 0xf) as usize]));
            }
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_valid_json_whatever_the_text() {
        let mut d = Doc::new("urn:x:", "a\"b", "T", 400, "line\nnext \u{1} \\ \"q\" é");
        d.strings("list", ["x", "y\"z"].into_iter());
        d.number("n", 7);
        let text = d.finish();
        let v: serde_json::Value = serde_json::from_slice(&text).unwrap();
        assert_eq!(v["type"], "urn:x:a\"b");
        assert_eq!(v["detail"], "line\nnext \u{1} \\ \"q\" é");
        assert_eq!(v["status"], 400);
        assert_eq!(v["list"][1], "y\"z");
        assert_eq!(v["n"], 7);
    }
}
