//! Heartbeats as Pulp sees them: each worker's `core_appstatus.last_heartbeat`, refreshed for
//! every lease that beat since the last write in one statement (heartbeat.sql), not one per
//! heartbeat. A lease's own liveness is its expiry in Redis; the row is what Pulp (and its
//! status API) reads, and it is written within a quarter of the lease's TTL after a beat, a
//! second at most.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use crate::shutdown::Shutdown;
use crate::tasks::Tasks;

/// The longest a beat waits for its row to be written.
pub const MAX_DELAY: Duration = Duration::from_secs(1);

/// After a write failed, the next try.
const RETRY: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
struct Pending {
    /// The rows of the leases that beat since the last write, each with when its lease expires
    /// unless it beats again (a row whose lease expired before its write is not written: its
    /// worker may be gone).
    rows: HashMap<Uuid, Instant>,
    /// When they must be written (the earliest of their beats' deadlines).
    due: Option<Instant>,
}

/// The rows waiting for their `last_heartbeat`, shared by the lease service and the writer.
#[derive(Debug, Clone, Default)]
pub struct Beats {
    pending: Arc<Mutex<Pending>>,
    sooner: Arc<tokio::sync::Notify>,
}

impl Beats {
    /// A lease with row `row` and time to live `ttl` beat now: its row is written within a
    /// quarter of the TTL ([`MAX_DELAY`] at most).
    pub fn beat(&self, row: Uuid, ttl: Duration) {
        let now = Instant::now();
        let due = now + (ttl / 4).min(MAX_DELAY);
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let expires = pending.rows.entry(row).or_insert(now);
        *expires = (*expires).max(now + ttl);
        if pending.due.is_none_or(|d| due < d) {
            pending.due = Some(due);
            self.sooner.notify_one();
        }
    }

    /// Writes the rows when they are due, in one statement each time, until shutdown; then
    /// writes those still pending (once: a beat answered after it is not written by this
    /// replica, the worker's next beat reaches another). A write that fails is tried again a
    /// second later with the rows that beat meanwhile, but for those whose lease expired.
    pub async fn run(self, tasks: Tasks, shutdown: Shutdown) {
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
                    self.write(&tasks).await;
                    return;
                }
            }
            self.write(&tasks).await;
        }
    }

    /// Writes every pending row now (one statement); on failure they stay pending.
    async fn write(&self, tasks: &Tasks) {
        let now = Instant::now();
        let rows: HashMap<Uuid, Instant> = {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            pending.due = None;
            pending
                .rows
                .drain()
                .filter(|(_, expires)| *expires > now)
                .collect()
        };
        if rows.is_empty() {
            return;
        }
        let ids: Vec<Uuid> = rows.keys().copied().collect();
        if let Err(e) = tasks.heartbeat(&ids).await {
            crate::metrics::heartbeat_write_error();
            tracing::warn!(error = %e, rows = ids.len(), "writing the workers' last_heartbeat failed; tried again in a second (rows whose lease expires meanwhile are dropped)");
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            for (row, expires) in rows {
                let kept = pending.rows.entry(row).or_insert(expires);
                *kept = (*kept).max(expires);
            }
            let retry = Instant::now() + RETRY;
            if pending.due.is_none_or(|d| retry < d) {
                pending.due = Some(retry);
            }
        }
    }
}
