//! Test harness: a throwaway PostgreSQL cluster shared by the tests of one binary (each test gets
//! its own database, cloned from a migrated template), a redis-server per test, and the broker
//! in-process on 127.0.0.1:0. Tests that kill Postgres start their own cluster.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use dispatch_broker::config::ServeArgs;
use dispatch_broker::proto::broker_client::BrokerClient;
use dispatch_broker::proto::*;
use dispatch_broker::server::{self, Running};
use dispatch_testkit::{Postgres, Redis};
use tonic::transport::Channel;
use uuid::Uuid;

static PG: OnceLock<Postgres> = OnceLock::new();
static NEXT_DB: AtomicUsize = AtomicUsize::new(0);
const TEMPLATE: &str = "dispatch_template";

/// The cluster shared by this test binary, with a migrated template database.
pub fn shared_pg() -> &'static Postgres {
    PG.get_or_init(|| {
        let pg = Postgres::start().expect("start throwaway postgres");
        pg.create_database(TEMPLATE).expect("create template");
        let migrate = dispatch_broker::tasks::sql::MIGRATE.as_str();
        pg.psql(TEMPLATE, migrate).expect("migrate template");
        let notify = include_str!("../../src/tasks/notify_trigger.sql");
        pg.psql(TEMPLATE, notify).expect("notify trigger");
        pg
    })
}

/// A fresh, migrated database on the shared cluster.
pub fn fresh_database() -> String {
    let pg = shared_pg();
    let name = format!(
        "t{}_{}",
        std::process::id(),
        NEXT_DB.fetch_add(1, Ordering::Relaxed)
    );
    pg.psql(
        "postgres",
        &format!("CREATE DATABASE {name} TEMPLATE {TEMPLATE}"),
    )
    .expect("create test database");
    pg.url(&name)
}

/// One test's world: its database, its Redis, its broker, a client.
pub struct Env {
    pub db_url: String,
    pub redis: Redis,
    pub broker: Option<Running>,
    pub client: BrokerClient<Channel>,
    pub db: tokio_postgres::Client,
    pub args: ServeArgs,
}

/// Options for [`Env::with`].
pub fn default_args(db_url: &str, redis_url: &str) -> ServeArgs {
    let mut args = ServeArgs::with_urls(db_url, redis_url);
    args.lease.min_ttl = Duration::from_millis(200);
    args.fetch.recheck = Duration::from_millis(50);
    args.fetch.wake_poll = Duration::from_millis(25);
    args
}

impl Env {
    /// A world with default broker options.
    pub async fn new() -> Env {
        Env::with(|_| {}).await
    }

    /// A world whose broker options `tweak` adjusts.
    pub async fn with(tweak: impl FnOnce(&mut ServeArgs)) -> Env {
        let db_url = tokio::task::spawn_blocking(fresh_database).await.unwrap();
        let redis = tokio::task::spawn_blocking(|| Redis::start().expect("start redis"))
            .await
            .unwrap();
        Env::on(db_url, redis, tweak).await
    }

    /// A world on an existing database and Redis.
    pub async fn on(db_url: String, redis: Redis, tweak: impl FnOnce(&mut ServeArgs)) -> Env {
        // TEST_LOG=<filter> (e.g. dispatch_broker=debug): the brokers' logs, in each test's output.
        if let Ok(filter) = std::env::var("TEST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_test_writer()
                .try_init();
        }
        let mut args = default_args(&db_url, &redis.url());
        tweak(&mut args);
        let broker = server::start(&args).await.expect("start broker");
        let client = BrokerClient::connect(format!("http://{}", broker.addr))
            .await
            .expect("connect");
        let (db, conn) = tokio_postgres::connect(&db_url, tokio_postgres::NoTls)
            .await
            .expect("connect db");
        tokio::spawn(conn);
        Env {
            db_url,
            redis,
            broker: Some(broker),
            client,
            db,
            args,
        }
    }

    pub fn broker(&self) -> &Running {
        self.broker.as_ref().expect("broker running")
    }

    /// A second replica with this one's options, on the same Postgres and Redis, and a client
    /// of it.
    pub async fn second_replica(&self) -> (Running, BrokerClient<Channel>) {
        let mut args = self.args.clone();
        args.listen = "127.0.0.1:0".parse().unwrap();
        args.metrics_listen = "127.0.0.1:0".parse().unwrap();
        let other = server::start(&args).await.expect("start a second replica");
        let client = BrokerClient::connect(format!("http://{}", other.addr))
            .await
            .expect("connect to the second replica");
        (other, client)
    }

