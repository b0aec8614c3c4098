//! The chaos checker: mutual exclusion (DESIGN.md invariant 6) and FIFO readiness while things
//! break.
//!
//! Two broker replicas (the real binary, as processes) share one throwaway PostgreSQL and Redis.
//! Tasks with random resource sets over a few resources (dense conflicts, shared and exclusive
//! mixed) are inserted while gRPC workers, spread over both replicas, fetch, hold a task for a
//! random time and finish it; some release instead, some skip the release and keep going, some
//! stop heartbeating (a crash), some close their lease mid-task. Each worker is a process (this
//! binary run with `--worker`, reporting what it sees on stdout). Faults at random moments: a
//! worker process killed with SIGKILL (and started again), a replica killed with SIGKILL and
//! restarted, Redis paused (SIGSTOP) for longer than a lease TTL, Redis killed and restarted
//! empty, PostgreSQL restarted.
//!
//! An independent checker records what the clients see and verifies afterwards, with no false
//! alarms (it uses only what the clients know for certain: a task was held at least from the
//! moment its grant arrived until the moment its holder last knew its lease was live or sent its
//! release):
//! - no two conflicting tasks were held at the same time;
//! - no task was handed out while an older conflicting task was still waiting for its first grant;
//! - fencing tokens strictly increase along each resource's grants;
//! - at the end every task is final or waiting, none is claimed or running, no lock is left.
//!
//! `cargo test --test chaos` runs a bounded version (24 s of traffic and faults, then the settling); `cargo test --test chaos --
//! --long [SECONDS] [--seed N]` runs longer and reports tasks, faults and violations. A violation
//! is printed with the seed and the timeline needed to reproduce it.

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dispatch_broker::proto::broker_client::BrokerClient;
use dispatch_broker::proto::*;
use dispatch_broker::states::TaskState;
use dispatch_testkit::{Postgres, Redis, Replica};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;
use tonic::Code;
use uuid::Uuid;

const RESOURCES: [&str; 6] = ["r0", "r1", "r2", "r3", "r4", "r5"];
const TTL: Duration = Duration::from_secs(1);
const HEARTBEAT: Duration = Duration::from_millis(250);
const WORKERS: usize = 8;

/// Time since the run began, in milliseconds, on the wall clock (worker processes share it).
#[derive(Clone, Copy)]
struct Clock(f64);

fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        * 1e3
}

impl Clock {
    fn ms(&self) -> f64 {
        unix_ms() - self.0
    }
}

/// Where a worker process reports what it sees: one line per event on stdout, read by the
/// checker in the parent.
struct Sink {
    next: std::sync::atomic::AtomicUsize,
}

impl Sink {
    fn grant(&self, h: &Held) -> usize {
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        println!(
            "G\t{i}\t{}\t{}\t{}\t{}\t{}\t{}",
            h.task,
            h.token,
            h.from,
            h.asked,
            h.exclusive.join(","),
            h.shared.join(",")
        );
        i
    }

    fn end(&self, i: usize, how: &str, until: f64) {
        println!("E\t{i}\t{until}\t{how}");
    }

    fn count(&self, what: &str) {
        println!("C\t{what}");
    }

    /// The current lease was live at least until `at`.
    fn live(&self, at: f64) {
        println!("L\t{at}");
    }
}

/// One grant as its holder saw it.
#[derive(Debug, Clone)]
struct Held {
    task: Uuid,
    worker: usize,
    token: u64,
    exclusive: Vec<String>,
    shared: Vec<String>,
    /// When the grant arrived (the server granted it before this).
    from: f64,
    /// The last moment the holder knew it still held it (the server released it after this).
    until: f64,
    /// When the FetchTask that returned it was sent.
    asked: f64,
    how: String,
}

impl Held {
    fn conflicts(&self, other: &Held) -> Vec<String> {
        let mut out = Vec::new();
        for r in &self.exclusive {
            if other.exclusive.contains(r) || other.shared.contains(r) {
                out.push(r.clone());
            }
        }
        for r in &self.shared {
            if other.exclusive.contains(r) {
                out.push(r.clone());
            }
        }
        out
    }
}

#[derive(Default)]
struct Record {
    held: Vec<Held>,
    faults: Vec<(f64, String)>,
    counts: BTreeMap<String, u64>,
}

type Shared = Arc<Mutex<Record>>;

