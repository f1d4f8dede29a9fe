//! Bounds on the config text, checked before serde_yaml sees it: file size, nesting depth
//! (libyaml's scanner is quadratic in depth long before any recursion limit acts) and what
//! aliases repeat (an alias is expanded at every use, so a small file can stand for a huge one).
//!
//! The depth scan is a single pass over the bytes that follows YAML's structure only as far as
//! it must: block indentation levels, `- `/`? `/`: ` indicators, flow brackets, quoted scalars,
//! block scalars and comments. Where it is unsure it counts a level rather than skip one, so it
//! can refuse an odd but valid file, never let a deep one through to the parser.

use yaml_rust2::parser::{Event, Parser};

/// The largest config file accepted, in bytes.
pub const MAX_CONFIG_BYTES: usize = 4 << 20;
/// Lists and maps (block or flow) nested deeper than this are refused. A tollgate config
/// needs 6 (`routes[].limits[].key[]`).
pub const MAX_DEPTH: usize = 32;
/// Aliases may repeat at most this many YAML nodes (scalars, lists, maps) in all: each use of
/// `*name` counts every node of what `&name` marks.
pub const MAX_ALIAS_NODES: u64 = 100_000;
/// … and at most this many bytes of scalar text.
pub const MAX_ALIAS_BYTES: u64 = 1 << 20;

/// A refusal with its 1-based position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

/// What the guard saw in an accepted text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shape {
    /// The deepest nesting (as the scan counts it).
    pub depth: usize,
    /// YAML nodes that aliases repeat, counted at every use.
    pub alias_nodes: u64,
}

/// Checks every bound; `Ok` means serde_yaml may parse `text`.
///
/// # Errors
/// The first bound exceeded, positioned where it was exceeded.
pub fn check(text: &str) -> Result<Shape, Refused> {
    if text.len() > MAX_CONFIG_BYTES {
        return Err(Refused {
            line: 1,
            column: 1,
            message: format!(
                "the config is {} bytes; at most {MAX_CONFIG_BYTES} bytes ({} MiB) are accepted",
                text.len(),
                MAX_CONFIG_BYTES >> 20
            ),
        });
    }
    let depth = Depth::scan(text.as_bytes())?;
    // Only a `*` can be an alias: texts without one skip the second parse.
    let alias_nodes = if text.as_bytes().contains(&b'*') { aliases(text)? } else { 0 };
    Ok(Shape { depth, alias_nodes })
}

/// The depth scanner's state: a stack of block indentation columns and the flow depth.
struct Depth<'a> {
    b: &'a [u8],
    /// Byte offset of the next byte to read.
    i: usize,
    line: usize,
    line_start: usize,
    block: Vec<usize>,
    flow: usize,
    max: usize,
}

fn is_ws(c: u8) -> bool {
    c == b' ' || c == b'\t'
}

fn is_flow_indicator(c: u8) -> bool {
    matches!(c, b',' | b'[' | b']' | b'{' | b'}')
}

impl<'a> Depth<'a> {
    fn scan(b: &'a [u8]) -> Result<usize, Refused> {
        let mut d = Depth { b, i: 0, line: 1, line_start: 0, block: Vec::new(), flow: 0, max: 0 };
        while d.i < d.b.len() {
            d.line_of_block()?;
        }
        Ok(d.max)
    }

    fn peek(&self, at: usize) -> Option<u8> {
        self.b.get(at).copied()
    }

    /// Whether the byte at `at` ends a token: whitespace, end of line or end of text.
    fn blank_at(&self, at: usize) -> bool {
        self.peek(at).is_none_or(|c| is_ws(c) || c == b'\n' || c == b'\r')
    }

    fn refuse(&self, at: usize) -> Refused {
        Refused {
            line: self.line,
            column: at - self.line_start + 1,
            message: format!(
                "nested deeper than {MAX_DEPTH} levels of lists and maps; a tollgate config needs at most 6 \
                 (this bound is checked before the YAML parser)"
            ),
        }
    }

    fn deeper(&mut self, at: usize) -> Result<(), Refused> {
        let depth = self.block.len() + self.flow;
        self.max = self.max.max(depth);
        if depth > MAX_DEPTH {
            return Err(self.refuse(at));
        }
        Ok(())
    }

    fn push_block(&mut self, column: usize, at: usize) -> Result<(), Refused> {
        if self.block.last().is_none_or(|&top| top < column) {
            self.block.push(column);
            self.deeper(at)?;
        }
        Ok(())
    }

    /// Moves past the end of the current line.
    fn next_line(&mut self) {
        while let Some(c) = self.peek(self.i) {
            self.i += 1;
            if c == b'\n' {
                self.line += 1;
                self.line_start = self.i;
                return;
            }
        }
    }

