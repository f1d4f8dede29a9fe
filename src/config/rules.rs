//! The syntax of a route's header rules (`request_headers`, `response_headers`): which
//! fields no rule may name, the `{variable}`s a value may name, and the rules of one
//! direction as the config holds them. Applying them is the `forward` room's.

use http::header::{self, HeaderName, HeaderValue};

/// Fields no rule may name: framing and hop-by-hop fields, which decide how a message is
/// delimited or whether the next hop keeps the connection (a rule on them could smuggle).
pub static REFUSED: [HeaderName; 9] = [
    header::CONNECTION,
    header::CONTENT_LENGTH,
    header::TRANSFER_ENCODING,
    header::HOST,
    header::TE,
    header::UPGRADE,
    header::TRAILER,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// The variables a value may name, as written between braces (`header:NAME` aside).
pub const VARIABLES: [&str; 6] = ["route", "client_ip", "host", "path", "request_id", "header:NAME"];

/// One piece of a value with variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(Box<str>),
    Route,
    ClientIp,
    Host,
    Path,
    RequestId,
    Header(HeaderName),
}

/// A rule's value: ready, or pieces rendered per request.
#[derive(Debug, Clone)]
pub enum Template {
    Static(HeaderValue),
    Dynamic(Box<[Piece]>),
}

impl Template {
    /// Parses `{variable}`s out of `text`; `{{` and `}}` stand for literal braces.
    ///
    /// # Errors
    /// An unknown variable, an unclosed `{`, a bad `header:` name, or text that is not a
    /// valid header value.
    pub fn parse(text: &str) -> Result<Template, String> {
        let mut pieces = Vec::new();
        let mut lit = String::new();
        let mut rest = text;
        while let Some(i) = rest.find(['{', '}']) {
            lit.push_str(&rest[..i]);
            let (brace, after) = (&rest[i..=i], &rest[i + 1..]);
            if let Some(after) = after.strip_prefix(brace) {
                lit.push_str(brace);
                rest = after;
                continue;
            }
            if brace == "}" {
                lit.push('}');
                rest = after;
                continue;
            }
            let end = after
                .find('}')
                .ok_or_else(|| format!("`{text}` has a `{{` without its `}}` (write `{{{{` for a literal brace)"))?;
            let name = &after[..end];
            let piece = match name {
                "route" => Piece::Route,
                "client_ip" => Piece::ClientIp,
                "host" => Piece::Host,
                "path" => Piece::Path,
                "request_id" => Piece::RequestId,
                _ => match name.strip_prefix("header:") {
                    Some(h) => Piece::Header(
                        HeaderName::from_bytes(h.trim().as_bytes())
                            .map_err(|_| format!("`{{{name}}}`: `{h}` is not a header name"))?,
                    ),
                    None => {
                        return Err(format!(
                            "unknown variable `{{{name}}}`; expected one of {}",
                            VARIABLES.map(|v| format!("{{{v}}}")).join(", ")
                        ))
                    }
                },
            };
            if !lit.is_empty() {
                pieces.push(Piece::Text(std::mem::take(&mut lit).into()));
            }
            pieces.push(piece);
            rest = &after[end + 1..];
        }
        lit.push_str(rest);
        if HeaderValue::from_str(&lit).is_err() {
            return Err(format!("`{text}` is not a valid header value (control characters or line breaks)"));
        }
        if pieces.is_empty() {
            return HeaderValue::from_str(&lit).map(Template::Static).map_err(|_| "not a header value".to_owned());
        }
        for p in &pieces {
            if let Piece::Text(t) = p {
                if HeaderValue::from_str(t).is_err() {
                    return Err(format!("`{text}` is not a valid header value (control characters or line breaks)"));
                }
            }
        }
        if !lit.is_empty() {
            pieces.push(Piece::Text(lit.into()));
        }
        Ok(Template::Dynamic(pieces.into()))
    }

    pub fn uses(&self, var: &Piece) -> bool {
        match self {
            Template::Static(_) => false,
            Template::Dynamic(pieces) => pieces.iter().any(|p| p == var),
        }
    }
}

impl std::fmt::Display for Template {
    /// The value as written in the config (braces escaped again).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = |f: &mut std::fmt::Formatter<'_>, t: &str| f.write_str(&t.replace('{', "{{").replace('}', "}}"));
        match self {
            Template::Static(v) => text(f, &String::from_utf8_lossy(v.as_bytes())),
            Template::Dynamic(pieces) => pieces.iter().try_for_each(|p| match p {
                Piece::Text(t) => text(f, t),
                Piece::Route => f.write_str("{route}"),
                Piece::ClientIp => f.write_str("{client_ip}"),
                Piece::Host => f.write_str("{host}"),
                Piece::Path => f.write_str("{path}"),
                Piece::RequestId => f.write_str("{request_id}"),
                Piece::Header(n) => write!(f, "{{header:{n}}}"),
            }),
        }
    }
}

/// The rules of one direction of one route, validated: `remove`, then `set` (replaces), then
/// `add` (appends).
#[derive(Debug, Clone, Default)]
pub struct HeaderRules {
    pub remove: Vec<HeaderName>,
    pub set: Vec<(HeaderName, Template)>,
    pub add: Vec<(HeaderName, Template)>,
}

impl HeaderRules {
    /// What the rules do, in words (`removes server; sets x-route: {route}`), for `explain`.
    pub fn describe(&self) -> String {
        let mut steps = Vec::new();
        if !self.remove.is_empty() {
            steps
                .push(format!("removes {}", self.remove.iter().map(HeaderName::as_str).collect::<Vec<_>>().join(", ")));
        }
        for (n, t) in &self.set {
            steps.push(format!("sets {n}: {t}"));
        }
        for (n, t) in &self.add {
            steps.push(format!("adds {n}: {t}"));
        }
        if steps.is_empty() {
            steps.push("nothing".to_owned());
        }
        steps.join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_variables_and_escapes() {
        assert!(matches!(Template::parse("plain").unwrap(), Template::Static(v) if v == "plain"));
        assert!(matches!(Template::parse("a {{b}} c}").unwrap(), Template::Static(v) if v == "a {b} c}"));
        let Template::Dynamic(p) = Template::parse("id={request_id}; via {header:X-Via}").unwrap() else { panic!() };
        assert_eq!(
            &p[..],
            &[
                Piece::Text("id=".into()),
                Piece::RequestId,
                Piece::Text("; via ".into()),
                Piece::Header(HeaderName::from_static("x-via"))
            ]
        );
        assert!(Template::parse("{nope}").unwrap_err().contains("unknown variable `{nope}`"));
        assert!(Template::parse("{route").unwrap_err().contains("without its"));
        assert!(Template::parse("{header:a b}").is_err());
        assert!(Template::parse("a\nb").is_err());
    }
}