/// Tasks inserted, in commit order, with their resource records.
type Created = Arc<Mutex<Vec<(Uuid, Vec<String>)>>>;

fn count(record: &Shared, what: &str) {
    *record
        .lock()
        .unwrap()
        .counts
        .entry(what.to_string())
        .or_default() += 1;
}

/// A replica of the real binary with the chaos run's short intervals; its log goes to the temporary
/// directory.
fn chaos_replica(pg_url: &str, redis_url: &str) -> Replica {
    let log = std::env::temp_dir().join(format!("dispatch-chaos-{}.log", Uuid::new_v4()));
    Replica::start(
        env!("CARGO_BIN_EXE_dispatch-broker"),
        pg_url,
        redis_url,
        &[
            "--lease-min-ttl",
            "200ms",
            "--sweep-interval",
            "200ms",
            "--fetch-recheck",
            "200ms",
            "--fetch-wake-poll",
            "50ms",
            "--backend-timeout",
            "500ms",
        ],
        log,
    )
    .unwrap()
}

async fn wait_serving(endpoint: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut c) = BrokerClient::connect(endpoint.to_string()).await {
            if let Err(s) = c
                .heartbeat(HeartbeatRequest {
                    lease_id: Uuid::new_v4().to_string(),
                    ..Default::default()
                })
                .await
            {
                if s.code() == Code::NotFound {
                    return;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "broker at {endpoint} did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a worker does with a task it holds.
#[derive(Clone, Copy, Debug)]
enum Behaviour {
    Finish,
    Release,
    /// Keeps the task (and its locks) without releasing it and fetches on; its lease is closed
    /// a few fetches later, which is what frees the task.
    SkipRelease,
    /// Stops heartbeating and never calls again: a crashed worker.
    Crash,
    /// Closes its lease while holding the task.
    CloseMidTask,
}

fn behaviour(rng: &mut StdRng) -> Behaviour {
    match rng.random_range(0..100) {
        0..75 => Behaviour::Finish,
        75..85 => Behaviour::Release,
        85..90 => Behaviour::SkipRelease,
        90..95 => Behaviour::Crash,
        _ => Behaviour::CloseMidTask,
    }
}

/// A lease with its heartbeat loop; `live_until` is the send time of the last acknowledged
/// heartbeat (or of OpenLease): the lease was live at least until then.
struct Lease {
    id: String,
    live_until: Arc<Mutex<f64>>,
    lost: Arc<std::sync::atomic::AtomicBool>,
    stop: tokio_util::sync::CancellationToken,
}

impl Lease {
    async fn open(
        client: &mut BrokerClient<Channel>,
        name: &str,
        clock: &Clock,
        sink: &Arc<Sink>,
    ) -> Option<Lease> {
        let sent = clock.ms();
        let lease = client
            .open_lease(OpenLeaseRequest {
                worker_name: name.into(),
                versions: Default::default(),
                ttl: Some(TTL.try_into().unwrap()),
                app_status_id: String::new(),
                open_id: String::new(),
            })
            .await
            .ok()?
            .into_inner();
        sink.live(sent);
        let live_until = Arc::new(Mutex::new(sent));
        let lost = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = tokio_util::sync::CancellationToken::new();
        let (mut c, id, clock, sink) = (
            client.clone(),
            lease.lease_id.clone(),
            *clock,
            Arc::clone(sink),
        );
        let (live, gone, stopped) = (Arc::clone(&live_until), Arc::clone(&lost), stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stopped.cancelled() => return,
                    _ = tokio::time::sleep(HEARTBEAT) => {}
                }
                let sent = clock.ms();
                let beat = tokio::time::timeout(
                    Duration::from_millis(400),
                    c.heartbeat(HeartbeatRequest {
                        lease_id: id.clone(),
                        ..Default::default()
                    }),
                )
                .await;
                match beat {
                    Ok(Ok(_)) => {
                        *live.lock().unwrap() = sent;
                        sink.live(sent);
                    }
                    Ok(Err(s)) if s.code() == Code::NotFound => {
                        gone.store(true, std::sync::atomic::Ordering::SeqCst);
                        return;
                    }
                    _ => {}
                }
            }
        });
        Some(Lease {
            id: lease.lease_id,
            live_until,
            lost,
            stop,
        })
    }

    /// Closes it (its heartbeats stop); returns until when it was certainly live.
    async fn close(&self, client: &mut BrokerClient<Channel>, clock: &Clock) -> f64 {
        let sent = clock.ms();
        self.stop.cancel();
        let request = CloseLeaseRequest {
            lease_id: self.id.clone(),
        };
        match client.close_lease(request).await {
            Ok(_) => sent,
            Err(_) => self.live_until().min(sent),
        }
    }

    fn live_until(&self) -> f64 {
        *self.live_until.lock().unwrap()
    }

    fn is_lost(&self) -> bool {
        self.lost.load(std::sync::atomic::Ordering::SeqCst)
    }
}

