//! `[server]`: the listener, its limits, deadlines and TLS, and whose forwarding headers to
//! believe.

use std::path::PathBuf;
use std::time::Duration;

use super::{pem_file, pem_pair, secret_source, shown, size_at_most, whole_number, Pem};
use crate::config::raw::RawServer;
use crate::config::{ConfigError, Deadlines, ServerConfig, TokenSource};

/// Request bodies buffered at once across every connection when `server.max_buffered` is not
/// set: about 64 thousand 1 KiB payment requests, or 64 at the 1 MiB `max_body`.
const DEFAULT_MAX_BUFFERED: usize = 64 << 20;
const MIN_BUFFERED: usize = 64 << 10;
const MAX_BUFFERED: u64 = 1 << 40;
/// More worker threads than this would only add switching.
const MAX_WORKERS: usize = 256;
/// How often the listener's certificate files are read again by default: cert-manager renews
/// days before expiry, and kubelet swaps a mounted Secret's files within about a minute.
const DEFAULT_TLS_RECHECK: Duration = Duration::from_secs(60);

pub(super) fn validate_server(raw: Option<RawServer>) -> Result<ServerConfig, ConfigError> {
    let raw = raw.ok_or_else(|| ConfigError::Missing {
        field: "server.listen".into(),
    })?;
    let listen = raw.listen.ok_or_else(|| ConfigError::Missing {
        field: "server.listen".into(),
    })?;
    let shutdown_grace = raw.shutdown_grace.unwrap_or(Duration::from_secs(30));
    if shutdown_grace > Duration::from_secs(3600) {
        return Err(ConfigError::invalid(
            "server.shutdown_grace",
            shown(shutdown_grace),
            "at most \"1h\"",
        ));
    }
    let drain_delay = raw.drain_delay.unwrap_or(Duration::ZERO);
    if drain_delay > Duration::from_secs(600) {
        return Err(ConfigError::invalid(
            "server.drain_delay",
            shown(drain_delay),
            "at most \"10m\"",
        ));
    }
    let max_connections = whole_number(
        "server.max_connections",
        raw.max_connections,
        4096,
        1..=1_000_000,
    )? as usize;
    // Unset: what the process may use, cgroup CPU limits included (a Kubernetes `limits.cpu`).
    let available = std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_WORKERS));
    let workers = whole_number(
        "server.workers",
        raw.workers,
        available as i64,
        1..=MAX_WORKERS as i64,
    )? as usize;
    let max_streams = whole_number("server.max_streams", raw.max_streams, 100, 1..=1000)? as u32;
    let max_buffered = max_buffered(&raw)?;
    let max_header_bytes = max_header_bytes(&raw)?;
    let admin_token = admin_token(&raw)?;
    let deadlines = deadlines(&raw)?;
    let (tls, tls_client_ca, tls_recheck) = listener_tls(&raw)?;
    let trusted_proxies = trusted_proxies(raw.trusted_proxies.unwrap_or_default())?;
    Ok(ServerConfig {
        listen,
        admin_token,
        admin: raw.admin,
        shutdown_grace,
        drain_delay,
        max_connections,
        workers,
        deadlines,
        max_streams,
        max_buffered,
        max_header_bytes,
        tls,
        tls_client_ca,
        tls_recheck,
        trusted_proxies,
        case_sensitive_routes: raw.case_sensitive_routes.unwrap_or(false),
        method_override_header: method_override_header(raw.method_override_header)?,
    })
}

/// Headers a method override cannot be: hop-by-hop ones never reach the upstream, and the others
/// already mean something else to the gateway or the upstream.
const NOT_AN_OVERRIDE: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "content-type",
    "content-encoding",
    "idempotency-key",
];

fn method_override_header(raw: Option<String>) -> Result<Option<http::HeaderName>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let invalid = |why: &str| ConfigError::invalid("server.method_override_header", &raw, why);
    let name = http::HeaderName::from_bytes(raw.as_bytes())
        .map_err(|_| invalid("a header name, such as \"X-HTTP-Method-Override\""))?;
    if NOT_AN_OVERRIDE.contains(&name.as_str()) {
        return Err(invalid(
            "a header of its own, not one HTTP or the gateway uses",
        ));
    }
    Ok(Some(name))
}

fn max_buffered(raw: &RawServer) -> Result<usize, ConfigError> {
    let max_buffered = match raw.max_buffered.clone() {
        None => DEFAULT_MAX_BUFFERED,
        Some(n) => size_at_most("server.max_buffered", n, MAX_BUFFERED)? as usize,
    };
    if max_buffered < MIN_BUFFERED {
        return Err(ConfigError::invalid(
            "server.max_buffered",
            max_buffered.to_string(),
            "at least 64KiB (64MiB is the default)",
        ));
    }
    Ok(max_buffered)
}

