//! Bounds on the config text, checked before serde_yaml sees it: file size, nesting depth
//! (libyaml's scanner is quadratic in depth long before any recursion limit acts) and what
//! aliases repeat (an alias is expanded at every use, so a small file can stand for a huge one).
//!
//! The depth scan is a single pass over the bytes that follows YAML's structure only as far as
//! it must: block indentation levels, `- `/`? `/`: ` indicators, flow brackets, quoted scalars,
//! block scalars and comments. Where it is unsure it counts a level rather than skip one, so it
//! can refuse an odd but valid file, never let a deep one through to the parser.
//!
//! One concept, though over 600 lines: the bounds on the config text, checked in one pass.

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
pub struct OutOfBounds {
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
pub fn check(text: &str) -> Result<Shape, OutOfBounds> {
    if text.len() > MAX_CONFIG_BYTES {
        return Err(OutOfBounds {
            line: 1,
            column: 1,
            message: format!(
                "the config has more than {MAX_CONFIG_BYTES} bytes; at most {MAX_CONFIG_BYTES} bytes ({} MiB) are accepted",
                MAX_CONFIG_BYTES >> 20
            ),
        });
    }
    let b = text.as_bytes();
    if let Some(at) = odd_line_break(b) {
        let line = 1 + b[..at].iter().filter(|&&c| c == b'\n').count();
        let line_start = b[..at].iter().rposition(|&c| c == b'\n').map_or(0, |p| p + 1);
        return Err(OutOfBounds {
            line,
            column: at - line_start + 1,
            message: "a carriage return without a line feed, or a U+0085, U+2028 or U+2029 character: YAML \
                      parsers disagree on whether these break a line, so they are refused; use LF or CRLF line \
                      endings (and `\\u2028` escapes in double-quoted strings)"
                .to_owned(),
        });
    }
    let depth = Depth::scan(b.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(b))?;
    // Only a `*` can be an alias: texts without one skip the second parse.
    let alias_nodes = if b.contains(&b'*') { aliases(text)? } else { 0 };
    Ok(Shape { depth, alias_nodes })
}

/// The offset of a line break other than LF and CRLF. libyaml (serde_yaml) breaks lines at a
/// lone CR and at NEL, LS and PS too; the scan below and yaml-rust2 would not, and a text
/// they read differently could hide its depth or its aliases from them.
fn odd_line_break(b: &[u8]) -> Option<usize> {
    b.iter().enumerate().find_map(|(i, &c)| {
        let odd = match c {
            b'\r' => b.get(i + 1) != Some(&b'\n'),
            0xC2 => b.get(i + 1) == Some(&0x85),
            0xE2 => b.get(i + 1) == Some(&0x80) && matches!(b.get(i + 2), Some(0xA8 | 0xA9)),
            _ => false,
        };
        odd.then_some(i)
    })
}

/// The depth scanner's state: a stack of block indentation columns and the flow depth.
///
/// It follows libyaml where the two could disagree about what is text: a plain scalar goes on
/// over the following lines indented past the collection that holds it (a quote on such a
/// line is text, not the start of a string), and a block scalar's content indentation is
/// computed as libyaml computes it.
struct Depth<'a> {
    b: &'a [u8],
    /// Byte offset of the next byte to read.
    i: usize,
    line: usize,
    line_start: usize,
    /// Block levels: their column, and whether it is an indentless sequence (a `- ` list at
    /// its key's own column), which lives on across lines at that column that start with `- `.
    block: Vec<(usize, bool)>,
    flow: usize,
    max: usize,
    /// A plain scalar ended its line; it goes on over lines indented past this column (the
    /// indentation of the collection that holds it, -1 at the document's root).
    plain: Option<isize>,
    /// The last line ended with a key and no value (`key:`, or `?`/`:` alone): a `- ` at the
    /// key's own indentation on the next line starts a sequence inside that key's mapping.
    key_open: bool,
}

fn is_ws(c: u8) -> bool {
    c == b' ' || c == b'\t'
}

fn is_flow_indicator(c: u8) -> bool {
    matches!(c, b',' | b'[' | b']' | b'{' | b'}')
}