async fn worker(
    n: usize,
    endpoint: String,
    seed: u64,
    clock: Clock,
    sink: Arc<Sink>,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ (n as u64) << 32);
    let channel = Channel::from_shared(endpoint).unwrap().connect_lazy();
    let mut client = BrokerClient::new(channel);
    let name = format!("chaos-{n}");
    // Tasks kept without release under the current lease: (record index).
    let mut kept: Vec<usize> = Vec::new();
    let mut lease: Option<Lease> = None;
    while !stop.is_cancelled() {
        let current = match &lease {
            Some(l) if !l.is_lost() => l,
            _ => {
                // A lost lease ends what it kept at the last moment it was known live.
                if let Some(old) = lease.take() {
                    end_kept(&sink, &mut kept, old.live_until());
                    old.stop.cancel();
                }
                match Lease::open(&mut client, &name, &clock, &sink).await {
                    Some(l) => lease = Some(l),
                    None => tokio::time::sleep(Duration::from_millis(100)).await,
                }
                continue;
            }
        };
        if !kept.is_empty() && rng.random_bool(0.3) {
            // It forgot to release what it kept; the lease ending is what frees them.
            let until = current.close(&mut client, &clock).await;
            end_kept(&sink, &mut kept, until);
            lease = None;
            continue;
        }
        let asked = clock.ms();
        let fetched = tokio::time::timeout(
            Duration::from_secs(2),
            client.fetch_task(FetchTaskRequest {
                lease_id: current.id.clone(),
                wait: Some(Duration::from_millis(300).try_into().unwrap()),
                skip_task_ids: vec![],
                start: false,
            }),
        )
        .await;
        let task = match fetched {
            Ok(Ok(r)) => match r.into_inner().task {
                Some(t) => t,
                None => continue,
            },
            Ok(Err(s)) if s.code() == Code::NotFound => {
                current
                    .lost
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                continue;
            }
            Ok(Err(s)) => {
                sink.count(match s.code() {
                    Code::Unavailable => "fetch errors: UNAVAILABLE (retried)",
                    Code::ResourceExhausted => "fetch errors: RESOURCE_EXHAUSTED (retried)",
                    _ => "fetch errors: other (retried)",
                });
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(_) => {
                sink.count("fetch calls timed out (retried)");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let from = clock.ms();
        let task_id: Uuid = task.task_id.parse().unwrap();
        let index = sink.grant(&Held {
            task: task_id,
            worker: n,
            token: task.fencing_token,
            exclusive: task.exclusive_resources.clone(),
            shared: task.shared_resources.clone(),
            from,
            until: f64::INFINITY,
            asked,
            how: "held".into(),
        });
        let what = behaviour(&mut rng);
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..40))).await;
        let lease_id = current.id.clone();
        let end = |how: &str, until: f64| sink.end(index, how, until);
        match what {
            Behaviour::Finish => {
                let _ = client
                    .start_task(StartTaskRequest {
                        lease_id: lease_id.clone(),
                        task_id: task.task_id.clone(),
                        fencing_token: task.fencing_token,
                    })
                    .await;
                let sent = clock.ms();
                let done = client
                    .finish_task(FinishTaskRequest {
                        lease_id,
                        task_id: task.task_id.clone(),
                        fencing_token: task.fencing_token,
                        state: "completed".into(),
                        error: String::new(),
                    })
                    .await;
                match done {
                    // FinishTask checks the holder: it held the task until then.
                    Ok(_) => end("finished", sent),
                    // Not acknowledged: held at least while the lease was known live.
                    Err(_) => end("end unacknowledged", current.live_until().min(sent)),
                }
            }
            Behaviour::Release => {
                // Released before it started: the task goes back to the queue.
                let sent = clock.ms();
                let done = client
                    .release_locks(ReleaseLocksRequest {
                        lease_id,
                        task_id: task.task_id.clone(),
                        fencing_token: task.fencing_token,
                    })
                    .await;
                match done {
                    // Released now: it held them until then.
                    Ok(r) if r.get_ref().released => end("released", sent),
                    // Nothing was held any more (swept meanwhile), or no answer.
                    _ => end("release found nothing", current.live_until().min(sent)),
                }
            }
            Behaviour::SkipRelease => {
                sink.count("releases skipped");
                kept.push(index);
            }
            Behaviour::Crash => {
                sink.count("worker crashes");
                // Crash once a heartbeat has shown the lease live with the task held, so the
                // checker knows the hold lasted (up to 1 s).
                let waited = Instant::now();
                while current.live_until() <= from && waited.elapsed() < Duration::from_secs(1) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                current.stop.cancel();
                let until = current.live_until();
                end("holder crashed", until);
                end_kept(&sink, &mut kept, until);
                lease = None;
            }
            Behaviour::CloseMidTask => {
                sink.count("leases closed mid-task");
                let until = current.close(&mut client, &clock).await;
                end("lease closed", until);
                end_kept(&sink, &mut kept, until);
                lease = None;
            }
        }
    }
    if let Some(l) = lease.take() {
        let until = l.close(&mut client, &clock).await;
        end_kept(&sink, &mut kept, until);
    }
}

