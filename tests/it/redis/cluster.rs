//! A Redis Cluster reshaping itself under load: a slot migration (MIGRATING/IMPORTING, an ASK
//! window, the slot handed over) and a reshard are the cluster working, not failures.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tollgate::limit::store::redis::{OnError, Topology};
use tollgate::limit::{Decision, KeyHash};

use super::{at_us, client_with, store, tb};
use crate::support::redis::{RedisCluster, RedisNode};

/// The index of the node serving `slot` (from `CLUSTER NODES`).
fn owner_of(cluster: &RedisCluster, slot: u16) -> usize {
    let nodes = cluster.nodes[0].cli(&["CLUSTER", "NODES"]);
    for line in nodes.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let serves = f.iter().skip(8).any(|r| match r.split_once('-') {
            Some((a, b)) => (a.parse::<u16>().unwrap()..=b.parse().unwrap()).contains(&slot),
            None => r.parse::<u16>().ok() == Some(slot),
        });
        if serves {
            let port: u16 = f[1].split(['@', ':']).nth(1).unwrap().parse().unwrap();
            return cluster.nodes.iter().position(|n| n.port == port).unwrap();
        }
    }
    panic!("slot {slot} has no owner: {nodes}");
}

fn id(node: &RedisNode) -> String {
    node.cli(&["CLUSTER", "MYID"]).trim().to_owned()
}

/// Moves `slot` from `from` to `to` by hand, as `redis-cli --cluster` does, holding the ASK
/// window (slot migrating, its keys already on the target) open for a while.
fn migrate(cluster: &RedisCluster, slot: u16, from: usize, to: usize) {
    let (src, dst) = (&cluster.nodes[from], &cluster.nodes[to]);
    let s = slot.to_string();
    assert_eq!(dst.cli(&["CLUSTER", "SETSLOT", &s, "IMPORTING", &id(src)]).trim(), "OK");
    assert_eq!(src.cli(&["CLUSTER", "SETSLOT", &s, "MIGRATING", &id(dst)]).trim(), "OK");
    for _ in 0..3 {
        let keys = src.cli(&["CLUSTER", "GETKEYSINSLOT", &s, "1000"]);
        let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        if !keys.is_empty() {
            let port = dst.port.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(keys);
            let out = src.cli(&args);
            assert!(out.contains("OK") || out.contains("NOKEY"), "MIGRATE: {out}");
        }
        // The ASK window: the slot's keys are on the target, the source still owns the slot.
        std::thread::sleep(Duration::from_millis(300));
    }
    let target = id(dst);
    for n in [dst, src].into_iter().chain(cluster.nodes.iter()) {
        assert_eq!(n.cli(&["CLUSTER", "SETSLOT", &s, "NODE", &target]).trim(), "OK");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migration_and_a_reshard_are_followed_without_errors() {
    let cluster = RedisCluster::start();
    // Deny: any call the store counts as failed is an error here.
    let client = client_with(Topology::Cluster(cluster.urls()), |c| {
        c.on_error = OnError::Deny;
        c.timeout = Duration::from_secs(2);
        c.memo_keys = 0;
    });
    client.connect().await.unwrap();
    const BURST: u64 = 1_000_000_000;
    // One unit an hour: the bucket's count is exact over the test.
    let s = Arc::new(store(&client, "moving", tb(3_600_000_000, BURST), None));
    let key = KeyHash(0x51_07);
    let slot: u16 = cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", &s.redis_key(key)]).trim().parse().unwrap();
    let from = owner_of(&cluster, slot);
    let (to, third) = ((from + 1) % 3, (from + 2) % 3);

    let stop = Arc::new(AtomicBool::new(false));
    let (sent, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut tasks = Vec::new();
    for t in 0..6u128 {
        let (s, stop, sent, errors) = (s.clone(), stop.clone(), sent.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0u128;
            while !stop.load(Ordering::Relaxed) {
                // The shared key, and keys all over the cluster on the same connections.
                match s.decide(key, at_us(0), 1).await {
                    Ok(d) => assert!(d.is_admitted(), "{d:?}"),
                    Err(e) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        eprintln!("decision failed: {e}");
                    }
                }
                sent.fetch_add(1, Ordering::Relaxed);
                let _ = s.decide(KeyHash(t * 1_000_000 + i % 64), at_us(0), 1).await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    let (seed, from_id, third_id) = (cluster.nodes[third].port, id(&cluster.nodes[from]), id(&cluster.nodes[third]));
    let cluster = tokio::task::spawn_blocking(move || {
        std::thread::sleep(Duration::from_millis(300));
        migrate(&cluster, slot, from, to);
        std::thread::sleep(Duration::from_millis(300));
        // Back to where it was, then 200 slots of its owner to the third node.
        migrate(&cluster, slot, to, from);
        let out = std::process::Command::new("redis-cli")
            .args(["--cluster", "reshard", &format!("127.0.0.1:{seed}")])
            .args(["--cluster-from", &from_id, "--cluster-to", &third_id, "--cluster-slots", "200"])
            .args(["--cluster-yes"])
            .output()
            .unwrap();
        assert!(out.status.success(), "reshard: {}", String::from_utf8_lossy(&out.stdout));
        std::thread::sleep(Duration::from_millis(300));
        cluster
    })
    .await
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let m = client.metrics().snapshot();
    let n = sent.load(Ordering::Relaxed);
    eprintln!("slot {slot}: {n} decisions on the moving key, {m:?}");
    assert_eq!(errors.load(Ordering::Relaxed), 0, "{m:?}");
    assert_eq!((m.fallbacks, m.reply_errors, m.connection_errors, m.timeouts), (0, 0, 0, 0), "{m:?}");
    // Nothing lost in the moves: the bucket counted every admission once.
    match s.decide(key, at_us(0), 1).await.unwrap() {
        Decision::Allow { remaining, .. } => assert_eq!(remaining, BURST - n - 1, "{m:?}"),
        d => panic!("{d:?}"),
    }
    assert_ne!(owner_of(&cluster, slot), to);
    assert!(n > 200, "traffic ran through the migration: {n}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_down_is_counted_as_connection_errors_not_replies() {
    let mut cluster = RedisCluster::start();
    let client = client_with(Topology::Cluster(cluster.urls()), |c| {
        c.on_error = OnError::Deny;
        c.memo_keys = 0;
        // Every call reaches the cluster client: no breaker in between.
        c.breaker_failures = std::num::NonZeroU32::MAX;
    });
    client.connect().await.unwrap();
    let s = store(&client, "down", tb(1_000, 1_000_000), None);
    // A key on the first master.
    let key = (0..10_000u128)
        .map(KeyHash)
        .find(|k| {
            let slot = cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", &s.redis_key(*k)]).trim().parse().unwrap();
            owner_of(&cluster, slot) == 0
        })
        .unwrap();
    assert!(s.decide(key, at_us(0), 1).await.unwrap().is_admitted());
    cluster.nodes[0].kill();
    let mut failed = 0;
    for _ in 0..40 {
        failed += u32::from(s.decide(key, at_us(0), 1).await.is_err());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = client.metrics().snapshot();
    assert!(failed > 0 && m.connection_errors > 0, "{m:?}");
    assert_eq!(m.reply_errors, 0, "{m:?}");
    // The live masters point at the dead one: that redirect is followed once per call, not again.
    assert!(m.redirects <= 40, "{m:?}");
}
