//! Finds the line and column of a config field path (`routes[2].upstream`) in the YAML text,
//! and the first key given twice in one mapping.
//!
//! serde_yaml reports positions only for errors raised while deserializing. Checks that
//! need the whole document (a route naming a missing upstream) run afterwards, so this
//! re-reads the text with a marked event parser; [`locate`] runs only on the error path.
//! serde_yaml also lets the last of two equal keys of a map win (`upstreams: { a: …, a: … }`)
//! and reports two equal fields without a position, so [`duplicate_key`] reads every text
//! once before it.

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

/// One step of a field path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seg {
    Key(String),
    Index(usize),
}

/// Renders a path the way the error messages print it: `routes[0].match.host`.
pub fn render(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Index(i) => {
                out.push('[');
                out.push_str(&i.to_string());
                out.push(']');
            }
        }
    }
    out
}

enum Node {
    Scalar(String, Marker),
    /// `*name`: what it stands for is not followed.
    Alias(Marker),
    Map(Marker, Vec<Entry>),
    Seq(Marker, Vec<Node>),
}

/// A mapping's entry: its key (`None` unless a scalar), where the key is, and the value.
struct Entry {
    key: Option<String>,
    at: Marker,
    value: Node,
}

impl Node {
    fn mark(&self) -> Marker {
        match self {
            Node::Scalar(_, m) | Node::Alias(m) | Node::Map(m, _) | Node::Seq(m, _) => *m,
        }
    }
}

/// A collection being built; a mapping remembers the key that waits for its value.
enum Frame {
    Map(Marker, Vec<Entry>, Option<(Option<String>, Marker)>),
    Seq(Marker, Vec<Node>),
}

#[derive(Default)]
struct Builder {
    stack: Vec<Frame>,
    root: Option<Node>,
}

impl Builder {
    fn push_value(&mut self, node: Node) {
        match self.stack.last_mut() {
            None => self.root = Some(node),
            Some(Frame::Seq(_, items)) => items.push(node),
            Some(Frame::Map(_, entries, pending)) => match pending.take() {
                Some((key, at)) => entries.push(Entry { key, at, value: node }),
                None => {
                    let at = node.mark();
                    *pending = Some(match node {
                        Node::Scalar(s, _) => (Some(s), at),
                        _ => (None, at),
                    })
                }
            },
        }
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        match ev {
            Event::Scalar(value, ..) => self.push_value(Node::Scalar(value, mark)),
            Event::MappingStart(..) => self.stack.push(Frame::Map(mark, Vec::new(), None)),
            Event::SequenceStart(..) => self.stack.push(Frame::Seq(mark, Vec::new())),
            Event::MappingEnd | Event::SequenceEnd => {
                let node = match self.stack.pop() {
                    Some(Frame::Map(m, entries, _)) => Node::Map(m, entries),
                    Some(Frame::Seq(m, items)) => Node::Seq(m, items),
                    None => return,
                };
                self.push_value(node);
            }
            Event::Alias(_) => self.push_value(Node::Alias(mark)),
            _ => {}
        }
    }
}

/// Line (1-based) and column (1-based) of the value at `path`, or of the deepest part of
/// the path that exists (a missing field points at its parent mapping).
pub fn locate(text: &str, path: &[Seg]) -> Option<(usize, usize)> {
    let root = tree(text)?;
    let mut node = &root;
    for seg in path {
        let next = match (seg, node) {
            (Seg::Key(k), Node::Map(_, entries)) => {
                entries.iter().find(|e| e.key.as_deref() == Some(k.as_str())).map(|e| &e.value)
            }
            (Seg::Index(i), Node::Seq(_, items)) => items.get(*i),
            _ => None,
        };
        match next {
            Some(n) => node = n,
            None => break,
        }
    }
    let m = node.mark();
    Some((m.line(), m.col() + 1))
}

/// The first document of `text` as a tree, or `None` if yaml-rust2 cannot read it. A byte
/// order mark is left out: yaml-rust2 would read it as part of the first key (and editors
/// count no column for it).
fn tree(text: &str) -> Option<Node> {
    let mut builder = Builder::default();
    let mut parser = Parser::new_from_str(text.strip_prefix('\u{feff}').unwrap_or(text));
    parser.load(&mut builder, false).ok()?;
    builder.root
}

