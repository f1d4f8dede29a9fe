//! The docs are tested: every ```yaml block of README.md and docs/ is a config `tollgate check`
//! accepts (or, marked `<!-- fragment -->` on the line before it, at least valid YAML), every
//! relative link and `#anchor` in the Markdown resolves, and every config in examples/ loads,
//! starts and answers a request.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use tollgate::config::Config;

use crate::support::redis::RedisNode;
use crate::support::tls::{connect, Client, Dir};
use crate::support::Tollgate;

/// The line that marks the next ```yaml block as part of a config, not a whole one.
const FRAGMENT: &str = "<!-- fragment -->";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every Markdown file under the folders that hold docs.
fn markdown_files() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md"), root().join("BENCHMARKS.md")];
    for dir in ["docs", "examples", "benchmarks"] {
        walk(&root().join(dir), &mut out);
    }
    out
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut paths: Vec<PathBuf> = entries.map(|e| e.unwrap().path()).collect();
    paths.sort();
    for p in paths {
        if p.is_dir() {
            walk(&p, out);
        } else if p.extension().is_some_and(|e| e == "md") {
            out.push(p);
        }
    }
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// A fenced code block: its info string, first line number (1-based, the fence's) and text.
struct Block {
    info: String,
    line: usize,
    text: String,
    fragment: bool,
}

/// A Markdown file split into what the test reads: fenced blocks, headings' anchors, links.
struct Doc {
    blocks: Vec<Block>,
    anchors: HashSet<String>,
}

/// GitHub's heading slug: lower case, spaces to `-`, every character but letters, digits,
/// `-` and `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn parse(text: &str) -> Doc {
    let mut doc = Doc { blocks: Vec::new(), anchors: HashSet::new() };
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut open: Option<Block> = None;
    let mut previous = "";
    for (i, line) in text.lines().enumerate() {
        if let Some(fence) = line.trim_start().strip_prefix("```") {
            match open.take() {
                Some(block) => doc.blocks.push(block),
                None => {
                    let fragment = previous.trim() == FRAGMENT;
                    open = Some(Block { info: fence.trim().to_owned(), line: i + 1, text: String::new(), fragment });
                }
            }
            previous = line;
            continue;
        }
        if let Some(block) = open.as_mut() {
            block.text.push_str(line);
            block.text.push('\n');
            continue;
        }
        if !line.trim().is_empty() {
            previous = line;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            let s = slug(&line[hashes + 1..]);
            let n = seen.entry(s.clone()).or_insert(0);
            doc.anchors.insert(if *n == 0 { s } else { format!("{s}-{n}") });
            *n += 1;
        }
    }
    assert!(open.is_none(), "a code block is never closed");
    doc
}

/// (line, target) of every `[text](target)` and `![alt](target)` outside code blocks and
/// code spans (a `](` after an odd number of backticks on its line is code).
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut from = 0;
        while let Some(at) = line[from..].find("](").map(|a| a + from) {
            let after = &line[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            if line[..at].matches('`').count() % 2 == 0 {
                out.push((i + 1, after[..end].to_owned()));
            }
            from = at + 2 + end;
        }
    }
    out
}

/// Files a config names that must exist for `check` to accept it: `{cert, key}` pairs, CA
/// files, a plans client file.
#[derive(Default)]
struct Named {
    pairs: Vec<(String, String)>,
    cas: Vec<String>,
    /// `admin.token_file`: a token is written there.
    tokens: Vec<String>,
    clients: Option<String>,
    /// `auth`: key set files (not URLs), HS256 secret files, API keys files.
    jwks: Vec<String>,
    secrets: Vec<String>,
    keys: Vec<String>,
}

fn named_files(v: &serde_yaml::Value, out: &mut Named) {
    match v {
        serde_yaml::Value::Mapping(m) => {
            let s = |k: &str| m.get(k).and_then(|v| v.as_str()).map(str::to_owned);
            if let (Some(c), Some(k)) = (s("cert"), s("key")) {
                out.pairs.push((c, k));
            }
            out.cas.extend(s("ca_file"));
            out.tokens.extend(s("token_file"));
            out.cas.extend(s("client_ca"));
            out.cas.extend(s("directory_ca"));
            out.secrets.extend(s("hmac_key_file"));
            out.jwks.extend(s("jwks").filter(|j| !j.starts_with("http://") && !j.starts_with("https://")));
            out.secrets.extend(s("secret_file"));
            if m.get("keys").is_some_and(serde_yaml::Value::is_string) {
                out.keys.extend(s("keys"));
            }
            for (_, v) in m {
                named_files(v, out);
            }
        }
        serde_yaml::Value::Sequence(s) => s.iter().for_each(|v| named_files(v, out)),
        _ => {}
    }
}

/// Writes `name` under `dir`: the file of that name in examples/ when there is one, else
/// `make()`.
fn provide(dir: &Dir, name: &str, make: impl FnOnce() -> String) -> Result<(), String> {
    if Path::new(name).is_absolute() {
        return Err(format!("`{name}`: name files relative to the config (the docs' examples are checked)"));
    }
    let target = dir.path(name);
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let shipped = root().join("examples").join(name);
    let text = match std::fs::read_to_string(&shipped) {
        Ok(t) => t,
        Err(_) => make(),
    };
    std::fs::write(&target, text).unwrap();
    Ok(())
}

