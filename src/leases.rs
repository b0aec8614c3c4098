//! Leases: a worker incarnation's right to hold locks, granted with a TTL and kept by heartbeats,
//! and everything that ends them: CloseLease, the sweeper (`leases/sweeper.rs`, which also runs
//! the reconciler), and the rebuild of lost lock state (`leases/recovery.rs`).
//!
//! A lease lives in Redis (expiry judged by Redis server time) and is tied to one
//! `core_appstatus` row, whose id is what `core_task.app_lock_id` records for claimed tasks.
//! Ending a lease always goes the same way: expire it (no more grants), end its tasks in Postgres
//! (claimed ones back to the queue, running ones failed), then release its locks through its
//! registry. A failure half-way leaves an expired lease, which the sweeper finishes. This module
//! never hands out tasks; `dispatch` does.

pub mod beats;
pub mod recovery;
pub mod sweeper;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::ids::{FencingToken, LeaseId, TaskId};
use crate::locks::{Locks, NewLease, Opened, Opening};
use crate::metrics::Stats;
use crate::tasks::Tasks;

/// The `error` reason of tasks a lease was still running when its worker closed it.
pub const CLOSED_WHILE_RUNNING: &str = "Aborted during worker shutdown.";
/// The `error` reason of tasks a lease was running when it expired (Pulp's own words).
pub const WORKER_MISSING: &str = "Worker has gone missing.";

/// A validated OpenLease request.
#[derive(Debug, Clone)]
pub struct OpenLease {
    /// The worker's name.
    pub worker_name: String,
    /// The worker's component versions.
    pub versions: BTreeMap<String, String>,
    /// The requested TTL; `None` for the broker's default.
    pub ttl: Option<Duration>,
    /// The worker's own `core_appstatus` row, if it has one.
    pub app_status_id: Option<Uuid>,
    /// The client's id for this open, the same in its retries of it.
    pub open_id: Option<Uuid>,
}

/// A granted lease.
#[derive(Debug, Clone)]
pub struct Lease {
    /// The new, unguessable lease id.
    pub lease_id: LeaseId,
    /// When it expires unless a heartbeat extends it.
    pub expires_at: DateTime<Utc>,
    /// Its TTL.
    pub ttl: Duration,
    /// The `core_appstatus` row it claims tasks for.
    pub app_status_id: Uuid,
    /// Locks rebuilt after a loss of Redis state and handed to this lease: (task, token).
    pub adopted: Vec<(String, u64)>,
}

/// A heartbeat's answer.
#[derive(Debug, Clone)]
pub struct Beat {
    /// The new expiry.
    pub expires_at: DateTime<Utc>,
    /// Tasks of the lease that were asked to cancel.
    pub cancel_task_ids: Vec<TaskId>,
    /// The core_appstatus row the lease claims tasks for.
    pub app_status: Uuid,
    /// Every task the lease holds locks for, with its fencing token.
    pub held: Vec<(TaskId, FencingToken)>,
}

/// What ending a lease did.
#[derive(Debug, Clone, Default)]
pub struct LeaseEnded {
    /// Task locks released.
    pub released_locks: u32,
    /// Claimed tasks put back in the queue.
    pub requeued_tasks: u32,
    /// Running tasks failed.
    pub failed_tasks: u32,
}

/// Bounds on the TTL a worker may ask for.
#[derive(Debug, Clone, Copy)]
pub struct TtlPolicy {
    /// Used when the request names none.
    pub default: Duration,
    /// The shortest TTL accepted.
    pub min: Duration,
    /// The longest TTL accepted.
    pub max: Duration,
}

/// Lease operations.
#[derive(Clone)]
pub struct Leases {
    locks: Locks,
    tasks: Tasks,
    ttl: TtlPolicy,
    stats: Arc<Stats>,
    canceling: Arc<tokio::sync::Mutex<CancelCache>>,
    beats: beats::Beats,
}

/// The `core_appstatus` row of a lease the lock store answered with.
fn row_of(opened: &Opened) -> Result<Uuid> {
    opened.app_status_id.parse().map_err(|_| {
        Error::Redis(crate::locks::Error::Protocol {
            script: "open_lease",
            reply: format!(
                "lease {} has row {:?}",
                opened.lease_id, opened.app_status_id
            ),
        })
    })
}

