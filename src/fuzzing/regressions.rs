//! Inputs that broke an invariant, replayed exactly as found.

use super::*;

/// Found by `yaml_shaped_noise_loads_or_points_inside_the_text`: the file `#` (one line) gets
/// `fuzz.yaml:2:1: missing field upstreams`. serde_yaml's position of an error at the end of a
/// text without a final line break is on the line after the last (libyaml ends the stream on
/// a line of its own); `Config::from_yaml` passes it on instead of clamping it into the text.
#[test]
fn config_error_at_the_end_is_inside_the_text() {
    for text in ["#", "listen: 127.0.0.1:8080", "routes: []\nupstreams: {}"] {
        let e = Config::from_yaml(Path::new("fuzz.yaml"), text).expect_err("incomplete config");
        assert!(within(text, e.line, e.column), "{e} is outside {text:?}");
    }
}

/// Found by `decided_targets_are_canonical_and_stable` (and the `target` fuzz target): a
/// segment made only of parameters becomes an empty segment of the matched path, so
/// `/api/;x/users` is routed as `/api//users`, past a route for `/api/users`, while Tomcat and
/// Spring strip the parameter, merge the slashes and serve `/api/users`.
#[test]
fn parameter_only_segment_leaves_no_empty_segment() {
    for (sent, want) in [("/api/;x/users", "/api/users"), ("/api/;/users", "/api/users"), ("/;a/;b/x", "/x")] {
        let mut parts = Head::parse(format!("GET {sent} HTTP/1.1\nhost: a").as_bytes()).request().expect("valid");
        let decided = crate::target::decide(&mut parts).expect("accepted");
        assert_eq!(decided.path(&parts), want, "{sent}");
    }
}

/// Found by the `cache_fields` fuzz target (a fault of the check, not of the parser): with
/// spaces before `=` the directive is still read by its trimmed name.
#[test]
fn directive_with_spaces_before_the_equals_sign() {
    let mut data = b"TTEEE\ncOache-.\ncache-control:".to_vec();
    data.extend([b'\t'; 59]);
    data.extend(b"no-store");
    data.extend([b'\t'; 20]);
    data.extend(b"=EEEEEEE");
    cache_fields(&data);
    let headers = Head::parse(b"HTTP/1.1 200\ncache-control: max-age = 5, no-store\t=x").headers();
    let cc = cache_control(&headers, 0);
    assert_eq!((cc.max_age, cc.no_store), (Some(5), true));
}

/// Found by `yaml_shaped_noise_loads_or_points_inside_the_text` after the first fix: a field
/// whose empty value ends the text (`z:`) was placed by the marked re-read on the line after.
#[test]
fn config_error_on_an_empty_last_value_is_inside_the_text() {
    for text in ["z:", "routes:", "upstreams: {}\nroutes:"] {
        let e = Config::from_yaml(Path::new("fuzz.yaml"), text).expect_err("incomplete config");
        assert!(within(text, e.line, e.column), "{e} is outside {text:?}");
    }
}
