//! The `dispatch-broker` binary: parses the command line, sets up logging, runs the library.
#![forbid(unsafe_code)]

use clap::FromArgMatches;
use dispatch_broker::config::{Cli, Command};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // The parser with old variable names read as aliases of the current ones.
    let matches = dispatch_broker::config::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    cli.log.install(None);
    let outcome = match cli.command {
        Command::Serve(args) => serve(*args).await,
        Command::Migrate(args) => dispatch_broker::tasks::migrate::run(&args).await,
        Command::Health(args) => dispatch_broker::server::probe(&args).await,
        Command::Explain(args) => dispatch_broker::cli::explain(&args).await,
        Command::Leases(args) => dispatch_broker::cli::leases(&args).await,
        Command::Locks(args) => dispatch_broker::cli::locks(&args).await,
        Command::Blocked(args) => dispatch_broker::cli::blocked(&args).await,
        Command::Fairness(args) => dispatch_broker::cli::fairness(&args).await,
        Command::Revoke(args) => dispatch_broker::cli::revoke(&args).await,
        Command::ForceRelease(args) => dispatch_broker::cli::force_release(&args).await,
    };
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dispatch-broker: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve(args: dispatch_broker::config::ServeArgs) -> anyhow::Result<()> {
    let running = dispatch_broker::server::start(&args).await?;
    running
        .serve_until(dispatch_broker::shutdown::os_signal())
        .await
}
