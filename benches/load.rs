//! Load scenarios, broker against the Pulp-style baseline (see `support/fleets.rs`), in the
//! same process on the same throwaway PostgreSQL and Redis.
//!
//! - **Incident** (head-of-line blocking): one repository (R0, domain D1) has N waiting tasks
//!   behind its oldest one, which is running; 200 tasks of four other domains (D2-D5) wait behind
//!   them; 10 workers, tasks take 20 ms; the head finishes after 2 s. Reported for N = 1,000,
//!   17,000 and 100,000: time until every other-domain task is done, worker utilisation until
//!   then, and how long a fetch of an other-domain task took (p50, p99). At 17,000 it also
//!   writes `benches/results/incident.svg`: tasks completed over time per domain, both fleets.
//! - **Throughput**: 20,000 tasks over 2,000 repositories (each also sharing one of four
//!   domains), 32 workers, zero-length tasks: tasks per second end to end (fetch, claim, start,
//!   finish and release) and Postgres statements per task.
//!
//! Run: `cargo bench --bench load` (both), or `-- incident [SIZES...]`, `-- throughput [TASKS]`;
//! `page=N`, `share=N` and `passes=N` set the broker's `--fetch-page`, `--fetch-share` and
//! `--fetch-passes` (e.g. `-- throughput share=0` to compare without shared scans), `workers=N`
//! the throughput scenario's fleet size (32 by default); broker
//! workers fetch with `start` (the grant starts the task, as the baseline's claim does), and
//! `start=0` has them call StartTask after the fetch instead. Prints Markdown tables.

#[path = "support/fleets.rs"]
mod fleets;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use dispatch_broker::config::ServeArgs;
use dispatch_testkit::{Postgres, Redis};
use dispatch_worker::{FinalState, Worker, WorkerConfig};
use fleets::{baseline_fleet, broker_fleet, ms, percentile, ratio, redis_flush, Fleet, Receipt};
use plotters::prelude::*;
use tokio::sync::mpsc;

const INCIDENT_WORKERS: usize = 10;
const INCIDENT_WORK: Duration = Duration::from_millis(20);
const OTHERS: usize = 200;
const OTHER_DOMAINS: usize = 4;
const HEAD_HOLD: Duration = Duration::from_secs(2);
const INCIDENT_WINDOW: Duration = Duration::from_secs(10);
const THROUGHPUT_WORKERS: usize = 32;
const THROUGHPUT_LIMIT: Duration = Duration::from_secs(300);

/// The head of R0: the oldest task, running.
const HEAD: [&str; 2] = ["prn:python.repository:R0", "shared:prn:core.domain:D1"];

struct Setup {
    pg: Postgres,
    redis: Redis,
}

impl Setup {
    async fn start() -> Self {
        eprintln!("starting throwaway PostgreSQL and Redis ...");
        let (pg, redis) =
            tokio::task::spawn_blocking(|| (Postgres::start().unwrap(), Redis::start().unwrap()))
                .await
                .unwrap();
        Setup { pg, redis }
    }

    /// A fresh database with the broker's schema and insert trigger, and a client on it.
    async fn database(&self, name: &str) -> (String, tokio_postgres::Client) {
        let url = self.pg.create_database(name).unwrap();
        self.pg
            .psql(name, dispatch_broker::tasks::sql::MIGRATE.as_str())
            .unwrap();
        self.pg
            .psql(name, include_str!("../src/tasks/notify_trigger.sql"))
            .unwrap();
        let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        redis_flush(&self.redis.url());
        (url, db)
    }
}

/// What one fleet did in one run.
struct Run {
    /// Every task done, in order, with its time since the fleet started.
    done: Vec<(Duration, String)>,
    stats: std::sync::Arc<fleets::FleetStats>,
}

impl Run {
    /// When the last other-domain task was done (None: not all of them within the window).
    fn others_done(&self) -> Option<Duration> {
        let others: Vec<Duration> = self
            .done
            .iter()
            .filter(|(_, n)| n != "D1")
            .map(|(t, _)| *t)
            .collect();
        (others.len() == OTHERS).then(|| others.into_iter().max().unwrap())
    }

