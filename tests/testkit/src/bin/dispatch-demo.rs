//! `dispatch-demo`: the broker at work on throwaway PostgreSQL and Redis (`make demo`).
#![forbid(unsafe_code)]

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use dispatch_testkit::demo::Cli;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // The demo draws progress bars: unless a log filter was asked for, it logs warnings only, so
    // the broker's per-task lines do not scroll them away.
    let quiet = matches.value_source("log") == Some(ValueSource::DefaultValue);
    cli.log.install(quiet.then_some("warn"));
    match dispatch_testkit::demo::run(&cli.demo).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dispatch-demo: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
