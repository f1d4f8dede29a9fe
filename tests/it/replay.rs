//! `tollgate replay`: a live tollgate's own access log replayed with its config gives every
//! request the decision it got live; each log format; unreadable lines; `--compare`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use tollgate::config::Config;
use tollgate::replay::{self, Columns, Format, Live, Options, Verdict};

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

/// A file in the temp dir, removed on drop.
struct Temp(PathBuf);

impl Temp {
    fn new(name: &str, text: &str) -> Temp {
        let p = std::env::temp_dir().join(format!("tollgate-replay-{}-{name}", std::process::id()));
        std::fs::write(&p, text).unwrap();
        Temp(p)
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Two limits, one a sliding window; a user's key is its `user` query parameter, so that
/// clients on one loopback address are told apart. One worker: decisions reach the stores
/// in the order of their instants (with several workers, two decisions within the same few
/// µs can reach a store in the other order than their instants say).
const LIVE: &str = "
server: { workers: 1 }
log: { format: json, access: true, access_keys: true }
upstreams: { app: { respond: { body: ok } } }
routes:
  - name: api
    upstream: app
    limits:
      - { name: per-user, algorithm: token_bucket, rate: 2/s, burst: 4, key: query:user }
      - { name: total, algorithm: sliding_window, rate: 100/m, key: route }
";

fn request(port: u16, path: &str, fields: &str) -> u16 {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nhost: api.example\r\n{fields}connection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0)
}

#[test]
fn a_live_log_replayed_with_its_config_gets_every_live_decision() {
    let (report, text) = live_decisions_are_reproduced("live", LIVE);
    assert_eq!(report.live.as_ref().unwrap().requests, 240);
    // The log carries each limit's digest, never the key's material.
    let line = text.lines().find(|l| l.contains("tollgate::access")).unwrap();
    assert!(line.contains("per-user|query:user|") && line.contains("\"at_us\":"), "{line}");
    assert!(!line.contains("|u0") && !line.contains("|u1"), "{line}");
}

/// Limits keyed on the consumer `auth` verified replay from the log's `consumer` field, and
/// requests refused for their credential (the clients with a fresh user each) stay refused.
#[test]
fn a_live_log_with_consumer_keys_gets_every_live_decision() {
    let digest = |k: &str| tollgate::config::auth::hash_key(k.as_bytes());
    let keys = Temp::new("live-consumers.keys", &format!("{} alice\n{} bob\n", digest("u0"), digest("u1")));
    // Two consumers take few of the route's window: a small one throttles too.
    let yaml = LIVE.replace("key: query:user }", "key: consumer }").replace("rate: 100/m", "rate: 7/m").replace(
        "    upstream: app\n",
        &format!(
            "    upstream: app\n    auth: {{ api_key: {{ from: 'query:user', keys: '{}' }} }}\n",
            keys.0.display()
        ),
    );
    assert!(yaml.contains("key: consumer") && yaml.contains("api_key"), "{yaml}");
    let (report, text) = live_decisions_are_reproduced("live-consumers", &yaml);
    assert_eq!(report.live.as_ref().unwrap().requests, 120, "the two clients with a key");
    assert!(text.contains("\"consumer\":\"alice\""), "the log names the consumer");
    assert!(report.routes[0].limits[0].key_parts_not_in_log.is_empty(), "{}", report.text());
}

/// Penalised early retries are decided by the same gate live and in replay, on the same
/// instants: every decision is reproduced too.
#[test]
fn a_live_log_with_early_retry_penalties_gets_every_live_decision() {
    let penalised = LIVE.replace("key: query:user }", "key: query:user, early_retry: { penalty: double } }");
    assert_ne!(penalised, LIVE);
    let (report, _) = live_decisions_are_reproduced("live-penalised", &penalised);
    let early = &report.routes[0].limits[0].early_retries;
    assert!(early.times > 0, "the clients that keep one user came back early: {}", report.text());
}

/// Runs tollgate with `yaml` and four clients at different paces, 60 requests each: client
/// `c`'s request `i` is `request(c, i)` (its target and its header lines). Returns the config,
/// the log and the statuses.
fn live_run(name: &str, yaml: &str, request: fn(u64, u64) -> (String, String)) -> (Temp, Temp, Vec<u16>) {
    let config = Temp::new(&format!("{name}.yaml"), yaml);
    let log = Temp::new(&format!("{name}.log"), "");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(BIN)
        .arg("-c")
        .arg(&config.0)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stderr(Stdio::from(std::fs::File::create(&log.0).unwrap()))
        .spawn()
        .unwrap();
    let mut up = false;
    for _ in 0..200 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            up = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(up, "tollgate did not start");
    let clients: Vec<_> = (0..4u64)
        .map(|c| {
            std::thread::spawn(move || {
                let mut statuses = Vec::new();
                for i in 0..60 {
                    let (target, fields) = request(c, i);
                    statuses.push(self::request(port, &target, &fields));
                    std::thread::sleep(Duration::from_millis(2 + 8 * c));
                }
                statuses
            })
        })
        .collect();
    let statuses: Vec<u16> = clients.into_iter().flat_map(|t| t.join().unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(statuses.len(), 240);
    assert!(statuses.contains(&429) && statuses.contains(&200), "the load throttles some, not all");
    (config, log, statuses)
}

fn live_decisions_are_reproduced(name: &str, yaml: &str) -> (replay::Report, String) {
    // Two clients keep one user each and run into their own limit whatever their pace, two
    // use a fresh user per request and, with the others, run into the route's (100 a minute
    // against 240 requests).
    let (config, log, statuses) = live_run(name, yaml, |c, i| {
        let user = if c < 2 { format!("u{c}") } else { format!("u{c}-{i}") };
        (format!("/items/{i}?user={user}"), String::new())
    });

    let cfg = Config::load(&config.0).unwrap();
    let verdicts = replay::verdicts(&cfg, std::slice::from_ref(&log.0)).unwrap();
    assert_eq!(verdicts.len(), 240, "one record per request");
    let mut by_limit = [0u32; 2];
    for (id, live, verdict) in &verdicts {
        assert!(id.is_some(), "every line has its request id");
        assert_eq!(*live, verdict.live(), "request {id:?}: live {live:?}, replay {verdict:?}");
        if let Verdict::Throttled { limits, .. } = verdict {
            for l in limits {
                by_limit[*l] += 1;
            }
        }
    }
    assert!(by_limit[0] > 0 && by_limit[1] > 0, "both limits throttled some: {by_limit:?}");
    let throttled = verdicts.iter().filter(|v| v.1 == Some(Live::Throttled)).count();
    assert_eq!(throttled, statuses.iter().filter(|s| **s == 429).count());

    // The report says the same, by route and limit.
    let report = replay::run(&cfg, std::slice::from_ref(&log.0), &options(Format::Tollgate)).unwrap();
    let live = report.live.as_ref().unwrap();
    // Every request the limits decided live (a 401 never reached them).
    let decided = statuses.iter().filter(|s| matches!(**s, 200 | 429)).count() as u64;
    assert_eq!((live.requests, live.reproduced), (decided, decided), "{:?}", live.differ);
    assert_eq!(report.routes[0].throttled as usize, throttled);
    (report, std::fs::read_to_string(&log.0).unwrap())
}

/// Clients behind a balancer (a trusted proxy: the log's `peer` is the balancer's address)
/// keyed by their forwarded address and by an API key header the log does not carry: with
/// `log.access_keys`, replay decides on each limit's logged key and gets every live decision.
const BALANCED: &str = "
server: { workers: 1 }
trusted_proxies: [127.0.0.1/32]
log: { format: json, access: true, access_keys: true }
upstreams: { app: { respond: { body: ok } } }
routes:
  - name: api
    upstream: app
    limits:
      - { name: per-ip, algorithm: token_bucket, rate: 10/s, burst: 5, key: client_ip }
      - { name: per-key, algorithm: sliding_window, rate: 10/m, key: header:x-api-key }
";

/// Client `c` is 203.0.113.`c+1` behind the balancer, with API key `key-{c % 2}`: each sends
/// 60 requests within seconds, past its address's 5 + 10/s, and each key's two clients get
/// more than 10 a minute past `per-ip`, however slowly they run.
fn balanced(c: u64, i: u64) -> (String, String) {
    (format!("/items/{i}"), format!("x-forwarded-for: 203.0.113.{}\r\nx-api-key: key-{}\r\n", c + 1, c % 2))
}

#[test]
fn a_live_log_behind_a_balancer_with_header_keys_gets_every_live_decision() {
    let (config, log, statuses) = live_run("balanced", BALANCED, balanced);
    let cfg = Config::load(&config.0).unwrap();
    let report = replay::run(&cfg, std::slice::from_ref(&log.0), &options(Format::Tollgate)).unwrap();
    let live = report.live.as_ref().unwrap();
    assert_eq!((live.requests, live.reproduced), (240, 240), "{}", report.text());
    assert!(live.why.is_empty(), "{:?}", live.why);
    let limits = &report.routes[0].limits;
    assert!(limits.iter().all(|l| l.throttled > 0), "both limits throttled some: {}", report.text());
    for l in limits {
        assert_eq!((l.keys_from_log, l.requests_without_key), (240, 0), "{}", report.text());
        assert!(l.key_parts_not_in_log.is_empty(), "{}", report.text());
    }
    // Clients are told apart by their logged keys, shown by digest where the log lacks the text.
    assert!(limits[0].keys_affected >= 2, "{}", report.text());
    assert!(limits[0].top_keys[0].0.starts_with("client_ip=? (key "), "{:?}", limits[0].top_keys);
    assert_eq!(statuses.iter().filter(|s| **s == 429).count() as u64, report.routes[0].throttled);

    // Without `access_keys`, the report says what it lacked, per limit and for the live check.
    let (config, log, _) = live_run("balanced-nokeys", &BALANCED.replace(", access_keys: true", ""), balanced);
    let cfg = Config::load(&config.0).unwrap();
    let report = replay::run(&cfg, std::slice::from_ref(&log.0), &options(Format::Tollgate)).unwrap();
    let limits = &report.routes[0].limits;
    assert_eq!(limits[0].key_parts_not_in_log, ["client_ip"], "{}", report.text());
    assert_eq!(limits[1].key_parts_not_in_log, ["header:x-api-key"], "{}", report.text());
    assert_eq!((limits[0].requests_without_key, limits[0].keys_from_log), (240, 0));
    let why = &report.live.as_ref().unwrap().why;
    assert_eq!(why.len(), 2, "{why:?}");
    assert!(why[0].contains("per-ip") && why[0].contains("its `peer` is the balancer"), "{why:?}");
    assert!(why.iter().all(|w| w.contains("`log.access_keys: true` logs each limit's key")), "{why:?}");
    assert!(report.text().contains("decided without the live key: route api limit per-key"), "{}", report.text());
}

fn options(format: Format) -> Options {
    Options { format, fallback: false, top: 5 }
}

const CANDIDATE: &str = "
upstreams: { app: { respond: { body: ok } } }
routes:
  - name: api
    match: { path_prefix: /api/ }
    upstream: app
    limits:
      - { name: per-ip, algorithm: fixed_window, rate: 2/s, key: client_ip }
  - { name: rest, upstream: app }
";

fn cfg(yaml: &str) -> Config {
    Config::from_yaml(std::path::Path::new("replay.yaml"), yaml).unwrap()
}

/// Three requests of one client in one second and one of another: the third is throttled.
fn nginx_lines(msec: bool) -> String {
    let mut out = String::new();
    for (i, ip) in ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.1"].iter().enumerate() {
        let ms = if msec { format!(" 1796547235.{:03}", i * 100) } else { String::new() };
        out += &format!(
            "{ip} - - [06/Dec/2026:08:53:55 +0000] \"GET /api/x?i={i} HTTP/1.1\" 200 2 \"-\" \"curl/8\"{ms}\n"
        );
    }
    out
}

#[test]
fn nginx_combined_with_and_without_msec() {
    for msec in [false, true] {
        let log = Temp::new(&format!("nginx-{msec}.log"), &nginx_lines(msec));
        let r = replay::run(&cfg(CANDIDATE), std::slice::from_ref(&log.0), &options(Format::Nginx)).unwrap();
        let api = &r.routes[0];
        assert_eq!((api.requests, api.throttled), (4, 1), "{}", r.text());
        assert_eq!(api.limits[0].top_keys, vec![("client_ip=10.0.0.1".to_owned(), 1)]);
        assert_eq!(api.retry_after.len(), 1);
    }
}

#[test]
fn csv_and_json_lines_with_named_columns_and_a_header_the_log_lacks() {
    let yaml = "
upstreams: { app: { respond: { body: ok } } }
routes:
  - name: api
    upstream: app
    limits:
      - { name: per-key, algorithm: sliding_window, rate: 1/m, key: header:x-api-key }
      - { name: per-tenant, algorithm: token_bucket, rate: 100/s, key: header:x-tenant }
";
    let columns = Columns::parse("ts=time,ip=remote,method=verb,path=uri,status=code,header:x-api-key=key").unwrap();
    let csv = "time,remote,verb,uri,code,key\n\
               1796547235.0,10.0.0.1,GET,/a,200,k1\n\
               1796547236.0,10.0.0.1,GET,/a,200,k1\n\
               1796547237.0,10.0.0.2,GET,/a,200,k2\n";
    let log = Temp::new("named.csv", csv);
    let r = replay::run(&cfg(yaml), std::slice::from_ref(&log.0), &options(Format::Csv(columns.clone()))).unwrap();
    assert_eq!(r.routes[0].throttled, 1, "{}", r.text());
    assert_eq!(r.routes[0].limits[0].top_keys[0].0, "header:x-api-key=k1");
    assert_eq!(r.routes[0].limits[1].key_parts_not_in_log, vec!["header:x-tenant".to_owned()]);
    assert!(r.text().contains("the log has no header:x-tenant"), "{}", r.text());

    let jsonl = r#"{"time":"2026-12-06T08:53:55Z","remote":"10.0.0.1","verb":"GET","uri":"/a","code":200,"key":"k1"}
{"time":"2026-12-06T08:53:56Z","remote":"10.0.0.1","verb":"GET","uri":"/a","code":200,"key":"k1"}
"#;
    let log = Temp::new("named.jsonl", jsonl);
    let r = replay::run(&cfg(yaml), std::slice::from_ref(&log.0), &options(Format::Json(columns))).unwrap();
    assert_eq!((r.routes[0].requests, r.routes[0].throttled), (2, 1));
}

#[test]
fn an_unreadable_line_is_counted_with_its_number() {
    let mut text = nginx_lines(true);
    text.insert_str(0, "this is not a log line\n");
    text += "10.0.0.9 - - [not a time] \"GET / HTTP/1.1\" 200 2 \"-\" \"-\"\n";
    let log = Temp::new("bad.log", &text);
    let r = replay::run(&cfg(CANDIDATE), std::slice::from_ref(&log.0), &options(Format::Nginx)).unwrap();
    assert_eq!((r.lines.lines, r.lines.requests, r.lines.bad_count), (6, 4, 2));
    let lines: Vec<u64> = r.lines.bad.iter().map(|b| b.line).collect();
    assert_eq!(lines, vec![1, 6]);
    assert!(r.text().contains("line 6: "), "{}", r.text());
}

#[test]
fn compare_names_who_is_newly_throttled_and_who_is_let_through() {
    let current = "
upstreams: { app: { respond: { body: ok } } }
routes:
  - name: api
    match: { path_prefix: /api/ }
    upstream: app
    limits:
      - { name: per-ip, algorithm: fixed_window, rate: 3/s, key: client_ip }
      - { name: all, algorithm: fixed_window, rate: 2/s, key: [route, query:i] }
  - { name: rest, upstream: app }
";
    let mut text = nginx_lines(true);
    // The first client's fourth request in that second; every `i` differs, so `all` never binds.
    text += "10.0.0.1 - - [06/Dec/2026:08:53:55 +0000] \"GET /api/x?i=9 HTTP/1.1\" 200 2 \"-\" \"-\" 1796547235.500\n";
    let log = Temp::new("compare.log", &text);
    let c =
        replay::compare(&cfg(current), &cfg(CANDIDATE), std::slice::from_ref(&log.0), &options(Format::Nginx)).unwrap();
    // Current: 3/s per IP throttles 10.0.0.1's fourth. Candidate: 2/s throttles its third and fourth.
    assert_eq!((c.throttled_current, c.throttled_candidate), (1, 2), "{}", c.text());
    assert_eq!((c.newly_throttled, c.let_through), (1, 0));
    assert_eq!(c.newly[0].key, "client_ip=10.0.0.1");
    assert_eq!(c.newly[0].limit, "per-ip");
    assert!(c.text().contains("newly throttled"));
}

#[test]
fn the_command_writes_text_json_and_the_chart() {
    let config = Temp::new("cmd.yaml", CANDIDATE);
    let log = Temp::new("cmd.log", &nginx_lines(true));
    let svg = std::env::temp_dir().join(format!("tollgate-replay-{}-chart.svg", std::process::id()));
    let out = Command::new(BIN)
        .args(["replay", "--format", "nginx", "--json", "--svg"])
        .arg(&svg)
        .arg("-c")
        .arg(&config.0)
        .arg(&log.0)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["routes"][0]["throttled"], 1);
    let chart = std::fs::read_to_string(&svg).unwrap();
    let _ = std::fs::remove_file(&svg);
    assert!(chart.contains("throttled (429)"));
    let out = Command::new(BIN)
        .args(["replay", "--format", "nginx", "--compare"])
        .arg(&config.0)
        .arg(&config.0)
        .arg(&log.0)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("newly throttled 0, let through 0"));
}

