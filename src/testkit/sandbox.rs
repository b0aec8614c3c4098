//! `dispatch-broker sandbox`: throwaway PostgreSQL and Redis with a broker on them, for trying a
//! client and for the Python client's tests. Prints one JSON line with the addresses, then
//! serves until SIGTERM, Ctrl-C or the end of stdin (so it dies with the process that started it).

use std::time::Duration;

use anyhow::Result;

use crate::config::{SandboxArgs, ServeArgs};

/// Runs the sandbox.
pub async fn run(args: &SandboxArgs) -> Result<()> {
    let (pg, redis) = tokio::task::spawn_blocking(|| -> Result<_> {
        Ok((super::Postgres::start()?, super::Redis::start()?))
    })
    .await??;
    let url = pg.create_database("sandbox")?;
    let stats = std::sync::Arc::new(crate::metrics::Stats::default());
    let tasks = crate::tasks::Tasks::connect(&url, 1, Duration::from_secs(10), stats).await?;
    tasks.migrate(false, false, false).await?;
    drop(tasks);
    let mut serve = ServeArgs::with_urls(&url, &redis.url());
    serve.listen = args.listen;
    serve.metrics_listen = args.metrics_listen;
    serve.lease.min_ttl = args.lease_min_ttl;
    serve.sweep_interval = args.sweep_interval;
    serve.security = args.security.clone();
    serve.lanes.cutoff = Duration::ZERO;
    let broker = crate::server::start(&serve).await?;
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
        _ = crate::shutdown::os_signal() => {}
        _ = stdin_closed => {}
    }
    broker.shutdown().await?;
    drop(redis);
    drop(pg);
    Ok(())
}
