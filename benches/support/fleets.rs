//! What the benchmarks share: the two fleets (broker workers on the crate's worker library, and
//! the baseline that does what Pulp's Redis worker does today), percentiles and formatting.
//!
//! The baseline worker loop: query the head of the task table itself (FIFO, batches of 20), skip
//! tasks that conflict with an older task of the same batch, take the task's Redis locks (one
//! script: exclusive and shared, all or nothing), claim it in Postgres, run it, mark it completed,
//! release the locks; sleep workers x 10 ms (+ 0.5-1.5 ms jitter) when a batch gave nothing.

#![allow(dead_code)] // Each bench uses its own part of this module.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deadpool_redis::redis;
use dispatch_worker::{FinalState, Worker, WorkerConfig};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use uuid::Uuid;

/// Connections the baseline fleet shares (Pulp's workers each have their own; on a 2-core box a
/// few hundred backends would measure Postgres's process count, not the polling).
const BASELINE_CONNECTIONS: usize = 20;

/// A task a worker ran: which one, its name (the benches put the domain there), when the worker
/// received it and when it was done.
#[derive(Debug, Clone)]
pub struct Receipt {
    pub id: Uuid,
    pub name: String,
    pub received: Instant,
    pub done: Instant,
}

/// What a fleet measured about itself.
#[derive(Debug, Default)]
pub struct FleetStats {
    /// Fetches that returned a task: (task name, how long the fetch took).
    pub fetches: Mutex<Vec<(String, Duration)>>,
    /// Fetch attempts (polls) that found nothing, and how long each took.
    pub empty_fetches: Mutex<Vec<Duration>>,
    /// Time spent running tasks, in nanoseconds.
    pub busy_nanos: AtomicU64,
    /// Postgres statements the baseline workers sent (the broker counts its own).
    pub statements: AtomicU64,
    /// Calls of broker workers that failed (the worker waits 100 ms and goes on).
    pub errors: AtomicU64,
}

impl FleetStats {
    fn fetched(&self, name: &str, took: Duration) {
        if let Ok(mut f) = self.fetches.lock() {
            f.push((name.to_owned(), took));
        }
    }

    /// Counts a failed call (and says what failed, the first few times).
    pub fn failed(&self, e: &dyn std::fmt::Display) {
        if self.errors.fetch_add(1, Ordering::Relaxed) < 5 {
            eprintln!("  a worker's call failed: {e}");
        }
    }

    fn empty(&self, took: Duration) {
        if let Ok(mut f) = self.empty_fetches.lock() {
            f.push(took);
        }
    }

    /// Sorted durations of the fetch attempts that found nothing.
    pub fn empty_times(&self) -> Vec<Duration> {
        let mut out = self.empty_fetches.lock().unwrap().clone();
        out.sort();
        out
    }

    /// Sorted fetch durations of tasks whose name `keep` accepts.
    pub fn fetch_times(&self, keep: impl Fn(&str) -> bool) -> Vec<Duration> {
        let mut out: Vec<Duration> = self
            .fetches
            .lock()
            .unwrap()
            .iter()
            .filter(|(n, _)| keep(n))
            .map(|(_, d)| *d)
            .collect();
        out.sort();
        out
    }
}

/// A running fleet; [`Fleet::stop`] ends it.
pub struct Fleet {
    pub stats: Arc<FleetStats>,
    stop: Arc<AtomicBool>,
    workers: Vec<Worker>,
    handles: Vec<JoinHandle<()>>,
}

impl Fleet {
    /// Stops every worker (a broker worker's long poll ends at once) and waits for them.
    pub async fn stop(self) {
        let errors = self.stats.errors.load(Ordering::Relaxed);
        if errors > 0 {
            eprintln!("  this fleet's workers met {errors} failed calls");
        }
        self.stop.store(true, Ordering::SeqCst);
        for w in &self.workers {
            w.stop();
        }
        for h in self.handles {
            h.await.unwrap();
        }
        // Leases end now (their heartbeats stop): the next phase measures its own fleet, not the
        // sweep of this one's expired leases.
        for w in &self.workers {
            let _ = w.close().await;
        }
    }
}

pub fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    Some(sorted[((sorted.len() as f64 - 1.0) * p).round() as usize])
}

