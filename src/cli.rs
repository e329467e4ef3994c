//! The command line: `idemgate run` and `idemgate check`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;
use crate::server::{shutdown_signal, Server};
use crate::telemetry::{self, LogFormat};

/// Exit status for a configuration that cannot be used (EX_USAGE in sysexits.h).
pub const EXIT_BAD_CONFIG: u8 = 64;
/// Exit status when the gateway cannot start, e.g. the port is taken (EX_UNAVAILABLE).
pub const EXIT_CANNOT_START: u8 = 69;

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
    },
}

/// Parses the command line and runs the command.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_format);
    match cli.command {
        Command::Check { config } => match Config::load(&config) {
            Ok(c) => {
                print!("{}", c.describe());
                println!("config OK");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("idemgate: {}: {e}", config.display());
                ExitCode::from(EXIT_BAD_CONFIG)
            }
        },
        Command::Run { config } => {
            let config = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("idemgate: {}: {e}", config.display());
                    return ExitCode::from(EXIT_BAD_CONFIG);
                }
            };
            run(config)
        }
    }
}

fn run(config: Config) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemgate: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_CANNOT_START);
        }
    };
    runtime.block_on(async move {
        let server = match Server::bind(config).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot start");
                return ExitCode::from(EXIT_CANNOT_START);
            }
        };
        server.run(shutdown_signal()).await;
        ExitCode::SUCCESS
    })
}