    /// The broker's counters once no fetch pass runs (a pass answers as soon as it has its
    /// grant, so its counts are complete only once it ended).
    pub async fn settled_stats(&self) -> dispatch_broker::metrics::StatsSnapshot {
        self.broker().passes.idle().await;
        self.broker().stats.snapshot()
    }

    /// Waits until the broker's resource queues hold every task queued so far (they catch up
    /// once a second on their own, so a fast test may otherwise run before they know of any).
    pub async fn settle_queues(&self) {
        self.broker()
            .resource_queues
            .settle()
            .await
            .expect("the resource queues catch up");
    }

    /// Inserts a waiting task with this `reserved_resources_record`.
    pub async fn task(&self, record: &[&str]) -> Uuid {
        self.task_with(record, "test.task", &[]).await
    }

    /// Inserts `n` waiting tasks, each needing one resource of its own (`{prefix}0`, `{prefix}1`,
    /// ...), oldest first.
    pub async fn free_tasks(&self, prefix: &str, n: usize) -> Vec<Uuid> {
        let mut ids = Vec::with_capacity(n);
        for i in 0..n {
            ids.push(self.task(&[format!("{prefix}{i}").as_str()]).await);
        }
        ids
    }

    /// Inserts a waiting task with a name and `versions`.
    pub async fn task_with(&self, record: &[&str], name: &str, versions: &[(&str, &str)]) -> Uuid {
        let id = Uuid::new_v4();
        let record: Vec<String> = record.iter().map(|s| s.to_string()).collect();
        let keys: Vec<&str> = versions.iter().map(|v| v.0).collect();
        let values: Vec<&str> = versions.iter().map(|v| v.1).collect();
        self.db
            .execute(
                "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record, versions) \
                 VALUES ($1, $2, 'waiting', $3, hstore($4::text[], $5::text[]))",
                &[&id, &name, &record, &keys, &values],
            )
            .await
            .expect("insert task");
        id
    }

    /// Inserts `n` waiting tasks with the same record in one transaction. The insert trigger is
    /// bypassed (its per-row check is O(queue), so 20,000 rows would take a minute); the rows
    /// get increasing `clock_timestamp()` stamps themselves, newer than every task before them.
    pub async fn tasks_bulk(&self, n: usize, record: &[&str]) {
        let record: Vec<String> = record.iter().map(|s| s.to_string()).collect();
        let n = n as i32;
        self.db
            .batch_execute("BEGIN; SET LOCAL session_replication_role = replica")
            .await
            .expect("begin bulk insert");
        self.db
            .execute(
                "INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
                 SELECT gen_random_uuid(), clock_timestamp(), 'test.bulk', 'waiting', $1 \
                 FROM generate_series(1, $2::int)",
                &[&record, &n],
            )
            .await
            .expect("insert tasks");
        self.db
            .batch_execute("COMMIT; ANALYZE core_task")
            .await
            .expect("commit bulk insert");
    }

    pub async fn state(&self, task: Uuid) -> String {
        self.db
            .query_one("SELECT state FROM core_task WHERE pulp_id = $1", &[&task])
            .await
            .expect("task state")
            .get(0)
    }

    /// The task's `error` (Pulp's JSON: `{"reason": ...}` for the broker's failures).
    pub async fn error_of(&self, task: Uuid) -> serde_json::Value {
        self.db
            .query_one("SELECT error FROM core_task WHERE pulp_id = $1", &[&task])
            .await
            .expect("task error")
            .get(0)
    }

    pub async fn app_lock(&self, task: Uuid) -> Option<Uuid> {
        self.db
            .query_one(
                "SELECT app_lock_id FROM core_task WHERE pulp_id = $1",
                &[&task],
            )
            .await
            .expect("task app_lock")
            .get(0)
    }

    /// Inserts a `core_appstatus` row, as a Pulp process registers itself (`app_type` "worker",
    /// "api" or "content").
    pub async fn app_status(&self, app_type: &str, name: &str) -> Uuid {
        let id = Uuid::new_v4();
        self.db
            .execute(
                "INSERT INTO core_appstatus (pulp_id, app_type, name, ttl) \
                 VALUES ($1, $2, $3, interval '30 seconds')",
                &[&id, &app_type, &name],
            )
            .await
            .expect("insert an app status row");
        id
    }

