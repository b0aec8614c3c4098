//! The scale-up storm: a fleet working down a backlog grows twentyfold within a second, broker
//! against the Pulp-style baseline (see `support/fleets.rs`), in the same process on the same
//! throwaway PostgreSQL and Redis.
//!
//! Backlog: repository B0's head task runs (held by a worker that finishes it at the end); 60,000
//! ready tasks wait on 6,000 other repositories (ten each, each task also sharing one of four
//! domains), and 17,000 more on B0, blocked behind its head. Tasks take no time. 25 workers
//! start; 6 s later 475 more join (all connecting at once); the backlog is worked down; then the
//! 500 workers idle for 20 s after 10 s to settle. Broker workers long-poll with `start` (30 s)
//! and heartbeat every 10 s, the libraries' defaults; the broker
//! runs with its defaults (lane gauge every 15 s, pools of 16 connections). A separate probe
//! calls FetchTask with `wait` 0 every 50 ms (for the baseline: one poll of the table), and
//! finishes what it gets.
//!
//! Sampled every second: tasks done, Postgres statements (the broker's own counters; the
//! baseline's workers count theirs), transactions and rows read (`pg_stat_database`, every
//! session but the sampler's, whose one statement a second is taken off), connections open to
//! the database. Backends publish their statistics about once a second, so the database's
//! figures lag the others by up to a second at a phase's edge.
//!
//! Rows read are also broken down by table and index (`pg_stat_all_tables`,
//! `pg_stat_all_indexes`), per task done while the first 25 work and from the join to the
//! backlog's end.
//!
//! The broker runs on a runtime of its own (two threads, this machine's cores) and the probe on
//! a thread of its own, as separate processes would run them; the fleet's clients share the
//! bench's runtime, as the one client process did.
//!
//! At the end every ready task must be completed exactly once (none left, none run twice).
//!
//! Then the storm once more with faults (broker only): two replicas, run as the real binary,
//! share the fleet; replica B is killed (SIGKILL) 2 s after the join began and started again 1 s
//! later, and Redis is paused for 5 s (shorter than the leases' TTL) 4 s after that. Every ready
//! task must still be done exactly once: grants lost with B are handed back by the workers'
//! heartbeats (undelivered grants).
//!
//! Fleet size alone: a control run of the broker's storm in which the first 25 work the whole
//! backlog down (nobody joins), set against the storm from the join to the backlog's end: the
//! same depth of the backlog (a readiness look-up reads a repository's tasks, done ones
//! included until vacuumed, so later tasks cost more rows whatever the fleet).
//!
//! Run: `cargo bench --bench storm` (both fleets, the control run, then the faults), `-- broker`
//! (the broker's storm and the control run) or `-- faults`. Prints Markdown tables and writes `benches/results/storm.svg`
//! (tasks/s and Postgres statements/s over the storm).

#[path = "support/fleets.rs"]
mod fleets;

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dispatch_broker::config::ServeArgs;
use dispatch_testkit::{Postgres, Redis, Replica};
use dispatch_worker::{FinalState, Worker, WorkerConfig};
use fleets::{
    baseline_finish, baseline_fleet_counted, baseline_locks, baseline_poll, broker_fleet,
    percentile, redis_flush, BaselineDb, Fleet, FleetStats, Receipt,
};
use plotters::prelude::*;
use tokio::sync::mpsc;
use uuid::Uuid;

/// At about 2,500 tasks/s, 20,000 would be done before the joining workers had settled.
const READY: usize = 60_000;
/// Ten tasks per repository, as in 20,000 over 2,000: a readiness look-up reads a repository's
/// tasks, done ones included, so more per repository would read more per task as the backlog
/// goes down, whatever the fleet.
const RESOURCES: usize = 6_000;
const BLOCKED: usize = 17_000;
const FIRST: usize = 25;
const JOINING: usize = 475;
/// When the 475 start joining, after the first 25 started.
const JOIN_AT: Duration = Duration::from_secs(6);
/// The joining phase measured.
const JOINING_WINDOW: Duration = Duration::from_secs(3);
/// After the backlog, before the idle window: Postgres publishes the counts of a backend that
/// went idle up to 10 s late.
const IDLE_SETTLE: Duration = Duration::from_secs(12);
/// Longer than a long poll (30 s): every worker's call ends and is made again within it.
const IDLE_WINDOW: Duration = Duration::from_secs(32);
const PROBE_EVERY: Duration = Duration::from_millis(50);
/// The backlog must be done by then.
const LIMIT: Duration = Duration::from_secs(300);
const SAMPLE_EVERY: Duration = Duration::from_secs(1);
const HEAD: &str = "prn:file.repository:B0";

/// One of a sample's counts.
type Field = fn(&Sample) -> f64;

/// The fleet's counts so far: Postgres statements and Redis calls.
type Counters = Arc<dyn Fn() -> (u64, u64) + Send + Sync>;

/// Cumulative counts at one moment of the storm.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    /// Seconds since the storm began.
    at: f64,
    /// Ready tasks done.
    done: f64,
    /// The fleet's Postgres statements (the broker's counters, or the baseline workers').
    statements: f64,
    /// The broker's Redis calls (0 for the baseline).
    redis: f64,
    /// Postgres transactions, every session but the sampler's.
    transactions: f64,
    /// Rows read (returned and fetched), every session.
    rows: f64,
    /// Connections open to the database now (not a count).
    connections: f64,
}

