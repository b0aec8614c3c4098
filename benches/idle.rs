//! What waiting costs: an idle fleet, broker against a baseline, in the same process on the same
//! throwaway PostgreSQL and Redis.
//!
//! - **Dispatch latency**: 100 idle workers; 50 tasks inserted one at a time; time from the
//!   insert's commit to a worker holding the task (p50, p99).
//! - **Scale-up herd**: 500 idle workers for 10 s; task-table queries per second at idle
//!   (`pg_stat_user_tables` scans of `core_task`).
//!
//! Broker workers use the crate's worker library and long-poll FetchTask. The baseline does what
//! Pulp's Redis worker does today: every worker queries the head of the task table itself (FIFO,
//! batches of 20), skips conflicts, tries the Redis lock, claims, and sleeps workers x 10 ms
//! (+ 0.5-1.5 ms jitter) when it finds nothing.
//!
//! Run: `cargo bench --bench idle` (or `-- LATENCY_WORKERS HERD_WORKERS`). Prints a Markdown table.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dispatch_broker::config::ServeArgs;
use dispatch_broker::testkit::{Postgres, Redis};
use dispatch_broker::worker::{FinalState, Worker, WorkerConfig};
use tokio::sync::mpsc;
use uuid::Uuid;

const TASKS: usize = 50;
const HERD_WINDOW: Duration = Duration::from_secs(10);
const BASELINE_CONNECTIONS: usize = 20;

type Receipt = (Uuid, Instant);

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Scans of core_task so far (sequential and index), as the statistics views count them.
async fn task_table_scans(db: &tokio_postgres::Client) -> i64 {
    db.batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .unwrap();
    db.query_one(
        "SELECT (coalesce(seq_scan, 0) + coalesce(idx_scan, 0))::bigint \
         FROM pg_stat_user_tables WHERE relname = 'core_task'",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// Task-table queries per second over `window` while the fleet idles.
async fn idle_query_rate(db: &tokio_postgres::Client, window: Duration) -> f64 {
    // Statistics reach the shared counters when a backend flushes them (about every second).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = task_table_scans(db).await;
    tokio::time::sleep(window).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = task_table_scans(db).await;
    (after - before) as f64 / (window.as_secs_f64() + 1.5)
}

/// Inserts tasks one at a time, each after the previous one was received; returns the latencies
/// from commit to receipt.
async fn latencies(
    db: &tokio_postgres::Client,
    receipts: &mut mpsc::UnboundedReceiver<Receipt>,
) -> Vec<Duration> {
    let mut out = Vec::new();
    for i in 0..TASKS {
        let id = Uuid::new_v4();
        db.execute(
            "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
             VALUES ($1, 'bench', 'waiting', ARRAY[$2])",
            &[&id, &format!("prn:file.repository:L{i}")],
        )
        .await
        .unwrap();
        let committed = Instant::now();
        loop {
            let (got, at) = tokio::time::timeout(Duration::from_secs(30), receipts.recv())
                .await
                .expect("a worker received the task")
                .unwrap();
            if got == id {
                out.push(at.saturating_duration_since(committed));
                break;
            }
        }
    }
    out.sort();
    out
}

/// Broker workers long-polling with a 30 s wait, as real ones would; stopping one ends its wait.
async fn broker_fleet(
    endpoint: &str,
    n: usize,
    receipts: mpsc::UnboundedSender<Receipt>,
    stop: Arc<AtomicBool>,
) -> (Vec<Worker>, Vec<tokio::task::JoinHandle<()>>) {
    let mut handles = Vec::new();
    let mut workers = Vec::new();
    for w in 0..n {
        let worker = Worker::connect(endpoint, WorkerConfig::new(format!("bench-{w}")))
            .await
            .unwrap();
        workers.push(worker.clone());
        let (receipts, stop) = (receipts.clone(), Arc::clone(&stop));
        handles.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                match worker.next_task(Duration::from_secs(30)).await {
                    Ok(Some(task)) => {
                        let _ = receipts.send((task.id().parse().unwrap(), Instant::now()));
                        task.start().await.unwrap();
                        task.finish(FinalState::Completed, None).await.unwrap();
                    }
                    Ok(None) => {}
                    Err(e) => panic!("fetch failed: {e}"),
                }
            }
            worker.close().await.unwrap();
        }));
    }
    (workers, handles)
}