/// `tollgate check` on one block: the text as a file in a folder of its own, beside the files
/// it names.
fn check_config(text: &str) -> Result<Config, String> {
    let value: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| format!("not YAML: {e}"))?;
    let mut named = Named::default();
    named_files(&value, &mut named);
    named.clients = value.get("plans").and_then(|p| p.get("clients")).and_then(|c| c.as_str()).map(str::to_owned);
    let dir = Dir::new();
    for (cert, key) in &named.pairs {
        let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        provide(&dir, cert, || made.cert.pem())?;
        provide(&dir, key, || made.signing_key.serialize_pem())?;
    }
    for ca in &named.cas {
        provide(&dir, ca, || rcgen::generate_simple_self_signed(vec!["ca".to_owned()]).unwrap().cert.pem())?;
    }
    for token in &named.tokens {
        provide(&dir, token, || "docs-example-admin-token-0123456789\n".to_owned())?;
    }
    for jwks in &named.jwks {
        provide(&dir, jwks, || {
            r#"{"keys":[{"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}"#.to_owned()
        })?;
    }
    for secret in &named.secrets {
        provide(&dir, secret, || "docs-example-hs256-secret-0123456789abcdef\n".to_owned())?;
    }
    for keys in &named.keys {
        provide(&dir, keys, || "# none\n".to_owned())?;
    }
    if let Some(clients) = &named.clients {
        provide(&dir, clients, || "{}\n".to_owned())?;
    }
    let file = dir.write("config.yaml", text);
    Config::load(&file).map_err(|e| e.to_string().replace(&file.display().to_string(), "block"))
}

#[test]
fn every_yaml_block_in_the_docs_is_a_config_check_accepts() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for md in markdown_files() {
        let text = std::fs::read_to_string(&md).unwrap();
        for b in parse(&text).blocks.iter().filter(|b| b.info == "yaml") {
            let result = if b.fragment {
                serde_yaml::from_str::<serde_yaml::Value>(&b.text).map(|_| ()).map_err(|e| format!("not YAML: {e}"))
            } else {
                check_config(&b.text).map(|_| ())
            };
            checked += 1;
            if let Err(e) = result {
                problems.push(format!("{}:{}: {e}", rel(&md), b.line));
            }
        }
    }
    assert!(checked >= 20, "only {checked} yaml blocks found");
    assert!(problems.is_empty(), "{} yaml block(s) fail:\n{}", problems.len(), problems.join("\n"));
}

#[test]
fn every_relative_link_and_anchor_in_the_docs_resolves() {
    let files = markdown_files();
    let mut anchors: BTreeMap<PathBuf, HashSet<String>> = BTreeMap::new();
    for md in &files {
        anchors.insert(md.clone(), parse(&std::fs::read_to_string(md).unwrap()).anchors);
    }
    let mut problems = Vec::new();
    let mut checked = 0;
    for md in &files {
        let text = std::fs::read_to_string(md).unwrap();
        for (line, target) in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() { md.clone() } else { md.parent().unwrap().join(path) };
            let Ok(file) = file.canonicalize() else {
                problems.push(format!("{}:{line}: `{target}`: no such file", rel(md)));
                continue;
            };
            if !file.starts_with(root().canonicalize().unwrap()) {
                problems.push(format!("{}:{line}: `{target}`: outside the repository", rel(md)));
                continue;
            }
            if let Some(anchor) = anchor {
                match anchors.iter().find(|(p, _)| p.canonicalize().ok().as_ref() == Some(&file)) {
                    Some((_, set)) if set.contains(anchor) => {}
                    Some(_) => problems.push(format!("{}:{line}: `{target}`: no heading with that anchor", rel(md))),
                    None => problems
                        .push(format!("{}:{line}: `{target}`: an anchor into a file that is not Markdown", rel(md))),
                }
            }
        }
    }
    assert!(checked >= 50, "only {checked} relative links found");
    assert!(problems.is_empty(), "{} broken link(s):\n{}", problems.len(), problems.join("\n"));
}

#[test]
fn the_readme_shows_the_shipped_config() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let at = readme.find("## The shipped config").expect("README has `## The shipped config`");
    let block = parse(&readme[at..]).blocks.into_iter().find(|b| b.info == "yaml").expect("a yaml block");
    let shown = check_config(&block.text).unwrap();
    let shipped = Config::load(&root().join("proxy.yaml")).unwrap();
    assert_eq!(tollgate::explain::explain(&shown), tollgate::explain::explain(&shipped));
}

/// The example configs (a plans client file is not one).
fn example_configs() -> Vec<PathBuf> {
    let dir = root().join("examples");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yaml") && !p.ends_with("clients.yaml") && !p.ends_with("orgs.yaml")
        })
        .collect();
    out.sort();
    out
}

