//! A network partition between the store and Redis: sockets stay open, nothing gets through.
//! Shared decisions come back within a probe interval of the network's return, however long
//! the partition lasted.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::limit::store::redis::{BreakerState, OnError, Topology};
use tollgate::limit::KeyHash;

use super::{at_us, client_with, store, tb};
use crate::support::redis::{RedisNode, Relay};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_are_shared_again_soon_after_a_30_s_partition_ends() {
    let node = RedisNode::start();
    let relay = Relay::start(node.port).await;
    let cooldown = Duration::from_millis(500);
    let client = client_with(Topology::Single(relay.url()), |c| {
        c.on_error = OnError::Deny;
        c.timeout = Duration::from_millis(200);
        c.breaker_failures = NonZeroU32::new(3).unwrap();
        c.breaker_cooldown = cooldown;
        c.memo_keys = 0;
    });
    client.connect().await.unwrap();
    let s = Arc::new(store(&client, "partition", tb(1_000, 1_000_000), None));
    // Decisions every 10 ms: (when it ended, answered by Redis).
    let traffic = {
        let s = s.clone();
        tokio::spawn(async move {
            let mut log = Vec::new();
            let end = Instant::now() + Duration::from_secs(36);
            while Instant::now() < end {
                let ok = s.decide(KeyHash(1), at_us(0), 1).await.is_ok();
                log.push((Instant::now(), ok));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            log
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    relay.cut(true);
    let cut_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(30)).await;
    relay.cut(false);
    let restored = Instant::now();
    let log = traffic.await.unwrap();
    assert!(log.iter().filter(|(t, _)| *t < cut_at).all(|(_, ok)| *ok), "answered before the partition");
    let during = log.iter().filter(|(t, _)| *t > cut_at + Duration::from_secs(1) && *t < restored);
    assert!(during.clone().count() > 100 && during.clone().all(|(_, ok)| !ok), "the partition was seen");
    let back = log.iter().find(|(t, ok)| *t > restored && *ok).map(|(t, _)| *t - restored);
    eprintln!("shared decisions back {back:?} after the partition ended; {:?}", client.metrics().snapshot());
    let back = back.expect("decisions never shared again");
    assert!(back < Duration::from_secs(2), "shared again only {back:?} after the network returned");
    // And they stay shared.
    let after = log.iter().filter(|(t, _)| *t > restored + back);
    assert!(after.clone().all(|(_, ok)| *ok), "{:?}", after.filter(|(_, ok)| !ok).count());
    assert_eq!(client.breaker_state(), BreakerState::Closed);
}