/// A worker process: this test binary run with `--worker`, reporting on stdout.
struct WorkerProcess {
    child: tokio::process::Child,
    reader: tokio::task::JoinHandle<()>,
}

fn spawn_worker(
    n: usize,
    endpoint: &str,
    seed: u64,
    clock: Clock,
    record: &Shared,
) -> WorkerProcess {
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--worker".to_string(),
            n.to_string(),
            endpoint.to_string(),
            seed.to_string(),
            clock.0.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start a worker process");
    let stdout = child.stdout.take().unwrap();
    let reader = tokio::spawn(read_events(n, stdout, Arc::clone(record)));
    WorkerProcess { child, reader }
}

impl WorkerProcess {
    /// Stops it the polite way (its stdin closes; it closes its lease) and waits for it.
    async fn stop(mut self) {
        drop(self.child.stdin.take());
        if tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
        self.reader.await.unwrap();
    }

    /// SIGKILL.
    async fn kill(mut self) {
        let _ = self.child.kill().await;
        self.reader.await.unwrap();
    }
}

/// Reads a worker process's events into the record. When the process is gone, what it still
/// held ends at the last moment its lease was known live.
async fn read_events(n: usize, stdout: tokio::process::ChildStdout, record: Shared) {
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut index: HashMap<usize, usize> = HashMap::new();
    let mut live = 0f64;
    let list = |s: &str| -> Vec<String> {
        if s.is_empty() {
            Vec::new()
        } else {
            s.split(',').map(String::from).collect()
        }
    };
    while let Ok(Some(line)) = lines.next_line().await {
        let f: Vec<&str> = line.split('\t').collect();
        let mut r = record.lock().unwrap();
        match f.as_slice() {
            ["G", i, task, token, from, asked, exclusive, shared] => {
                r.held.push(Held {
                    task: task.parse().unwrap(),
                    worker: n,
                    token: token.parse().unwrap(),
                    exclusive: list(exclusive),
                    shared: list(shared),
                    from: from.parse().unwrap(),
                    until: f64::INFINITY,
                    asked: asked.parse().unwrap(),
                    how: "held".into(),
                });
                index.insert(i.parse().unwrap(), r.held.len() - 1);
            }
            ["E", i, until, how] => {
                if let Some(&g) = index.get(&i.parse().unwrap()) {
                    let until: f64 = until.parse().unwrap();
                    let h = &mut r.held[g];
                    h.until = until.max(h.from);
                    h.how = how.to_string();
                }
            }
            ["C", what] => *r.counts.entry(what.to_string()).or_default() += 1,
            ["L", at] => live = live.max(at.parse().unwrap()),
            // Anything else (a panic message, a log line) is counted, not fatal here.
            _ => {
                *r.counts
                    .entry("worker output lines not understood".into())
                    .or_default() += 1
            }
        }
    }
    let mut r = record.lock().unwrap();
    for &g in index.values() {
        let h = &mut r.held[g];
        if h.until.is_infinite() {
            h.until = live.max(h.from);
            h.how = "holder process killed".into();
        }
    }
}

