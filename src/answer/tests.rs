use http_body_util::BodyExt;

use super::*;
use crate::gate::Gate;
use crate::limit::Timestamp;
use crate::request_key::KeyCtx;

fn route(limits: &str) -> (Gate, RouteAnswers, Metrics) {
    let yaml = format!(
        "listen: 127.0.0.1:1\nupstreams:\n  up: {{ url: http://127.0.0.1:9, timeout: 2s }}\nroutes:\n  - name: r\n    upstream: up\n    limits:\n{limits}"
    );
    let config = crate::config::Config::from_yaml(std::path::Path::new("t.yaml"), &yaml).unwrap();
    let metrics = Metrics::new();
    let r = &config.routes[0];
    let gate = Gate::new(r, &metrics, &mut |l| crate::gate::Limit::local_store(l));
    let facts = RouteFacts {
        name: &r.name,
        limits: r.limits.iter().map(|l| l.name.clone()).collect(),
        policy: gate.policy().cloned(),
        alone: None,
        upstream: Some(("up", Duration::from_secs(2))),
        methods: None,
    };
    let answers = RouteAnswers::new(Some(facts), Arc::from(crate::config::DEFAULT_PROBLEM_TYPE_BASE), &metrics);
    (gate, answers, metrics)
}

async fn denied(gate: &Gate, now: u64) -> Error {
    let parts = http::Request::new(()).into_parts().0;
    let ctx = KeyCtx::test(&parts);
    gate.check(&ctx, Timestamp::from_micros(now)).await.err().unwrap_or_else(|| panic!("admitted at {now}"))
}

async fn text(resp: Response<Body>) -> (http::response::Parts, serde_json::Value) {
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts, serde_json::from_slice(&bytes).unwrap())
}

#[tokio::test]
async fn cached_429s_follow_the_retry_after() {
    // One request per 10 s: denied at 0 s (retry after 10), at 4.5 s (6), at 9.2 s (1).
    let (g, a, _) = route("      - { name: slow, algorithm: token_bucket, rate: 1/10s, burst: 1 }\n");
    let get = http::Method::GET;
    let parts = http::Request::new(()).into_parts().0;
    let ctx = KeyCtx::test(&parts);
    assert!(g.check(&ctx, Timestamp::ZERO).await.is_ok());
    for round in 0..2 {
        for (now, secs) in [(1, 10), (4_500_000, 6), (9_200_000, 1)] {
            let (head, doc) = text(a.respond(&denied(&g, now).await, &get, "/", http::Version::HTTP_11)).await;
            assert_eq!(head.status, 429);
            assert_eq!(head.headers[RETRY_AFTER], secs.to_string().as_str(), "round {round} at {now}");
            assert_eq!(head.headers[ratelimit::RATELIMIT], format!("\"slow\";r=0;t={secs}").as_str());
            assert_eq!(head.headers[ratelimit::RATELIMIT_POLICY], "\"slow\";q=1;w=10");
            assert_eq!(doc["retry-after"], secs);
            assert_eq!(doc["type"], "https://iana.org/assignments/http-problem-types#quota-exceeded");
            assert_eq!(doc["violated-policies"], serde_json::json!(["slow"]));
        }
    }
}

const CHALLENGE: crate::answer::Challenge = crate::answer::Challenge {
    scheme: "Bearer",
    why: &crate::answer::Why { reason: "expired", description: Some("the token has expired") },
};

