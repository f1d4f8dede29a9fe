//! An HTTP/3 load generator for benches/h3.sh (Debian's h2load is built without QUIC):
//! `CONNS` connections, each keeping `STREAMS` GETs in flight, until `N` requests are done;
//! or, with `--handshakes`, `N` connections one after another per client task, each with one
//! GET. Prints one line: requests, failures, seconds, requests a second.
//!
//!   cargo run --release --example h3load -- ADDR SNI CA.pem URL_PATH N CONNS STREAMS [--handshakes]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::{Buf, Bytes};
use rustls::pki_types::pem::PemObject;

type Send = h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>;

struct Target {
    addr: SocketAddr,
    sni: String,
    url: String,
    client: quinn::ClientConfig,
}

fn endpoint(t: &Target) -> Result<quinn::Endpoint, String> {
    let mut endpoint =
        quinn::Endpoint::client("127.0.0.1:0".parse().map_err(|_| "addr")?).map_err(|e| e.to_string())?;
    endpoint.set_default_client_config(t.client.clone());
    Ok(endpoint)
}

async fn connect(endpoint: &quinn::Endpoint, t: &Target) -> Result<(quinn::Connection, Send), String> {
    let conn = endpoint.connect(t.addr, &t.sni).map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
    let (mut driver, send) =
        h3::client::new(h3_quinn::Connection::new(conn.clone())).await.map_err(|e| e.to_string())?;
    tokio::spawn(async move { std::future::poll_fn(|cx| driver.poll_close(cx)).await });
    Ok((conn, send))
}

async fn get(send: &mut Send, url: &str) -> Result<(), String> {
    let req = http::Request::get(url).body(()).map_err(|e| e.to_string())?;
    let mut stream = send.send_request(req).await.map_err(|e| e.to_string())?;
    stream.finish().await.map_err(|e| e.to_string())?;
    let resp = stream.recv_response().await.map_err(|e| e.to_string())?;
    while let Some(mut chunk) = stream.recv_data().await.map_err(|e| e.to_string())? {
        chunk.advance(chunk.remaining());
    }
    if resp.status().is_success() {
        Ok(())
    } else {
        Err(format!("status {}", resp.status()))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 8 {
        return Err("usage: h3load ADDR SNI CA.pem PATH N CONNS STREAMS [--handshakes]".into());
    }
    let (addr, sni, ca, path) = (args[1].parse()?, args[2].clone(), &args[3], &args[4]);
    let (n, conns, streams): (u64, u64, u64) = (args[5].parse()?, args[6].parse()?, args[7].parse()?);
    let handshakes = args.get(8).is_some_and(|a| a == "--handshakes");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca)? {
        roots.add(cert?)?;
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"h3".to_vec()];
    // Every handshake full: no ticket kept between connections.
    tls.resumption = rustls::client::Resumption::disabled();
    let client = quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(tls)?));
    let target = Arc::new(Target { addr, sni, url: format!("https://{}{path}", args[2]), client });
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (done, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let started = Instant::now();
    runtime.block_on(async {
        let mut tasks = Vec::new();
        let next = Arc::new(AtomicU64::new(0));
        for _ in 0..conns {
            let (t, done, failed, next) = (target.clone(), done.clone(), failed.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                let Ok(endpoint) = endpoint(&t) else {
                    failed.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                if handshakes {
                    while next.fetch_add(1, Ordering::Relaxed) < n {
                        match connect(&endpoint, &t).await {
                            Ok((conn, mut send)) => {
                                let ok = get(&mut send, &t.url).await.is_ok();
                                (if ok { &done } else { &failed }).fetch_add(1, Ordering::Relaxed);
                                conn.close(0u32.into(), b"");
                            }
                            Err(_) => {
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    return;
                }
                let Ok((conn, send)) = connect(&endpoint, &t).await else {
                    failed.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                let mut lanes = Vec::new();
                for _ in 0..streams {
                    let (t, done, failed, next, mut send) =
                        (t.clone(), done.clone(), failed.clone(), next.clone(), send.clone());
                    lanes.push(tokio::spawn(async move {
                        while next.fetch_add(1, Ordering::Relaxed) < n {
                            let ok = get(&mut send, &t.url).await.is_ok();
                            (if ok { &done } else { &failed }).fetch_add(1, Ordering::Relaxed);
                        }
                    }));
                }
                for l in lanes {
                    let _ = l.await;
                }
                conn.close(0u32.into(), b"");
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
    });
    let secs = started.elapsed().as_secs_f64();
    let (d, f) = (done.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    println!("requests {d} failed {f} seconds {secs:.3} rps {:.0}", d as f64 / secs);
    Ok(())
}
