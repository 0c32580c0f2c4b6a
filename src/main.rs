//! The API service binary: parse config, bind, serve until a signal
//! (SIGHUP reloads the config; ctrl-c and SIGTERM stop gracefully).
//!
//! Expected failures (a bad config, a bad flag, a port in use) print one
//! line naming the field, file or address, and exit 1, whatever
//! `RUST_BACKTRACE` says: backtraces are for bugs, which still panic.

use clap::Parser;
use ratelimiter::config::{Cli, Config};
use ratelimiter::server;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(cli.clone()) {
        Ok(config) => config,
        Err(e) => {
            // Its message already names the field or file, and the cause.
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match server::run(config, Some(cli)).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