    fn others_count(&self) -> usize {
        self.done.iter().filter(|(_, n)| n != "D1").count()
    }
}

/// Collects receipts until `stop_when` says so or `limit` passes; then stops the fleet.
async fn collect(
    fleet: Fleet,
    mut rx: mpsc::UnboundedReceiver<Receipt>,
    started: Instant,
    limit: Duration,
    stop_when: impl Fn(&[(Duration, String)]) -> bool,
) -> Run {
    let mut done = Vec::new();
    let deadline = tokio::time::Instant::from_std(started + limit);
    while !stop_when(&done) {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(r)) => done.push((r.done - started, r.name)),
            _ => break,
        }
    }
    let stats = std::sync::Arc::clone(&fleet.stats);
    fleet.stop().await;
    Run { done, stats }
}

/// Inserts the blocked queue and the other domains' tasks (after the head).
async fn insert_incident(db: &tokio_postgres::Client, blocked: usize) {
    db.batch_execute(&format!(
        "BEGIN; SET LOCAL session_replication_role = replica; \
         INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
         SELECT gen_random_uuid(), clock_timestamp(), 'D1', 'waiting', \
                ARRAY['{}', '{}'] FROM generate_series(1, {blocked}); \
         INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
         SELECT gen_random_uuid(), clock_timestamp(), 'D' || (2 + i % {OTHER_DOMAINS}), 'waiting', \
                ARRAY['prn:file.repository:F' || i, 'shared:prn:core.domain:D' || (2 + i % {OTHER_DOMAINS})] \
         FROM generate_series(1, {OTHERS}) AS i; \
         COMMIT;",
        HEAD[0], HEAD[1]
    ))
    .await
    .unwrap();
    db.batch_execute("VACUUM ANALYZE core_task").await.unwrap();
}

async fn insert_head(db: &tokio_postgres::Client) {
    db.batch_execute(&format!(
        "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
         VALUES (gen_random_uuid(), 'D1', 'waiting', ARRAY['{}', '{}'])",
        HEAD[0], HEAD[1]
    ))
    .await
    .unwrap();
}

/// The incident with broker workers: the head is held by a worker of its own.
/// Broker options given on the command line.
#[derive(Debug, Default)]
struct Tweaks {
    page: Option<i64>,
    share: Option<u64>,
    passes: Option<u64>,
    /// `start=0`: broker workers fetch, then call StartTask (by default the fetch starts it).
    start: Option<bool>,
    /// `workers=N`: the throughput scenario's fleets (by default [`THROUGHPUT_WORKERS`]).
    workers: Option<usize>,
}

fn throughput_workers() -> usize {
    TWEAKS
        .get()
        .and_then(|t| t.workers)
        .unwrap_or(THROUGHPUT_WORKERS)
}

fn start_on_fetch() -> bool {
    TWEAKS.get().and_then(|t| t.start).unwrap_or(true)
}

static TWEAKS: std::sync::OnceLock<Tweaks> = std::sync::OnceLock::new();

fn tweak(args: &mut ServeArgs) {
    if let Some(t) = TWEAKS.get() {
        if let Some(page) = t.page {
            args.fetch.page = page;
        }
        if let Some(share) = t.share {
            args.fetch.share = share;
        }
        if let Some(passes) = t.passes {
            args.fetch.passes = passes;
        }
    }
}

