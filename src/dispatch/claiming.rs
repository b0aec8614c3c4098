//! Locking and claiming: what turns a ready task into a grant. A round's tasks (`grant_round`)
//! are locked in one call of `lua/acquire.lua`, claimed in one statement (`claim_round.sql`) and
//! checked against their leases in one call of `lua/holder.lua`: three round trips for the
//! round, not three per task. A single task (ClaimTask, a directed pass) is a round of one.
//!
//! Whatever fails after the locks were taken undoes what was done: locks taken for a task that
//! was not claimed are released; a claim that may have committed is put back first, and its
//! locks released only once it is back.

use super::*;
use crate::locks::Wanted;
use crate::tasks::Claimed;

/// One task of a round to lock and claim, and for whom.
pub(super) struct Try<'a> {
    pub lease_id: LeaseId,
    pub lease: &'a LeaseRecord,
    pub row: &'a TaskRow,
    pub start: bool,
}

/// How a round's attempt at one task came out ([`Dispatch::lock_and_claim_round`]).
pub(super) enum Tried {
    /// Settled.
    Done(Attempt),
    /// Locked, but another transaction holds its row (or Postgres refused the round's claim):
    /// to be claimed on its own ([`Dispatch::claim_alone`]), which waits for the row.
    Alone {
        fencing_token: FencingToken,
        app_status: Uuid,
    },
}

impl Dispatch {
    /// Locks and claims one task: a round of one.
    pub(super) async fn lock_and_claim(
        &self,
        lease_id: LeaseId,
        lease: &LeaseRecord,
        row: &TaskRow,
        start: bool,
    ) -> Result<Attempt> {
        let one = Try {
            lease_id,
            lease,
            row,
            start,
        };
        match self
            .lock_and_claim_round(std::slice::from_ref(&one))
            .await?
            .pop()
        {
            Some(Tried::Done(attempt)) => Ok(attempt),
            Some(Tried::Alone {
                fencing_token,
                app_status,
            }) => self.claim_alone(&one, fencing_token, app_status).await,
            None => Err(Error::Internal("a round of one settled nothing".into())),
        }
    }

