//! Every connection to Redis has Nagle's algorithm off (`TCP_NODELAY`), as client sockets
//! do: decisions sent together must not wait for the previous segment's acknowledgement.
//! Read from the sockets themselves: this process's file descriptors connected to the test's
//! redis-server ports.

use std::collections::HashSet;
use std::os::fd::{BorrowedFd, RawFd};

use tollgate::limit::store::redis::Topology;
use tollgate::limit::KeyHash;

use super::{at_us, client_with, store, tb};
use crate::support::redis::{RedisCluster, RedisNode};

/// This process's established TCP sockets whose peer is `127.0.0.1:port`, with their
/// `TCP_NODELAY`.
fn sockets_to(port: u16) -> Vec<(RawFd, bool)> {
    let mut inodes = HashSet::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let (Some(remote), Some(state), Some(inode)) = (cols.get(2), cols.get(3), cols.get(9)) else { continue };
            let remote_port = remote.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            // 01: ESTABLISHED.
            if remote_port == Some(port) && *state == "01" {
                inodes.insert(format!("socket:[{inode}]"));
            }
        }
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(link) = std::fs::read_link(entry.path()) else { continue };
        if !inodes.contains(link.to_string_lossy().as_ref()) {
            continue;
        }
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<RawFd>() else { continue };
        // SAFETY: the descriptor belongs to the Redis client, which holds it open for the
        // length of this call (the test keeps the client).
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        if let Ok(nodelay) = socket2::SockRef::from(&borrowed).tcp_nodelay() {
            out.push((fd, nodelay));
        }
    }
    out
}

#[tokio::test]
async fn a_single_node_connection_has_nagle_off() {
    let node = RedisNode::start();
    let client = client_with(Topology::Single(node.url()), |_| {});
    client.connect().await.unwrap();
    let s = store(&client, "nodelay", tb(1_000, 10), None);
    s.decide(KeyHash(7), at_us(0), 1).await.unwrap();
    let sockets = sockets_to(node.port);
    assert!(!sockets.is_empty(), "no connection to port {} found", node.port);
    assert!(sockets.iter().all(|(_, nodelay)| *nodelay), "TCP_NODELAY off on {sockets:?}");
}

#[tokio::test]
async fn every_cluster_connection_has_nagle_off() {
    let cluster = RedisCluster::start();
    let client = client_with(Topology::Cluster(cluster.urls()), |_| {});
    client.connect().await.unwrap();
    let s = store(&client, "nodelay", tb(1_000, 10), None);
    // Keys enough to reach every master.
    for k in 0..64 {
        s.decide(KeyHash(k), at_us(0), 1).await.unwrap();
    }
    for node in &cluster.nodes {
        let sockets = sockets_to(node.port);
        assert!(!sockets.is_empty(), "no connection to port {} found", node.port);
        assert!(sockets.iter().all(|(_, nodelay)| *nodelay), "port {}: TCP_NODELAY off on {sockets:?}", node.port);
    }
}
