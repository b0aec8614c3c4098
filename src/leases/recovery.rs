//! Rebuilding lost lock state (invariant 5): when Redis restarted empty, or failed over to a
//! replica that lost writes, the locks of every claimed incomplete task are rebuilt from Postgres
//! before anything is granted again.
//!
//! Detection: every script that grants checks the epoch key against the epoch this replica works
//! in, and the fencing counter against the highest token this replica handed out. A refusal makes
//! the RPC answer UNAVAILABLE ("being rebuilt") and wakes the background loop, which calls
//! [`Recovery::check`]. One replica at a time rebuilds (a Redis lock): it wipes the prefix, sets a
//! temporary epoch (so no other replica grants meanwhile) and a fencing floor above every token
//! handed out before, opens one lease per worker row that has claimed tasks (with a full TTL: a
//! worker's heartbeats may have failed only because Redis was gone; a dead one is swept a TTL
//! later), locks each task under it, and finally publishes a new epoch, only if no newer rebuild
//! took over. A rebuild that dies half-way leaves its epoch marked; once its lock expires, the
//! next check starts over. A live worker whose
//! heartbeat then gets NOT_FOUND reopens with its `app_status_id` and takes its locks back
//! (`open_lease.lua`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use crate::error::{Error, Result};
use crate::ids::{LeaseId, TaskId};
use crate::locks::{self, Acquire, Locks, NewLease};
use crate::metrics::Stats;
use crate::tasks::Tasks;

const REBUILDING: &str = "rebuilding:";
/// How long a rebuild may take before another replica may take over.
const REBUILD_LOCK_TTL: Duration = Duration::from_secs(60);

/// Watches the lock state and rebuilds it when lost.
#[derive(Clone)]
pub struct Recovery {
    locks: Locks,
    tasks: Tasks,
    stats: Arc<Stats>,
    /// This replica's id, as holder of the rebuild lock.
    replica: String,
    /// What fair dispatch groups tasks by: a rebuild counts the tasks holding locks by group.
    by: crate::fair::FairBy,
    /// One rebuild at a time in this replica.
    busy: Arc<tokio::sync::Mutex<()>>,
    /// Set when a grant was refused although the epoch matched: the counter went backwards.
    suspect: Arc<AtomicBool>,
}

