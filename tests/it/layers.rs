//! The rooms of `src/` in layers: a room uses rooms of lower layers only, and a room of its
//! own layer only when the pair is listed below with its reason. Read from the paths of product
//! code as the compiler resolves them (comments, literals and `#[cfg(test)]` items left out,
//! wherever in a file they are): `crate::` and `$crate::` paths whole, grouped or nested
//! (`use crate::{gate::Gate, proxy};`), `super::` that climbs out of a room (from inline
//! modules too), and the names the crate root re-exports; a glob of the crate root, or the
//! root under another name, is refused. An edge that breaks the table fails here, and so does
//! any cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top to bottom: a room may use the rooms of the layers below its own.
const LAYERS: [(&str, &[&str], &str); 7] = [
    (
        "tools",
        &["bench", "calibrate", "fuzzing", "replay", "trust"],
        "commands and harnesses around a running tollgate",
    ),
    ("process", &["instance", "reload"], "one running tollgate: its servers, admin and reloads"),
    ("edge", &["admin", "server", "listen", "acme"], "sockets and connections, before and around HTTP"),
    ("request", &["proxy", "explain"], "the compiled config serving a request, and its description"),
    ("step", &["step"], "a route's declared steps, each composing parts, run in order by the request path"),
    (
        "parts",
        &["route", "auth", "gate", "forward", "cache", "compress", "target", "framing", "answer", "body", "trace"],
        "the steps of one request, compiled from the config at `Proxy::build`",
    ),
    (
        "ground",
        &[
            "config",
            "limit",
            "metrics",
            "timer",
            "request_id",
            "request_key",
            "ratelimit",
            "workers",
            "pki",
            "peer",
            "jwt",
        ],
        "validated data and pure mechanisms, no sockets and no other room's compiled state",
    ),
];

/// Edges inside one layer, each with why; they must stay acyclic.
const SAME_LAYER: [(&str, &str, &str); 25] = [
    ("instance", "reload", "a running tollgate runs its reloader"),
    ("admin", "server", "the admin listener is served by the server's connection loop"),
    ("server", "listen", "a listener that is not plain runs listen's edge steps before HTTP"),
    ("server", "acme", "a plain listener answers ACME HTTP-01 validations before routing"),
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
    ("request_key", "limit", "a request's key material is encoded and hashed as the limit room defines keys"),
];

/// Rooms and the rooms they use, from every `src/**/*.rs`.
fn room_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    collect(src, &mut files);
    let test_only = test_modules(&files);
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let root = Root::read(&product(&code_only(&lib)));
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        if test_only.contains(file) {
            continue;
        }
        let rel = file.strip_prefix(src).expect("under src");
        let module = module_path(rel);
        let Some(room) = module.first().cloned() else { continue };
        if room == "main" {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("readable");
        let used = uses(&module, &product(&code_only(&text)), &root);
        let entry = graph.entry(room.clone()).or_default();
        entry.extend(used.into_iter().filter(|u| *u != room));
    }
    graph
}

/// The module path of a file under `src/`: `gate/limit.rs` is `gate::limit`, `lib.rs` the root.
fn module_path(rel: &Path) -> Vec<String> {
    let mut out: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if let Some(last) = out.last_mut() {
        *last = last.trim_end_matches(".rs").to_owned();
        if last == "mod" || last == "lib" {
            out.pop();
        }
    }
    out
}

/// What the crate root holds: its modules (the rooms) and the names it re-exports, by room.
struct Root {
    modules: BTreeSet<String>,
    reexports: BTreeMap<String, String>,
}

impl Root {
    fn read(lib: &str) -> Root {
        let tokens = tokens(lib);
        let mut modules = BTreeSet::new();
        for w in tokens.windows(2) {
            if w[0] == "mod" && is_ident(&w[1]) {
                modules.insert(w[1].clone());
            }
        }
        let mut reexports = BTreeMap::new();
        let mut i = 0;
        while i < tokens.len() {
            if tokens[i] == "use" {
                let mut leaves = Vec::new();
                i = use_tree(&tokens, i + 1, &mut Vec::new(), &mut leaves);
                for (path, name) in leaves {
                    if let (Some(room), Some(name)) = (path.first(), name) {
                        if modules.contains(room) {
                            reexports.insert(name, room.clone());
                        }
                    }
                }
            } else {
                i += 1;
            }
        }
        Root { modules, reexports }
    }

