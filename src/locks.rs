//! Lock and lease state in Redis: the only module that talks to Redis.
//!
//! Every change goes through one of the Lua scripts in `lua/` (loaded once at start-up, called
//! with EVALSHA), so each decision is atomic whichever broker replica makes it. Scripts that grant
//! (open a lease, heartbeat, lock a task) refuse when the lock state is not the one this replica
//! knows (the epoch key is gone or different, or the fencing counter went backwards): a Redis that
//! lost its data is never granted from before it was rebuilt (`leases::recovery`). This module
//! never decides readiness; it only executes what the scripts allow.
//!
//! One file per thing it keeps: `grants` (task locks, fencing tokens, releases), `leases`,
//! `changes` (the change log scan hints are checked against), `lanes` (the shared lane count),
//! `state` (the lock state's epoch and its rebuild), `views` (the operator's reads), `keys` (key
//! names) and `scripts` (loading the Lua scripts). This file holds the connection pool and how a
//! script is run and counted.

mod changes;
mod grants;
pub mod keys;
mod lanes;
mod leases;
mod scripts;
mod state;
mod views;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use deadpool_redis::redis::{self, Value};
use tokio::sync::Notify;

use crate::ids::{FencingToken, LeaseId, TaskId};
use crate::metrics::Stats;
use crate::ready::Resources;
pub use changes::{Change, Changes, OwnChanges, LEFT_PREFIX, REQUEUED_PREFIX};
pub use grants::{Acquire, Admission, Release, Wanted};
pub use keys::Keys;
pub use leases::{Beaten, Ending, LeaseRecord, NewLease, Opened, Opening};
use scripts::Scripts;
pub use views::{HeldLock, LeasePage, LeaseView};

/// Ids go to Redis as their text: keys and records hold the hyphenated form.
macro_rules! redis_text_arg {
    ($($id:ty),*) => {$(
        impl redis::ToRedisArgs for $id {
            fn write_redis_args<W>(&self, out: &mut W)
            where
                W: ?Sized + redis::RedisWrite,
            {
                out.write_arg(
                    self.0
                        .hyphenated()
                        .encode_lower(&mut uuid::Uuid::encode_buffer())
                        .as_bytes(),
                );
            }
        }

        impl redis::ToSingleRedisArg for $id {}
    )*};
}

redis_text_arg!(LeaseId, TaskId);

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
    /// The failure of a batched call, which every call in the batch shares (`crate::batch`).
    #[error(transparent)]
    Batch(Arc<Error>),
}

impl Error {
    /// True when the broker misread Redis (a bug), not when Redis failed.
    pub fn is_protocol(&self) -> bool {
        match self {
            Error::Protocol { .. } => true,
            Error::Batch(e) => e.is_protocol(),
            Error::Pool(_) | Error::Command(_) | Error::Timeout(_) | Error::StateLost => false,
        }
    }
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
    /// What those calls recorded in the change log, where they say (see [`Locks::own_changes`]).
    journal: std::sync::Mutex<changes::Journal>,
}

/// Counts a call that may have changed lock state when dropped (see [`Locks::changes_made`]),
/// with what it recorded in the change log when the call says so (`noted`); unknown otherwise.
struct Made<'a> {
    known: &'a Knowledge,
    noted: Option<changes::Noted>,
}

impl<'a> Made<'a> {
    fn new(known: &'a Knowledge) -> Made<'a> {
        Made { known, noted: None }
    }
}

impl Drop for Made<'_> {
    fn drop(&mut self) {
        // Counted under the journal's lock: whoever reads the count and then the journal finds
        // this call's entry in it.
        let mut journal = self.known.journal.lock().unwrap_or_else(|e| e.into_inner());
        let made = self.known.made.fetch_add(1, Ordering::SeqCst) + 1;
        journal.note(made, self.noted.take());
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
            // Last in, first out, as the Postgres pool (see `Tasks::connect`): at idle a call
            // takes a recently used connection and skips the idle check's round trip.
            .queue_mode(deadpool::managed::QueueMode::Lifo)
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
        let _counted = Made::new(&self.known);
        self.run_reading(invocation).await
    }

    /// Runs one prepared script invocation that may change lock state and says what it recorded
    /// in the change log: `read` turns its reply into the answer, the lock state (epoch) the
    /// script ran in and the changes it recorded (sequence number, names). The call is counted
    /// as [`Locks::run`] counts it, with those changes once its reply is read (see
    /// [`Locks::own_changes`]); unknown when it fails before that.
    async fn run_noting<R: redis::FromRedisValue, T>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
        read: impl FnOnce(R) -> Result<(T, String, Vec<(u64, Vec<String>)>), Error>,
    ) -> Result<T, Error> {
        let sent = std::time::Instant::now();
        let mut made = Made::new(&self.known);
        let (answer, epoch, changes) = read(self.run_reading(invocation).await?)?;
        made.noted = Some(changes::Noted::new(epoch, sent, changes));
        Ok(answer)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Calls one after another take the connection used last (see the Postgres pool's test in
    /// `tasks`): a connection handed out in turn would be idle-checked (UNWATCH, PING) first.
    #[tokio::test]
    async fn calls_one_after_another_reuse_the_last_connection() {
        let server = tokio::task::spawn_blocking(dispatch_testkit::Redis::start)
            .await
            .unwrap()
            .expect("start redis");
        let locks = Locks::connect(
            &server.url(),
            4,
            "test",
            Duration::from_secs(5),
            Arc::new(Stats::default()),
        )
        .await
        .unwrap();
        let held = futures::future::try_join_all((0..4).map(|_| locks.conn()))
            .await
            .unwrap();
        drop(held);
        let mut clients = std::collections::BTreeSet::new();
        for _ in 0..6 {
            let mut conn = locks.conn().await.unwrap();
            let id: i64 = redis::cmd("CLIENT")
                .arg("ID")
                .query_async(&mut *conn)
                .await
                .unwrap();
            clients.insert(id);
        }
        assert_eq!(
            clients.len(),
            1,
            "six calls one after another ran on {} connections",
            clients.len()
        );
    }

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