pub fn ms(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.2} ms", d.as_secs_f64() * 1e3),
        None => "none".into(),
    }
}

/// `baseline / broker` as `N.Nx`, or a dash when either is missing.
pub fn ratio(broker: Option<f64>, baseline: Option<f64>) -> String {
    match (broker, baseline) {
        (Some(b), Some(r)) if b > 0.0 => format!("{:.1}x", r / b),
        _ => "-".into(),
    }
}

/// The number of the next broker worker (its name).
static NEXT_WORKER: AtomicUsize = AtomicUsize::new(0);

/// Broker workers: long-poll `next_task` (30 s), run the task for `work`, finish it. With
/// `start` the fetch also starts the task (`next_task_started`: one call, as the baseline claims
/// and starts in one statement); otherwise a StartTask call follows.
pub async fn broker_fleet(
    endpoint: &str,
    n: usize,
    work: Duration,
    start: bool,
    receipts: mpsc::UnboundedSender<Receipt>,
) -> Fleet {
    let stop = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(FleetStats::default());
    let mut handles = Vec::new();
    let mut workers = Vec::new();
    // Every worker connects at once, as a fleet scaled up does (names go on across fleets).
    let first = NEXT_WORKER.fetch_add(n, Ordering::Relaxed);
    let connected = futures::future::join_all(
        (first..first + n)
            .map(|w| Worker::connect(endpoint, WorkerConfig::new(format!("bench-{w}")))),
    )
    .await;
    for worker in connected {
        let worker = worker.unwrap();
        workers.push(worker.clone());
        let (receipts, stop, stats) = (receipts.clone(), Arc::clone(&stop), Arc::clone(&stats));
        handles.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let asked = Instant::now();
                let next = if start {
                    worker.next_task_started(Duration::from_secs(30)).await
                } else {
                    worker.next_task(Duration::from_secs(30)).await
                };
                match next {
                    Ok(Some(task)) => {
                        let received = Instant::now();
                        stats.fetched(&task.task().name, received - asked);
                        if let Err(e) = task.start().await {
                            stats.failed(&e);
                            continue;
                        }
                        if !work.is_zero() {
                            tokio::time::sleep(work).await;
                        }
                        stats
                            .busy_nanos
                            .fetch_add(received.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        let (id, name) = (task.id().parse().unwrap(), task.task().name.clone());
                        // A finish that fails in passing is retried in the background by the
                        // library: the task ran either way.
                        if let Err(e) = task.finish(FinalState::Completed, None).await {
                            stats.failed(&e);
                        }
                        let _ = receipts.send(Receipt {
                            id,
                            name,
                            received,
                            done: Instant::now(),
                        });
                    }
                    Ok(None) => stats.empty(asked.elapsed()),
                    Err(_) if stop.load(Ordering::SeqCst) => {}
                    Err(e) => {
                        stats.failed(&e);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            worker.close().await.unwrap();
        }));
    }
    Fleet {
        stats,
        stop,
        workers,
        handles,
    }
}

/// Takes a task's locks: exclusive keys must be free and have no sharers, shared ones must have
/// no exclusive holder. All or nothing.
const BASELINE_LOCK: &str = r#"
for _, r in ipairs(ARGV) do
  local mode, name = string.sub(r, 1, 1), string.sub(r, 3)
  if redis.call('EXISTS', 'baseline:x:' .. name) == 1 then return 0 end
  if mode == 'x' and redis.call('SCARD', 'baseline:s:' .. name) > 0 then return 0 end
end
for _, r in ipairs(ARGV) do
  local mode, name = string.sub(r, 1, 1), string.sub(r, 3)
  if mode == 'x' then redis.call('SET', 'baseline:x:' .. name, KEYS[1])
  else redis.call('SADD', 'baseline:s:' .. name, KEYS[1]) end
end
return 1
"#;

const BASELINE_UNLOCK: &str = r#"
for _, r in ipairs(ARGV) do
  local mode, name = string.sub(r, 1, 1), string.sub(r, 3)
  if mode == 'x' then redis.call('DEL', 'baseline:x:' .. name)
  else redis.call('SREM', 'baseline:s:' .. name, KEYS[1]) end
end
return 1
"#;

