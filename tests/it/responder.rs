//! The built-in responder as a load-test target, measured over real sockets: its error share,
//! its cut answers, its latency distribution, its slow and sized bodies, and a seed that
//! repeats a run.

use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::Request;

use crate::support::{full, h1, Tollgate};

fn target(respond: &str) -> String {
    format!("listen: 127.0.0.1:0\nupstreams:\n  t:\n    respond: {respond}\nroutes:\n  - {{ name: t, upstream: t }}\n")
}

/// `n` GETs one after another over keep-alive HTTP/1.1 (a new connection after a cut one):
/// each one's status (`None`: cut before its end), body length and time.
async fn run(addr: std::net::SocketAddr, n: usize) -> Vec<(Option<u16>, usize, Duration)> {
    let mut out = Vec::with_capacity(n);
    let mut send = h1(addr).await;
    for _ in 0..n {
        if send.ready().await.is_err() {
            send = h1(addr).await;
        }
        let start = Instant::now();
        let req = Request::get("/").header("host", "localhost").body(full("")).unwrap();
        let resp = match send.send_request(req).await {
            Ok(r) => r,
            Err(_) => {
                out.push((None, 0, start.elapsed()));
                send = h1(addr).await;
                continue;
            }
        };
        let status = resp.status().as_u16();
        match resp.into_body().collect().await {
            Ok(b) => out.push((Some(status), b.to_bytes().len(), start.elapsed())),
            Err(_) => {
                out.push((None, 0, start.elapsed()));
                send = h1(addr).await;
            }
        }
    }
    out
}

fn share(v: &[(Option<u16>, usize, Duration)], p: impl Fn(&(Option<u16>, usize, Duration)) -> bool) -> f64 {
    v.iter().filter(|x| p(x)).count() as f64 / v.len() as f64
}

#[tokio::test]
async fn a_tenth_of_answers_are_errors_and_a_seed_repeats_them() {
    let yaml = target("{ status: 200, body: ok, errors: { share: 10%, status: 503 }, seed: 42 }");
    let mut gate = Tollgate::start(&yaml).await;
    let got = run(gate.addr, 2_000).await;
    let errors = share(&got, |r| r.0 == Some(503));
    assert!((0.07..=0.13).contains(&errors), "{:.1} % errors, want 10 % ± 3 %", errors * 100.0);
    assert_eq!(share(&got, |r| r.0 == Some(200)) + errors, 1.0);
    gate.shutdown();
    // The same seed, a new process state: the same answers in the same order.
    let mut again = Tollgate::start(&yaml).await;
    let repeated = run(again.addr, 2_000).await;
    let statuses = |v: &[(Option<u16>, usize, Duration)]| v.iter().map(|r| r.0).collect::<Vec<_>>();
    assert_eq!(statuses(&got), statuses(&repeated));
    again.shutdown();
}

#[tokio::test]
async fn cut_answers_end_short_and_the_others_carry_their_whole_size() {
    let yaml = target("{ status: 200, body_size: 40KiB, resets: 10%, seed: 7 }");
    let mut gate = Tollgate::start(&yaml).await;
    let got = run(gate.addr, 2_000).await;
    let cut = share(&got, |r| r.0.is_none());
    assert!((0.07..=0.13).contains(&cut), "{:.1} % cut, want 10 % ± 3 %", cut * 100.0);
    assert!(got.iter().all(|r| r.0.is_none() || (r.0 == Some(200) && r.1 == 40 * 1024)));
    // Every answer was whole or cut: none came back at another size or status.
    assert!(share(&got, |r| r.0 == Some(200)) + cut == 1.0);
    gate.shutdown();
}

/// The `q` quantile of the answers' times.
fn quantile(v: &[(Option<u16>, usize, Duration)], q: f64) -> Duration {
    let mut t: Vec<Duration> = v.iter().map(|r| r.2).collect();
    t.sort();
    t[((t.len() as f64 * q) as usize).min(t.len() - 1)]
}

