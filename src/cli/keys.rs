//! `idemgate keys`: one key, named as its client sent it (route or consumer, key parts, client),
//! or the list of unknown outcomes. Through the running gateway's operator API when the config
//! has one (`server.admin` and a token the command can read too) and the gateway answers
//! there: records as JSON. Otherwise by opening the store itself, which the disk store allows
//! only while no gateway holds it.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};

use super::{runtime, say, KeyArgs, KeysAction, ListArgs, EXIT_BAD_CONFIG, EXIT_CANNOT_START};
use crate::config::Config;
use crate::key::{KeyPart, StoreKey};
use crate::operator::{self, Change, Filter};
use crate::store::OriginKind;

/// How long a call to the gateway's API may take.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// What the command does to the key.
enum Op {
    Get,
    Release,
    /// The answer to store, as the API's `PUT` body.
    Resolve(String),
}

pub(super) fn keys(action: KeysAction) -> ExitCode {
    match action {
        KeysAction::Id(a) => key_id(&a),
        KeysAction::List(a) => list(&a),
        KeysAction::Get(a) => with_key(&a, Op::Get),
        KeysAction::Delete(a) => with_key(&a, Op::Release),
        KeysAction::Resolve(r) => {
            let headers: Option<Vec<(String, String)>> = r
                .headers
                .iter()
                .map(|h| {
                    let (n, v) = h.split_once(':')?;
                    Some((n.trim().to_string(), v.trim().to_string()))
                })
                .collect();
            let Some(headers) = headers else {
                eprintln!("idemgate: --header takes \"name: value\"");
                return ExitCode::from(EXIT_BAD_CONFIG);
            };
            let body = serde_json::json!({"status": r.status, "headers": headers, "body": r.body});
            with_key(&r.key, Op::Resolve(body.to_string()))
        }
    }
}

/// `idemgate keys id`: the key's id, computed from the config alone.
fn key_id(args: &KeyArgs) -> ExitCode {
    match located(args) {
        Ok((_, key)) => {
            say(&format!("{key}\n"));
            ExitCode::SUCCESS
        }
        Err(code) => code,
    }
}

fn located(args: &KeyArgs) -> Result<(Config, StoreKey), ExitCode> {
    let config = Config::load(&args.config).map_err(|e| {
        eprintln!("idemgate: {}: {e}", args.config.display());
        ExitCode::from(EXIT_BAD_CONFIG)
    })?;
    let client = operator::ClientName {
        value: args.client.clone(),
        header: args.client_header.clone(),
        issuer: args.jwt_issuer.clone(),
        claims: args.jwt_claim.clone(),
    };
    let parts = key_parts(args).map_err(|e| {
        eprintln!("idemgate: {e}");
        ExitCode::from(EXIT_BAD_CONFIG)
    })?;
    let (key, scope) = operator::located(&config, &args.route, &parts, &client).map_err(|e| {
        eprintln!("idemgate: {e}");
        ExitCode::from(EXIT_BAD_CONFIG)
    })?;
    // Which scope was hashed, where the operator reads it but a script reading stdout does not.
    eprintln!("idemgate: client scope: {scope}");
    Ok((config, key))
}

/// The `--key` parts: text as given, or with `--json-parts` each a JSON string, number or
/// boolean (a number part never names the key of the same digits as a string).
fn key_parts(args: &KeyArgs) -> Result<Vec<KeyPart>, String> {
    if !args.json_parts {
        return Ok(args.key.iter().cloned().map(KeyPart::Text).collect());
    }
    (args.key.iter())
        .map(|k| {
            KeyPart::parse_json(k).map_err(|_| {
                format!("--key {k:?} is not a JSON string, number or boolean (--json-parts)")
            })
        })
        .collect()
}

fn with_key(args: &KeyArgs, op: Op) -> ExitCode {
    let (config, key) = match located(args) {
        Ok(found) => found,
        Err(code) => return code,
    };
    let runtime = match runtime(tokio::runtime::Builder::new_current_thread()) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    runtime.block_on(async move {
        if let Some((addr, token)) = api(&config) {
            match call(addr, &token, &key, &op, args.force).await {
                Ok(answer) => return answered(answer),
                // Nobody listens: no gateway runs, so the store can be opened.
                Err(Call::Unreachable) => {}
                Err(Call::Failed(why)) => {
                    eprintln!("idemgate: the gateway's operator API at {addr}: {why}");
                    return ExitCode::from(EXIT_CANNOT_START);
                }
            }
        }
        direct(&config, &key, &args.route, op, args.force).await
    })
}