#[tokio::test]
async fn credentials_are_refused_with_a_challenge() {
    let (_, a, _) = route("");
    let (head, doc) =
        text(a.respond(&Error::Unauthenticated(CHALLENGE), &http::Method::GET, "/", http::Version::HTTP_11)).await;
    assert_eq!(
        head.headers[header::WWW_AUTHENTICATE],
        r#"Bearer realm="r", error="invalid_token", error_description="the token has expired""#
    );
    assert!(doc["detail"].as_str().unwrap().contains("expired"));
    let missing = crate::answer::Challenge {
        scheme: "ApiKey",
        why: &crate::answer::Why { reason: "missing", description: None },
    };
    let (head, _) =
        text(a.respond(&Error::Unauthenticated(missing), &http::Method::GET, "/", http::Version::HTTP_11)).await;
    assert_eq!(head.headers[header::WWW_AUTHENTICATE], r#"ApiKey realm="r""#);
    let (head, _) =
        text(a.respond(&Error::WrongAudience(CHALLENGE), &http::Method::GET, "/", http::Version::HTTP_11)).await;
    assert!(head.headers[header::WWW_AUTHENTICATE].to_str().unwrap().contains(r#"error="insufficient_scope""#));
}

#[tokio::test]
async fn two_denying_limits_are_both_named() {
    let (g, a, _) = route(
        "      - { name: a, algorithm: token_bucket, rate: 1/10s, burst: 1 }\n      - { name: b, algorithm: fixed_window, rate: 1/m }\n",
    );
    let parts = http::Request::new(()).into_parts().0;
    let ctx = KeyCtx::test(&parts);
    assert!(g.check(&ctx, Timestamp::ZERO).await.is_ok());
    let (head, doc) = text(a.respond(&denied(&g, 1).await, &http::Method::GET, "/", http::Version::HTTP_11)).await;
    assert_eq!(head.headers[ratelimit::RATELIMIT], "\"a\";r=0;t=10, \"b\";r=0;t=60");
    assert_eq!(head.headers[RETRY_AFTER], "60");
    assert_eq!(doc["violated-policies"], serde_json::json!(["a", "b"]));
    assert_eq!(doc["detail"], "route `r`: limit `a` and limit `b` admit no more requests now; retry after 60 s");
}

#[tokio::test]
async fn every_error_has_one_answer_with_its_source() {
    let (_, a, metrics) = route("      - { name: l, algorithm: token_bucket, rate: 1/s }\n");
    let cases: Vec<(Error, u16, &str, Option<&str>, Source)> = vec![
        (
            Error::BadRequest("the request has two Host fields"),
            400,
            "urn:tollgate:problem:bad-request",
            None,
            Source::Downstream,
        ),
        (
            Error::ClientBody(ClientBody::Malformed),
            400,
            "urn:tollgate:problem:bad-request-body",
            None,
            Source::Downstream,
        ),
        (Error::NoRoute, 404, "urn:tollgate:problem:no-route", None, Source::Policy),
        (
            Error::OverCapacity,
            503,
            "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity",
            Some("1"),
            Source::Policy,
        ),
        (
            Error::StoreUnavailable { limit: 0, retry_after_secs: 2 },
            503,
            "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity",
            Some("2"),
            Source::Store,
        ),
        (
            Error::Upstream(UpstreamFailure::Connect(Cause::default())),
            502,
            "urn:tollgate:problem:upstream-unreachable",
            None,
            Source::Upstream,
        ),
        (
            Error::Upstream(UpstreamFailure::Timeout),
            504,
            "urn:tollgate:problem:upstream-timeout",
            None,
            Source::Upstream,
        ),
        (
            Error::Upstream(UpstreamFailure::Broken(Cause::default())),
            502,
            "urn:tollgate:problem:upstream-failed",
            None,
            Source::Upstream,
        ),
        (
            Error::Upstream(UpstreamFailure::BadResponse("x")),
            502,
            "urn:tollgate:problem:upstream-bad-response",
            None,
            Source::Upstream,
        ),
        (Error::Internal("x"), 500, "urn:tollgate:problem:internal", None, Source::Internal),
        (Error::MethodNotAllowed, 405, "urn:tollgate:problem:method-not-allowed", None, Source::Policy),
        (Error::TooLarge(16), 413, "urn:tollgate:problem:content-too-large", None, Source::Downstream),
        (Error::Unauthenticated(CHALLENGE), 401, "urn:tollgate:problem:unauthenticated", None, Source::Policy),
        (Error::WrongAudience(CHALLENGE), 403, "urn:tollgate:problem:wrong-audience", None, Source::Policy),
        (
            Error::AuthUnavailable,
            503,
            "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity",
            Some("1"),
            Source::Store,
        ),
        (Error::CorsRefused("why"), 403, "urn:tollgate:problem:cors-refused", None, Source::Policy),
    ];
    for (err, status, kind, retry, source) in cases {
        assert_eq!(err.source(), source, "{err:?}");
        for _ in 0..2 {
            let (head, doc) = text(a.respond(&err, &http::Method::GET, "/x", http::Version::HTTP_11)).await;
            assert_eq!(head.status, status, "{err:?}");
            assert_eq!(head.headers[header::CONTENT_TYPE], "application/problem+json");
            assert_eq!(doc["type"], kind, "{err:?}");
            assert_eq!(doc["status"], status);
            assert_eq!(head.headers.get(RETRY_AFTER).map(|v| v.to_str().unwrap()), retry, "{err:?}");
            let closes = head.headers.get(header::CONNECTION).is_some_and(|v| v == "close");
            assert_eq!(closes, source == Source::Downstream, "{err:?}");
            // Only the heuristically cacheable 404 needs telling not to be stored.
            let no_store = head.headers.get(header::CACHE_CONTROL).is_some_and(|v| v == "no-store");
            assert_eq!(no_store, status == 404, "{err:?}");
            if source == Source::Upstream {
                assert_eq!(doc["upstream"], "up");
            }
        }
        let text = metrics.encode(None);
        let line =
            format!("tollgate_errors_total{{route=\"r\",source=\"{}\",kind=\"{}\"}} 2", source.as_str(), err.kind());
        assert!(text.contains(&line), "{line} not in\n{text}");
    }
    // Only the upstream's own failures and throttling may be answered by a stale copy.
    assert!(Error::ClientBody(ClientBody::Incomplete).stale_reason().is_none());
    assert!(Error::Upstream(UpstreamFailure::Broken(Cause::default())).stale_reason().is_some());
}

#[test]
fn no_route_names_the_request_without_echoing_it_whole() {
    let metrics = Metrics::new();
    let a = RouteAnswers::new(None, Arc::from("https://api.example.com/problems/"), &metrics);
    let long = format!("/{}", "é".repeat(300));
    let resp = a.respond(&Error::NoRoute, &http::Method::POST, &long, http::Version::HTTP_11);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let (_, doc) = rt.block_on(text(resp));
    assert_eq!(doc["type"], "https://api.example.com/problems/no-route");
    let detail = doc["detail"].as_str().unwrap();
    assert!(detail.starts_with("no route matches POST /é"), "{detail}");
    assert!(detail.len() < 300, "{detail}");
    assert!(metrics.encode(None).contains("tollgate_errors_total{route=\"-\",source=\"policy\",kind=\"no_route\"} 1"));
}

#[tokio::test]
async fn grpc_calls_get_a_grpc_status_and_pushback_where_a_wait_is_known() {
    let (g, a, _) = route("      - { name: slow, algorithm: token_bucket, rate: 1/10s, burst: 1 }\n");
    let parts = http::Request::new(()).into_parts().0;
    let ctx = KeyCtx::test(&parts);
    assert!(g.check(&ctx, Timestamp::ZERO).await.is_ok());
    let cases = [
        (denied(&g, 1).await, "8", Some("10000")),
        (Error::OverCapacity, "14", Some("1000")),
        (Error::StoreUnavailable { limit: 0, retry_after_secs: 3 }, "14", Some("3000")),
        (Error::Upstream(UpstreamFailure::Connect(Cause::default())), "14", None),
        (Error::Upstream(UpstreamFailure::Timeout), "4", None),
        (Error::NoRoute, "12", None),
        (Error::BadRequest("bad"), "13", None),
        (Error::Internal("x"), "13", None),
    ];
    for (err, code, pushback) in cases {
        let resp = a.respond_grpc(&err);
        assert_eq!(resp.status(), StatusCode::OK, "{err:?}");
        let h = resp.headers();
        assert_eq!(h[header::CONTENT_TYPE], "application/grpc");
        assert_eq!(h["grpc-status"], code, "{err:?}");
        assert_eq!(h.get("grpc-retry-pushback-ms").map(|v| v.to_str().unwrap()), pushback, "{err:?}");
        assert!(!h["grpc-message"].is_empty());
        assert!(http_body::Body::is_end_stream(resp.body()), "Trailers-Only: the status is in the head");
    }
}

#[test]
fn grpc_messages_are_percent_encoded() {
    assert_eq!(grpc_message("route `r`: 100% é\n"), "route `r`: 100%25 %C3%A9%0A");
}
