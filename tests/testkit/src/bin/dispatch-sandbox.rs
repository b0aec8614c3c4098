//! `dispatch-sandbox`: a broker on throwaway PostgreSQL and Redis, for trying a client and for
//! the Python client's tests.
#![forbid(unsafe_code)]

use clap::Parser;
use dispatch_testkit::sandbox::Cli;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    cli.log.install(None);
    match dispatch_testkit::sandbox::run(&cli.sandbox).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dispatch-sandbox: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