    /// Sets a task's state directly, as a Pulp worker does.
    pub async fn set_state(&self, task: Uuid, state: &str) {
        self.db
            .execute(
                "UPDATE core_task SET state = $2 WHERE pulp_id = $1",
                &[&task, &state],
            )
            .await
            .expect("set state");
    }

    pub async fn open(&mut self, name: &str) -> String {
        self.open_with(name, &[("core", "3.123.1")], None).await
    }

    pub async fn open_with(
        &mut self,
        name: &str,
        versions: &[(&str, &str)],
        ttl: Option<Duration>,
    ) -> String {
        self.client
            .open_lease(OpenLeaseRequest {
                worker_name: name.into(),
                versions: versions
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ttl: ttl.map(|t| t.try_into().unwrap()),
                app_status_id: String::new(),
                open_id: String::new(),
            })
            .await
            .expect("open lease")
            .into_inner()
            .lease_id
    }

    pub async fn fetch(&mut self, lease: &str) -> Option<Task> {
        self.try_fetch(lease, &[]).await.expect("fetch")
    }

    /// FetchTask asking the grant to start its task.
    pub async fn fetch_started(&self, lease: &str) -> Option<Task> {
        self.client
            .clone()
            .fetch_task(FetchTaskRequest {
                start: true,
                ..fetch_request(lease)
            })
            .await
            .expect("fetch")
            .into_inner()
            .task
    }

    pub async fn try_fetch(
        &mut self,
        lease: &str,
        skip: &[Uuid],
    ) -> Result<Option<Task>, tonic::Status> {
        Ok(self
            .client
            .fetch_task(FetchTaskRequest {
                lease_id: lease.into(),
                wait: None,
                skip_task_ids: skip.iter().map(|s| s.to_string()).collect(),
                start: false,
            })
            .await?
            .into_inner()
            .task)
    }

    pub async fn claim(&mut self, lease: &str, task: Uuid) -> Result<Option<Task>, tonic::Status> {
        Ok(self
            .client
            .claim_task(ClaimTaskRequest {
                lease_id: lease.into(),
                task_id: task.to_string(),
            })
            .await?
            .into_inner()
            .task)
    }

    pub async fn start(&mut self, lease: &str, task: &Task) {
        self.client
            .start_task(start_request(lease, task))
            .await
            .expect("start task");
    }

    pub async fn finish(&mut self, lease: &str, task: &Task, state: &str) -> FinishTaskResponse {
        self.client
            .finish_task(finish_request(lease, task, state))
            .await
            .expect("finish task")
            .into_inner()
    }

    pub async fn release(&mut self, lease: &str, task: &Task) -> Result<bool, tonic::Status> {
        Ok(self
            .client
            .release_locks(ReleaseLocksRequest {
                lease_id: lease.into(),
                task_id: task.task_id.clone(),
                fencing_token: task.fencing_token,
            })
            .await?
            .into_inner()
            .released)
    }

    pub async fn cancel(&mut self, task: Uuid) -> Result<CancelTaskResponse, tonic::Status> {
        Ok(self
            .client
            .cancel_task(CancelTaskRequest {
                task_id: task.to_string(),
            })
            .await?
            .into_inner())
    }

    /// The task locks Redis holds, as task ids.
    pub async fn locked_tasks(&self) -> BTreeSet<String> {
        self.broker()
            .locks
            .held_task_locks()
            .await
            .expect("list locks")
            .into_iter()
            .map(|(task, _, _)| task)
            .collect()
    }

    /// Adds `task` to `lease`'s registry (the set of tasks it holds locks for) behind the
    /// broker's back: a stray entry, while the task's lock names whichever lease holds it.
    pub async fn stray_registry_entry(&self, lease: &str, task: &str) {
        use deadpool_redis::redis;
        let tag = format!("{{{}}}", self.args.redis.key_prefix);
        let client = redis::Client::open(self.redis.url()).expect("redis url");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to redis");
        let _: i64 = redis::cmd("SADD")
            .arg(format!("{tag}:lease:{lease}:tasks"))
            .arg(task)
            .query_async(&mut conn)
            .await
            .expect("SADD");
    }