/// How long one read of the canceling tasks serves heartbeats.
const CANCEL_CACHE_AGE: Duration = Duration::from_secs(1);

/// A read of the canceling tasks still unfinished after this long was abandoned (the heartbeat
/// call that made it was dropped).
const ABANDONED_READ: Duration = Duration::from_secs(10);

/// Claimed tasks asked to cancel, by the row that claimed them, as last read.
#[derive(Default)]
struct CancelCache {
    read_at: Option<std::time::Instant>,
    /// When a heartbeat started reading them (and has not finished): the others answer with the
    /// last list meanwhile. A read older than [`ABANDONED_READ`] is taken as abandoned (its
    /// call was dropped) and another heartbeat reads.
    reading: Option<std::time::Instant>,
    by_row: HashMap<Uuid, Vec<TaskId>>,
}

impl Leases {
    /// Builds the lease service.
    pub fn new(locks: Locks, tasks: Tasks, ttl: TtlPolicy, stats: Arc<Stats>) -> Self {
        Leases {
            locks,
            tasks,
            ttl,
            stats,
            canceling: Arc::default(),
            beats: beats::Beats::default(),
        }
    }

    /// The workers' rows waiting for their `last_heartbeat` (written by [`beats::Beats::run`]).
    pub fn beats(&self) -> beats::Beats {
        self.beats.clone()
    }

    /// Opens a lease. Creates the worker's `core_appstatus` row when it brings none; when it
    /// brings one whose locks were rebuilt after a loss of Redis state, the lease takes them over.
    pub async fn open(&self, request: OpenLease) -> Result<Lease> {
        let ttl = request.ttl.unwrap_or(self.ttl.default);
        if ttl < self.ttl.min || ttl > self.ttl.max {
            return Err(Error::InvalidArgument(format!(
                "ttl {ttl:?} is outside the accepted range {:?}..={:?}",
                self.ttl.min, self.ttl.max
            )));
        }
        let lease_id = LeaseId(Uuid::new_v4());
        let (app_status_id, owned) = match request.app_status_id {
            Some(id) => {
                if !self.tasks.app_status_exists(id).await? {
                    return Err(Error::AppStatusNotFound(id));
                }
                (id, false)
            }
            None => {
                let id = Uuid::new_v4();
                self.tasks
                    .insert_app_status(id, &request.worker_name, &request.versions, ttl)
                    .await?;
                (id, true)
            }
        };
        let row = app_status_id.to_string();
        let new = NewLease {
            lease_id,
            ttl,
            worker_name: &request.worker_name,
            app_status_id: &row,
            owns_app_status: owned,
            versions: &request.versions,
            adopt: !owned,
            open_id: request.open_id,
        };
        let opened = self.open_usable(&new).await;
        let opened = match opened {
            Ok(Opening::Opened(opened)) if !opened.again => opened,
            other => {
                if owned {
                    // No lease was opened on the row created for this call: remove it.
                    if let Err(cleanup) = self.tasks.delete_app_status(app_status_id).await {
                        tracing::warn!(%app_status_id, error = %cleanup, "could not remove the core_appstatus row of a lease that was not opened");
                    }
                }
                match other? {
                    Opening::Opened(again) => return self.opened_before(again, &request),
                    Opening::OtherRow(row) => {
                        return Err(Error::InvalidArgument(format!(
                            "open_id {} already opened a lease for core_appstatus row {row}; \
                             use a new open_id for every open (the same one only to retry it)",
                            request.open_id.map(|id| id.to_string()).unwrap_or_default()
                        )))
                    }
                }
            }
        };
        if !opened.tasks.is_empty() {
            tracing::warn!(%lease_id, %app_status_id, tasks = opened.tasks.len(), "new lease took over locks rebuilt after redis lost its state");
        }
        self.stats.lease_opened();
        tracing::info!(%lease_id, worker = %request.worker_name, %app_status_id, ?ttl, "lease opened");
        Ok(Lease {
            lease_id,
            expires_at: from_ms(opened.expires_at_ms),
            ttl,
            app_status_id,
            adopted: opened.tasks,
        })
    }