/// `--worker N ENDPOINT SEED EPOCH`: one worker, until its stdin closes.
async fn worker_process(args: &[String]) {
    use tokio::io::AsyncReadExt;
    let n: usize = args[0].parse().unwrap();
    let seed: u64 = args[2].parse().unwrap();
    let clock = Clock(args[3].parse().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let stopping = stop.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 64];
        let mut stdin = tokio::io::stdin();
        while matches!(stdin.read(&mut buf).await, Ok(k) if k > 0) {}
        stopping.cancel();
    });
    let sink = Arc::new(Sink {
        next: std::sync::atomic::AtomicUsize::new(0),
    });
    worker(n, args[1].clone(), seed, clock, sink, stop).await;
}

fn end_kept(sink: &Sink, kept: &mut Vec<usize>, until: f64) {
    for i in kept.drain(..) {
        sink.end(i, "kept until its lease ended", until);
    }
}

/// Inserts tasks at random moments: 1-3 resources each, 30% of them shared.
async fn inserter(
    url: String,
    seed: u64,
    record: Shared,
    created: Created,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(31));
    let mut db: Option<tokio_postgres::Client> = None;
    while !stop.is_cancelled() {
        if db.as_ref().is_none_or(|c| c.is_closed()) {
            db = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                Ok((c, conn)) => {
                    tokio::spawn(conn);
                    Some(c)
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
        }
        let n = rng.random_range(1..=3);
        let mut record_entries: Vec<String> = Vec::new();
        for _ in 0..n {
            let r = RESOURCES[rng.random_range(0..RESOURCES.len())];
            if record_entries
                .iter()
                .any(|e| e.trim_start_matches("shared:") == r)
            {
                continue;
            }
            record_entries.push(if rng.random_bool(0.3) {
                format!("shared:{r}")
            } else {
                r.to_string()
            });
        }
        let id = Uuid::new_v4();
        let inserted = db
            .as_ref()
            .unwrap()
            .execute(
                "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
                 VALUES ($1, 'chaos', 'waiting', $2)",
                &[&id, &record_entries],
            )
            .await;
        match inserted {
            Ok(_) => {
                created.lock().unwrap().push((id, record_entries));
                count(&record, "tasks inserted");
            }
            Err(_) => db = None,
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(5..40))).await;
    }
}

struct Options {
    seconds: u64,
    seed: u64,
    long: bool,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let long = args.iter().any(|a| a == "--long");
    let seed_at = args.iter().position(|a| a == "--seed").map(|i| i + 1);
    let seed: u64 = seed_at
        .and_then(|i| args.get(i))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    // Seconds: the number right after --long (libtest's own options, e.g. --test-threads 1,
    // are not mistaken for it).
    let seconds = args
        .iter()
        .position(|a| a == "--long")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(if long { 300 } else { 24 });
    Options {
        seconds,
        seed,
        long,
    }
}