async fn incident_broker(setup: &Setup, blocked: usize) -> Run {
    let (url, db) = setup.database(&format!("incident_broker_{blocked}")).await;
    let mut args = ServeArgs::with_urls(&url, &setup.redis.url());
    args.lanes.interval = Duration::from_secs(3600);
    tweak(&mut args);
    let broker = dispatch_broker::server::start(&args).await.unwrap();
    let endpoint = format!("http://{}", broker.addr);
    insert_head(&db).await;
    let holder = Worker::connect(&endpoint, WorkerConfig::new("head-holder"))
        .await
        .unwrap();
    let head = holder.next_task(Duration::ZERO).await.unwrap().unwrap();
    head.start().await.unwrap();
    insert_incident(&db, blocked).await;
    let (tx, rx) = mpsc::unbounded_channel();
    let started = Instant::now();
    let fleet = broker_fleet(
        &endpoint,
        INCIDENT_WORKERS,
        INCIDENT_WORK,
        start_on_fetch(),
        tx,
    )
    .await;
    let finish_head = tokio::spawn(async move {
        tokio::time::sleep(HEAD_HOLD).await;
        head.finish(FinalState::Completed, None).await.unwrap();
        holder.close().await.unwrap();
    });
    let run = collect(fleet, rx, started, INCIDENT_WINDOW, |_| false).await;
    finish_head.await.unwrap();
    broker.shutdown().await.unwrap();
    run
}

/// The incident with baseline workers: the head is marked running and holds the baseline's
/// locks until it finishes.
async fn incident_baseline(setup: &Setup, blocked: usize) -> Run {
    let (url, db) = setup
        .database(&format!("incident_baseline_{blocked}"))
        .await;
    insert_head(&db).await;
    db.batch_execute("UPDATE core_task SET state = 'running', started_at = now()")
        .await
        .unwrap();
    let pool = deadpool_redis::Config::from_url(setup.redis.url())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let head_locks = fleets::baseline_lock_args(&HEAD.map(String::from));
    let mut conn = pool.get().await.unwrap();
    assert!(fleets::baseline_locks(&mut conn, "head-holder", &head_locks, true).await);
    insert_incident(&db, blocked).await;
    let (tx, rx) = mpsc::unbounded_channel();
    let started = Instant::now();
    let fleet = baseline_fleet(
        &url,
        &setup.redis.url(),
        INCIDENT_WORKERS,
        INCIDENT_WORK,
        tx,
    )
    .await;
    let finish_head = tokio::spawn(async move {
        tokio::time::sleep(HEAD_HOLD).await;
        db.batch_execute("UPDATE core_task SET state = 'completed', finished_at = now() WHERE state = 'running' AND app_lock_id IS NULL")
            .await
            .unwrap();
        fleets::baseline_locks(&mut conn, "head-holder", &head_locks, false).await;
    });
    let run = collect(fleet, rx, started, INCIDENT_WINDOW, |_| false).await;
    finish_head.await.unwrap();
    run
}

/// Busy time of tasks finished by `until`, over the workers' time until then.
fn utilisation_until(run: &Run, until: Duration) -> f64 {
    let finished = run.done.iter().filter(|(t, _)| *t <= until).count();
    let work = finished as f64 * INCIDENT_WORK.as_secs_f64();
    work / (INCIDENT_WORKERS as f64 * until.as_secs_f64())
}

fn others_done(run: &Run) -> String {
    match run.others_done() {
        Some(t) => format!("{:.2} s", t.as_secs_f64()),
        None => format!(
            "not within {} s ({} of {OTHERS} done)",
            INCIDENT_WINDOW.as_secs(),
            run.others_count()
        ),
    }
}

