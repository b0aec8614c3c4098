//! Heartbeats as Pulp sees them: each worker's `core_appstatus.last_heartbeat`, refreshed for
//! every lease that beat since the last write in one statement (heartbeat.sql), not one per
//! heartbeat. A lease's own liveness is its expiry in Redis; the row is what Pulp (and its
//! status API) reads, and it is written within a quarter of the lease's TTL after a beat, a
//! second at most.
//!
//! A row the write does not find was deleted outside the broker (Pulp's clean-up of missing
//! workers, an operator): Pulp no longer knows that worker, and no task can be claimed for it.
//! Its leases are ended as the sweeper ends an expired one ("Worker has gone missing."), so the
//! worker's next heartbeat answers NOT_FOUND and it opens a new lease (with a new row, or its own
//! row written again).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use crate::ids::LeaseId;
use crate::leases::Leases;
use crate::shutdown::Shutdown;

/// The longest a beat waits for its row to be written.
pub const MAX_DELAY: Duration = Duration::from_secs(1);

/// After a write failed, the next try.
const RETRY: Duration = Duration::from_secs(1);

/// A row waiting for its write.
#[derive(Debug)]
struct Beating {
    /// When its lease expires unless it beats again (a row whose lease expired before its write
    /// is not written: its worker may be gone).
    expires: Instant,
    /// The leases that beat with it (one, unless a worker reopened under its own row).
    leases: HashSet<LeaseId>,
}

#[derive(Debug, Default)]
struct Pending {
    /// The rows of the leases that beat since the last write.
    rows: HashMap<Uuid, Beating>,
    /// When they must be written (the earliest of their beats' deadlines).
    due: Option<Instant>,
}

impl Pending {
    /// `row` is to be written for `leases`, which live until `expires` at least.
    fn add(&mut self, row: Uuid, expires: Instant, leases: impl IntoIterator<Item = LeaseId>) {
        let beating = self.rows.entry(row).or_insert_with(|| Beating {
            expires,
            leases: HashSet::new(),
        });
        beating.expires = beating.expires.max(expires);
        beating.leases.extend(leases);
    }
}

/// The rows waiting for their `last_heartbeat`, shared by the lease service and the writer.
#[derive(Debug, Clone, Default)]
pub struct Beats {
    pending: Arc<Mutex<Pending>>,
    sooner: Arc<tokio::sync::Notify>,
}

impl Beats {
    /// Lease `lease` with row `row` and time to live `ttl` beat now: its row is written within
    /// a quarter of the TTL ([`MAX_DELAY`] at most).
    pub fn beat(&self, row: Uuid, lease: LeaseId, ttl: Duration) {
        let now = Instant::now();
        let (expires, due) = (now + ttl, now + (ttl / 4).min(MAX_DELAY));
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.add(row, expires, [lease]);
        if pending.due.is_none_or(|d| due < d) {
            pending.due = Some(due);
            self.sooner.notify_one();
        }
    }

    /// Writes the rows when they are due, in one statement each time, until shutdown; then
    /// writes those still pending (once: a beat answered after it is not written by this
    /// replica, the worker's next beat reaches another). A write that fails is tried again a
    /// second later with the rows that beat meanwhile, but for those whose lease expired. The
    /// leases of rows a write did not find are ended through `leases`.
    pub async fn run(self, leases: Leases, shutdown: Shutdown) {
        loop {
            let due = self.pending.lock().unwrap_or_else(|e| e.into_inner()).due;
            tokio::select! {
                () = async {
                    match due {
                        Some(due) => tokio::time::sleep_until(due).await,
                        None => std::future::pending().await,
                    }
                } => {}
                () = self.sooner.notified() => continue,
                () = shutdown.fired() => {
                    self.write(&leases).await;
                    return;
                }
            }
            self.write(&leases).await;
        }
    }

    /// Writes every pending row now (one statement); on failure they stay pending. Then ends
    /// the leases of the rows the write did not find.
    async fn write(&self, leases: &Leases) {
        let now = Instant::now();
        let rows: HashMap<Uuid, Beating> = {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            pending.due = None;
            pending
                .rows
                .drain()
                .filter(|(_, beating)| beating.expires > now)
                .collect()
        };
        if rows.is_empty() {
            return;
        }
        let ids: Vec<Uuid> = rows.keys().copied().collect();
        match leases.tasks.heartbeat(&ids).await {
            Ok(written) => {
                // Each in a task of its own: the writer keeps its pace for the other rows (a
                // row written late may look missing to Pulp's clean-up in turn).
                for (row, beating) in rows {
                    if !written.contains(&row) {
                        for lease in beating.leases {
                            let leases = leases.clone();
                            tokio::spawn(async move {
                                if let Err(e) = leases.end_without_row(lease, row).await {
                                    tracing::warn!(lease_id = %lease, app_status_id = %row, error = %e, "a lease whose core_appstatus row was deleted could not be ended now; tried again at its next beat, or swept once it expires");
                                }
                            });
                        }
                    }
                }
            }
            Err(e) => {
                crate::metrics::heartbeat_write_error();
                tracing::warn!(error = %e, rows = ids.len(), "writing the workers' last_heartbeat failed; tried again in a second (rows whose lease expires meanwhile are dropped)");
                let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                for (row, beating) in rows {
                    pending.add(row, beating.expires, beating.leases);
                }
                let retry = Instant::now() + RETRY;
                if pending.due.is_none_or(|d| retry < d) {
                    pending.due = Some(retry);
                }
            }
        }
    }
}