/// One probe call: when it started (since the storm began) and how long it took (failed calls
/// too: they count in the errors).
#[derive(Debug, Clone, Copy)]
struct Probe {
    at: Duration,
    took: Duration,
}

/// What one fleet's storm measured.
struct Storm {
    label: &'static str,
    samples: Vec<Sample>,
    /// How long the 475 took to connect.
    joined_in: Duration,
    /// When the last ready task was done.
    backlog_done: Duration,
    /// The idle window.
    idle: (Duration, Duration),
    probes: Vec<Probe>,
    /// Failed calls: workers' and the probe's.
    errors: u64,
    /// Tasks done, and tasks done more than once.
    done: usize,
    twice: usize,
    /// Ready tasks the database still has incomplete at the end.
    left: i64,
    by_relation: ByRelation,
}

impl Storm {
    /// Linear interpolation of the samples at `t` seconds.
    fn at(&self, t: f64) -> Sample {
        let s = &self.samples;
        let i = s.partition_point(|x| x.at <= t);
        if i == 0 {
            return s[0];
        }
        if i == s.len() {
            return s[s.len() - 1];
        }
        let (a, b) = (s[i - 1], s[i]);
        let f = (t - a.at) / (b.at - a.at);
        let mix = |x: f64, y: f64| x + (y - x) * f;
        Sample {
            at: t,
            done: mix(a.done, b.done),
            statements: mix(a.statements, b.statements),
            redis: mix(a.redis, b.redis),
            transactions: mix(a.transactions, b.transactions),
            rows: mix(a.rows, b.rows),
            connections: b.connections,
        }
    }

    /// Per-second figures of the window [from, to).
    fn phase(&self, from: Duration, to: Duration) -> Option<Phase> {
        let (a, b) = (from.as_secs_f64(), to.as_secs_f64());
        if b - a < 0.5 {
            return None;
        }
        let (x, y) = (self.at(a), self.at(b));
        let per_s = |f: Field| (f(&y) - f(&x)) / (b - a);
        let connections = self
            .samples
            .iter()
            .filter(|s| s.at >= a && s.at <= b)
            .map(|s| s.connections)
            .fold(0.0, f64::max);
        let mut probes: Vec<Duration> = self
            .probes
            .iter()
            .filter(|p| p.at >= from && p.at < to)
            .map(|p| p.took)
            .collect();
        probes.sort();
        Some(Phase {
            tasks: per_s(|s| s.done),
            statements: per_s(|s| s.statements),
            redis: per_s(|s| s.redis),
            transactions: per_s(|s| s.transactions),
            rows: per_s(|s| s.rows),
            connections,
            probe_p50: percentile(&probes, 0.5),
            probe_p99: percentile(&probes, 0.99),
        })
    }

    /// The per-second rate of a count, second by second from the start.
    fn rates(&self, f: Field) -> Vec<(f64, f64)> {
        self.samples
            .windows(2)
            .map(|w| (w[1].at, (f(&w[1]) - f(&w[0])) / (w[1].at - w[0].at)))
            .collect()
    }

    /// How long after the join started throughput held at 90% of the 500 workers' median
    /// rate for good.
    fn steady_after(&self) -> Option<Duration> {
        let rates = self.rates(|s| s.done);
        let join = (JOIN_AT + JOINING_WINDOW).as_secs_f64();
        let end = self.backlog_done.as_secs_f64();
        let mut full: Vec<f64> = rates
            .iter()
            .filter(|(t, _)| *t > join && *t < end)
            .map(|r| r.1)
            .collect();
        if full.is_empty() {
            return None;
        }
        full.sort_by(f64::total_cmp);
        let steady = full[full.len() / 2] * 0.9;
        let after_join: Vec<&(f64, f64)> = rates
            .iter()
            .filter(|(t, _)| *t > JOIN_AT.as_secs_f64() && *t < end)
            .collect();
        // (None when even the last full second was below: never steady.)
        let last_below = after_join.iter().rposition(|(_, r)| *r < steady);
        let first_steady = match last_below {
            Some(i) => after_join.get(i + 1)?.0,
            None => after_join.first()?.0,
        };
        // A sample closes the second before it: the steady second began a second earlier.
        Some(Duration::from_secs_f64(
            (first_steady - 1.0 - JOIN_AT.as_secs_f64()).max(0.0),
        ))
    }
}

/// A phase's figures: per second, but connections (the most open at once) and the probe's.
struct Phase {
    tasks: f64,
    statements: f64,
    redis: f64,
    transactions: f64,
    rows: f64,
    connections: f64,
    probe_p50: Option<Duration>,
    probe_p99: Option<Duration>,
}

struct Setup {
    pg: Postgres,
    redis: Redis,
}

