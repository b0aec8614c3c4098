//! The lock state as the operator's view (`admin`) sees it: who holds what, which leases live,
//! the survey of blocked resources the lane gauge stored, and the one audited write of its own
//! (releasing a lock whose lease record is gone). Each read is one script whose cost is what is
//! held (locks, leases), never the number of tasks or a keyspace scan.

use deadpool_redis::redis::Value;

use super::{int, protocol, text, Error, Locks};
use crate::ids::{FencingToken, LeaseId, TaskId};

/// One held task lock and its holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLock {
    /// The task whose lock it is.
    pub task_id: String,
    /// The lease holding it.
    pub lease_id: String,
    /// The fencing token of the grant (grants are ordered by it: smaller is older).
    pub fencing_token: FencingToken,
    /// Resources held exclusively.
    pub exclusive: Vec<String>,
    /// Resources held shared.
    pub shared: Vec<String>,
    /// The holding lease's worker; `None` when the lease record is gone.
    pub worker: Option<String>,
    /// The holding lease's expiry (ms, Redis server time); `None` when the lease record is gone.
    pub lease_expires_ms: Option<i64>,
}

/// One lease as ListLeases shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseView {
    /// The lease id.
    pub lease_id: String,
    /// Expiry (ms, Redis server time).
    pub expires_ms: i64,
    /// The worker's name.
    pub worker: String,
    /// The worker row (core_appstatus) it claims tasks for.
    pub app_status_id: String,
    /// The worker's component versions (JSON object text).
    pub versions: String,
    /// Tasks whose locks it holds.
    pub task_ids: Vec<String>,
    /// The locks it holds, as record entries (`name`, `shared:name`).
    pub locks: Vec<String>,
}

/// One page of leases.
#[derive(Debug, Clone, Default)]
pub struct LeasePage {
    /// Redis server time (ms), to judge expiries by.
    pub now_ms: i64,
    /// Leases matching the filter, on all pages.
    pub total: u64,
    /// This page, in lease id order.
    pub leases: Vec<LeaseView>,
}

impl Locks {
    /// Every held task lock with its holder, and Redis server time (ms).
    pub async fn lock_table(&self) -> Result<(i64, Vec<HeldLock>), Error> {
        let reply: Vec<Value> = self
            .run_reading(
                self.scripts
                    .lock_table
                    .key(self.keys.locked())
                    .key(self.keys.leases())
                    .arg(self.keys.tag()),
            )
            .await?;
        let now = int(reply.first()).ok_or_else(|| protocol("lock_table", &reply))?;
        let rows = &reply[1..];
        if !rows.len().is_multiple_of(7) {
            return Err(protocol("lock_table", &reply));
        }
        let names = |v: &Value| -> Vec<String> {
            text(Some(v))
                .map(|joined| {
                    joined
                        .split('\n')
                        .filter(|n| !n.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default()
        };
        let locks = rows
            .chunks(7)
            .map(|r| {
                let worker = text(r.get(5)).unwrap_or_default();
                let gone = worker.is_empty() && int(r.get(6)).unwrap_or(0) == 0;
                HeldLock {
                    task_id: text(r.first()).unwrap_or_default(),
                    lease_id: text(r.get(1)).unwrap_or_default(),
                    fencing_token: FencingToken(int(r.get(2)).unwrap_or(0).max(0) as u64),
                    exclusive: names(&r[3]),
                    shared: names(&r[4]),
                    worker: (!gone).then_some(worker),
                    lease_expires_ms: (!gone).then(|| int(r.get(6)).unwrap_or(0)),
                }
            })
            .collect();
        Ok((now, locks))
    }

    /// One page of leases, in lease id order after `after`: live ones, or also those expired
    /// but not yet swept; `worker_contains` filters by worker name ("" for all). Without
    /// `details`, the tasks and locks of each lease are left out (for reading versions only).
    pub async fn lease_table(
        &self,
        worker_contains: &str,
        include_expired: bool,
        after: &str,
        page_size: usize,
        details: bool,
    ) -> Result<LeasePage, Error> {
        let reply: Vec<Value> = self
            .run_reading(
                self.scripts
                    .lease_table
                    .key(self.keys.leases())
                    .arg(self.keys.tag())
                    .arg(worker_contains)
                    .arg(if include_expired { "1" } else { "0" })
                    .arg(after)
                    .arg(page_size)
                    .arg(if details { "1" } else { "0" }),
            )
            .await?;
        let (Some(now_ms), Some(total)) = (int(reply.first()), int(reply.get(1))) else {
            return Err(protocol("lease_table", &reply));
        };
        let strings = |v: Option<&Value>| -> Vec<String> {
            match v {
                Some(Value::Array(items)) => items.iter().filter_map(|i| text(Some(i))).collect(),
                _ => Vec::new(),
            }
        };
        let mut leases = Vec::new();
        for entry in &reply[2..] {
            let Value::Array(f) = entry else {
                return Err(protocol("lease_table", &reply));
            };
            leases.push(LeaseView {
                lease_id: text(f.first()).unwrap_or_default(),
                expires_ms: int(f.get(1)).unwrap_or(0),
                worker: text(f.get(2)).unwrap_or_default(),
                app_status_id: text(f.get(3)).unwrap_or_default(),
                versions: text(f.get(4)).unwrap_or_else(|| "{}".into()),
                task_ids: strings(f.get(5)),
                locks: strings(f.get(6)),
            });
        }
        Ok(LeasePage {
            now_ms,
            total: total.max(0) as u64,
            leases,
        })
    }

    /// Releases the lock of `task_id` if it is still held by `lease_id` under `fencing_token`
    /// and that lease has no record and is not alive: `Some(true)` released, `Some(false)` the
    /// lock is gone or another holder's now, `None` the lease lives (nothing done either way).
    pub async fn release_orphan(
        &self,
        task_id: TaskId,
        lease_id: LeaseId,
        fencing_token: FencingToken,
    ) -> Result<Option<bool>, Error> {
        let code: i64 = self
            .run(
                self.scripts
                    .release_orphan
                    .key(self.keys.task(task_id))
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .arg(self.keys.tag())
                    .arg(task_id)
                    .arg(lease_id)
                    .arg(fencing_token.0),
            )
            .await?;
        match code {
            1 => Ok(Some(true)),
            0 => Ok(Some(false)),
            -1 => Ok(None),
            other => Err(protocol("release_orphan", &other)),
        }
    }

    /// The survey of blocked resources the last lane computation stored: `(JSON or None,
    /// computed-at ms, now ms)`.
    pub async fn blocked_survey(&self) -> Result<(Option<String>, i64, i64), Error> {
        let (survey, at, now): (String, i64, i64) = self
            .run_reading(&self.scripts.blocked_survey.key(self.keys.lanes()))
            .await?;
        Ok(((!survey.is_empty()).then_some(survey), at, now))
    }
}