/// The operator API's address (a listener on every address is asked on loopback) and token,
/// if the config has one and its token can be read here.
fn api(config: &Config) -> Option<(SocketAddr, String)> {
    let mut addr = config.server.admin?;
    let source = config.server.admin_token.as_ref()?;
    let token = match crate::admin::read_token(source) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("idemgate: not using the operator API: {e}");
            return None;
        }
    };
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    Some((addr, token))
}

enum Call {
    Unreachable,
    Failed(String),
}

async fn call(
    addr: SocketAddr,
    token: &str,
    key: &StoreKey,
    op: &Op,
    force: bool,
) -> Result<(StatusCode, Bytes), Call> {
    let (method, body) = match op {
        Op::Get => (Method::GET, String::new()),
        Op::Release => (Method::DELETE, String::new()),
        Op::Resolve(json) => (Method::PUT, json.clone()),
    };
    let query = if force { "?force=true" } else { "" };
    exchange(addr, token, method, &format!("/keys/{key}{query}"), body).await
}

/// One request to the operator API.
async fn exchange(
    addr: SocketAddr,
    token: &str,
    method: Method,
    path: &str,
    body: String,
) -> Result<(StatusCode, Bytes), Call> {
    let request = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| Call::Failed(e.to_string()))?;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let exchange = async {
        let response = client.request(request).await.map_err(|e| {
            if e.is_connect() {
                Call::Unreachable
            } else {
                Call::Failed(e.to_string())
            }
        })?;
        let status = response.status();
        let body = response.into_body().collect().await;
        let body = body.map_err(|e| Call::Failed(e.to_string()))?.to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout(API_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(Call::Failed(format!("no answer within {API_TIMEOUT:?}"))))
}

/// `idemgate keys list`: the unknown outcomes, one JSON object per line, through the API or
/// from the store.
fn list(args: &ListArgs) -> ExitCode {
    let config = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("idemgate: {}: {e}", args.config.display());
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    let filter = Filter {
        from: match (&args.route, &args.consumer) {
            (Some(r), _) => Some((OriginKind::Route, r.clone())),
            (None, Some(c)) => Some((OriginKind::Consumer, c.clone())),
            (None, None) => None,
        },
    };
    let runtime = match runtime(tokio::runtime::Builder::new_current_thread()) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    runtime.block_on(async move {
        let listed = match api(&config) {
            Some((addr, token)) => match listed_by_api(addr, &token, &filter, args.limit).await {
                Err(Call::Unreachable) => listed_by_store(&config, &filter, args.limit).await,
                Err(Call::Failed(why)) => {
                    Err(format!("the gateway's operator API at {addr}: {why}"))
                }
                Ok(found) => Ok(found),
            },
            None => listed_by_store(&config, &filter, args.limit).await,
        };
        match listed {
            Ok(found) => {
                let lines: String = found.iter().map(|v| format!("{v}\n")).collect();
                say(&lines);
                eprintln!("idemgate: {} unknown outcome(s)", found.len());
                ExitCode::SUCCESS
            }
            Err(why) => {
                eprintln!("idemgate: {why}");
                ExitCode::from(EXIT_CANNOT_START)
            }
        }
    })
}

async fn listed_by_api(
    addr: SocketAddr,
    token: &str,
    filter: &Filter,
    limit: usize,
) -> Result<Vec<serde_json::Value>, Call> {
    let mut found = Vec::new();
    let mut cursor: Option<String> = None;
    while found.len() < limit {
        let mut query = form_urlencoded::Serializer::new(String::new());
        query.append_pair("state", "unknown");
        query.append_pair(
            "limit",
            &(limit - found.len()).min(operator::MAX_LIST).to_string(),
        );
        if let Some((kind, name)) = &filter.from {
            query.append_pair(kind.as_str(), name);
        }
        if let Some(c) = &cursor {
            query.append_pair("cursor", c);
        }
        let path = format!("/keys?{}", query.finish());
        let (status, body) = exchange(addr, token, Method::GET, &path, String::new()).await?;
        if !status.is_success() {
            return Err(Call::Failed(format!(
                "{status}: {}",
                String::from_utf8_lossy(&body)
            )));
        }
        let page: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| Call::Failed(e.to_string()))?;
        if let Some(keys) = page["keys"].as_array() {
            found.extend(keys.iter().cloned());
        }
        cursor = page["next_cursor"].as_str().map(str::to_owned);
        if cursor.is_none() {
            break;
        }
    }
    Ok(found)
}

