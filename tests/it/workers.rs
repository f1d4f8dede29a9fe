//! `tollgate run` with two workers, as a process of its own: each worker takes connections
//! on its own `SO_REUSEPORT` socket (the process shape of `instance::process`).

use std::time::Duration;

use crate::support::process::Process;
use crate::support::{get, get_with};

#[tokio::test]
async fn two_workers_both_take_connections() {
    let tg = Process::start(
        "server: { workers: 2 }\nupstreams: { d: { respond: { body: ok } } }\nroutes: [{ upstream: d }]\n",
    )
    .await;
    let before = accepted(&tg).await;
    // Fresh connections from fresh source ports: the kernel spreads them by their addresses.
    for _ in 0..200 {
        let answer = tokio::time::timeout(Duration::from_secs(5), get_with(tg.addr, "/", &[("connection", "close")]));
        let (status, _, body) = answer.await.expect("a connection no worker took");
        assert_eq!((status.as_u16(), &body[..]), (200, &b"ok"[..]));
    }
    let after = accepted(&tg).await;
    let by_worker: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    println!("connections by worker: {by_worker:?}");
    // The admin listener's scrapes are not counted; each worker took a fair share (an even
    // split has a 1e-12 chance of falling outside 40..=160 of 200).
    assert_eq!(by_worker.iter().sum::<f64>(), 200.0, "{by_worker:?}");
    assert!(by_worker.iter().all(|&n| (40.0..=160.0).contains(&n)), "one worker took (almost) all: {by_worker:?}");
}

/// Connections each of the two workers accepted so far.
async fn accepted(tg: &Process) -> Vec<f64> {
    let (_, _, text) = get(tg.admin, "/metrics").await;
    let text = String::from_utf8_lossy(&text);
    (0..2)
        .map(|w| {
            let name = format!("tollgate_connections_accepted_total{{worker=\"{w}\"}} ");
            text.lines().find_map(|l| l.strip_prefix(&name)).map_or(0.0, |v| v.parse().unwrap())
        })
        .collect()
}