async fn incident(setup: &Setup, sizes: &[usize]) {
    let mut rows = Vec::new();
    for &blocked in sizes {
        eprintln!("incident: {blocked} blocked, broker ...");
        let broker = incident_broker(setup, blocked).await;
        eprintln!("incident: {blocked} blocked, baseline ...");
        let baseline = incident_baseline(setup, blocked).await;
        if blocked == 17_000 {
            plot(
                &broker,
                &baseline,
                Path::new("benches/results/incident.svg"),
            );
        }
        rows.push((blocked, broker, baseline));
    }
    println!("\n### Incident: N tasks of one repository behind its running head, 200 of other domains behind them; {INCIDENT_WORKERS} workers, {} ms tasks, head done after {} s\n", INCIDENT_WORK.as_millis(), HEAD_HOLD.as_secs());
    println!("| blocked | fleet | other domains all done | utilisation until then | other-domain fetch p50 | p99 | empty polls (p50 each) |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for (blocked, broker, baseline) in &rows {
        for (label, run) in [("broker", broker), ("baseline", baseline)] {
            let until = run.others_done().unwrap_or(INCIDENT_WINDOW);
            let fetches = run.stats.fetch_times(|n| n != "D1");
            let empty = run.stats.empty_times();
            println!(
                "| {blocked} | {label} | {} | {:.0}% | {} | {} | {} ({}) |",
                others_done(run),
                utilisation_until(run, until) * 100.0,
                ms(percentile(&fetches, 0.5)),
                ms(percentile(&fetches, 0.99)),
                empty.len(),
                ms(percentile(&empty, 0.5)),
            );
        }
    }
    let ratios: Vec<String> = rows
        .iter()
        .map(|(blocked, broker, baseline)| {
            let b = broker.others_done().map(|d| d.as_secs_f64());
            let r = Some(
                baseline
                    .others_done()
                    .unwrap_or(INCIDENT_WINDOW)
                    .as_secs_f64(),
            );
            if b.is_none() {
                return format!("{blocked}: neither within the window");
            }
            let bound = if baseline.others_done().is_none() {
                "more than "
            } else {
                ""
            };
            format!("{blocked}: {bound}{}", ratio(b, r))
        })
        .collect();
    println!(
        "\nOther domains done, baseline / broker: {}.",
        ratios.join(", ")
    );
    let first = rows.first().and_then(|(_, b, _)| {
        percentile(&b.stats.fetch_times(|n| n != "D1"), 0.5).map(|d| d.as_secs_f64())
    });
    let growth: Vec<String> = rows
        .iter()
        .map(|(blocked, b, _)| {
            let p50 = percentile(&b.stats.fetch_times(|n| n != "D1"), 0.5).map(|d| d.as_secs_f64());
            format!("{blocked}: {}", ratio(first, p50))
        })
        .collect();
    println!(
        "Broker fetch p50 against the smallest queue: {}.",
        growth.join(", ")
    );
}