    /// The room an absolute path (from the crate root) reaches: a room module, or a name the
    /// root re-exports from one. `Err`: a path that names no room (an unknown item, or a glob
    /// of the root itself, which would hide what it uses).
    fn room(&self, path: &[String]) -> Result<String, String> {
        match path.first().map(String::as_str) {
            Some("*") => Err("* (a glob of the crate root)".to_owned()),
            None => Err("crate (the crate root under another name)".to_owned()),
            Some(first) if self.modules.contains(first) => Ok(first.to_owned()),
            Some(first) => self.reexports.get(first).cloned().ok_or_else(|| first.to_owned()),
        }
    }
}

fn is_ident(t: &str) -> bool {
    t.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// The tokens of code (comments and literals already blanked): identifiers and keywords, `::`,
/// and every other character alone; numbers and whitespace left out. `r#name` is `name`.
fn tokens(code: &str) -> Vec<String> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            if &code[start..i] == "r"
                && b.get(i) == Some(&b'#')
                && b.get(i + 1).is_some_and(|c| c.is_ascii_alphabetic())
            {
                continue;
            }
            out.push(code[start..i].to_owned());
        } else if c.is_ascii_digit() {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'.') {
                i += 1;
            }
        } else if code[i..].starts_with("::") {
            out.push("::".to_owned());
            i += 2;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else {
            let ch = code[i..].chars().next().expect("not at the end");
            out.push(ch.to_string());
            i += ch.len_utf8();
        }
    }
    out
}

/// Reads a use tree (or a plain path) from `tokens[i]`, under `prefix`, into `leaves`: each
/// full path with the name it brings in (`None` for `*` and for a path that is not a `use`).
/// Returns the index after it.
fn use_tree(
    tokens: &[String],
    mut i: usize,
    prefix: &mut Vec<String>,
    leaves: &mut Vec<(Vec<String>, Option<String>)>,
) -> usize {
    let depth = prefix.len();
    loop {
        match tokens.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                while tokens.get(i).is_some_and(|t| t != "}") {
                    let next = use_tree(tokens, i, prefix, leaves);
                    i = if next == i { i + 1 } else { next };
                    if tokens.get(i).is_some_and(|t| t == ",") {
                        i += 1;
                    }
                }
                prefix.truncate(depth);
                return i + 1;
            }
            Some("*") => {
                let mut path = prefix.clone();
                path.push("*".to_owned());
                leaves.push((path, None));
                prefix.truncate(depth);
                return i + 1;
            }
            Some(t) if is_ident(t) => {
                prefix.push(t.to_owned());
                i += 1;
                if tokens.get(i).is_some_and(|t| t == "::") {
                    i += 1;
                    continue;
                }
                let mut name = prefix.last().cloned();
                if tokens.get(i).is_some_and(|t| t == "as") {
                    name = tokens.get(i + 1).cloned();
                    i += 2;
                }
                // `self` in a group names the group's own path.
                let mut path = prefix.clone();
                if path.last().is_some_and(|l| l == "self") && path.len() > 1 {
                    path.pop();
                    if name.as_deref() == Some("self") {
                        name = path.last().cloned();
                    }
                }
                leaves.push((path, name));
                prefix.truncate(depth);
                return i;
            }
            // Anything else ends the path (`crate::x::<T>`, `crate::f(…)`): what was read counts.
            _ => {
                if prefix.len() > depth {
                    leaves.push((prefix.clone(), None));
                }
                prefix.truncate(depth);
                return i;
            }
        }
    }
}

