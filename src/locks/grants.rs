//! Grants and releases: locking a task's resources all at once with a fencing token, checking
//! and releasing what a holder holds, and the reconciler's list of locked tasks.

use super::*;
use crate::fair::{Group, HeldBack, Standing};
use crate::ids::{FencingToken, TaskId};

/// The outcome of trying to lock a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// Every lock is held now under the lease, with this fencing token.
    Granted {
        /// The token the holder must present to release.
        fencing_token: FencingToken,
    },
    /// The lease is unknown or expired.
    LeaseGone,
    /// The task is already locked.
    TaskHeld,
    /// These resources are held in a conflicting mode.
    Blocked(Vec<String>),
    /// Ready, but fairness holds it back: its group's cap, or the reserve for immediate tasks.
    HeldBack(HeldBack),
}

/// What the acquire script checks of fairness for one task (src/fair.rs): its group, whether it
/// is immediate, the group's cap and the reserve in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// The task's group.
    pub group: Group,
    /// Pulp's `immediate`.
    pub immediate: bool,
    /// The group's cap, if it has one.
    pub cap: Option<u32>,
    /// Leases kept for immediate tasks.
    pub reserve: u32,
}

impl Admission {
    /// Counted under its group, but never held back (a rebuild restoring the locks of tasks
    /// that were running already).
    pub fn counted(group: Group, immediate: bool) -> Self {
        Admission {
            group,
            immediate,
            cap: None,
            reserve: 0,
        }
    }
}

/// One task to lock: for whom, its resources, and what fairness checks of it.
#[derive(Debug, Clone, Copy)]
pub struct Wanted<'a> {
    pub lease_id: LeaseId,
    pub task_id: TaskId,
    pub resources: &'a Resources,
    pub admission: Admission,
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