#[test]
fn there_is_an_example_per_guide() {
    let names: Vec<String> =
        example_configs().iter().map(|p| p.file_stem().unwrap().to_string_lossy().into_owned()).collect();
    for guide in std::fs::read_dir(root().join("docs/guides")).unwrap() {
        let stem = guide.unwrap().path().file_stem().unwrap().to_string_lossy().into_owned();
        assert!(names.contains(&stem), "docs/guides/{stem}.md has no examples/{stem}.yaml");
    }
}

/// The Redis the examples name (`redis://127.0.0.1:6380`), replaced by one of the test's own.
const EXAMPLE_REDIS: &str = "redis://127.0.0.1:6380";

#[tokio::test]
async fn every_example_starts_and_answers() {
    let mut redis: Option<RedisNode> = None;
    let mut started = 0;
    for path in example_configs() {
        let mut text = std::fs::read_to_string(&path).unwrap();
        if text.contains(EXAMPLE_REDIS) {
            let node = redis.get_or_insert_with(RedisNode::start);
            text = text.replace(EXAMPLE_REDIS, &node.url());
        }
        // Loaded as the file itself, so the files it names resolve from examples/.
        let mut config = Config::from_yaml(&path, &text).unwrap_or_else(|e| panic!("{}: {e}", rel(&path)));
        let tls: Vec<bool> = config.listeners.iter().map(|l| l.tls.is_some()).collect();
        // A local CA of the test's own, so nothing is written outside it.
        let local_ca = Dir::new();
        let mut internal = false;
        for m in config.listeners.iter_mut().filter_map(|l| l.tls.as_mut()).flat_map(|t| t.managed.iter_mut()) {
            if let tollgate::config::CertSource::Internal(i) = &mut m.source {
                let mut own = tollgate::config::managed::Internal::clone(i);
                own.storage = local_ca.0.clone();
                *i = Arc::new(own);
                internal = true;
            }
        }
        // With certificates tollgate gets itself, as `tollgate run` wires it (the manager
        // puts them in service before the first accept).
        let (addrs, mut gate, instance) = if internal {
            let bound = crate::support::acme::Bound::new(config.listeners.len()).await;
            let addrs = bound.addrs.clone();
            (addrs, None, Some(crate::support::acme::Instance::start_config(bound, config).await))
        } else {
            let gate = Tollgate::start_config(config).await;
            (gate.addrs.clone(), Some(gate), None)
        };
        for (i, addr) in addrs.into_iter().enumerate() {
            let status = if tls.get(i).copied().unwrap_or(false) {
                let demo = CertificateDer::from_pem_file(root().join("examples/certs/demo-localhost.pem")).unwrap();
                let mut roots = rustls::RootCertStore::empty();
                roots.add(demo).unwrap();
                if internal {
                    let pem = local_ca.path("local-ca/root.pem");
                    roots.add(CertificateDer::from_pem_file(pem).expect("the local CA's root")).unwrap();
                }
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let mut client = rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .unwrap()
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                client.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
                let tls = connect(addr, "localhost", Arc::new(client)).await.unwrap();
                Client::over(tls).await.get("localhost", "/v1/items").await.0
            } else {
                crate::support::get(addr, "/v1/items").await.0
            };
            println!("{} listener {i}: GET /v1/items -> {status}", rel(&path));
            assert!(status.as_u16() < 600, "{}: no answer", rel(&path));
        }
        if let Some(g) = gate.as_mut() {
            g.shutdown();
        }
        if let Some(i) = instance {
            i.stop().await;
        }
        started += 1;
    }
    assert!(started >= 5, "only {started} examples");
}

/// The configs of docker-compose.yml and of the Kubernetes manifest, which no example starts
/// (they name hosts of their own networks): `check` accepts them, an admin listener off
/// loopback only with a token. tls.yaml's certificate is made by a container at `/certs/`, the
/// manifest's admin token is a Secret mounted at `/etc/tollgate-admin/`; here each is a
/// stand-in beside the config.
#[test]
fn the_deploy_configs_pass_the_check() {
    let checked = |text: &str, what: &str| {
        let config = check_config(text).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(config.admin_exposed.is_none(), "{what}: `tollgate check` refuses its admin listener");
    };
    let deploy = root().join("deploy");
    for name in ["gateway.yaml", "upstream.yaml", "tls.yaml"] {
        let text = std::fs::read_to_string(deploy.join(name)).unwrap().replace("/certs/", "certs/");
        checked(&text, &format!("deploy/{name}"));
    }
    let manifest = std::fs::read_to_string(deploy.join("kubernetes.yaml")).unwrap();
    let mut configs = 0;
    for doc in serde_yaml::Deserializer::from_str(&manifest) {
        let value = <serde_yaml::Value as serde::Deserialize>::deserialize(doc).unwrap();
        if let Some(text) = value.get("data").and_then(|d| d.get("proxy.yaml")).and_then(|t| t.as_str()) {
            let text = text.replace("/etc/tollgate-admin/", "tollgate-admin/");
            checked(&text, "deploy/kubernetes.yaml, the ConfigMap's proxy.yaml");
            configs += 1;
        }
    }
    assert_eq!(configs, 1, "deploy/kubernetes.yaml holds one config");
}
