//! Lock and lease state in Redis: the only module that talks to Redis.
//!
//! Every change goes through one of the Lua scripts in `lua/` (loaded once at start-up, called
//! with EVALSHA), so each decision is atomic whichever broker replica makes it. Scripts that grant
//! (open a lease, heartbeat, lock a task) refuse when the lock state is not the one this replica
//! knows (the epoch key is gone or different, or the fencing counter went backwards): a Redis that
//! lost its data is never granted from before it was rebuilt (`leases::recovery`). This module
//! never decides readiness; it only executes what the scripts allow.

pub mod keys;
mod scripts;
mod views;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use deadpool_redis::redis::{self, Value};
use tokio::sync::Notify;

use crate::metrics::Stats;
use crate::ready::Resources;
pub use keys::Keys;
use scripts::Scripts;
pub use views::{HeldLock, LeasePage, LeaseView};

/// Failures of the lock store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No connection could be had from the pool (Redis down or unreachable).
    #[error("redis is unreachable: {0}")]
    Pool(#[from] deadpool::managed::PoolError<redis::RedisError>),
    /// A command failed on an established connection.
    #[error("redis command failed: {0}")]
    Command(#[from] redis::RedisError),
    /// Redis did not answer within the configured timeout.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// Redis lost the lock state (restarted empty, failed over without recent writes) or it is
    /// being rebuilt; nothing is granted until the rebuild from Postgres is done.
    #[error("lock state in redis was lost and is being rebuilt from postgres; retry shortly")]
    StateLost,
    /// A script answered with something the broker does not understand.
    #[error("unexpected reply from redis script {script}: {reply}")]
    Protocol {
        /// The script that answered.
        script: &'static str,
        /// The reply, for the log.
        reply: String,
    },
}

/// A lease as the lock store keeps it.
#[derive(Debug, Clone)]
pub struct LeaseRecord {
    /// Expiry in ms since the epoch, by Redis server time.
    pub expires_at_ms: i64,
    /// The `core_appstatus` row the lease claims tasks for.
    pub app_status_id: String,
    /// The worker's component versions.
    pub versions: BTreeMap<String, String>,
    /// The worker's name.
    pub worker_name: String,
}

/// What a lease is opened with.
#[derive(Debug, Clone)]
pub struct NewLease<'a> {
    /// The new lease's id.
    pub lease_id: &'a str,
    /// Time to live.
    pub ttl: Duration,
    /// The worker's name.
    pub worker_name: &'a str,
    /// The `core_appstatus` row it claims tasks for.
    pub app_status_id: &'a str,
    /// Whether the broker created that row (and so removes it when the lease ends).
    pub owns_app_status: bool,
    /// The worker's component versions.
    pub versions: &'a BTreeMap<String, String>,
}

/// The change recorded when a claimed task goes back to the queue is this prefix and the task's
/// id, not a resource name: a scan hint survives it and checks that task first (it may sit before
/// the hint's position). The control character keeps it apart from any resource name Pulp makes.
pub const REQUEUED_PREFIX: &str = "\u{1}requeued:";

/// The change recorded when a waiting task left the queue without a lock being released (Pulp
/// canceled it while nobody held it) is this prefix and an entry of its record (`NAME`, or
/// `shared:NAME`): it matters only to a scan hint whose passed-over tasks reserve that name, not
/// to one that relies on the name's lock still being held.
pub const LEFT_PREFIX: &str = "\u{1}left:";