    /// One line in block context (flow collections and quoted scalars may carry it further).
    fn line_of_block(&mut self) -> Result<(), Refused> {
        let start = self.i;
        let mut p = start;
        while self.peek(p) == Some(b' ') {
            p += 1;
        }
        let indent = p - start;
        let mut q = p;
        while self.peek(q).is_some_and(is_ws) {
            q += 1;
        }
        match self.peek(q) {
            None => {
                self.i = q;
                return Ok(());
            }
            Some(b'\n' | b'\r' | b'#') => {
                self.next_line();
                return Ok(());
            }
            _ => {}
        }
        if indent == 0 {
            let rest = &self.b[p..];
            if rest.starts_with(b"%") {
                self.next_line();
                return Ok(());
            }
            if (rest.starts_with(b"---") || rest.starts_with(b"...")) && self.blank_at(p + 3) {
                self.block.clear();
                self.i = p + 3;
                return self.node(false);
            }
        }
        while self.block.last().is_some_and(|&top| top > indent) {
            self.block.pop();
        }
        self.push_block(indent, p)?;
        self.i = p;
        self.node(true)
    }

    /// A node in block context at `self.i`, then whatever follows it on the line. `fresh`: the
    /// line's first node (a `:` there is an indicator, not the value of a key on this line).
    fn node(&mut self, mut fresh: bool) -> Result<(), Refused> {
        loop {
            while self.peek(self.i).is_some_and(is_ws) {
                self.i += 1;
            }
            let Some(c) = self.peek(self.i) else { return Ok(()) };
            match c {
                b'\n' | b'\r' | b'#' => {
                    self.next_line();
                    return Ok(());
                }
                b'-' | b'?' | b':' if self.blank_at(self.i + 1) && (c != b':' || fresh) => {
                    // `- - x` and `? ? x` nest on one line: the content is one level deeper.
                    let mut p = self.i + 1;
                    while self.peek(p).is_some_and(is_ws) {
                        p += 1;
                    }
                    if self.peek(p).is_some_and(|c| c != b'\n' && c != b'\r' && c != b'#') {
                        self.push_block(p - self.line_start, p)?;
                    }
                    self.i = p;
                    fresh = true;
                }
                b'[' | b'{' => {
                    self.flow(self.i)?;
                    return self.after_node();
                }
                b'"' | b'\'' => {
                    self.quoted(c);
                    return self.after_node();
                }
                b'|' | b'>' => {
                    self.block_scalar();
                    return Ok(());
                }
                b'&' | b'!' => {
                    while !self.blank_at(self.i) {
                        self.i += 1;
                    }
                }
                b'*' => {
                    while !self.blank_at(self.i) {
                        self.i += 1;
                    }
                    return self.after_node();
                }
                _ => {
                    // A plain scalar: it ends at `: ` (it was a key), ` #` or the line's end.
                    loop {
                        match self.peek(self.i) {
                            None | Some(b'\n' | b'\r') => return Ok(()),
                            Some(b':') if self.blank_at(self.i + 1) => {
                                self.i += 1;
                                break;
                            }
                            Some(b'#') if self.i > 0 && is_ws(self.b[self.i - 1]) => {
                                self.next_line();
                                return Ok(());
                            }
                            Some(_) => self.i += 1,
                        }
                    }
                    fresh = false;
                }
            }
        }
    }

    /// After a quoted scalar, an alias or a flow collection: a `:` makes it a key.
    fn after_node(&mut self) -> Result<(), Refused> {
        while self.peek(self.i).is_some_and(is_ws) {
            self.i += 1;
        }
        if self.peek(self.i) == Some(b':') {
            self.i += 1;
        }
        // Anything else is a syntax error for the parser; scanning it as a node only counts more.
        self.node(false)
    }

    /// Skips a quoted scalar opening at `self.i`, across lines.
    fn quoted(&mut self, quote: u8) {
        self.i += 1;
        while let Some(c) = self.peek(self.i) {
            self.i += 1;
            match c {
                b'\\' if quote == b'"' => {
                    if self.peek(self.i) == Some(b'\n') {
                        self.line += 1;
                        self.line_start = self.i + 1;
                    }
                    self.i += 1;
                }
                b'\'' if quote == b'\'' && self.peek(self.i) == Some(b'\'') => self.i += 1,
                b'\n' => {
                    self.line += 1;
                    self.line_start = self.i;
                }
                c if c == quote => return,
                _ => {}
            }
        }
    }

