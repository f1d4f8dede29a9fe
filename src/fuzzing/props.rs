//! The fuzz targets' invariants as property tests on stable: a bounded number of generated
//! inputs per parser, shaped like real traffic and then bent, so `cargo test` covers the
//! corners that the fuzzer finds by coverage.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proptest::prelude::*;
use proptest::sample::select;

use super::*;

fn cases() -> ProptestConfig {
    ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() }
}

// --- config ----------------------------------------------------------------------------------

/// Valid files (checked below), shared with the fuzz target's seed corpus.
const SEEDS: [&str; 3] = [
    include_str!("../../proxy.yaml"),
    include_str!("../../fuzz/corpus/config/everything.yaml"),
    include_str!("../../deploy/gateway.yaml"),
];

#[test]
fn seeds_are_valid_configs() {
    for seed in SEEDS {
        if let Err(e) = Config::from_yaml(Path::new("seed.yaml"), seed) {
            panic!("{e}");
        }
    }
}

/// A byte-level edit of a seed: what a typo, a bad paste or a fuzzer does to a real file.
#[derive(Debug, Clone)]
enum Edit {
    Delete(usize, usize),
    Insert(usize, String),
    DuplicateLine(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 1usize..20).prop_map(|(at, n)| Edit::Delete(at, n)),
        (any::<usize>(), "[ \\t\\n:,\\-\\[\\]{}\"'#&*!|>%@a-z0-9.\\\\\u{85}\u{2028}é]{1,8}")
            .prop_map(|(at, s)| Edit::Insert(at, s)),
        any::<usize>().prop_map(Edit::DuplicateLine),
    ]
}

fn apply(text: &str, edits: &[Edit]) -> String {
    let mut s = text.to_owned();
    let boundary = |s: &str, at: usize| {
        let mut at = at % (s.len() + 1);
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        at
    };
    for e in edits {
        match e {
            Edit::Delete(at, n) => {
                let from = boundary(&s, *at);
                let to = boundary(&s, from + n);
                s.replace_range(from..to.max(from), "");
            }
            Edit::Insert(at, text) => {
                let at = boundary(&s, *at);
                s.insert_str(at, text);
            }
            Edit::DuplicateLine(at) => {
                let lines: Vec<&str> = s.split_inclusive('\n').collect();
                let i = at % lines.len().max(1);
                let mut out: String = lines[..i].concat();
                out.push_str(lines.get(i).copied().unwrap_or(""));
                out.push_str(&lines[i..].concat());
                s = out;
            }
        }
    }
    s
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn edited_configs_load_or_point_inside_the_text(seed in 0..SEEDS.len(), edits in prop::collection::vec(edit(), 0..4)) {
        check_config(&apply(SEEDS[seed], &edits));
    }

    #[test]
    fn yaml_shaped_noise_loads_or_points_inside_the_text(text in "[ \\t\\r\\n:,\\-\\[\\]{}\"'#&*!|>%@a-z0-9./\u{2028}]{0,120}") {
        check_config(&text);
    }
}

// --- keys ------------------------------------------------------------------------------------

fn value_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop_oneof![8 => 0x20u8..0x7f, 1 => 0x80u8..=0xff, 1 => Just(b'\t')], 0..max)
}

fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        select(vec!["x-api-key", "authorization", "cookie", "x-forwarded-for", "host", "X-Api-Key"])
            .prop_map(String::from),
        "[a-z0-9!#$%&'*+.^_`|~-]{1,12}",
    ]
}

