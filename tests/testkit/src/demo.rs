//! `dispatch-demo`: the head-of-line incident in miniature, on throwaway servers.
//!
//! Queues 2,000 tasks on one repository, the oldest of them already running on a busy worker, and
//! a few hundred tasks of other domains behind them; then lets 10 simulated workers (the
//! dispatch-worker library) fetch, run and finish tasks, with live progress per domain and the lane
//! gauge. The other domains' tasks are handed out at once instead of waiting behind the blocked
//! head. Ends with a summary and what the broker's `/metrics` shows; `--keep` leaves it serving.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use tokio::sync::mpsc;

use clap::{Args, Parser};
use dispatch_broker::config::ServeArgs;
use dispatch_worker::{FinalState, Worker, WorkerConfig};

/// Start throwaway PostgreSQL and Redis servers, the broker, and a scripted exchange of workers
/// and tasks that shows the broker at work. Needs nothing configured.
#[derive(Debug, Parser)]
#[command(name = "dispatch-demo", version)]
pub struct Cli {
    #[command(flatten)]
    pub demo: DemoArgs,
    #[command(flatten)]
    pub log: dispatch_broker::config::LogArgs,
}

/// Options of `dispatch-demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Tasks queued on the one busy repository (the head-of-line block).
    #[arg(long, default_value_t = 2000)]
    pub blocked: usize,
    /// Simulated workers.
    #[arg(long, default_value_t = 10)]
    pub workers: usize,
    /// Where the demo broker serves /metrics.
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub metrics_listen: SocketAddr,
    /// Keep the broker (gRPC and /metrics) serving after the exchange, for a person to point a
    /// client at, until Ctrl-C.
    #[arg(long, alias = "keep-running")]
    pub keep: bool,
}

const REPO: &str = "prn:python.repository:R0";

/// The other domains of the demo: (domain, repositories, tasks).
const OTHERS: [(&str, usize, usize); 3] = [("D2", 50, 150), ("D3", 20, 100), ("D4", 100, 100)];

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
    let stats = std::sync::Arc::new(dispatch_broker::metrics::Stats::default());
    let tasks =
        dispatch_broker::tasks::Tasks::connect(&url, 2, Duration::from_secs(10), stats).await?;
    tasks.migrate(false, false, false, false).await?;
    let broker = dispatch_broker::server::start(&serve).await?;
    println!(
        "broker: gRPC on {}, metrics on http://{}/metrics",
        broker.addr, broker.metrics_addr
    );
    let endpoint = format!("http://{}", broker.addr);

    let client = tasks.pool().get().await?;
    client
        .batch_execute(&format!(
            "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), 'D1', 'waiting', \
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
    for (domain, repos, count) in OTHERS {
        client
            .batch_execute(&format!(
                "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
                 SELECT gen_random_uuid(), '{domain}', 'waiting', \
                        ARRAY['prn:file.repository:{domain}-' || (i % {repos}), \
                              'shared:prn:core.domain:{domain}'] \
                 FROM generate_series(1, {count}) AS i;"
            ))
            .await?;
    }
    drop(client);
    let others: usize = OTHERS.iter().map(|o| o.2).sum();
    println!(
        "queued {} tasks on {REPO} in domain D1 (the oldest running on busy-worker) and {others} \
         tasks of domains D2-D4 behind them; {} workers start",
        args.blocked, args.workers
    );

    // Progress per domain, and the lane gauge (drawn on a terminal only).
    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template("{prefix:>3} [{bar:40}] {pos:>5}/{len:5} {msg}")
        .expect("a valid template")
        .progress_chars("=> ");
    let mut progress = HashMap::new();
    let d1 = bars.add(ProgressBar::new(args.blocked as u64).with_style(style.clone()));
    d1.set_prefix("D1");
    d1.set_message("blocked behind its running head");
    progress.insert("D1".to_owned(), d1.clone());
    for (domain, _, count) in OTHERS {
        let bar = bars.add(ProgressBar::new(count as u64).with_style(style.clone()));
        bar.set_prefix(domain);
        progress.insert(domain.to_owned(), bar);
    }
    let gauge = bars.add(ProgressBar::new_spinner());
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<String>();
    let started = Instant::now();
    let mut fleet = Vec::new();
    for n in 0..args.workers {
        let worker = Worker::connect(endpoint.clone(), config(&format!("demo-worker-{n}"))).await?;
        fleet.push(worker.clone());
        let done = done_tx.clone();
        tokio::spawn(async move {
            while let Ok(next) = worker.next_task(Duration::from_secs(1)).await {
                let Some(task) = next else {
                    if worker.stopping().is_cancelled() {
                        break;
                    }
                    continue;
                };
                if task.start().await.is_err() {
                    continue;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                let domain = task.task().name.clone();
                if task.finish(FinalState::Completed, None).await.is_ok() {
                    let _ = done.send(domain);
                }
            }
            let _ = worker.close().await;
        });
    }
    drop(done_tx);
    let mut finished = 0;
    let mut ticker = tokio::time::interval(Duration::from_millis(200));
    while finished < others {
        tokio::select! {
            domain = done_rx.recv() => {
                let Some(domain) = domain else { break };
                if let Some(bar) = progress.get(&domain) {
                    bar.inc(1);
                }
                finished += 1;
            }
            _ = ticker.tick() => {
                let g = broker.lanes.current();
                gauge.set_message(format!(
                    "lanes {} (live leases {}, waiting_tasks {})",
                    g.lanes, g.live_leases, g.waiting_tasks()
                ));
                gauge.tick();
            }
        }
    }
    let took = started.elapsed();
    for w in &fleet {
        w.stop();
    }
    gauge.finish_and_clear();
    for bar in progress.values() {
        bar.abandon();
    }
    // Let the gauge take in the drained queue before the summary.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let s = broker.stats.snapshot();
    println!(
        "\n{} workers ran all {others} tasks of D2-D4 in {took:.2?}, while the {} tasks of {REPO} \
         stayed behind their running head (no head-of-line blocking).",
        args.workers, args.blocked
    );
    println!(
        "broker: {} fetch passes, {} postgres statements, {} redis calls; lane gauge {}",
        s.fetch_passes,
        s.postgres_statements,
        s.redis_calls,
        broker.lanes.current().lanes
    );
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
    if args.keep {
        println!(
            "\nthe broker keeps serving gRPC on {} (Postgres {url}, Redis {}); Ctrl-C ends it",
            broker.addr,
            redis.url()
        );
        println!(
            "ask it why tasks wait (the admin API is open: this broker has no credentials):\n  \
             dispatch-broker blocked --addr http://{addr}\n  \
             dispatch-broker explain TASK_ID --addr http://{addr}\n  \
             dispatch-broker leases --addr http://{addr}\n  \
             dispatch-broker locks --addr http://{addr}",
            addr = broker.addr
        );
        dispatch_broker::shutdown::os_signal().await;
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
