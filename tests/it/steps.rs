//! A per-route step written here, outside the library, plugs in with one registration: its
//! YAML value is checked when the config loads (a bad one refused with its position), its
//! request side changes what goes upstream or answers at once, and its answer side sees every
//! answer of the route, tollgate's own 429 included.

use std::path::Path;
use std::sync::{Arc, Once};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::request::Parts;
use http::{Response, StatusCode};
use tollgate::config::Config;
use tollgate::step::{Answer, Step, Value};

use crate::support::{full, get, Tollgate, Upstream};

/// Stamps a field on the request it forwards and on every answer, and says where each answer
/// came from; answers `/teapot` itself.
struct Stamp {
    name: HeaderName,
    value: HeaderValue,
}

impl Step for Stamp {
    fn request(&self, head: &mut Parts) -> Option<Response<Bytes>> {
        if head.uri.path() == "/teapot" {
            let mut teapot = Response::new(Bytes::from_static(b"short and stout"));
            *teapot.status_mut() = StatusCode::IM_A_TEAPOT;
            return Some(teapot);
        }
        head.headers.insert(self.name.clone(), self.value.clone());
        None
    }

    fn answer(&self, answer: &mut Answer<'_>) {
        let from = format!("{:?}", answer.from()).to_lowercase();
        answer.headers_mut().insert(self.name.clone(), self.value.clone());
        answer.headers_mut().insert("x-stamped-from", HeaderValue::try_from(from).unwrap());
    }

    fn explain(&self) -> String {
        format!("stamps {}: {} on the request and on every answer", self.name, self.value.to_str().unwrap_or("?"))
    }
}

fn stamp(v: &Value) -> Result<Arc<dyn Step>, String> {
    let text = |k: &str| v.get(k).and_then(Value::as_str).ok_or_else(|| format!("expected `{k}` (text)"));
    let name = HeaderName::from_bytes(text("header")?.as_bytes()).map_err(|_| "`header` is not a header name")?;
    let value = HeaderValue::try_from(text("value")?).map_err(|_| "`value` is not a header value")?;
    Ok(Arc::new(Stamp { name, value }))
}

/// The one registration (once per test process).
fn registered() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| tollgate::step::register("stamp", stamp).unwrap());
}

fn yaml(upstream: std::net::SocketAddr, value: &str) -> String {
    format!(
        "upstreams:
  up: {{ url: 'http://{upstream}' }}
routes:
  - name: api
    upstream: up
    extensions:
      stamp: {value}
    limits:
      - {{ name: one, algorithm: token_bucket, rate: 1/h, burst: 1, key: route }}
"
    )
}

#[tokio::test]
async fn a_step_written_outside_the_library_plugs_in_with_one_registration() {
    registered();
    // The upstream says whether the stamp reached it.
    let up = Upstream::start(|req| async move {
        let seen = req.headers().get("x-stamped").map_or("-".to_owned(), |v| v.to_str().unwrap().to_owned());
        Response::new(full(seen))
    })
    .await;
    let tg = Tollgate::start(&yaml(up.addr, "{ header: x-stamped, value: 'yes' }")).await;

    let (status, headers, body) = get(tg.addr, "/").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "yes", "the request side stamped what went upstream");
    assert_eq!(headers["x-stamped"], "yes");
    assert_eq!(headers["x-stamped-from"], "upstream");

    // The limit's own 429 goes through the answer side too.
    let (status, headers, _) = get(tg.addr, "/").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["x-stamped"], "yes");
    assert_eq!(headers["x-stamped-from"], "own");
    assert!(headers.contains_key("retry-after"));

    // An answer of the step's own: never forwarded, and no quota to spend first.
    let (status, headers, body) = get(tg.addr, "/teapot").await;
    assert_eq!((status, &body[..]), (StatusCode::IM_A_TEAPOT, &b"short and stout"[..]));
    assert_eq!(headers["x-stamped-from"], "own");
    assert!(headers.contains_key("x-request-id"));

    // `explain` asks the step for its line.
    let config = Config::from_yaml(Path::new("t.yaml"), &yaml(up.addr, "{ header: x-stamped, value: 'yes' }")).unwrap();
    let text = tollgate::explain::explain(&config);
    assert!(
        text.contains("extension steps: stamp: stamps x-stamped: yes on the request and on every answer"),
        "{text}"
    );
}

#[test]
fn a_value_the_step_refuses_is_a_config_error_at_its_place() {
    registered();
    let up = "127.0.0.1:9".parse().unwrap();
    let e = Config::from_yaml(Path::new("t.yaml"), &yaml(up, "{ header: 'not a name', value: x }")).unwrap_err();
    assert_eq!(e.path, "routes[0].extensions.stamp");
    assert_eq!((e.line, e.column), (7, 14), "{e}");
    assert!(e.message.contains("step `stamp`: `header` is not a header name"), "{e}");

    let text = yaml(up, "{ header: x, value: y }").replace("      stamp:", "      stomp:");
    let e = Config::from_yaml(Path::new("t.yaml"), &text).unwrap_err();
    assert_eq!(e.path, "routes[0].extensions.stomp");
    assert!(e.message.contains("unknown step `stomp`; registered: ") && e.message.contains("stamp"), "{e}");

    // A name names one step.
    assert!(tollgate::step::register("stamp", stamp).unwrap_err().contains("registered already"));
    assert!(tollgate::step::register("not a name", stamp).is_err());
}