    /// Fails unless Redis holds exactly the locks of `expected` tasks: their task locks, and
    /// resource locks naming only them, each in the mode the task needs.
    /// Checks that Redis holds exactly the locks of `expected`, reading every lock-related key
    /// with a Redis client of its own (not the broker's accessors): each task's lock hash, the
    /// exclusive and shared resource keys, the locked-tasks set, and the task sets of the leases
    /// the task hashes name.
    pub async fn assert_locks(&self, expected: &[&Task]) {
        use deadpool_redis::redis;
        let tag = format!("{{{}}}", self.args.redis.key_prefix);
        let client = redis::Client::open(self.redis.url()).expect("redis url");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to redis");
        let scan = conn.clone();
        let keys = move |pattern: String| {
            let mut conn = scan.clone();
            async move {
                let mut keys: Vec<String> = redis::cmd("KEYS")
                    .arg(pattern)
                    .query_async(&mut conn)
                    .await
                    .expect("KEYS");
                keys.sort();
                keys
            }
        };
        let want: BTreeSet<String> = expected.iter().map(|t| t.task_id.clone()).collect();

        // Each task's lock hash: which tasks, their names, and the lease that holds each.
        let task_prefix = format!("{tag}:task:");
        let mut have_tasks = BTreeSet::new();
        let mut holding_lease = Vec::new();
        for key in keys(format!("{task_prefix}*")).await {
            let task_id = key[task_prefix.len()..].to_owned();
            let (lease, x, s): (Option<String>, Option<String>, Option<String>) =
                redis::cmd("HMGET")
                    .arg(&key)
                    .arg("lease")
                    .arg("x")
                    .arg("s")
                    .query_async(&mut conn)
                    .await
                    .expect("HMGET task lock");
            let names = |v: Option<String>| -> BTreeSet<String> {
                v.unwrap_or_default()
                    .split('\n')
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned)
                    .collect()
            };
            if let Some(t) = expected.iter().find(|t| t.task_id == task_id) {
                let want_x: BTreeSet<String> = t.exclusive_resources.iter().cloned().collect();
                let want_s: BTreeSet<String> = t.shared_resources.iter().cloned().collect();
                assert_eq!(names(x), want_x, "exclusive names in {key}");
                assert_eq!(names(s), want_s, "shared names in {key}");
            }
            let lease = lease.unwrap_or_default();
            assert!(!lease.is_empty(), "{key} names no lease");
            holding_lease.push((task_id.clone(), lease));
            have_tasks.insert(task_id);
        }
        assert_eq!(have_tasks, want, "task locks in redis");

        // The reconciler's list of locked tasks.
        let locked: BTreeSet<String> = redis::cmd("SMEMBERS")
            .arg(format!("{tag}:locked"))
            .query_async(&mut conn)
            .await
            .expect("SMEMBERS locked");
        assert_eq!(locked, want, "locked-tasks set in redis");

        // The leases' task sets: each task in its holder's set, and no task anywhere else.
        let mut in_lease_sets = BTreeSet::new();
        for key in keys(format!("{tag}:lease:*:tasks")).await {
            let members: BTreeSet<String> = redis::cmd("SMEMBERS")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("SMEMBERS lease tasks");
            for task_id in members {
                assert!(
                    holding_lease
                        .iter()
                        .any(|(t, lease)| *t == task_id
                            && key == format!("{tag}:lease:{lease}:tasks")),
                    "{key} lists {task_id}, whose lock it does not hold"
                );
                in_lease_sets.insert(task_id);
            }
        }
        assert_eq!(in_lease_sets, want, "tasks in the leases' task sets");