async fn connect(url: &str, name: &str) -> tokio_postgres::Client {
    let mut config: tokio_postgres::Config = url.parse().unwrap();
    config.application_name(name);
    let (client, conn) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

impl Setup {
    /// A fresh database with the broker's schema and insert trigger, holding the backlog; its
    /// URL, a client on it and the id of B0's head task.
    async fn database(&self, name: &str) -> (String, tokio_postgres::Client, Uuid) {
        let url = self.pg.create_database(name).unwrap();
        self.pg
            .psql(name, dispatch_broker::tasks::sql::MIGRATE.as_str())
            .unwrap();
        self.pg
            .psql(name, include_str!("../src/tasks/notify_trigger.sql"))
            .unwrap();
        redis_flush(&self.redis.url());
        let db = connect(&url, "storm-bench").await;
        let head = Uuid::new_v4();
        db.batch_execute(&format!(
            "BEGIN; SET LOCAL session_replication_role = replica; \
             INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
             VALUES ('{head}', clock_timestamp(), 'head', 'waiting', \
                     ARRAY['{HEAD}', 'shared:prn:core.domain:D0']); \
             INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), clock_timestamp(), 'ready', 'waiting', \
                    ARRAY['prn:file.repository:R' || (i % {RESOURCES}), \
                          'shared:prn:core.domain:D' || (i % 4)] \
             FROM generate_series(1, {READY}) AS i; \
             INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), clock_timestamp(), 'blocked', 'waiting', \
                    ARRAY['{HEAD}', 'shared:prn:core.domain:D0'] \
             FROM generate_series(1, {BLOCKED}); \
             COMMIT;"
        ))
        .await
        .unwrap();
        db.batch_execute("VACUUM ANALYZE core_task").await.unwrap();
        (url, db, head)
    }
}

/// Runs `make`'s future on a thread and runtime of its own, as a separate process would run it:
/// the probe's calls then wait for the machine, not behind the fleet's 500 clients on the
/// bench's runtime.
fn on_own_thread<F, Fut, T>(make: F) -> tokio::sync::oneshot::Receiver<T>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
    T: Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _ = tx.send(runtime.block_on(make()));
    });
    rx
}