fn check(record: &Record, created: &[(Uuid, Vec<String>)]) -> Vec<String> {
    let mut violations = Vec::new();
    let held = &record.held;
    // 1. Mutual exclusion.
    for (i, a) in held.iter().enumerate() {
        for b in &held[i + 1..] {
            let overlap = a.from < b.until && b.from < a.until;
            if !overlap {
                continue;
            }
            if a.task == b.task {
                if a.token != b.token {
                    violations.push(format!(
                        "task {} held twice at once: worker {} (token {}, {:.1}-{:.1} ms, {}) and worker {} (token {}, {:.1}-{:.1} ms, {})",
                        a.task, a.worker, a.token, a.from, a.until, a.how,
                        b.worker, b.token, b.from, b.until, b.how
                    ));
                }
                continue;
            }
            let on = a.conflicts(b);
            if !on.is_empty() {
                violations.push(format!(
                    "conflicting tasks held at once on {on:?}: {} (worker {}, token {}, {:.1}-{:.1} ms, {}) and {} (worker {}, token {}, {:.1}-{:.1} ms, {})",
                    a.task, a.worker, a.token, a.from, a.until, a.how,
                    b.task, b.worker, b.token, b.from, b.until, b.how
                ));
            }
        }
    }
    // 2. Fencing tokens increase along each resource's grants (one after the other).
    let mut by_resource: HashMap<&str, Vec<&Held>> = HashMap::new();
    for h in held {
        for r in h.exclusive.iter().chain(&h.shared) {
            by_resource.entry(r.as_str()).or_default().push(h);
        }
    }
    for (r, grants) in &by_resource {
        for a in grants {
            for b in grants {
                // a's hold was proven to last until before b's grant was asked for.
                if a.until < b.asked
                    && a.token >= b.token
                    && (a.exclusive.iter().any(|x| x == r) || b.exclusive.iter().any(|x| x == r))
                {
                    violations.push(format!(
                        "fencing token went back on {r}: {} got {} at {:.1} ms, after {} had {} until {:.1} ms",
                        b.task, b.token, b.from, a.task, a.token, a.until
                    ));
                }
            }
        }
    }
    // 3. FIFO: no task handed out while an older conflicting task was waiting for its first
    //    grant (its first grant was asked for only after the newer one had arrived).
    let position: HashMap<Uuid, usize> = created
        .iter()
        .enumerate()
        .map(|(i, (id, _))| (*id, i))
        .collect();
    let mut first: HashMap<Uuid, &Held> = HashMap::new();
    for h in held {
        let e = first.entry(h.task).or_insert(h);
        if h.from < e.from {
            *e = h;
        }
    }
    // A task never handed out waited all along.
    let never: Vec<Held> = created
        .iter()
        .filter(|(id, _)| !first.contains_key(id))
        .map(|(id, record)| Held {
            task: *id,
            worker: usize::MAX,
            token: 0,
            exclusive: record
                .iter()
                .filter(|e| !e.starts_with("shared:"))
                .cloned()
                .collect(),
            shared: record
                .iter()
                .filter_map(|e| e.strip_prefix("shared:").map(String::from))
                .collect(),
            from: f64::INFINITY,
            until: f64::INFINITY,
            asked: f64::INFINITY,
            how: "never handed out".into(),
        })
        .collect();
    for (task, t) in &first {
        let Some(&pt) = position.get(task) else {
            continue;
        };
        for u in first.values().copied().chain(never.iter()) {
            let Some(&pu) = position.get(&u.task) else {
                continue;
            };
            if pu < pt && u.asked > t.from && !u.conflicts(t).is_empty() {
                violations.push(format!(
                    "{task} was handed out at {:.1} ms while the older conflicting {} still waited (first asked for at {:.1} ms)",
                    t.from, u.task, u.asked
                ));
            }
        }
    }
    violations
}