        // The resource keys: exclusive holders and shared holders, by name.
        let mut want_resources: Vec<(String, bool, Vec<String>)> = Vec::new();
        for t in expected {
            for (names, exclusive) in [(&t.exclusive_resources, true), (&t.shared_resources, false)]
            {
                for name in names {
                    match want_resources
                        .iter_mut()
                        .find(|(n, x, _)| n == name && *x == exclusive)
                    {
                        Some(entry) => entry.2.push(t.task_id.clone()),
                        None => {
                            want_resources.push((name.clone(), exclusive, vec![t.task_id.clone()]))
                        }
                    }
                }
            }
        }
        for entry in &mut want_resources {
            entry.2.sort();
        }
        want_resources.sort();
        let mut have = Vec::new();
        for (exclusive, infix) in [(true, "x"), (false, "s")] {
            let prefix = format!("{tag}:{infix}:");
            for key in keys(format!("{prefix}*")).await {
                let mut holders: Vec<String> = if exclusive {
                    let holder: Option<String> = redis::cmd("GET")
                        .arg(&key)
                        .query_async(&mut conn)
                        .await
                        .expect("GET");
                    holder.into_iter().collect()
                } else {
                    redis::cmd("SMEMBERS")
                        .arg(&key)
                        .query_async(&mut conn)
                        .await
                        .expect("SMEMBERS")
                };
                holders.sort();
                have.push((key[prefix.len()..].to_owned(), exclusive, holders));
            }
        }
        have.sort();
        assert_eq!(have, want_resources, "resource locks in redis");
    }

    pub async fn shutdown(mut self) {
        if let Some(b) = self.broker.take() {
            b.shutdown().await.expect("shutdown");
        }
    }
}

/// A transaction of the test's own that holds a task's row lock, so that the broker's next
/// statement on that row waits: the way tests stop a broker call half-way.
pub struct RowLock {
    client: tokio_postgres::Client,
}

impl RowLock {
    /// Locks `task`'s row until [`RowLock::commit`] or [`RowLock::rollback`].
    pub async fn take(db_url: &str, task: Uuid) -> RowLock {
        let (client, conn) = tokio_postgres::connect(db_url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        client.batch_execute("BEGIN").await.expect("begin");
        client
            .execute(
                "SELECT 1 FROM core_task WHERE pulp_id = $1 FOR UPDATE",
                &[&task],
            )
            .await
            .expect("lock the row");
        RowLock { client }
    }

    /// Runs a statement inside the transaction.
    pub async fn execute(&self, sql: &str, task: Uuid) {
        self.client.execute(sql, &[&task]).await.expect("statement");
    }

    /// Ends the transaction, keeping what it did.
    pub async fn commit(self) {
        self.client.batch_execute("COMMIT").await.expect("commit");
    }

    /// Ends the transaction, undoing what it did.
    pub async fn rollback(self) {
        self.client
            .batch_execute("ROLLBACK")
            .await
            .expect("rollback");
    }
}

impl Env {
    /// Starts a FetchTask for `lease` in the background.
    pub fn spawn_fetch(
        &self,
        lease: &str,
    ) -> tokio::task::JoinHandle<Result<Option<Task>, tonic::Status>> {
        let mut client = self.client.clone();
        let lease = lease.to_owned();
        tokio::spawn(async move {
            client
                .fetch_task(fetch_request(lease))
                .await
                .map(|r| r.into_inner().task)
        })
    }
}

/// Waits until `n` sessions of this test's database wait on a lock.
pub async fn sessions_wait_on_locks(env: &Env, n: i64) {
    eventually(Duration::from_secs(20), || async {
        let row = env
            .db
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .unwrap();
        row.get::<_, i64>(0) >= n
    })
    .await
    .expect("sessions wait on the row lock");
}

/// Polls `check` until it holds, for at most `limit`; returns whether it did and how long it took.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if check().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// A migrated database on a cluster of the test's own (for tests that stop Postgres).
pub fn own_postgres() -> (Postgres, String) {
    let pg = Postgres::start().expect("start own postgres");
    let url = pg.create_database("own").expect("create database");
    for sql in *BROKER_SCHEMA {
        pg.psql("own", sql).expect("the broker's schema");
    }
    (pg, url)
}

/// The broker's own schema (`migrate`, with its insert trigger's notification).
pub static BROKER_SCHEMA: std::sync::LazyLock<[&str; 2]> = std::sync::LazyLock::new(|| {
    [
        dispatch_broker::tasks::sql::MIGRATE.as_str(),
        include_str!("../../src/tasks/notify_trigger.sql"),
    ]
});

/// A broker (options adjusted by `tweak`) on a Postgres of the test's own that keeps statement
/// statistics (pg_stat_statements) for database `name`, made by running `schema` in it; and that
/// Postgres.
pub async fn measured_env(
    name: &'static str,
    schema: &'static [&'static str],
    tweak: impl FnOnce(&mut ServeArgs),
) -> (Postgres, Env) {
    let (pg, url, redis) = tokio::task::spawn_blocking(move || {
        let mut pg = Postgres::start().expect("start own postgres");
        preload_pg_stat_statements(&mut pg);
        let url = pg.create_database(name).expect("create database");
        for sql in schema {
            pg.psql(name, sql).expect("load the schema");
        }
        pg.psql(name, "CREATE EXTENSION pg_stat_statements")
            .expect("create extension");
        let redis = Redis::start().expect("start redis");
        (pg, url, redis)
    })
    .await
    .unwrap();
    (pg, Env::on(url, redis, tweak).await)
}