/// Samples the counters every second until `stop`.
fn sampler(
    url: String,
    started: Instant,
    done: Arc<AtomicU64>,
    counters: Counters,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Sample>> {
    tokio::spawn(async move {
        let db = connect(&url, "storm-sampler").await;
        // Prepared once: each sample is then one transaction (its end also drops the statistics
        // snapshot), which is taken off the count.
        let statement = db
            .prepare(
                "SELECT (xact_commit + xact_rollback)::float8, \
                        (tup_returned + tup_fetched)::float8, \
                        (SELECT count(*) FROM pg_stat_activity a \
                         WHERE a.datname = current_database() \
                           AND a.backend_type = 'client backend' \
                           AND coalesce(a.application_name, '') NOT LIKE 'storm-%')::float8 \
                 FROM pg_stat_database WHERE datname = current_database()",
            )
            .await
            .unwrap();
        let mut out = Vec::new();
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut own = 0.0;
        while !stop.load(Ordering::SeqCst) {
            tick.tick().await;
            let row = db.query_one(&statement, &[]).await.unwrap();
            let at = started.elapsed().as_secs_f64();
            let (statements, redis) = counters();
            out.push(Sample {
                at,
                done: done.load(Ordering::Relaxed) as f64,
                statements: statements as f64,
                redis: redis as f64,
                transactions: row.get::<_, f64>(0) - own,
                rows: row.get(1),
                connections: row.get(2),
            });
            own += 1.0;
        }
        out
    })
}

/// Counts receipts of ready tasks (a worker ran the task; its finish may still be retried in the
/// background) into `done`, each task once; returns (tasks run, tasks run twice). The database
/// says at the end whether every one was finished (`left`).
fn tally(
    mut rx: mpsc::UnboundedReceiver<Receipt>,
    done: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<(usize, usize)> {
    tokio::spawn(async move {
        let mut seen = HashSet::new();
        let mut twice = 0;
        while let Some(r) = rx.recv().await {
            if r.name == "ready" {
                if seen.insert(r.id) {
                    done.fetch_add(1, Ordering::Relaxed);
                } else {
                    twice += 1;
                }
            }
        }
        (seen.len(), twice)
    })
}

/// Waits until `done` reaches the backlog (or the limit, which is said); returns when.
async fn backlog_done(done: &AtomicU64, started: Instant) -> Duration {
    while done.load(Ordering::Relaxed) < READY as u64 && started.elapsed() < LIMIT {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if done.load(Ordering::Relaxed) < READY as u64 {
        eprintln!(
            "  the backlog was not done within {} s: {} of {READY} tasks",
            LIMIT.as_secs(),
            done.load(Ordering::Relaxed)
        );
    }
    started.elapsed()
}

/// The ready tasks the database still has incomplete.
async fn left(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT count(*) FROM core_task WHERE name = 'ready' AND state <> 'completed'",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// A storm under way, its first 25 workers started: what runs beside the fleet.
struct Course {
    started: Instant,
    /// Ready tasks run so far.
    done: Arc<AtomicU64>,
    /// Stops the probe and the sampler.
    stop: Arc<AtomicBool>,
    probe: tokio::sync::oneshot::Receiver<Vec<Probe>>,
    probe_stats: Arc<FleetStats>,
    samples: tokio::task::JoinHandle<Vec<Sample>>,
    tally: tokio::task::JoinHandle<(usize, usize)>,
    /// The database, for the rows read by relation.
    url: String,
    /// Whether the fleet idles after the backlog (the control run does not).
    idles: bool,
}

/// What a storm measured, but its label and what the database has left.
struct Measured {
    samples: Vec<Sample>,
    joined_in: Duration,
    backlog_done: Duration,
    idle: (Duration, Duration),
    probes: Vec<Probe>,
    errors: u64,
    done: usize,
    twice: usize,
    by_relation: ByRelation,
}

/// Rows read by relation (`pg_stat_all_tables` and `pg_stat_all_indexes`, every session) per
/// task done: while the first 25 work, from the join to the backlog's end, and over both; most
/// first.
#[derive(Default)]
struct ByRelation(Vec<(String, [f64; 3])>);

impl ByRelation {
    /// The counts now: for each table, rows read by sequential scans and live rows fetched
    /// through its indexes; for each index, entries read.
    async fn counts(url: &str) -> Vec<(String, f64)> {
        let db = connect(url, "storm-relations").await;
        db.query(
            "SELECT 'table ' || relname || ' (sequential)', seq_tup_read::float8 \
             FROM pg_stat_all_tables WHERE seq_tup_read > 0 \
             UNION ALL \
             SELECT 'table ' || relname || ' (fetched through indexes)', idx_tup_fetch::float8 \
             FROM pg_stat_all_tables WHERE idx_tup_fetch > 0 \
             UNION ALL \
             SELECT 'index ' || indexrelname, idx_tup_read::float8 \
             FROM pg_stat_all_indexes WHERE idx_tup_read > 0",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
    }

    /// Rows per task done from the first count to the second (25 workers), the second to the
    /// third (475 joining and the 500), and over both.
    fn between(counts: [&[(String, f64)]; 3], done: [u64; 3]) -> Self {
        let [start, join, end] = counts;
        let count =
            |at: &[(String, f64)], name: &str| at.iter().find(|b| b.0 == name).map_or(0.0, |b| b.1);
        let per_task = |from: &[(String, f64)], to: &[(String, f64)], name: &str, tasks: u64| {
            (count(to, name) - count(from, name)) / (tasks.max(1) as f64)
        };
        let mut out: Vec<(String, [f64; 3])> = end
            .iter()
            .map(|(name, _)| {
                (
                    name.clone(),
                    [
                        per_task(start, join, name, done[1] - done[0]),
                        per_task(join, end, name, done[2] - done[1]),
                        per_task(start, end, name, done[2] - done[0]),
                    ],
                )
            })
            .filter(|(_, n)| n[2] >= 0.1)
            .collect();
        out.sort_by(|a, b| b.1[2].total_cmp(&a.1[2]));
        Self(out)
    }
}

impl Course {
    /// The rest of the storm, the same for both fleets: the 475 join at JOIN_AT (`join` starts
    /// them), the backlog is worked down, the fleet idles; then the probe, the sampler and both
    /// fleets stop.
    async fn run(
        self,
        first: Fleet,
        join: impl std::future::Future<Output = Fleet>,
        tx: mpsc::UnboundedSender<Receipt>,
    ) -> Measured {
        let started = self.started;
        let (counts_before, done_before) = (
            ByRelation::counts(&self.url).await,
            self.done.load(Ordering::Relaxed),
        );
        tokio::time::sleep_until((started + JOIN_AT).into()).await;
        let (counts_joining, done_joining) = (
            ByRelation::counts(&self.url).await,
            self.done.load(Ordering::Relaxed),
        );
        let joining = Instant::now();
        let second = join.await;
        let joined_in = joining.elapsed();
        eprintln!(
            "  the joining workers connected in {:.2} s",
            joined_in.as_secs_f64()
        );
        drop(tx);
        let backlog_done = backlog_done(&self.done, started).await;
        eprintln!("  backlog done at {:.1} s", backlog_done.as_secs_f64());
        // (Busy backends publish their counts at most a second late.)
        tokio::time::sleep(SAMPLE_EVERY).await;
        let counts_after = ByRelation::counts(&self.url).await;
        let done_after = self.done.load(Ordering::Relaxed);
        let by_relation = ByRelation::between(
            [&counts_before, &counts_joining, &counts_after],
            [done_before, done_joining, done_after],
        );
        let idle_from = started.elapsed() + IDLE_SETTLE;
        if self.idles {
            tokio::time::sleep(IDLE_SETTLE + IDLE_WINDOW + SAMPLE_EVERY).await;
        }
        self.stop.store(true, Ordering::SeqCst);
        let probes = self.probe.await.unwrap();
        let samples = self.samples.await.unwrap();
        let errors = [&first.stats, &second.stats, &self.probe_stats]
            .iter()
            .map(|s| s.errors.load(Ordering::Relaxed))
            .sum();
        first.stop().await;
        second.stop().await;
        let (done, twice) = self.tally.await.unwrap();
        Measured {
            samples,
            joined_in,
            backlog_done,
            idle: (idle_from, idle_from + IDLE_WINDOW),
            probes,
            errors,
            done,
            twice,
            by_relation,
        }
    }
}

impl Measured {
    fn into_storm(self, label: &'static str, left: i64) -> Storm {
        Storm {
            label,
            samples: self.samples,
            joined_in: self.joined_in,
            backlog_done: self.backlog_done,
            idle: self.idle,
            probes: self.probes,
            errors: self.errors,
            done: self.done,
            twice: self.twice,
            left,
            by_relation: self.by_relation,
        }
    }
}

/// The broker's storm, or with `joining` 0 the control run: the first 25 work the whole
/// backlog down alone (no idle window), so that what the 500 cost per task after the join can be
/// set against what 25 cost at the same depth of the backlog.
async fn broker_storm(setup: &Setup, joining: usize) -> Storm {
    let (url, db, head) = setup
        .database(if joining > 0 {
            "storm_broker"
        } else {
            "storm_control"
        })
        .await;
    let args = ServeArgs::with_urls(&url, &setup.redis.url());
    // The broker on a runtime of its own, two threads as on this machine's two cores, as its
    // own process would run it: its tasks then do not queue behind the fleet's 500 clients on
    // the bench's runtime.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("broker")
        .enable_all()
        .build()
        .unwrap();
    let broker = runtime
        .spawn(async move { dispatch_broker::server::start(&args).await })
        .await
        .unwrap()
        .unwrap();
    let endpoint = format!("http://{}", broker.addr);
    let holder = Worker::connect(&endpoint, WorkerConfig::new("head-holder"))
        .await
        .unwrap();
    let head_task = holder
        .claim(&head.to_string())
        .await
        .unwrap()
        .expect("B0's head is ready");
    head_task.start().await.unwrap();
    broker.resource_queues.settle().await.unwrap();

    let (tx, rx) = mpsc::unbounded_channel();
    let done = Arc::new(AtomicU64::new(0));
    let tally = tally(rx, Arc::clone(&done));
    let stop = Arc::new(AtomicBool::new(false));
    let (stats, background) = (
        Arc::clone(&broker.stats),
        Arc::clone(&broker.background_stats),
    );
    let counters: Counters = Arc::new(move || {
        let (rpc, background) = (stats.snapshot(), background.snapshot());
        (
            rpc.postgres_statements + background.postgres_statements,
            rpc.redis_calls + background.redis_calls,
        )
    });
    let started = Instant::now();
    let samples = sampler(
        url.clone(),
        started,
        Arc::clone(&done),
        counters,
        Arc::clone(&stop),
    );
    // The probe.
    let probe_stats = Arc::new(FleetStats::default());
    let probe = {
        let (stop, tx, stats) = (Arc::clone(&stop), tx.clone(), Arc::clone(&probe_stats));
        let endpoint = endpoint.clone();
        on_own_thread(move || async move {
            let worker = Worker::connect(&endpoint, WorkerConfig::new("probe"))
                .await
                .unwrap();
            let mut out = Vec::new();
            let mut tick = tokio::time::interval(PROBE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                let asked = Instant::now();
                let fetched = worker.next_task_started(Duration::ZERO).await;
                out.push(Probe {
                    at: asked - started,
                    took: asked.elapsed(),
                });
                match fetched {
                    Ok(task) => {
                        if let Some(task) = task {
                            let (id, name) = (task.id().parse().unwrap(), task.task().name.clone());
                            // (A finish that fails in passing is retried in the background.)
                            if let Err(e) = task.finish(FinalState::Completed, None).await {
                                stats.failed(&e);
                            }
                            let now = Instant::now();
                            let _ = tx.send(Receipt {
                                id,
                                name,
                                received: now,
                                done: now,
                            });
                        }
                    }
                    Err(e) => stats.failed(&e),
                }
            }
            worker.close().await.unwrap();
            out
        })
    };
    let first = broker_fleet(&endpoint, FIRST, Duration::ZERO, true, tx.clone()).await;
    let join = broker_fleet(&endpoint, joining, Duration::ZERO, true, tx.clone());
    let course = Course {
        started,
        done,
        stop,
        probe,
        probe_stats,
        samples,
        tally,
        url: url.clone(),
        idles: joining > 0,
    };
    let storm = course.run(first, join, tx).await;
    head_task.finish(FinalState::Completed, None).await.unwrap();
    holder.close().await.unwrap();
    runtime.spawn(broker.shutdown()).await.unwrap().unwrap();
    runtime.shutdown_background();
    let label = if joining > 0 {
        "broker"
    } else {
        "broker, 25 throughout"
    };
    storm.into_storm(label, left(&db).await)
}

async fn baseline_storm(setup: &Setup) -> Storm {
    let (url, db, head) = setup.database("storm_baseline").await;
    let redis_pool = deadpool_redis::Config::from_url(setup.redis.url())
        .builder()
        .unwrap()
        .max_size(2)
        .runtime(deadpool_redis::Runtime::Tokio1)
        .build()
        .unwrap();
    // B0's head runs: claimed and locked as a baseline worker would.
    let holder = Uuid::new_v4();
    db.execute(
        "INSERT INTO core_appstatus (pulp_id, app_type, name, ttl) \
         VALUES ($1, 'worker', $2, interval '30 seconds')",
        &[&holder, &format!("baseline-holder-{holder}")],
    )
    .await
    .unwrap();
    db.execute(
        "UPDATE core_task SET state = 'running', app_lock_id = $2, started_at = now() \
         WHERE pulp_id = $1",
        &[&head, &holder],
    )
    .await
    .unwrap();
    let mut redis = redis_pool.get().await.unwrap();
    assert!(
        baseline_locks(
            &mut redis,
            "baseline-holder",
            &fleets::baseline_lock_args(&[HEAD.to_owned()]),
            true
        )
        .await
    );

    let (tx, rx) = mpsc::unbounded_channel();
    let done = Arc::new(AtomicU64::new(0));
    let tally = tally(rx, Arc::clone(&done));
    let stop = Arc::new(AtomicBool::new(false));
    let fleet_stats: Arc<Mutex<Vec<Arc<FleetStats>>>> = Arc::default();
    let probe_stats = Arc::new(FleetStats::default());
    fleet_stats.lock().unwrap().push(Arc::clone(&probe_stats));
    let counted = Arc::clone(&fleet_stats);
    // (The baseline's Redis calls are not counted.)
    let counters: Counters = Arc::new(move || {
        let statements = counted
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.statements.load(Ordering::Relaxed))
            .sum();
        (statements, 0)
    });
    let started = Instant::now();
    let samples = sampler(
        url.clone(),
        started,
        Arc::clone(&done),
        counters,
        Arc::clone(&stop),
    );
    let probe = {
        let (stop, tx, stats) = (Arc::clone(&stop), tx.clone(), Arc::clone(&probe_stats));
        let (url, redis_url) = (url.clone(), setup.redis.url());
        on_own_thread(move || async move {
            // (A connection of its own, where the baseline's workers share 20 per fleet.)
            let probe_db = BaselineDb::connect(&url).await;
            let redis_pool = deadpool_redis::Config::from_url(redis_url)
                .builder()
                .unwrap()
                .max_size(1)
                .runtime(deadpool_redis::Runtime::Tokio1)
                .build()
                .unwrap();
            let mut redis = redis_pool.get().await.unwrap();
            let app_status = Uuid::new_v4();
            probe_db
                .register(app_status, &format!("baseline-probe-{app_status}"))
                .await;
            let mut out = Vec::new();
            let mut tick = tokio::time::interval(PROBE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let name = format!("baseline-probe-{app_status}");
            while !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                let asked = Instant::now();
                let claim = baseline_poll(&probe_db, &mut redis, &name, app_status, &stats).await;
                out.push(Probe {
                    at: asked - started,
                    took: asked.elapsed(),
                });
                if let Some(claim) = claim {
                    baseline_finish(&probe_db, &mut redis, &name, &claim, &stats).await;
                    let now = Instant::now();
                    let _ = tx.send(Receipt {
                        id: claim.id,
                        name: claim.name,
                        received: now,
                        done: now,
                    });
                }
            }
            out
        })
    };
    let redis_url = setup.redis.url();
    // Each fleet's counts are read from the moment its first worker starts.
    let counted = |stats: &Arc<Mutex<Vec<Arc<FleetStats>>>>| {
        let fleet = Arc::new(FleetStats::default());
        stats.lock().unwrap().push(Arc::clone(&fleet));
        fleet
    };
    let first = baseline_fleet_counted(
        &url,
        &redis_url,
        FIRST,
        Duration::ZERO,
        tx.clone(),
        counted(&fleet_stats),
    )
    .await;
    let join = baseline_fleet_counted(
        &url,
        &redis_url,
        JOINING,
        Duration::ZERO,
        tx.clone(),
        counted(&fleet_stats),
    );
    let course = Course {
        started,
        done,
        stop,
        probe,
        probe_stats,
        samples,
        tally,
        url: url.clone(),
        idles: true,
    };
    let storm = course.run(first, join, tx).await;
    storm.into_storm("baseline", left(&db).await)
}

/// What the storm with faults showed.
struct Faults {
    backlog_done: Duration,
    errors: u64,
    done: usize,
    twice: usize,
    left: i64,
    /// Grants handed back as undelivered and requeued (the replicas' warnings).
    handed_back: usize,
    /// What happened when.
    timeline: Vec<String>,
}

/// The storm once more, broker only, with two replicas (the real binary) sharing the fleet and
/// faults while the 500 work: replica B killed (SIGKILL) 2 s after the join began and started
/// again 1 s later; Redis paused (SIGSTOP) for 5 s, shorter than the leases' 30 s TTL, 4 s after
/// that. Nothing may be lost: every ready task done exactly once.
async fn faults_storm(setup: &Setup) -> Faults {
    let (url, db, head) = setup.database("storm_faults").await;
    let logs = tempfile::tempdir().unwrap();
    let redis_url = setup.redis.url();
    let replica = |name: &str| {
        Replica::start(
            env!("CARGO_BIN_EXE_dispatch-broker"),
            &url,
            &redis_url,
            &[],
            logs.path().join(format!("replica-{name}.log")),
        )
        .unwrap()
    };
    let a = replica("a");
    let mut b = replica("b");
    let holder = Worker::connect(a.endpoint(), WorkerConfig::new("head-holder"))
        .await
        .unwrap();
    let head_task = holder
        .claim(&head.to_string())
        .await
        .unwrap()
        .expect("B0's head is ready");
    let (tx, rx) = mpsc::unbounded_channel();
    let done = Arc::new(AtomicU64::new(0));
    let tally = tally(rx, Arc::clone(&done));
    let started = Instant::now();
    let mut fleets = Vec::new();
    for endpoint in [a.endpoint(), b.endpoint()] {
        fleets.push(broker_fleet(&endpoint, FIRST / 2, Duration::ZERO, true, tx.clone()).await);
    }
    tokio::time::sleep_until((started + JOIN_AT).into()).await;
    for endpoint in [a.endpoint(), b.endpoint()] {
        fleets.push(broker_fleet(&endpoint, JOINING / 2, Duration::ZERO, true, tx.clone()).await);
    }
    drop(tx);
    let mut timeline = Vec::new();
    let mut note = |what: &str| {
        let line = format!("{:.1} s: {what}", started.elapsed().as_secs_f64());
        eprintln!("  {line}");
        timeline.push(line);
    };
    tokio::time::sleep_until((started + JOIN_AT + Duration::from_secs(2)).into()).await;
    b.kill();
    note("replica B killed (SIGKILL)");
    tokio::time::sleep(Duration::from_secs(1)).await;
    b.boot().unwrap();
    note("replica B started again");
    tokio::time::sleep(Duration::from_secs(4)).await;
    setup.redis.pause();
    note("Redis paused (SIGSTOP)");
    tokio::time::sleep(Duration::from_secs(5)).await;
    setup.redis.resume();
    note("Redis resumed");
    let backlog_done = backlog_done(&done, started).await;
    note("backlog done");
    // What is left, and why, when something is (before the leases close).
    for row in db
        .query(
            "SELECT pulp_id::text, state, app_lock_id::text, started_at IS NOT NULL \
             FROM core_task WHERE name = 'ready' AND state <> 'completed' AND $1",
            &[&(done.load(Ordering::Relaxed) < READY as u64)],
        )
        .await
        .unwrap()
    {
        let id: String = row.get(0);
        let lock = std::process::Command::new("redis-cli")
            .args([
                "-u",
                &redis_url,
                "HGETALL",
                &format!("{{dispatch}}:task:{id}"),
            ])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).replace('\n', " "))
            .unwrap_or_default();
        eprintln!(
            "  left: {id} {} claimed by {:?}, started: {}; its lock: [{lock}]",
            row.get::<_, String>(1),
            row.get::<_, Option<String>>(2),
            row.get::<_, bool>(3),
        );
        for line in [&a, &b].iter().flat_map(|r| r.logged(&id)) {
            eprintln!("    {line}");
        }
    }
    let errors = fleets
        .iter()
        .map(|f| f.stats.errors.load(Ordering::Relaxed))
        .sum();
    for fleet in fleets {
        fleet.stop().await;
    }
    let (done, twice) = tally.await.unwrap();
    head_task.finish(FinalState::Completed, None).await.unwrap();
    holder.close().await.unwrap();
    let handed_back = [&a, &b]
        .iter()
        .map(|r| r.logged("the worker never received this grant").len())
        .sum();
    Faults {
        backlog_done,
        errors,
        done,
        twice,
        left: left(&db).await,
        handed_back,
        timeline,
    }
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
}

fn report(storms: &[Storm]) {
    println!("\n### Scale-up storm: {READY} ready tasks over {RESOURCES} repositories and {BLOCKED} blocked behind a running head; {FIRST} workers, then {JOINING} joining\n");
    println!("| fleet | phase | Postgres statements/s | transactions/s | rows read/s | tasks/s | statements / task | Redis calls / task | rows read / task | connections (most) | probe p50 / p99 ms |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for storm in storms {
        let joined = JOIN_AT + JOINING_WINDOW;
        let phases = [
            ("25 workers, backlog", Duration::from_secs(1), JOIN_AT),
            ("475 joining (first 3 s)", JOIN_AT, joined),
            (
                "500 workers, backlog",
                joined,
                storm.backlog_done.saturating_sub(Duration::from_secs(1)),
            ),
            ("500 workers idle", storm.idle.0, storm.idle.1),
        ];
        for (name, from, to) in phases {
            let Some(p) = storm.phase(from, to) else {
                println!("| {} | {name} | (too short) | | | | | | | | |", storm.label);
                continue;
            };
            let per_task = |x: f64| {
                if p.tasks >= 1.0 {
                    format!("{:.2}", x / p.tasks)
                } else {
                    "-".into()
                }
            };
            println!(
                "| {} | {name} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {:.0} | {} / {} |",
                storm.label,
                p.statements,
                p.transactions,
                p.rows,
                p.tasks,
                per_task(p.statements),
                if p.redis > 0.0 {
                    per_task(p.redis)
                } else {
                    "-".into()
                },
                per_task(p.rows),
                p.connections,
                ms(p.probe_p50),
                ms(p.probe_p99),
            );
        }
    }
    println!();
    for storm in storms {
        let small = storm.phase(Duration::from_secs(1), JOIN_AT);
        let large = storm.phase(
            JOIN_AT + JOINING_WINDOW,
            storm.backlog_done.saturating_sub(Duration::from_secs(1)),
        );
        let growth = match (small, large) {
            (Some(s), Some(l)) if s.tasks >= 1.0 && l.tasks >= 1.0 => format!(
                "statements per task {:.2}x, rows read per task {:.2}x",
                (l.statements / l.tasks) / (s.statements / s.tasks),
                (l.rows / l.tasks) / (s.rows / s.tasks)
            ),
            _ => "-".into(),
        };
        println!(
            "- {}: 475 joined in {:.2} s; backlog done at {:.1} s; throughput steady {} after the join began; \
             500 workers against 25: {growth}; failed calls: {}; ready tasks done {} (twice: {}), left incomplete in the database: {}.",
            storm.label,
            storm.joined_in.as_secs_f64(),
            storm.backlog_done.as_secs_f64(),
            storm
                .steady_after()
                .map_or("never".into(), |d| format!("{:.0} s", d.as_secs_f64())),
            storm.errors,
            storm.done,
            storm.twice,
            storm.left,
        );
    }
}

/// Where each fleet's rows read go (relations of at least a tenth of a row per task).
fn report_relations(storms: &[Storm], control: Option<&Storm>) {
    for storm in storms {
        println!(
            "\n{}: rows read per task done, by relation (every session)\n",
            storm.label
        );
        println!(
            "| relation | {FIRST} workers | {JOINING} joining, then {} | both |",
            FIRST + JOINING
        );
        println!("|---|---:|---:|---:|");
        for (name, [small, large, both]) in &storm.by_relation.0 {
            println!("| {name} | {small:.1} | {large:.1} | {both:.1} |");
        }
    }
    let (Some(control), Some(broker)) = (control, storms.iter().find(|s| s.label == "broker"))
    else {
        return;
    };
    // The same depth of the backlog: from the join (6 s, the same tasks done in both runs by
    // then) to its end.
    let after_join = |s: &Storm| {
        s.phase(
            JOIN_AT,
            s.backlog_done.saturating_sub(Duration::from_secs(1)),
        )
    };
    println!(
        "\nFleet size alone: after the join at {} s, to the backlog's end, the broker's storm against the control run (its first {FIRST} work the backlog down alone)\n",
        JOIN_AT.as_secs()
    );
    println!("| run | workers after the join | tasks/s | statements / task | Redis calls / task | rows read / task | rows read / task, by relation (sum) |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut per_task = Vec::new();
    for (storm, workers) in [(broker, FIRST + JOINING), (control, FIRST)] {
        let Some(p) = after_join(storm) else { continue };
        let by_relation: f64 = storm.by_relation.0.iter().map(|(_, n)| n[1]).sum();
        let tasks = p.tasks.max(1.0);
        println!(
            "| {} | {workers} | {:.0} | {:.2} | {:.2} | {:.1} | {:.1} |",
            storm.label,
            p.tasks,
            p.statements / tasks,
            p.redis / tasks,
            p.rows / tasks,
            by_relation
        );
        per_task.push((p.statements / tasks, p.rows / tasks, by_relation));
    }
    if let [(s500, r500, b500), (s25, r25, b25)] = per_task[..] {
        println!(
            "\n500 workers against 25 at the same depth: statements per task {:.2}x, rows read per task {:.2}x ({:.2}x by relation).",
            s500 / s25,
            r500 / r25,
            b500 / b25
        );
    }
    println!();
    println!(
        "\n{}: rows read per task done, by relation (every session)\n",
        control.label
    );
    println!("| relation | first {} s | after |", JOIN_AT.as_secs());
    println!("|---|---:|---:|");
    for (name, [small, large, _]) in &control.by_relation.0 {
        println!("| {name} | {small:.1} | {large:.1} |");
    }
}

/// Tasks/s and Postgres statements/s over the storm, one line per fleet.
fn plot(storms: &[Storm], path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let root = SVGBackend::new(path, (1100, 420)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let panels = root.split_evenly((1, 2));
    let end = storms
        .iter()
        .map(|s| s.backlog_done.as_secs_f64() + 5.0)
        .fold(JOIN_AT.as_secs_f64() + 5.0, f64::max);
    let series: [(&str, Field); 2] = [
        ("tasks done / s", |s| s.done),
        ("Postgres statements / s", |s| s.statements),
    ];
    for (panel, (title, f)) in panels.iter().zip(series) {
        let top = storms
            .iter()
            .flat_map(|s| s.rates(f))
            .filter(|(t, _)| *t <= end)
            .map(|r| r.1)
            .fold(1.0, f64::max);
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!(
                    "{title} ({FIRST} workers, {JOINING} join at {} s)",
                    JOIN_AT.as_secs()
                ),
                ("sans-serif", 17),
            )
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..end, 0f64..top * 1.1)
            .unwrap();
        chart
            .configure_mesh()
            .x_desc("seconds since the first workers started")
            .y_desc(title)
            .draw()
            .unwrap();
        for (i, storm) in storms.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let points: Vec<(f64, f64)> = storm
                .rates(f)
                .into_iter()
                .filter(|(t, _)| *t <= end)
                .collect();
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .unwrap()
                .label(storm.label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .unwrap();
    }
    root.present().unwrap();
    eprintln!("wrote {}", path.display());
}

#[tokio::main]
async fn main() {
    let which: Option<String> = std::env::args().skip(1).find(|a| a != "--bench");
    eprintln!("starting throwaway PostgreSQL and Redis ...");
    let (pg, redis) =
        tokio::task::spawn_blocking(|| (Postgres::start().unwrap(), Redis::start().unwrap()))
            .await
            .unwrap();
    let setup = Setup { pg, redis };
    let mut storms = Vec::new();
    let mut control = None;
    if which.as_deref() != Some("faults") {
        eprintln!("storm: broker ...");
        storms.push(broker_storm(&setup, JOINING).await);
        eprintln!("storm: broker, the control run ({FIRST} workers throughout) ...");
        control = Some(broker_storm(&setup, 0).await);
    }
    if which.is_none() {
        eprintln!("storm: baseline ...");
        storms.push(baseline_storm(&setup).await);
    }
    let faults = if which.is_none() || which.as_deref() == Some("faults") {
        eprintln!("storm with faults: broker, two replicas ...");
        Some(faults_storm(&setup).await)
    } else {
        None
    };
    if !storms.is_empty() {
        report(&storms);
        report_relations(&storms, control.as_ref());
        plot(
            &storms,
            Path::new(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/benches/results/storm.svg"
            )),
        );
    }
    if let Some(f) = &faults {
        println!(
            "\n### The storm with faults (broker, two replicas as the real binary, the fleet split between them)\n"
        );
        for line in &f.timeline {
            println!("- {line}");
        }
        println!(
            "\nFailed calls (retried by the workers): {}; grants handed back as undelivered and requeued: {}; \
             backlog done at {:.1} s; ready tasks done {} (twice: {}), left incomplete in the database: {}.",
            f.errors,
            f.handed_back,
            f.backlog_done.as_secs_f64(),
            f.done,
            f.twice,
            f.left
        );
    }
    if let Some(f) = &faults {
        assert!(
            f.done == READY && f.twice == 0 && f.left == 0,
            "with faults, every ready task must be done exactly once ({} done, {} twice, {} left)",
            f.done,
            f.twice,
            f.left
        );
    }
    for storm in storms.iter().chain(&control) {
        assert!(
            storm.done == READY && storm.twice == 0 && storm.left == 0,
            "{}: every ready task must be done exactly once ({} done, {} twice, {} left)",
            storm.label,
            storm.done,
            storm.twice,
            storm.left
        );
    }
}
