//! The background loop of every replica: checks the lock state (rebuilding it when lost), sweeps
//! expired leases and reconciles locks of finished tasks. At most one replica sweeps at a time
//! (the sweeper lock in Redis, held with a TTL of two intervals); the others only check.
//!
//! Sweeping a lease is `Leases::end` with Pulp's reason "Worker has gone missing.": its claimed
//! tasks go back to the queue, its running tasks fail, its locks are released through its
//! registry (O(locks held)), and the worker row the broker created for it is removed. So a lease's
//! locks are gone no later than TTL + one interval after its last heartbeat (invariant 1).
//!
//! Tasks asked to cancel while nobody held them (Pulp's own cancel API marks a waiting task
//! `canceling` and leaves it to a worker) are finished as `canceled`, as Pulp's workers would.
//!
//! Reconciling reads the set of locked tasks (O(locks held)) and releases every lock whose task
//! is final or gone, whoever holds it (invariant 2), and every lock whose task has stayed waiting
//! and unclaimed for two turns (a grant that failed half-way). It also looks the other way: a
//! claimed incomplete task untouched for a while that holds no lock goes back to the queue when
//! it had not started, and makes the lock state be rebuilt from Postgres when it runs (Redis lost
//! writes), so no claim is left without a lock (O(claimed tasks)).

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use crate::ids::TaskId;

use super::recovery::Recovery;
use super::{Leases, WORKER_MISSING};
use crate::error::Result;
use crate::locks::Locks;
use crate::metrics::Stats;
use crate::states::TaskState;
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
    /// How long a claim must be untouched before a missing lock counts as lost.
    pub claim_grace: Duration,
    /// Locked tasks seen waiting and unclaimed in the previous turn.
    pub unclaimed_last_turn: Mutex<HashSet<TaskId>>,
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
                .end(lease, WORKER_MISSING, Some(&self.replica), "sweep")
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
        self.reconcile().await?;
        // Fair dispatch's counts of tasks holding locks, from the locks themselves.
        self.locks.recount().await?;
        Ok(())
    }

    /// Releases the locks that serve no one (see the module docs), then checks claims.
    async fn reconcile(&self) -> Result<()> {
        let locked: Vec<TaskId> = self
            .locks
            .locked_task_ids()
            .await?
            .iter()
            .filter_map(|id| id.parse().ok())
            .collect();
        let previous = self
            .unclaimed_last_turn
            .lock()
            .map(|mut set| std::mem::take(&mut *set))
            .unwrap_or_default();
        let mut unclaimed_now = HashSet::new();
        for chunk in locked.chunks(RECONCILE_BATCH) {
            for (task, finished) in self.tasks.lock_targets(chunk).await? {
                let release = finished || previous.contains(&task);
                if !finished {
                    unclaimed_now.insert(task);
                }
                if !release {
                    continue;
                }
                if let Some(lease) = self.locks.force_release(task).await? {
                    self.stats.lock_reconciled();
                    let why = if finished {
                        "the task is finished"
                    } else {
                        "the task was never claimed"
                    };
                    tracing::warn!(task_id = %task, lease_id = %lease, why, "released a lock that served no one");
                }
            }
        }
        if let Ok(mut set) = self.unclaimed_last_turn.lock() {
            *set = unclaimed_now.difference(&previous).copied().collect();
        }
        let canceled = self.tasks.finish_orphan_cancels().await?;
        if !canceled.is_empty() {
            // They held no lock: what changed is only that they no longer reserve their names.
            let left: Vec<String> = canceled
                .iter()
                .map(|entry| format!("{}{entry}", crate::locks::LEFT_PREFIX))
                .collect();
            self.locks
                .note_changes(&left.iter().map(String::as_str).collect::<Vec<_>>())
                .await?;
            let names: Vec<&str> = canceled.iter().map(String::as_str).collect();
            tracing::info!(resources = ?names, "finished tasks canceled while nobody held them");
        }
        self.claims_without_locks().await
    }

    /// Finds claimed incomplete tasks without a lock (see the module docs).
    async fn claims_without_locks(&self) -> Result<()> {
        let claimed = self.tasks.claimed_since(self.claim_grace).await?;
        for chunk in claimed.chunks(RECONCILE_BATCH) {
            let ids: Vec<TaskId> = chunk.iter().map(|(id, _, _)| *id).collect();
            let locked = self.locks.are_locked(&ids).await?;
            let mut lost_running = false;
            let mut running_unlocked = Vec::new();
            for ((task, state, app_status), has_lock) in chunk.iter().zip(locked) {
                if has_lock {
                    continue;
                }
                if *state != TaskState::Waiting {
                    running_unlocked.push(*task);
                    continue;
                }
                if self.tasks.requeue(*task, *app_status, false).await? {
                    self.locks.note_changes(&["*"]).await?;
                    self.stats.lock_reconciled();
                    tracing::warn!(task_id = %task, "a claimed task had no lock; back in the queue");
                }
            }
            // A running task read as claimed just before its locks went, on the way back to the
            // queue (an undelivered grant handed back: its locks are released first, then it is
            // requeued), is no lost write: only one still claimed, running and unlocked at a
            // second look is.
            if !running_unlocked.is_empty() {
                let still: HashSet<TaskId> = self
                    .tasks
                    .claimed_since(self.claim_grace)
                    .await?
                    .into_iter()
                    .filter(|(_, state, _)| *state != TaskState::Waiting)
                    .map(|(id, _, _)| id)
                    .collect();
                let again: Vec<TaskId> = running_unlocked
                    .into_iter()
                    .filter(|t| still.contains(t))
                    .collect();
                let locked = self.locks.are_locked(&again).await?;
                for (task, has_lock) in again.iter().zip(locked) {
                    if !has_lock {
                        tracing::error!(task_id = %task, "a running task has no lock: redis lost writes");
                        lost_running = true;
                    }
                }
            }
            if lost_running {
                return self.recovery.rebuild().await;
            }
        }
        Ok(())
    }
}