/// Terminates the broker's Postgres sessions that wait on a lock (the injected failure), in this
/// test's database only: tests share one Postgres server, and killing another test's sessions
/// failed that test's next statement ("connection closed").
pub async fn kill_waiting_broker_sessions(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name = 'dispatch-broker' AND wait_event_type = 'Lock' \
           AND datname = current_database()",
        &[],
    )
    .await
    .expect("terminate")
    .get(0)
}

/// An OpenLeaseRequest with the broker's defaults (no versions, default TTL, new worker row).
/// Opens a lease through `client` (e.g. a second replica's); its id.
pub async fn open_on(client: &mut BrokerClient<Channel>, worker_name: &str) -> String {
    client
        .open_lease(lease_request(worker_name))
        .await
        .expect("OpenLease")
        .into_inner()
        .lease_id
}

/// FetchTask through `client` with no wait.
pub async fn fetch_on(client: &mut BrokerClient<Channel>, lease: &str) -> Option<Task> {
    client
        .fetch_task(fetch_request(lease))
        .await
        .expect("FetchTask")
        .into_inner()
        .task
}

pub fn lease_request(worker_name: impl Into<String>) -> OpenLeaseRequest {
    OpenLeaseRequest {
        worker_name: worker_name.into(),
        versions: Default::default(),
        ttl: None,
        app_status_id: String::new(),
        open_id: String::new(),
    }
}

/// A FetchTaskRequest that does not wait and skips nothing.
pub fn fetch_request(lease_id: impl Into<String>) -> FetchTaskRequest {
    FetchTaskRequest {
        lease_id: lease_id.into(),
        wait: None,
        skip_task_ids: vec![],
        start: false,
    }
}

/// A FinishTaskRequest ending `task` in `state` under `lease_id`, with the token it was granted.
pub fn finish_request(lease_id: impl Into<String>, task: &Task, state: &str) -> FinishTaskRequest {
    FinishTaskRequest {
        lease_id: lease_id.into(),
        task_id: task.task_id.clone(),
        fencing_token: task.fencing_token,
        state: state.into(),
        error: String::new(),
    }
}

/// A StartTaskRequest for `task` under `lease_id`, with the token it was granted.
pub fn start_request(lease_id: impl Into<String>, task: &Task) -> StartTaskRequest {
    StartTaskRequest {
        lease_id: lease_id.into(),
        task_id: task.task_id.clone(),
        fencing_token: task.fencing_token,
    }
}

/// Waits (up to `limit`) until a FetchTask under `lease_id` is told NOT_FOUND: after Redis lost
/// its state, the broker has rebuilt the locks and the old lease is gone. True when it was.
pub async fn until_lease_gone(env: &Env, lease_id: &str, limit: Duration) -> bool {
    eventually(limit, || {
        let mut client = env.client.clone();
        let request = fetch_request(lease_id);
        async move {
            matches!(client.fetch_task(request).await,
                Err(s) if s.code() == tonic::Code::NotFound)
        }
    })
    .await
    .is_some()
}

/// Parses a task id from the wire.
pub fn id(task: &Task) -> Uuid {
    task.task_id.parse().unwrap()
}

/// A task as the worker library (its own generated code) received it, read as the broker's
/// message: the same bytes on the wire.
pub fn as_sent(task: &dispatch_worker::proto::Task) -> Task {
    use prost::Message;
    Task::decode(task.encode_to_vec().as_slice()).expect("the same message")
}

/// Has this cluster load pg_stat_statements (a restart): a database whose statements are counted
/// then needs `CREATE EXTENSION pg_stat_statements`.
pub fn preload_pg_stat_statements(pg: &mut Postgres) {
    pg.psql(
        "postgres",
        "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'",
    )
    .expect("preload pg_stat_statements");
    pg.restart().expect("restart postgres");
}