    /// Skips a block scalar (`|` or `>` at `self.i`): the header line, then every line indented
    /// at least as far as its content. The content indentation is taken as the largest a YAML
    /// parser could use (explicit indicator, the first content line, the longest leading blank
    /// line), so no line the parser reads as structure is skipped.
    fn block_scalar(&mut self) {
        let n = self.block.last().copied().unwrap_or(0);
        let mut explicit = None;
        let mut p = self.i + 1;
        while let Some(c) = self.peek(p) {
            match c {
                b'1'..=b'9' => explicit = Some(usize::from(c - b'0')),
                b'+' | b'-' => {}
                _ => break,
            }
            p += 1;
        }
        self.next_line();
        let mut content: Option<usize> = None;
        let mut leading_blank = 0;
        while self.i < self.b.len() {
            let start = self.i;
            let mut p = start;
            while self.peek(p) == Some(b' ') {
                p += 1;
            }
            let spaces = p - start;
            let blank = matches!(self.peek(p), None | Some(b'\n' | b'\r'));
            let at = match content {
                Some(at) => at,
                None if blank => {
                    leading_blank = leading_blank.max(spaces);
                    self.next_line();
                    continue;
                }
                None => {
                    let at = spaces.max(leading_blank).max(n + 1).max(explicit.map_or(0, |k| n + k));
                    content = Some(at);
                    at
                }
            };
            if !blank && spaces < at {
                return;
            }
            self.next_line();
        }
    }

    /// A flow collection opening at `at`, to its matching close (across lines).
    fn flow(&mut self, at: usize) -> Result<(), Refused> {
        let base = self.flow;
        self.flow += 1;
        self.deeper(at)?;
        self.i = at + 1;
        // `start`: the next token begins a node (quotes open a scalar only there).
        // `closed`: the last token was a quoted scalar or a collection (`"a":b` JSON style).
        let (mut start, mut closed, mut ws) = (true, false, false);
        while let Some(c) = self.peek(self.i) {
            let here = self.i;
            self.i += 1;
            match c {
                b'\n' => {
                    self.line += 1;
                    self.line_start = self.i;
                    ws = true;
                    continue;
                }
                b' ' | b'\t' | b'\r' => {
                    ws = true;
                    continue;
                }
                b'#' if ws => {
                    self.i = here;
                    self.next_line();
                    continue;
                }
                b'[' | b'{' => {
                    self.flow += 1;
                    self.deeper(here)?;
                    (start, closed) = (true, false);
                }
                b']' | b'}' => {
                    self.flow -= 1;
                    if self.flow == base {
                        return Ok(());
                    }
                    (start, closed) = (false, true);
                }
                b',' => (start, closed) = (true, false),
                b':' => {
                    let next = self.peek(self.i);
                    let value =
                        closed || next.is_none_or(|n| is_ws(n) || n == b'\n' || n == b'\r' || is_flow_indicator(n));
                    (start, closed) = (value, false);
                }
                b'?' if start && self.blank_at(self.i) => {}
                b'"' | b'\'' if start => {
                    self.i = here;
                    self.quoted(c);
                    (start, closed) = (false, true);
                }
                b'&' | b'!' | b'*' if start => {
                    while self
                        .peek(self.i)
                        .is_some_and(|n| !(is_ws(n) || n == b'\n' || n == b'\r' || is_flow_indicator(n)))
                    {
                        self.i += 1;
                    }
                    if c == b'*' {
                        (start, closed) = (false, false);
                    }
                }
                _ => (start, closed) = (false, false),
            }
            ws = false;
        }
        Ok(())
    }
}

/// What one finished node weighs: its nodes and scalar bytes, aliases expanded.
#[derive(Clone, Copy, Default)]
struct Weight {
    nodes: u64,
    bytes: u64,
}

impl Weight {
    fn add(&mut self, w: Weight) {
        self.nodes = self.nodes.saturating_add(w.nodes);
        self.bytes = self.bytes.saturating_add(w.bytes);
    }
}