    /// Locks, claims and checks a round's tasks, three round trips in all; one outcome per
    /// task, in order. `Err` when a step failed for the whole round (Redis or Postgres
    /// unavailable): by then every lock it took is released or its claim put back. A claim
    /// statement Postgres refused is retried task by task ([`Tried::Alone`]).
    pub(super) async fn lock_and_claim_round(&self, tries: &[Try<'_>]) -> Result<Vec<Tried>> {
        let mut tried: Vec<Option<Tried>> = tries.iter().map(|_| None).collect();
        let mut app_status = Vec::with_capacity(tries.len());
        let mut wanted = Vec::with_capacity(tries.len());
        let mut wanted_at = Vec::with_capacity(tries.len());
        for (i, t) in tries.iter().enumerate() {
            let Ok(row_of) = t.lease.app_status_id.parse::<Uuid>() else {
                tracing::error!(lease_id = %t.lease_id, "the lease names no valid core_appstatus row; it is given nothing");
                app_status.push(Uuid::nil());
                tried[i] = Some(Tried::Done(Attempt::NotGranted));
                continue;
            };
            app_status.push(row_of);
            let resources = &t.row.candidate.resources;
            if resources
                .exclusive
                .iter()
                .chain(&resources.shared)
                .any(|r| r.contains('\n'))
            {
                tracing::error!(task_id = %t.row.id, "a resource name contains a newline; the task cannot be locked");
                tried[i] = Some(Tried::Done(Attempt::NotGranted));
                continue;
            }
            wanted.push(Wanted {
                lease_id: t.lease_id,
                task_id: t.row.id,
                resources,
                admission: self
                    .fairness
                    .admission(self.fairness.group_of_row(t.row), t.row.immediate),
            });
            wanted_at.push(i);
        }

        let acquired = match self.locks.acquire_all(&wanted).await {
            Ok(acquired) => acquired,
            Err(crate::locks::Error::StateLost) => {
                return Err(crate::locks::Error::StateLost.into())
            }
            Err(e) => {
                // The script may have run although the answer was lost: take back whatever
                // these leases hold for the unclaimed tasks.
                futures::future::join_all(wanted.iter().map(|w| async move {
                    if let Err(abort) = self.locks.abort(w.lease_id, w.task_id).await {
                        tracing::error!(task_id = %w.task_id, error = %abort, "could not take back locks of a failed acquire; they stay until the lease ends");
                    }
                }))
                .await;
                return Err(e.into());
            }
        };
        let mut claims = Vec::new();
        let mut claims_at = Vec::new();
        for (k, outcome) in acquired.into_iter().enumerate() {
            let i = wanted_at[k];
            let t = &tries[i];
            let attempt = match outcome {
                Acquire::Granted { fencing_token } => {
                    claims.push((t.row.id, app_status[i], t.start));
                    claims_at.push((i, fencing_token));
                    continue;
                }
                Acquire::LeaseGone => Attempt::LeaseGone,
                Acquire::TaskHeld => Attempt::NotGranted,
                Acquire::Blocked(names) => {
                    tracing::debug!(task_id = %t.row.id, ?names, "resources held; not ready");
                    Attempt::Blocked
                }
                Acquire::HeldBack(why) => {
                    tracing::debug!(task_id = %t.row.id, %why, "ready, held back by fairness");
                    self.stats.held_back(match why {
                        crate::fair::HeldBack::Cap { .. } => "cap",
                        crate::fair::HeldBack::Reserve { .. } => "reserve",
                    });
                    Attempt::HeldBack(why)
                }
            };
            tried[i] = Some(Tried::Done(attempt));
        }

        if !claims.is_empty() {
            let claimed = match self.claim_all(&claims).await {
                Ok(claimed) => claimed,
                Err(e) if e.is_refused() && claims.len() > 1 => {
                    // Postgres refused the round's statement (a lease ended meanwhile and its
                    // core_appstatus row went with it, say): each task is claimed on its own, so
                    // one task's trouble fails only its own grant.
                    tracing::warn!(error = %e, "a round's claim failed; its tasks are claimed one by one");
                    claims.iter().map(|_| Claimed::RowLocked).collect()
                }
                Err(e) => {
                    futures::future::join_all(claims_at.iter().map(|&(i, fencing_token)| {
                        self.claim_failed(&tries[i], fencing_token, app_status[i], &e)
                    }))
                    .await;
                    return Err(e.into());
                }
            };
            let mut confirm = Vec::with_capacity(claims_at.len());
            let mut lost = Vec::new();
            let mut gone = Vec::new();
            for (&(i, fencing_token), claimed) in claims_at.iter().zip(claimed) {
                match claimed {
                    Claimed::Claimed(started_at) => confirm.push((i, fencing_token, started_at)),
                    Claimed::NotClaimable => {
                        // Canceled, finished or claimed elsewhere since it was read.
                        lost.push((i, fencing_token));
                        tried[i] = Some(Tried::Done(Attempt::Lost));
                    }
                    Claimed::RowLocked => {
                        tried[i] = Some(Tried::Alone {
                            fencing_token,
                            app_status: app_status[i],
                        })
                    }
                    Claimed::AppStatusGone => {
                        lost.push((i, fencing_token));
                        gone.push(i);
                        tried[i] = Some(Tried::Done(Attempt::LeaseGone));
                    }
                }
            }
            futures::future::join_all(
                lost.iter()
                    .map(|&(i, fencing_token)| self.let_go(&tries[i], fencing_token)),
            )
            .await;
            for i in gone {
                self.app_status_gone(&tries[i], app_status[i]).await;
            }
            let checks: Vec<_> = confirm
                .iter()
                .map(|&(i, fencing_token, _)| (tries[i].lease_id, tries[i].row.id, fencing_token))
                .collect();
            match self.locks.holders(&checks).await {
                Ok(held) => {
                    let attempts = futures::future::join_all(confirm.iter().zip(held).map(
                        |(&(i, fencing_token, started_at), held)| {
                            self.confirmed(
                                &tries[i],
                                fencing_token,
                                app_status[i],
                                started_at,
                                held,
                            )
                        },
                    ))
                    .await;
                    for (&(i, _, _), attempt) in confirm.iter().zip(attempts) {
                        tried[i] = Some(Tried::Done(attempt));
                    }
                }
                Err(e) => {
                    // A failed check (Redis slow or paused) is an error to retry, not a reason
                    // for a worker to replace a lease that is alive. The claimed tasks go back
                    // before their locks are released; those left to be claimed on their own
                    // are released now.
                    let alone = tried
                        .iter()
                        .zip(tries)
                        .filter_map(|(tried, t)| match tried {
                            Some(Tried::Alone { fencing_token, .. }) => Some((t, *fencing_token)),
                            _ => None,
                        });
                    futures::future::join(
                        futures::future::join_all(confirm.iter().map(|&(i, fencing_token, _)| {
                            self.put_back(&tries[i], fencing_token, app_status[i])
                        })),
                        futures::future::join_all(
                            alone.map(|(t, fencing_token)| self.let_go(t, fencing_token)),
                        ),
                    )
                    .await;
                    return Err(e.into());
                }
            }
        }
        Ok(tried
            .into_iter()
            .map(|t| t.unwrap_or(Tried::Done(Attempt::NotGranted)))
            .collect())
    }

    /// Claims a round's locked tasks: several with claim_round.sql; one with claim.sql, the
    /// simpler statement, which waits for its row as the task would be claimed on its own anyway.
    /// (A round of several that Postgres refuses is claimed task by task, so a lease whose row
    /// is gone is told apart on its own claim.)
    async fn claim_all(
        &self,
        claims: &[(TaskId, Uuid, bool)],
    ) -> std::result::Result<Vec<Claimed>, crate::tasks::Error> {
        match claims {
            [(task, app_status, start)] => {
                Ok(vec![self.claim_one(*task, *app_status, *start).await?])
            }
            _ => self.tasks.claim_round(claims).await,
        }
    }

    /// Claims one locked task with claim.sql, which waits for a row another transaction holds,
    /// then checks its lease still holds it.
    pub(super) async fn claim_alone(
        &self,
        t: &Try<'_>,
        fencing_token: FencingToken,
        app_status: Uuid,
    ) -> Result<Attempt> {
        match self.claim_one(t.row.id, app_status, t.start).await {
            Ok(Claimed::Claimed(started_at)) => {
                let held = self.locks.holder(t.lease_id, t.row.id, fencing_token).await;
                match held {
                    Ok(held) => Ok(self
                        .confirmed(t, fencing_token, app_status, started_at, held)
                        .await),
                    Err(e) => {
                        self.put_back(t, fencing_token, app_status).await;
                        Err(e.into())
                    }
                }
            }
            // Canceled, finished or claimed elsewhere since it was read (claim.sql waits for a
            // busy row, so it is never RowLocked).
            Ok(Claimed::NotClaimable | Claimed::RowLocked) => {
                self.let_go(t, fencing_token).await;
                Ok(Attempt::Lost)
            }
            Ok(Claimed::AppStatusGone) => {
                self.let_go(t, fencing_token).await;
                self.app_status_gone(t, app_status).await;
                Ok(Attempt::LeaseGone)
            }
            Err(e) => {
                self.claim_failed(t, fencing_token, app_status, &e).await;
                Err(e.into())
            }
        }
    }

    /// A claim for `t`'s lease broke the foreign key: its `core_appstatus` row `app_status` was
    /// deleted outside the broker (the claim writes no other reference). The lease is ended now,
    /// before its caller hears NOT_FOUND, rather than tried again by every pass. If that fails,
    /// the heartbeat writer ends it at the worker's next beat, or the sweeper once it expires.
    async fn app_status_gone(&self, t: &Try<'_>, app_status: Uuid) {
        self.forget_lease(t.lease_id);
        if let Err(e) = self
            .lease_ends
            .end_without_row(t.lease_id, app_status)
            .await
        {
            tracing::warn!(lease_id = %t.lease_id, app_status_id = %app_status, task_id = %t.row.id, error = %e, "a claim found the lease's core_appstatus row gone, and ending the lease failed; its next heartbeat ends it, or the sweeper");
        }
    }

    /// Claims one task with claim.sql (which waits for its row); a claim that breaks the foreign
    /// key (the lease's row is gone) is [`Claimed::AppStatusGone`], not an error.
    async fn claim_one(
        &self,
        task: TaskId,
        app_status: Uuid,
        start: bool,
    ) -> std::result::Result<Claimed, crate::tasks::Error> {
        match self.tasks.claim(task, app_status, start).await {
            Ok(Some(started_at)) => Ok(Claimed::Claimed(started_at)),
            Ok(None) => Ok(Claimed::NotClaimable),
            Err(e) if e.app_status_gone() => Ok(Claimed::AppStatusGone),
            Err(e) => Err(e),
        }
    }

    /// Releases the locks of a task of the round that was not claimed.
    async fn let_go(&self, t: &Try<'_>, fencing_token: FencingToken) {
        self.requeue
            .release_after_failure(t.lease_id, t.row.id, fencing_token)
            .await
    }

    /// Puts a task of the round that may be claimed back in the queue, then releases its locks.
    async fn put_back(&self, t: &Try<'_>, fencing_token: FencingToken, app_status: Uuid) {
        self.requeue
            .requeue(t.row.id, app_status, t.lease_id, fencing_token, t.start)
            .await
    }

    /// Undoes a grant whose claim failed: its locks are released when the claim certainly did
    /// not commit; otherwise the task is put back first, and released only once it is back.
    async fn claim_failed(
        &self,
        t: &Try<'_>,
        fencing_token: FencingToken,
        app_status: Uuid,
        e: &crate::tasks::Error,
    ) {
        if e.certainly_not_applied() {
            self.let_go(t, fencing_token).await;
        } else {
            self.put_back(t, fencing_token, app_status).await;
        }
    }

    /// The grant of a claimed task, once the holder check `held` says its lease still holds it.
    /// The lease may have been closed or swept between the lock and the claim; its clean-up
    /// then missed this claim, which is put back. Only a lease Redis no longer knows is gone.
    async fn confirmed(
        &self,
        t: &Try<'_>,
        fencing_token: FencingToken,
        app_status: Uuid,
        started_at: Option<DateTime<Utc>>,
        held: std::result::Result<String, Release>,
    ) -> Attempt {
        let row = t.row;
        if let Err(why) = held {
            self.put_back(t, fencing_token, app_status).await;
            return match why {
                Release::NotHeld => Attempt::LeaseGone,
                _ => Attempt::Lost,
            };
        }
        self.lease_alive(t.lease_id);
        tracing::info!(task_id = %row.id, lease_id = %t.lease_id, %fencing_token, "task handed out");
        let waited = (Utc::now() - row.created).num_milliseconds().max(0) as f64 / 1000.0;
        self.stats
            .task_waited(self.fairness.label(self.fairness.group_of_row(row)), waited);
        Attempt::Granted(Grant {
            task_id: row.id,
            name: row.name.clone(),
            resources: row.candidate.resources.clone(),
            fencing_token,
            immediate: row.immediate,
            created_at: row.created,
            started_at,
            lease_id: t.lease_id,
            app_status_id: app_status,
        })
    }
}