async fn listed_by_store(
    config: &Config,
    filter: &Filter,
    limit: usize,
) -> Result<Vec<serde_json::Value>, String> {
    let store = operator::open_store(config)
        .await
        .map_err(|e| e.to_string())?;
    let mut found = Vec::new();
    let mut cursor = None;
    while found.len() < limit {
        let want = (limit - found.len()).min(operator::MAX_LIST);
        let (page, next) = operator::list_unknown(&*store, filter, cursor, want)
            .await
            .map_err(|e| e.to_string())?;
        found.extend(page.iter().map(operator::listed));
        cursor = next;
        if cursor.is_none() {
            break;
        }
    }
    Ok(found)
}

/// The API's answer: the record (or problem) as it says, and 0 only for a 2xx.
fn answered((status, body): (StatusCode, Bytes)) -> ExitCode {
    let text = String::from_utf8_lossy(&body);
    if status.is_success() {
        say(&format!("{text}\n"));
        ExitCode::SUCCESS
    } else {
        eprintln!("idemgate: {status}: {text}");
        ExitCode::from(1)
    }
}

/// Without a gateway's API: the store itself.
async fn direct(config: &Config, key: &StoreKey, route: &str, op: Op, force: bool) -> ExitCode {
    let store = match operator::open_store(config).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("idemgate: {e}");
            return ExitCode::from(EXIT_CANNOT_START);
        }
    };
    let ttl = config.longest_ttl();
    let done = match op {
        Op::Resolve(_) => "resolved: every request with this key replays that answer\n",
        _ => "deleted: the next request with this key executes\n",
    };
    let changed = match op {
        Op::Get => {
            return match store.get(key).await {
                Ok(Some(record)) => {
                    say(&operator::describe(key, route, &record));
                    ExitCode::SUCCESS
                }
                Ok(None) => {
                    say("no record for this key (never used, expired, or deleted)\n");
                    ExitCode::from(1)
                }
                Err(e) => {
                    eprintln!("idemgate: {e}");
                    ExitCode::from(EXIT_CANNOT_START)
                }
            }
        }
        Op::Release => operator::release(&*store, (key, None), force, ttl).await,
        Op::Resolve(json) => match crate::admin::resolution_of(json.as_bytes()) {
            Ok(response) => operator::resolve(&*store, (key, None), response, force, ttl).await,
            Err(why) => {
                eprintln!("idemgate: {why}");
                return ExitCode::from(EXIT_BAD_CONFIG);
            }
        },
    };
    match changed {
        Ok(Change::Done) => {
            say(done);
            ExitCode::SUCCESS
        }
        Ok(Change::NotFound) => {
            say("no record for this key (never used, expired, or deleted)\n");
            ExitCode::from(1)
        }
        Ok(Change::Live) => {
            eprintln!("idemgate: the record is pending and its lease still runs (its request may still be executing): wait, or add --force");
            ExitCode::from(1)
        }
        Ok(Change::Completed) => {
            eprintln!("idemgate: the record is completed (its request ran; retries replay its answer): releasing or overwriting it needs --force");
            ExitCode::from(1)
        }
        Ok(Change::Changed) => {
            eprintln!("idemgate: the record changed meanwhile and was left as it is: look again");
            ExitCode::from(1)
        }
        Ok(Change::Unreadable) => {
            eprintln!("idemgate: the record does not open with the configured keys (store.encryption_keys_*): list its key again, or release it with --force (it cannot be resolved)");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("idemgate: {e}");
            ExitCode::from(EXIT_CANNOT_START)
        }
    }
}