/// Three clients denied by a 1-per-10 s window at 1 s: `.1` comes back at 2, 3 and 4 s and
/// again at 11 s, `.2` at 5 s, `.3` waits the 9 s it was told (at 10.2 s).
fn eager_lines() -> String {
    let at = [
        ("10.0.0.1", 0),
        ("10.0.0.2", 100),
        ("10.0.0.3", 200),
        ("10.0.0.1", 1000),
        ("10.0.0.2", 1100),
        ("10.0.0.3", 1200),
        ("10.0.0.1", 2000),
        ("10.0.0.1", 3000),
        ("10.0.0.1", 4000),
        ("10.0.0.2", 5000),
        ("10.0.0.3", 10_200),
        ("10.0.0.1", 11_000),
    ];
    at.iter()
        .map(|(ip, ms)| {
            let t = 1_796_547_230_000u64 + ms;
            format!(
                "{ip} - - [06/Dec/2026:08:53:50 +0000] \"GET /api/x HTTP/1.1\" 200 2 \"-\" \"-\" {}.{:03}\n",
                t / 1000,
                t % 1000
            )
        })
        .collect()
}

const EAGER: &str = "
upstreams: { app: { respond: { body: ok } } }
routes:
  - name: api
    upstream: app
    limits:
      - { name: per-ip, algorithm: fixed_window, rate: 1/10s, key: client_ip }