async fn stop_broker_fleet(
    stop: &AtomicBool,
    (workers, handles): (Vec<Worker>, Vec<tokio::task::JoinHandle<()>>),
) {
    stop.store(true, Ordering::SeqCst);
    for w in &workers {
        w.stop();
    }
    for h in handles {
        h.await.unwrap();
    }
}

/// Releases the baseline's Redis locks (one DEL).
async fn unlock(redis: &mut deadpool_redis::Connection, keys: &[String]) {
    if keys.is_empty() {
        return;
    }
    let _: i64 = deadpool_redis::redis::cmd("DEL")
        .arg(keys)
        .query_async(redis)
        .await
        .unwrap();
}

/// The baseline worker loop (Pulp's Redis worker, reduced to what dispatch needs).
async fn baseline_worker(
    name: String,
    app_status: Uuid,
    fleet: usize,
    db: Arc<tokio_postgres::Client>,
    mut redis: deadpool_redis::Connection,
    receipts: mpsc::UnboundedSender<Receipt>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::SeqCst) {
        let rows = db
            .query(
                "SELECT pulp_id, coalesce(reserved_resources_record, '{}') FROM core_task \
                 WHERE state = 'waiting' AND app_lock_id IS NULL ORDER BY pulp_created LIMIT 20",
                &[],
            )
            .await
            .unwrap();
        let mut got = false;
        let mut taken: Vec<String> = Vec::new();
        for row in rows {
            let id: Uuid = row.get(0);
            let record: Vec<String> = row.get(1);
            let names: Vec<String> = record
                .iter()
                .map(|r| r.trim_start_matches("shared:").to_owned())
                .collect();
            let conflict = names.iter().any(|n| taken.contains(n));
            taken.extend(names.iter().cloned());
            if conflict {
                continue;
            }
            // The Redis locks: all or nothing.
            let mut locked = Vec::new();
            for n in &names {
                let key = format!("baseline:lock:{n}");
                let ok: bool = deadpool_redis::redis::cmd("SET")
                    .arg(&key)
                    .arg(&name)
                    .arg("NX")
                    .query_async::<Option<String>>(&mut redis)
                    .await
                    .unwrap()
                    .is_some();
                if !ok {
                    break;
                }
                locked.push(key);
            }
            if locked.len() < names.len() {
                unlock(&mut redis, &locked).await;
                continue;
            }
            let claimed = db
                .execute(
                    "UPDATE core_task SET app_lock_id = $2 \
                     WHERE pulp_id = $1 AND state = 'waiting' AND app_lock_id IS NULL",
                    &[&id, &app_status],
                )
                .await
                .unwrap();
            if claimed == 1 {
                let _ = receipts.send((id, Instant::now()));
                db.execute(
                    "UPDATE core_task SET state = 'completed', finished_at = now() WHERE pulp_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
                got = true;
            }
            unlock(&mut redis, &locked).await;
            if got {
                break;
            }
        }
        if !got {
            let jitter = 0.5 + rand::random::<f64>();
            tokio::time::sleep(Duration::from_secs_f64(
                (fleet as f64 * 10.0 + jitter) / 1000.0,
            ))
            .await;
        }
    }
}

