//! The background loop of every replica: checks the lock state (rebuilding it when lost), sweeps
//! expired leases and reconciles locks of finished tasks. At most one replica sweeps at a time
//! (the sweeper lock in Redis, held with a TTL of two intervals); the others only check.
//!
//! Sweeping a lease is `Leases::end` with Pulp's reason "Worker has gone missing.": its claimed
//! tasks go back to the queue, its running tasks fail, its locks are released through its
//! registry (O(locks held)), and the worker row the broker created for it is removed. So a lease's
//! locks are gone no later than TTL + one interval after its last heartbeat (invariant 1).
//!
//! Reconciling reads the set of locked tasks (O(locks held)) and releases every lock whose task
//! is final or gone, whoever holds it (invariant 2).

use std::time::Duration;

use uuid::Uuid;

use super::recovery::Recovery;
use super::{Leases, WORKER_MISSING};
use crate::error::Result;
use crate::locks::Locks;
use crate::metrics::Stats;
use crate::tasks::Tasks;
use std::sync::Arc;

/// Leases swept per turn at most; the rest wait for the next turn.
const SWEEP_BATCH: usize = 200;
/// Locked tasks checked per Postgres statement.
const RECONCILE_BATCH: usize = 1000;

/// One replica's background loop.
pub struct Sweeper {
    /// Lease operations (ending leases).
    pub leases: Leases,
    /// The lock store.
    pub locks: Locks,
    /// The task store.
    pub tasks: Tasks,
    /// Lock-state watcher.
    pub recovery: Recovery,
    /// Counters.
    pub stats: Arc<Stats>,
    /// Time between turns.
    pub interval: Duration,
    /// This replica's id, as holder of the sweeper lock.
    pub replica: String,
}

impl Sweeper {
    /// One turn: check the lock state, sweep, reconcile.
    pub async fn turn(&self) -> Result<()> {
        self.recovery.check().await?;
        let lock_ttl = self.interval * 2;
        let Some(expired) = self
            .locks
            .expired_leases(&self.replica, lock_ttl, SWEEP_BATCH)
            .await?
        else {
            return Ok(());
        };
        for lease in expired {
            match self
                .leases
                .end(&lease, WORKER_MISSING, Some(&self.replica))
                .await
            {
                Ok(Some(closed)) => {
                    self.stats.lease_swept();
                    tracing::warn!(lease_id = %lease, released = closed.released_locks, requeued = closed.requeued_tasks, failed = closed.failed_tasks, "expired lease swept");
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(lease_id = %lease, error = %e, "sweeping a lease failed; it stays expired and is retried")
                }
            }
        }
        self.reconcile().await
    }

    /// Releases the locks of tasks that are final or gone.
    async fn reconcile(&self) -> Result<()> {
        let locked: Vec<Uuid> = self
            .locks
            .locked_task_ids()
            .await?
            .iter()
            .filter_map(|id| id.parse().ok())
            .collect();
        for chunk in locked.chunks(RECONCILE_BATCH) {
            for task in self.tasks.finished_among(chunk).await? {
                if let Some(lease) = self.locks.force_release(&task.to_string()).await? {
                    self.stats.lock_reconciled();
                    tracing::warn!(task_id = %task, lease_id = %lease, "released the locks of a finished task");
                }
            }
        }
        Ok(())
    }
}