impl<'a> Depth<'a> {
    fn scan(b: &'a [u8]) -> Result<usize, OutOfBounds> {
        let mut d =
            Depth { b, i: 0, line: 1, line_start: 0, block: Vec::new(), flow: 0, max: 0, plain: None, key_open: false };
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

    fn column(&self, at: usize) -> usize {
        at - self.line_start
    }

    fn refuse(&self, at: usize) -> OutOfBounds {
        OutOfBounds {
            line: self.line,
            column: self.column(at) + 1,
            message: format!(
                "nested deeper than {MAX_DEPTH} levels of lists and maps; a tollgate config needs at most 6 \
                 (this bound is checked before the YAML parser)"
            ),
        }
    }

    fn deeper(&mut self, at: usize) -> Result<(), OutOfBounds> {
        let depth = self.block.len() + self.flow;
        self.max = self.max.max(depth);
        if depth > MAX_DEPTH {
            return Err(self.refuse(at));
        }
        Ok(())
    }

    /// Pushes a block level at `column` unless the innermost one is already there or deeper;
    /// true if it pushed.
    fn push_block(&mut self, column: usize, at: usize) -> Result<bool, OutOfBounds> {
        if self.block.last().is_none_or(|&(top, _)| top < column) {
            self.block.push((column, false));
            self.deeper(at)?;
            return Ok(true);
        }
        Ok(false)
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
    fn line_of_block(&mut self) -> Result<(), OutOfBounds> {
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
            // Blank lines are folded into a plain scalar; they do not end it.
            Some(b'\n' | b'\r') => {
                self.next_line();
                return Ok(());
            }
            Some(b'#') => {
                self.plain = None;
                self.next_line();
                return Ok(());
            }
            _ => {}
        }
        if q == start {
            let rest = &self.b[q..];
            if rest.starts_with(b"%") {
                self.plain = None;
                self.next_line();
                return Ok(());
            }
            if (rest.starts_with(b"---") || rest.starts_with(b"...")) && self.blank_at(q + 3) {
                self.block.clear();
                self.plain = None;
                self.key_open = false;
                self.i = q + 3;
                return self.node(false, -1, false);
            }
        }
        if let Some(owner) = self.plain.take() {
            if self.column(q) as isize > owner {
                self.plain = Some(owner);
                self.i = q;
                return self.continuation();
            }
        }
        let entry = self.peek(p) == Some(b'-') && self.blank_at(p + 1);
        while let Some(&(top, indentless)) = self.block.last() {
            if top <= indent || (indentless && entry && top == indent + 1) {
                break;
            }
            self.block.pop();
        }
        let pushed = self.push_block(indent, p)?;
        if std::mem::take(&mut self.key_open) && !pushed && entry && self.push_block(indent + 1, p)? {
            // An indentless sequence: the value of the key above, at the key's indentation.
            if let Some(level) = self.block.last_mut() {
                level.1 = true;
            }
        }
        // The collection holding this line's first node: the level above a new one, or this
        // level itself.
        let owner = if pushed {
            self.block.len().checked_sub(2).map_or(-1, |i| self.block[i].0 as isize)
        } else {
            indent as isize
        };
        self.i = p;
        self.node(true, owner, false)
    }

    /// A line that goes on with a plain scalar: text up to `: ` (libyaml refuses that in a
    /// multi-line scalar; scanning on only counts more) or a comment.
    fn continuation(&mut self) -> Result<(), OutOfBounds> {
        loop {
            match self.peek(self.i) {
                None => return Ok(()),
                Some(b'\n' | b'\r') => {
                    self.next_line();
                    return Ok(());
                }
                Some(b':') if self.blank_at(self.i + 1) => {
                    self.plain = None;
                    self.i += 1;
                    return self.node(false, -1, true);
                }
                Some(b'#') if is_ws(self.b[self.i - 1]) => {
                    self.plain = None;
                    self.next_line();
                    return Ok(());
                }
                Some(_) => self.i += 1,
            }
        }
    }

    /// A node in block context at `self.i`, then whatever follows it on the line. `fresh`: the
    /// line's first node (a `:` there is an indicator, not the value of a key on this line).
    /// `owner`: the indentation of the collection that holds the node. `after_key`: a key's `:`
    /// was just read (a line that ends here leaves the key open).
    fn node(&mut self, mut fresh: bool, mut owner: isize, mut after_key: bool) -> Result<(), OutOfBounds> {
        loop {
            while self.peek(self.i).is_some_and(is_ws) {
                self.i += 1;
            }
            let Some(c) = self.peek(self.i) else { return Ok(()) };
            let col = self.column(self.i);
            match c {
                b'\n' | b'\r' | b'#' => {
                    self.key_open = after_key;
                    self.next_line();
                    return Ok(());
                }
                b'-' | b'?' | b':' if self.blank_at(self.i + 1) && (c != b':' || fresh) => {
                    // `- - x` and `? ? x` nest on one line: the content is one level deeper.
                    let mut p = self.i + 1;
                    while self.peek(p).is_some_and(is_ws) {
                        p += 1;
                    }
                    // With nothing after it on the line, its node still is one level deeper.
                    let content = self.peek(p).is_some_and(|c| c != b'\n' && c != b'\r' && c != b'#');
                    let column = if content { self.column(p) } else { col + 1 };
                    if !self.push_block(column, p)? && !content {
                        // An entry of an indentless sequence, whose own level already sits at
                        // this column: its node, on the lines below, is one level deeper still.
                        self.block.push((column, false));
                        self.deeper(p)?;
                    }
                    self.i = p;
                    fresh = true;
                    // `?` or `:` alone on its line leaves a key (or its value) open like `key:`.
                    after_key = !content && c != b'-';
                    owner = col as isize;
                }
                b'[' | b'{' => {
                    self.flow(self.i)?;
                    return self.after_node(col);
                }
                b'"' | b'\'' => {
                    self.quoted(c);
                    return self.after_node(col);
                }
                b'|' | b'>' => {
                    self.block_scalar(owner);
                    return Ok(());
                }
                b'&' | b'!' => {
                    while !self.blank_at(self.i) {
                        self.i += 1;
                    }
                    // Properties that end their line belong to a node on the lines below (as
                    // `? &a` then `- x`): it is open like a key without its value.
                    let mut p = self.i;
                    while self.peek(p).is_some_and(is_ws) {
                        p += 1;
                    }
                    if matches!(self.peek(p), None | Some(b'\n' | b'\r' | b'#')) {
                        after_key = true;
                    }
                }
                b'*' => {
                    while !self.blank_at(self.i) {
                        self.i += 1;
                    }
                    return self.after_node(col);
                }
                _ => {
                    // A plain scalar: it ends at `: ` (it was a key), ` #` or the line's end
                    // (and then may go on over the next lines).
                    loop {
                        match self.peek(self.i) {
                            None | Some(b'\n' | b'\r') => {
                                self.plain = Some(owner);
                                return Ok(());
                            }
                            Some(b':') if self.blank_at(self.i + 1) => {
                                self.i += 1;
                                break;
                            }
                            Some(b'#') if is_ws(self.b[self.i - 1]) => {
                                self.next_line();
                                return Ok(());
                            }
                            Some(_) => self.i += 1,
                        }
                    }
                    fresh = false;
                    after_key = true;
                    owner = col as isize;
                }
            }
        }
    }

    /// After a quoted scalar, an alias or a flow collection that began at column `col`: a `:`
    /// makes it a key.
    fn after_node(&mut self, col: usize) -> Result<(), OutOfBounds> {
        while self.peek(self.i).is_some_and(is_ws) {
            self.i += 1;
        }
        let key = self.peek(self.i) == Some(b':');
        if key {
            self.i += 1;
        }
        // Anything else is a syntax error for the parser; scanning it as a node only counts more.
        self.node(false, col as isize, key)
    }

    /// Skips a quoted scalar opening at `self.i`, across lines (to its closing quote, as
    /// libyaml reads it whatever the lines' indentation).
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

    /// Skips a block scalar (`|` or `>` at `self.i`) held by the collection at column `owner`:
    /// the header line, then its content lines, with the content indentation libyaml uses (an
    /// explicit indicator counts from `owner`; else the most indented of the leading blank
    /// lines and the first content line, at least one past `owner`).
    fn block_scalar(&mut self, owner: isize) {
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
        let base = usize::try_from(owner).unwrap_or(0);
        let mut content: Option<usize> = explicit.map(|k| if owner >= 0 { base + k } else { k });
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
                    let floor = if owner >= 0 { base + 1 } else { 1 };
                    let at = spaces.max(leading_blank).max(floor);
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

    /// A flow collection opening at `at`, to its matching close (across lines). A `key: value`
    /// (or `? key`) entry of a flow sequence is a one-pair mapping: a level of its own until the
    /// entry ends.
    fn flow(&mut self, at: usize) -> Result<(), OutOfBounds> {
        // Open collections: whether a sequence, and whether its current entry is such a pair.
        let mut open: Vec<(bool, bool)> = Vec::new();
        // `start`: the next token begins a node (quotes open a scalar only there).
        // `closed`: the last token was a quoted scalar or a collection (`"a":b` JSON style).
        let (mut start, mut closed, mut ws) = (true, false, false);
        self.i = at;
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
                    open.push((c == b'[', false));
                    self.flow += 1;
                    self.deeper(here)?;
                    (start, closed) = (true, false);
                }
                b']' | b'}' => {
                    if let Some((_, pair)) = open.pop() {
                        self.flow -= 1 + usize::from(pair);
                    }
                    if open.is_empty() {
                        return Ok(());
                    }
                    (start, closed) = (false, true);
                }
                b',' => {
                    if let Some((_, pair)) = open.last_mut() {
                        if std::mem::take(pair) {
                            self.flow -= 1;
                        }
                    }
                    (start, closed) = (true, false);
                }
                b':' => {
                    let next = self.peek(self.i);
                    let value =
                        closed || next.is_none_or(|n| is_ws(n) || n == b'\n' || n == b'\r' || is_flow_indicator(n));
                    if value {
                        self.pair(&mut open, here)?;
                    }
                    (start, closed) = (value, false);
                }
                b'?' if start && self.blank_at(self.i) => self.pair(&mut open, here)?,
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

    /// A `:` or `?` in a flow collection: in a sequence, its entry becomes a one-pair mapping.
    fn pair(&mut self, open: &mut [(bool, bool)], at: usize) -> Result<(), OutOfBounds> {
        if let Some((true, pair @ false)) = open.last_mut() {
            *pair = true;
            self.flow += 1;
            self.deeper(at)?;
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
fn aliases(text: &str) -> Result<u64, OutOfBounds> {
    let mut parser = Parser::new_from_str(text);
    // Open collections: their anchor id and weight so far.
    let mut open: Vec<(usize, Weight)> = Vec::new();
    let mut anchored: std::collections::HashMap<usize, Weight> = std::collections::HashMap::new();
    let mut repeated = Weight::default();
    loop {
        let (event, mark) = parser.next_token().map_err(|e| OutOfBounds {
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
                    return Err(OutOfBounds {
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
        assert_eq!(depth("a:\n- b: 1\n  c: 2\n"), 3);
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
        // A leading blank line wider than the first content line sets the indentation.
        let deep = format!("a: |\n          \n    x: {}\n", "[".repeat(40));
        assert!(Depth::scan(deep.as_bytes()).is_err());
    }

    #[test]
    fn a_quote_on_a_line_that_goes_on_with_a_plain_scalar_is_text() {
        // libyaml reads `abc "def` as one plain scalar and `z:` as the next key.
        let deep = format!("k: abc\n \"def\nz: {}\nw: \"\n", "[".repeat(40));
        assert!(Depth::scan(deep.as_bytes()).is_err());
        let deep = format!("- abc\n  'def\n- {}\n- '\n", "[".repeat(40));
        assert!(Depth::scan(deep.as_bytes()).is_err());
        // …while a line at the holding collection's indentation is structure again.
        assert_eq!(depth("k: abc\n  \"def [[[[\n  more\nz: 1\n"), 1);
    }

    #[test]
    fn a_block_scalar_s_content_indentation_is_libyaml_s() {
        // `- |`: the sequence at column 0 holds it, so column 1 is content already.
        let deep = format!("- |\n \"text\nx: {}\n\"\n", "[".repeat(40));
        assert!(Depth::scan(deep.as_bytes()).is_err());
        assert_eq!(depth("- |\n  [[[[\n- x\n"), 2);
    }

    #[test]
    fn line_breaks_yaml_parsers_disagree_on_are_refused() {
        for text in ["a: 1\rb: [x]\n", "a: 1\u{85}b: 2\n", "a: 1\n\u{2028}b: 2\n", "a: '\u{2029}'\n"] {
            let e = check(text).unwrap_err();
            assert!(e.message.contains("carriage return"), "{e:?}");
        }
        assert_eq!(check("a: 1\r\nb: [x]\r\n").map(|s| s.depth), Ok(2));
        assert_eq!(check("\u{feff}a: [[x]]\n").map(|s| s.depth), Ok(3));
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

    /// Nesting of a parsed value: the root collection is 1.
    fn value_depth(v: &serde_yaml::Value) -> usize {
        use serde_yaml::Value;
        match v {
            Value::Sequence(items) => 1 + items.iter().map(value_depth).max().unwrap_or(0),
            Value::Mapping(m) => 1 + m.iter().map(|(k, v)| value_depth(k).max(value_depth(v))).max().unwrap_or(0),
            Value::Tagged(t) => value_depth(&t.value),
            _ => 0,
        }
    }

    /// Undercounts the differential test below found (each was fixed).
    #[test]
    fn cases_found_by_the_differential_test() {
        for text in ["? \n- ", "? \n- :: ", "&a b: [? : ]", ":: \n- \n- :: :[", "? &a \n- :x:"] {
            let want = value_depth(&serde_yaml::from_str(text).unwrap());
            assert!(depth(text) >= want, "{text:?}: {} < {want}", depth(text));
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 4000, ..Default::default() })]
        /// Differential against serde_yaml (libyaml): whatever it parses, the scan never
        /// counts less nesting than the parsed value has.
        #[test]
        fn the_scan_never_counts_less_than_libyaml_parses(parts in proptest::collection::vec(proptest::sample::select(vec![
            "[", "]", "{", "}", "- ", "? ", ": ", ":", "a", "b: ", "\"x\"", "'y'", "\"", "'", " #c", " ", "\n", "  ", "    ",
            "|", ">", "|2", "&a ", "*a", ", ", ",", "\n- ", "\n  ", "\n    ", "x:", "'it''s'", "\\", "---\n", "\t",
            "\n- - ", "\n? ", "\n: ", "{a: ", "[a: ", "\"a\":", "\n ", "x\n", "|\n", ">-\n ", "#", "!t ", "\n\n",
        ]), 0..64)) {
            let text: String = parts.concat();
            if let Ok(v) = serde_yaml::from_str::<serde_yaml::Value>(&text) {
                let want = value_depth(&v);
                match Depth::scan(text.as_bytes()) {
                    Ok(got) => proptest::prop_assert!(got >= want, "scan {got} < parsed {want}: {text:?}"),
                    Err(_) => proptest::prop_assert!(want > 0),
                }
            }
        }
    }

    #[test]
    fn an_empty_entry_of_an_indentless_sequence_counts_the_node_below_it() {
        // Found by the property test below: the entry's mapping sits one level under the list.
        let text = "x:\n- #>-\n x:";
        let want = value_depth(&serde_yaml::from_str::<serde_yaml::Value>(text).unwrap());
        assert_eq!(want, 3);
        assert!(Depth::scan(text.as_bytes()).unwrap() >= want);
    }

    /// A YAML tree, written out below in mixed styles.
    #[derive(Debug, Clone)]
    enum Tree {
        Leaf(u8),
        Seq(Vec<Tree>),
        Map(Vec<Tree>),
    }

    fn tree_depth(t: &Tree) -> usize {
        match t {
            Tree::Leaf(_) => 0,
            Tree::Seq(c) | Tree::Map(c) => 1 + c.iter().map(tree_depth).max().unwrap_or(0),
        }
    }

    /// Scalars whose text looks like structure: brackets in quotes, plain text and block scalars.
    fn flow_leaf(n: u8) -> &'static str {
        ["a", "'[ ''x'' {'", "\"[\\\"{,]\"", "b c", "'#[ {'", "\"x\\\\\""][usize::from(n % 6)]
    }

    /// Writes `t` as a flow node.
    fn write_flow(t: &Tree, out: &mut String) {
        match t {
            Tree::Leaf(n) => out.push_str(flow_leaf(*n)),
            Tree::Seq(c) => {
                out.push('[');
                for (i, x) in c.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_flow(x, out);
                }
                out.push(']');
            }
            Tree::Map(c) => {
                out.push('{');
                for (i, x) in c.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    out.push_str(&format!("k{i}: "));
                    write_flow(x, out);
                }
                out.push('}');
            }
        }
    }

    /// Writes a block scalar value for a node held by the collection at `indent` (the text
    /// after `key:` or `- `, through the end of its last line).
    fn write_block_leaf(n: u8, indent: usize, out: &mut String) {
        let more = " ".repeat(indent + 2);
        match n % 5 {
            0 => out.push_str(" a [b {c\n"),
            1 => out.push_str(&format!(" |\n{more}[[ x ]\n{more}  {{ \"y\n")),
            // A plain scalar over three lines; its next lines look like structure and strings.
            2 => out.push_str(&format!(" a\n{more}\"b [[\n{more}- 'c\n")),
            3 => out.push_str(&format!(" >-\n\n{more}'[[\n")),
            _ => {
                out.push(' ');
                out.push_str(flow_leaf(n / 5));
                out.push('\n');
            }
        }
    }

    /// Writes the value of a key or sequence entry held by the collection at `indent`.
    fn write_value(x: &Tree, indent: usize, choices: &mut dyn Iterator<Item = bool>, out: &mut String) {
        match x {
            Tree::Leaf(n) => write_block_leaf(*n, indent, out),
            Tree::Seq(c) | Tree::Map(c) if c.is_empty() || choices.next().unwrap_or(false) => {
                out.push(' ');
                write_flow(x, out);
                out.push('\n');
            }
            _ => {
                out.push('\n');
                write_block(x, indent + 2, choices, out);
            }
        }
    }

    /// Writes `t` in block style at `indent`; `choices` picks styles (flow, indentless).
    fn write_block(t: &Tree, indent: usize, choices: &mut dyn Iterator<Item = bool>, out: &mut String) {
        let pad = " ".repeat(indent);
        match t {
            Tree::Leaf(n) => {
                out.push_str(&pad);
                out.push_str(flow_leaf(*n));
                out.push('\n');
            }
            Tree::Seq(c) => {
                for x in c {
                    out.push_str(&pad);
                    out.push('-');
                    write_value(x, indent, choices, out);
                }
            }
            Tree::Map(c) => {
                for (i, x) in c.iter().enumerate() {
                    out.push_str(&format!("{pad}k{i}:"));
                    if let (Tree::Seq(items), true) = (x, choices.next().unwrap_or(false)) {
                        if !items.is_empty() {
                            // An indentless sequence: its `- ` at the key's own column.
                            out.push('\n');
                            write_block(x, indent, choices, out);
                            continue;
                        }
                    }
                    write_value(x, indent, choices, out);
                }
            }
        }
    }

    fn tree() -> impl proptest::strategy::Strategy<Value = Tree> {
        use proptest::prelude::*;
        (0u8..30).prop_map(Tree::Leaf).prop_recursive(10, 80, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 1..4).prop_map(Tree::Seq),
                proptest::collection::vec(inner, 1..4).prop_map(Tree::Map),
            ]
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 1000, ..Default::default() })]
        /// Valid documents of known depth, in mixed block and flow styles with scalars that look
        /// like structure: the scan never counts less than they nest.
        #[test]
        fn the_scan_never_counts_less_than_a_document_nests(
            t in proptest::strategy::Strategy::prop_filter(tree(), "a collection at the root", |t| !matches!(t, Tree::Leaf(_))),
            picks in proptest::collection::vec(proptest::bool::ANY, 64),
        ) {
            let mut text = String::new();
            write_block(&t, 0, &mut picks.into_iter().cycle(), &mut text);
            let want = tree_depth(&t);
            let parsed = serde_yaml::from_str::<serde_yaml::Value>(&text);
            proptest::prop_assert!(parsed.as_ref().is_ok_and(|v| value_depth(v) == want), "{parsed:?}\n{text}");
            match Depth::scan(text.as_bytes()) {
                Ok(got) => proptest::prop_assert!(got >= want, "scan {got} < {want}:\n{text}"),
                Err(_) => proptest::prop_assert!(want > 0),
            }
        }
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