    /// Opens `new`, or finds the lease an earlier call with its open id opened. That lease is
    /// of no use when the broker made its row and the row is gone: the earlier call, which could
    /// not tell whether its script ran (Redis timed out), removed it. It is ended then, and this
    /// call's lease opened on the row made for it.
    async fn open_usable(&self, new: &NewLease<'_>) -> Result<Opening> {
        let opened = self.locks.open_lease(new).await?;
        let Opening::Opened(again) = &opened else {
            return Ok(opened);
        };
        if !again.again || !new.owns_app_status {
            return Ok(opened);
        }
        let row = row_of(again)?;
        if self.tasks.app_status_exists(row).await? {
            return Ok(opened);
        }
        tracing::warn!(lease_id = %again.lease_id, %row, "OpenLease retried: the lease its first call opened lost its row when that call failed; ending it and opening another");
        self.locks.expire_now(again.lease_id, false).await?;
        Ok(self.locks.open_lease(new).await?)
    }

    /// The answer to a retry of an open whose first call opened `again`: that lease, with every
    /// task it holds as adopted (no one has used it: its id was never told to anyone).
    fn opened_before(&self, again: Opened, request: &OpenLease) -> Result<Lease> {
        let app_status_id = row_of(&again)?;
        tracing::info!(lease_id = %again.lease_id, worker = %request.worker_name, %app_status_id, tasks = again.tasks.len(), "OpenLease retried: answering the lease its first call opened");
        Ok(Lease {
            lease_id: again.lease_id,
            expires_at: from_ms(again.expires_at_ms),
            ttl: again.ttl,
            app_status_id,
            adopted: again.tasks,
        })
    }

    /// Extends a live lease and reports its tasks that were asked to cancel.
    pub async fn heartbeat(&self, lease_id: LeaseId) -> Result<Beat> {
        let beaten = self
            .locks
            .heartbeat(lease_id)
            .await?
            .ok_or_else(|| Error::LeaseNotFound(lease_id.to_string()))?;
        let app_status: Uuid = beaten
            .app_status
            .parse()
            .map_err(|_| Error::LeaseNotFound(lease_id.to_string()))?;
        // Its row is written with others' in one statement (`beats`), by the lease's own TTL (not
        // its expiry against this replica's clock).
        self.beats.beat(app_status, lease_id, beaten.ttl);
        let cancel_task_ids = self.canceling_for(app_status).await?;
        Ok(Beat {
            expires_at: from_ms(beaten.expires_ms),
            cancel_task_ids,
            app_status,
            held: beaten.held,
        })
    }

    /// The tasks claimed by `app_status` that were asked to cancel: from one read per second for
    /// all heartbeats of this replica. While one heartbeat reads, the others answer at once with
    /// the last list (a slow Postgres does not queue heartbeats behind the read).
    async fn canceling_for(&self, app_status: Uuid) -> Result<Vec<TaskId>> {
        let read = {
            let mut cache = self.canceling.lock().await;
            let due = cache
                .reading
                .is_none_or(|at| at.elapsed() >= ABANDONED_READ)
                && cache
                    .read_at
                    .is_none_or(|at| at.elapsed() >= CANCEL_CACHE_AGE);
            if !due {
                return Ok(cache.by_row.get(&app_status).cloned().unwrap_or_default());
            }
            cache.reading = Some(std::time::Instant::now());
            self.tasks.canceling()
        };
        let outcome = read.await;
        let mut cache = self.canceling.lock().await;
        cache.reading = None;
        // Stamped after the read: while Postgres is slow or down, the heartbeats of the next
        // second serve the last list instead of each repeating the failing read.
        cache.read_at = Some(std::time::Instant::now());
        match outcome {
            Ok(rows) => {
                let mut by_row: HashMap<Uuid, Vec<TaskId>> = HashMap::new();
                for (task, row) in rows {
                    by_row.entry(row).or_default().push(task);
                }
                cache.by_row = by_row;
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading canceling tasks failed; heartbeats report the last list")
            }
        }
        Ok(cache.by_row.get(&app_status).cloned().unwrap_or_default())
    }

