//! Lane gauge benchmark: the broker's streamed count against the straightforward reference
//! (load every incomplete task, loop with two sets, as Pulp's `count_waiting_tasks_for_metric`
//! does), in the same process, on the same throwaway PostgreSQL, at 18,000, 100,000 and
//! 1,000,000 incomplete tasks. Mix: 60% on one repository (exclusive) and the rest over 2,000
//! repositories, every task with a shared domain resource (10 domains).
//!
//! Each run times a full pass (the whole queue), then applies one interval's changes (the 200
//! oldest heads of their queues end, 100 waiting tasks anywhere are canceled, 200 new tasks
//! arrive) and times the maintained pass that brings the full pass's counter up to date, then
//! the reference on the changed queue; both counts are checked against the reference.
//!
//! Run: `cargo bench --bench lanes` (add sizes as arguments to choose others). Prints a Markdown
//! table: median of 3 runs, and the process's peak resident memory growth during each run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dispatch_broker::lanes::TRACK_LIMIT;
use dispatch_broker::metrics::Stats;
use dispatch_broker::tasks::{LaneReads, Tasks};
use dispatch_testkit::Postgres;

const RUNS: usize = 3;

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Runs `f`, returning its time and how far the process's peak RSS rose above the RSS before.
async fn measure<T>(f: impl std::future::Future<Output = T>) -> (T, Duration, u64) {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = status_kib("VmRSS:");
    let start = Instant::now();
    let out = f.await;
    let took = start.elapsed();
    let peak = status_kib("VmHWM:");
    (out, took, peak.saturating_sub(before))
}

async fn reference(db: &tokio_postgres::Client) -> u64 {
    dispatch_testkit::reference_lanes(db).await.unwrap()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let sizes: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.replace('_', "").parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![18_000, 100_000, 1_000_000]
    } else {
        sizes
    };
    eprintln!("starting a throwaway PostgreSQL ...");
    let pg = tokio::task::spawn_blocking(Postgres::start)
        .await
        .unwrap()
        .unwrap();
    pg.create_database("bench").unwrap();
    pg.psql("bench", dispatch_broker::tasks::sql::MIGRATE.as_str())
        .unwrap();
    let url = pg.url("bench");
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let tasks = Tasks::connect(
        &url,
        2,
        Duration::from_secs(600),
        Arc::new(Stats::default()),
    )
    .await
    .unwrap();

    println!("| incomplete tasks | lanes | broker: full pass | broker: maintained pass | broker peak RSS growth (full / maintained) | reference (load all) | reference peak RSS growth | ratio: full | ratio: maintained |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut have = 0u64;
    for size in sizes {
        eprintln!("inserting up to {size} tasks ...");
        insert(&db, have + 1, size, "1 hour").await;
        db.batch_execute("VACUUM ANALYZE core_task").await.unwrap();
        have = size;
        let (mut full_times, mut maintained_times, mut reference_times) =
            (Vec::new(), Vec::new(), Vec::new());
        let (mut full_mem, mut maintained_mem, mut reference_mem) = (0, 0, 0);
        let mut lanes = 0;
        for run in 0..RUNS {
            let (counter, took, mem) =
                measure(tasks.count_lanes(Duration::ZERO, TRACK_LIMIT)).await;
            let counter = counter.unwrap();
            assert_eq!(counter.lanes(), reference(&db).await, "full pass");
            full_times.push(took);
            full_mem = full_mem.max(mem);
            // What changes between two passes: the oldest 200 heads end (the lanes workers
            // run), 100 tasks deep in the queue are canceled, 200 new tasks arrive.
            churn(&db, size + run as u64 * 1_000).await;
            let (counter, took, mem) =
                measure(tasks.maintain_lanes(counter, Duration::ZERO, LaneReads::default())).await;
            let counter = counter.unwrap().expect("maintained without a full pass");
            maintained_times.push(took);
            maintained_mem = maintained_mem.max(mem);
            let (reference_lanes, took, mem) = measure(reference(&db)).await;
            assert_eq!(counter.lanes(), reference_lanes, "maintained pass");
            lanes = reference_lanes;
            reference_times.push(took);
            reference_mem = reference_mem.max(mem);
        }
        let (f, m, r) = (
            median(full_times),
            median(maintained_times),
            median(reference_times),
        );
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "| {size} | {lanes} | {:.1} ms | {:.1} ms | {:.1} / {:.1} MiB | {:.1} ms | {:.1} MiB | {:.2}x | {:.1}x |",
            ms(f),
            ms(m),
            full_mem as f64 / 1024.0,
            maintained_mem as f64 / 1024.0,
            ms(r),
            reference_mem as f64 / 1024.0,
            r.as_secs_f64() / f.as_secs_f64(),
            r.as_secs_f64() / m.as_secs_f64(),
        );
    }
}

/// Inserts tasks `from..=to` of the mix, `age` before now.
async fn insert(db: &tokio_postgres::Client, from: u64, to: u64, age: &str) {
    db.batch_execute(&format!(
        "BEGIN; SET LOCAL session_replication_role = replica; \
         INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
         SELECT gen_random_uuid(), clock_timestamp() - interval '{age}', 't', \
                CASE WHEN i % 10 = 0 THEN 'running' ELSE 'waiting' END, \
                CASE WHEN i % 5 < 3 \
                     THEN ARRAY['prn:python.repository:R0', 'shared:prn:core.domain:D' || (i % 10)] \
                     ELSE ARRAY['prn:file.repository:F' || (i % 2000), 'shared:prn:core.domain:D' || (i % 10)] END \
         FROM generate_series({from}, {to}) AS i; COMMIT;"
    ))
    .await
    .unwrap();
}

/// One interval's changes: the 200 oldest heads of their queues end, 100 waiting tasks
/// anywhere are canceled, 200 new tasks arrive (numbered from `next`).
async fn churn(db: &tokio_postgres::Client, next: u64) {
    db.batch_execute(
        "UPDATE core_task SET state = 'completed' WHERE pulp_id IN ( \
             SELECT pulp_id FROM ( \
                 SELECT DISTINCT ON (reserved_resources_record[1]) pulp_id, pulp_created \
                 FROM core_task WHERE state IN ('waiting', 'running') \
                 ORDER BY reserved_resources_record[1], pulp_created, pulp_id) heads \
             ORDER BY pulp_created LIMIT 200); \
         UPDATE core_task SET state = 'canceled' WHERE pulp_id IN ( \
             SELECT pulp_id FROM core_task WHERE state = 'waiting' ORDER BY random() LIMIT 100)",
    )
    .await
    .unwrap();
    insert(db, next + 1, next + 200, "30 minutes").await;
}
