//! FetchTask on Pulp's own database under live traffic, against pulpcore's own
//! `RedisWorker.fetch_task` in the same run.
//!
//! The database is made by pulpcore 3.123.1's own migrations (`pulpcore-manager migrate`, in the
//! virtualenv `scripts/ensure-pulp.sh` makes). Per backlog size N: the head task of repository R0
//! runs (under a broker lease; for pulpcore, under pulpcore's own Redis locks), N tasks on R0
//! wait behind it, 50 tasks of other repositories after them. Then 20 rounds: 10 workers each
//! fetch a task (timed one at a time), then start and finish it, or put the claim back
//! (`requeue`); 10 new tasks arrive through pulpcore's own `dispatch()` (its insert trigger and
//! wake-up notification); every 5th round 2 waiting R0 tasks are canceled through pulpcore's
//! `cancel_task()`. The broker runs with its defaults (lane gauge every 15 s, GIN pending list
//! merged every second); the GIN index's pending list is on (a fresh Pulp database), then off
//! (`migrate --gin-fastupdate-off`). A last cell (pending list off, finish) lets R0's queue
//! move: its head finishes first, so each round hands out R0's next task too (broker only). pulpcore's side runs in a Python helper process
//! (`benches/pulp/helper.py`) on the same database and Redis, timed there.
//!
//! The cluster is durable, as a deployment's is: fsync and full_page_writes on (the test clusters
//! run without fsync), so every commit, the broker's claims and pulpcore's alike, waits for its
//! WAL to reach the disk.
//!
//! The backlog itself is inserted in one statement with Pulp's insert trigger off: through the
//! trigger, each insert on R0 reads every incomplete R0 task (its clock check), so a backlog of
//! 100,000 would take hours to build. Everything that arrives during the run goes through
//! `dispatch()`. Nothing is vacuumed or analysed by the bench; the rounds start 2 s after the
//! backlog's insert, once the broker merged the GIN pending list it left.
//!
//! Postgres statements and buffers (8 kB pages) per fetch come from `pg_stat_statements`,
//! counting every statement of the broker's role during the broker's rounds (background work
//! included), but not the transaction control some reads are wrapped in (`BEGIN READ ONLY` with
//! their planner settings, and `COMMIT`, sent with the read in one round trip): those are counted
//! apart.
//!
//! pulpcore's workers and the broker share the database here, as they never do in a deployment:
//! when pulpcore's cell outlasts the broker's claim grace (14 s, at 1,000,000 blocked), the
//! broker's reconciler takes the tasks pulpcore's workers run for lost Redis writes and rebuilds
//! its lock state; `PULPCORE=0` measures the broker's side alone.
//!
//! Run: `cargo bench --bench pulp` (N = 1,000, 17,000, 100,000, 1,000,000) or
//! `cargo bench --bench pulp -- 1000 17000`; `PULPCORE=0` runs the broker's rounds only,
//! `PULPCORE=first` pulpcore's in the first cell of each size only; `TRUST_AB=1` compares, round
//! by round, passes that may trust their scan hint with passes that may not (see `trust_ab`);
//! `PAUSE_AB=MS` first fetches right after a round's traffic with first fetches MS ms after it
//! (see `pause_ab`); `WARM_AB=1` first fetches right after a round's traffic with first fetches
//! that follow a Heartbeat (see `warm_ab`); `QUIET_AB=1` first fetches after pulpcore's
//! `dispatch()` with first fetches after the same inserts made from Rust (see `quiet_ab`). Prints
//! Markdown tables.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use dispatch_broker::config::ServeArgs;
use dispatch_testkit::{Postgres, Redis};
use dispatch_worker::{FinalState, TaskGuard, Worker, WorkerConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

const WORKERS: usize = 10;
const ROUNDS: usize = 20;
const OTHERS: usize = 50;
const CANCEL_EVERY: usize = 5;
const CANCELS: usize = 2;
const R0: &str = "prn:file.filerepository:R0";
/// The role the broker connects as, so pg_stat_statements tells its statements apart.
const BROKER_ROLE: &str = "dispatch";

/// pulpcore's side: `benches/pulp/helper.py` in pulpcore's virtualenv.
struct Helper {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Helper {
    async fn start(python: &std::path::Path, env: &BTreeMap<String, String>) -> Helper {
        let mut child = tokio::process::Command::new(python)
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/benches/pulp/helper.py"
            ))
            .envs(env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the pulpcore helper");
        let stdin = child.stdin.take().expect("helper stdin");
        let lines = BufReader::new(child.stdout.take().expect("helper stdout")).lines();
        let mut helper = Helper {
            child,
            stdin,
            lines,
        };
        let ready = helper.read().await;
        assert_eq!(ready["ready"], true, "pulpcore helper: {ready}");
        helper
    }

    async fn read(&mut self) -> Value {
        let line = self
            .lines
            .next_line()
            .await
            .expect("read the helper")
            .expect("the pulpcore helper exited (its error is above)");
        serde_json::from_str(&line).expect("the helper answers JSON")
    }

    async fn call(&mut self, request: Value) -> Value {
        self.stdin
            .write_all(format!("{request}\n").as_bytes())
            .await
            .expect("write to the helper");
        let answer = self.read().await;
        if let Some(e) = answer.get("error") {
            panic!("pulpcore helper, {request}: {e}");
        }
        answer
    }

    async fn stop(mut self) {
        self.call(json!({"op": "stop"})).await;
        drop(self.stdin);
        let _ = self.child.wait().await;
    }
}

/// The Pulp settings for a database, as PULP_* variables.
fn pulp_env(
    pg_port: u16,
    database: &str,
    redis_url: &str,
    work: &std::path::Path,
) -> BTreeMap<String, String> {
    let key = work.join("db.key");
    std::fs::write(&key, "8NQBBpPIlyl6nGVYTdjkJyvOHh5ZWQnjD0kv/jUW5Vs=\n").unwrap();
    for d in ["media", "work", "tmp"] {
        std::fs::create_dir_all(work.join(d)).unwrap();
    }
    let path = |d: &str| work.join(d).display().to_string();
    [
        (
            "PULP_DATABASES__default__ENGINE",
            "django.db.backends.postgresql".to_owned(),
        ),
        ("PULP_DATABASES__default__NAME", database.to_owned()),
        ("PULP_DATABASES__default__USER", "postgres".to_owned()),
        ("PULP_DATABASES__default__HOST", "127.0.0.1".to_owned()),
        ("PULP_DATABASES__default__PORT", pg_port.to_string()),
        (
            "PULP_SECRET_KEY",
            "throwaway-secret-for-the-benchmark".to_owned(),
        ),
        ("PULP_CONTENT_ORIGIN", "http://127.0.0.1:24816".to_owned()),
        ("PULP_MEDIA_ROOT", path("media")),
        ("PULP_WORKING_DIRECTORY", path("work")),
        ("PULP_FILE_UPLOAD_TEMP_DIR", path("tmp")),
        ("PULP_DB_ENCRYPTION_KEY", key.display().to_string()),
        ("PULP_REDIS_URL", redis_url.to_owned()),
        ("PULP_ANALYTICS", "false".to_owned()),
        // pulpcore connects to Redis (for RedisWorker) only with its cache or its Redis worker on.
        ("PULP_CACHE_ENABLED", "true".to_owned()),
        ("DJANGO_SETTINGS_MODULE", "pulpcore.app.settings".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Median and p99 in ms.
fn summary(mut ms: Vec<f64>) -> (f64, f64) {
    ms.sort_by(|a, b| a.total_cmp(b));
    (percentile(&ms, 0.5), percentile(&ms, 0.99))
}

/// What pg_stat_statements counted for the broker's role.
#[derive(Debug, Default)]
struct Costs {
    statements: f64,
    /// BEGIN, the planner settings (`*_settings.sql`) and COMMIT around a read.
    control: f64,
    buffers: f64,
    /// The lane gauge's statements (lanes*.sql) during the rounds: calls and total ms.
    lane_calls: i64,
    lane_ms: f64,
    /// The statements by total time: (first line, calls, mean ms, buffers per call).
    top: Vec<(String, i64, f64, f64)>,
    /// The broker's own counts over the rounds: fetch passes, their Redis calls, and the passes
    /// that trusted their scan hint (no Redis read of the lease and the changes first).
    passes: u64,
    pass_redis_calls: u64,
    hints_trusted: u64,
    own_changes: u64,
    pages_carried: u64,
}

async fn reset_statements(db: &tokio_postgres::Client) {
    db.batch_execute("SELECT pg_stat_statements_reset()")
        .await
        .unwrap();
}

async fn broker_costs(db: &tokio_postgres::Client) -> Costs {
    let rows = db
        .query(
            "SELECT split_part(ltrim(s.query), E'\\n', 1), s.calls, s.mean_exec_time, \
                    (s.shared_blks_hit + s.shared_blks_read)::float8 / greatest(s.calls, 1) \
             FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid \
             WHERE r.rolname = $1 AND s.calls > 0 \
             ORDER BY s.total_exec_time DESC",
            &[&BROKER_ROLE],
        )
        .await
        .unwrap();
    let mut costs = Costs::default();
    for row in rows {
        let calls: i64 = row.get(1);
        let per_call: f64 = row.get(3);
        let first_line: String = row.get(0);
        if first_line.starts_with("-- lanes") {
            let mean: f64 = row.get(2);
            costs.lane_calls += calls;
            costs.lane_ms += mean * calls as f64;
        }
        if first_line.starts_with("BEGIN")
            || first_line.starts_with("COMMIT")
            || first_line.contains("_settings.sql")
        {
            costs.control += calls as f64;
            continue;
        }
        costs.statements += calls as f64;
        costs.buffers += per_call * calls as f64;
        costs.top.push((row.get(0), calls, row.get(2), per_call));
    }
    costs
}

/// One traffic mode's rounds for one fleet: fetch latencies in ms.
struct Cell {
    fetch_ms: Vec<f64>,
    fetched: usize,
    costs: Option<Costs>,
    /// What the broker's fetches did, the first of each round and the others apart.
    steps: [Steps; 2],
}

/// The broker's counters summed over some fetches (each fetch's change, read around it).
#[derive(Default, Clone, Copy)]
struct Steps {
    fetches: u64,
    statements: u64,
    redis_calls: u64,
    passes: u64,
    hints_trusted: u64,
    own_changes: u64,
    pages_carried: u64,
    queue_starts: u64,
}

impl Steps {
    fn add(&mut self, d: &dispatch_broker::metrics::StatsSnapshot) {
        self.fetches += 1;
        self.statements += d.fetch_postgres_statements;
        self.redis_calls += d.fetch_redis_calls;
        self.passes += d.fetch_passes;
        self.hints_trusted += d.hints_trusted;
        self.own_changes += d.own_changes;
        self.pages_carried += d.pages_carried;
        self.queue_starts += d.queue_starts;
    }

    fn line(&self) -> String {
        let n = self.fetches.max(1) as f64;
        format!(
            "{:.2} statements, {:.2} Redis calls, {:.2} passes; of the passes {:.0}% trusted a \
             hint, {:.0}% on own changes, {:.0}% judged a carried page, {:.0}% started from the \
             queues",
            self.statements as f64 / n,
            self.redis_calls as f64 / n,
            self.passes as f64 / n,
            100.0 * self.hints_trusted as f64 / self.passes.max(1) as f64,
            100.0 * self.own_changes as f64 / self.passes.max(1) as f64,
            100.0 * self.pages_carried as f64 / self.passes.max(1) as f64,
            100.0 * self.queue_starts as f64 / self.passes.max(1) as f64,
        )
    }
}

/// `QUIET_AB=1`: before every other round the round's new tasks are inserted by the bench itself
/// (one transaction each, the insert trigger on, Pulp's wake-up notification with each) instead
/// of by pulpcore's `dispatch()` in the Python helper, and no cancels are made; the first fetches
/// of the two kinds of round are reported apart: how much of the first fetch's extra cost comes
/// with Python running on the same cores, rather than with the arrivals themselves.
fn quiet_ab() -> bool {
    std::env::var_os("QUIET_AB").is_some_and(|v| v != "0")
}

/// The round's new tasks as [`traffic`] makes them, inserted from Rust.
async fn quiet_traffic(db: &tokio_postgres::Client, round: usize) {
    for i in 0..WORKERS {
        db.batch_execute(&format!(
            "BEGIN; \
             INSERT INTO core_task (pulp_id, pulp_created, pulp_last_updated, state, name, \
                 logging_cid, reserved_resources_record, pulp_domain_id, versions, immediate, \
                 deferred, pulp_api_version) \
             SELECT gen_random_uuid(), now(), now(), 'waiting', 'pulpcore.app.tasks.test.sleep', \
                    'bench', ARRAY['prn:file.filerepository:Q{round}-{i}', \
                                   'shared:prn:core.domain:' || d.pulp_id], \
                    d.pulp_id, hstore('core', '3.123.1'), false, true, 'v3' \
             FROM core_domain d WHERE d.name = 'default'; \
             NOTIFY pulp_worker_wakeup; COMMIT;"
        ))
        .await
        .unwrap();
    }
}

async fn traffic(helper: &mut Helper, round: usize) {
    helper
        .call(json!({"op": "dispatch", "n": WORKERS, "prefix": "F"}))
        .await;
    if round % CANCEL_EVERY == CANCEL_EVERY - 1 {
        helper
            .call(json!({"op": "cancel", "n": CANCELS, "resource": R0}))
            .await;
    }
}

/// `TRUST_AB=1`: every other round notes an unrelated change through the broker's own lock
/// store before each fetch (untimed), so that the fetch's pass cannot trust its scan hint and
/// reads the lease and the change log first, as every pass did before hints were trusted. The
/// two kinds of round alternate in one process, on the same data, so the machine's drift falls
/// on both alike.
fn trust_ab() -> bool {
    std::env::var_os("TRUST_AB").is_some_and(|v| v != "0")
}

/// `PAUSE_AB=MS`: every other round waits MS ms (untimed) between the round's traffic and its
/// first fetch, and the first fetches of the two kinds of round are reported apart: how much of
/// the first fetch's cost is the broker's own work on the round's changes and inserts, which it
/// does right then.
fn pause_ab() -> Option<std::time::Duration> {
    std::env::var("PAUSE_AB")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(std::time::Duration::from_millis)
}

/// `WARM_AB=1`: every other round makes one untimed Heartbeat call (gRPC to the broker, one
/// Redis call there) right before its first fetch, and the first fetches of the two kinds of
/// round are reported apart: how much of the first fetch's extra cost is any first call after
/// the round's traffic (client, network, the broker's runtime, Redis), rather than the pass's own
/// work on what changed.
fn warm_ab() -> bool {
    std::env::var_os("WARM_AB").is_some_and(|v| v != "0")
}

async fn broker_rounds(
    broker: &dispatch_broker::server::Running,
    fleet: &[Worker],
    helper: &mut Helper,
    db: &tokio_postgres::Client,
    requeue: bool,
) -> Cell {
    let stats = &broker.stats;
    reset_statements(db).await;
    let before = stats.snapshot();
    let mut fetch_ms = Vec::new();
    let mut untrusted_ms = Vec::new();
    let (mut first_paused, mut first_unpaused) = (Vec::new(), Vec::new());
    let (mut first_warmed, mut first_cold) = (Vec::new(), Vec::new());
    let (mut first_quiet, mut first_python) = (Vec::new(), Vec::new());
    let mut warm_client = match warm_ab() {
        true => Some(
            dispatch_broker::proto::broker_client::BrokerClient::connect(format!(
                "http://{}",
                broker.addr
            ))
            .await
            .expect("a client to warm with"),
        ),
        false => None,
    };
    let mut fetched = 0;
    let mut steps = [Steps::default(); 2];
    for round in 0..ROUNDS {
        let mut held: Vec<TaskGuard> = Vec::new();
        let untrusted = trust_ab() && round % 2 == 1;
        let paused = pause_ab().filter(|_| round % 2 == 1);
        if let Some(pause) = paused {
            tokio::time::sleep(pause).await;
        }
        let warmed = warm_ab() && round % 2 == 1;
        if let (true, Some(client)) = (warmed, warm_client.as_mut()) {
            client
                .heartbeat(dispatch_broker::proto::HeartbeatRequest {
                    lease_id: fleet[0].lease_id(),
                    ..Default::default()
                })
                .await
                .expect("Heartbeat");
        }
        for (i, worker) in fleet.iter().enumerate() {
            if untrusted {
                broker
                    .locks
                    .note_changes(&["bench:no-trust"])
                    .await
                    .expect("note a change");
            }
            let step_before = stats.snapshot();
            let started = Instant::now();
            let task = if requeue {
                worker.next_task(Duration::ZERO).await
            } else {
                worker.next_task_started(Duration::ZERO).await
            }
            .expect("FetchTask");
            let ms = started.elapsed().as_secs_f64() * 1000.0;
            // (A pass answers once its grant is made; its counts are complete once it ended.)
            broker.passes.idle().await;
            steps[usize::from(i != 0)].add(&(stats.snapshot() - step_before));
            if slow_ms().is_some_and(|slow| ms >= slow) {
                eprintln!(
                    "    slow fetch: round {round}, fetch {i} of the round, {ms:.2} ms, ended {}",
                    chrono::Utc::now().format("%H:%M:%S%.3f")
                );
            }
            if untrusted {
                untrusted_ms.push(ms);
            } else {
                fetch_ms.push(ms);
            }
            if i == 0 && pause_ab().is_some() {
                if paused.is_some() {
                    first_paused.push(ms);
                } else {
                    first_unpaused.push(ms);
                }
            }
            if i == 0 && quiet_ab() && round > 0 {
                if round % 2 == 1 {
                    first_quiet.push(ms);
                } else {
                    first_python.push(ms);
                }
            }
            if i == 0 && warm_ab() {
                if warmed {
                    first_warmed.push(ms);
                } else {
                    first_cold.push(ms);
                }
            }
            held.extend(task);
        }
        fetched += held.len();
        for task in held {
            if requeue {
                task.release().await.expect("ReleaseLocks");
            } else {
                task.finish(FinalState::Completed, None)
                    .await
                    .expect("FinishTask");
            }
        }
        if quiet_ab() && round % 2 == 0 {
            quiet_traffic(db, round).await;
        } else {
            traffic(helper, round).await;
        }
    }
    if quiet_ab() {
        let (q50, q99) = summary(first_quiet);
        let (p50, p99) = summary(first_python);
        eprintln!(
            "    QUIET_AB: first fetch of a round {p50:.2} / {p99:.2} ms after pulpcore's \
             dispatch(), {q50:.2} / {q99:.2} ms after the same inserts from Rust (median / p99)"
        );
    }
    if trust_ab() {
        let (t50, t99) = summary(fetch_ms.clone());
        let (u50, u99) = summary(untrusted_ms);
        eprintln!(
            "    TRUST_AB: rounds that may trust their hint {t50:.2} / {t99:.2} ms, rounds that \
             may not {u50:.2} / {u99:.2} ms (median / p99), {:.3} ms ({:.1}%) saved at the median",
            u50 - t50,
            (u50 - t50) / u50 * 100.0
        );
    }
    if let Some(pause) = pause_ab() {
        let (p50, p99) = summary(first_paused);
        let (u50, u99) = summary(first_unpaused);
        eprintln!(
            "    PAUSE_AB: first fetch of a round {u50:.2} / {u99:.2} ms right after its traffic, \
             {p50:.2} / {p99:.2} ms {} ms after it (median / p99, 10 each)",
            pause.as_millis()
        );
    }
    if warm_ab() {
        let (w50, w99) = summary(first_warmed);
        let (c50, c99) = summary(first_cold);
        eprintln!(
            "    WARM_AB: first fetch of a round {c50:.2} / {c99:.2} ms right after its traffic, \
             {w50:.2} / {w99:.2} ms after a Heartbeat (median / p99, 10 each)"
        );
    }
    let counted = stats.snapshot() - before;
    let mut costs = broker_costs(db).await;
    costs.passes = counted.fetch_passes;
    costs.pass_redis_calls = counted.fetch_redis_calls;
    costs.hints_trusted = counted.hints_trusted;
    costs.own_changes = counted.own_changes;
    costs.pages_carried = counted.pages_carried;
    Cell {
        fetch_ms,
        fetched,
        costs: Some(costs),
        steps,
    }
}

async fn pulpcore_rounds(helper: &mut Helper, requeue: bool) -> Cell {
    let mode = if requeue { "requeue" } else { "finish" };
    let mut fetch_ms = Vec::new();
    let mut fetched = 0;
    for round in 0..ROUNDS {
        let answer = helper
            .call(json!({"op": "baseline_round", "mode": mode}))
            .await;
        fetch_ms.extend(
            answer["ms"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap()),
        );
        fetched += answer["fetched"].as_u64().unwrap() as usize;
        traffic(helper, round).await;
    }
    Cell {
        fetch_ms,
        fetched,
        costs: None,
        steps: Default::default(),
    }
}

/// Inserts a task as pulpcore's dispatch does (every NOT NULL column, the insert trigger on).
async fn insert_head(db: &tokio_postgres::Client, domain: &str) {
    db.execute(
        "INSERT INTO core_task (pulp_id, pulp_created, pulp_last_updated, state, name, logging_cid, \
             reserved_resources_record, pulp_domain_id, versions, immediate, deferred, pulp_api_version) \
         SELECT gen_random_uuid(), now(), now(), 'waiting', 'pulpcore.app.tasks.test.sleep', 'bench', \
                ARRAY[$1, 'shared:' || $2], d.pulp_id, hstore('core', '3.123.1'), false, true, 'v3' \
         FROM core_domain d WHERE d.name = 'default'",
        &[&R0, &domain],
    )
    .await
    .unwrap();
}

/// The backlog on R0 and the other repositories' tasks behind it, the insert trigger off.
async fn insert_backlog(db: &tokio_postgres::Client, blocked: usize, domain: &str) {
    let insert = |count: usize, record: String| {
        format!(
            "INSERT INTO core_task (pulp_id, pulp_created, pulp_last_updated, state, name, logging_cid, \
                 reserved_resources_record, pulp_domain_id, versions, immediate, deferred, pulp_api_version) \
             SELECT gen_random_uuid(), clock_timestamp(), now(), 'waiting', 'pulpcore.app.tasks.test.sleep', \
                    'bench', {record}, d.pulp_id, hstore('core', '3.123.1'), false, true, 'v3' \
             FROM core_domain d, generate_series(1, {count}) AS i WHERE d.name = 'default';"
        )
    };
    db.batch_execute(&format!(
        "BEGIN; SET LOCAL session_replication_role = replica; {} {} COMMIT;",
        insert(blocked, format!("ARRAY['{R0}', 'shared:{domain}']")),
        insert(
            OTHERS,
            format!("ARRAY['prn:file.filerepository:O' || i, 'shared:{domain}']")
        ),
    ))
    .await
    .unwrap();
}

/// `PULPCORE=0`: the broker's rounds only (pulpcore's fetch_task takes about a second per call
/// at 1,000,000 blocked); `PULPCORE=first`: pulpcore's rounds in each size's first cell only
/// (pending list on, finish).
fn skip_pulpcore(first_cell: bool) -> bool {
    match std::env::var("PULPCORE").as_deref() {
        Ok("0") => true,
        Ok("first") => !first_cell,
        _ => false,
    }
}

/// `SLOW=MS`: print every broker fetch that took at least MS milliseconds, with its round.
fn slow_ms() -> Option<f64> {
    std::env::var("SLOW").ok().and_then(|v| v.parse().ok())
}

/// The bench process's resident memory (broker, resource queues and clients together), in MB.
fn rss_mb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb / 1024)
}

fn ensure_pulp() -> PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let status = std::process::Command::new(format!("{root}/scripts/ensure-pulp.sh"))
        .status()
        .expect("run scripts/ensure-pulp.sh");
    assert!(status.success(), "scripts/ensure-pulp.sh failed");
    PathBuf::from(format!("{root}/target/pulp-venv/bin"))
}

struct Row {
    blocked: usize,
    pending: &'static str,
    mode: &'static str,
    pulpcore: Cell,
    broker: Cell,
}

async fn run_size(
    pg: &Postgres,
    redis: &Redis,
    venv: &std::path::Path,
    work: &std::path::Path,
    blocked: usize,
) -> Vec<Row> {
    let name = format!("pulp_{blocked}");
    pg.psql("postgres", &format!("CREATE DATABASE {name} TEMPLATE pulp"))
        .unwrap();
    let url = pg.url(&name);
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let _ = std::process::Command::new("redis-cli")
        .args(["-u", &redis.url(), "FLUSHALL"])
        .output();
    let port: u16 = url
        .rsplit(':')
        .next()
        .and_then(|p| p.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap();
    let env = pulp_env(port, &name, &redis.url(), work);
    let mut helper = Helper::start(&venv.join("python"), &env).await;
    let install = helper.call(json!({"op": "domain"})).await;
    let domain = install["prn"].as_str().unwrap().to_owned();
    let versions: BTreeMap<String, String> =
        serde_json::from_value(install["versions"].clone()).unwrap();
    let config = |name: String| {
        let mut config = WorkerConfig::new(name);
        config.versions = versions.clone();
        config
    };

    insert_head(&db, &domain).await;
    let broker_url = url.replacen("postgres@", &format!("{BROKER_ROLE}@"), 1);
    let args = ServeArgs::with_urls(&broker_url, &redis.url());
    let broker = dispatch_broker::server::start(&args).await.unwrap();
    let endpoint = format!("http://{}", broker.addr);
    let holder = Worker::connect(&endpoint, config("head-holder".to_owned()))
        .await
        .unwrap();
    let head = holder
        .next_task_started(Duration::ZERO)
        .await
        .unwrap()
        .expect("the head task");
    let started = Instant::now();
    insert_backlog(&db, blocked, &domain).await;
    eprintln!(
        "N = {blocked}: backlog inserted in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // A backlog that arrived over time would have been merged into the GIN index as it came
    // (the broker merges the pending list every second); this one arrived in one statement, so
    // the rounds start after the broker's next merge, not in the middle of it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Likewise the broker's resource queues read arrivals every second: the rounds start once
    // they hold the backlog (as they would a backlog that built up over time).
    let settling = Instant::now();
    broker.resource_queues.settle().await.unwrap();
    eprintln!(
        "  resource queues: {} tasks, caught up {:.1} s after the wait; bench process RSS {} MB",
        broker.resource_queues.task_count().unwrap_or(0),
        settling.elapsed().as_secs_f64(),
        rss_mb()
    );
    helper
        .call(json!({"op": "baseline_setup", "head": head.id(), "workers": WORKERS}))
        .await;
    let mut fleet = Vec::new();
    for i in 0..WORKERS {
        fleet.push(
            Worker::connect(&endpoint, config(format!("bench-{i}")))
                .await
                .unwrap(),
        );
    }

    let mut rows = Vec::new();
    for pending in ["on", "off"] {
        if pending == "off" {
            db.batch_execute(include_str!("../src/tasks/gin_fastupdate.sql"))
                .await
                .unwrap();
        }
        for (mode, requeue) in [("finish", false), ("requeue", true)] {
            let first_cell = pending == "on" && !requeue;
            let pulpcore = if skip_pulpcore(first_cell) {
                Cell {
                    fetch_ms: Vec::new(),
                    fetched: 0,
                    costs: None,
                    steps: Default::default(),
                }
            } else {
                pulpcore_rounds(&mut helper, requeue).await
            };
            let broker_cell = broker_rounds(&broker, &fleet, &mut helper, &db, requeue).await;
            let row = Row {
                blocked,
                pending,
                mode,
                pulpcore,
                broker: broker_cell,
            };
            print_row(&row);
            rows.push(row);
        }
    }
    // R0's queue moves: its head finishes, and each round hands out R0's next task beside the
    // other domain's. Broker only: pulpcore's side still holds R0's lock in its own Redis
    // locks (baseline_setup), so its fetch_task would not see the same queue.
    let moving = match head.finish(FinalState::Completed, None).await {
        Ok(_) => "finish, R0 moving",
        Err(e) => {
            // Its lease lapsed during the run: the sweeper failed it, and R0's queue moves
            // already.
            eprintln!("  the head task's lease lapsed during the run: {e}");
            "finish, R0 moving (head lapsed)"
        }
    };
    let broker_cell = broker_rounds(&broker, &fleet, &mut helper, &db, false).await;
    let row = Row {
        blocked,
        pending: "off",
        mode: moving,
        pulpcore: Cell {
            fetch_ms: Vec::new(),
            fetched: 0,
            costs: None,
            steps: Default::default(),
        },
        broker: broker_cell,
    };
    print_row(&row);
    rows.push(row);
    // One full pass of the lane gauge over this backlog, as the broker makes it (a
    // maintained pass in between reads only what changed).
    let started = Instant::now();
    match broker.lanes.compute(true).await {
        Ok(_) => eprintln!(
            "  lane gauge: one full pass at {blocked} blocked took {:.1} ms",
            started.elapsed().as_secs_f64() * 1000.0
        ),
        Err(e) => eprintln!(
            "  lane gauge: one full pass at {blocked} blocked failed after {:.1} ms: {e}",
            started.elapsed().as_secs_f64() * 1000.0
        ),
    }
    for worker in &fleet {
        worker.close().await.unwrap();
    }
    holder.close().await.unwrap();
    helper.stop().await;
    broker.shutdown().await.unwrap();
    if std::env::var_os("EXPLAIN").is_some() {
        let data: String = db
            .query_one("SHOW data_directory", &[])
            .await
            .unwrap()
            .get(0);
        let log = std::path::Path::new(&data).with_file_name("postgres.log");
        eprintln!("{}", std::fs::read_to_string(log).unwrap_or_default());
    }
    rows
}

fn print_row(row: &Row) {
    let (pp50, pp99) = summary(row.pulpcore.fetch_ms.clone());
    let (bp50, bp99) = summary(row.broker.fetch_ms.clone());
    let calls = row.broker.fetch_ms.len().max(1) as f64;
    let costs = row.broker.costs.as_ref();
    eprintln!(
        "  pending list {}, {}: pulpcore {:.2} / {:.2} ms ({} tasks), broker {:.2} / {:.2} ms ({} tasks), {:.1}x",
        row.pending,
        row.mode,
        pp50,
        pp99,
        row.pulpcore.fetched,
        bp50,
        bp99,
        row.broker.fetched,
        pp50 / bp50
    );
    // The first fetch of each round comes after the round's traffic, when the machine's
    // processes have been waiting for Python: every step of it is slower (see
    // benches/results/pulp.md, "The first fetch of each round").
    let split = |ms: &[f64]| {
        let first: Vec<f64> = ms.iter().step_by(WORKERS).copied().collect();
        let rest: Vec<f64> = ms
            .iter()
            .enumerate()
            .filter(|(i, _)| i % WORKERS != 0)
            .map(|(_, m)| *m)
            .collect();
        (summary(first), summary(rest))
    };
    let ((fp50, fp99), (rp50, rp99)) = split(&row.broker.fetch_ms);
    eprintln!(
        "    broker, first fetch of each round: {fp50:.2} / {fp99:.2} ms; the other {}: \
         {rp50:.2} / {rp99:.2} ms",
        WORKERS - 1
    );
    eprintln!(
        "    broker, per fetch: the first of each round {}",
        row.broker.steps[0].line()
    );
    eprintln!(
        "    broker, per fetch: the other {} {}",
        WORKERS - 1,
        row.broker.steps[1].line()
    );
    if let Some(c) = costs {
        eprintln!(
            "    broker role: {:.1} statements and {:.0} buffers per fetch \
             (and {:.1} BEGIN / settings / COMMIT sent with reads)",
            c.statements / calls,
            c.buffers / calls,
            c.control / calls
        );
        eprintln!(
            "    broker: {} fetch passes, {:.1} Redis calls per pass, {} passes trusted their \
             scan hint, {} took this replica's own changes, {} judged a carried page",
            c.passes,
            c.pass_redis_calls as f64 / c.passes.max(1) as f64,
            c.hints_trusted,
            c.own_changes,
            c.pages_carried
        );
        eprintln!(
            "    lane gauge during the rounds: {} statements, {:.1} ms in all",
            c.lane_calls, c.lane_ms
        );
        for (text, n, mean, buffers) in c.top.iter().take(6) {
            eprintln!("      {n:>5} x {mean:>7.3} ms {buffers:>8.1} buffers  {text}");
        }
    }
}

#[tokio::main]
async fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1_000, 17_000, 100_000, 1_000_000]
    } else {
        sizes
    };
    let venv = tokio::task::spawn_blocking(ensure_pulp).await.unwrap();
    eprintln!("starting throwaway PostgreSQL and Redis ...");
    let (mut pg, redis) =
        tokio::task::spawn_blocking(|| (Postgres::start().unwrap(), Redis::start().unwrap()))
            .await
            .unwrap();
    // EXPLAIN=MS: auto_explain logs the plans of the broker's statements slower than MS (with
    // buffers) to the throwaway cluster's log, which is printed after each backlog size.
    let explain = std::env::var("EXPLAIN").ok();
    pg.psql(
        "postgres",
        "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'",
    )
    .unwrap();
    // Durable, as a deployment's database is (the test clusters run without fsync): every
    // commit, the broker's claims and pulpcore's alike, waits for its WAL to reach the disk.
    for setting in ["fsync", "full_page_writes"] {
        pg.psql("postgres", &format!("ALTER SYSTEM SET {setting} = on"))
            .unwrap();
    }
    pg.restart().unwrap();
    let durable: String = pg.psql("postgres", "SHOW fsync").unwrap();
    assert_eq!(
        durable.trim(),
        "on",
        "the benchmark's cluster runs with fsync on"
    );
    pg.psql(
        "postgres",
        &format!("CREATE ROLE {BROKER_ROLE} LOGIN SUPERUSER"),
    )
    .unwrap();
    if let Some(ms) = &explain {
        pg.psql(
            "postgres",
            &format!(
                "ALTER ROLE {BROKER_ROLE} SET session_preload_libraries = 'auto_explain'; \
                 ALTER ROLE {BROKER_ROLE} SET auto_explain.log_min_duration = '{ms}ms'; \
                 ALTER ROLE {BROKER_ROLE} SET auto_explain.log_analyze = on; \
                 ALTER ROLE {BROKER_ROLE} SET auto_explain.log_buffers = on"
            ),
        )
        .unwrap();
        // With the time of each line, and autovacuum's work, to set beside the slow fetches.
        for setting in [
            "ALTER SYSTEM SET log_autovacuum_min_duration = 0",
            "ALTER SYSTEM SET log_line_prefix = '%m [%p] '",
            "SELECT pg_reload_conf()",
        ] {
            pg.psql("postgres", setting).unwrap();
        }
    }
    pg.create_database("pulp").unwrap();
    let work = tempfile::tempdir().unwrap();
    let port: u16 = pg
        .url("pulp")
        .rsplit(':')
        .next()
        .and_then(|p| p.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap();
    eprintln!("pulpcore-manager migrate ...");
    let migrate = std::process::Command::new(venv.join("pulpcore-manager"))
        .args(["migrate", "--noinput"])
        .envs(pulp_env(port, "pulp", &redis.url(), work.path()))
        .output()
        .expect("run pulpcore-manager");
    assert!(
        migrate.status.success(),
        "pulpcore-manager migrate: {}",
        String::from_utf8_lossy(&migrate.stderr)
    );
    pg.psql("pulp", "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .unwrap();

    let mut rows = Vec::new();
    for blocked in sizes {
        rows.extend(run_size(&pg, &redis, &venv, work.path(), blocked).await);
    }
    println!("\nFetch latency, {WORKERS} workers x {ROUNDS} rounds per cell (ms, median / p99):\n");
    println!("| blocked | GIN pending list | traffic | pulpcore fetch_task | broker FetchTask | ratio (median) | broker statements / fetch | buffers / fetch |");
    println!("|---:|---|---|---:|---:|---:|---:|---:|");
    for row in &rows {
        let (pp50, pp99) = summary(row.pulpcore.fetch_ms.clone());
        let (bp50, bp99) = summary(row.broker.fetch_ms.clone());
        let calls = row.broker.fetch_ms.len().max(1) as f64;
        let (statements, buffers) = row
            .broker
            .costs
            .as_ref()
            .map(|c| (c.statements / calls, c.buffers / calls))
            .unwrap_or_default();
        println!(
            "| {} | {} | {} | {pp50:.2} / {pp99:.2} | {bp50:.2} / {bp99:.2} | {:.1}x | {statements:.1} | {buffers:.0} |",
            row.blocked,
            row.pending,
            row.mode,
            pp50 / bp50
        );
    }
}