#[tokio::test]
async fn a_log_normal_latency_has_its_p50_and_p99() {
    let yaml = target("{ status: 200, body: ok, latency: { p50: 20ms, p99: 100ms }, seed: 3 }");
    let mut gate = Tollgate::start(&yaml).await;
    // 20 clients at once, 600 answers: the distribution's own shape, not one client's queue.
    let tasks: Vec<_> = (0..20).map(|_| tokio::spawn(run(gate.addr, 30))).collect();
    let mut got = Vec::new();
    for t in tasks {
        got.extend(t.await.unwrap());
    }
    let (p50, p99) = (quantile(&got, 0.5), quantile(&got, 0.99));
    // A loaded machine only adds time: the lower bounds are the distribution's within 20 %, the
    // upper one that half the answers come well before the p99 (a fixed 100 ms would not).
    assert!(p50 >= Duration::from_millis(16), "p50 {p50:?}");
    assert!(p99 >= Duration::from_millis(80), "p99 {p99:?}");
    assert!(p50 < Duration::from_millis(80), "p50 {p50:?}: not a distribution around 20 ms");
    gate.shutdown();
}

#[tokio::test]
async fn a_slow_body_arrives_a_piece_at_a_time() {
    let yaml = target("{ status: 200, body_size: 3000, drip: { bytes: 1000, every: 200ms } }");
    let mut gate = Tollgate::start(&yaml).await;
    let mut send = h1(gate.addr).await;
    let start = Instant::now();
    let req = Request::get("/").header("host", "localhost").body(full("")).unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.headers()["content-length"], "3000");
    let head = start.elapsed();
    let mut body = resp.into_body();
    let mut pieces = Vec::new();
    while let Some(frame) = body.frame().await {
        pieces.push((frame.unwrap().into_data().unwrap().len(), start.elapsed()));
    }
    assert_eq!(pieces.iter().map(|p| p.0).sum::<usize>(), 3000);
    // Three pieces, the last at least two intervals after the head.
    assert!(pieces.last().unwrap().1 >= head + Duration::from_millis(400), "{pieces:?}");
    assert!(pieces.len() >= 3, "{pieces:?}");
    gate.shutdown();
}

#[tokio::test]
async fn explain_says_each_fault_and_a_bad_one_is_refused_at_its_field() {
    let yaml = target(
        "{ status: 200, latency: { distribution: uniform, min: 10ms, max: 30ms }, errors: { share: 0.5%, status: 500 }, resets: 1%, body_size: 1MiB, drip: { bytes: 1KiB, every: 100ms }, seed: 9 }",
    );
    let config = tollgate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap();
    let text = tollgate::explain::explain(&config);
    for want in [
        "latency is uniform between 10ms and 30ms",
        "0.5 % of answers are errors: status 500",
        "1 % of answers are cut after half their body",
        "the body is 1048576 bytes",
        "sent 1024 bytes at a time, one piece every 100ms",
        "draws from seed 9",
    ] {
        assert!(text.contains(want), "`{want}` not in:\n{text}");
    }
    for (respond, field) in [
        ("{ latency: { p50: 50ms, p99: 10ms } }", "upstreams.t.respond.latency.p99"),
        ("{ latency: { distribution: uniform, min: 1s } }", "upstreams.t.respond.latency.max"),
        ("{ errors: { share: 120% } }", "upstreams.t.respond.errors.share"),
        ("{ errors: { share: 1%, status: 99 } }", "upstreams.t.respond.errors.status"),
        ("{ body: hi, body_size: 10 }", "upstreams.t.respond.body_size"),
        ("{ drip: { bytes: 0, every: 1s } }", "upstreams.t.respond.drip.bytes"),
    ] {
        let e = tollgate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &target(respond)).unwrap_err();
        assert_eq!(e.path, field, "{respond}: {e}");
    }
}