/// `server.admin_token_env` or `admin_token_file` (not both), with `server.admin` set.
fn admin_token(raw: &RawServer) -> Result<Option<TokenSource>, ConfigError> {
    let names = ("server.admin_token_env", "server.admin_token_file");
    let Some(source) = secret_source(&raw.admin_token_env, &raw.admin_token_file, names, "token")?
    else {
        return Ok(None);
    };
    if raw.admin.is_none() {
        return Err(ConfigError::invalid(
            match source {
                TokenSource::Env(_) => "server.admin_token_env",
                TokenSource::File(_) => "server.admin_token_file",
            },
            "(set)",
            "only with server.admin (the operator API is served on the admin listener)",
        ));
    }
    Ok(Some(source))
}

/// `server.max_header_bytes`: 64 KiB unless set; at least 8 KiB (hyper's smallest HTTP/1.1 read
/// buffer, and nginx's default line limit), at most 1 MiB.
fn max_header_bytes(raw: &RawServer) -> Result<usize, ConfigError> {
    let bytes = match raw.max_header_bytes.clone() {
        None => 64 << 10,
        Some(n) => size_at_most("server.max_header_bytes", n, 1 << 20)? as usize,
    };
    if bytes < 8 << 10 {
        return Err(ConfigError::invalid(
            "server.max_header_bytes",
            bytes.to_string(),
            "from 8KiB to 1MiB (64KiB is the default)",
        ));
    }
    Ok(bytes)
}

/// Every phase of a connection has a deadline, each from 100ms to 1h.
fn deadlines(raw: &RawServer) -> Result<Deadlines, ConfigError> {
    let defaults = Deadlines::default();
    let timeout = |field: &str, raw: Option<Duration>, default: Duration| match raw {
        None => Ok(default),
        Some(d) if d < Duration::from_millis(100) || d > Duration::from_secs(3600) => Err(
            ConfigError::invalid(field, shown(d), "a duration from \"100ms\" to \"1h\""),
        ),
        Some(d) => Ok(d),
    };
    Ok(Deadlines {
        header: timeout("server.header_timeout", raw.header_timeout, defaults.header)?,
        body: timeout("server.body_timeout", raw.body_timeout, defaults.body)?,
        idle: timeout("server.idle_timeout", raw.idle_timeout, defaults.idle)?,
        send: timeout("server.send_timeout", raw.send_timeout, defaults.send)?,
    })
}

type ListenerTls = (
    Option<(PathBuf, PathBuf)>,
    Option<PathBuf>,
    Option<Duration>,
);

/// The listener's certificate and key, the CA its clients' certificates must chain to, and
/// how often the files are read again.
fn listener_tls(raw: &RawServer) -> Result<ListenerTls, ConfigError> {
    let tls = pem_pair(
        ("server.tls_cert", "server.tls_key"),
        raw.tls_cert.clone(),
        raw.tls_key.clone(),
    )?;
    let tls_client_ca = match &raw.tls_client_ca {
        None => None,
        Some(_) if tls.is_none() => {
            return Err(ConfigError::invalid(
                "server.tls_client_ca",
                "(set)",
                "only with server.tls_cert and tls_key: client certificates are asked for in the TLS handshake",
            ))
        }
        Some(path) => Some(pem_file(
            "server.tls_client_ca",
            path.clone(),
            Pem::Certificate,
        )?),
    };
    let tls_recheck = match raw.tls_recheck {
        None => Some(DEFAULT_TLS_RECHECK),
        Some(_) if tls.is_none() => {
            return Err(ConfigError::invalid(
                "server.tls_recheck",
                "(set)",
                "only with server.tls_cert and tls_key",
            ))
        }
        Some(d) => match d {
            d if d.is_zero() => None,
            d if d < Duration::from_secs(1) => {
                return Err(ConfigError::invalid(
                    "server.tls_recheck",
                    shown(d),
                    "at least 1s, or 0 to read the files again only on SIGHUP",
                ))
            }
            d => Some(d),
        },
    };
    Ok((tls, tls_client_ca, tls_recheck))
}

fn trusted_proxies(raw: Vec<String>) -> Result<Vec<ipnet::IpNet>, ConfigError> {
    let mut nets = Vec::with_capacity(raw.len());
    for (i, raw) in raw.into_iter().enumerate() {
        let net = raw
            .parse::<ipnet::IpNet>()
            .or_else(|_| raw.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| {
                ConfigError::invalid(
                    format!("server.trusted_proxies[{i}]"),
                    &raw,
                    "an IP address or CIDR range such as \"10.0.0.0/8\" or \"127.0.0.1\"",
                )
            })?;
        nets.push(net.trunc());
    }
    Ok(nets)
}