/// One entry of the change log, read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change<'a> {
    /// Anything may have changed (`*`).
    All,
    /// A claimed task went back to the queue: its id, as recorded ([`REQUEUED_PREFIX`]).
    Requeued(&'a str),
    /// A waiting task that held nothing left the queue; it needed `name`, shared or not
    /// ([`LEFT_PREFIX`]).
    Left { name: &'a str, shared: bool },
    /// A lock on `name` was released, shared or exclusive.
    Released { name: &'a str, shared: bool },
}

impl<'a> Change<'a> {
    /// Reads one entry of [`Changes::changed`].
    pub fn of(entry: &'a str) -> Change<'a> {
        let split = |e: &'a str| match e.strip_prefix(crate::ready::SHARED_PREFIX) {
            Some(name) => (name, true),
            None => (e, false),
        };
        if let Some(id) = entry.strip_prefix(REQUEUED_PREFIX) {
            Change::Requeued(id)
        } else if let Some(left) = entry.strip_prefix(LEFT_PREFIX) {
            let (name, shared) = split(left);
            Change::Left { name, shared }
        } else if entry == "*" {
            Change::All
        } else {
            let (name, shared) = split(entry);
            Change::Released { name, shared }
        }
    }
}

/// What changed since a scan hint was taken.
#[derive(Debug, Clone)]
pub struct Changes {
    /// The change sequence now.
    pub seq: u64,
    /// Resource names changed since the hint (`"*"`: anything); `None` when that cannot be told
    /// (no hint, or too much changed).
    pub changed: Option<Vec<String>>,
}

/// A lease whose life was just ended, and what must be cleaned up after it.
#[derive(Debug, Clone)]
pub struct Ending {
    /// Its `core_appstatus` row.
    pub app_status_id: String,
    /// Whether the broker created that row.
    pub owns_app_status: bool,
    /// The tasks it holds locks for.
    pub task_ids: Vec<String>,
}

/// The outcome of trying to lock a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// Every lock is held now under the lease, with this fencing token.
    Granted {
        /// The token the holder must present to release.
        fencing_token: u64,
    },
    /// The lease is unknown or expired.
    LeaseGone,
    /// The task is already locked.
    TaskHeld,
    /// These resources are held in a conflicting mode.
    Blocked(Vec<String>),
}

/// The outcome of a checked release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The locks were released now.
    Released,
    /// Nothing was held (already released).
    NotHeld,
    /// Another lease holds the task.
    OtherLease,
    /// This lease holds the task under a different fencing token.
    StaleToken,
}

/// What this replica knows of the lock state, to notice when Redis lost it.
#[derive(Debug, Default)]
struct Knowledge {
    /// The epoch this replica works in ("" before the first check).
    epoch: RwLock<String>,
    /// The highest fencing token this replica has handed out.
    max_token: AtomicU64,
    /// Woken when a script reports lost state, so the background loop rebuilds at once.
    lost: Notify,
    /// Calls this replica made that may have changed lock state (releases, cancels, requeues,
    /// ended leases...), counted when each ended: see [`Locks::changes_made`].
    made: AtomicU64,
    /// The change counter as last read, and when that read was sent.
    seq_read: std::sync::Mutex<Option<(u64, std::time::Instant)>>,
}

/// Counts a call that may have changed lock state when dropped (see [`Locks::changes_made`]).
struct Made<'a>(&'a AtomicU64);

impl Drop for Made<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// deadpool-redis's manager, except that a pooled connection is checked (UNWATCH and PING) only
/// after it sat idle for [`crate::config::VERIFY_IDLE_AFTER`]: a busy broker pays no extra round
/// trip per call. A connection that broke in use is dropped by [`Locks::settle`], and the
/// multiplexed connection fails at once when its socket has closed.
pub struct QuickRecycle(deadpool_redis::Manager);

impl deadpool::managed::Manager for QuickRecycle {
    type Type = redis::aio::MultiplexedConnection;
    type Error = redis::RedisError;

    async fn create(&self) -> Result<Self::Type, Self::Error> {
        self.0.create().await
    }

    async fn recycle(
        &self,
        conn: &mut Self::Type,
        metrics: &deadpool::managed::Metrics,
    ) -> deadpool::managed::RecycleResult<Self::Error> {
        if metrics.last_used() < crate::config::VERIFY_IDLE_AFTER {
            return Ok(());
        }
        self.0.recycle(conn, metrics).await
    }
}

/// Handle on the lock store.
#[derive(Clone)]
pub struct Locks {
    pool: deadpool::managed::Pool<QuickRecycle>,
    keys: Keys,
    scripts: Arc<Scripts>,
    timeout: Duration,
    stats: Arc<Stats>,
    known: Arc<Knowledge>,
}

