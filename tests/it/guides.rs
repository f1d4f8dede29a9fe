//! The first hour, as written: the README's tour and each guide's steps are run here with the
//! guide's own commands and files, and fail when a step no longer works as the page says.
//!
//! A step is a command line of the page (`Guide::run` first checks that the page holds it
//! word for word), run by bash from a copy of the clone's `proxy.yaml` and `examples/`, with
//! the built `tollgate` first on `PATH` and `cargo run --release --` read as `tollgate` (the
//! README says they are the same). The only change is the ports: the fixed ports of the pages
//! (8080, 9901, 3000, …) become free ones, in the commands and in the copied configs alike,
//! so that tests run side by side. What the page shows a command printing (`# …` lines under
//! it, or the output block after it) is checked against what it printed.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::tls::Dir;
use crate::support::Upstream;

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn free() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let target = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &target);
        } else {
            std::fs::copy(&p, &target).unwrap();
        }
    }
}

/// A page's command lines: `\`-continued lines joined, as bash reads them.
fn commands(block: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut open = String::new();
    for line in block.lines() {
        match line.strip_suffix('\\') {
            Some(part) => {
                open.push_str(part);
            }
            None => {
                open.push_str(line);
                out.push(std::mem::take(&mut open).split_whitespace().collect::<Vec<_>>().join(" "));
            }
        }
    }
    out
}

/// The fenced blocks of a page: (info, text).
fn blocks(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in text.lines() {
        if let Some(info) = line.trim_start().strip_prefix("```") {
            match open.take() {
                Some(b) => out.push(b),
                None => open = Some((info.trim().to_owned(), String::new())),
            }
            continue;
        }
        if let Some((_, t)) = open.as_mut() {
            t.push_str(line);
            t.push('\n');
        }
    }
    out
}

/// A page being followed: its copy of the clone, the ports moved, the variables its steps set.
struct Guide {
    page: String,
    text: String,
    dir: Dir,
    ports: Vec<(String, String)>,
    env: BTreeMap<String, String>,
    servers: Vec<std::process::Child>,
    logs: Vec<PathBuf>,
}