";

#[test]
fn early_retries_are_told_in_words_in_the_report_its_json_and_compare() {
    let log = Temp::new("eager.log", &eager_lines());
    let r = replay::run(&cfg(EAGER), std::slice::from_ref(&log.0), &options(Format::Nginx)).unwrap();
    let early = &r.routes[0].limits[0].early_retries;
    assert_eq!((early.times, early.clients), (4, 2), "{}", r.text());
    assert_eq!(early.most_eager, Some(("client_ip=10.0.0.1".to_owned(), 3)));
    let words = "2 clients came back before their Retry-After, 4 times; the most eager, client_ip=10.0.0.1, 3 times";
    assert_eq!(early.words, words);
    assert!(r.text().contains(&format!("early retries: {words}\n")), "{}", r.text());
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["routes"][0]["limits"][0]["early_retries"]["times"], 4);

    // With the penalty, `.1`'s return at 11 s is still early (told 10 s at 4 s): refused.
    let penalised = EAGER.replace("key: client_ip }", "key: client_ip, early_retry: { penalty: double } }");
    let c =
        replay::compare(&cfg(EAGER), &cfg(&penalised), std::slice::from_ref(&log.0), &options(Format::Nginx)).unwrap();
    assert_eq!((c.throttled_current, c.throttled_candidate, c.newly_throttled), (7, 8, 1), "{}", c.text());
    let row = &c.early_retries[0];
    assert_eq!((row.route.as_str(), row.limit.as_str()), ("api", "per-ip"));
    assert_eq!(row.current.as_ref().map(|e| e.words.as_str()), Some(words));
    let candidate = row.candidate.as_ref().map(|e| e.words.as_str()).unwrap_or_default();
    assert_eq!(
        candidate,
        "2 clients came back before their Retry-After, 5 times; the most eager, client_ip=10.0.0.1, 4 times; \
         each was refused and told twice its last wait (up to 10 s)"
    );
    assert!(c.text().contains("early retries:\n  route api limit per-ip\n"), "{}", c.text());
}
