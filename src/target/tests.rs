use http::Request;

use super::*;

fn parts(version: Version, uri: &str, hosts: &[&str]) -> Parts {
    let mut b = Request::builder().version(version).uri(uri);
    for h in hosts {
        b = b.header(HOST, *h);
    }
    b.body(()).expect("valid test request").into_parts().0
}

fn h1(uri: &str, host: &str) -> Parts {
    parts(Version::HTTP_11, uri, &[host])
}

/// (canonical Host, forwarded path and query, matched path) or the reason for a 400.
fn decided(mut p: Parts) -> Result<(String, String, String), &'static str> {
    let t = decide(&mut p).map_err(|e| match e {
        Error::BadRequest(why) => why,
        _ => "another error",
    })?;
    let host = p.headers.get(HOST).map(|v| v.to_str().unwrap_or("").to_owned()).unwrap_or_default();
    let pq = p.uri.path_and_query().map_or("", |pq| pq.as_str()).to_owned();
    Ok((host, pq, t.path(&p).to_owned()))
}

#[test]
fn hosts_are_canonical_lower_case_without_trailing_dot() {
    for (sent, want) in [
        ("api.example.com", "api.example.com"),
        ("API.Example.COM", "api.example.com"),
        ("api.example.com.", "api.example.com"),
        ("api.example.com.:8080", "api.example.com:8080"),
        ("api.example.com:", "api.example.com"),
        ("127.0.0.1:80", "127.0.0.1:80"),
        ("[::1]:8080", "[::1]:8080"),
        ("[2001:DB8::1]", "[2001:db8::1]"),
        ("internal_host", "internal_host"),
    ] {
        assert_eq!(decided(h1("/", sent)).map(|d| d.0), Ok(want.to_owned()), "{sent}");
    }
    assert_eq!(host(&h1("/", "a.b:1").headers), Some("a.b"));
    assert_eq!(strip_port("[::1]:8080"), "[::1]");
}

#[test]
fn malformed_hosts_are_refused() {
    for sent in [
        "",
        "a b",
        "user@api.example.com",
        "api.example.com:80:80",
        "api.example.com:http",
        "api..example.com",
        ".example.com",
        "[::1",
        "[::1]x",
        "[fe80::1%eth0]",
        "exa/mple.com",
        "api.example.com:123456",
    ] {
        assert!(decided(h1("/", sent)).is_err(), "{sent:?} was accepted");
    }
}

#[test]
fn one_authority_per_request() {
    assert_eq!(decided(parts(Version::HTTP_11, "/", &["a.com", "b.com"])), Err("the request has two Host fields"));
    assert_eq!(decided(parts(Version::HTTP_11, "/", &["a.com", "a.com"])), Err("the request has two Host fields"));
    // Absolute-form: the target's authority, and a Host that disagrees is refused.
    assert!(decided(h1("http://public.example.com/x", "admin.internal")).is_err());
    assert_eq!(
        decided(h1("http://Public.example.com/x", "public.example.com.")).map(|d| d.0),
        Ok("public.example.com".to_owned())
    );
    assert_eq!(
        decided(parts(Version::HTTP_11, "http://public.example.com/x", &[])).map(|d| d.0),
        Ok("public.example.com".to_owned())
    );
    // HTTP/2 carries :authority in the URI; a `host` field must agree with it.
    assert!(decided(parts(Version::HTTP_2, "http://public.example.com/", &["admin.internal"])).is_err());
    assert_eq!(
        decided(parts(Version::HTTP_2, "http://public.example.com/", &[])).map(|d| d.0),
        Ok("public.example.com".to_owned())
    );
    assert_eq!(decided(parts(Version::HTTP_11, "/", &[])), Err("an HTTP/1.1 request needs a Host field"));
    assert!(decided(parts(Version::HTTP_10, "/", &[])).is_ok());
}

#[test]
fn paths_are_normalised_once() {
    for (sent, fwd, matched) in [
        ("/api/users", "/api/users", "/api/users"),
        ("/%61pi/users", "/api/users", "/api/users"),
        ("/x/../api/", "/api/", "/api/"),
        ("/x/%2e%2E/api/", "/api/", "/api/"),
        ("//api//users", "/api/users", "/api/users"),
        ("/api/./users/.", "/api/users/", "/api/users/"),
        ("/api/..", "/", "/"),
        ("/a%20b?q=%2F", "/a%20b?q=%2F", "/a%20b"),
        ("/a%3ab", "/a%3Ab", "/a%3Ab"),
        ("/api;v=1/users", "/api;v=1/users", "/api/users"),
        ("/api;jsessionid=x", "/api;jsessionid=x", "/api"),
        ("/;x/api/users", "/;x/api/users", "/api/users"),
        ("/api/;x", "/api/;x", "/api/"),
        ("/api;x/", "/api;x/", "/api/"),
        ("/;x", "/;x", "/"),
        ("/a;b/;c/d;e", "/a;b/;c/d;e", "/a/d"),
        ("/", "/", "/"),
        ("/.", "/", "/"),
    ] {
        let got = decided(h1(sent, "h"));
        assert_eq!(got.map(|d| (d.1, d.2)), Ok((fwd.to_owned(), matched.to_owned())), "{sent}");
    }
}

#[test]
fn ambiguous_paths_are_refused() {
    for sent in [
        "/api%2Fusers",
        "/api%2fusers",
        "/api%5Cusers",
        "/api%00",
        "/..",
        "/a/../../b",
        "/api/%2e%2e/%2e%2e/x",
        "/a/..;/api/",
        "/a/.;x/b",
        "/a%zz",
        "/a%4",
    ] {
        assert!(decided(h1(sent, "h")).is_err(), "{sent} was accepted");
    }
    let mut star = parts(Version::HTTP_11, "*", &["h"]);
    star.method = Method::OPTIONS;
    assert!(decide(&mut star).is_ok());
}
