//! Lock and lease state in Redis: the only module that talks to Redis.
//!
//! Every change goes through one of the Lua scripts in `lua/` (loaded once at start-up, called
//! with EVALSHA), so each decision is atomic whichever broker replica makes it. This module
//! never decides readiness; it only executes what the scripts allow.

pub mod keys;
mod scripts;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::{self, Value};

use crate::metrics::Stats;
use crate::ready::Resources;
pub use keys::Keys;
use scripts::Scripts;

/// Failures of the lock store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No connection could be had from the pool (Redis down or unreachable).
    #[error("redis is unreachable: {0}")]
    Pool(#[from] deadpool_redis::PoolError),
    /// A command failed on an established connection.
    #[error("redis command failed: {0}")]
    Command(#[from] redis::RedisError),
    /// Redis did not answer within the configured timeout.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// A script answered with something the broker does not understand (a bug or a foreign
    /// script under the same name).
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

/// Handle on the lock store.
#[derive(Clone)]
pub struct Locks {
    pool: deadpool_redis::Pool,
    keys: Keys,
    scripts: Arc<Scripts>,
    timeout: Duration,
    stats: Arc<Stats>,
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
        let mut config = deadpool_redis::Config::from_url(url);
        let mut pool_config = deadpool_redis::PoolConfig::new(pool_size);
        pool_config.timeouts.wait = Some(timeout);
        pool_config.timeouts.create = Some(timeout);
        pool_config.timeouts.recycle = Some(timeout);
        config.pool = Some(pool_config);
        let pool = config
            .create_pool(Some(deadpool_redis::Runtime::Tokio1))
            .map_err(|e| Error::Protocol {
                script: "pool",
                reply: e.to_string(),
            })?;
        let locks = Locks {
            pool,
            keys: Keys::new(prefix),
            scripts: Arc::new(Scripts::new()),
            timeout,
            stats,
        };
        locks.load_scripts().await?;
        Ok(locks)
    }

    /// The key builder for this store's prefix.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    async fn load_scripts(&self) -> Result<(), Error> {
        let mut conn = self.conn().await?;
        for script in self.scripts.all() {
            self.stats.redis_call();
            tokio::time::timeout(self.timeout, script.load_async(&mut conn))
                .await
                .map_err(|_| Error::Timeout(self.timeout))??;
        }
        Ok(())
    }

    async fn conn(&self) -> Result<deadpool_redis::Connection, Error> {
        Ok(self.pool.get().await?)
    }

    /// Runs one prepared script invocation with the timeout, counting it as one Redis call.
    async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, Error> {
        self.stats.redis_call();
        let mut conn = self.conn().await?;
        tokio::time::timeout(self.timeout, invocation.invoke_async(&mut conn))
            .await
            .map_err(|_| Error::Timeout(self.timeout))?
            .map_err(Error::from)
    }

    /// Registers a new lease; returns its expiry (ms since the epoch, Redis server time).
    pub async fn open_lease(&self, lease: &NewLease<'_>) -> Result<i64, Error> {
        let versions = serde_json::to_string(lease.versions).unwrap_or_else(|_| "{}".into());
        let ttl_ms = lease.ttl.as_millis().min(i64::MAX as u128) as i64;
        let expires: i64 = self
            .run(
                self.scripts
                    .open_lease
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease.lease_id))
                    .arg(lease.lease_id)
                    .arg(ttl_ms)
                    .arg(lease.worker_name)
                    .arg(lease.app_status_id)
                    .arg(if lease.owns_app_status { "1" } else { "0" })
                    .arg(versions),
            )
            .await?;
        if expires < 0 {
            return Err(Error::Protocol {
                script: "open_lease",
                reply: format!("lease id {} already exists", lease.lease_id),
            });
        }
        Ok(expires)
    }

    /// Extends a live lease by its TTL: `Some((expiry ms, app_status_id))`, or `None` when the
    /// lease is unknown or expired.
    pub async fn heartbeat(&self, lease_id: &str) -> Result<Option<(i64, String)>, Error> {
        self.run(
            self.scripts
                .heartbeat
                .key(self.keys.leases())
                .key(self.keys.lease(lease_id))
                .arg(lease_id),
        )
        .await
    }

    /// Reads a live lease; `None` when it is unknown or expired.
    pub async fn lease(&self, lease_id: &str) -> Result<Option<LeaseRecord>, Error> {
        let reply: Option<(i64, String, String, String)> = self
            .run(
                self.scripts
                    .lease_info
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .arg(lease_id),
            )
            .await?;
        Ok(reply.map(
            |(expires_at_ms, app_status_id, versions, worker_name)| LeaseRecord {
                expires_at_ms,
                app_status_id,
                versions: serde_json::from_str(&versions).unwrap_or_default(),
                worker_name,
            },
        ))
    }

    /// Locks every resource of a task for a lease in one atomic step, or nothing.
    pub async fn acquire(
        &self,
        lease_id: &str,
        task_id: &str,
        resources: &Resources,
    ) -> Result<Acquire, Error> {
        let mut invocation = self.scripts.acquire.prepare_invoke();
        invocation
            .key(self.keys.leases())
            .key(self.keys.lease_tasks(lease_id))
            .key(self.keys.task(task_id))
            .key(self.keys.fence());
        for name in resources.exclusive.iter().chain(&resources.shared) {
            invocation
                .key(self.keys.exclusive(name))
                .key(self.keys.shared(name));
        }
        invocation
            .arg(lease_id)
            .arg(task_id)
            .arg(resources.exclusive.len())
            .arg(resources.shared.len());
        for name in resources.exclusive.iter().chain(&resources.shared) {
            invocation.arg(name);
        }
        let reply: Value = self.run(&invocation).await?;
        parse_acquire(reply)
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
            .run(
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

    /// Reads a lease's worker row and whether the broker owns it, alive or expired; `None` when
    /// the lease is unknown.
    pub async fn lease_row(&self, lease_id: &str) -> Result<Option<(String, bool)>, Error> {
        self.stats.redis_call();
        let mut conn = self.conn().await?;
        let (app_status, owned): (Option<String>, Option<String>) = tokio::time::timeout(
            self.timeout,
            redis::cmd("HMGET")
                .arg(self.keys.lease(lease_id))
                .arg("app_status")
                .arg("owned")
                .query_async(&mut conn),
        )
        .await
        .map_err(|_| Error::Timeout(self.timeout))??;
        Ok(app_status.map(|a| (a, owned.as_deref() == Some("1"))))
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

    /// Ends a lease and releases all its locks; `None` when the lease is unknown.
    pub async fn close_lease(&self, lease_id: &str) -> Result<Option<u32>, Error> {
        let released: i64 = self
            .run(
                self.scripts
                    .close_lease
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .key(self.keys.lease_tasks(lease_id))
                    .arg(self.keys.tag())
                    .arg(lease_id),
            )
            .await?;
        Ok(u32::try_from(released).ok())
    }

    /// Lists every task lock as (task id, lease id, fencing token). Scans the broker's keys: for
    /// tests and diagnostics only, never on a request path.
    pub async fn held_task_locks(&self) -> Result<Vec<(String, String, u64)>, Error> {
        let mut conn = self.conn().await?;
        let pattern = format!("{}:task:*", self.keys.tag());
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(&pattern)
            .query_async(&mut conn)
            .await?;
        let mut locks = Vec::with_capacity(keys.len());
        for key in keys {
            let (lease, token): (String, u64) = redis::cmd("HMGET")
                .arg(&key)
                .arg("lease")
                .arg("token")
                .query_async(&mut conn)
                .await?;
            let task = key.rsplit(':').next().unwrap_or_default().to_owned();
            locks.push((task, lease, token));
        }
        locks.sort();
        Ok(locks)
    }

    /// Every key under the broker's prefix (tests and diagnostics only).
    pub async fn all_keys(&self) -> Result<Vec<String>, Error> {
        let mut conn = self.conn().await?;
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(self.keys.all_pattern())
            .query_async(&mut conn)
            .await?;
        keys.sort();
        Ok(keys)
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

fn parse_acquire(reply: Value) -> Result<Acquire, Error> {
    let protocol = |reply: &Value| Error::Protocol {
        script: "acquire",
        reply: format!("{reply:?}"),
    };
    let Value::Array(items) = &reply else {
        return Err(protocol(&reply));
    };
    let text = |v: &Value| -> Option<String> {
        match v {
            Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
            Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        }
    };
    match (items.first(), items.get(1)) {
        (Some(Value::Int(1)), Some(Value::Int(token))) => Ok(Acquire::Granted {
            fencing_token: u64::try_from(*token).map_err(|_| protocol(&reply))?,
        }),
        (Some(Value::Int(0)), Some(reason)) => match text(reason).as_deref() {
            Some("lease") => Ok(Acquire::LeaseGone),
            Some("task") => Ok(Acquire::TaskHeld),
            Some("blocked") => Ok(Acquire::Blocked(
                items[2..].iter().filter_map(text).collect(),
            )),
            _ => Err(protocol(&reply)),
        },
        _ => Err(protocol(&reply)),
    }
}