fn any_ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|o| IpAddr::V4(Ipv4Addr::from(o))),
        any::<u128>().prop_map(|a| IpAddr::V6(Ipv6Addr::from(a))),
        any::<[u8; 4]>().prop_map(|o| IpAddr::V6(Ipv4Addr::from(o).to_ipv6_mapped())),
    ]
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn keys_read_only_named_capped_material(
        fields in prop::collection::vec((field_name(), prop_oneof![value_bytes(40), value_bytes(2_500)]), 0..6),
        query in "[a-z0-9=&%+]{0,40}",
        spec in prop::option::of(select(vec![
            "client_ip", "route, header:x-api-key", "header:authorization, query:user, path",
            " route ,header:X-Api-Key,query: a b ", "query:%41", "nonsense", "",
        ])),
        peer in any_ip(),
    ) {
        let mut headers = HeaderMap::new();
        for (n, v) in &fields {
            if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(n.as_bytes()), HeaderValue::from_bytes(v)) {
                headers.append(n, v);
            }
        }
        let uri: Uri = format!("/p?{query}").parse().expect("a generated query is a valid URI");
        check_key(spec, &request(Method::GET, uri, Version::HTTP_11, headers), peer);
    }

    #[test]
    fn any_framed_head_hashes(data in prop::collection::vec(any::<u8>(), 0..300)) {
        key(&data);
    }
}

// --- client IP -------------------------------------------------------------------------------

/// One hop as proxies and clients write it: addresses with and without ports and brackets,
/// obfuscated names and garbage.
fn hop() -> impl Strategy<Value = String> {
    let near = prop_oneof![
        any::<u8>().prop_map(|b| format!("10.0.0.{b}")),
        any::<u16>().prop_map(|b| format!("fd00::{b:x}")),
        any::<[u8; 4]>().prop_map(|o| Ipv4Addr::from(o).to_string()),
        any::<u128>().prop_map(|a| Ipv6Addr::from(a).to_string()),
        any::<u8>().prop_map(|b| format!("::ffff:10.0.0.{b}")),
    ];
    (near, 0..6u8, "[a-z_ ]{0,6}").prop_map(|(ip, form, junk)| match form {
        0 | 1 => ip,
        2 if ip.contains(':') => format!("[{ip}]:443"),
        2 => format!("{ip}:8080"),
        3 => format!(" {ip}\t"),
        4 => "unknown".to_owned(),
        _ => junk,
    })
}

fn forwarded_element() -> impl Strategy<Value = String> {
    (hop(), 0..4u8).prop_map(|(h, form)| match form {
        0 if h.contains(':') && !h.starts_with('[') => format!("for=\"[{h}]\""),
        0 => format!("for={h}"),
        1 => format!("For=\"{h}\";proto=https"),
        2 => format!("by=10.0.0.1;for={h}"),
        _ => format!("proto=http;host={h}"),
    })
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn forwarded_chains_name_the_first_untrusted_hop(
        nets in prop::sample::subsequence(vec!["10.0.0.0/8", "fd00::/8", "127.0.0.1/32", "::ffff:0:0/96", "0.0.0.0/0"], 0..3),
        peer in prop_oneof![Just("10.0.0.4".to_owned()), Just("::ffff:10.0.0.4".to_owned()), Just("fd00::4".to_owned()), any_ip().prop_map(|i| i.to_string())],
        xff in prop::collection::vec(prop::collection::vec(hop(), 0..4), 0..3),
        fwd in prop::collection::vec(prop::collection::vec(forwarded_element(), 0..3), 0..3),
        raw in prop::option::of(value_bytes(30)),
    ) {
        let nets: Vec<IpNet> = nets.iter().map(|n| n.parse().expect("valid net")).collect();
        let mut headers = HeaderMap::new();
        for line in xff {
            headers.append("x-forwarded-for", HeaderValue::from_str(&line.join(",")).expect("printable"));
        }
        for line in fwd {
            headers.append(FORWARDED, HeaderValue::from_str(&line.join(", ")).expect("printable"));
        }
        if let Some(raw) = raw.and_then(|r| HeaderValue::from_bytes(&r).ok()) {
            headers.append("x-forwarded-for", raw);
        }
        check_client_ip(&nets, peer.parse().expect("valid peer"), &headers);
    }
}

// --- Cache-Control, Vary, dates ---------------------------------------------------------------