/// Tasks completed over time per domain, broker left and baseline right.
fn plot(broker: &Run, baseline: &Run, path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let root = SVGBackend::new(path, (1100, 420)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let panels = root.split_evenly((1, 2));
    let top = broker
        .done
        .iter()
        .chain(&baseline.done)
        .fold(BTreeMap::<&str, usize>::new(), |mut m, (_, n)| {
            *m.entry(n.as_str()).or_default() += 1;
            m
        })
        .into_values()
        .max()
        .unwrap_or(1)
        .max(OTHERS / OTHER_DOMAINS);
    for (panel, (title, run)) in panels.iter().zip([
        ("broker (long-poll FetchTask)", broker),
        ("baseline (Pulp-style polling)", baseline),
    ]) {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{title}: 17,000 blocked on R0"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d(0f64..INCIDENT_WINDOW.as_secs_f64(), 0usize..top + 5)
            .unwrap();
        chart
            .configure_mesh()
            .x_desc("seconds since the workers started")
            .y_desc("tasks completed")
            .draw()
            .unwrap();
        let mut per_domain: BTreeMap<&str, Vec<(f64, usize)>> = BTreeMap::new();
        for d in 1..=OTHER_DOMAINS + 1 {
            per_domain.insert(Box::leak(format!("D{d}").into_boxed_str()), vec![(0.0, 0)]);
        }
        for (t, name) in &run.done {
            if let Some(series) = per_domain.get_mut(name.as_str()) {
                let n = series.last().map(|p| p.1).unwrap_or(0) + 1;
                series.push((t.as_secs_f64(), n));
            }
        }
        for (i, (domain, mut series)) in per_domain.into_iter().enumerate() {
            let last = series.last().map(|p| p.1).unwrap_or(0);
            series.push((INCIDENT_WINDOW.as_secs_f64(), last));
            let color = Palette99::pick(i).to_rgba();
            let label = if domain == "D1" {
                "D1 (repository R0)".to_owned()
            } else {
                domain.to_owned()
            };
            chart
                .draw_series(LineSeries::new(series, color.stroke_width(2)))
                .unwrap()
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .unwrap();
    }
    root.present().unwrap();
    eprintln!("wrote {}", path.display());
}

/// `tasks` over 2,000 repositories, each task also sharing one of four domains.
async fn insert_throughput(db: &tokio_postgres::Client, tasks: usize) {
    db.batch_execute(&format!(
        "BEGIN; SET LOCAL session_replication_role = replica; \
         INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
         SELECT gen_random_uuid(), clock_timestamp(), 'T', 'waiting', \
                ARRAY['prn:file.repository:R' || (random() * 1999)::int, \
                      'shared:prn:core.domain:D' || (i % 4)] \
         FROM generate_series(1, {tasks}) AS i; \
         COMMIT;"
    ))
    .await
    .unwrap();
    db.batch_execute("VACUUM ANALYZE core_task").await.unwrap();
}

/// The rows Postgres has read in `db`'s database so far (`pg_stat_database`: returned and
/// fetched, every session's). With `alone`, first waits (up to 15 s) until no other session is
/// connected to it: a session's counts are published when it ends (a busy one's about once a
/// second, an idle one's up to 10 s late).
async fn rows_read(db: &tokio_postgres::Client, alone: bool) -> u64 {
    if alone {
        for _ in 0..150 {
            let others: i64 = db
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if others == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // This session's own counts (the insert's) are published once it is idle.
    db.batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    let rows: i64 = db
        .query_one(
            "SELECT (tup_returned + tup_fetched)::bigint FROM pg_stat_database \
             WHERE datname = current_database()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    u64::try_from(rows).unwrap_or(0)
}

struct Throughput {
    tasks: usize,
    took: Duration,
    statements: u64,
    /// The broker's Redis calls (the baseline's are not counted).
    redis_calls: Option<u64>,
    /// The broker's passes over the queue.
    passes: Option<u64>,
    /// Tasks the broker's passes handed to other waiting calls than their own.
    shared: Option<u64>,
    /// Rows Postgres read during the run (every session: the fleet's, and for the broker its
    /// background work), from the end of the insert until every session had ended.
    rows_read: u64,
}

impl Throughput {
    fn rate(&self) -> f64 {
        self.tasks as f64 / self.took.as_secs_f64()
    }
}

async fn throughput_broker(setup: &Setup, tasks: usize) -> Throughput {
    let (url, db) = setup.database("throughput_broker").await;
    let mut args = ServeArgs::with_urls(&url, &setup.redis.url());
    args.lanes.interval = Duration::from_secs(3600);
    tweak(&mut args);
    let broker = dispatch_broker::server::start(&args).await.unwrap();
    let endpoint = format!("http://{}", broker.addr);
    insert_throughput(&db, tasks).await;
    let rows_before = rows_read(&db, false).await;
    let (tx, rx) = mpsc::unbounded_channel();
    let totals = || {
        let (rpc, background) = (broker.stats.snapshot(), broker.background_stats.snapshot());
        (
            rpc.postgres_statements + background.postgres_statements,
            rpc.redis_calls + background.redis_calls,
            rpc.fetch_passes,
            rpc.shared,
        )
    };
    let before = totals();
    let started = Instant::now();
    let fleet = broker_fleet(
        &endpoint,
        throughput_workers(),
        Duration::ZERO,
        start_on_fetch(),
        tx,
    )
    .await;
    let run = collect(fleet, rx, started, THROUGHPUT_LIMIT, |d| d.len() >= tasks).await;
    let took = run.done.last().map(|d| d.0).unwrap_or(THROUGHPUT_LIMIT);
    let after = totals();
    broker.shutdown().await.unwrap();
    Throughput {
        tasks: run.done.len(),
        took,
        statements: after.0 - before.0,
        redis_calls: Some(after.1 - before.1),
        passes: Some(after.2 - before.2),
        shared: Some(after.3 - before.3),
        rows_read: rows_read(&db, true).await.saturating_sub(rows_before),
    }
}

async fn throughput_baseline(setup: &Setup, tasks: usize) -> Throughput {
    let (url, db) = setup.database("throughput_baseline").await;
    insert_throughput(&db, tasks).await;
    let rows_before = rows_read(&db, false).await;
    let (tx, rx) = mpsc::unbounded_channel();
    let started = Instant::now();
    let fleet = baseline_fleet(
        &url,
        &setup.redis.url(),
        throughput_workers(),
        Duration::ZERO,
        tx,
    )
    .await;
    let stats = std::sync::Arc::clone(&fleet.stats);
    let run = collect(fleet, rx, started, THROUGHPUT_LIMIT, |d| d.len() >= tasks).await;
    Throughput {
        tasks: run.done.len(),
        took: run.done.last().map(|d| d.0).unwrap_or(THROUGHPUT_LIMIT),
        statements: stats.statements.load(std::sync::atomic::Ordering::Relaxed),
        redis_calls: None,
        passes: None,
        shared: None,
        rows_read: rows_read(&db, true).await.saturating_sub(rows_before),
    }
}

async fn throughput(setup: &Setup, tasks: usize) {
    eprintln!("throughput: {tasks} tasks, broker ...");
    let broker = throughput_broker(setup, tasks).await;
    eprintln!("throughput: {tasks} tasks, baseline ...");
    let baseline = throughput_baseline(setup, tasks).await;
    println!(
        "\n### Throughput: {tasks} zero-length tasks over 2,000 repositories, {} workers\n",
        throughput_workers()
    );
    println!("| fleet | tasks done | time | tasks/s | Postgres statements / task | Redis calls / task | rows read / task | passes / task | handed out by a shared pass |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (label, t) in [("broker", &broker), ("baseline", &baseline)] {
        let per_task = |n: Option<u64>| match n {
            Some(n) => format!("{:.1}", n as f64 / t.tasks.max(1) as f64),
            None => "-".into(),
        };
        let shared = match t.shared {
            Some(n) => format!("{:.0}%", 100.0 * n as f64 / t.tasks.max(1) as f64),
            None => "-".into(),
        };
        println!(
            "| {label} | {} | {:.2} s | {:.0} | {} | {} | {} | {} | {shared} |",
            t.tasks,
            t.took.as_secs_f64(),
            t.rate(),
            per_task(Some(t.statements)),
            per_task(t.redis_calls),
            per_task(Some(t.rows_read)),
            per_task(t.passes),
        );
    }
    println!(
        "\nTasks/s, broker / baseline: {}.",
        ratio(Some(baseline.rate()), Some(broker.rate()))
    );
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    // `page=N` and `share=N` set the broker's --fetch-page and --fetch-share (to compare).
    let mut tweaks = Tweaks::default();
    for arg in &args {
        match arg.split_once('=') {
            Some(("page", n)) => tweaks.page = n.parse().ok(),
            Some(("share", n)) => tweaks.share = n.parse().ok(),
            Some(("passes", n)) => tweaks.passes = n.parse().ok(),
            Some(("start", n)) => tweaks.start = Some(n != "0"),
            Some(("workers", n)) => tweaks.workers = n.parse().ok(),
            _ => {}
        }
    }
    TWEAKS.set(tweaks).unwrap();
    let args: Vec<String> = args.into_iter().filter(|a| !a.contains('=')).collect();
    let numbers: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let which = args.iter().find(|a| a.parse::<usize>().is_err()).cloned();
    let setup = Setup::start().await;
    if which.as_deref() != Some("throughput") {
        let sizes = if which.is_some() && !numbers.is_empty() {
            numbers.clone()
        } else {
            vec![1_000, 17_000, 100_000]
        };
        incident(&setup, &sizes).await;
    }
    if which.as_deref() != Some("incident") {
        let tasks = match (&which, numbers.first()) {
            (Some(_), Some(&n)) => n,
            _ => 20_000,
        };
        throughput(&setup, tasks).await;
    }
}
