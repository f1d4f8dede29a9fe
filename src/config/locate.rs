//! Finds the line and column of a config field path (`routes[2].upstream`) in the YAML text.
//!
//! serde_yaml reports positions only for errors raised while deserializing. Checks that
//! need the whole document (a route naming a missing upstream) run afterwards, so this
//! re-reads the text with a marked event parser. It runs only on the error path.

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
    Map(Marker, Vec<(String, Node)>),
    Seq(Marker, Vec<Node>),
}

impl Node {
    fn mark(&self) -> Marker {
        match self {
            Node::Scalar(_, m) | Node::Map(m, _) | Node::Seq(m, _) => *m,
        }
    }
}

/// A collection being built; a mapping remembers the key that waits for its value.
enum Frame {
    Map(Marker, Vec<(String, Node)>, Option<String>),
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
                Some(k) => entries.push((k, node)),
                None => {
                    *pending = Some(match node {
                        Node::Scalar(s, _) => s,
                        _ => String::new(),
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
            Event::Alias(_) => self.push_value(Node::Scalar(String::new(), mark)),
            _ => {}
        }
    }
}

/// Line (1-based) and column (1-based) of the value at `path`, or of the deepest part of
/// the path that exists (a missing field points at its parent mapping).
pub fn locate(text: &str, path: &[Seg]) -> Option<(usize, usize)> {
    let mut builder = Builder::default();
    let mut parser = Parser::new_from_str(text);
    if parser.load(&mut builder, false).is_err() {
        return None;
    }
    let mut node = builder.root.as_ref()?;
    for seg in path {
        let next = match (seg, node) {
            (Seg::Key(k), Node::Map(_, entries)) => entries.iter().find(|(key, _)| key == k).map(|(_, v)| v),
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
    fn renders_paths() {
        assert_eq!(render(&p(&["routes", "0", "match", "host"])), "routes[0].match.host");
    }
}