/// The rooms the code of the module at `module` reaches, as the compiler resolves its paths:
/// every path that starts at `crate` (or `$crate`), or climbs out of the room with `super`,
/// whether written whole (`crate::gate::Gate`), grouped (`use crate::{gate::Gate, proxy};`),
/// spread over lines or nested in groups. Inline modules (`mod x { … }`) are followed, so a
/// `super` inside one climbs from it. A path that names no room is returned as `?name`.
fn uses(module: &[String], code: &str, root: &Root) -> BTreeSet<String> {
    let tokens = tokens(code);
    let mut out = BTreeSet::new();
    // Inline modules: (name, the brace depth inside them).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i].as_str();
        match t {
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d > depth) {
                    inline.pop();
                }
            }
            "mod" if tokens.get(i + 2).is_some_and(|t| t == "{") && is_ident(&tokens[i + 1]) => {
                inline.push((tokens[i + 1].clone(), depth + 1));
            }
            _ => {}
        }
        let starts = matches!(t, "crate" | "super" | "self")
            && tokens.get(i + 1).is_some_and(|n| n == "::")
            && !(i > 0 && tokens[i - 1] == "::");
        if !starts {
            i += 1;
            continue;
        }
        let here: Vec<String> = module.iter().cloned().chain(inline.iter().map(|(m, _)| m.clone())).collect();
        let mut leaves = Vec::new();
        let next = use_tree(&tokens, i, &mut Vec::new(), &mut leaves);
        for (path, _) in leaves {
            // Resolve the leading `crate` / `self` / `super`s against this module.
            let mut base: Vec<String> = here.clone();
            let mut rest = path.as_slice();
            match rest.first().map(String::as_str) {
                Some("crate") => {
                    base.clear();
                    rest = &rest[1..];
                }
                Some("self") => rest = &rest[1..],
                _ => {}
            }
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
            base.extend(rest.iter().cloned());
            match root.room(&base) {
                Ok(room) => {
                    out.insert(room);
                }
                // Inside the module's own room (`super::x` from `gate::limit`): nothing crossed.
                Err(_) if base.first() == module.first() => {}
                Err(what) => {
                    out.insert(format!("?{what}"));
                }
            }
        }
        // Braces of a group were read by `use_tree`: they do not open inline modules.
        i = next.max(i + 1);
    }
    out
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

/// A `src/` of a few files in a temp dir, removed on drop.
struct FakeSrc(PathBuf);