/// Shared buffers (8 kB pages) read since the last call by the statements whose text matches any
/// of the LIKE `patterns`, all calls together; the counts start afresh.
pub async fn statement_pages(db: &tokio_postgres::Client, patterns: &[&str]) -> i64 {
    let pages: i64 = db
        .query_one(
            "SELECT coalesce(sum(shared_blks_hit + shared_blks_read), 0)::bigint \
             FROM pg_stat_statements WHERE query LIKE ANY ($1)",
            &[&patterns],
        )
        .await
        .unwrap()
        .get(0);
    db.execute("SELECT pg_stat_statements_reset()", &[])
        .await
        .unwrap();
    pages
}

/// Fails when a fetch read clearly more pages at 20,000 blocked (`large`, per fetch) than any
/// fetch at 1,000 (`small`): more than half as many again, and 8.
pub fn no_fetch_reads_more_at_20_000(case: &str, small: &[i64], large: &[i64]) {
    println!("pages per fetch {case}: {small:?} at 1,000, {large:?} at 20,000");
    let (most_small, most_large) = (*small.iter().max().unwrap(), *large.iter().max().unwrap());
    assert!(
        most_large <= most_small * 3 / 2 + 8,
        "fetches read {large:?} pages at 20,000 blocked, {small:?} at 1,000 ({case})"
    );
}

/// A broker as a process of its own (the server binary, `serve`), for what is process-wide in
/// the library: the environment a deployment sets, and the Prometheus recorder (one per process,
/// so `/metrics` shows this broker's series only). Killed when dropped.
pub struct BrokerProcess {
    child: std::process::Child,
    /// Where its stderr (the log) goes.
    log: tempfile::NamedTempFile,
    /// Its gRPC address.
    pub addr: std::net::SocketAddr,
    /// Its metrics address.
    pub metrics_addr: std::net::SocketAddr,
}

impl BrokerProcess {
    /// Starts `dispatch-broker serve` on `db_url` and `redis_url` with `args` added, its
    /// environment without the test process's `DISPATCH_*` variables but with `vars`, and waits
    /// until both its ports accept connections.
    pub async fn start(
        db_url: &str,
        redis_url: &str,
        args: &[&str],
        vars: &[(&str, &str)],
    ) -> BrokerProcess {
        let port = || dispatch_testkit::free_port().expect("a free port");
        let addr: std::net::SocketAddr = format!("127.0.0.1:{}", port()).parse().unwrap();
        let metrics_addr: std::net::SocketAddr = format!("127.0.0.1:{}", port()).parse().unwrap();
        let mut serve = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-broker"));
        serve
            .args(["serve", "--postgres-url", db_url, "--redis-url", redis_url])
            .args(["--listen", &addr.to_string()])
            .args(["--metrics-listen", &metrics_addr.to_string()])
            .args(args)
            .stdout(std::process::Stdio::null());
        let log = tempfile::NamedTempFile::new().expect("a log file");
        serve.stderr(log.reopen().expect("the log file"));
        for (name, _) in std::env::vars().filter(|(n, _)| n.starts_with("DISPATCH_")) {
            serve.env_remove(name);
        }
        serve.envs(vars.iter().copied());
        let process = BrokerProcess {
            child: serve.spawn().expect("start the server binary"),
            log,
            addr,
            metrics_addr,
        };
        for at in [addr, metrics_addr] {
            eventually(Duration::from_secs(30), || async move {
                tokio::net::TcpStream::connect(at).await.is_ok()
            })
            .await
            .expect("the broker process listens");
        }
        process
    }

    /// What it has logged so far (its stderr; `DISPATCH_LOG` as the test sets it in `vars`,
    /// `info` by default).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).expect("read the log")
    }

    /// A client of it.
    pub async fn client(&self) -> BrokerClient<Channel> {
        BrokerClient::connect(format!("http://{}", self.addr))
            .await
            .expect("connect to the broker process")
    }

    /// Its `/metrics` page (Prometheus' text format).
    pub async fn metrics(&self) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.metrics_addr)
            .await
            .expect("connect to /metrics");
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut body = String::new();
        stream.read_to_string(&mut body).await.unwrap();
        assert!(
            body.starts_with("HTTP/1.0 200") || body.starts_with("HTTP/1.1 200"),
            "{body}"
        );
        body
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of the series `series` (its name with labels, as `/metrics` prints it) in a
/// Prometheus text page, if it is there.
pub fn metric(page: &str, series: &str) -> Option<f64> {
    page.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}