/// `x:name` / `s:name` for the lock scripts, from a reserved-resources record.
pub fn baseline_lock_args(record: &[String]) -> Vec<String> {
    record
        .iter()
        .map(|r| match r.strip_prefix("shared:") {
            Some(name) => format!("s:{name}"),
            None => format!("x:{r}"),
        })
        .collect()
}

/// Takes (`lock`) or drops the baseline's locks for `holder`.
pub async fn baseline_locks(
    redis: &mut deadpool_redis::Connection,
    holder: &str,
    args: &[String],
    lock: bool,
) -> bool {
    let script = redis::Script::new(if lock { BASELINE_LOCK } else { BASELINE_UNLOCK });
    let ok: i64 = script
        .key(holder)
        .arg(args)
        .invoke_async(redis)
        .await
        .unwrap();
    ok == 1
}

/// A task a baseline poll claimed: its id, name and lock arguments.
pub struct BaselineClaim {
    pub id: Uuid,
    pub name: String,
    args: Vec<String>,
}

/// A baseline connection with its statements prepared once, so each runs as one round trip and
/// one transaction (as a Pulp worker's do; a statement given as text would be prepared on every
/// call: two of each).
pub struct BaselineDb {
    client: tokio_postgres::Client,
    head: tokio_postgres::Statement,
    claim: tokio_postgres::Statement,
    complete: tokio_postgres::Statement,
}

impl BaselineDb {
    pub async fn connect(url: &str) -> BaselineDb {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let head = client
            .prepare(
                "SELECT pulp_id, name, coalesce(reserved_resources_record, '{}') FROM core_task \
                 WHERE state = 'waiting' AND app_lock_id IS NULL ORDER BY pulp_created LIMIT 20",
            )
            .await
            .unwrap();
        let claim = client
            .prepare(
                "UPDATE core_task SET app_lock_id = $2, state = 'running', started_at = now() \
                 WHERE pulp_id = $1 AND state = 'waiting' AND app_lock_id IS NULL",
            )
            .await
            .unwrap();
        let complete = client
            .prepare(
                "UPDATE core_task SET state = 'completed', finished_at = now() WHERE pulp_id = $1",
            )
            .await
            .unwrap();
        BaselineDb {
            client,
            head,
            claim,
            complete,
        }
    }

    /// Registers a baseline worker's `core_appstatus` row.
    pub async fn register(&self, app_status: Uuid, name: &str) {
        self.client
            .execute(
                "INSERT INTO core_appstatus (pulp_id, app_type, name, ttl) \
                 VALUES ($1, 'worker', $2, interval '30 seconds')",
                &[&app_status, &name],
            )
            .await
            .unwrap();
    }
}

/// One poll of a baseline worker: reads the head of the task table, skips tasks that conflict
/// with an older one of the batch, takes the first free task's locks and claims it.
pub async fn baseline_poll(
    db: &BaselineDb,
    redis: &mut deadpool_redis::Connection,
    name: &str,
    app_status: Uuid,
    stats: &FleetStats,
) -> Option<BaselineClaim> {
    let rows = db.client.query(&db.head, &[]).await.unwrap();
    stats.statements.fetch_add(1, Ordering::Relaxed);
    // Resources of older tasks in this batch, by mode: a newer task conflicting with one is
    // skipped.
    let mut exclusive: Vec<String> = Vec::new();
    let mut shared: Vec<String> = Vec::new();
    for row in rows {
        let id: Uuid = row.get(0);
        let task_name: String = row.get(1);
        let record: Vec<String> = row.get(2);
        let args = baseline_lock_args(&record);
        let conflict = args.iter().any(|a| {
            let n = &a[2..];
            exclusive.iter().any(|e| e == n)
                || (a.starts_with('x') && shared.iter().any(|s| s == n))
        });
        for a in &args {
            if a.starts_with('x') {
                exclusive.push(a[2..].to_owned());
            } else {
                shared.push(a[2..].to_owned());
            }
        }
        if conflict || !baseline_locks(redis, name, &args, true).await {
            continue;
        }
        let claimed = db
            .client
            .execute(&db.claim, &[&id, &app_status])
            .await
            .unwrap();
        stats.statements.fetch_add(1, Ordering::Relaxed);
        if claimed == 1 {
            return Some(BaselineClaim {
                id,
                name: task_name,
                args,
            });
        }
        baseline_locks(redis, name, &args, false).await;
    }
    None
}

