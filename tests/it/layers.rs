//! The rooms of `src/` in layers: a room uses rooms of lower layers only, and a room of its
//! own layer only when the pair is listed below with its reason. Read from the `crate::ROOM`
//! paths of product code (comments, literals and `#[cfg(test)]` items left out, wherever in
//! a file they are), so an edge that breaks the table fails here, and so does any cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top to bottom: a room may use the rooms of the layers below its own.
const LAYERS: [(&str, &[&str], &str); 7] = [
    ("tools", &["bench", "calibrate", "fuzzing", "replay"], "commands and harnesses around a running tollgate"),
    ("process", &["instance", "reload"], "one running tollgate: its servers, admin and reloads"),
    ("edge", &["admin", "server", "listen"], "sockets and connections, before and around HTTP"),
    ("request", &["proxy", "explain"], "the compiled config serving a request, and its description"),
    ("step", &["step"], "a route's declared steps, each composing parts, run in order by the request path"),
    (
        "parts",
        &["route", "auth", "gate", "forward", "cache", "compress", "target", "framing", "answer", "body", "trace"],
        "the steps of one request, compiled from the config at `Proxy::build`",
    ),
    (
        "ground",
        &["config", "limit", "metrics", "timer", "request_id", "ratelimit", "workers", "pki", "peer", "jwt"],
        "validated data and pure mechanisms, no sockets and no other room's compiled state",
    ),
];

/// Edges inside one layer, each with why; they must stay acyclic.
const SAME_LAYER: [(&str, &str, &str); 23] = [
    ("instance", "reload", "a running tollgate runs its reloader"),
    ("admin", "server", "the admin listener is served by the server's connection loop"),
    ("server", "listen", "a listener that is not plain runs listen's edge steps before HTTP"),
    ("gate", "answer", "a refusal is an answer"),
    ("auth", "answer", "refused credentials are an answer (401, 403, with their challenge)"),
    ("gate", "body", "a granted slot is held by the answer's body"),
    ("cache", "answer", "a stale copy is served as an answer"),
    ("cache", "body", "copies are captured from and served as bodies"),
    ("compress", "body", "an encoded answer is a body around the one it encodes"),
    ("target", "answer", "a bad target is refused with an answer"),
    ("framing", "answer", "a smuggling attempt is refused with an answer"),
    ("route", "target", "routes match the decided target"),
    ("forward", "answer", "upstream failures become answers"),
    ("forward", "body", "bodies are streamed both ways"),
    ("forward", "target", "the forwarded path is the decided target's"),
    ("answer", "body", "answers are bodies"),
    ("config", "limit", "limits are validated into the limit room's algorithm parameters"),
    ("config", "request_id", "the default request id field and the fields it may not be"),
    ("config", "pki", "the files a config names are read and checked when it loads"),
    ("config", "jwt", "key sets and secrets are parsed and checked when the config loads"),
    ("limit", "pki", "a `rediss://` client's TLS runs on the process's crypto provider"),
    ("metrics", "limit", "limit decisions are counted by label"),
    ("ratelimit", "limit", "the RateLimit fields are written from limit decisions"),
];

/// Rooms and the rooms they use, from every `src/**/*.rs`.
fn room_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    collect(src, &mut files);
    let test_only = test_modules(&files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        if test_only.contains(file) {
            continue;
        }
        let rel = file.strip_prefix(src).expect("under src");
        let first = rel.components().next().expect("a file").as_os_str().to_string_lossy().into_owned();
        let room = first.trim_end_matches(".rs").to_owned();
        if room == "lib" || room == "main" {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("readable");
        let uses = graph.entry(room.clone()).or_default();
        let code = product(&code_only(&text));
        let mut rest = code.as_str();
        while let Some(i) = rest.find("crate::") {
            let before = rest[..i].chars().next_back();
            rest = &rest[i + "crate::".len()..];
            // `$crate::` is this crate too; `other_crate::` is not.
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
            let used = &rest[..end];
            if !used.is_empty() && used != room {
                uses.insert(used.to_owned());
            }
        }
    }
    graph
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src readable") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Files declared as `#[cfg(test)] mod x;`: test code in files of their own.
fn test_modules(files: &[PathBuf]) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(file).expect("readable");
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        for pair in lines.windows(2) {
            let name = pair[1].trim_start_matches("pub ").strip_prefix("mod ").and_then(|m| m.strip_suffix(';'));
            if let (true, Some(name)) = (pair[0] == "#[cfg(test)]", name) {
                // `src/a.rs` declares `src/a/x.rs`; `src/a/mod.rs` would too, none exists.
                let dir = file.with_extension("");
                out.insert(dir.join(format!("{name}.rs")));
                out.insert(dir.join(name).join("mod.rs"));
            }
        }
    }
    out
}

