//! The cost of each admin call in the head-of-line incident: one repository's queue of N waiting
//! tasks behind its running head, 200 tasks of other domains, 10 workers each holding one
//! other-domain task. Each call runs 20 times over gRPC; the table shows p50/p99 and the p50
//! against N = 1,000 (the baseline in the same run). ExplainTask of the newest blocked task is
//! the worst case: all N older tasks conflict with it.
//!
//! Run: `cargo bench --bench admin` (sizes as arguments to choose others).

#[path = "support/incident.rs"]
mod incident;

use std::future::Future;
use std::time::{Duration, Instant};

use dispatch_broker::config::ServeArgs;
use dispatch_broker::proto::admin_client::AdminClient;
use dispatch_broker::proto::*;
use dispatch_testkit::{Postgres, Redis};
use dispatch_worker::Worker;
use incident::{percentile, quiet};
use tonic::transport::Channel;
use uuid::Uuid;

const OTHERS: i32 = 200;
const LEASES: usize = 10;
const RUNS: usize = 20;

async fn measure<F, Fut>(mut call: F) -> (Duration, Duration)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    call().await; // warm the prepared statements and the connection
    let mut times = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let start = Instant::now();
        call().await;
        times.push(start.elapsed());
    }
    times.sort();
    (percentile(&times, 0.5), percentile(&times, 0.99))
}

#[tokio::main]
async fn main() {
    let sizes: Vec<i32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1_000, 100_000]
    } else {
        sizes
    };
    let (pg, redis) =
        tokio::task::spawn_blocking(|| (Postgres::start().unwrap(), Redis::start().unwrap()))
            .await
            .unwrap();
    let mut rows: Vec<(String, Vec<(Duration, Duration)>)> = Vec::new();
    for (n, size) in sizes.iter().enumerate() {
        let url = pg.create_database(&format!("admin{n}")).unwrap();
        pg.psql(
            &format!("admin{n}"),
            dispatch_broker::tasks::sql::MIGRATE.as_str(),
        )
        .unwrap();
        let _ = std::process::Command::new("redis-cli")
            .args(["-u", &redis.url(), "FLUSHALL"])
            .output();
        let mut args = ServeArgs::with_urls(&url, &redis.url());
        args.lanes.interval = Duration::from_secs(3600);
        args.lanes.cutoff = Duration::ZERO;
        let broker = dispatch_broker::server::start(&args).await.unwrap();
        let endpoint = format!("http://{}", broker.addr);
        let incident::Incident { db, busy, head } =
            incident::seed(&url, &endpoint, *size, OTHERS).await;
        let mut workers = Vec::new();
        let mut held = Vec::new();
        for w in 0..LEASES {
            let worker = Worker::connect(&endpoint, quiet(&format!("w{w}")))
                .await
                .unwrap();
            held.push(worker.next_task(Duration::ZERO).await.unwrap().unwrap());
            workers.push(worker);
        }
        let newest: Uuid = db
            .query_one(
                "SELECT pulp_id FROM core_task WHERE name = 'blocked' \
                 ORDER BY pulp_created DESC, pulp_id DESC LIMIT 1",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        let other: Uuid = db
            .query_one(
                "SELECT pulp_id FROM core_task WHERE name = 'other' AND app_lock_id IS NULL \
                 ORDER BY pulp_created DESC LIMIT 1",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        let channel = Channel::from_shared(endpoint.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let admin = AdminClient::new(channel);
        // BlockedResources counts from the resource queues once they have read every task.
        broker.resource_queues.settle().await.unwrap();
        let gauge = {
            let lanes = broker.lanes.clone();
            measure(|| {
                let lanes = lanes.clone();
                async move { lanes.compute_now().await.unwrap() }
            })
            .await
        };
        let explain = |id: Uuid| {
            let admin = admin.clone();
            move || {
                let mut admin = admin.clone();
                async move {
                    admin
                        .explain_task(ExplainTaskRequest {
                            task_id: id.to_string(),
                            max_conflicts: 10,
                        })
                        .await
                        .unwrap();
                }
            }
        };
        let head_id: Uuid = head.task().task_id.parse().unwrap();
        let results = vec![
            (
                format!("ExplainTask, newest blocked task ({size} older conflicts)"),
                measure(explain(newest)).await,
            ),
            (
                "ExplainTask, the running head".to_owned(),
                measure(explain(head_id)).await,
            ),
            (
                "ExplainTask, a ready task of another domain".to_owned(),
                measure(explain(other)).await,
            ),
            (
                "ListLeases (page of 50)".to_owned(),
                measure(|| {
                    let mut admin = admin.clone();
                    async move {
                        admin
                            .list_leases(ListLeasesRequest::default())
                            .await
                            .unwrap();
                    }
                })
                .await,
            ),
            (
                "ListLocks (page of 50)".to_owned(),
                measure(|| {
                    let mut admin = admin.clone();
                    async move {
                        admin.list_locks(ListLocksRequest::default()).await.unwrap();
                    }
                })
                .await,
            ),
            (
                "BlockedResources (10, heads explained; from the resource queues)".to_owned(),
                measure(|| {
                    let mut admin = admin.clone();
                    async move {
                        admin
                            .blocked_resources(BlockedResourcesRequest { limit: 10 })
                            .await
                            .unwrap();
                    }
                })
                .await,
            ),
            (
                "(the gauge's full pass that makes the survey, every --lane-full-interval (60 s) by one replica)".to_owned(),
                gauge,
            ),
        ];
        for (i, (name, figures)) in results.into_iter().enumerate() {
            if n == 0 {
                rows.push((name, vec![figures]));
            } else {
                rows[i].1.push(figures);
            }
        }
        drop(held);
        for w in workers {
            let _ = w.close().await;
        }
        let _ = busy.close().await;
        broker.shutdown().await.unwrap();
    }
    let header: Vec<String> = sizes
        .iter()
        .map(|s| format!("p50 / p99 at {s} waiting"))
        .collect();
    println!(
        "| admin call | {} | p50 at {} vs {} |",
        header.join(" | "),
        sizes.last().unwrap(),
        sizes[0]
    );
    println!("|---|{}---:|", "---:|".repeat(sizes.len()));
    for (name, figures) in rows {
        let cells: Vec<String> = figures
            .iter()
            .map(|(p50, p99)| {
                format!(
                    "{:.2} / {:.2} ms",
                    p50.as_secs_f64() * 1e3,
                    p99.as_secs_f64() * 1e3
                )
            })
            .collect();
        let ratio = figures.last().unwrap().0.as_secs_f64() / figures[0].0.as_secs_f64();
        println!("| {name} | {} | {ratio:.1}x |", cells.join(" | "));
    }
}
