//! FetchTask latency in the head-of-line incident: one repository's queue of N blocked tasks
//! (its oldest running) with 200 tasks of other domains behind it; 10 leases fetch the other
//! domains' tasks. Reports p50/p99 latency and the per-fetch backend calls at each N, against
//! N = 1,000 as the baseline in the same run.
//!
//! Run: `cargo bench --bench fetch` (sizes as arguments to choose others).

#[path = "support/incident.rs"]
mod incident;

use std::time::{Duration, Instant};

use dispatch_broker::config::ServeArgs;
use dispatch_testkit::{Postgres, Redis};
use dispatch_worker::{FinalState, Worker};
use incident::{percentile, quiet};

const OTHERS: i32 = 200;
const LEASES: usize = 10;

#[tokio::main]
async fn main() {
    let sizes: Vec<i32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1_000, 17_000, 100_000]
    } else {
        sizes
    };
    let (pg, redis) =
        tokio::task::spawn_blocking(|| (Postgres::start().unwrap(), Redis::start().unwrap()))
            .await
            .unwrap();
    println!("| blocked tasks | fetch p50 | fetch p99 | postgres statements / fetch | redis calls / fetch | p50 vs 1,000 |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let mut baseline = None;
    for (n, size) in sizes.into_iter().enumerate() {
        let url = pg.create_database(&format!("fetch{n}")).unwrap();
        pg.psql(
            &format!("fetch{n}"),
            dispatch_broker::tasks::sql::MIGRATE.as_str(),
        )
        .unwrap();
        redis_flush(&redis);
        let mut args = ServeArgs::with_urls(&url, &redis.url());
        args.lanes.interval = Duration::from_secs(3600);
        let broker = dispatch_broker::server::start(&args).await.unwrap();
        let endpoint = format!("http://{}", broker.addr);
        let incident::Incident {
            db: _db,
            busy,
            head,
        } = incident::seed(&url, &endpoint, size, OTHERS).await;
        let mut workers = Vec::new();
        for w in 0..LEASES {
            workers.push(
                Worker::connect(&endpoint, quiet(&format!("w{w}")))
                    .await
                    .unwrap(),
            );
        }
        let before = broker.stats.snapshot();
        let mut times = Vec::new();
        let mut held = Vec::new();
        for i in 0..OTHERS as usize {
            let start = Instant::now();
            let task = workers[i % LEASES]
                .next_task(Duration::ZERO)
                .await
                .unwrap()
                .expect("another domain's task");
            times.push(start.elapsed());
            assert_eq!(task.task().name, "other");
            // Held until the round ends (dropping the guard would release it in the background
            // and make the measured fetches race those releases).
            held.push(task);
        }
        broker.passes.idle().await;
        let cost = broker.stats.snapshot() - before;
        times.sort();
        let p50 = percentile(&times, 0.5);
        let base = *baseline.get_or_insert(p50);
        println!(
            "| {size} | {:.2} ms | {:.2} ms | {:.1} | {:.1} | {:.2}x |",
            p50.as_secs_f64() * 1e3,
            percentile(&times, 0.99).as_secs_f64() * 1e3,
            cost.postgres_statements as f64 / OTHERS as f64,
            cost.redis_calls as f64 / OTHERS as f64,
            p50.as_secs_f64() / base.as_secs_f64(),
        );
        for task in held {
            task.release().await.unwrap();
        }
        for w in workers {
            w.close().await.unwrap();
        }
        head.finish(FinalState::Completed, None).await.unwrap();
        busy.close().await.unwrap();
        broker.shutdown().await.unwrap();
    }
}

fn redis_flush(redis: &Redis) {
    let _ = std::process::Command::new("redis-cli")
        .args(["-u", &redis.url(), "FLUSHALL"])
        .output();
}