/// `text` without its comments, and with the contents of its string and character literals
/// blanked: what is left is code, whose braces match.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let ident = |j: usize| j > 0 && (b[j - 1].is_ascii_alphanumeric() || b[j - 1] == b'_');
    // `r"…"` or `br"…"`, not the end of an identifier such as `for"`.
    let raw_start = |j: usize| !ident(j) || (b[j - 1] == b'b' && !ident(j - 1));
    while i < b.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |e| e + 2);
        } else if b[i] == b'"' || (b[i] == b'r' && raw_start(i) && matches!(b.get(i + 1), Some(b'"' | b'#'))) {
            // A string, or a raw string `r#"…"#` (a `b` before either changes nothing here).
            let hashes = if b[i] == b'r' { rest[1..].bytes().take_while(|&c| c == b'#').count() } else { 0 };
            let raw = b[i] == b'r';
            let start = i + usize::from(raw) + hashes;
            if b.get(start) != Some(&b'"') {
                out.push(char::from(b[i]));
                i += 1;
                continue;
            }
            let close = format!("\"{}", "#".repeat(hashes));
            let mut j = start + 1;
            while j < b.len() {
                if !raw && b[j] == b'\\' {
                    j += 2;
                } else if b[j..].starts_with(close.as_bytes()) {
                    break;
                } else {
                    j += 1;
                }
            }
            out.push_str("\"\"");
            i = (j + close.len()).min(b.len());
        } else if b[i] == b'\'' {
            // A character literal (`'x'`, `'\n'`, `'\u{7f}'`), else a lifetime.
            let end = if b.get(i + 1) == Some(&b'\\') {
                rest[2..].find('\'').map(|e| e + 3)
            } else {
                rest[1..].chars().next().and_then(|c| {
                    let after = 1 + c.len_utf8();
                    (rest.as_bytes().get(after) == Some(&b'\'')).then_some(after + 1)
                })
            };
            match end {
                Some(n) => {
                    out.push_str("' '");
                    i += n;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let c = rest.chars().next().expect("not at the end");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// `code` without the items under `#[cfg(test)]`: each one up to its `;`, or to the `}` that
/// closes its first `{`.
fn product(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(i) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..i]);
        rest = &rest[i + "#[cfg(test)]".len()..];
        let (mut depth, mut nested) = (0usize, 0usize);
        let mut end = rest.len();
        for (j, c) in rest.char_indices() {
            match c {
                '(' | '[' => nested += 1,
                ')' | ']' => nested = nested.saturating_sub(1),
                ';' if depth == 0 && nested == 0 => {
                    end = j + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn layer_of(room: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, rooms, _)| rooms.contains(&room))
}

/// Edges that break the table: upward, or sideways without a listed reason.
fn broken(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut out = Vec::new();
    for (room, uses) in graph {
        let Some(mine) = layer_of(room) else {
            out.push(format!("`{room}` is in no layer"));
            continue;
        };
        for used in uses {
            let Some(theirs) = layer_of(used) else {
                out.push(format!("{room} -> {used}: `{used}` is in no layer"));
                continue;
            };
            if theirs < mine {
                out.push(format!("{room} ({}) -> {used} ({}): upward", LAYERS[mine].0, LAYERS[theirs].0));
            } else if theirs == mine && !SAME_LAYER.iter().any(|(a, b, _)| a == room && b == used) {
                out.push(format!("{room} -> {used}: same layer ({}) and not allowed", LAYERS[mine].0));
            }
        }
    }
    out
}

/// A cycle of the graph, if any, as its rooms in order (the first repeated at the end).
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit(
        room: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        marks: &mut BTreeMap<String, Mark>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        marks.insert(room.to_owned(), Mark::Open);
        stack.push(room.to_owned());
        for next in graph.get(room).into_iter().flatten() {
            match marks.get(next).copied().unwrap_or(Mark::New) {
                Mark::Open => {
                    let from = stack.iter().position(|r| r == next).expect("on the stack");
                    let mut found = stack[from..].to_vec();
                    found.push(next.clone());
                    return Some(found);
                }
                Mark::New => {
                    if let Some(found) = visit(next, graph, marks, stack) {
                        return Some(found);
                    }
                }
                Mark::Done => {}
            }
        }
        stack.pop();
        marks.insert(room.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for room in graph.keys() {
        if marks.get(room).copied().unwrap_or(Mark::New) == Mark::New {
            if let Some(found) = visit(room, graph, &mut marks, &mut Vec::new()) {
                return Some(found);
            }
        }
    }
    None
}

fn render(graph: &BTreeMap<String, BTreeSet<String>>) -> String {
    graph
        .iter()
        .map(|(room, uses)| format!("{room} -> {}", uses.iter().cloned().collect::<Vec<_>>().join(" ")))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn rooms_use_only_lower_layers_and_have_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = room_graph(&src);
    assert!(graph.len() > 20, "the rooms of src/ were not read:\n{}", render(&graph));
    let broken = broken(&graph);
    let cycle = cycle(&graph).map(|c| c.join(" -> "));
    assert!(
        broken.is_empty() && cycle.is_none(),
        "edges that break the layers:\n{}\n\na cycle between rooms: {}\n\nthe graph:\n{}",
        broken.join("\n"),
        cycle.as_deref().unwrap_or("none"),
        render(&graph)
    );
}

#[test]
fn the_layer_table_is_consistent() {
    let mut seen = BTreeSet::new();
    for (_, rooms, _) in LAYERS {
        for room in rooms {
            assert!(seen.insert(*room), "`{room}` is in two layers");
        }
    }
    for (a, b, _) in SAME_LAYER {
        assert!(layer_of(a).is_some() && layer_of(a) == layer_of(b), "{a} -> {b} is not inside one layer");
    }
    // The allowed same-layer edges alone must not close a cycle.
    let mut allowed: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, b, _) in SAME_LAYER {
        allowed.entry(a.to_owned()).or_default().insert(b.to_owned());
    }
    assert_eq!(cycle(&allowed), None);
    // The checker sees what it must: an upward edge and a cycle.
    let made: BTreeMap<String, BTreeSet<String>> = [
        ("config".to_owned(), BTreeSet::from(["route".to_owned()])),
        ("route".to_owned(), BTreeSet::from(["config".to_owned()])),
    ]
    .into();
    assert_eq!(broken(&made), ["config (ground) -> route (parts): upward"]);
    assert_eq!(cycle(&made), Some(vec!["config".to_owned(), "route".to_owned(), "config".to_owned()]));
}

#[test]
fn the_reader_keeps_product_code_only() {
    let text = r##"use crate::a; // crate::comment
/* crate::block */ const S: &str = "crate::string {";
const R: &str = r#"crate::raw "{"#;
const C: char = '{';
fn f<'x>(v: &'x [u8; 4]) -> &'x str { crate::b::g(v) }
#[cfg(test)]
pub(crate) fn only_in_tests() -> [u8; 2] { crate::test_only::h(); [0; 2] }
fn after() { crate::c::i() }
#[cfg(test)]
mod t;
#[cfg(test)]
mod tests { fn x() { crate::tests_only::y() } }
"##;
    let code = product(&code_only(text));
    let used: Vec<&str> = code.match_indices("crate::").map(|(i, _)| &code[i + 7..i + 8]).collect();
    assert_eq!(used, ["a", "b", "c"], "{code}");
}
