//! Renewing a scan hint off the fetch path.
//!
//! A hint older than `--fetch-hint-max-age` may miss a change made outside the broker (a Pulp
//! process finishing or inserting a task in Postgres), so it must be checked against the queue
//! from its head. That walk reads every blocked task in front of the hint (100,000 on the
//! incident's repository), so no FetchTask waits for it: the call that finds its hint old keeps
//! using it and starts this walk in the background, one at a time per replica, and the walk's
//! hint replaces the old one when it is done. Walks are spaced by at least ten times the last
//! walk's duration, so a long queue costs Postgres at most about a tenth of its time: a change
//! made outside the broker is seen within the larger of the hint's age limit and ten walks.
//!
//! With the resource queues (`queues`) the walk starts where they say, as a pass without a hint
//! does, instead of at the head: what sees a change made outside the broker is then their check
//! of the holders (a holder that ended is removed, and the tasks behind it become lanes); a task
//! newer than where their knowledge ends is read by the walk itself.
//!
//! Never grants, locks or claims: it only reads the queue and judges by the readiness rule.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Dispatch, ScanHint};
use crate::error::Result;
use crate::ready::{self, Reservations};

/// The background walks of one replica: whether one runs, and how long the last took.
#[derive(Debug, Default)]
pub(super) struct Refreshes {
    running: std::sync::atomic::AtomicBool,
    last_walk_ms: std::sync::atomic::AtomicU64,
}

/// A walk in progress; dropping it lets the next one run.
struct Running(Arc<Refreshes>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.store(false, Ordering::SeqCst);
    }
}

impl Refreshes {
    /// How old a hint may grow before a walk renews it: the age limit, or ten walks if longer.
    pub(super) fn due_after(&self, max_age: Duration) -> Duration {
        max_age.max(Duration::from_millis(
            self.last_walk_ms.load(Ordering::Relaxed).saturating_mul(10),
        ))
    }
}

impl Dispatch {
    /// Starts a background walk that renews the scan hint, unless one runs already.
    pub(super) fn refresh_hint(&self) {
        if self.refreshes.running.swap(true, Ordering::SeqCst) {
            return;
        }
        let dispatch = self.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            // Lets the next walk run however this one ends.
            let _running = Running(Arc::clone(&dispatch.refreshes));
            match dispatch.walk_for_hint(started).await {
                Ok(()) => {
                    dispatch
                        .refreshes
                        .last_walk_ms
                        .store(started.elapsed().as_millis() as u64, Ordering::Relaxed);
                    dispatch.stats.hint_walk();
                }
                Err(e) => {
                    // The old hint stays in use; it only delays, and the next fetch retries.
                    tracing::warn!(error = %e, "renewing the scan hint failed; the next fetch retries")
                }
            }
        });
    }

    /// Walks the queue from its head to the first task ready by the rule (any lease's), as a
    /// fetch pass does, and installs the hint for where it stopped, unless a newer hint was
    /// installed meanwhile.
    async fn walk_for_hint(&self, taken: Instant) -> Result<()> {
        let made = self.locks.changes_made();
        let checked_at = Instant::now();
        let seq = self.locks.change_seq().await?;
        // Before anything the hint relies on is read (see `queues::Queues::split_hiding`).
        let removals = self.queues.removals();
        let epoch = self.locks.epoch();
        let mut reserved = Reservations::default();
        let mut excluded: Vec<String> = Vec::new();
        let mut seen_keys: HashSet<String> = HashSet::new();
        let mut after = None;
        let mut held_seen: HashSet<String> = HashSet::new();
        let mut page = self.policy.first_page;
        let near = self.near();
        // With the resource queues, the walk starts where they say, as a pass without a hint
        // does: their check of the holders is what makes a change made outside the broker seen
        // (a holder that ended), and the blocked queue is not read every walk.
        let start = if self.uses_resource_queues() {
            self.queue_start(None).await
        } else {
            None
        };
        if let Some(start) = start {
            after = Some(crate::tasks::key_bound(start.apply(
                &mut reserved,
                &mut held_seen,
                |key| {
                    if seen_keys.insert(key.clone()) {
                        excluded.push(key);
                    }
                },
            )));
        }
        'pages: loop {
            if self.shutdown.is_fired() {
                return Ok(());
            }
            let found = self.tasks.candidates(&excluded, after, &near, page).await?;
            held_seen.extend(found.held.iter().cloned());
            let last_page = !found.full;
            let end = found.end();
            for row in found.tasks {
                let verdict = ready::obstacles(&row.candidate, &reserved, &Default::default());
                if verdict.ready_by_rule() {
                    // The hint starts with it: what the pages skipped before it is hidden by
                    // held locks (looked up below) or by the reservations the hint keeps.
                    after = Some(super::hint::just_before(row.created, row.id));
                    break 'pages;
                }
                reserved.reserve(&row.candidate.resources);
                for key in row.candidate.resources.conflict_keys() {
                    if seen_keys.insert(key.clone()) {
                        excluded.push(key);
                    }
                }
                after = Some((row.created, row.id));
            }
            if last_page {
                // None ready: every waiting task after the last row was skipped (held, or
                // reserved by what the hint keeps).
                if end > after {
                    after = end;
                }
                break;
            }
            page = (page * 2).min(self.policy.max_page);
        }
        let Some(after) = after else {
            // Nothing waits: no hint, the next pass reads from the head.
            self.install(None, taken);
            return Ok(());
        };
        // What hides older tasks at the new position. The names the current hint knows to hide
        // are kept without a look-up when still held (a name kept needlessly only drops the hint
        // more often than needed: never a task handed out late); only the other held names are
        // looked up. Counting the blocked repository's name again cost as much as the walk.
        let known: HashSet<String> = self
            .hint
            .lock()
            .ok()
            .and_then(|slot| slot.as_ref().map(|h| h.hiding.clone()))
            .unwrap_or_default();
        let (mut hiding, unknown) = super::split_by_known(held_seen, &known);
        // The resource queues answer for most names (see the pass).
        let unknown =
            self.queues
                .split_hiding(unknown, super::position_key(after), removals, &mut hiding);
        if !unknown.is_empty() {
            hiding.extend(self.tasks.hiding(after, &unknown).await?);
        }
        let hint = ScanHint {
            read: super::ReadAgainst {
                epoch,
                seq,
                checked_at,
                made,
            },
            taken,
            after,
            excluded,
            reserved,
            hiding,
            returned: Vec::new(),
            carried: None,
        };
        self.install(Some(hint), taken);
        Ok(())
    }

    /// Replaces the hint with a walk's, unless a pass installed one after the walk began (at
    /// least as fresh). When the walk's starts earlier in the queue, a task the old hint skipped
    /// may be ready: the waiting calls get a turn.
    fn install(&self, hint: Option<ScanHint>, taken: Instant) {
        tracing::debug!(after = ?hint.as_ref().map(|h| h.after), "walk installs a scan hint");
        let moved_back = match self.hint.lock() {
            Ok(mut slot) => {
                if slot.as_ref().is_some_and(|h| h.taken > taken) {
                    return;
                }
                let moved_back = match (slot.as_ref(), hint.as_ref()) {
                    (Some(old), Some(new)) => new.after < old.after,
                    (Some(_), None) => true,
                    (None, _) => false,
                };
                *slot = hint;
                moved_back
            }
            Err(_) => return,
        };
        if moved_back {
            self.waiters.wake();
        }
    }
}
