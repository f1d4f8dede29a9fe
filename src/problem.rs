//! `application/problem+json` answers (RFC 9457) for everything tollgate says itself:
//! no route, upstream failures, throttling.

use http::{header, HeaderValue, Response, StatusCode};
use serde_json::json;

use crate::body::Body;

/// Base of the `type` URIs; the suffix names the problem (`no-route`, `quota-exceeded`, …).
pub const TYPE_BASE: &str = "https://tollgate.dev/problems/";

pub const CONTENT_TYPE: HeaderValue = HeaderValue::from_static("application/problem+json");

/// A problem answer with the standard members plus any `extra` members.
pub fn response(status: StatusCode, kind: &str, title: &str, detail: &str, extra: serde_json::Value) -> Response<Body> {
    let mut doc = json!({
        "type": format!("{TYPE_BASE}{kind}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    if let (Some(doc), serde_json::Value::Object(extra)) = (doc.as_object_mut(), extra) {
        doc.extend(extra);
    }
    let mut resp = Response::new(Body::full(doc.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, CONTENT_TYPE);
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

pub fn no_route(method: &http::Method, path: &str) -> Response<Body> {
    response(
        StatusCode::NOT_FOUND,
        "no-route",
        "No route matches this request",
        &format!("no route matches {method} {path}"),
        serde_json::Value::Null,
    )
}
