//! `dispatch-sandbox`: throwaway PostgreSQL and Redis with a broker on them, for trying a
//! client and for the Python client's tests. Prints one JSON line with the addresses, then
//! serves until SIGTERM, Ctrl-C or the end of stdin (so it dies with the process that started it).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser};
use dispatch_broker::config::{parse_duration, SecurityArgs, ServeArgs};

/// Start throwaway PostgreSQL and Redis servers and a broker on them, print their addresses as
/// one JSON line, and serve until SIGTERM, Ctrl-C or the end of stdin.
#[derive(Debug, Parser)]
#[command(name = "dispatch-sandbox", version)]
pub struct Cli {
    #[command(flatten)]
    pub sandbox: SandboxArgs,
    #[command(flatten)]
    pub log: dispatch_broker::config::LogArgs,
}

/// Options of `dispatch-sandbox`.
#[derive(Debug, Clone, Args)]
pub struct SandboxArgs {
    /// gRPC address (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Prometheus address (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub metrics_listen: SocketAddr,
    /// Smallest lease TTL accepted (short TTLs make lease-loss tests quick).
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub lease_min_ttl: Duration,
    /// How often expired leases are swept.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub sweep_interval: Duration,
    /// Authentication and TLS, as for `serve`.
    #[command(flatten)]
    pub security: SecurityArgs,
}

/// Runs the sandbox.
pub async fn run(args: &SandboxArgs) -> Result<()> {
    let (pg, redis) = tokio::task::spawn_blocking(|| -> Result<_> {
        Ok((super::Postgres::start()?, super::Redis::start()?))
    })
    .await??;
    let url = pg.create_database("sandbox")?;
    let stats = std::sync::Arc::new(dispatch_broker::metrics::Stats::default());
    let tasks =
        dispatch_broker::tasks::Tasks::connect(&url, 1, Duration::from_secs(10), stats).await?;
    tasks.migrate(false, false, false, false).await?;
    drop(tasks);
    let mut serve = ServeArgs::with_urls(&url, &redis.url());
    serve.listen = args.listen;
    serve.metrics_listen = args.metrics_listen;
    serve.lease.min_ttl = args.lease_min_ttl;
    serve.sweep_interval = args.sweep_interval;
    serve.security = args.security.clone();
    serve.lanes.cutoff = Duration::ZERO;
    let broker = dispatch_broker::server::start(&serve).await?;
    let scheme = if serve.security.tls_cert.is_some() {
        "https"
    } else {
        "http"
    };
    let line = serde_json::json!({
        "endpoint": format!("{scheme}://{}", broker.addr),
        "address": broker.addr.to_string(),
        "metrics": format!("http://{}/metrics", broker.metrics_addr),
        "postgres_url": url,
        "redis_url": redis.url(),
    });
    println!("{line}");
    let stdin_closed = async {
        use tokio::io::AsyncReadExt;
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 256];
        while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
    };
    tokio::select! {
        _ = dispatch_broker::shutdown::os_signal() => {}
        _ = stdin_closed => {}
    }
    broker.shutdown().await?;
    drop(redis);
    drop(pg);
    Ok(())
}
