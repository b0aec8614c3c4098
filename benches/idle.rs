//! What waiting costs: an idle fleet, broker against a baseline, in the same process on the same
//! throwaway PostgreSQL and Redis.
//!
//! - **Dispatch latency**: 100 idle workers; 300 tasks inserted one at a time; time from the
//!   insert's commit to a worker holding the task (p50, p99).
//! - **Burst**: the same 100 idle workers; 100 tasks inserted in one statement; time from the
//!   commit to the last worker holding its task (each task takes 3 s, so nobody polls again
//!   meanwhile), and the broker's passes over the queue for it, with shared scans (`--fetch-share 64`, the default) and without (`--fetch-share 0`).
//! - **Scale-up herd**: 500 idle workers, measured for 32 s (a long poll's 30 s and more) after 10 s to settle (heartbeats every third of the 30 s TTL, the
//!   libraries' default); per second at idle: task-table queries (`pg_stat_user_tables` scans of
//!   `core_task`), Postgres transactions and rows read (`pg_stat_database`).
//!
//! Broker workers use the crate's worker library and long-poll FetchTask. The baseline does what
//! Pulp's Redis worker does today: every worker queries the head of the task table itself (FIFO,
//! batches of 20), skips conflicts, tries the Redis lock, claims, and sleeps workers x 10 ms
//! (+ 0.5-1.5 ms jitter) when it finds nothing.
//!
//! Run: `cargo bench --bench idle` (or `-- LATENCY_WORKERS HERD_WORKERS`). Prints a Markdown table.

#[path = "support/fleets.rs"]
mod fleets;

use std::time::{Duration, Instant};

use dispatch_broker::config::ServeArgs;
use dispatch_testkit::{Postgres, Redis};
use fleets::{baseline_fleet, broker_fleet, ms, percentile, ratio, Receipt};
use tokio::sync::mpsc;
use uuid::Uuid;

/// Tasks of the dispatch-latency run: enough that its p99 is not its slowest one.
const TASKS: usize = 300;
/// Longer than a long poll (30 s): every worker's call ends and is made again within it.
const HERD_WINDOW: Duration = Duration::from_secs(32);
/// How long an idle fleet settles before its window (its workers' first heartbeats and long polls
/// go by, the broker's connections have prepared its statements).
const HERD_SETTLE: Duration = Duration::from_secs(10);
/// How long each task of the burst takes (longer than the burst).
const BURST_WORK: Duration = Duration::from_secs(3);

/// What the database did so far, as the statistics views count it: scans of core_task
/// (sequential and index), transactions (committed and rolled back), rows read (returned by
/// scans and fetched by index).
async fn counted(db: &tokio_postgres::Client) -> [i64; 3] {
    db.batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .unwrap();
    let row = db
        .query_one(
            "SELECT (SELECT (coalesce(seq_scan, 0) + coalesce(idx_scan, 0))::bigint \
                     FROM pg_stat_user_tables WHERE relname = 'core_task'), \
                    (xact_commit + xact_rollback)::bigint, (tup_returned + tup_fetched)::bigint \
             FROM pg_stat_database WHERE datname = current_database()",
            &[],
        )
        .await
        .unwrap();
    [row.get(0), row.get(1), row.get(2)]
}

/// Per second while a fleet idles: task-table queries, transactions, rows read.
#[derive(Debug, Clone, Copy)]
struct Idle {
    scans: f64,
    transactions: f64,
    rows: f64,
    /// The broker's own Postgres statements (its counters), when a broker is given.
    statements: f64,
}

/// What the database does per second over `window` while the fleet idles, after it settled
/// (the bench's own two reads of the statistics included); and `broker`'s own statements.
async fn idle_rates(
    db: &tokio_postgres::Client,
    window: Duration,
    broker: Option<&dispatch_broker::server::Running>,
) -> Idle {
    let statements = || {
        broker.map_or(0, |b| {
            b.stats.snapshot().postgres_statements
                + b.background_stats.snapshot().postgres_statements
        })
    };
    tokio::time::sleep(HERD_SETTLE).await;
    let before = counted(db).await;
    let (statements_before, started) = (statements(), Instant::now());
    tokio::time::sleep(window).await;
    let statements = (statements() - statements_before) as f64 / started.elapsed().as_secs_f64();
    // Statistics reach the shared counters when a backend flushes them (about every second).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = counted(db).await;
    let per_second = |i: usize| (after[i] - before[i]) as f64 / (window.as_secs_f64() + 1.5);
    Idle {
        scans: per_second(0),
        transactions: per_second(1),
        rows: per_second(2),
        statements,
    }
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
            let receipt = tokio::time::timeout(Duration::from_secs(30), receipts.recv())
                .await
                .expect("a worker received the task")
                .unwrap();
            if receipt.id == id {
                out.push(receipt.received.saturating_duration_since(committed));
                break;
            }
        }
    }
    out.sort();
    out
}

/// Inserts `n` tasks in one statement; returns the time from its commit to the last receipt.
async fn burst(
    db: &tokio_postgres::Client,
    receipts: &mut mpsc::UnboundedReceiver<Receipt>,
    n: usize,
) -> Duration {
    while receipts.try_recv().is_ok() {}
    let tag = Uuid::new_v4().to_string();
    let rows = db
        .query(
            "INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), now() + i * interval '1 us', 'burst', 'waiting', \
                    ARRAY['prn:file.repository:B' || i || '-' || $1] \
             FROM generate_series(1, $2::int) AS i RETURNING pulp_id",
            &[&tag, &(n as i32)],
        )
        .await
        .unwrap();
    let committed = Instant::now();
    let mut ids: std::collections::HashSet<Uuid> = rows.iter().map(|r| r.get(0)).collect();
    let mut last = committed;
    while !ids.is_empty() {
        let receipt = tokio::time::timeout(Duration::from_secs(30), receipts.recv())
            .await
            .expect("every task of the burst was received")
            .unwrap();
        if ids.remove(&receipt.id) {
            last = last.max(receipt.received);
        }
    }
    last.saturating_duration_since(committed)
}