impl Drop for Guide {
    fn drop(&mut self) {
        for c in &mut self.servers {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Guide {
    fn open(page: &str) -> Guide {
        let text = std::fs::read_to_string(root().join(page)).unwrap();
        let dir = Dir::new();
        copy_dir(&root().join("examples"), &dir.path("examples"));
        std::fs::copy(root().join("proxy.yaml"), dir.path("proxy.yaml")).unwrap();
        std::fs::create_dir_all(dir.path("bin")).unwrap();
        std::os::unix::fs::symlink(BIN, dir.path("bin/tollgate")).unwrap();
        Guide {
            page: page.to_owned(),
            text,
            dir,
            ports: Vec::new(),
            env: BTreeMap::new(),
            servers: Vec::new(),
            logs: Vec::new(),
        }
    }

    /// The page's `port` becomes a free one, in later commands and in every copied config.
    fn port(&mut self, port: u16) -> SocketAddr {
        let addr = free();
        let (from, to) = (format!(":{port}"), format!(":{}", addr.port()));
        let mut files = Vec::new();
        for d in [self.dir.path("examples"), self.dir.path("examples/replay"), self.dir.0.clone()] {
            for e in std::fs::read_dir(d).unwrap() {
                let p = e.unwrap().path();
                if p.extension().is_some_and(|e| e == "yaml") {
                    files.push(p);
                }
            }
        }
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            let moved = text.replace(&format!("127.0.0.1{from}"), &format!("127.0.0.1{to}"));
            std::fs::write(&f, moved.replace(&format!("localhost{from}"), &format!("localhost{to}"))).unwrap();
        }
        self.ports.push((from, to));
        addr
    }

    /// `line` as bash will run it: the page's ports moved, `cargo run --release --` as
    /// `tollgate`. Fails unless the page holds `line`.
    fn line(&self, line: &str) -> String {
        let found = blocks(&self.text)
            .iter()
            .filter(|(info, _)| info == "sh")
            .flat_map(|(_, b)| commands(b))
            .any(|c| c == line || c.split(" #").next().is_some_and(|c| c.trim_end() == line));
        assert!(found, "{}: no command `{line}` in its sh blocks", self.page);
        let mut run =
            line.replace("cargo run --release -- ", "tollgate ").replace("target/release/tollgate ", "tollgate ");
        if run == "cargo run --release" {
            run = "tollgate".to_owned();
        }
        // `tollgate proxy` listens on :8080 unless told otherwise: told the moved port.
        if run.starts_with("tollgate proxy ") && !run.contains("--from") {
            if let Some((_, to)) = self.ports.iter().find(|(from, _)| from == ":8080") {
                run = run.replacen("tollgate proxy ", &format!("tollgate proxy --from 127.0.0.1{to} "), 1);
            }
        }
        for (from, to) in &self.ports {
            run = run.replace(&format!("localhost{from}"), &format!("localhost{to}"));
            run = run.replace(&format!("127.0.0.1{from}"), &format!("127.0.0.1{to}"));
            run = run.replace(&format!(" {from}"), &format!(" {to}"));
            // `redis-server --port 6380`, `redis-cli -p 6380`.
            let (f, t) = (&from[1..], &to[1..]);
            run = run.replace(&format!("--port {f} "), &format!("--port {t} "));
            run = run.replace(&format!("-p {f} "), &format!("-p {t} "));
        }
        run
    }

    fn bash(&self, script: &str) -> Command {
        let mut c = Command::new("bash");
        let path = format!("{}:{}", self.dir.path("bin").display(), std::env::var("PATH").unwrap_or_default());
        c.arg("-c").arg(script).current_dir(&self.dir.0).env("PATH", path).envs(&self.env);
        c
    }

    /// Runs the page's command `line` to its end; its output (stdout, then stderr). It must
    /// exit 0.
    fn run(&self, line: &str) -> String {
        self.run_edited(line, |l| l)
    }

    /// [`Guide::run`] with the page's command edited first (for a step tried again, whose
    /// first try left state behind).
    fn run_edited(&self, line: &str, edit: impl Fn(String) -> String) -> String {
        let out = self.bash(&edit(self.line(line))).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{}: `{line}` failed ({}):\n{text}", self.page, out.status);
        text
    }

    /// Runs `VAR=$(command)` of the page and keeps VAR for the next steps.
    fn set(&mut self, line: &str) {
        let (var, command) = line.split_once("=$(").unwrap();
        let command = command.strip_suffix(')').unwrap();
        let script = self.line(line).replacen(&format!("{var}=$("), "printf %s \"$(", 1) + "\"";
        let _ = command;
        let out = self.bash(&script).output().unwrap();
        assert!(out.status.success(), "{}: `{line}`: {}", self.page, String::from_utf8_lossy(&out.stderr));
        let value = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        assert!(!value.is_empty(), "{}: `{line}` set nothing", self.page);
        self.env.insert(var.to_owned(), value);
    }

    /// Starts the page's server command `line` (a trailing `&` dropped) and waits until
    /// `addr` accepts; its log goes to a file ([`Guide::log`]).
    async fn serve(&mut self, line: &str, addr: SocketAddr) {
        let run = self.line(line);
        let run = run.trim_end().trim_end_matches('&').trim_end().to_owned();
        let log = self.dir.path(&format!("server-{}.log", self.servers.len()));
        let file = std::fs::File::create(&log).unwrap();
        let child = self
            .bash(&format!("exec {run}"))
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        self.servers.push(child);
        self.logs.push(log);
        let deadline = Instant::now() + Duration::from_secs(60);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            let exited = self.servers.last_mut().unwrap().try_wait().unwrap();
            assert!(exited.is_none(), "{}: `{line}` exited: {exited:?}\n{}", self.page, self.log());
            assert!(Instant::now() < deadline, "{}: `{line}` does not listen on {addr}", self.page);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the servers started so far.
    fn stop(&mut self) {
        for c in &mut self.servers {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.servers.clear();
    }

    /// What the servers logged so far.
    fn log(&self) -> String {
        self.logs.iter().map(|l| std::fs::read_to_string(l).unwrap_or_default()).collect()
    }

    /// The `# …` lines the page shows under `line` in its sh block: what it prints.
    fn shown(&self, line: &str) -> Vec<String> {
        for (_, b) in blocks(&self.text).iter().filter(|(i, _)| i == "sh") {
            let lines = commands(b);
            if let Some(at) = lines.iter().position(|l| l == line) {
                return lines[at + 1..].iter().map_while(|l| l.strip_prefix("# ").map(str::to_owned)).collect();
            }
        }
        panic!("{}: no line `{line}`", self.page)
    }

    /// The output block right after the sh block whose last command is `line`.
    fn output_after(&self, line: &str) -> String {
        let all = blocks(&self.text);
        let at = all
            .iter()
            .position(|(i, b)| i == "sh" && commands(b).last().is_some_and(|c| c == line))
            .unwrap_or_else(|| panic!("{}: no sh block ending with `{line}`", self.page));
        let (info, text) = &all[at + 1];
        assert!(info.is_empty() || info == "text", "{}: the block after `{line}` is ```{info}", self.page);
        text.clone()
    }
}

/// Every line of `want` (trimmed, blank ones skipped) is a line of `got`.
fn has_lines(page: &str, what: &str, want: &str, got: &str) {
    let got_lines: Vec<&str> = got.lines().map(str::trim).collect();
    for w in want.lines().map(str::trim).filter(|l| !l.is_empty()) {
        assert!(got_lines.contains(&w), "{page}: `{what}` printed no line\n  {w}\nit printed:\n{got}");
    }
}

#[tokio::test]
async fn the_readme_tour() {
    let mut g = Guide::open("README.md");
    let addr = g.port(8080);
    g.serve("cargo run --release", addr).await;
    let out = g.run("curl -i localhost:8080/");
    assert!(out.starts_with("HTTP/1.1 200 OK") && out.contains("hello from tollgate"), "{out}");
    assert!(g.run("curl -i localhost:8080/slow").starts_with("HTTP/1.1 200 OK"));
    assert!(g.run("curl -i --http2-prior-knowledge localhost:8080/").starts_with("HTTP/2 200"));
    // The page's burst starts from a full bucket (a person types between the commands; 5/s
    // refills 10 in 2 s). The 11th request comes from a second curl: on a loaded machine it
    // may start after a token came back, so the step is tried again (from a full bucket).
    let burst = r#"curl -s -o /dev/null -w '%{http_code} ' "localhost:8080/?n=[1-10]"; echo; curl -i localhost:8080/"#;
    let mut tries = 0;
    let out = loop {
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        let out = g.run(burst);
        tries += 1;
        if out.contains("HTTP/1.1 429") || tries == 5 {
            break out;
        }
    };
    let mut lines = out.lines();
    assert_eq!(lines.next().map(str::trim), Some("200 200 200 200 200 200 200 200 200 200"), "{out}");
    for want in ["HTTP/1.1 429 Too Many Requests", "retry-after: 1", "ratelimit-policy: \"per-client\";q=10;w=2"] {
        assert!(out.lines().any(|l| l.trim() == want), "no `{want}` in:\n{out}");
    }
    let explained = g.run("cargo run --release -- explain -c proxy.yaml");
    let shown = "route `everything-else` -> upstream `demo`\n  per client IP `per-client`: bursts of 10, then 5 requests/s (one every 200ms); request 11 of a burst gets 429 with Retry-After: 1";
    has_lines("README.md", "explain", shown, &explained);
    assert!(g.run("cargo run --release -- check -c proxy.yaml").starts_with("config ok"));
    let replayed = g.run("cargo run --release -- replay -c proxy.yaml --format nginx examples/replay/access.log");
    assert!(replayed.contains("3000 requests") && replayed.contains("would get 429"), "{replayed}");
}

// Commands run blocking: the in-process upstream needs a thread of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_command_serves_with_a_limit_over_real_sockets() {
    let app = Upstream::fixed("from the app\n").await;
    let mut g = Guide::open("README.md");
    let addr = g.port(8080);
    g.ports.push((":3000".to_owned(), format!(":{}", app.addr.port())));
    g.serve("tollgate proxy --to http://localhost:3000 --limit 10/s", addr).await;
    // A burst of 10 (the rate's count), then 429 for the same client.
    let out = g
        .bash(&format!("curl -s -o /dev/null -w '%{{http_code}} ' 'http://127.0.0.1:{}/x?n=[1-12]'", addr.port()))
        .output()
        .unwrap();
    let codes = String::from_utf8_lossy(&out.stdout).into_owned();
    let codes: Vec<&str> = codes.split_whitespace().collect();
    assert_eq!(codes.len(), 12);
    assert!(codes[..10].iter().all(|c| *c == "200"), "{codes:?}");
    assert_eq!(codes[11], "429", "{codes:?}");
    let (status, headers, body) = crate::support::get(addr, "/").await;
    assert!(status == 429 || &body[..] == b"from the app\n");
    assert!(headers.contains_key("x-request-id"));
    // The access log is on: a line per request.
    assert!(g.log().contains("tollgate::access"), "{}", g.log());
    // --print-config makes a file that `check` and `run` take, with the same limit.
    let mut printed =
        g.bash("tollgate proxy --to http://localhost:3000 --limit 100/s --burst 200 --print-config > dev.yaml");
    assert!(printed.status().unwrap().success());
    let checked = g.bash("tollgate -c dev.yaml check && tollgate -c dev.yaml explain").output().unwrap();
    let text = String::from_utf8_lossy(&checked.stdout);
    assert!(checked.status.success() && text.contains("bursts of 200, then 100 requests/s"), "{text}");
    // A bad flag value is the config's error: exit 2, with the config the flags made.
    let bad = g.bash("tollgate proxy --to localhost:3000 --limit ten/s").output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("the flags made this config"));
}

// Commands run blocking: the in-process upstream needs a thread of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_dev_proxy_guide() {
    let app = Upstream::fixed("from the app\n").await;
    let mut g = Guide::open("docs/guides/local-dev-proxy.md");
    let addr = g.port(8080);
    g.ports.push((":3000".to_owned(), format!(":{}", app.addr.port())));
    g.serve("tollgate proxy --to http://localhost:3000 --limit 100/s --burst 200 --shadow", addr).await;
    let (status, _, body) = crate::support::get(addr, "/").await;
    assert_eq!((status.as_u16(), &body[..]), (200, &b"from the app\n"[..]));
    // The load the walkthrough makes passes the shadow limit's rate: every request is
    // answered by the app, and the log says the limit would have refused some.
    let out = g.run("tollgate calibrate http://127.0.0.1:8080/ --rates 300 --step-duration 3s --warmup 0s");
    assert!(out.contains("300"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !g.log().contains("shadow limit would reject") {
        assert!(Instant::now() < deadline, "no shadow line in the log:\n{}", g.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!g.log().contains("status=429") && !g.log().contains("\"status\":429"));
    let printed =
        g.run("tollgate proxy --to http://localhost:3000 --limit 100/s --burst 200 --shadow --print-config > dev.yaml");
    assert!(printed.is_empty());
    // The file runs as the flags did, the page's second command.
    g.stop();
    g.serve("tollgate -c dev.yaml", addr).await;
    let (status, _, body) = crate::support::get(addr, "/").await;
    assert_eq!((status.as_u16(), &body[..]), (200, &b"from the app\n"[..]));
}

#[tokio::test]
async fn the_roll_out_guide() {
    let mut g = Guide::open("docs/guides/roll-out.md");
    let addr = g.port(8080);
    g.port(9901);
    g.serve("cargo run --release -- -c examples/roll-out.yaml", addr).await;
    for line in [
        "curl -s -H 'x-canary: always' localhost:8080/",
        "curl -s -H 'x-canary: never' localhost:8080/",
        "curl -s localhost:9901/metrics | grep -c tollgate_route_split_requests_total",
    ] {
        let out = g.run(line);
        assert_eq!(vec![out.trim().to_owned()], g.shown(line), "{line}");
    }
}

#[tokio::test]
async fn the_why_was_i_throttled_guide() {
    let mut g = Guide::open("docs/guides/why-was-i-throttled.md");
    let addr = g.port(8080);
    let admin = g.port(9901);
    g.serve("tollgate -c examples/why-was-i-throttled.yaml", admin).await;
    let _ = addr;
    let line = "for i in 1 2 3; do curl -si -H 'x-api-key: k-123' localhost:8080/v1/items | head -1; done";
    // The burst and the request after it are separate commands: on a loaded machine a token
    // (one a second) may come back between them; then the step is tried again, from a full
    // bucket.
    let mut tries = 0;
    let (burst, out) = loop {
        let burst = g.run(line);
        let out = g.run("curl -si -H 'x-api-key: k-123' localhost:8080/v1/items");
        tries += 1;
        if out.starts_with("HTTP/1.1 429") || tries == 5 {
            break (burst, out);
        }
        tokio::time::sleep(Duration::from_millis(2_500)).await;
    };
    let got: Vec<&str> = burst.lines().map(str::trim).collect();
    assert_eq!(got, g.shown(line).iter().map(String::as_str).collect::<Vec<_>>(), "{burst}");
    for want in ["HTTP/1.1 429 Too Many Requests", "retry-after: 1", "ratelimit-policy: \"per-client\";q=2;w=2"] {
        assert!(out.lines().any(|l| l.trim() == want), "no `{want}` in:\n{out}");
    }
    assert!(out.contains("\"violated-policies\":[\"per-client\"]"), "{out}");
    // Step 2: the access log line with its request id.
    let id = out.lines().find_map(|l| l.strip_prefix("x-request-id: ")).unwrap().trim().to_owned();
    assert!(g.log().contains(&id) && g.log().contains("\"status\":429"), "{}", g.log());
    // Step 4: the limit table names the key, and the page's reset lets it through.
    let table = g.run("curl -s 'http://127.0.0.1:9901/limits/api/per-client/keys?top=3'");
    let parsed: serde_json::Value = serde_json::from_str(&table).unwrap_or_else(|e| panic!("{e}: {table}"));
    let key = &parsed["keys"][0];
    assert_eq!(key["key"], "header:x-api-key=k-123", "{table}");
    assert_eq!(key["hash"], "275d839dbc83922114eedf49a9509213", "the page's digest is not k-123's: {table}");
    let reset = g.run(
        "curl -X DELETE -H \"Authorization: Bearer $(cat examples/admin-token)\" http://127.0.0.1:9901/limits/api/per-client/keys/275d839dbc83922114eedf49a9509213",
    );
    let json = reset.find('{').map(|at| &reset[at..reset.rfind('}').unwrap() + 1]).unwrap_or("");
    let reset: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {reset}"));
    assert_eq!(reset["reset"], true, "{reset}");
    let out = g.run("curl -si -H 'x-api-key: k-123' localhost:8080/v1/items");
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
}

#[tokio::test]
async fn the_limits_per_customer_guide() {
    let mut g = Guide::open("docs/guides/limits-per-customer.md");
    let addr = g.port(8080);
    let _admin = g.port(9901);
    g.serve("tollgate -c examples/limits-per-customer.yaml &", addr).await;
    let sign =
        "SIGN=\"tollgate token --key examples/jwt-test-only.pem --kid guide-test-only --iss https://id.example.com/\"";
    let value = g.line(sign);
    let value = value.split_once('=').unwrap().1.trim_matches('"').to_owned();
    g.env.insert("SIGN".to_owned(), value);
    for line in [
        "TOKEN=$($SIGN --aud api --sub alice --claim org_id=acme)",
        "EXPIRED=$($SIGN --aud api --sub alice --claim org_id=acme --expired)",
        "TOKEN_FOR_BILLING=$($SIGN --aud billing --sub alice --claim org_id=acme)",
    ] {
        g.set(line);
    }
    for line in [
        "curl -i -H \"authorization: Bearer $TOKEN\" localhost:8080/v1/orders",
        "curl -i -H 'x-api-key: example-key-acme' localhost:8080/partners/x",
        "curl -i -H 'x-api-key: made-up' localhost:8080/partners/x",
        "curl -i localhost:8080/v1/orders",
        "curl -i -H \"authorization: Bearer $EXPIRED\" localhost:8080/v1/orders",
        "curl -i -H \"authorization: Bearer $TOKEN_FOR_BILLING\" localhost:8080/v1/orders",
    ] {
        let out = g.run(line);
        let shown = g.shown(line);
        assert!(!shown.is_empty(), "{line}: the page shows nothing");
        has_lines(&g.page, line, &shown.join("\n"), &out.replace('\r', ""));
    }
}

#[tokio::test]
async fn the_test_a_limit_guide_replays_the_shipped_log() {
    let g = Guide::open("docs/guides/test-a-limit-before-it-bites.md");
    for line in [
        "tollgate replay -c examples/replay/candidate.yaml --format nginx examples/replay/access.log --top 3 --svg replay.svg",
        "tollgate replay --compare examples/test-a-limit-before-it-bites.yaml examples/replay/candidate.yaml --format nginx examples/replay/access.log --top 4",
    ] {
        let out = g.run(line);
        has_lines(&g.page, line, &g.output_after(line), &out);
    }
    assert!(std::fs::read_to_string(g.dir.path("replay.svg")).unwrap().starts_with("<svg"));
    // The candidate the page shows is the shipped one.
    let shown = blocks(&g.text).into_iter().filter(|(i, _)| i == "yaml").nth(1).unwrap().1;
    let shipped = std::fs::read_to_string(root().join("examples/replay/candidate.yaml")).unwrap();
    let body = |t: &str| t.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>().join("\n");
    assert_eq!(body(&shown).trim(), body(&shipped).trim());
}

#[tokio::test]
async fn the_load_test_target_guide() {
    let mut g = Guide::open("docs/guides/load-test-target.md");
    let addr = g.port(8080);
    g.serve("tollgate -c examples/load-test-target.yaml", addr).await;
    let line =
        "for i in $(seq 20); do curl -s -o /dev/null -w '%{http_code} %{time_total}\\n' localhost:8080/flaky; done";
    let out = g.run(line);
    assert_eq!(out.lines().count(), 20, "{out}");
    assert!(out.lines().all(|l| l.starts_with("200 ") || l.starts_with("503 ") || l.starts_with("000 ")), "{out}");
    let explained = g.run("tollgate explain -c examples/load-test-target.yaml");
    for want in ["log-normal", "5 % of answers are errors: status 503", "1 % of answers are cut", "draws from seed 1"] {
        assert!(explained.contains(want), "no `{want}` in:\n{explained}");
    }
    // The fragment the page shows is the example's upstream.
    let config = tollgate::config::Config::load(&root().join("examples/load-test-target.yaml")).unwrap();
    let up = config.upstreams.iter().find(|u| u.name == "flaky").unwrap();
    assert!(matches!(&up.kind, tollgate::config::UpstreamKind::Respond(r) if r.faults.is_some()));
}

/// The container: the Dockerfile's config and arguments serve on the published port, and the
/// arguments compose and Kubernetes give the image replace its CMD cleanly (no second `-c`).
#[test]
fn the_image_serves_its_config_on_its_published_port() {
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let instruction = |name: &str| -> Vec<String> {
        let line = dockerfile
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("Dockerfile has no {name}"));
        serde_json::from_str(line[name.len()..].trim()).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let (entry, cmd) = (instruction("ENTRYPOINT"), instruction("CMD"));
    assert_eq!(entry, ["tollgate"], "arguments after the image name must replace CMD only");
    // The config the image copies, where CMD names it.
    let copied: BTreeMap<String, String> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("COPY "))
        .filter(|l| !l.starts_with("--from"))
        .filter_map(|l| l.split_once(' ').map(|(a, b)| (b.trim().to_owned(), a.trim().to_owned())))
        .collect();
    let exposed: Vec<u16> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|l| l.split_whitespace().map(|p| p.parse::<u16>().unwrap()))
        .collect();
    let at = cmd.iter().position(|a| a == "-c").unwrap();
    let file = &copied[&cmd[at + 1]];
    let mut config = tollgate::config::Config::load(&root().join(file)).unwrap();
    let listen = cmd.iter().position(|a| a == "--listen").map(|i| cmd[i + 1].parse::<SocketAddr>().unwrap());
    if let Some(l) = listen {
        config.set_listen(l);
    }
    for l in &config.listeners {
        assert!(!l.addr.ip().is_loopback(), "the image listens on {}: a published port cannot reach it", l.addr);
        assert!(exposed.contains(&l.addr.port()), "the image listens on {} but EXPOSEs {exposed:?}", l.addr);
    }
    // `tollgate check` with the image's own arguments, as its entry point runs them, the
    // image's /etc/tollgate/ a folder here.
    let dir = Dir::new();
    let mounted = dir.path("etc-tollgate");
    std::fs::create_dir_all(&mounted).unwrap();
    let argv = |args: &[String]| -> Vec<String> {
        let inside = format!("{}/", mounted.display());
        entry[1..].iter().chain(args).map(|a| a.replace("/etc/tollgate/", &inside)).collect()
    };
    std::fs::copy(root().join(file), mounted.join(Path::new(&cmd[at + 1]).file_name().unwrap())).unwrap();
    let out = Command::new(BIN).args(argv(&cmd)).arg("check").output().unwrap();
    assert!(out.status.success(), "the image's CMD: {}", String::from_utf8_lossy(&out.stderr));
    // docker-compose.yml's `command:` and the Kubernetes `args:` replace CMD.
    let compose: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(root().join("docker-compose.yml")).unwrap()).unwrap();
    let mut replaced = 0;
    for (name, service) in compose["services"].as_mapping().unwrap() {
        if service.get("build").is_none() {
            continue;
        }
        let args: Vec<String> = serde_yaml::from_value(service["command"].clone()).unwrap();
        for v in service["volumes"].as_sequence().into_iter().flatten() {
            let (host, inside) = v.as_str().unwrap().split_once(':').unwrap();
            if let Some(f) = inside.strip_prefix("/etc/tollgate/") {
                let f = f.trim_end_matches(":ro");
                let text = std::fs::read_to_string(root().join(host)).unwrap().replace("/certs/", "certs/");
                std::fs::write(mounted.join(f), text).unwrap();
            }
        }
        // tls.yaml's certificate is made by a container: `explain` reads no certificate, but
        // it parses the arguments and loads the config as `run` would.
        let out = Command::new(BIN).args(argv(&args)).arg("check").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() || err.contains("certs/"),
            "compose service {name:?}: `tollgate {}`: {err}",
            args.join(" ")
        );
        replaced += 1;
    }
    assert!(replaced >= 3);
    let manifest = std::fs::read_to_string(root().join("deploy/kubernetes.yaml")).unwrap();
    let args_line = manifest.lines().find(|l| l.trim_start().starts_with("args:")).unwrap();
    let args: Vec<String> = serde_json::from_str(args_line.trim_start().strip_prefix("args:").unwrap().trim()).unwrap();
    std::fs::write(mounted.join("proxy.yaml"), std::fs::read_to_string(root().join("proxy.yaml")).unwrap()).unwrap();
    let out = Command::new(BIN).args(argv(&args)).arg("check").output().unwrap();
    assert!(out.status.success(), "kubernetes args: {}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test]
async fn the_edge_gateway_guide() {
    let mut g = Guide::open("docs/guides/edge-gateway.md");
    let redis = g.port(6380);
    let (a, b) = (g.port(3001), g.port(3002));
    let (https, http, admin) = (g.port(8443), g.port(8080), g.port(9901));
    g.serve("redis-server --port 6380 --save '' --appendonly no &", redis).await;
    g.serve("tollgate -c examples/demo-upstream.yaml --listen 127.0.0.1:3001 &", a).await;
    g.serve("tollgate -c examples/demo-upstream.yaml --listen 127.0.0.1:3002 &", b).await;
    g.serve("tollgate -c examples/edge-gateway.yaml", https).await;
    let _ = http;
    let out = g.run("curl -i localhost:8080/v1/items");
    assert!(out.starts_with("HTTP/1.1 308"), "{out}");
    let location = format!("location: https://localhost:{}/v1/items", https.port());
    assert!(out.lines().any(|l| l.trim() == location), "{out}");
    let out =
        g.run("curl -i --cacert examples/certs/demo-localhost.pem https://localhost:8443/v1/items -H 'x-api-key: k1'");
    assert!(out.starts_with("HTTP/2 200"), "{out}");
    assert!(out.contains("strict-transport-security: max-age=31536000") && out.contains("x-request-id:"), "{out}");
    assert!(out.contains("ratelimit: \"per-key\";r=9;t=1, \"per-key-daily\";r=99999;t="), "{out}");
    // A Redis call slower than the config's 20 ms (a loaded machine) is decided locally
    // (`on_error: local`), and nothing is written: the page's request is asked again then.
    let shown = g.shown("redis-cli -p 6380 --scan --pattern 'tollgate:*'");
    let prefix = shown[0].split('<').next().unwrap().to_owned();
    for tries in 1.. {
        let keys = g.run("redis-cli -p 6380 --scan --pattern 'tollgate:*'");
        if keys.lines().any(|l| l.starts_with(&prefix)) {
            break;
        }
        assert!(tries < 20, "no {prefix}… in Redis: {keys}");
        g.run("curl -i --cacert examples/certs/demo-localhost.pem https://localhost:8443/v1/items -H 'x-api-key: k1'");
    }
    // The burst of 10, then 429: one curl, twelve requests on one connection; on a loaded
    // machine a token may come back before the eleventh (5/s), then the step is tried again
    // once the bucket is full.
    let burst = "curl -s -o /dev/null -w '%{http_code} ' --cacert examples/certs/demo-localhost.pem -H 'x-api-key: k2' \"https://localhost:8443/v1/items?n=[1-12]\"; echo";
    let shown = g.shown(burst);
    // A debug build on a loaded machine may take longer than the 200 ms in which a token
    // comes back: such a round says nothing about the page, and a round that was quick enough
    // must print what it shows.
    // So may Redis take longer than the config's 20 ms `timeout`: those decisions are taken by
    // the local fallback (`on_error: local`), and the key's count is split between the two
    // stores; `tollgate_redis_errors_total` counts them, and that round says nothing about
    // the page either.
    let errors = |metrics: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with("tollgate_redis_errors_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let redis_errors = || async {
        let (_, _, body) = crate::support::get(admin, "/metrics").await;
        errors(&String::from_utf8_lossy(&body))
    };
    let mut unclear = 0;
    loop {
        let start = Instant::now();
        let before = redis_errors().await;
        // A round after the first asks other URLs: the route serves a stale copy in place of
        // a 429 (`on_limit.stale`), and the first round left a copy of each of its URLs.
        let round = format!("?round={unclear}&n=");
        let out = g.run_edited(burst, |l| if unclear == 0 { l } else { l.replace("?n=", &round) });
        if out.trim() == shown[0] {
            break;
        }
        let slow = start.elapsed() > Duration::from_millis(200);
        let fell_back = redis_errors().await > before;
        assert!(slow || fell_back, "a quick burst, all of it decided in Redis, printed {out}, not {}", shown[0]);
        unclear += 1;
        if unclear == 5 {
            println!("edge-gateway: every burst was slow or fell back to the local store; its 429s were not checked");
            break;
        }
        tokio::time::sleep(Duration::from_millis(2_500)).await;
    }
    let metrics = g.run("curl -s localhost:9901/metrics | grep upstream_server_requests_total");
    for server in [a, b] {
        assert!(metrics.contains(&format!("http://{server}")), "{metrics}");
    }
    // `kill %2`: the server on 3001 stops (the test's own kill: it is the second server it
    // started). Requests still succeed, retried on the other, and the first is ejected.
    let _ = g.servers[1].kill();
    let _ = g.servers[1].wait();
    let config = "curl -s localhost:9901/config | python3 -c 'import json,sys; [print(s) for s in json.load(sys.stdin)[\"upstreams\"][\"api\"][\"servers\"]]'";
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    loop {
        n += 1;
        // "keep asking": the page's request, a new key and URL each time.
        let ask = format!(
            "curl -s -o /dev/null -w '%{{http_code}}' --cacert examples/certs/demo-localhost.pem -H 'x-api-key: k{n}' \
             'https://localhost:{}/v1/items?m={n}'",
            https.port()
        );
        let out = g.bash(&ask).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "200", "a request after the server stopped");
        let servers = g.run(config);
        // Ejected, or found unhealthy by its health check first, as the page says.
        let stopped = servers.lines().find(|l| l.contains(&format!("'url': 'http://{a}'"))).unwrap_or("");
        if stopped.contains("'state': 'ejected'") || stopped.contains("'state': 'unhealthy'") {
            break;
        }
        assert!(Instant::now() < deadline, "never ejected:\n{servers}");
    }
}

#[tokio::test]
async fn the_api_product_guide() {
    let mut g = Guide::open("docs/guides/api-product.md");
    let redis = g.port(6380);
    let addr = g.port(8080);
    g.serve("redis-server --port 6380 --save '' --appendonly no &", redis).await;
    g.serve("target/release/tollgate -c examples/api-product.yaml &", addr).await;
    let out = g.run("curl -i localhost:8080/v1/complete -H 'x-api-key: key-pro-1'");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("ratelimit-policy:") && l.contains("q=200")),
        "the pro tier's policy: {out}"
    );
    let out = g.run("curl -i localhost:8080/v1/complete -H 'x-api-key: key-abuser'");
    assert!(out.starts_with("HTTP/1.1 403"), "{out}");
}