fn seconds() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..100_000).prop_map(|n| n.to_string()),
        "[0-9]{10,25}",
        any::<u64>().prop_map(|n| format!("\"{n}\"")),
        Just("soon".to_owned()),
        Just(String::new()),
        Just("-1".to_owned()),
    ]
}

fn directive() -> impl Strategy<Value = String> {
    let name = select(vec![
        "no-store",
        "No-Cache",
        "private",
        "must-revalidate",
        "proxy-revalidate",
        "public",
        "immutable",
        "no-cache=\"set-cookie, x-a\"",
        "private=\"a,b\\\"c\"",
    ]);
    let valued =
        (select(vec!["max-age", "Max-Age", "s-maxage", "stale-if-error", "stale-while-revalidate"]), seconds())
            .prop_map(|(n, v)| format!("{n}={v}"));
    prop_oneof![name.prop_map(String::from), valued]
}

fn date() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..253_402_300_800).prop_map(imf_fixdate),
        (0u8..7, 0u8..40, 0usize..12, 1960u16..10_000, 0u8..30, 0u8..70, 0u8..70).prop_map(|(w, d, m, y, h, mi, s)| {
            let wd = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"][usize::from(w)];
            format!("{wd}, {d:02} {} {y:04} {h:02}:{mi:02}:{s:02} GMT", MONTHS[m])
        }),
        "[A-Za-z0-9 ,:]{25,32}",
        Just("Sunday, 06-Nov-94 08:49:37 GMT".to_owned()),
        Just("0".to_owned()),
    ]
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn cache_fields_read_first_capped_values(
        cc in prop::collection::vec((prop::collection::vec(directive(), 0..5), select(vec![", ", ",", " ,, ", "\t,"])), 0..3),
        vary in prop::collection::vec(prop::collection::vec(select(vec!["accept-encoding", "Accept-Language", "*", "bad name", "x-a", "\"q\""]), 0..4), 0..3),
        dates in prop::collection::vec((prop_oneof![Just(DATE), Just(EXPIRES)], date()), 0..3),
        received in 0u64..4_000_000_000,
    ) {
        let mut headers = HeaderMap::new();
        for (items, sep) in cc {
            headers.append(CACHE_CONTROL, HeaderValue::from_str(&items.join(sep)).expect("printable"));
        }
        for items in vary {
            headers.append(VARY, HeaderValue::from_str(&items.join(", ")).expect("printable"));
        }
        for (name, d) in dates {
            headers.append(name, HeaderValue::from_str(&d).expect("printable"));
        }
        check_cache_fields(&headers, received);
    }

    #[test]
    fn dates_print_and_parse_back(t in 0u64..253_402_300_800) {
        prop_assert_eq!(http_date(imf_fixdate(t).as_bytes()), Some(t));
    }

    #[test]
    fn any_framed_response_head_parses(data in prop::collection::vec(any::<u8>(), 0..300)) {
        cache_fields(&data);
    }
}

// --- Redis replies ---------------------------------------------------------------------------

fn resp_reply() -> impl Strategy<Value = Vec<u8>> {
    let int = prop_oneof![-3i64..5, any::<i64>()].prop_map(|i| format!(":{i}\r\n"));
    let item = prop_oneof![
        4 => int,
        1 => Just("$1\r\n7\r\n".to_owned()),
        1 => Just("$-1\r\n".to_owned()),
        1 => Just("-ERR boom\r\n".to_owned()),
        1 => Just("+OK\r\n".to_owned()),
        1 => Just("*1\r\n:1\r\n".to_owned()),
        1 => Just(",1.5\r\n".to_owned()),
    ];
    (prop::collection::vec(item, 0..7), prop::option::of(any::<usize>())).prop_map(|(items, cut)| {
        let mut out = format!("*{}\r\n{}", items.len(), items.concat()).into_bytes();
        if let Some(cut) = cut {
            out.truncate(cut % (out.len() + 1));
        }
        out
    })
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn replies_are_read_only_when_well_shaped(reply in prop::collection::vec(prop_oneof![-2i64..5, any::<i64>()], 0..7)) {
        check_decode(&reply);
    }

    #[test]
    fn resp_replies_decode_or_are_refused(resp in resp_reply()) {
        redis_reply(&resp);
    }
}