/// A key given a second time in one mapping.
#[derive(Debug, PartialEq, Eq)]
pub struct Duplicate {
    /// The path of the second occurrence (`upstreams.ok`).
    pub path: Vec<Seg>,
    /// Line and column (1-based) of the second occurrence's key.
    pub line: usize,
    pub column: usize,
    /// The line of the first occurrence.
    pub first_line: usize,
}

/// The first key (in the order of the text) that a mapping gives twice, comparing keys as
/// the strings serde_yaml reads (`a`, `'a'` and `"a"` are the same key). `None` if there is
/// none, or if yaml-rust2 cannot read the text (serde_yaml then reports the syntax error).
/// Keys that are not scalars (an alias, a complex key) are not compared.
pub fn duplicate_key(text: &str) -> Option<Duplicate> {
    let root = tree(text)?;
    let mut path = Vec::new();
    first_duplicate(&root, &mut path)
}

fn first_duplicate(node: &Node, path: &mut Vec<Seg>) -> Option<Duplicate> {
    match node {
        Node::Map(_, entries) => {
            let mut seen: std::collections::HashMap<&str, Marker> = std::collections::HashMap::new();
            for e in entries {
                if let Some(k) = e.key.as_deref() {
                    if let Some(first) = seen.insert(k, e.at) {
                        path.push(Seg::Key(k.to_owned()));
                        return Some(Duplicate {
                            path: std::mem::take(path),
                            line: e.at.line(),
                            column: e.at.col() + 1,
                            first_line: first.line(),
                        });
                    }
                    path.push(Seg::Key(k.to_owned()));
                } else {
                    path.push(Seg::Key(String::new()));
                }
                let found = first_duplicate(&e.value, path);
                if found.is_some() {
                    return found;
                }
                path.pop();
            }
            None
        }
        Node::Seq(_, items) => {
            for (i, item) in items.iter().enumerate() {
                path.push(Seg::Index(i));
                let found = first_duplicate(item, path);
                if found.is_some() {
                    return found;
                }
                path.pop();
            }
            None
        }
        Node::Scalar(..) | Node::Alias(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "listen: 127.0.0.1:8080\nroutes:\n  - name: a\n    upstream: x\n  - name: b\n    match: { path: /b }\n    upstream: y\n";

    fn p(segs: &[&str]) -> Vec<Seg> {
        segs.iter()
            .map(|s| match s.parse::<usize>() {
                Ok(i) => Seg::Index(i),
                Err(_) => Seg::Key((*s).to_owned()),
            })
            .collect()
    }

    #[test]
    fn finds_nested_values() {
        assert_eq!(locate(DOC, &p(&["listen"])), Some((1, 9)));
        assert_eq!(locate(DOC, &p(&["routes", "0", "upstream"])), Some((4, 15)));
        assert_eq!(locate(DOC, &p(&["routes", "1", "upstream"])), Some((7, 15)));
        assert_eq!(locate(DOC, &p(&["routes", "1", "match", "path"])), Some((6, 20)));
    }

    #[test]
    fn missing_field_points_at_parent() {
        assert_eq!(locate(DOC, &p(&["routes", "0", "nope"])).map(|(l, _)| l), Some(3));
    }

    #[test]
    fn finds_the_first_key_given_twice_in_any_mapping() {
        let at = |text: &str| duplicate_key(text).map(|d| (render(&d.path), d.line, d.column, d.first_line));
        assert_eq!(at(DOC), None);
        // Flow and block mappings, at any depth, quoted or not; the second occurrence's key.
        assert_eq!(at("upstreams: { ok: 1, ok: 2 }\n"), Some(("upstreams.ok".into(), 1, 21, 1)));
        assert_eq!(at("listen: a\nroutes: []\nlisten: b\n"), Some(("listen".into(), 3, 1, 1)));
        assert_eq!(
            at("routes:\n  - name: a\n    match:\n      host: x\n      'host': y\n"),
            Some(("routes[0].match.host".into(), 5, 7, 4))
        );
        // The first in the text wins, even if deeper.
        assert_eq!(at("a: { b: 1, b: 2 }\na: 3\n").map(|d| d.0), Some("a.b".into()));
        // Equal keys in different mappings, equal values, a key inside a list item's value.
        assert_eq!(at("a: { x: 1 }\nb: { x: 1 }\nc: [{ x: 1 }, { x: 1 }]\n"), None);
        // Not YAML: serde_yaml reports it.
        assert_eq!(at("a: [\n"), None);
    }

    #[test]
    fn renders_paths() {
        assert_eq!(render(&p(&["routes", "0", "match", "host"])), "routes[0].match.host");
    }
}
