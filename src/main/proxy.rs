//! `tollgate proxy --to URL`: a reverse proxy from the command line, as `caddy reverse-proxy`
//! is. The flags write a config file's text, which is loaded and served exactly as a file
//! would be (`--print-config` shows it, to keep it as a file).

use std::fmt::Write as _;

#[derive(clap::Args)]
pub struct ProxyArgs {
    /// The upstream: `http://localhost:3000`, `https://api.example.com`, or `localhost:3000`
    /// (http:// is assumed).
    #[arg(long, value_name = "URL")]
    to: String,
    /// Where to listen: `:8080` (loopback, 127.0.0.1:8080), `127.0.0.1:8080`, or
    /// `0.0.0.0:8080` to serve other machines.
    #[arg(long, default_value = ":8080", value_name = "ADDR")]
    from: String,
    /// A limit for every request: `10/s`, `600/m`, `1000/60s` (none by default).
    #[arg(long, value_name = "RATE")]
    limit: Option<String>,
    /// Requests a client may send at once above the rate (the token bucket's burst; default:
    /// the rate's count).
    #[arg(long, requires = "limit")]
    burst: Option<u64>,
    /// What the limit counts: `client_ip` (default), `header:NAME`, `query:NAME`, `route`
    /// (everyone together), or several joined by commas.
    #[arg(long, default_value = "client_ip", requires = "limit")]
    key: String,
    /// The limit logs the requests it would refuse and refuses none (`mode: shadow`).
    #[arg(long, requires = "limit")]
    shadow: bool,
    /// Serve the last good answer, up to this old, when a client is throttled or the upstream
    /// fails (`on_limit` and `on_upstream_error` stale copies of GET answers).
    #[arg(long, value_name = "AGE")]
    stale: Option<String>,
    /// An admin listener (metrics, the limit table, the dashboard): `127.0.0.1:9901`.
    #[arg(long, value_name = "ADDR")]
    admin: Option<String>,
    /// No access log line per request (on by default).
    #[arg(long)]
    quiet: bool,
    /// Print the config these flags make and exit (save it, then `tollgate -c` it).
    #[arg(long)]
    print_config: bool,
}

impl ProxyArgs {
    pub fn print_only(&self) -> bool {
        self.print_config
    }
}

/// A YAML scalar in double quotes (JSON's string syntax is YAML's).
fn quoted(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

/// `:8080` → `127.0.0.1:8080`; anything else as given (the config checks it).
fn listen_addr(from: &str) -> String {
    match from.strip_prefix(':') {
        Some(port) => format!("127.0.0.1:{port}"),
        None => from.to_owned(),
    }
}

/// The upstream URL with its scheme.
fn upstream_url(to: &str) -> String {
    if to.contains("://") {
        to.to_owned()
    } else {
        format!("http://{to}")
    }
}

/// The config file the flags stand for.
pub fn config_text(a: &ProxyArgs) -> String {
    let mut y = String::new();
    let _ = writeln!(y, "# made by `tollgate proxy`; serve it with `tollgate -c FILE`");
    let _ = writeln!(y, "listen: {}", quoted(&listen_addr(&a.from)));
    if let Some(admin) = &a.admin {
        let _ = writeln!(y, "admin: {}", quoted(&listen_addr(admin)));
    }
    let _ = writeln!(y, "log: {{ access: {} }}", !a.quiet);
    let _ = writeln!(y, "upstreams:\n  app: {{ url: {} }}", quoted(&upstream_url(&a.to)));
    let _ = writeln!(y, "routes:\n  - name: app\n    upstream: app");
    if let Some(rate) = &a.limit {
        let key: Vec<String> = a.key.split(',').map(|k| quoted(k.trim())).collect();
        let _ = write!(y, "    limits:\n      - {{ name: limit, algorithm: token_bucket, rate: {}", quoted(rate));
        if let Some(b) = a.burst {
            let _ = write!(y, ", burst: {b}");
        }
        let _ = write!(y, ", key: [{}]", key.join(", "));
        if a.shadow {
            y.push_str(", mode: shadow");
        }
        y.push_str(" }\n");
    }
    if let Some(age) = &a.stale {
        let age = quoted(age);
        let _ = writeln!(y, "    on_limit: {{ stale: {{ max_age: {age} }} }}");
        let _ = writeln!(y, "    on_upstream_error: {{ stale: {{ max_age: {age} }} }}");
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ProxyArgs,
    }

    fn made(args: &[&str]) -> String {
        let cli = Cli::try_parse_from(std::iter::once("proxy").chain(args.iter().copied())).unwrap();
        config_text(&cli.args)
    }

    fn load(text: &str) -> tollgate::config::Config {
        tollgate::config::Config::from_yaml(std::path::Path::new("flags"), text)
            .unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    #[test]
    fn the_flags_make_a_config_that_loads() {
        let c = load(&made(&["--to", "localhost:3000"]));
        assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
        assert!(c.routes[0].limits.is_empty());
        let text = made(&[
            "--to",
            "http://127.0.0.1:3000",
            "--from",
            "0.0.0.0:9000",
            "--limit",
            "10/s",
            "--burst",
            "20",
            "--key",
            "client_ip,header:x-api-key",
            "--shadow",
            "--stale",
            "30s",
            "--admin",
            ":9901",
        ]);
        let c = load(&text);
        assert_eq!(c.listen.to_string(), "0.0.0.0:9000");
        let explained = tollgate::explain::explain(&c);
        assert!(explained.contains("bursts of 20, then 10 requests/s"), "{explained}");
        assert!(explained.contains("shadow"), "{explained}");
        assert_eq!(c.routes[0].limits[0].key.parts().len(), 2);
        assert!(c.routes[0].stale_on_limit.is_some());
    }

    #[test]
    fn a_bad_flag_value_is_the_config_s_error() {
        let text = made(&["--to", "localhost:3000", "--limit", "ten/s"]);
        let e = tollgate::config::Config::from_yaml(std::path::Path::new("flags"), &text).unwrap_err();
        assert!(e.to_string().contains("rate"), "{e}");
    }
}
