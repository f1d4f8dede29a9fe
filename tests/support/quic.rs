//! An HTTP/3 client for tests: quinn with the `h3` crate.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use http::{Request, StatusCode};

use super::tls::{client_config, Ca};

/// An HTTP/3 client connection (quinn and h3), its driver running beside it.
pub struct H3 {
    pub conn: quinn::Connection,
    pub send: h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>,
    _endpoint: quinn::Endpoint,
}

impl H3 {
    pub async fn connect(addr: SocketAddr, ca: &Ca) -> Result<H3, String> {
        let tls = client_config(ca, &[b"h3"], None);
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).map_err(|e| e.to_string())?;
        endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic)));
        let conn = endpoint.connect(addr, "api.test").map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
        let (mut driver, send) =
            h3::client::new(h3_quinn::Connection::new(conn.clone())).await.map_err(|e| e.to_string())?;
        tokio::spawn(async move { std::future::poll_fn(|cx| driver.poll_close(cx)).await });
        Ok(H3 { conn, send, _endpoint: endpoint })
    }

    /// `method path` with `body`; the status, headers and body of the answer.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> Result<(StatusCode, http::HeaderMap, Bytes), String> {
        self.request_with(method, path, &[], body).await
    }

    /// [`H3::request`] with `headers` (sent as they are: h3's client checks none of them).
    pub async fn request_with(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(StatusCode, http::HeaderMap, Bytes), String> {
        let mut send = self.send.clone();
        let mut req = Request::builder().method(method).uri(format!("https://api.test{path}"));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(()).unwrap();
        let mut stream = send.send_request(req).await.map_err(|e| e.to_string())?;
        if !body.is_empty() {
            stream.send_data(Bytes::copy_from_slice(body)).await.map_err(|e| e.to_string())?;
        }
        stream.finish().await.map_err(|e| e.to_string())?;
        let resp = stream.recv_response().await.map_err(|e| e.to_string())?;
        let mut out = BytesMut::new();
        while let Some(mut chunk) = stream.recv_data().await.map_err(|e| e.to_string())? {
            out.extend_from_slice(&chunk.copy_to_bytes(chunk.remaining()));
        }
        Ok((resp.status(), resp.headers().clone(), out.freeze()))
    }

    pub async fn get(&self, path: &str) -> (StatusCode, http::HeaderMap, Bytes) {
        self.request("GET", path, b"").await.unwrap_or_else(|e| panic!("GET {path} over HTTP/3: {e}"))
    }
}
