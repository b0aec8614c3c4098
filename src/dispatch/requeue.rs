//! Requeueing a grant that did not complete: the claim goes back to the queue and the locks are
//! released, or, when the claim cannot be put back, the locks stay with it.

use std::sync::Arc;

use uuid::Uuid;

use super::{Grant, Passes};
use crate::ids::{FencingToken, LeaseId, TaskId};
use crate::locks::{Locks, Release, REQUEUED_PREFIX};
use crate::metrics::Stats;
use crate::tasks::Tasks;

/// What requeues a grant that did not complete: its claim returned to the queue, its locks
/// released. Shared by the fetch pipeline and the waiting queue (a grant delivered to a call
/// that left).
#[derive(Clone)]
pub(super) struct Requeue {
    pub(super) locks: Locks,
    pub(super) tasks: Tasks,
    pub(super) stats: Arc<Stats>,
}

impl Requeue {
    /// Requeues an undelivered grant in a task of its own (counted in `passes`, so shutdown
    /// waits for it).
    pub(super) fn spawn_requeue(&self, grant: Grant, passes: &Arc<Passes>) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let requeue = self.clone();
                let running = passes.enter();
                runtime.spawn(async move {
                    let _running = running;
                    requeue.undelivered(&grant).await
                });
            }
            Err(_) => {
                tracing::error!(task_id = %grant.task_id, "a grant whose caller left could not be requeued (no runtime); it goes back when its lease ends");
            }
        }
    }

    /// Requeues a grant that could not be delivered.
    pub(super) async fn undelivered(&self, grant: &Grant) {
        tracing::warn!(task_id = %grant.task_id, "the caller went away before its grant was delivered; requeueing it");
        self.requeue(
            grant.task_id,
            grant.app_status_id,
            grant.lease_id,
            grant.fencing_token,
            grant.started_at.is_some(),
        )
        .await;
    }

    /// Requeues a task claimed by this grant, then releases its locks (`started`:
    /// the grant also started it, and was never delivered). If it cannot be requeued (Postgres
    /// unreachable), the locks stay with the claim, so the state stays consistent until the
    /// lease ends or the reconciler finds it.
    pub(super) async fn requeue(
        &self,
        task_id: TaskId,
        app_status: Uuid,
        lease_id: LeaseId,
        fencing_token: FencingToken,
        started: bool,
    ) {
        match self.tasks.requeue(task_id, app_status, started).await {
            Ok(requeued) => {
                if requeued {
                    self.note_requeue(task_id).await;
                }
                self.release_after_failure(lease_id, task_id, fencing_token)
                    .await
            }
            Err(e) => {
                tracing::error!(%task_id, error = %e, "could not requeue a claimed task; its locks stay with the claim")
            }
        }
    }

    /// Releases locks taken by a grant that did not complete, retrying a transient failure.
    pub(super) async fn release_after_failure(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        fencing_token: FencingToken,
    ) {
        match self
            .locks
            .release_retrying(lease_id, task_id, fencing_token)
            .await
        {
            Ok((Release::Released, _)) => self.stats.locks_released("fetch_failure", 1),
            Ok(_) => {}
            Err(e) => {
                tracing::error!(%task_id, %lease_id, error = %e, "locks of an incomplete grant stay until the lease ends")
            }
        }
    }

    /// Records that a claimed task went back to the queue: scan hints may have passed it, and
    /// check it first from now on (`ScanHint::returned`).
    pub(super) async fn note_requeue(&self, task_id: TaskId) {
        let change = format!("{REQUEUED_PREFIX}{task_id}");
        if let Err(e) = self.locks.note_changes(&[change.as_str()]).await {
            tracing::warn!(error = %e, "could not record a requeue; scan hints find the task when they are renewed");
        }
    }
}