/// Counts what aliases repeat, stopping at the first alias past a bound.
fn aliases(text: &str) -> Result<u64, Refused> {
    let mut parser = Parser::new_from_str(text);
    // Open collections: their anchor id and weight so far.
    let mut open: Vec<(usize, Weight)> = Vec::new();
    let mut anchored: std::collections::HashMap<usize, Weight> = std::collections::HashMap::new();
    let mut repeated = Weight::default();
    loop {
        let (event, mark) = parser.next_token().map_err(|e| Refused {
            line: e.marker().line(),
            column: e.marker().col() + 1,
            message: format!("not valid YAML: {}", e.info()),
        })?;
        let done = match event {
            Event::StreamEnd => return Ok(repeated.nodes),
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                open.push((anchor, Weight { nodes: 1, bytes: 0 }));
                None
            }
            Event::SequenceEnd | Event::MappingEnd => open.pop(),
            Event::Scalar(value, _, anchor, _) => Some((anchor, Weight { nodes: 1, bytes: value.len() as u64 })),
            Event::Alias(id) => {
                // An alias of an anchor still open (recursive) is an error for serde_yaml.
                let w = anchored.get(&id).copied().unwrap_or(Weight { nodes: 1, bytes: 0 });
                repeated.add(w);
                if repeated.nodes > MAX_ALIAS_NODES || repeated.bytes > MAX_ALIAS_BYTES {
                    return Err(Refused {
                        line: mark.line(),
                        column: mark.col() + 1,
                        message: format!(
                            "aliases repeat more than {MAX_ALIAS_NODES} YAML nodes or {MAX_ALIAS_BYTES} bytes of \
                             text (each `*name` counts all of `&name` again); write the repeated parts out or use \
                             fewer aliases"
                        ),
                    });
                }
                Some((0, w))
            }
            _ => None,
        };
        if let Some((anchor, w)) = done {
            if anchor != 0 {
                anchored.insert(anchor, w);
            }
            if let Some((_, parent)) = open.last_mut() {
                parent.add(w);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth(text: &str) -> usize {
        match Depth::scan(text.as_bytes()) {
            Ok(d) => d,
            Err(e) => panic!("refused: {e:?}"),
        }
    }

    #[test]
    fn counts_block_and_flow_levels() {
        assert_eq!(depth("a: 1\n"), 1);
        assert_eq!(depth("a:\n  b:\n    c: 1\n"), 3);
        assert_eq!(depth("a:\n  - b: 1\n    c: 2\n"), 3);
        assert_eq!(depth("a:\n- b: 1\n  c: 2\n"), 2);
        assert_eq!(depth("a: [1, {b: [2]}]\n"), 4);
        // The scan counts a level for the scalar after the last `- `: one more than there are.
        assert_eq!(depth("- - - x\n"), 4);
        assert_eq!(depth("a:\n  b: [x,\n    [y]]\nc: 1\n"), 4);
    }

    #[test]
    fn text_is_not_structure() {
        assert_eq!(depth("a: '[[[[' # [[[\nb: \"{{\\\"[[\"\nc: x[[[y\n"), 1);
        assert_eq!(depth("a: |\n  [[[[\n    - - - -\n  {{{{\nb: 1\n"), 1);
        assert_eq!(depth("a: [\"]]]]\", 'it''s', x]\n"), 2);
    }

    #[test]
    fn a_quote_inside_a_plain_scalar_does_not_hide_brackets() {
        let deep = format!("a: [x'y, {}]\n", "[".repeat(40));
        assert!(Depth::scan(deep.as_bytes()).is_err());
        let deep = format!("a: [x:'y, {}]\n", "[".repeat(40));
        assert!(Depth::scan(deep.as_bytes()).is_err());
    }

    #[test]
    fn a_block_scalar_does_not_hide_less_indented_lines() {
        let deep = format!("- a: |\n      text\n    b: {}\n", "[".repeat(40));
        assert!(Depth::scan(deep.as_bytes()).is_err());
        let deep = format!("a: |4\n {}\n", "[".repeat(40));
        assert!(Depth::scan(deep.as_bytes()).is_err());
        let deep = format!("a: |\n          \n    x\n    {}\n", "[".repeat(40));
        assert!(Depth::scan(deep.as_bytes()).is_err());
    }

    #[test]
    fn refuses_deep_nesting_at_its_position() {
        let e = Depth::scan(format!("a:\n  b: {}\n", "[".repeat(100)).as_bytes()).unwrap_err();
        // Two block levels, then the 31st bracket (column 5 + 31) is level 33.
        assert_eq!((e.line, e.column), (2, 36));
        let e = Depth::scan("- ".repeat(100).as_bytes()).unwrap_err();
        assert_eq!(e.line, 1);
        let mut nested = String::new();
        for i in 0..40 {
            nested.push_str(&" ".repeat(i));
            nested.push_str("k:\n");
        }
        assert_eq!(Depth::scan(nested.as_bytes()).unwrap_err().line, MAX_DEPTH + 1);
    }

    #[test]
    fn counts_what_aliases_repeat() {
        assert_eq!(aliases("a: &x [1, 2]\nb: *x\nc: *x\n"), Ok(6));
        // Nested aliases multiply: each `*y` brings three `*x` of three nodes each.
        let text = "a: &x [1, 2]\nb: &y [*x, *x, *x]\nc: [*y, *y]\n";
        assert_eq!(aliases(text), Ok(3 * 3 + 2 * (1 + 3 * 3)));
        let laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n\
                      c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n\
                      e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n";
        let e = aliases(laughs).unwrap_err();
        assert_eq!(e.line, 5, "{e:?}");
        let text = format!("a: &x '{}'\nb: [*x, *x]\n", "y".repeat(600_000));
        assert!(aliases(&text).is_err());
    }
}
