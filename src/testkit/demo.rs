//! `dispatch-broker demo`: the head-of-line incident in miniature, on throwaway servers.
//!
//! Queues many tasks on one repository (the oldest of them already running) and a few tasks of
//! another domain behind them, then lets simulated workers fetch, run and finish tasks through
//! the broker's gRPC API. It prints who got what and when, showing that the other domain's tasks
//! are handed out at once instead of waiting behind the blocked head.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::config::{DemoArgs, ServeArgs};
use crate::proto::broker_client::BrokerClient;
use crate::proto::{FetchTaskRequest, FinishTaskRequest, OpenLeaseRequest, StartTaskRequest};

/// Runs the demo.
pub async fn run(args: &DemoArgs) -> Result<()> {
    println!("starting throwaway PostgreSQL and Redis ...");
    let (pg, redis) = tokio::task::spawn_blocking(|| -> Result<_> {
        Ok((super::Postgres::start()?, super::Redis::start()?))
    })
    .await??;
    let url = pg.create_database("demo")?;
    let serve = ServeArgs::with_urls(&url, &redis.url());
    let stats = std::sync::Arc::new(crate::metrics::Stats::default());
    let tasks = crate::tasks::Tasks::connect(&url, 2, Duration::from_secs(10), stats).await?;
    tasks.migrate().await?;
    let broker = crate::server::start(&serve).await?;
    println!("broker listening on {}", broker.addr);

    let client = tasks.pool().get().await?;
    client
        .batch_execute(&format!(
            "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), 'pulp_python.sync', 'waiting', \
                    ARRAY['prn:python.repository:R0', 'shared:prn:core.domain:D1'] \
             FROM generate_series(1, {blocked}); \
             INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), 'pulp_file.publish', 'waiting', \
                    ARRAY['prn:file.repository:F' || i, 'shared:prn:core.domain:D2'] \
             FROM generate_series(1, {others}) AS i;",
            blocked = args.blocked,
            others = args.others
        ))
        .await?;
    drop(client);
    println!(
        "queued {} tasks on prn:python.repository:R0 and {} tasks in domain D2 behind them",
        args.blocked, args.others
    );

    let endpoint = format!("http://{}", broker.addr);
    let started = Instant::now();
    let mut workers = Vec::new();
    for n in 0..args.workers {
        let endpoint = endpoint.clone();
        let others = args.others;
        workers.push(tokio::spawn(async move {
            worker(n, endpoint, others, started).await
        }));
    }
    let mut handled = 0;
    for w in workers {
        handled += w.await.context("worker")??;
    }
    println!(
        "{} workers handled {handled} tasks in {:.2?}; every D2 task was handed out while R0's queue was still {}+ deep",
        args.workers,
        started.elapsed(),
        args.blocked.saturating_sub(handled),
    );
    let s = broker.stats.snapshot();
    println!(
        "broker counters: {} fetches, {} postgres statements, {} redis calls",
        s.fetches, s.postgres_statements, s.redis_calls
    );
    broker.shutdown().await?;
    drop(redis);
    drop(pg);
    Ok(())
}

/// One simulated worker: fetches until no D2 task is left, "runs" each task for 20 ms.
async fn worker(n: usize, endpoint: String, others: usize, started: Instant) -> Result<usize> {
    let mut client = BrokerClient::connect(endpoint).await?;
    let lease = client
        .open_lease(OpenLeaseRequest {
            worker_name: format!("demo-worker-{n}"),
            versions: [("core".to_string(), "3.123.1".to_string())].into(),
            ttl: None,
            app_status_id: String::new(),
        })
        .await?
        .into_inner();
    let mut handled = 0;
    loop {
        let fetched = client
            .fetch_task(FetchTaskRequest {
                lease_id: lease.lease_id.clone(),
                wait: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 300_000_000,
                }),
                skip_task_ids: vec![],
            })
            .await?
            .into_inner();
        let Some(task) = fetched.task else { break };
        println!(
            "  {:>6.0?}  worker {n} got {:<18} {} (token {})",
            started.elapsed(),
            task.name,
            task.exclusive_resources.join(","),
            task.fencing_token
        );
        client
            .start_task(StartTaskRequest {
                lease_id: lease.lease_id.clone(),
                task_id: task.task_id.clone(),
                fencing_token: task.fencing_token,
            })
            .await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
        client
            .finish_task(FinishTaskRequest {
                lease_id: lease.lease_id.clone(),
                task_id: task.task_id,
                fencing_token: task.fencing_token,
                state: "completed".into(),
                error: String::new(),
            })
            .await?;
        handled += 1;
        if handled > others + 5 {
            break;
        }
    }
    client
        .close_lease(crate::proto::CloseLeaseRequest {
            lease_id: lease.lease_id,
        })
        .await?;
    Ok(handled)
}