impl Recovery {
    /// Builds the watcher for one replica.
    pub fn new(
        locks: Locks,
        tasks: Tasks,
        stats: Arc<Stats>,
        replica: String,
        by: crate::fair::FairBy,
    ) -> Self {
        Recovery {
            locks,
            tasks,
            stats,
            replica,
            by,
            busy: Arc::new(tokio::sync::Mutex::new(())),
            suspect: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Notes that a grant was refused for lost state (called by the background loop when woken).
    pub fn suspect(&self) {
        self.suspect.store(true, Ordering::Relaxed);
    }

    /// Makes sure this replica works in the lock state Redis holds, rebuilding it when lost.
    /// `Err(StateLost)` while another replica rebuilds.
    pub async fn check(&self) -> Result<()> {
        let suspect = self.suspect.swap(false, Ordering::Relaxed);
        let known = self.locks.epoch();
        match self.locks.current_epoch().await? {
            Some(current) if current.starts_with(REBUILDING) => {
                if self.locks.rebuild_locked().await? {
                    Err(Error::Redis(locks::Error::StateLost))
                } else {
                    // The replica that was rebuilding died or failed half-way: start over.
                    tracing::error!(
                        "a rebuild of lock state was left unfinished; rebuilding again"
                    );
                    self.rebuild().await
                }
            }
            Some(current) if current == known && !known.is_empty() => {
                if suspect && self.counter_regressed().await? {
                    tracing::error!("the fencing counter went backwards: redis lost writes; rebuilding lock state");
                    self.rebuild().await
                } else {
                    Ok(())
                }
            }
            Some(current) => {
                tracing::info!(epoch = %current, "working in the lock state in redis");
                self.locks.set_epoch(&current);
                Ok(())
            }
            None => {
                if !known.is_empty() {
                    tracing::error!(
                        "redis lost the lock state (no epoch); rebuilding it from postgres"
                    );
                }
                self.rebuild().await
            }
        }
    }

    /// True when a grant now would be refused although the epoch matches.
    async fn counter_regressed(&self) -> Result<bool> {
        // A probe acquire on a lease that cannot exist: "epoch" means regression, "lease" not.
        let probe = Uuid::new_v4();
        match self
            .locks
            .acquire(
                LeaseId(probe),
                TaskId(probe),
                &crate::ready::Resources::default(),
                locks::Admission::counted(Uuid::nil(), true),
            )
            .await
        {
            Err(locks::Error::StateLost) => Ok(true),
            Ok(_) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Rebuilds the lock state from Postgres (see the module docs).
    pub async fn rebuild(&self) -> Result<()> {
        let _one_at_a_time = self.busy.lock().await;
        // This replica never worked in a lock state: its first start, or Redis lost the state
        // before it came. Only what a rebuild restores tells the two apart.
        let first_start = self.locks.epoch().is_empty();
        let lost = || Error::Redis(locks::Error::StateLost);
        if !self
            .locks
            .try_recovery_lock(&self.replica, REBUILD_LOCK_TTL)
            .await?
        {
            return Err(lost());
        }
        // From here on no replica grants anything: the epoch says "rebuilding".
        let building = format!("{REBUILDING}{}", Uuid::new_v4());
        if !self.locks.rebuild_begin(&self.replica, &building).await? {
            return Err(lost());
        }
        self.locks.wipe().await?;
        let claimed = self.tasks.claimed_tasks().await?;
        let mut leases: HashMap<Uuid, LeaseId> = HashMap::new();
        let mut locked = 0usize;
        for task in &claimed {
            let lease_id = match leases.get(&task.app_status_id) {
                Some(id) => *id,
                None => {
                    let id = LeaseId(Uuid::new_v4());
                    // A full TTL from now for every worker, fresh or not: its heartbeats may have
                    // failed only because Redis was gone. A worker that is really dead is swept
                    // one TTL later, as usual.
                    let ttl = Duration::from_millis(task.worker_ttl_ms.max(1000) as u64);
                    let app_status = task.app_status_id.to_string();
                    self.locks
                        .open_lease_in(
                            &building,
                            &NewLease {
                                lease_id: id,
                                ttl,
                                worker_name: &task.worker_name,
                                app_status_id: &app_status,
                                owns_app_status: false,
                                versions: &task.worker_versions,
                                adopt: false,
                                open_id: None,
                            },
                        )
                        .await?;
                    self.locks.mark_recovered(&app_status, id).await?;
                    leases.insert(task.app_status_id, id);
                    id
                }
            };
            match self
                .locks
                .acquire_in(
                    &building,
                    0,
                    lease_id,
                    task.task_id,
                    &task.resources,
                    locks::Admission::counted(
                        crate::fair::group_of(self.by, task.domain, task.task_group),
                        task.immediate,
                    ),
                )
                .await?
            {
                Acquire::Granted { .. } => locked += 1,
                other => {
                    tracing::error!(task_id = %task.task_id, ?other, "a claimed task could not be locked again while rebuilding");
                }
            }
        }
        let epoch = Uuid::new_v4().to_string();
        if !self
            .locks
            .rebuild_end(&self.replica, &building, &epoch)
            .await?
        {
            return Err(lost());
        }
        self.locks.set_epoch(&epoch);
        if first_start && leases.is_empty() && locked == 0 {
            // Nothing was claimed, so nothing was lost: a broker's first start on an empty Redis
            // (not counted as a rebuild of lost state).
            tracing::info!(%epoch, "lock state started in an empty redis: no claimed task to restore");
        } else {
            self.stats.rebuild();
            tracing::warn!(%epoch, leases = leases.len(), locks = locked, "lock state rebuilt from postgres");
        }
        Ok(())
    }
}