async fn baseline_fleet(
    url: &str,
    redis_url: &str,
    n: usize,
    receipts: mpsc::UnboundedSender<Receipt>,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut clients = Vec::new();
    for _ in 0..BASELINE_CONNECTIONS.min(n) {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        clients.push(Arc::new(client));
    }
    let pool = deadpool_redis::Config::from_url(redis_url)
        .builder()
        .unwrap()
        .max_size(n)
        .runtime(deadpool_redis::Runtime::Tokio1)
        .build()
        .unwrap();
    let mut handles = Vec::new();
    for w in 0..n {
        let app_status = Uuid::new_v4();
        clients[0]
            .execute(
                "INSERT INTO core_appstatus (pulp_id, app_type, name, ttl) \
                 VALUES ($1, 'worker', $2, interval '30 seconds')",
                &[&app_status, &format!("baseline-{w}")],
            )
            .await
            .unwrap();
        let db = Arc::clone(&clients[w % clients.len()]);
        let redis = pool.get().await.unwrap();
        handles.push(tokio::spawn(baseline_worker(
            format!("baseline-{w}"),
            app_status,
            n,
            db,
            redis,
            receipts.clone(),
            Arc::clone(&stop),
        )));
        // Workers start spread out, as a fleet does.
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    handles
}

async fn stop_all(stop: &AtomicBool, handles: Vec<tokio::task::JoinHandle<()>>) {
    stop.store(true, Ordering::SeqCst);
    for h in handles {
        h.await.unwrap();
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (latency_workers, herd_workers) = (
        args.first().copied().unwrap_or(100),
        args.get(1).copied().unwrap_or(500),
    );
    eprintln!("starting throwaway PostgreSQL and Redis ...");
    let (pg, redis) =
        tokio::task::spawn_blocking(|| (Postgres::start().unwrap(), Redis::start().unwrap()))
            .await
            .unwrap();
    let url = pg.create_database("idle").unwrap();
    pg.psql("idle", include_str!("../src/tasks/migrate.sql"))
        .unwrap();
    pg.psql("idle", include_str!("../src/tasks/notify_trigger.sql"))
        .unwrap();
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);

    let args = ServeArgs::with_urls(&url, &redis.url());
    let broker = dispatch_broker::server::start(&args).await.unwrap();
    let endpoint = format!("http://{}", broker.addr);

    // Dispatch latency.
    eprintln!("dispatch latency: {latency_workers} broker workers ...");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    let fleet = broker_fleet(&endpoint, latency_workers, tx, Arc::clone(&stop)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let broker_latency = latencies(&db, &mut rx).await;
    stop_broker_fleet(&stop, fleet).await;

    eprintln!("dispatch latency: {latency_workers} baseline workers ...");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    let fleet = baseline_fleet(&url, &redis.url(), latency_workers, tx, Arc::clone(&stop)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let baseline_latency = latencies(&db, &mut rx).await;
    stop_all(&stop, fleet).await;

    // Scale-up herd: idle query rate.
    eprintln!("herd: {herd_workers} idle broker workers ...");
    let (tx, _rx) = mpsc::unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    let fleet = broker_fleet(&endpoint, herd_workers, tx, Arc::clone(&stop)).await;
    let statements_before = broker.stats.snapshot().postgres_statements
        + broker.background_stats.snapshot().postgres_statements;
    let started = Instant::now();
    let broker_rate = idle_query_rate(&db, HERD_WINDOW).await;
    let statements = broker.stats.snapshot().postgres_statements
        + broker.background_stats.snapshot().postgres_statements
        - statements_before;
    let statement_rate = statements as f64 / started.elapsed().as_secs_f64();
    stop_broker_fleet(&stop, fleet).await;

    eprintln!("herd: {herd_workers} idle baseline workers ...");
    let (tx, _rx) = mpsc::unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    let fleet = baseline_fleet(&url, &redis.url(), herd_workers, tx, Arc::clone(&stop)).await;
    let baseline_rate = idle_query_rate(&db, HERD_WINDOW).await;
    stop_all(&stop, fleet).await;

    println!("| scenario | broker | baseline (Pulp-style polling) | baseline / broker |");
    println!("|---|---:|---:|---:|");
    for (label, p) in [("p50", 0.5), ("p99", 0.99)] {
        let (b, r) = (
            percentile(&broker_latency, p),
            percentile(&baseline_latency, p),
        );
        println!(
            "| dispatch latency {label}, {latency_workers} idle workers, commit to receipt | {} | {} | {:.1}x |",
            ms(b),
            ms(r),
            r.as_secs_f64() / b.as_secs_f64()
        );
    }
    println!(
        "| task-table queries/s, {herd_workers} idle workers | {broker_rate:.1} | {baseline_rate:.1} | {:.1}x |",
        baseline_rate / broker_rate.max(0.01)
    );
    println!(
        "| broker's own Postgres statements/s at idle (all tables, heartbeats included) | {statement_rate:.1} | | |"
    );
    broker.shutdown().await.unwrap();
    drop(redis);
    drop(pg);
}