impl FakeSrc {
    fn new(name: &str, files: &[(&str, &str)]) -> FakeSrc {
        let dir = std::env::temp_dir().join(format!("tollgate-layers-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let p = dir.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        FakeSrc(dir)
    }
}

impl Drop for FakeSrc {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The reader sees what the compiler resolves: a grouped import, a path over several lines,
/// `super::` out of a room (from its root file, from a file below it, from an inline module),
/// and a name the crate root re-exports.
#[test]
fn the_reader_follows_grouped_imports_and_super_paths() {
    let lib = "mod config;\nmod gate;\nmod limit;\nmod proxy;\nmod trace;\nmod metrics;\npub use proxy::{Proxy, Shared as Both};\n";
    // (name, files besides lib.rs, the edges the reader must see)
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: [Case; 6] = [
        ("grouped", &[("limit.rs", "use crate::{gate::Gate, proxy::Proxy};\n")], &["limit -> gate", "limit -> proxy"]),
        (
            "nested",
            &[("limit.rs", "use crate::{config::{self, Seg}, gate::{limit::{Limit}}};\nfn f() { crate::\n    trace::x::<u8>(); }\n")],
            &["limit -> config", "limit -> gate", "limit -> trace"],
        ),
        ("super", &[("config.rs", "use super::proxy::Proxy;\n")], &["config -> proxy"]),
        (
            "super-deep",
            &[("limit/store.rs", "use super::Decision;\nuse super::super::gate::Gate;\n"), ("limit.rs", "mod store;\n")],
            &["limit -> gate"],
        ),
        (
            "inline",
            &[("metrics.rs", "mod shown {\n    use super::super::trace::Span;\n}\nfn g() {}\n")],
            &["metrics -> trace"],
        ),
        ("reexport", &[("config.rs", "fn f(p: crate::Both) {}\n")], &["config -> proxy"]),
    ];
    for (name, files, want) in cases {
        let mut all = vec![("lib.rs", lib)];
        all.extend_from_slice(files);
        let src = FakeSrc::new(name, &all);
        let graph = room_graph(&src.0);
        let edges: Vec<String> =
            graph.iter().flat_map(|(a, bs)| bs.iter().map(move |b| format!("{a} -> {b}"))).collect();
        assert_eq!(edges, want, "{name}");
        // Each of these goes up the table (ground -> parts, request): the test fails on it.
        assert!(!broken(&graph).is_empty(), "{name}: {edges:?}");
    }
    // A glob of the crate root, or the root under another name, hides what is used through
    // it: refused, not passed.
    for (name, text, what) in
        [("glob", "use super::*;\n", "?* (a glob"), ("alias", "use crate::{self as c};\n", "?crate (")]
    {
        let src = FakeSrc::new(name, &[("lib.rs", lib), ("config.rs", text)]);
        let graph = room_graph(&src.0);
        assert!(broken(&graph).iter().any(|b| b.contains(&format!("config -> {what}"))), "{name}: {graph:?}");
    }
}

/// ARCHITECTURE.md says the same as this file: its layer table names the same rooms in each
/// layer, and its table of edges inside a layer the same edges (a room added to one and not
/// the other fails here).
#[test]
fn architecture_md_has_the_same_tables() {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md")).unwrap();
    // The rows of the table whose header row is `header`.
    let rows = |header: &str| -> Vec<Vec<String>> {
        let start = text.find(&format!("{header}\n")).unwrap_or_else(|| panic!("a table `{header}`"));
        text[start..]
            .lines()
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            .map(|l| l.trim_matches('|').split(" | ").map(|c| c.trim().to_owned()).collect())
            .collect()
    };
    // The names in backticks of a cell, before any parenthesis' own backticks are counted:
    // `instance` (with `instance::process`: …) names `instance`.
    let rooms = |cell: &str| -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let mut depth = 0;
        let mut rest = cell;
        while let Some(c) = rest.chars().next() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                '`' if depth == 0 => {
                    let end = rest[1..].find('`').expect("a closing backtick") + 1;
                    out.insert(rest[1..end].to_owned());
                    rest = &rest[end + 1..];
                    continue;
                }
                _ => {}
            }
            rest = &rest[c.len_utf8()..];
        }
        out
    };
    let md: Vec<(String, BTreeSet<String>)> =
        rows("| layer | rooms | why |").into_iter().map(|r| (r[0].clone(), rooms(&r[1]))).collect();
    let ours: Vec<(String, BTreeSet<String>)> = LAYERS
        .iter()
        .map(|(name, rooms, _)| ((*name).to_owned(), rooms.iter().map(|r| (*r).to_owned()).collect()))
        .collect();
    assert_eq!(md, ours, "the layer table of ARCHITECTURE.md and LAYERS");
    let md: BTreeSet<(String, String)> = rows("| edge | reason |")
        .iter()
        .flat_map(|r| {
            r[0].split(", ").map(|e| {
                let (a, b) = e.split_once(" → ").expect("`a → b`");
                (a.trim().to_owned(), b.trim().to_owned())
            })
        })
        .collect();
    let ours: BTreeSet<(String, String)> =
        SAME_LAYER.iter().map(|(a, b, _)| ((*a).to_owned(), (*b).to_owned())).collect();
    assert_eq!(md, ours, "the same-layer edges of ARCHITECTURE.md and SAME_LAYER");
}

/// `limit` knows keys and their digest, not requests: no product code of the room names a
/// request's head, its fields, its target or its forwarding fields (`request_key` reads them).
#[test]
fn the_limit_room_reads_no_request() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![src.join("limit.rs")];
    collect(&src.join("limit"), &mut files);
    let test_only = test_modules(&files);
    let request = ["Parts", "Request", "HeaderMap", "HeaderValue", "Uri", "uri", "headers", "FORWARDED"];
    let mut found = Vec::new();
    for file in files.iter().filter(|f| !test_only.contains(*f)) {
        let code = product(&code_only(&std::fs::read_to_string(file).unwrap()));
        for t in tokens(&code) {
            if request.contains(&t.as_str()) {
                found.push(format!("{}: {t}", file.strip_prefix(&src).unwrap().display()));
            }
        }
    }
    found.dedup();
    assert!(found.is_empty(), "the limit room reads requests: {found:?}");
}