#[tokio::test]
async fn the_several_instances_guide() {
    let mut g = Guide::open("docs/guides/several-instances.md");
    let redis = g.port(6380);
    let (a, b) = (g.port(8081), g.port(8082));
    g.serve("redis-server --port 6380 --save '' --appendonly no &", redis).await;
    g.serve("tollgate -c examples/several-instances.yaml --listen 127.0.0.1:8081 &", a).await;
    g.serve("tollgate -c examples/several-instances.yaml --listen 127.0.0.1:8082 &", b).await;
    let line = "for i in $(seq 15); do curl -s -o /dev/null -w '%{http_code} ' localhost:8081/; curl -s -o /dev/null -w '%{http_code} ' localhost:8082/; done; echo";
    let start = Instant::now();
    let out = g.run(line);
    let took = start.elapsed().as_secs_f64();
    let codes: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(codes.len(), 30, "{out}");
    let admitted = codes.iter().filter(|c| **c == "200").count();
    // One bucket of 20 for both, refilled at 10/s while the loop ran (a loaded machine runs it
    // slowly): never more than that; two buckets of their own would admit up to 40.
    let most = 20 + (10.0 * took).ceil() as usize;
    assert!(admitted <= most, "{admitted} admitted in {took:.2} s, at most {most} from one shared bucket: {out}");
    assert!(codes.iter().all(|c| *c == "200" || *c == "429"), "{out}");
    if most < 30 {
        assert!(codes.contains(&"429"), "{out}");
    }
}