/// A burst against a broker fleet: (time to the last receipt, passes, tasks handed out by
/// shared passes).
async fn broker_burst(
    broker: &dispatch_broker::server::Running,
    db: &tokio_postgres::Client,
    workers: usize,
) -> (Duration, u64, u64) {
    let endpoint = format!("http://{}", broker.addr);
    let (tx, mut rx) = mpsc::unbounded_channel();
    // Each task takes longer than the burst, so no worker polls again while it is measured.
    let fleet = broker_fleet(&endpoint, workers, BURST_WORK, true, tx).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = broker.stats.snapshot();
    let took = burst(db, &mut rx, workers).await;
    let spent = broker.stats.snapshot() - before;
    fleet.stop().await;
    (took, spent.fetch_passes, spent.shared)
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
    pg.psql("idle", dispatch_broker::tasks::sql::MIGRATE.as_str())
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
    let fleet = broker_fleet(&endpoint, latency_workers, Duration::ZERO, true, tx).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let broker_latency = latencies(&db, &mut rx).await;
    fleet.stop().await;

    eprintln!("dispatch latency: {latency_workers} baseline workers ...");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let fleet = baseline_fleet(&url, &redis.url(), latency_workers, Duration::ZERO, tx).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let baseline_latency = latencies(&db, &mut rx).await;
    fleet.stop().await;

    // Burst: as many tasks at once as there are idle workers.
    eprintln!("burst: {latency_workers} tasks to {latency_workers} idle broker workers ...");
    let shared_burst = broker_burst(&broker, &db, latency_workers).await;
    let mut unshared_args = ServeArgs::with_urls(&url, &redis.url());
    unshared_args.fetch.share = 0;
    let unshared = dispatch_broker::server::start(&unshared_args)
        .await
        .unwrap();
    eprintln!("burst: the same without shared scans ...");
    let unshared_burst = broker_burst(&unshared, &db, latency_workers).await;
    unshared.shutdown().await.unwrap();
    eprintln!("burst: {latency_workers} baseline workers ...");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let fleet = baseline_fleet(&url, &redis.url(), latency_workers, BURST_WORK, tx).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let baseline_burst = burst(&db, &mut rx, latency_workers).await;
    fleet.stop().await;

    // Scale-up herd: idle query rate.
    eprintln!("herd: {herd_workers} idle broker workers ...");
    let (tx, _rx) = mpsc::unbounded_channel();
    let fleet = broker_fleet(&endpoint, herd_workers, Duration::ZERO, true, tx).await;
    let broker_idle = idle_rates(&db, HERD_WINDOW, Some(&broker)).await;
    fleet.stop().await;

    eprintln!("herd: {herd_workers} idle baseline workers ...");
    let (tx, _rx) = mpsc::unbounded_channel();
    let fleet = baseline_fleet(&url, &redis.url(), herd_workers, Duration::ZERO, tx).await;
    let baseline_idle = idle_rates(&db, HERD_WINDOW, None).await;
    fleet.stop().await;

    println!("| scenario | broker | baseline (Pulp-style polling) | baseline / broker |");
    println!("|---|---:|---:|---:|");
    for (label, p) in [("p50", 0.5), ("p99", 0.99)] {
        let (b, r) = (
            percentile(&broker_latency, p),
            percentile(&baseline_latency, p),
        );
        println!(
            "| dispatch latency {label}, {latency_workers} idle workers, commit to receipt | {} | {} | {} |",
            ms(b),
            ms(r),
            ratio(b.map(|d| d.as_secs_f64()), r.map(|d| d.as_secs_f64()))
        );
    }
    let secs = |d: Duration| Some(d.as_secs_f64());
    println!(
        "| burst of {latency_workers} tasks, {latency_workers} idle workers, commit to last receipt | {} | {} | {} |",
        ms(Some(shared_burst.0)),
        ms(Some(baseline_burst)),
        ratio(secs(shared_burst.0), secs(baseline_burst))
    );
    println!(
        "| the same burst, broker passes over the queue (tasks handed out by a shared pass) | {} ({}) | | |",
        shared_burst.1, shared_burst.2
    );
    println!(
        "| the same burst without shared scans (`--fetch-share 0`): time, passes | {}, {} | | |",
        ms(Some(unshared_burst.0)),
        unshared_burst.1
    );
    for (what, b, r) in [
        (
            "task-table queries/s",
            broker_idle.scans,
            baseline_idle.scans,
        ),
        (
            "Postgres transactions/s (all sessions, heartbeats included)",
            broker_idle.transactions,
            baseline_idle.transactions,
        ),
        (
            "rows read/s (all sessions)",
            broker_idle.rows,
            baseline_idle.rows,
        ),
    ] {
        println!(
            "| {what}, {herd_workers} idle workers | {b:.1} | {r:.1} | {:.1}x |",
            r / b.max(0.01)
        );
    }
    println!(
        "| broker's own Postgres statements/s at idle (all tables, heartbeats included) | {:.1} | | |",
        broker_idle.statements
    );
    broker.shutdown().await.unwrap();
    drop(redis);
    drop(pg);
}
