//! Lane gauge benchmark: the broker's streamed count against the straightforward reference
//! (load every incomplete task, loop with two sets, as Pulp's `count_waiting_tasks_for_metric`
//! does), in the same process, on the same throwaway PostgreSQL, at 18,000, 100,000 and
//! 1,000,000 incomplete tasks. Mix: 60% on one repository (exclusive) and the rest over 2,000
//! repositories, every task with a shared domain resource (10 domains).
//!
//! Run: `cargo bench --bench lanes` (add sizes as arguments to choose others). Prints a Markdown
//! table: median of 3 runs, and the process's peak resident memory growth during each run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dispatch_broker::metrics::Stats;
use dispatch_broker::tasks::Tasks;
use dispatch_broker::testkit::Postgres;

const RUNS: usize = 3;
/// Blocked resources the gauge's survey keeps (as the broker does).
const SURVEY: usize = dispatch_broker::lanes::SURVEY_KEEP;

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
    dispatch_broker::testkit::reference_lanes(db).await.unwrap()
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
    pg.psql("bench", include_str!("../src/tasks/migrate.sql"))
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

    println!("| incomplete tasks | lanes | broker (streamed) | broker peak RSS growth | reference (load all) | reference peak RSS growth | time ratio |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    let mut have = 0u64;
    for size in sizes {
        eprintln!("inserting up to {size} tasks ...");
        db.batch_execute(&format!(
            "BEGIN; SET LOCAL session_replication_role = replica; \
             INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), clock_timestamp() - interval '1 hour', 't', \
                    CASE WHEN i % 10 = 0 THEN 'running' ELSE 'waiting' END, \
                    CASE WHEN i % 5 < 3 \
                         THEN ARRAY['prn:python.repository:R0', 'shared:prn:core.domain:D' || (i % 10)] \
                         ELSE ARRAY['prn:file.repository:F' || (i % 2000), 'shared:prn:core.domain:D' || (i % 10)] END \
             FROM generate_series({from}, {to}) AS i; COMMIT;",
            from = have + 1,
            to = size
        ))
        .await
        .unwrap();
        db.batch_execute("VACUUM ANALYZE core_task").await.unwrap();
        have = size;
        let (mut broker_times, mut reference_times) = (Vec::new(), Vec::new());
        let (mut broker_mem, mut reference_mem) = (0, 0);
        let (mut broker_lanes, mut reference_lanes) = (0, 0);
        for _ in 0..RUNS {
            let (lanes, took, mem) =
                measure(async { tasks.lanes(Duration::ZERO, SURVEY).await.map(|s| s.lanes) }).await;
            broker_lanes = lanes.unwrap();
            broker_times.push(took);
            broker_mem = broker_mem.max(mem);
            let (lanes, took, mem) = measure(reference(&db)).await;
            reference_lanes = lanes;
            reference_times.push(took);
            reference_mem = reference_mem.max(mem);
        }
        assert_eq!(broker_lanes, reference_lanes, "the two counts disagree");
        let (b, r) = (median(broker_times), median(reference_times));
        println!(
            "| {size} | {broker_lanes} | {:.1} ms | {:.1} MiB | {:.1} ms | {:.1} MiB | {:.2}x |",
            b.as_secs_f64() * 1e3,
            broker_mem as f64 / 1024.0,
            r.as_secs_f64() * 1e3,
            reference_mem as f64 / 1024.0,
            r.as_secs_f64() / b.as_secs_f64(),
        );
    }
}