#[tokio::test]
async fn the_browser_facing_api_guide() {
    let mut g = Guide::open("docs/guides/browser-facing-api.md");
    let addr = g.port(8080);
    g.serve("tollgate -c examples/browser-facing-api.yaml", addr).await;
    let preflight = "curl -si -X OPTIONS localhost:8080/v1/items/7 -H 'Origin: https://app.example.com' -H 'Access-Control-Request-Method: PUT' -H 'Access-Control-Request-Headers: content-type, x-csrf-token'";
    let page = "docs/guides/browser-facing-api.md";
    has_lines(page, preflight, &g.output_after(preflight), &g.run(preflight));
    // The burst and the call after it are separate commands: on a loaded machine a token (one
    // every 6 s) may come back between them; then the step is tried again, from a full bucket.
    let burst =
        "for i in 1 2 3; do curl -s -o /dev/null -H 'Origin: https://app.example.com' localhost:8080/v1/items; done";
    let call = "curl -si -H 'Origin: https://app.example.com' localhost:8080/v1/items";
    let mut tries = 0;
    let out = loop {
        g.run(burst);
        let out = g.run(call);
        tries += 1;
        if out.starts_with("HTTP/1.1 429") || tries == 3 {
            break out;
        }
        tokio::time::sleep(Duration::from_secs(19)).await;
    };
    // Every line the page shows, but the waits, which count whole seconds from the burst.
    let shown = g.output_after(call);
    let steady: String = shown
        .lines()
        .filter(|l| !l.starts_with("retry-after") && !l.starts_with("ratelimit:"))
        .map(|l| format!("{l}\n"))
        .collect();
    has_lines(page, call, &steady, &out);
    assert!(out.lines().any(|l| l.trim() == "retry-after: 6" || l.trim() == "retry-after: 5"), "{out}");
    let refused = "curl -si -X OPTIONS localhost:8080/v1/items -H 'Origin: https://evil.example' -H 'Access-Control-Request-Method: PUT'";
    let out = g.run(refused);
    has_lines(page, refused, &g.output_after(refused), &out);
    assert!(!out.to_lowercase().contains("access-control-"), "{out}");
    assert!(g.log().contains("\"cors=origin_refused\""), "{}", g.log());
    let explain = "tollgate explain -c examples/browser-facing-api.yaml";
    has_lines(page, explain, &g.output_after(explain), &g.run(explain));
}