    /// CloseLease: ends the lease now, as described in the module docs.
    pub async fn close(&self, lease_id: LeaseId) -> Result<LeaseEnded> {
        let closed = self
            .end(lease_id, CLOSED_WHILE_RUNNING, None, "close")
            .await?
            .ok_or_else(|| Error::LeaseNotFound(lease_id.to_string()))?;
        tracing::info!(%lease_id, released = closed.released_locks, requeued = closed.requeued_tasks, failed = closed.failed_tasks, "lease closed");
        Ok(closed)
    }

    /// RevokeLease and ForceRelease (an operator's order): ends the lease now as the sweeper
    /// would, live or expired, failing its running tasks with `reason`; `path` labels the
    /// released locks. `None` when the lease is unknown.
    pub async fn revoke(
        &self,
        lease_id: LeaseId,
        reason: &str,
        path: &'static str,
    ) -> Result<Option<LeaseEnded>> {
        self.end(lease_id, reason, None, path).await
    }

    /// Ends `lease`, whose `core_appstatus` row `row` was deleted outside the broker (found by
    /// the heartbeat writer, `beats`, or by a claim that broke the foreign key), as the sweeper
    /// ends an expired lease; logs and counts it. `false` when it is no longer live: whatever
    /// ends a lease (CloseLease, the sweeper, RevokeLease) expires it before it deletes the row
    /// the broker made for it, so a row found gone under an expired lease went that way, and
    /// that ending finishes the lease.
    pub async fn end_without_row(&self, lease: LeaseId, row: Uuid) -> Result<bool> {
        if self.locks.lease(lease).await?.is_none() {
            return Ok(false);
        }
        let Some(ended) = self
            .end(lease, WORKER_MISSING, None, "app_status_gone")
            .await?
        else {
            return Ok(false);
        };
        self.stats.lease_app_status_gone();
        tracing::warn!(
            lease_id = %lease,
            app_status_id = %row,
            released = ended.released_locks,
            requeued = ended.requeued_tasks,
            failed = ended.failed_tasks,
            "lease ended: its core_appstatus row was deleted outside the broker (Pulp's clean-up of missing processes, say); its worker opens a new one"
        );
        Ok(true)
    }

    /// Ends a lease: expire, end its tasks in Postgres, release its locks. `None` when the lease
    /// is unknown, or (for a sweeper) when the sweeper lock was lost meanwhile. `path` labels
    /// the released locks in the metrics.
    pub(crate) async fn end(
        &self,
        lease_id: LeaseId,
        reason: &str,
        sweeper: Option<&str>,
        path: &'static str,
    ) -> Result<Option<LeaseEnded>> {
        let Some(ending) = self.locks.expire_now(lease_id, sweeper.is_some()).await? else {
            if sweeper.is_some() {
                // An expiry entry without its lease: nothing to clean up but the entry.
                self.locks.forget_lease(lease_id).await?;
            }
            return Ok(None);
        };
        let app_status: Uuid = ending.app_status_id.parse().map_err(|_| {
            Error::Internal(format!(
                "lease {lease_id} names no valid core_appstatus row"
            ))
        })?;
        let task_ids: Vec<TaskId> = ending
            .task_ids
            .iter()
            .filter_map(|t| t.parse().ok())
            .collect();
        let ended = self
            .tasks
            .end_lease_tasks(app_status, &task_ids, reason, ending.owns_app_status)
            .await?;
        if !task_ids.is_empty() {
            // Claims may have gone back to the queue (now or in an earlier, failed attempt):
            // scan hints may have passed them.
            self.locks.note_changes(&["*"]).await?;
        }
        let released = match self.locks.close_lease(lease_id, sweeper).await? {
            Some(Some(released)) => released,
            // The sweeper finished this lease while its worker's CloseLease was under way (the
            // lease was expired by then): it is closed all the same.
            None if sweeper.is_none() => 0,
            _ => return Ok(None),
        };
        self.stats.locks_released(path, u64::from(released));
        Ok(Some(LeaseEnded {
            released_locks: released,
            requeued_tasks: ended.requeued,
            failed_tasks: ended.failed,
        }))
    }
}

/// Milliseconds since the epoch (Redis server time) as a timestamp.
pub fn from_ms(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or(DateTime::<Utc>::MIN_UTC)
}