impl Locks {
    /// Connects the pool, loads every script (so a broken script fails at start-up) and returns
    /// the handle.
    pub async fn connect(
        url: &str,
        pool_size: usize,
        prefix: &str,
        timeout: Duration,
        stats: Arc<Stats>,
    ) -> Result<Self, Error> {
        let protocol = |e: String| Error::Protocol {
            script: "pool",
            reply: e,
        };
        let manager = deadpool_redis::Manager::new(url).map_err(|e| protocol(e.to_string()))?;
        let pool = deadpool::managed::Pool::builder(QuickRecycle(manager))
            .max_size(pool_size)
            .runtime(deadpool::Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout))
            .recycle_timeout(Some(timeout))
            .build()
            .map_err(|e| protocol(e.to_string()))?;
        let locks = Locks {
            pool,
            keys: Keys::new(prefix),
            scripts: Arc::new(Scripts::new()),
            timeout,
            stats,
            known: Arc::new(Knowledge::default()),
        };
        locks.load_scripts().await?;
        Ok(locks)
    }

    /// The same store, counting its calls in `stats` (the background loop counts apart from
    /// requests, so per-request costs stay exact).
    pub fn with_stats(&self, stats: Arc<Stats>) -> Locks {
        Locks {
            stats,
            ..self.clone()
        }
    }

    async fn load_scripts(&self) -> Result<(), Error> {
        let mut conn = self.conn().await?;
        for script in self.scripts.all() {
            self.stats.redis_call();
            tokio::time::timeout(self.timeout, script.load_async(&mut *conn))
                .await
                .map_err(|_| Error::Timeout(self.timeout))??;
        }
        Ok(())
    }

    async fn conn(&self) -> Result<deadpool::managed::Object<QuickRecycle>, Error> {
        Ok(self.pool.get().await?)
    }

    /// Runs one prepared script invocation that may change lock state, with the timeout,
    /// counting it as one Redis call and, however it ends (it may have run although the answer
    /// was lost), among the changes this replica made.
    async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, Error> {
        // Counted when the call ends, also when the caller drops it half-way (a client that hung
        // up): the script may have run all the same.
        let _counted = Made(&self.known.made);
        self.run_reading(invocation).await
    }

    /// Runs one prepared script invocation that changes nothing a scan hint relies on (it
    /// reads, takes locks, or keeps a lease alive), with the timeout, counting it as one Redis
    /// call.
    async fn run_reading<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, Error> {
        self.stats.redis_call();
        let mut conn = self.conn().await?;
        let outcome = tokio::time::timeout(self.timeout, invocation.invoke_async(&mut *conn)).await;
        self.settle(conn, outcome)
    }

    /// How many calls that may have changed lock state this replica made so far. A scan hint
    /// that was checked against the change log after this last moved still holds for every
    /// change made through this replica.
    pub fn changes_made(&self) -> u64 {
        self.known.made.load(Ordering::SeqCst)
    }

    /// The change counter as last read by this replica (by [`Locks::change_seq`], which every
    /// replica polls, or with a lease), and when that read was sent.
    pub fn seq_read(&self) -> Option<(u64, std::time::Instant)> {
        self.known.seq_read.lock().ok().and_then(|r| *r)
    }

    /// Notes a read of the change counter sent at `sent`, unless a later-sent read was noted.
    fn note_seq(&self, seq: u64, sent: std::time::Instant) {
        if let Ok(mut read) = self.known.seq_read.lock() {
            if read.is_none_or(|(_, at)| at < sent) {
                *read = Some((seq, sent));
            }
        }
    }

    /// Runs one plain command with the timeout, counting it.
    async fn command<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, Error> {
        self.stats.redis_call();
        let mut conn = self.conn().await?;
        let outcome = tokio::time::timeout(self.timeout, cmd.query_async(&mut *conn)).await;
        self.settle(conn, outcome)
    }

    /// Turns a call's outcome into a result. A connection whose call timed out or broke is
    /// dropped instead of going back to the pool: its late replies must never be read as the
    /// answer to another call.
    fn settle<T>(
        &self,
        conn: deadpool::managed::Object<QuickRecycle>,
        outcome: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Result<T, Error> {
        match outcome {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                if e.is_io_error()
                    || e.is_timeout()
                    || e.is_connection_dropped()
                    || e.is_unrecoverable_error()
                {
                    drop(deadpool::managed::Object::take(conn));
                }
                Err(Error::Command(e))
            }
            Err(_) => {
                drop(deadpool::managed::Object::take(conn));
                Err(Error::Timeout(self.timeout))
            }
        }
    }

    /// The epoch this replica works in.
    pub fn epoch(&self) -> String {
        self.known
            .epoch
            .read()
            .map(|e| e.clone())
            .unwrap_or_default()
    }

    /// Adopts `epoch` as the lock state this replica works in.
    pub fn set_epoch(&self, epoch: &str) {
        if let Ok(mut known) = self.known.epoch.write() {
            *known = epoch.to_owned();
        }
    }

    /// Reports lost lock state: wakes the background loop and returns the error to answer with.
    fn state_lost(&self) -> Error {
        self.known.lost.notify_one();
        Error::StateLost
    }

    /// Completes when a script has reported lost lock state since the last call.
    pub async fn lost(&self) {
        self.known.lost.notified().await
    }

    /// The epoch key's value in Redis, if any.
    pub async fn current_epoch(&self) -> Result<Option<String>, Error> {
        self.command(redis::cmd("GET").arg(self.keys.epoch())).await
    }

    /// Marks the epoch as being rebuilt by `owner` (who must hold the rebuild lock) and raises
    /// the fencing counter above every token handed out before; false without the lock.
    pub async fn rebuild_begin(&self, owner: &str, building: &str) -> Result<bool, Error> {
        let ok: i64 = self
            .run(
                self.scripts
                    .rebuild_begin
                    .key(self.keys.recovery())
                    .key(self.keys.epoch())
                    .key(self.keys.fence())
                    .arg(owner)
                    .arg(building)
                    .arg(self.known.max_token.load(Ordering::Relaxed)),
            )
            .await?;
        Ok(ok == 1)
    }

    /// Publishes the rebuilt state's epoch and frees the rebuild lock, only if the epoch is still
    /// `building`; false when a newer rebuild took over.
    pub async fn rebuild_end(
        &self,
        owner: &str,
        building: &str,
        epoch: &str,
    ) -> Result<bool, Error> {
        let ok: i64 = self
            .run(
                self.scripts
                    .rebuild_end
                    .key(self.keys.recovery())
                    .key(self.keys.epoch())
                    .arg(owner)
                    .arg(building)
                    .arg(epoch),
            )
            .await?;
        Ok(ok == 1)
    }

    /// Whether some replica holds the rebuild lock.
    pub async fn rebuild_locked(&self) -> Result<bool, Error> {
        let exists: i64 = self
            .command(redis::cmd("EXISTS").arg(self.keys.recovery()))
            .await?;
        Ok(exists == 1)
    }

    /// Takes the rebuild lock for `owner` (true) unless another replica holds it.
    pub async fn try_recovery_lock(&self, owner: &str, ttl: Duration) -> Result<bool, Error> {
        let set: Option<String> = self
            .command(
                redis::cmd("SET")
                    .arg(self.keys.recovery())
                    .arg(owner)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl.as_millis() as u64),
            )
            .await?;
        Ok(set.is_some())
    }

    /// Deletes every key of this prefix except the rebuild lock, the epoch and the fencing
    /// counter (only a rebuild does this, after marking the epoch, so no replica grants
    /// meanwhile; it is the one path that scans the keyspace).
    pub async fn wipe(&self) -> Result<u64, Error> {
        let mut conn = self.conn().await?;
        // The change counter is kept too, so scan-hint sequences never go backwards.
        let keep = [
            self.keys.recovery(),
            self.keys.epoch(),
            self.keys.fence(),
            self.keys.change_seq(),
        ];
        let mut cursor: u64 = 0;
        let mut deleted = 0;
        loop {
            self.stats.redis_call();
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(self.keys.all_pattern())
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut *conn)
                .await?;
            let batch: Vec<String> = batch.into_iter().filter(|k| !keep.contains(k)).collect();
            if !batch.is_empty() {
                self.stats.redis_call();
                deleted += redis::cmd("DEL")
                    .arg(&batch)
                    .query_async::<u64>(&mut *conn)
                    .await?;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }

    /// Marks a rebuilt lease as the one to hand to the worker that reopens with `app_status_id`.
    pub async fn mark_recovered(&self, app_status_id: &str, lease_id: &str) -> Result<(), Error> {
        self.command::<()>(
            redis::cmd("SET")
                .arg(self.keys.recovered(app_status_id))
                .arg(lease_id),
        )
        .await
    }

    /// Registers a new lease; returns its expiry (ms since the epoch, Redis server time).
    /// `epoch` is the lock state to open it in (the known one, or a rebuild's).
    pub async fn open_lease_in(&self, epoch: &str, lease: &NewLease<'_>) -> Result<i64, Error> {
        let versions = serde_json::to_string(lease.versions).unwrap_or_else(|_| "{}".into());
        let ttl_ms = lease.ttl.as_millis().clamp(1, i64::MAX as u128) as i64;
        let expires: i64 = self
            .run_reading(
                self.scripts
                    .open_lease
                    .key(self.keys.epoch())
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease.lease_id))
                    .arg(epoch)
                    .arg(lease.lease_id)
                    .arg(ttl_ms)
                    .arg(lease.worker_name)
                    .arg(lease.app_status_id)
                    .arg(if lease.owns_app_status { "1" } else { "0" })
                    .arg(versions),
            )
            .await?;
        match expires {
            -2 => Err(self.state_lost()),
            -1 => Err(Error::Protocol {
                script: "open_lease",
                reply: format!("lease id {} already exists", lease.lease_id),
            }),
            ms => Ok(ms),
        }
    }

    /// Registers a new lease in the known lock state.
    pub async fn open_lease(&self, lease: &NewLease<'_>) -> Result<i64, Error> {
        self.open_lease_in(&self.epoch(), lease).await
    }

    /// Hands the locks rebuilt for `app_status_id` to `lease_id`; returns (task id, token) pairs.
    pub async fn adopt(
        &self,
        app_status_id: &str,
        lease_id: &str,
    ) -> Result<Vec<(String, u64)>, Error> {
        let flat: Vec<String> = self
            .run(
                self.scripts
                    .adopt
                    .key(self.keys.recovered(app_status_id))
                    .key(self.keys.leases())
                    .key(self.keys.lease_tasks(lease_id))
                    .key(self.keys.epoch())
                    .arg(self.keys.tag())
                    .arg(lease_id)
                    .arg(self.epoch()),
            )
            .await?;
        Ok(flat
            .chunks(2)
            .filter_map(|pair| match pair {
                [task, token] => Some((task.clone(), token.parse().ok()?)),
                _ => None,
            })
            .collect())
    }

    /// Extends a live lease by its TTL: `Some((expiry ms, app_status_id))`, or `None` when the
    /// lease is unknown or expired.
    pub async fn heartbeat(&self, lease_id: &str) -> Result<Option<(i64, String)>, Error> {
        let reply: Vec<Value> = self
            .run_reading(
                self.scripts
                    .heartbeat
                    .key(self.keys.epoch())
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .arg(self.epoch())
                    .arg(lease_id),
            )
            .await?;
        match reply.first() {
            Some(Value::Int(1)) => {
                let expires = int(reply.get(1)).ok_or_else(|| protocol("heartbeat", &reply))?;
                let app_status = text(reply.get(2)).unwrap_or_default();
                Ok(Some((expires, app_status)))
            }
            Some(Value::Int(0)) => Ok(None),
            Some(Value::Int(-2)) => Err(self.state_lost()),
            _ => Err(protocol("heartbeat", &reply)),
        }
    }

    /// Reads a live lease; `None` when it is unknown or expired.
    pub async fn lease(&self, lease_id: &str) -> Result<Option<LeaseRecord>, Error> {
        Ok(self
            .lease_and_changes(lease_id, None)
            .await?
            .map(|(lease, _)| lease))
    }

    /// Reads a live lease together with what changed since a scan hint's change sequence.
    pub async fn lease_and_changes(
        &self,
        lease_id: &str,
        since: Option<u64>,
    ) -> Result<Option<(LeaseRecord, Changes)>, Error> {
        let sent = std::time::Instant::now();
        let reply: Vec<Value> = self
            .run_reading(
                self.scripts
                    .lease_info
                    .key(self.keys.epoch())
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .key(self.keys.changes())
                    .key(self.keys.change_seq())
                    .key(self.keys.change_floor())
                    .arg(self.epoch())
                    .arg(lease_id)
                    .arg(since.map(|s| s.to_string()).unwrap_or_default()),
            )
            .await?;
        match reply.first() {
            Some(Value::Int(1)) => {
                let lease = LeaseRecord {
                    expires_at_ms: int(reply.get(1))
                        .ok_or_else(|| protocol("lease_info", &reply))?,
                    app_status_id: text(reply.get(2)).unwrap_or_default(),
                    versions: text(reply.get(3))
                        .and_then(|v| serde_json::from_str(&v).ok())
                        .unwrap_or_default(),
                    worker_name: text(reply.get(4)).unwrap_or_default(),
                };
                let seq = int(reply.get(5)).unwrap_or(0).max(0) as u64;
                self.note_seq(seq, sent);
                let changed = match text(reply.get(6)).as_deref() {
                    Some("fresh") => Some(Vec::new()),
                    Some("changed") => {
                        Some(reply[7..].iter().filter_map(|v| text(Some(v))).collect())
                    }
                    _ => None,
                };
                Ok(Some((lease, Changes { seq, changed })))
            }
            Some(Value::Int(0)) => Ok(None),
            Some(Value::Int(-2)) => Err(self.state_lost()),
            _ => Err(protocol("lease_info", &reply)),
        }
    }

    /// Records that waiting tasks needing `names` may have become ready without a lock release
    /// ("*": anything may have changed).
    pub async fn note_changes(&self, names: &[&str]) -> Result<(), Error> {
        let mut invocation = self.scripts.note_changes.prepare_invoke();
        invocation.key(self.keys.changes()).arg(self.keys.tag());
        for name in names {
            invocation.arg(*name);
        }
        self.run::<i64>(&invocation).await.map(|_| ())
    }

    /// Locks every resource of a task for a lease in one atomic step, or nothing.
    pub async fn acquire(
        &self,
        lease_id: &str,
        task_id: &str,
        resources: &Resources,
    ) -> Result<Acquire, Error> {
        let epoch = self.epoch();
        let floor = self.known.max_token.load(Ordering::Relaxed);
        self.acquire_in(&epoch, floor, lease_id, task_id, resources)
            .await
    }

    /// [`Locks::acquire`] in a given lock state (a rebuild passes its own).
    pub async fn acquire_in(
        &self,
        epoch: &str,
        token_floor: u64,
        lease_id: &str,
        task_id: &str,
        resources: &Resources,
    ) -> Result<Acquire, Error> {
        let mut invocation = self.scripts.acquire.prepare_invoke();
        invocation
            .key(self.keys.epoch())
            .key(self.keys.leases())
            .key(self.keys.lease_tasks(lease_id))
            .key(self.keys.task(task_id))
            .key(self.keys.fence())
            .key(self.keys.locked());
        for name in resources.exclusive.iter().chain(&resources.shared) {
            invocation
                .key(self.keys.exclusive(name))
                .key(self.keys.shared(name));
        }
        invocation
            .arg(epoch)
            .arg(token_floor)
            .arg(lease_id)
            .arg(task_id)
            .arg(resources.exclusive.len())
            .arg(resources.shared.len());
        for name in resources.exclusive.iter().chain(&resources.shared) {
            invocation.arg(name);
        }
        let reply: Value = self.run_reading(&invocation).await?;
        let outcome = parse_acquire(reply)?;
        match &outcome {
            Acquire::Granted { fencing_token } => {
                self.known
                    .max_token
                    .fetch_max(*fencing_token, Ordering::Relaxed);
            }
            Acquire::Blocked(names) if names.is_empty() => return Err(self.state_lost()),
            _ => {}
        }
        Ok(outcome)
    }

    /// Releases a task's locks if `lease_id` holds them under `fencing_token`. Also returns the
    /// caller's lease's `core_appstatus` row ("" when the lease is gone).
    pub async fn release(
        &self,
        lease_id: &str,
        task_id: &str,
        fencing_token: u64,
    ) -> Result<(Release, String), Error> {
        let (code, app_status): (i64, String) = self
            .run(
                self.scripts
                    .release
                    .key(self.keys.task(task_id))
                    .arg(self.keys.tag())
                    .arg(task_id)
                    .arg(lease_id)
                    .arg(fencing_token.to_string()),
            )
            .await?;
        Ok((release_code("release", code)?, app_status))
    }

    /// Checks that a live lease holds a task under `fencing_token`: `Ok(Ok(app_status_id))` when
    /// it does, `Ok(Err(why))` when it does not (`Release::NotHeld` standing for "lease gone").
    pub async fn holder(
        &self,
        lease_id: &str,
        task_id: &str,
        fencing_token: u64,
    ) -> Result<std::result::Result<String, Release>, Error> {
        let (code, app_status): (i64, String) = self
            .run_reading(
                self.scripts
                    .holder
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .key(self.keys.task(task_id))
                    .arg(lease_id)
                    .arg(fencing_token.to_string()),
            )
            .await?;
        Ok(match release_code("holder", code)? {
            Release::Released => Ok(app_status),
            other => Err(other),
        })
    }

    /// Releases a task's locks if `lease_id` holds them (no token: only for the broker's own
    /// unclaimed grants whose acquire outcome is unknown); true when something was released.
    pub async fn abort(&self, lease_id: &str, task_id: &str) -> Result<bool, Error> {
        let released: i64 = self
            .run(
                self.scripts
                    .abort
                    .key(self.keys.task(task_id))
                    .arg(self.keys.tag())
                    .arg(task_id)
                    .arg(lease_id),
            )
            .await?;
        Ok(released == 1)
    }

    /// Releases a task's locks whoever holds them; returns the holding lease, if any. Only for
    /// tasks that are over (canceled, final).
    pub async fn force_release(&self, task_id: &str) -> Result<Option<String>, Error> {
        self.run(
            self.scripts
                .force_release
                .key(self.keys.task(task_id))
                .arg(self.keys.tag())
                .arg(task_id),
        )
        .await
    }

    /// Ends a lease's life now (no more grants or heartbeats) and returns what it held; `None`
    /// when the lease is unknown. `rotate` moves an already expired lease behind the others.
    pub async fn expire_now(&self, lease_id: &str, rotate: bool) -> Result<Option<Ending>, Error> {
        let reply: Vec<String> = self
            .run(
                self.scripts
                    .expire_now
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .key(self.keys.lease_tasks(lease_id))
                    .arg(lease_id)
                    .arg(if rotate { "rotate" } else { "" }),
            )
            .await?;
        let mut items = reply.into_iter();
        let Some(app_status_id) = items.next() else {
            return Ok(None);
        };
        let owns_app_status = items.next().as_deref() == Some("1");
        Ok(Some(Ending {
            app_status_id,
            owns_app_status,
            task_ids: items.collect(),
        }))
    }

    /// Removes a lease and releases all its locks; `None` when the lease is unknown. With a
    /// `sweeper` id, only an expired lease is closed, and only while that sweeper holds the
    /// sweeper lock (`Some(None)` otherwise: nothing changed).
    pub async fn close_lease(
        &self,
        lease_id: &str,
        sweeper: Option<&str>,
    ) -> Result<Option<Option<u32>>, Error> {
        let released: i64 = self
            .run(
                self.scripts
                    .close_lease
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .key(self.keys.lease_tasks(lease_id))
                    .key(self.keys.sweeper())
                    .arg(self.keys.tag())
                    .arg(lease_id)
                    .arg(sweeper.unwrap_or("")),
            )
            .await?;
        Ok(match released {
            -1 => None,
            -3 => Some(None),
            n => Some(u32::try_from(n).ok()),
        })
    }

    /// The sweeper's turn: `Some(expired lease ids)` when `sweeper` holds (or now took) the
    /// sweeper lock, `None` when another replica does.
    pub async fn expired_leases(
        &self,
        sweeper: &str,
        lock_ttl: Duration,
        limit: usize,
    ) -> Result<Option<Vec<String>>, Error> {
        let reply: Vec<Value> = self
            .run_reading(
                self.scripts
                    .expired
                    .key(self.keys.sweeper())
                    .key(self.keys.leases())
                    .arg(sweeper)
                    .arg(lock_ttl.as_millis() as u64)
                    .arg(limit),
            )
            .await?;
        match reply.first() {
            Some(Value::Int(1)) => Ok(Some(
                reply[1..].iter().filter_map(|v| text(Some(v))).collect(),
            )),
            Some(Value::Int(0)) => Ok(None),
            _ => Err(protocol("expired", &reply)),
        }
    }

    /// Drops a lease id from the expiry set when nothing else of it exists (a leftover).
    pub async fn forget_lease(&self, lease_id: &str) -> Result<(), Error> {
        self.command::<i64>(redis::cmd("ZREM").arg(self.keys.leases()).arg(lease_id))
            .await
            .map(|_| ())
    }

    /// Every task that holds a lock (the reconciler's list; O(locks held)).
    pub async fn locked_task_ids(&self) -> Result<Vec<String>, Error> {
        self.command(redis::cmd("SMEMBERS").arg(self.keys.locked()))
            .await
    }

    /// The shared lane count: `(value, computed-at ms, now ms)`, value `None` when none is cached.
    pub async fn lanes_cache(&self) -> Result<(Option<u64>, i64, i64), Error> {
        let (value, at, now): (i64, i64, i64) = self
            .run_reading(&self.scripts.lanes_cache.key(self.keys.lanes()))
            .await?;
        Ok((u64::try_from(value).ok(), at, now))
    }

    /// Takes the lane-computation lock for `owner` for `ttl`; false when another replica has it.
    pub async fn try_lanes_lock(&self, owner: &str, ttl: Duration) -> Result<bool, Error> {
        let set: Option<String> = self
            .command(
                redis::cmd("SET")
                    .arg(self.keys.lanes_lock())
                    .arg(owner)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl.as_millis().max(1) as u64),
            )
            .await?;
        Ok(set.is_some())
    }

    /// Publishes a lane count and, when the pass took one, the survey of blocked resources
    /// (JSON); returns its stamp (ms, server time).
    pub async fn store_lanes(&self, lanes: u64, survey: Option<&str>) -> Result<i64, Error> {
        self.run_reading(
            self.scripts
                .store_lanes
                .key(self.keys.lanes())
                .arg(lanes)
                .arg(survey.unwrap_or_default()),
        )
        .await
    }

    /// Which of these tasks hold a lock.
    pub async fn are_locked(&self, task_ids: &[String]) -> Result<Vec<bool>, Error> {
        if task_ids.is_empty() {
            return Ok(Vec::new());
        }
        self.command(
            redis::cmd("SMISMEMBER")
                .arg(self.keys.locked())
                .arg(task_ids),
        )
        .await
    }

    /// The change counter: bumped by every release, cancel and requeue, through any replica.
    pub async fn change_seq(&self) -> Result<u64, Error> {
        let sent = std::time::Instant::now();
        let seq: Option<u64> = self
            .command(redis::cmd("GET").arg(self.keys.change_seq()))
            .await?;
        let seq = seq.unwrap_or(0);
        self.note_seq(seq, sent);
        Ok(seq)
    }

    /// Live leases (not yet expired by Redis server time).
    pub async fn live_lease_count(&self) -> Result<u64, Error> {
        let reply: Vec<Value> = self.command(&redis::cmd("TIME")).await?;
        let now_ms = text(reply.first())
            .and_then(|s| s.parse::<i64>().ok())
            .map(|s| s * 1000)
            .unwrap_or(0);
        self.command(
            redis::cmd("ZCOUNT")
                .arg(self.keys.leases())
                .arg(format!("({now_ms}"))
                .arg("+inf"),
        )
        .await
    }

    /// Lists every task lock as (task id, lease id, fencing token). Scans the broker's keys: for
    /// tests and diagnostics only, never on a request path.
    pub async fn held_task_locks(&self) -> Result<Vec<(String, String, u64)>, Error> {
        let mut conn = self.conn().await?;
        let pattern = format!("{}:task:*", self.keys.tag());
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(&pattern)
            .query_async(&mut *conn)
            .await?;
        let mut locks = Vec::with_capacity(keys.len());
        for key in keys {
            let (lease, token): (Option<String>, Option<u64>) = redis::cmd("HMGET")
                .arg(&key)
                .arg("lease")
                .arg("token")
                .query_async(&mut *conn)
                .await?;
            // Released between the listing and this read: not held any more.
            if let (Some(lease), Some(token)) = (lease, token) {
                let task = key.rsplit(':').next().unwrap_or_default().to_owned();
                locks.push((task, lease, token));
            }
        }
        locks.sort();
        Ok(locks)
    }
}