// --- request target --------------------------------------------------------------------------

fn host() -> impl Strategy<Value = String> {
    let label = prop_oneof![4 => "[a-z0-9]{1,6}", 4 => "[A-Za-z0-9_-]{1,6}", 1 => Just(String::new())];
    let name = (prop::collection::vec(label, 1..4), any::<bool>()).prop_map(|(labels, dot)| {
        let mut n = labels.join(".");
        if dot {
            n.push('.');
        }
        n
    });
    let ipv6 = any::<u128>().prop_map(|a| format!("[{}]", Ipv6Addr::from(a)).to_uppercase());
    let port = prop_oneof![
        Just(String::new()),
        Just(":".to_owned()),
        (0u32..100_000).prop_map(|p| format!(":{p}")),
        Just(":http".to_owned())
    ];
    let junk = "[a-z@:/ %\\[\\].]{0,10}";
    prop_oneof![4 => (prop_oneof![name, ipv6], port).prop_map(|(h, p)| h + &p), 1 => junk]
}

fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => select(vec![
            "", ".", "..", "%2e", "%2E%2e", ".%2E", "api", "users", "a;v=1", ";x", ";", "..;x", ".;", "%2e;x",
            "%61pi", "%2F", "%2f", "%5c", "%00", "%zz", "%4", "%7e", "%7E", "%3b", "%3B", "A", "%41%42", "~u",
        ]).prop_map(String::from),
        1 => "[a-zA-Z0-9._~;=%-]{1,6}",
    ]
}

fn path() -> impl Strategy<Value = String> {
    (prop::collection::vec(segment(), 0..6), prop::option::of("[a-z0-9=&/.%]{0,8}")).prop_map(|(segs, q)| {
        let mut p = format!("/{}", segs.join("/"));
        if let Some(q) = q {
            p.push('?');
            p.push_str(&q);
        }
        p
    })
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn decided_targets_are_canonical_and_stable(
        method in select(vec!["GET", "OPTIONS", "POST"]),
        form in 0..6u8,
        path in path(),
        authority in host(),
        hosts in prop_oneof![3 => host().prop_map(|h| vec![h]), 1 => prop::collection::vec(host(), 0..3)],
        version in select(vec!["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/0.9"]),
    ) {
        let request_target = match form {
            0 => format!("http://{authority}{path}"),
            1 => "*".to_owned(),
            _ => path,
        };
        let mut text = format!("{method} {request_target} {version}\n");
        for h in hosts {
            text.push_str(&format!("host: {h}\n"));
        }
        target(text.as_bytes());
    }

    #[test]
    fn any_framed_request_decides_or_is_refused(data in prop::collection::vec(any::<u8>(), 0..200)) {
        target(&data);
    }
}

// --- jwt -------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cases())]

    /// Tokens shaped like real ones (three base64url parts of JSON), then bent.
    #[test]
    fn jwt_holds_on_dotted_json(
        header in select(vec![r#"{"alg":"ES256","kid":"a"}"#, r#"{"alg":"none"}"#, r#"{"alg":"HS256"}"#, r#"{"alg":"RS256","crit":[]}"#]),
        claims in select(vec![r#"{"sub":"a","exp":1800000060,"aud":"api"}"#, r#"{"exp":1e300}"#, "[]", "{}"]),
        sig in proptest::collection::vec(any::<u8>(), 0..80),
        cut in 0usize..200,
    ) {
        use base64::Engine as _;
        let b = |x: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(x);
        let token = format!("{}.{}.{}", b(header.as_bytes()), b(claims.as_bytes()), b(&sig));
        jwt(token.as_bytes());
        jwt(&token.as_bytes()[..cut.min(token.len())]);
    }

    #[test]
    fn jwt_holds_on_any_bytes(data in proptest::collection::vec(any::<u8>(), 0..300)) {
        jwt(&data);
    }
}
