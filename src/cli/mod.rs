//! The command line: `idemgate run`, `idemgate check`, `idemgate keys get|delete`,
//! `idemgate probe`.

mod check;
mod describe;
mod keys;

pub use describe::describe;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::config::Config;
use crate::server::{reload_on_sighup, shutdown_signal, Hangups, Server};
use crate::telemetry::{self, LogFormat};

/// Exit status for a configuration that cannot be used (EX_USAGE in sysexits.h).
pub const EXIT_BAD_CONFIG: u8 = 64;
/// Exit status when the gateway cannot start, e.g. the port is taken (EX_UNAVAILABLE).
pub const EXIT_CANNOT_START: u8 = 69;
/// A second SIGTERM or SIGINT during shutdown: the drain was cut short.
pub const EXIT_INTERRUPTED: u8 = 130;

#[derive(Debug, Parser)]
#[command(
    name = "idemgate",
    version,
    about = "Idempotency gateway: makes the HTTP routes you name safe to retry"
)]
pub struct Cli {
    /// Log line format on stderr.
    #[arg(long, value_enum, default_value = "text", global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start the gateway.
    Run {
        /// The TOML config file.
        #[arg(long, env = "IDEMGATE_CONFIG")]
        config: PathBuf,
    },
    /// Validate a config file and print the resolved routes.
    Check {
        /// The TOML config file.
        #[arg(long, env = "IDEMGATE_CONFIG")]
        config: PathBuf,
        /// Print only the SQL that creates the Postgres store's tables (backend = "postgres"),
        /// for teams that apply schema changes themselves.
        #[arg(long)]
        print_ddl: bool,
        /// The running gateway's admin address (host:port): exit 1 if this config derives
        /// stored keys otherwise than the routes it runs (a reload of it would be refused).
        #[arg(long, value_name = "ADMIN_ADDRESS")]
        running: Option<String>,
    },
    /// GET a URL and exit 0 on 2xx, 1 otherwise: a health check for images without curl.
    Probe {
        /// For example http://127.0.0.1:9090/readyz
        url: String,
    },
    /// Inspect, release or resolve one stored key: through the running gateway's operator API
    /// when the config has one, else by opening the store (the disk store with the gateway
    /// stopped).
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
}

#[derive(Debug, Subcommand)]
pub enum KeysAction {
    /// Print a key's id (the hex of its stored key), for the operator API's /keys/{id}. Opens
    /// no store: works while the gateway runs, on every store.
    Id(KeyArgs),
    /// Print a key's record: state, fingerprint, timestamps, status, body size. Exit 1 if none.
    Get(KeyArgs),
    /// Release a key's record, so the next retry executes. Check the upstream's records first.
    #[command(alias = "release")]
    Delete(KeyArgs),
    /// Resolve a key's unknown outcome as completed with this answer: every retry replays it.
    Resolve(ResolveArgs),
    /// List the unknown outcomes (marked unknown, or abandoned by a gateway that stopped
    /// mid-flight), one JSON object per line: id, route or consumer, the client's key, state,
    /// reason, times.
    List(ListArgs),
}

#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// The TOML config file of the gateways sharing the store.
    #[arg(long, env = "IDEMGATE_CONFIG")]
    pub config: PathBuf,
    /// Only this route's.
    #[arg(long, conflicts_with = "consumer")]
    pub route: Option<String>,
    /// Only this consumer's.
    #[arg(long)]
    pub consumer: Option<String>,
    /// List at most this many.
    #[arg(long, default_value_t = 1000)]
    pub limit: usize,
}

#[derive(Debug, clap::Args)]
pub struct ResolveArgs {
    #[command(flatten)]
    pub key: KeyArgs,
    /// The HTTP status retries get.
    #[arg(long)]
    pub status: u16,
    /// A header of the answer, as "name: value"; once per header.
    #[arg(long = "header")]
    pub headers: Vec<String>,
    /// The body retries get.
    #[arg(long, default_value = "")]
    pub body: String,
}

#[derive(Debug, clap::Args)]
pub struct KeyArgs {
    /// The TOML config file of the gateways sharing the store.
    #[arg(long, env = "IDEMGATE_CONFIG")]
    pub config: PathBuf,
    /// The route's `name` (or a consumer's).
    #[arg(long)]
    pub route: String,
    /// The idempotency key, as the client sent it. Routes keyed by several headers or body
    /// fields take one --key per part, in the order the route lists them (headers first).
    #[arg(long, required = true)]
    pub key: Vec<String>,
    /// Read each --key as JSON ("pi_1", 10, true): how a number or boolean body field is named
    /// (the number 10 and the string "10" are different keys).
    #[arg(long)]
    pub json_parts: bool,
    /// The client header's value (e.g. "Bearer ..."), for routes that scope keys per client.
    #[arg(long)]
    pub client: Option<String>,
    /// Which of the route's `client_header` names --client was sent in (default: the first).
    #[arg(long, requires = "client")]
    pub client_header: Option<String>,
    /// For a `client_jwt` route: one of its scope claims as the client's token carries it,
    /// NAME=VALUE (e.g. --jwt-claim sub=alice); one per claim the route names.
    #[arg(long, value_parser = claim, conflicts_with = "client")]
    pub jwt_claim: Vec<(String, String)>,
    /// For a `client_jwt` route that accepts several issuers: the token's `iss`.
    #[arg(long, conflicts_with = "client")]
    pub jwt_issuer: Option<String>,
    /// Release or resolve a pending record whose lease still runs (its request may still be
    /// executing).
    #[arg(long)]
    pub force: bool,
}

