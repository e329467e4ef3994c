//! `idemgate check`: validate a config, print what it resolves to, warn where a route's keys
//! follow its path, and with `--running <admin address>` compare how its routes derive their
//! stored keys with the running gateway's (the comparison a reload makes before it applies).

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use http_body_util::BodyExt;

use super::{describe, runtime, say, EXIT_BAD_CONFIG, EXIT_CANNOT_START};
use crate::config::identity::{rekeyed, unnamed, KeyIdentity};
use crate::config::{Config, StoreConfig};

/// The largest `/routes` answer read from a running gateway.
const MAX_ROUTES_ANSWER: usize = 4 << 20;

/// `idemgate check --config F [--print-ddl] [--running ADDR]`.
pub(super) fn check(path: &Path, print_ddl: bool, running: Option<&str>) -> ExitCode {
    let config = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("idemgate: {}: {e}", path.display());
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    if print_ddl {
        return match &config.store {
            StoreConfig::Postgres(p) => {
                say(&crate::store::postgres::schema::ddl(&p.table));
                ExitCode::SUCCESS
            }
            _ => {
                eprintln!(
                    "idemgate: {}: --print-ddl is for store.backend = \"postgres\"",
                    path.display()
                );
                ExitCode::from(EXIT_BAD_CONFIG)
            }
        };
    }
    // The store's keys are read as the gateway would at its start (which a bad file stops).
    if let Some(source) = &config.store_keys {
        match crate::store::seal::Sealer::load(source) {
            Ok(sealer) => say(&format!(
                "store keys: {:?} (the first seals)\n",
                sealer.ids()
            )),
            Err(e) => {
                eprintln!("idemgate: {}: store.encryption_keys_*: {e}", path.display());
                return ExitCode::from(EXIT_BAD_CONFIG);
            }
        }
    }
    say(&describe(&config));
    for warning in unnamed(&config.routes)
        .into_iter()
        .chain(subject_scoped(&config.routes))
        .chain(unsigned_keys(&config.routes))
    {
        say(&format!("{warning}\n"));
    }
    if let Some(admin) = running {
        let new: Vec<KeyIdentity> = config.routes.iter().map(KeyIdentity::of).collect();
        let runs = match runtime(tokio::runtime::Builder::new_current_thread()) {
            Ok(rt) => rt.block_on(running_routes(admin)),
            Err(code) => return code,
        };
        let running = match runs {
            Ok(r) => r,
            Err(why) => {
                eprintln!("idemgate: cannot read the running gateway's routes at {admin}: {why}");
                return ExitCode::from(EXIT_CANNOT_START);
            }
        };
        let why = rekeyed(&running, &new);
        if !why.is_empty() {
            for line in &why {
                say(&format!("refused: {line}\n"));
            }
            say("a reload (SIGHUP) of this config would be refused; a restart applies it on purpose (docs/operations.md, \"Reloading the config\")\n");
            return ExitCode::from(1);
        }
        say(&format!(
            "keys derived as by the running gateway at {admin}: a reload keeps every stored key\n"
        ));
    }
    say("config OK\n");
    ExitCode::SUCCESS
}

/// The running gateway's routes as `GET /routes` on its admin listener reports them.
async fn running_routes(admin: &str) -> Result<Vec<KeyIdentity>, String> {
    let uri: http::Uri = format!("http://{admin}/routes")
        .parse()
        .map_err(|e| format!("not a host:port ({e})"))?;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let answer = async {
        let resp = client.get(uri).await.map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("it answered {}", resp.status()));
        }
        let body = http_body_util::Limited::new(resp.into_body(), MAX_ROUTES_ANSWER)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        #[derive(serde::Deserialize)]
        struct Routes {
            routes: Vec<KeyIdentity>,
            /// Every route served since startup: what a reload is checked against (a gateway
            /// that does not say gives its running routes only).
            #[serde(default)]
            served: Option<Vec<KeyIdentity>>,
        }
        serde_json::from_slice::<Routes>(&body)
            .map(|r| r.served.unwrap_or(r.routes))
            .map_err(|e| format!("not a /routes answer: {e}"))
    };
    tokio::time::timeout(Duration::from_secs(5), answer)
        .await
        .unwrap_or_else(|_| Err("no answer within 5s".into()))
}

/// Signed routes keyed by a header their sender's signature does not cover: GitHub, Shopify and
/// the generic scheme sign the body only, Stripe and Slack a timestamp and the body, Standard
/// Webhooks its `webhook-id` too. A captured signed body sent with another delivery's id runs
/// under that id, and the genuine delivery then finds its key taken.
fn unsigned_keys(routes: &[crate::config::RouteConfig]) -> Vec<String> {
    use crate::config::SignatureScheme;
    let mut warnings = Vec::new();
    for r in routes {
        let Some(sig) = &r.signature else { continue };
        let signed: &[&str] = match sig.scheme {
            SignatureScheme::StandardWebhooks => &["webhook-id", "svix-id"],
            _ => &[],
        };
        let unsigned: Vec<&str> = (r.key.headers.iter())
            .map(|h| h.as_str())
            .filter(|h| !signed.contains(h))
            .collect();
        // A body field that names the delivery, where the sender's payloads have one: GitHub's
        // have no top-level id, and Shopify's `id` is the resource's, shared by its events.
        let advice = match sig.scheme {
            SignatureScheme::Stripe => "key it by the event id in the body (key = { json = \"/id\" })",
            SignatureScheme::Slack => "key it by the event id in the body (key = { json = \"/event_id\" })",
            _ => "key it by body fields the signature covers that name the operation (a business key), if the payloads have them",
        };
        if !unsigned.is_empty() {
            warnings.push(format!(
                "warning: route {:?} is keyed by {} which its {} signature does not cover: a captured signed body sent again with another delivery's id runs under that id, and the genuine delivery then finds its key taken (409); {advice}",
                r.name,
                unsigned.join(", "),
                sig.scheme.name()
            ));
        }
    }
    warnings
}

/// Routes scoped by a certificate: by its subject, many workloads can share one (a mesh's
/// `O=SPIRE`), and one workload's can change at each rotation; by its URIs or subject without
/// `require_client`, every certificate without one shares the anonymous scope.
fn subject_scoped(routes: &[crate::config::RouteConfig]) -> Vec<String> {
    use crate::config::{CLIENT_SUBJECT_HEADER, CLIENT_URI_HEADER};
    let mut warnings = Vec::new();
    for r in routes {
        let names = |h: &str| r.policy.client_headers.iter().any(|c| c == h);
        if names(CLIENT_SUBJECT_HEADER) {
            warnings.push(format!(
                "warning: route {:?} scopes keys by the client certificate's subject: workloads whose certificates share a subject share one scope (one's key can replay another's answer), and a subject that changes at rotation loses the keys; in a mesh, scope by the SPIFFE ID with client_header = \"X-Client-Cert-URI\"",
                r.name
            ));
        }
        if (names(CLIENT_SUBJECT_HEADER) || names(CLIENT_URI_HEADER)) && !r.policy.require_client {
            warnings.push(format!(
                "warning: route {:?} scopes keys by the client certificate, without require_client: every certificate without that field shares the one anonymous scope; set require_client = true",
                r.name
            ));
        }
    }
    warnings
}