/// The checker finds what it must: run on made-up histories with one violation of each kind
/// (and one clean history), before the real run.
fn checker_self_test() {
    let held = |task: u128, token: u64, x: &[&str], s: &[&str], from: f64, until: f64| Held {
        task: Uuid::from_u128(task),
        worker: 0,
        token,
        exclusive: x.iter().map(|r| r.to_string()).collect(),
        shared: s.iter().map(|r| r.to_string()).collect(),
        from,
        until,
        asked: from - 1.0,
        how: "made up".into(),
    };
    let created: Vec<(Uuid, Vec<String>)> =
        (1..=3).map(|i| (Uuid::from_u128(i), Vec::new())).collect();
    let history = |h: Vec<Held>| Record {
        held: h,
        ..Record::default()
    };
    // Clean: one after the other, tokens rising, oldest first; two shared holders at once.
    let clean = history(vec![
        held(1, 1, &["a"], &[], 0.0, 10.0),
        held(2, 2, &[], &["a"], 11.0, 20.0),
        held(3, 3, &[], &["a"], 12.0, 20.0),
    ]);
    assert!(
        check(&clean, &created).is_empty(),
        "{:?}",
        check(&clean, &created)
    );
    let overlap = history(vec![
        held(1, 1, &["a"], &[], 0.0, 10.0),
        held(2, 2, &[], &["a"], 5.0, 20.0),
    ]);
    assert!(check(&overlap, &created)
        .iter()
        .any(|v| v.contains("held at once")));
    let token_back = history(vec![
        held(1, 5, &["a"], &[], 0.0, 10.0),
        held(2, 3, &["a"], &[], 12.0, 20.0),
    ]);
    assert!(check(&token_back, &created)
        .iter()
        .any(|v| v.contains("went back")));
    let twice = history(vec![
        held(1, 1, &["a"], &[], 0.0, 10.0),
        held(1, 2, &["a"], &[], 5.0, 20.0),
    ]);
    assert!(check(&twice, &created)
        .iter()
        .any(|v| v.contains("held twice")));
    let starved = Record {
        held: vec![held(2, 1, &["a"], &[], 0.0, 10.0)],
        ..Record::default()
    };
    let waiting_older = vec![
        (Uuid::from_u128(1), vec!["shared:a".to_string()]),
        (Uuid::from_u128(2), Vec::new()),
    ];
    assert!(check(&starved, &waiting_older)
        .iter()
        .any(|v| v.contains("still waited")));
    let unfair = history(vec![
        held(2, 1, &["a"], &[], 0.0, 10.0),
        held(1, 2, &["a"], &[], 11.0, 20.0),
    ]);
    assert!(check(&unfair, &created)
        .iter()
        .any(|v| v.contains("still waited")));
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--worker") {
        return worker_process(&args[1..]).await;
    }
    if args.iter().any(|a| a == "--list") {
        println!("chaos: test");
        return;
    }
    checker_self_test();
    let opts = options();
    let started = Instant::now();
    let again = if opts.long {
        format!("--long {} --seed {}", opts.seconds, opts.seed)
    } else {
        format!("--seed {}", opts.seed)
    };
    println!(
        "chaos: seed {} for {} s (reproduce with `cargo test --test chaos -- {again}`)",
        opts.seed, opts.seconds
    );
    let (mut pg, mut redis) =
        tokio::task::spawn_blocking(|| (Postgres::start().unwrap(), Redis::start().unwrap()))
            .await
            .unwrap();
    let url = pg.create_database("chaos").unwrap();
    pg.psql("chaos", dispatch_broker::tasks::sql::MIGRATE.as_str())
        .unwrap();
    let mut replicas = vec![
        chaos_replica(&url, &redis.url()),
        chaos_replica(&url, &redis.url()),
    ];
    for r in &replicas {
        wait_serving(&r.endpoint()).await;
    }
    let clock = Clock(unix_ms());
    let record: Shared = Arc::new(Mutex::new(Record::default()));
    let created = Arc::new(Mutex::new(Vec::new()));
    let endpoints: Vec<String> = replicas.iter().map(Replica::endpoint).collect();
    let mut workers: Vec<WorkerProcess> = (0..WORKERS)
        .map(|n| spawn_worker(n, &endpoints[n % 2], opts.seed, clock, &record))
        .collect();
    let stop_inserting = tokio_util::sync::CancellationToken::new();
    let inserting = tokio::spawn(inserter(
        url.clone(),
        opts.seed,
        Arc::clone(&record),
        Arc::clone(&created),
        stop_inserting.clone(),
    ));

    // Faults at random moments, one at a time, each in turn.
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let run_until = Instant::now() + Duration::from_secs(opts.seconds);
    let mut round = 0usize;
    let fault = |record: &Shared, what: String| {
        let at = clock.ms();
        println!("  {at:>9.1} ms  {what}");
        record.lock().unwrap().faults.push((at, what));
    };
    while Instant::now() + Duration::from_secs(4) < run_until {
        tokio::time::sleep(Duration::from_millis(rng.random_range(1000..2500))).await;
        match round % 5 {
            4 => {
                let n = rng.random_range(0..WORKERS);
                fault(&record, format!("worker process {n} killed (SIGKILL)"));
                workers.remove(n).kill().await;
                let fresh = spawn_worker(
                    n,
                    &endpoints[n % 2],
                    opts.seed ^ round as u64,
                    clock,
                    &record,
                );
                workers.insert(n, fresh);
            }
            0 => {
                let which = rng.random_range(0..2);
                fault(&record, format!("replica {which} killed (SIGKILL)"));
                replicas[which].kill();
                tokio::time::sleep(Duration::from_millis(rng.random_range(300..1500))).await;
                replicas[which].boot().unwrap();
                wait_serving(&replicas[which].endpoint()).await;
                fault(&record, format!("replica {which} restarted"));
            }
            1 => {
                fault(
                    &record,
                    "Redis paused (SIGSTOP) for longer than a lease TTL".into(),
                );
                redis.pause();
                tokio::time::sleep(TTL + Duration::from_millis(rng.random_range(200..800))).await;
                redis.resume();
                fault(&record, "Redis resumed".into());
            }
            2 => {
                fault(&record, "Redis killed and restarted empty".into());
                tokio::task::block_in_place(|| redis.restart()).unwrap();
            }
            _ => {
                fault(&record, "PostgreSQL restarted".into());
                tokio::task::block_in_place(|| pg.restart()).unwrap();
            }
        }
        round += 1;
    }
    tokio::time::sleep(run_until.saturating_duration_since(Instant::now())).await;
    stop_inserting.cancel();
    inserting.await.unwrap();
    for w in workers {
        w.stop().await;
    }
    // Settle: leases of crashed workers expire and are swept, their claims requeued.
    for r in &replicas {
        wait_serving(&r.endpoint()).await;
    }
    tokio::time::sleep(TTL * 3).await;

    let record = std::mem::take(&mut *record.lock().unwrap());
    let created = std::mem::take(&mut *created.lock().unwrap());
    let mut violations = check(&record, &created);
    // 4. The end state.
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let states: Vec<(String, i64)> = db
        .query(
            "SELECT state || CASE WHEN app_lock_id IS NULL THEN '' ELSE ' (claimed)' END, count(*) \
             FROM core_task GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    for (state, n) in &states {
        if !(TaskState::is_final_name(state) || state == TaskState::Waiting.as_str()) {
            violations.push(format!("{n} tasks left {state} with no live holder"));
        }
    }
    let client = deadpool_redis::redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut locks: Vec<String> = Vec::new();
    for pattern in [
        "{dispatch}:[xs]:*",
        "{dispatch}:task:*",
        "{dispatch}:lease:*:tasks",
    ] {
        let found: Vec<String> = deadpool_redis::redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut conn)
            .await
            .unwrap();
        locks.extend(found);
    }
    let locked: i64 = deadpool_redis::redis::cmd("SCARD")
        .arg("{dispatch}:locked")
        .query_async(&mut conn)
        .await
        .unwrap();
    if !locks.is_empty() || locked > 0 {
        violations.push(format!(
            "locks left at the end: {locks:?}, {locked} in {{dispatch}}:locked"
        ));
    }
    let ids: Vec<Uuid> = created.iter().map(|(id, _)| *id).collect();
    let present: i64 = db
        .query_one(
            "SELECT count(*) FROM core_task WHERE pulp_id = ANY($1)",
            &[&ids],
        )
        .await
        .unwrap()
        .get(0);
    if present != ids.len() as i64 {
        violations.push(format!(
            "{} of {} inserted tasks are gone",
            ids.len() as i64 - present,
            ids.len()
        ));
    }

    let tasks_done: i64 = states
        .iter()
        .filter(|(s, _)| s == "completed")
        .map(|(_, n)| n)
        .sum();
    println!("\n| figure | value |\n|---|---:|");
    println!("| duration | {:.1} s |", started.elapsed().as_secs_f64());
    println!("| seed | {} |", opts.seed);
    for (what, n) in &record.counts {
        println!("| {what} | {n} |");
    }
    println!("| grants seen by workers | {} |", record.held.len());
    println!("| tasks completed | {tasks_done} |");
    let mut fault_counts: BTreeMap<String, usize> = BTreeMap::new();
    for (_, f) in &record.faults {
        let follow_up =
            (f.starts_with("replica") && f.ends_with("restarted")) || f.ends_with("resumed");
        if !follow_up {
            let kind: String = f
                .chars()
                .map(|c| if c.is_ascii_digit() { 'N' } else { c })
                .collect();
            *fault_counts.entry(kind).or_default() += 1;
        }
    }
    for (f, n) in &fault_counts {
        println!("| fault: {f} | {n} |");
    }
    println!("| end states | {states:?} |");
    println!("| violations | {} |", violations.len());
    if !violations.is_empty() {
        println!("\nViolations (seed {}):", opts.seed);
        for v in violations.iter().take(50) {
            println!("- {v}");
        }
        println!("\nTimeline of faults:");
        for (at, f) in &record.faults {
            println!("  {at:>9.1} ms  {f}");
        }
        println!(
            "\ntest result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out"
        );
        // exit() runs no destructors: stop the servers first.
        drop(replicas);
        drop(redis);
        drop(pg);
        std::process::exit(1);
    }
    assert!(
        record.held.len() > 20,
        "too little work was done to check anything"
    );
    println!("\ntest result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
}