fn claim(arg: &str) -> Result<(String, String), String> {
    match arg.split_once('=') {
        Some((name, value)) if !name.is_empty() => Ok((name.to_string(), value.to_string())),
        _ => Err("NAME=VALUE, such as sub=alice".into()),
    }
}

/// Parses the command line and runs the command.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_format);
    match cli.command {
        Command::Check {
            config,
            print_ddl,
            running,
        } => check::check(&config, print_ddl, running.as_deref()),
        Command::Keys { action } => keys::keys(action),
        Command::Probe { url } => probe(&url),
        Command::Run { config: path } => run(path),
    }
}

/// Builds a runtime, or the exit status that says it could not be built.
fn runtime(mut builder: tokio::runtime::Builder) -> Result<tokio::runtime::Runtime, ExitCode> {
    builder.enable_all().build().map_err(|e| {
        eprintln!("idemgate: cannot start the async runtime: {e}");
        ExitCode::from(EXIT_CANNOT_START)
    })
}

fn run(path: PathBuf) -> ExitCode {
    // Requests are served by the server's worker threads, each with its own runtime; this one
    // runs the acceptor, signals, the admin listener and the store's background connections.
    let runtime = match runtime(tokio::runtime::Builder::new_current_thread()) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    runtime.block_on(async move {
        // First: a SIGHUP while the config loads or the store connects must not end the process.
        let hangups = Hangups::catch();
        tracing::info!(config = %path.display(), "starting");
        // Test builds only: a slow start, for the test of a SIGHUP during it.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("startup");
        let config = match Config::load(&path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("idemgate: {}: {e}", path.display());
                return ExitCode::from(EXIT_BAD_CONFIG);
            }
        };
        let server = match Server::bind(config.clone()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot start");
                return ExitCode::from(EXIT_CANNOT_START);
            }
        };
        let watcher = match (server.listener_tls(), config.server.tls_recheck) {
            (Some(tls), Some(every)) => Some(tokio::spawn(crate::tls::watch(tls, every))),
            _ => None,
        };
        let reloader = tokio::spawn(reload_on_sighup(
            hangups,
            path,
            Arc::clone(server.gateway()),
            config,
            server.listener_tls(),
        ));
        let (first, signalled) = tokio::sync::oneshot::channel();
        let impatient = tokio::spawn(async move {
            shutdown_signal().await;
            let _ = first.send(());
            // A second signal within a second is the same stop (a terminal's Ctrl-C and a
            // supervisor's SIGTERM together); one after it is an operator, or an orchestrator,
            // that will not wait out the drain: as prompt as without the gateway's own handler.
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let second = shutdown_signal();
            tracing::info!("a second SIGTERM or SIGINT now ends the process at once");
            second.await;
            tracing::warn!("a second SIGTERM or SIGINT: exiting now, without waiting for the drain; calls still running leave their keys pending");
            std::process::exit(i32::from(EXIT_INTERRUPTED));
        });
        let served = server
            .run(async {
                let _ = signalled.await;
            })
            .await;
        impatient.abort();
        reloader.abort();
        if let Some(watcher) = watcher {
            watcher.abort();
        }
        match served {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "cannot start");
                ExitCode::from(EXIT_CANNOT_START)
            }
        }
    })
}

/// Writes to standard output; a reader that went away (`idemgate check | head`) is not an error
/// worth a panic, unlike what `print!` does.
fn say(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().write_all(text.as_bytes());
}

fn probe(url: &str) -> ExitCode {
    let uri: http::Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("idemgate probe: invalid URL {url:?}: {e}");
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    let runtime = match runtime(tokio::runtime::Builder::new_current_thread()) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    runtime.block_on(async move {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Empty<bytes::Bytes>>();
        match tokio::time::timeout(std::time::Duration::from_secs(3), client.get(uri)).await {
            Ok(Ok(resp)) if resp.status().is_success() => {
                say(&format!("{}\n", resp.status()));
                ExitCode::SUCCESS
            }
            Ok(Ok(resp)) => {
                say(&format!("{}\n", resp.status()));
                ExitCode::from(1)
            }
            Ok(Err(e)) => {
                say(&format!("unreachable: {e}\n"));
                ExitCode::from(1)
            }
            Err(_) => {
                say("no answer within 3s\n");
                ExitCode::from(1)
            }
        }
    })
}