pub(super) fn release_code(script: &'static str, code: i64) -> Result<Release, Error> {
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

/// Parses acquire.lua's reply. Lost state comes back as `Blocked(vec![])`, which the caller
/// turns into [`Error::StateLost`].
pub(super) fn parse_acquire(reply: Value) -> Result<Acquire, Error> {
    let Value::Array(items) = &reply else {
        return Err(protocol("acquire", &reply));
    };
    match (items.first(), items.get(1)) {
        (Some(Value::Int(1)), Some(Value::Int(token))) => Ok(Acquire::Granted {
            fencing_token: FencingToken(
                u64::try_from(*token).map_err(|_| protocol("acquire", &reply))?,
            ),
        }),
        (Some(Value::Int(0)), Some(reason)) => match text(Some(reason)).as_deref() {
            Some("lease") => Ok(Acquire::LeaseGone),
            Some("task") => Ok(Acquire::TaskHeld),
            Some("epoch") => Ok(Acquire::Blocked(Vec::new())),
            Some("blocked") => Ok(Acquire::Blocked(
                items[2..].iter().filter_map(|v| text(Some(v))).collect(),
            )),
            Some(why @ ("cap" | "reserve")) => {
                let Some(Value::Int(n)) = items.get(2) else {
                    return Err(protocol("acquire", &reply));
                };
                let n = u32::try_from(*n).map_err(|_| protocol("acquire", &reply))?;
                Ok(Acquire::HeldBack(if why == "cap" {
                    HeldBack::Cap { cap: n }
                } else {
                    HeldBack::Reserve { reserve: n }
                }))
            }
            _ => Err(protocol("acquire", &reply)),
        },
        _ => Err(protocol("acquire", &reply)),
    }
}

/// A hash's fields and values from Redis' flat reply.
fn pairs(flat: Vec<String>) -> Vec<(String, String)> {
    let mut flat = flat.into_iter();
    std::iter::from_fn(|| Some((flat.next()?, flat.next()?))).collect()
}

impl Locks {
    /// What holds locks now, on every replica: tasks by group, deferred tasks, live leases
    /// (standing.lua, one call; changes nothing).
    pub async fn standing(&self) -> Result<Standing, Error> {
        let reply: Value = self
            .run_reading(
                self.scripts
                    .standing
                    .key(self.keys.running())
                    .key(self.keys.deferred())
                    .key(self.keys.leases()),
            )
            .await?;
        let bad = || protocol("standing", &reply);
        let Value::Array(items) = &reply else {
            return Err(bad());
        };
        let count = |v: Option<&Value>| match v {
            Some(Value::Int(n)) => u32::try_from(*n.max(&0)).map_err(|_| bad()),
            _ => Err(bad()),
        };
        let mut standing = Standing {
            deferred: count(items.first())?,
            live_leases: count(items.get(1))?,
            ..Standing::default()
        };
        for pair in items.get(2..).unwrap_or_default().chunks(2) {
            let group: Group = text(pair.first())
                .and_then(|g| g.parse().ok())
                .ok_or_else(bad)?;
            standing.running.insert(group, count(pair.get(1))?);
        }
        Ok(standing)
    }

    /// The fairness policy's overrides made at run time, as Redis keeps them (field, value).
    pub async fn fair_overrides(&self) -> Result<Vec<(String, String)>, Error> {
        let flat: Vec<String> = self
            .command(redis::cmd("HGETALL").arg(self.keys.fair_overrides()))
            .await?;
        Ok(pairs(flat))
    }

    /// Records overrides of the fairness policy (`fields`: see `fair::override_fields`) made over
    /// the policy file whose text hashes to `base`: every override kept now, or `Err(kept)`, the
    /// base of the overrides kept, when they were made over another policy file (nothing is
    /// changed then).
    pub async fn override_fairness(
        &self,
        base: u64,
        fields: &[(String, String)],
    ) -> Result<Result<Vec<(String, String)>, u64>, Error> {
        let mut invocation = self.scripts.fair_override.key(self.keys.fair_overrides());
        invocation.arg(base.to_string());
        for (field, value) in fields {
            invocation.arg(field).arg(value);
        }
        let reply: Value = self.run_reading(&invocation).await?;
        let bad = || protocol("fair_override", &reply);
        let Value::Array(items) = &reply else {
            return Err(bad());
        };
        match items.first() {
            Some(Value::Int(1)) => {
                let flat: Vec<String> = items[1..]
                    .iter()
                    .map(|v| text(Some(v)).ok_or_else(bad))
                    .collect::<Result<_, _>>()?;
                Ok(Ok(pairs(flat)))
            }
            Some(Value::Int(0)) => {
                let kept = text(items.get(1))
                    .and_then(|b| b.parse().ok())
                    .ok_or_else(bad)?;
                Ok(Err(kept))
            }
            _ => Err(bad()),
        }
    }

    /// Drops every override of the fairness policy made at run time.
    pub async fn drop_fair_overrides(&self) -> Result<(), Error> {
        self.command(redis::cmd("DEL").arg(self.keys.fair_overrides()))
            .await
    }

    /// Counts the tasks holding locks anew, by group and deferred (recount.lua; the sweeping
    /// replica, every sweep). Returns how many task locks it counted.
    pub async fn recount(&self) -> Result<u64, Error> {
        self.run_reading(
            self.scripts
                .recount
                .key(self.keys.locked())
                .key(self.keys.running())
                .key(self.keys.deferred())
                .arg(self.keys.tag()),
        )
        .await
    }

    /// Locks every resource of a task for a lease in one atomic step, or nothing.
    pub async fn acquire(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        resources: &Resources,
        admission: Admission,
    ) -> Result<Acquire, Error> {
        let mut outcomes = self
            .acquire_all(&[Wanted {
                lease_id,
                task_id,
                resources,
                admission,
            }])
            .await?;
        outcomes
            .pop()
            .ok_or_else(|| protocol("acquire", &"no reply"))
    }

    /// [`Locks::acquire`] for several tasks in one call (a fetch round's): tried in order, each
    /// seeing what the ones before it took. One outcome per task, in order.
    pub async fn acquire_all(&self, wanted: &[Wanted<'_>]) -> Result<Vec<Acquire>, Error> {
        let epoch = self.epoch();
        let floor = self.known.max_token.load(Ordering::Relaxed);
        self.acquire_all_in(&epoch, floor, wanted).await
    }

    /// [`Locks::acquire`] in a given lock state (a rebuild passes its own).
    pub async fn acquire_in(
        &self,
        epoch: &str,
        token_floor: u64,
        lease_id: LeaseId,
        task_id: TaskId,
        resources: &Resources,
        admission: Admission,
    ) -> Result<Acquire, Error> {
        let wanted = Wanted {
            lease_id,
            task_id,
            resources,
            admission,
        };
        let mut outcomes = self.acquire_all_in(epoch, token_floor, &[wanted]).await?;
        outcomes
            .pop()
            .ok_or_else(|| protocol("acquire", &"no reply"))
    }

    async fn acquire_all_in(
        &self,
        epoch: &str,
        token_floor: u64,
        wanted: &[Wanted<'_>],
    ) -> Result<Vec<Acquire>, Error> {
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let mut invocation = self.scripts.acquire.prepare_invoke();
        invocation
            .key(self.keys.epoch())
            .key(self.keys.leases())
            .key(self.keys.fence())
            .key(self.keys.locked())
            .key(self.keys.running())
            .key(self.keys.deferred())
            .arg(epoch)
            .arg(token_floor)
            .arg(wanted.len());
        for w in wanted {
            let names = w.resources.exclusive.iter().chain(&w.resources.shared);
            invocation
                .key(self.keys.lease_tasks(w.lease_id))
                .key(self.keys.task(w.task_id));
            for name in names.clone() {
                invocation
                    .key(self.keys.exclusive(name))
                    .key(self.keys.shared(name));
            }
            invocation
                .arg(w.lease_id)
                .arg(w.task_id)
                .arg(w.resources.exclusive.len())
                .arg(w.resources.shared.len())
                .arg(w.admission.group.to_string())
                .arg(if w.admission.immediate { "1" } else { "0" })
                .arg(w.admission.cap.map_or(-1, i64::from))
                .arg(w.admission.reserve);
            for name in names {
                invocation.arg(name);
            }
        }
        let reply: Value = self.run_reading(&invocation).await?;
        let Value::Array(replies) = reply else {
            return Err(protocol("acquire", &reply));
        };
        let outcomes = replies
            .into_iter()
            .map(parse_acquire)
            .collect::<Result<Vec<_>, _>>()?;
        if outcomes
            .iter()
            .any(|o| matches!(o, Acquire::Blocked(names) if names.is_empty()))
        {
            return Err(self.state_lost());
        }
        if outcomes.len() != wanted.len() {
            return Err(protocol("acquire", &outcomes));
        }
        for outcome in &outcomes {
            if let Acquire::Granted { fencing_token } = outcome {
                self.known
                    .max_token
                    .fetch_max(fencing_token.0, Ordering::Relaxed);
            }
        }
        Ok(outcomes)
    }

    /// Releases a task's locks if `lease_id` holds them under `fencing_token`. Also returns the
    /// caller's lease's `core_appstatus` row ("" when the lease is gone).
    pub async fn release(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        fencing_token: FencingToken,
    ) -> Result<(Release, String), Error> {
        let mut released = self
            .release_all(&[(lease_id, task_id, fencing_token)], false)
            .await?;
        released
            .pop()
            .ok_or_else(|| protocol("release", &"no reply"))
    }

    /// [`Locks::release`] for several (lease, task, token) in one call. `finished`: the releases
    /// end FinishTask calls; each lease notes the task as its last finished one
    /// ([`Locks::last_finished`]).
    pub async fn release_all(
        &self,
        held: &[(LeaseId, TaskId, FencingToken)],
        finished: bool,
    ) -> Result<Vec<(Release, String)>, Error> {
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let mut invocation = self.scripts.release.prepare_invoke();
        invocation.arg(self.keys.tag());
        for (lease_id, task_id, fencing_token) in held {
            invocation
                .key(self.keys.task(*task_id))
                .arg(task_id)
                .arg(lease_id)
                .arg(fencing_token.to_string())
                .arg(if finished { "1" } else { "0" });
        }
        self.run_noting(&invocation, |mut flat: Vec<Value>| {
            // The epoch the script ran in, which its sequence numbers belong to.
            let epoch = text(flat.pop().as_ref()).unwrap_or_default();
            if flat.len() != 4 * held.len() {
                return Err(protocol("release", &flat));
            }
            let mut released = Vec::with_capacity(held.len());
            let mut noted = Vec::new();
            for reply in flat.chunks(4) {
                let code = int(reply.first()).ok_or_else(|| protocol("release", &reply))?;
                let app_status = text(reply.get(1)).unwrap_or_default();
                released.push((release_code("release", code)?, app_status));
                let seq = int(reply.get(2)).ok_or_else(|| protocol("release", &reply))?;
                if seq > 0 {
                    let names = match reply.get(3) {
                        Some(Value::Array(names)) => {
                            names.iter().filter_map(|n| text(Some(n))).collect()
                        }
                        _ => Vec::new(),
                    };
                    noted.push((seq as u64, names));
                }
            }
            Ok((released, epoch, noted))
        })
        .await
    }

    /// [`Locks::release`], tried three times with a short backoff (50, then 100 ms) while it
    /// fails: a release is idempotent, and a lock left behind would block the task's resources
    /// until its lease ends. The last failure is returned.
    pub async fn release_retrying(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        fencing_token: FencingToken,
    ) -> Result<(Release, String), Error> {
        let mut attempt = 0u32;
        loop {
            match self.release(lease_id, task_id, fencing_token).await {
                Err(e) if attempt < 2 => {
                    tracing::warn!(%task_id, %lease_id, attempt, error = %e, "release failed; retrying");
                    tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                    attempt += 1;
                }
                done => return done,
            }
        }
    }

    /// Takes the hand-back of an undelivered grant for `hold` (it expires then, should this
    /// replica die half-way): false when another replica is handing it back.
    pub async fn take_return(
        &self,
        task_id: TaskId,
        fencing_token: FencingToken,
        hold: Duration,
    ) -> Result<bool, Error> {
        let set: Option<String> = self
            .command(
                redis::cmd("SET")
                    .arg(self.keys.returning(task_id, fencing_token.0))
                    .arg(1)
                    .arg("NX")
                    .arg("PX")
                    .arg(u64::try_from(hold.as_millis()).unwrap_or(u64::MAX)),
            )
            .await?;
        Ok(set.is_some())
    }

    /// Checks that a live lease holds a task under `fencing_token`: `Ok(Ok(app_status_id))` when
    /// it does, `Ok(Err(why))` when it does not (`Release::NotHeld` standing for "lease gone").
    pub async fn holder(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        fencing_token: FencingToken,
    ) -> Result<std::result::Result<String, Release>, Error> {
        let mut held = self.holders(&[(lease_id, task_id, fencing_token)]).await?;
        held.pop().ok_or_else(|| protocol("holder", &"no reply"))
    }

    /// [`Locks::holder`] for several (lease, task, token) in one call (a fetch round's grants).
    pub async fn holders(
        &self,
        held: &[(LeaseId, TaskId, FencingToken)],
    ) -> Result<Vec<std::result::Result<String, Release>>, Error> {
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let mut invocation = self.scripts.holder.key(self.keys.leases());
        for (lease_id, task_id, fencing_token) in held {
            invocation
                .key(self.keys.lease(*lease_id))
                .key(self.keys.task(*task_id))
                .arg(lease_id)
                .arg(fencing_token.to_string());
        }
        let flat: Vec<(i64, String)> = self.run_reading(&invocation).await?;
        if flat.len() != held.len() {
            return Err(protocol("holder", &flat));
        }
        flat.into_iter()
            .map(|(code, app_status)| {
                Ok(match release_code("holder", code)? {
                    Release::Released => Ok(app_status),
                    other => Err(other),
                })
            })
            .collect()
    }

    /// The task a FinishTask of this lease last released, as `task_id:fencing_token`, if any.
    pub async fn last_finished(&self, lease_id: LeaseId) -> Result<Option<String>, Error> {
        self.command(
            redis::cmd("HGET")
                .arg(self.keys.lease(lease_id))
                .arg("finished"),
        )
        .await
    }

    /// Releases a task's locks if `lease_id` holds them (no token: only for the broker's own
    /// unclaimed grants whose acquire outcome is unknown); true when something was released.
    pub async fn abort(&self, lease_id: LeaseId, task_id: TaskId) -> Result<bool, Error> {
        let released: i64 = self
            .run(
                self.scripts
                    .abort
                    .key(self.keys.task(task_id))
                    .arg(self.keys.tag())
                    .arg(task_id)
                    .arg(lease_id),
            )
            .await?;
        Ok(released == 1)
    }

    /// Releases a task's locks whoever holds them; returns the holding lease, if any. Only for
    /// tasks that are over (canceled, final).
    pub async fn force_release(&self, task_id: TaskId) -> Result<Option<String>, Error> {
        self.run(
            self.scripts
                .force_release
                .key(self.keys.task(task_id))
                .arg(self.keys.tag())
                .arg(task_id),
        )
        .await
    }

    /// Every task that holds a lock (the reconciler's list; O(locks held)).
    pub async fn locked_task_ids(&self) -> Result<Vec<String>, Error> {
        self.command(redis::cmd("SMEMBERS").arg(self.keys.locked()))
            .await
    }

    /// Which of these tasks hold a lock.
    pub async fn are_locked(&self, task_ids: &[TaskId]) -> Result<Vec<bool>, Error> {
        if task_ids.is_empty() {
            return Ok(Vec::new());
        }
        self.command(
            redis::cmd("SMISMEMBER")
                .arg(self.keys.locked())
                .arg(task_ids),
        )
        .await
    }

    /// Lists every task lock as (task id, lease id, fencing token). Scans the broker's keys: for
    /// tests and diagnostics only, never on a request path.
    pub async fn held_task_locks(&self) -> Result<Vec<(String, String, u64)>, Error> {
        let mut conn = self.conn().await?;
        let pattern = format!("{}:task:*", self.keys.tag());
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(&pattern)
            .query_async(&mut *conn)
            .await?;
        let mut locks = Vec::with_capacity(keys.len());
        for key in keys {
            let (lease, token): (Option<String>, Option<u64>) = redis::cmd("HMGET")
                .arg(&key)
                .arg("lease")
                .arg("token")
                .query_async(&mut *conn)
                .await?;
            // Released between the listing and this read: not held any more.
            if let (Some(lease), Some(token)) = (lease, token) {
                let task = key.rsplit(':').next().unwrap_or_default().to_owned();
                locks.push((task, lease, token));
            }
        }
        locks.sort();
        Ok(locks)
    }
}
