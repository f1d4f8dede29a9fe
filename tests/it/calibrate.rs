//! `tollgate calibrate` against tollgate's own responder behind a concurrency cap: a server
//! whose knee is known from its configuration.

use std::process::Stdio;
use std::time::Duration;

use crate::support::Tollgate;

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

/// 4 slots × 20 ms answers = 200 requests/s; past that, requests queue up to 200 ms for a
/// slot and then get 503. The knee must come out within one 50/s step of 200/s.
///
/// The generator and the server run in one runtime on tokio's paused clock, over real
/// loopback sockets: time moves only when every task waits (the responder's 20 ms, the next
/// request's due time, a slot's wait), never while one computes, so a loaded machine cannot
/// make the generator late or the server slow. On the wall clock it took the whole machine:
/// two busy cores made the generator fall behind and the knee come out nowhere.
#[tokio::test(start_paused = true)]
async fn finds_the_knee_of_a_capped_responder_within_one_step() {
    use tollgate::calibrate::{self, Options, Slo};
    let tg = Tollgate::start(
        "upstreams:\n  slow: { respond: { body: ok, latency: 20ms } }\nroutes:\n  - name: capped\n    upstream: slow\n    concurrency: { max: 4, max_wait: 200ms }\n",
    )
    .await;
    let options = Options {
        target: calibrate::target(&tg.url("/"), None, &[], None).unwrap(),
        rates: calibrate::listed("100,150,200,250,300,350").unwrap(),
        warmup: Duration::from_millis(500),
        step: Duration::from_secs(2),
        timeout: Duration::from_secs(2),
        concurrency_max: 1000,
        slo: Slo { p99_ms: Some(100.0), errors: 0.001 },
        instances: Some(3),
        max_duration: Duration::from_secs(15 * 60),
        stop_after_bad: 2,
    };
    options.check().unwrap();
    let run = calibrate::run(&options, None, std::future::pending());
    let report = run.await;
    let dir = std::env::temp_dir().join(format!("tollgate-calibrate-{}", std::process::id()));
    calibrate::report::write_dir(&report, &dir).unwrap();
    let report = serde_json::to_value(&report).unwrap();
    let (good, bad) = (report["knee"]["last_good"].as_u64(), report["knee"]["first_bad"].as_u64());
    assert!(
        matches!((good, bad), (Some(150), Some(200)) | (Some(200), Some(250))),
        "knee {good:?}–{bad:?}: {report:#}"
    );
    let steps = report["steps"].as_array().unwrap();
    // Below capacity: no error, latency near the responder's 20 ms; it stopped 2 bad steps in.
    assert_eq!(steps[0]["errors"].as_f64(), Some(0.0), "{report:#}");
    assert!(steps[0]["p50_ms"].as_f64().unwrap() >= 20.0, "{report:#}");
    // Two bad steps end the run: the first bad one and the next.
    assert_eq!(steps.last().unwrap()["rate"].as_u64(), bad.map(|b| b + 50), "{report:#}");
    // Past it: the 503s of the full cap, and queueing visible in the p99.
    let last = steps.last().unwrap();
    assert!(last["errors"].as_f64().unwrap() > 0.01 || last["p99_ms"].as_f64().unwrap() > 100.0, "{report:#}");
    // The knee was judged on steps the generator kept up with (a step where it fell behind
    // would have ended the search without a first bad step).
    assert_eq!(report["knee"]["generator_limited_at"], serde_json::Value::Null, "{report:#}");
    let s = &report["suggestion"];
    let rate = s["rate"].as_u64().unwrap();
    assert!((162..=212).contains(&rate), "{report:#}");
    assert_eq!(s["cluster_rate"].as_u64(), Some(rate * 3 * 8 / 10), "{report:#}");
    // The files, and a suggestion `check` accepts.
    let svg = std::fs::read_to_string(dir.join("chart.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("knee"));
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["knee"], report["knee"]);
    let check =
        std::process::Command::new(BIN).arg("check").arg("-c").arg(dir.join("suggestion.yaml")).output().unwrap();
    assert!(check.status.success(), "{check:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn refuses_a_plan_past_its_bounds_with_exit_2() {
    let out = std::process::Command::new(BIN)
        .args([
            "calibrate",
            "http://127.0.0.1:9/",
            "--rates",
            "100,200",
            "--step-duration",
            "10m",
            "--max-duration",
            "5m",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("more than --max-duration"), "{out:?}");
    let out = std::process::Command::new(BIN).args(["calibrate", "https://127.0.0.1:9/"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[test]
fn ctrl_c_stops_at_once_and_prints_what_was_measured() {
    // A server that closes every connection unanswered: every request fails fast, and the port
    // stays this test's (a freed port can be taken by a parallel test's server). The run would
    // take minutes.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            drop(conn);
        }
    });
    let child = std::process::Command::new(BIN)
        .args(["calibrate", &format!("http://127.0.0.1:{port}/"), "--rates", "50,60,70", "--step-duration", "60s"])
        .args(["--warmup", "0", "--json"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let _ = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["stopped"], "interrupted");
    let step = &report["steps"][0];
    assert_eq!((step["rate"].as_u64(), step["interrupted"].as_bool()), (Some(50), Some(true)), "{report:#}");
    assert_eq!(step["errors"].as_f64(), Some(1.0), "{report:#}");
}
