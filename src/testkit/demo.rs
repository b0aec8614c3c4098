//! `dispatch-broker demo`: the head-of-line incident in miniature, on throwaway servers.
//!
//! Queues many tasks on one repository, the oldest of them already running on a busy worker,
//! and tasks of another domain behind them; then lets simulated workers fetch, run and finish
//! tasks through the broker's gRPC API. The other domain's tasks are handed out at once instead
//! of waiting behind the blocked head. Ends with what the broker's `/metrics` shows.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::config::{DemoArgs, ServeArgs};
use crate::worker::{FinalState, Worker, WorkerConfig};

const REPO: &str = "prn:python.repository:R0";

/// Runs the demo.
pub async fn run(args: &DemoArgs) -> Result<()> {
    println!("starting throwaway PostgreSQL and Redis ...");
    let (pg, redis) = tokio::task::spawn_blocking(|| -> Result<_> {
        Ok((super::Postgres::start()?, super::Redis::start()?))
    })
    .await??;
    let url = pg.create_database("demo")?;
    let mut serve = ServeArgs::with_urls(&url, &redis.url());
    serve.metrics_listen = args.metrics_listen;
    serve.lanes.cutoff = Duration::ZERO;
    serve.lanes.interval = Duration::from_millis(500);
    let stats = std::sync::Arc::new(crate::metrics::Stats::default());
    let tasks = crate::tasks::Tasks::connect(&url, 2, Duration::from_secs(10), stats).await?;
    tasks.migrate(false, false).await?;
    let broker = crate::server::start(&serve).await?;
    println!(
        "broker: gRPC on {}, metrics on http://{}/metrics",
        broker.addr, broker.metrics_addr
    );
    let endpoint = format!("http://{}", broker.addr);

    let client = tasks.pool().get().await?;
    client
        .batch_execute(&format!(
            "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), 'pulp_python.sync', 'waiting', \
                    ARRAY['{REPO}', 'shared:prn:core.domain:D1'] \
             FROM generate_series(1, {blocked});",
            blocked = args.blocked,
        ))
        .await?;
    // The busy worker takes the head of the repository's queue and keeps it running.
    let busy = Worker::connect(endpoint.clone(), config("busy-worker")).await?;
    let head = busy
        .next_task(Duration::ZERO)
        .await?
        .context("the head task")?;
    head.start().await?;
    client
        .batch_execute(&format!(
            "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), 'pulp_file.publish', 'waiting', \
                    ARRAY['prn:file.repository:F' || i, 'shared:prn:core.domain:D2'] \
             FROM generate_series(1, {others}) AS i;",
            others = args.others
        ))
        .await?;
    drop(client);
    println!(
        "queued {} tasks on {REPO} (the oldest one running on busy-worker) and {} tasks of domain D2 behind them",
        args.blocked, args.others
    );

    let started = Instant::now();
    let mut workers = Vec::new();
    for n in 0..args.workers {
        let endpoint = endpoint.clone();
        workers.push(tokio::spawn(
            async move { worker(n, endpoint, started).await },
        ));
    }
    let mut handled = 0;
    for w in workers {
        handled += w.await.context("worker")??;
    }
    println!(
        "{} workers ran all {handled} D2 tasks in {:.2?}, while {REPO} stayed blocked behind its running head",
        args.workers,
        started.elapsed(),
    );
    let s = broker.stats.snapshot();
    println!(
        "broker counters: {} fetch passes, {} postgres statements, {} redis calls",
        s.fetches, s.postgres_statements, s.redis_calls
    );
    // Let the gauge see the queue, then show what Prometheus would scrape.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    println!(
        "\n$ curl http://{}/metrics   (dispatch_* gauges and counters)",
        broker.metrics_addr
    );
    for line in scrape(broker.metrics_addr).await?.lines() {
        let interesting = line.starts_with("dispatch_")
            && !line.contains("_bucket")
            && !line.contains("dispatch_rpc_duration_seconds");
        if interesting {
            println!("  {line}");
        }
    }
    if args.keep_running {
        println!("\nserving until Ctrl-C ...");
        crate::shutdown::os_signal().await;
    }
    head.finish(FinalState::Completed, None).await?;
    busy.close().await?;
    broker.shutdown().await?;
    drop(tasks);
    drop(busy);
    drop(redis);
    drop(pg);
    Ok(())
}

fn config(name: &str) -> WorkerConfig {
    let mut config = WorkerConfig::new(name);
    config.versions = [("core".to_string(), "3.123.1".to_string())].into();
    config
}

/// One simulated worker (the crate's worker library): fetches until nothing is ready for 300 ms,
/// "runs" each task 20 ms.
async fn worker(n: usize, endpoint: String, started: Instant) -> Result<usize> {
    let worker = Worker::connect(endpoint, config(&format!("demo-worker-{n}"))).await?;
    let mut handled = 0;
    while let Some(task) = worker.next_task(Duration::from_millis(300)).await? {
        println!(
            "  {:>6.0?}  demo-worker-{n} got {:<18} {} (fencing token {})",
            started.elapsed(),
            task.task().name,
            task.task().exclusive_resources.join(","),
            task.fencing_token()
        );
        task.start().await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
        task.finish(FinalState::Completed, None).await?;
        handled += 1;
    }
    worker.close().await?;
    Ok(handled)
}

async fn scrape(addr: std::net::SocketAddr) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut body = String::new();
    stream.read_to_string(&mut body).await?;
    Ok(body)
}