/// Marks a claimed task completed and drops its locks, as a baseline worker does.
pub async fn baseline_finish(
    db: &BaselineDb,
    redis: &mut deadpool_redis::Connection,
    name: &str,
    claim: &BaselineClaim,
    stats: &FleetStats,
) {
    db.client.execute(&db.complete, &[&claim.id]).await.unwrap();
    stats.statements.fetch_add(1, Ordering::Relaxed);
    baseline_locks(redis, name, &claim.args, false).await;
}

/// Baseline workers running now, in every fleet: an idle worker sleeps this many times 10 ms,
/// as Pulp's workers scale their sleep with the workers online.
static BASELINE_ONLINE: AtomicUsize = AtomicUsize::new(0);

/// Counts a baseline worker online while it lives (also when it panics).
struct Online;

impl Online {
    fn new() -> Online {
        BASELINE_ONLINE.fetch_add(1, Ordering::Relaxed);
        Online
    }
}

impl Drop for Online {
    fn drop(&mut self) {
        BASELINE_ONLINE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One baseline worker.
#[allow(clippy::too_many_arguments)]
async fn baseline_worker(
    name: String,
    app_status: Uuid,
    work: Duration,
    db: Arc<BaselineDb>,
    mut redis: deadpool_redis::Connection,
    receipts: mpsc::UnboundedSender<Receipt>,
    stop: Arc<AtomicBool>,
    stats: Arc<FleetStats>,
) {
    let _online = Online::new();
    while !stop.load(Ordering::SeqCst) {
        let asked = Instant::now();
        match baseline_poll(&db, &mut redis, &name, app_status, &stats).await {
            Some(claim) => {
                let received = Instant::now();
                stats.fetched(&claim.name, received - asked);
                if !work.is_zero() {
                    tokio::time::sleep(work).await;
                }
                stats
                    .busy_nanos
                    .fetch_add(received.elapsed().as_nanos() as u64, Ordering::Relaxed);
                baseline_finish(&db, &mut redis, &name, &claim, &stats).await;
                let _ = receipts.send(Receipt {
                    id: claim.id,
                    name: claim.name,
                    received,
                    done: Instant::now(),
                });
            }
            None => {
                stats.empty(asked.elapsed());
                let jitter = 0.5 + rand::random::<f64>();
                let online = BASELINE_ONLINE.load(Ordering::Relaxed).max(1);
                tokio::time::sleep(Duration::from_secs_f64(
                    (online as f64 * 10.0 + jitter) / 1000.0,
                ))
                .await;
            }
        }
    }
}

/// Starts `n` baseline workers (each with its own `core_appstatus` row).
pub async fn baseline_fleet(
    url: &str,
    redis_url: &str,
    n: usize,
    work: Duration,
    receipts: mpsc::UnboundedSender<Receipt>,
) -> Fleet {
    baseline_fleet_counted(url, redis_url, n, work, receipts, Arc::default()).await
}

/// [`baseline_fleet`], counting in `stats` (which the caller may read while the workers start).
pub async fn baseline_fleet_counted(
    url: &str,
    redis_url: &str,
    n: usize,
    work: Duration,
    receipts: mpsc::UnboundedSender<Receipt>,
    stats: Arc<FleetStats>,
) -> Fleet {
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for _ in 0..BASELINE_CONNECTIONS.min(n) {
        clients.push(Arc::new(BaselineDb::connect(url).await));
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
            .register(app_status, &format!("baseline-{w}-{app_status}"))
            .await;
        let db = Arc::clone(&clients[w % clients.len()]);
        let redis = pool.get().await.unwrap();
        handles.push(tokio::spawn(baseline_worker(
            format!("baseline-{app_status}"),
            app_status,
            work,
            db,
            redis,
            receipts.clone(),
            Arc::clone(&stop),
            Arc::clone(&stats),
        )));
        // Workers start spread out, as a fleet does.
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    Fleet {
        stats,
        stop,
        workers: Vec::new(),
        handles,
    }
}

/// Empties Redis (between scenarios on one server).
pub fn redis_flush(url: &str) {
    let _ = std::process::Command::new("redis-cli")
        .args(["-u", url, "FLUSHALL"])
        .output();
}
