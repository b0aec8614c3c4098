//! Leases: a worker incarnation's right to hold locks, granted with a TTL and kept by heartbeats.
//!
//! A lease lives in Redis (expiry judged by Redis server time) and is tied to one
//! `core_appstatus` row, whose id is what `core_task.app_lock_id` records for claimed tasks. This
//! module never hands out tasks; `dispatch` does.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::locks::{Locks, NewLease};
use crate::metrics::Stats;
use crate::tasks::Tasks;

/// The `error` reason of tasks a lease was still running when it closed.
pub const CLOSED_WHILE_RUNNING: &str = "Aborted during worker shutdown.";

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
}

/// A granted lease.
#[derive(Debug, Clone)]
pub struct Lease {
    /// The new, unguessable lease id.
    pub lease_id: Uuid,
    /// When it expires unless a heartbeat extends it.
    pub expires_at: DateTime<Utc>,
    /// Its TTL.
    pub ttl: Duration,
    /// The `core_appstatus` row it claims tasks for.
    pub app_status_id: Uuid,
}

/// A heartbeat's answer.
#[derive(Debug, Clone)]
pub struct Beat {
    /// The new expiry.
    pub expires_at: DateTime<Utc>,
    /// Tasks of the lease that were asked to cancel.
    pub cancel_task_ids: Vec<Uuid>,
}

/// What closing a lease did.
#[derive(Debug, Clone, Default)]
pub struct Closed {
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
}

impl Leases {
    /// Builds the lease service.
    pub fn new(locks: Locks, tasks: Tasks, ttl: TtlPolicy, stats: Arc<Stats>) -> Self {
        Leases {
            locks,
            tasks,
            ttl,
            stats,
        }
    }

    /// Opens a lease. Creates the worker's `core_appstatus` row when it brings none.
    pub async fn open(&self, request: OpenLease) -> Result<Lease> {
        let ttl = request.ttl.unwrap_or(self.ttl.default);
        if ttl < self.ttl.min || ttl > self.ttl.max {
            return Err(Error::InvalidArgument(format!(
                "ttl {ttl:?} is outside the accepted range {:?}..={:?}",
                self.ttl.min, self.ttl.max
            )));
        }
        let lease_id = Uuid::new_v4();
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
        let opened = self
            .locks
            .open_lease(&NewLease {
                lease_id: &lease_id.to_string(),
                ttl,
                worker_name: &request.worker_name,
                app_status_id: &app_status_id.to_string(),
                owns_app_status: owned,
                versions: &request.versions,
            })
            .await;
        let expires_at_ms = match opened {
            Ok(ms) => ms,
            Err(e) => {
                if owned {
                    // The lease never existed: remove the row created for it.
                    if let Err(cleanup) = self.tasks.close_worker(app_status_id, "", true).await {
                        tracing::warn!(%app_status_id, error = %cleanup, "could not remove the core_appstatus row of a lease that failed to open");
                    }
                }
                return Err(e.into());
            }
        };
        tracing::info!(%lease_id, worker = %request.worker_name, %app_status_id, ?ttl, "lease opened");
        Ok(Lease {
            lease_id,
            expires_at: from_ms(expires_at_ms),
            ttl,
            app_status_id,
        })
    }

    /// Extends a live lease and reports its tasks that were asked to cancel.
    pub async fn heartbeat(&self, lease_id: Uuid) -> Result<Beat> {
        let (expires_at_ms, app_status) = self
            .locks
            .heartbeat(&lease_id.to_string())
            .await?
            .ok_or_else(|| Error::LeaseNotFound(lease_id.to_string()))?;
        let app_status: Uuid = app_status
            .parse()
            .map_err(|_| Error::LeaseNotFound(lease_id.to_string()))?;
        let cancel_task_ids = self.tasks.heartbeat(app_status).await?;
        Ok(Beat {
            expires_at: from_ms(expires_at_ms),
            cancel_task_ids,
        })
    }

    /// Ends a lease: its claimed tasks go back to the queue, the tasks it still runs fail, its
    /// locks are released, and the worker row is removed when the broker created it. Postgres goes
    /// first, so a failure half-way leaves the locks in place and a retry completes the close.
    pub async fn close(&self, lease_id: Uuid) -> Result<Closed> {
        let id = lease_id.to_string();
        let (app_status, owned) = self
            .locks
            .lease_row(&id)
            .await?
            .ok_or_else(|| Error::LeaseNotFound(id.clone()))?;
        let app_status: Uuid = app_status
            .parse()
            .map_err(|_| Error::LeaseNotFound(id.clone()))?;
        let closed = self
            .tasks
            .close_worker(app_status, CLOSED_WHILE_RUNNING, owned)
            .await?;
        let released = self
            .locks
            .close_lease(&id)
            .await?
            .ok_or_else(|| Error::LeaseNotFound(id.clone()))?;
        self.stats.locks_released("close", u64::from(released));
        tracing::info!(%lease_id, released, requeued = closed.requeued, failed = closed.failed, "lease closed");
        Ok(Closed {
            released_locks: released,
            requeued_tasks: closed.requeued,
            failed_tasks: closed.failed,
        })
    }
}

/// Milliseconds since the epoch (Redis server time) as a timestamp.
pub fn from_ms(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or(DateTime::<Utc>::MIN_UTC)
}