#[tokio::test]
async fn the_cache_a_slow_read_api_guide() {
    let mut g = Guide::open("docs/guides/cache-a-slow-read-api.md");
    let api = g.port(3001);
    let addr = g.port(8080);
    g.port(9901);
    g.serve("tollgate -c examples/demo-upstream.yaml --listen 127.0.0.1:3001", api).await;
    g.serve("tollgate -c examples/cache-a-slow-read-api.yaml", addr).await;
    for line in [
        "curl -s -o /dev/null -D - localhost:8080/items | grep -io 'cache-status: tollgate; [a-z=-]*'",
        "curl -s -o /dev/null -D - localhost:8080/items | grep -io 'cache-status: tollgate; [a-z]*'",
        "curl -s localhost:9901/metrics | grep 'step=\"cache\",result=\"hit\"'",
    ] {
        let out = g.run(line);
        assert_eq!(vec![out.trim().to_owned()], g.shown(line), "{line}");
    }
    let purge = "curl -s -X DELETE -H \"Authorization: Bearer $(cat examples/admin-token)\" localhost:9901/cache/localhost/items";
    let out = g.run(purge);
    has_lines(&g.page, "purge", &g.output_after(purge), &out);
    // The degraded read: the API gone, the last good copy (stored again after the purge).
    let (status, _, _) = crate::support::get(addr, "/items").await;
    assert_eq!(status.as_u16(), 200);
    let _ = g.servers[0].kill();
    let _ = g.servers[0].wait();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, h, _) = crate::support::get_with(addr, "/items", &[("cache-control", "no-cache")]).await;
        let cs = h.get("cache-status").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
        if cs.contains("detail=upstream-error") {
            assert_eq!(status.as_u16(), 200, "{cs}");
            break;
        }
        assert!(Instant::now() < deadline, "no stale copy once the API is gone: {cs}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