fn text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn int(v: Option<&Value>) -> Option<i64> {
    match v? {
        Value::Int(i) => Some(*i),
        other => text(Some(other))?.parse().ok(),
    }
}

fn protocol(script: &'static str, reply: &impl std::fmt::Debug) -> Error {
    Error::Protocol {
        script,
        reply: format!("{reply:?}"),
    }
}

fn release_code(script: &'static str, code: i64) -> Result<Release, Error> {
    match code {
        1 => Ok(Release::Released),
        0 => Ok(Release::NotHeld),
        -1 => Ok(Release::OtherLease),
        -2 => Ok(Release::StaleToken),
        other => Err(Error::Protocol {
            script,
            reply: other.to_string(),
        }),
    }
}

/// Parses acquire.lua's reply. Lost state comes back as `Blocked(vec![])`, which the caller
/// turns into [`Error::StateLost`].
fn parse_acquire(reply: Value) -> Result<Acquire, Error> {
    let Value::Array(items) = &reply else {
        return Err(protocol("acquire", &reply));
    };
    match (items.first(), items.get(1)) {
        (Some(Value::Int(1)), Some(Value::Int(token))) => Ok(Acquire::Granted {
            fencing_token: u64::try_from(*token).map_err(|_| protocol("acquire", &reply))?,
        }),
        (Some(Value::Int(0)), Some(reason)) => match text(Some(reason)).as_deref() {
            Some("lease") => Ok(Acquire::LeaseGone),
            Some("task") => Ok(Acquire::TaskHeld),
            Some("epoch") => Ok(Acquire::Blocked(Vec::new())),
            Some("blocked") => Ok(Acquire::Blocked(
                items[2..].iter().filter_map(|v| text(Some(v))).collect(),
            )),
            _ => Err(protocol("acquire", &reply)),
        },
        _ => Err(protocol("acquire", &reply)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn change_log_entries_read_by_kind() {
        let requeued = format!("{REQUEUED_PREFIX}0191");
        let left = format!("{LEFT_PREFIX}shared:d");
        let left_x = format!("{LEFT_PREFIX}x");
        assert_eq!(Change::of(&requeued), Change::Requeued("0191"));
        assert_eq!(
            Change::of(&left),
            Change::Left {
                name: "d",
                shared: true
            }
        );
        assert_eq!(
            Change::of(&left_x),
            Change::Left {
                name: "x",
                shared: false
            }
        );
        assert_eq!(Change::of("*"), Change::All);
        assert_eq!(
            Change::of("shared:d"),
            Change::Released {
                name: "d",
                shared: true
            }
        );
        assert_eq!(
            Change::of("x"),
            Change::Released {
                name: "x",
                shared: false
            }
        );
    }
}
