//! The scan hint: where the last fetch pass stopped finding only tasks that are not ready, what
//! it relies on, and how long a pass may use it without reading the change log first.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ids::TaskId;
use chrono::{DateTime, Utc};

use super::carried::Carried;
use crate::locks::Change;
use crate::ready::{self, Reservations, SHARED_PREFIX};
use crate::tasks::TaskRow;

/// Where the last pass over the queue stopped finding only tasks that are not ready by the rule
/// (an older incomplete task or a held lock conflicts): the next pass starts there, with the
/// same reservations, instead of walking the blocked head again. It is dropped as soon as a
/// resource it relies on changes (a lock on it released, a waiting task reserving it left the
/// queue: `lua/lib.lua` records those); claims put back are checked first (`returned`); once
/// older than `hint_max_age` (changes made outside the broker) a background walk renews it
/// (`refresh`). A stale hint can only delay a task, never hand out one that is not ready:
/// every candidate still gets the exact look-up.
#[derive(Debug, Clone)]
pub(super) struct ScanHint {
    /// What it was read against: the lock state it was taken in (a rebuild drops every hint),
    /// the change sequence, when the log showed nothing that drops it up to there (see
    /// [`super::Dispatch::trusted`]).
    pub(super) read: ReadAgainst,
    pub(super) taken: Instant,
    pub(super) after: (DateTime<Utc>, TaskId),
    /// Conflict keys and reservations of the tasks before `after` that were left waiting (not
    /// ready, or passed over). A task the pass handed out is not among them: once claimed it is
    /// skipped by candidates.sql's `held` and counted by every newer task's exact look-up, so
    /// its finishing (which releases its locks and records its names) need not drop the hint:
    /// with many workers finishing tasks all the time, hints would otherwise never survive.
    pub(super) excluded: Vec<String>,
    pub(super) reserved: Reservations,
    /// Names of claimed or running tasks that hid older waiting tasks from the scan.
    pub(super) hiding: HashSet<String>,
    /// Claims put back in the queue since the hint was taken (their ids, as recorded with
    /// [`crate::locks::REQUEUED_PREFIX`]): they may sit before `after`, so every pass that uses the hint
    /// checks them first (`Tasks::returned`), until one is handed out or leaves the queue. At most
    /// [`MAX_RETURNED`]; beyond that the hint is dropped.
    pub(super) returned: Vec<TaskId>,
    /// The rest of the page the pass that left the hint read, and the claims put back it
    /// checks first, for the next pass (see [`Carried`]).
    pub(super) carried: Option<Arc<Carried>>,
}

/// Until when the change log is known to hold nothing that drops a hint read against it as `h`
/// says, if a pass may use the hint at `now` without reading the log first. Only in the lock
/// state (`epoch`) the hint was taken in (another state's sequence numbers are not comparable),
/// only while no call of this replica that may change lock state ended since the hint was read
/// against the log (`made` is [`crate::locks::Locks::changes_made`] now), and for at most
/// `window` (two `--fetch-wake-poll` intervals) since that read, or since the change counter
/// (which every replica reads each interval; `seq_read` is the last read and when it was sent)
/// was last seen still at the hint's sequence number. So a change made through another replica,
/// or by its sweeper, reaches this replica's passes as late as it reaches its waiting calls. A hint used past a change only delays a
/// task (see [`ScanHint`]); the acquire script still checks the lease and every lock.
pub(super) fn trusted_until(
    h: &ReadAgainst,
    epoch: &str,
    made: u64,
    seq_read: Option<(u64, Instant)>,
    window: Duration,
    now: Instant,
) -> Option<Instant> {
    if window.is_zero() || h.made != made || h.epoch != epoch {
        return None;
    }
    let clean_until = match seq_read {
        Some((seq, at)) if at > h.checked_at => {
            // Moved on, or back (a failover that lost the last changes: the numbers after it
            // come again, for other changes).
            if seq != h.seq {
                return None;
            }
            at
        }
        _ => h.checked_at,
    };
    (now.saturating_duration_since(clean_until) <= window).then_some(clean_until)
}

/// Splits held record entries by whether the name each locks is among `known` (names known to
/// hide tasks): those names, and the entries whose names must be looked up (hiding.sql).
pub(super) fn split_by_known(
    held: impl IntoIterator<Item = String>,
    known: &HashSet<String>,
) -> (HashSet<String>, Vec<String>) {
    let mut kept = HashSet::new();
    let mut unknown = Vec::new();
    for entry in held {
        let name = entry.strip_prefix(SHARED_PREFIX).unwrap_or(&entry);
        if known.contains(name) {
            kept.insert(name.to_owned());
        } else {
            unknown.push(entry);
        }
    }
    (kept, unknown)
}

/// The names whose locks the changes `changed` (as the change log records them) released,
/// exclusive or shared: not claims put back, not waiting tasks that left (they held nothing).
pub(super) fn released_names(changed: &[String]) -> HashSet<String> {
    changed
        .iter()
        .filter_map(|n| match Change::of(n) {
            Change::Released { name, .. } => Some(name.to_owned()),
            Change::All => Some("*".to_owned()),
            Change::Requeued(_) | Change::Left { .. } => None,
        })
        .collect()
}

/// A position as the resource queues key it (`ready::Key`).
pub(super) fn position_key(position: (DateTime<Utc>, TaskId)) -> ready::Key {
    (position.0.timestamp_micros(), position.1)
}

/// The queue position just before a task's: a scan hint that starts there starts with the task.
/// (Positions are `(pulp_created, pulp_id)`; no id lies between an id and its predecessor.)
pub(super) fn just_before(created: DateTime<Utc>, id: TaskId) -> (DateTime<Utc>, TaskId) {
    crate::tasks::key_bound(ready::queues::before(position_key((created, id))))
}

/// The most claims put back that a scan hint checks on every pass.
pub(super) const MAX_RETURNED: usize = 64;

/// What the hint a pass leaves will say, kept row by row as the pass settles its rows in queue
/// order. Everything before `after` is not ready by the rule while the book is `safe`; at the
/// first row that breaks that (a task left alone or lost, a ready one passed over or whose
/// attempt did not grant it), the hint ends just before it ([`HintBook::end_here`]), and what the pass settles from there on is not
/// in it.
pub(super) struct HintBook {
    /// What the hint is read against.
    read: ReadAgainst,
    /// When the hint the pass started from was taken (its age carries over).
    taken: Instant,
    /// The last position settled (the pass reads its next page from here too).
    pub(super) after: Option<(DateTime<Utc>, TaskId)>,
    /// What the tasks before `after` that were left waiting reserve (not those handed out).
    pub(super) reserved: Reservations,
    /// Their conflict keys.
    pub(super) excluded: Vec<String>,
    /// The claims put back that are still waiting, oldest first.
    pub(super) returned: Vec<TaskId>,
    safe: bool,
    ended: Option<ScanHint>,
}

/// What a hint is read against: the lock state (epoch), the change sequence, when the change
/// log was read up to it (the read was sent then; or when the call of this replica that
/// recorded it was sent: its own changes), and [`crate::locks::Locks::changes_made`] before that.
#[derive(Debug, Clone)]
pub(super) struct ReadAgainst {
    pub(super) epoch: String,
    pub(super) seq: u64,
    pub(super) checked_at: Instant,
    pub(super) made: u64,
}

/// How a pass settled one row, for the book.
pub(super) enum Settle {
    /// Not ready by the rule, or its lock attempt found it blocked: it stays waiting and
    /// reserves its names. (A claim put back: anything but handed out or lost.)
    Waiting,
    /// Handed out.
    Granted,
    /// Left alone (granted by this replica since it was read) or lost between read and claim.
    /// (A claim put back: lost only.)
    Gone,
    /// Ready but not tried, or tried without a grant: the hint cannot vouch for it.
    Unsure,
}

impl HintBook {
    pub(super) fn new(
        read: ReadAgainst,
        taken: Instant,
        after: Option<(DateTime<Utc>, TaskId)>,
        reserved: Reservations,
        excluded: Vec<String>,
        returned: Vec<TaskId>,
    ) -> HintBook {
        HintBook {
            read,
            taken,
            after,
            reserved,
            excluded,
            returned,
            safe: true,
            ended: None,
        }
    }

    /// Whether the hint has not ended early: it reaches `after`, the last position the pass
    /// settled (or moved to).
    pub(super) fn unbroken(&self) -> bool {
        self.safe
    }

    fn snapshot(&self, at: Option<(DateTime<Utc>, TaskId)>) -> Option<ScanHint> {
        at.map(|after| ScanHint {
            read: self.read.clone(),
            taken: self.taken,
            after,
            excluded: {
                // Each key once: every task before the hint adds its keys.
                let mut keys = self.excluded.clone();
                keys.sort_unstable();
                keys.dedup();
                keys
            },
            reserved: self.reserved.clone(),
            hiding: HashSet::new(),
            returned: self.returned.clone(),
            carried: None,
        })
    }

    /// The hint ends at `at` (at the latest just before the row being settled: the tasks the
    /// page skipped before that row are hidden by held locks or by the reservations the hint
    /// keeps); what the pass settles from there on is not in it.
    pub(super) fn end_here(&mut self, at: Option<(DateTime<Utc>, TaskId)>) {
        if self.safe {
            self.ended = self.snapshot(at);
            self.safe = false;
        }
    }

    /// Settles a claim put back (before the hint's position, which stays): handed out or gone,
    /// it is checked no more; still waiting, it reserves its resources for every newer task and
    /// is checked again by the next pass.
    pub(super) fn settle_returned(&mut self, row: &TaskRow, how: Settle) {
        match how {
            Settle::Granted => self.returned.retain(|id| *id != row.id),
            Settle::Gone => {
                // As for any task lost between page and claim: newer tasks that conflict only
                // with it were skipped by this pass, so the hint ends where the pass began.
                self.returned.retain(|id| *id != row.id);
                self.end_here(self.after);
            }
            Settle::Waiting | Settle::Unsure => self.keep_waiting(row),
        }
    }

    /// Settles a row of a page (after the hint's position).
    pub(super) fn settle(&mut self, row: &TaskRow, how: Settle) {
        let position = Some((row.created, row.id));
        match how {
            Settle::Waiting => {}
            Settle::Gone => {
                // The hint stops before it: newer tasks that conflict only with it are skipped
                // by this pass, and once it finishes (or if it was canceled) nothing the hint
                // relies on would change.
                self.end_here(Some(just_before(row.created, row.id)));
                self.after = position;
                return;
            }
            Settle::Granted => {
                // Handed out: not among what the hint keeps.
                self.after = position;
                return;
            }
            Settle::Unsure => self.end_here(Some(just_before(row.created, row.id))),
        }
        self.after = position;
        // Not handed out: it reserves its resources for every newer task.
        self.keep_waiting(row);
    }

    fn keep_waiting(&mut self, row: &TaskRow) {
        self.reserved.reserve(&row.candidate.resources);
        self.excluded
            .extend(row.candidate.resources.conflict_keys());
    }

    /// The hint the pass leaves: up to its last row settled, or where it ended.
    pub(super) fn leave(self) -> Option<ScanHint> {
        if self.safe {
            self.snapshot(self.after)
        } else {
            self.ended
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::queues;
    use super::*;
    use crate::locks::{LEFT_PREFIX, REQUEUED_PREFIX};
    use crate::ready::Resources;
    use crate::tasks::TaskRow;
    use uuid::Uuid;

    fn hint(checked_at: Instant, seq: u64, made: u64) -> ReadAgainst {
        ReadAgainst {
            epoch: "e1".to_owned(),
            seq,
            checked_at,
            made,
        }
    }

    const WINDOW: Duration = Duration::from_millis(200);

    fn row(record: &[&str]) -> TaskRow {
        TaskRow {
            id: TaskId(Uuid::new_v4()),
            created: Utc::now(),
            name: "t".to_owned(),
            immediate: false,
            domain: Uuid::nil(),
            task_group: None,
            candidate: crate::ready::Candidate {
                resources: Resources::from_record(record),
                older_conflicts: 0,
                versions: Some(Default::default()),
            },
        }
    }

    fn book() -> HintBook {
        HintBook::new(
            ReadAgainst {
                epoch: "e1".to_owned(),
                seq: 7,
                checked_at: Instant::now(),
                made: 0,
            },
            Instant::now(),
            None,
            Reservations::default(),
            Vec::new(),
            Vec::new(),
        )
    }

    #[test]
    fn the_book_keeps_waiting_rows_and_moves_past_handed_out_ones() {
        let mut b = book();
        let (waiting, granted) = (row(&["a"]), row(&["b"]));
        b.settle(&waiting, Settle::Waiting);
        b.settle(&granted, Settle::Granted);
        assert!(b.unbroken());
        let h = b.leave().expect("a hint");
        assert_eq!(h.after, (granted.created, granted.id));
        assert_eq!(h.read.seq, 7);
        assert!(h.reserved.touches("a"), "a waiting row reserves its names");
        assert!(!h.reserved.touches("b"), "a handed-out row does not");
    }

    #[test]
    fn the_hint_ends_before_the_first_row_it_cannot_vouch_for() {
        for how in [Settle::Gone, Settle::Unsure] {
            let mut b = book();
            let (first, doubtful, later) = (row(&["a"]), row(&["b"]), row(&["c"]));
            b.settle(&first, Settle::Waiting);
            b.settle(&doubtful, how);
            b.settle(&later, Settle::Waiting);
            assert!(!b.unbroken());
            let h = b.leave().expect("a hint");
            assert_eq!(h.after, just_before(doubtful.created, doubtful.id));
            assert!(h.reserved.touches("a"));
            assert!(
                !h.reserved.touches("c"),
                "settled after the end: not in the hint"
            );
        }
    }

    #[test]
    fn claims_put_back_leave_the_list_once_handed_out_or_gone() {
        let mut b = book();
        let (handed, waiting, lost) = (row(&["a"]), row(&["b"]), row(&["c"]));
        b.after = Some((lost.created, lost.id));
        b.returned = vec![handed.id, waiting.id, lost.id];
        b.settle_returned(&handed, Settle::Granted);
        b.settle_returned(&waiting, Settle::Waiting);
        assert!(b.unbroken());
        b.settle_returned(&lost, Settle::Gone);
        assert!(
            !b.unbroken(),
            "a claim lost ends the hint where the pass began"
        );
        let h = b.leave().expect("a hint");
        assert_eq!(h.after, (lost.created, lost.id));
        assert_eq!(h.returned, vec![waiting.id]);
        assert!(h.reserved.touches("b"));
    }

    fn try_carried(rows: Vec<TaskRow>, returned: Vec<TaskRow>) -> Option<Carried> {
        Carried::of(
            rows,
            (returned, Instant::now()),
            vec!["held".to_owned()],
            Instant::now(),
            queues::Removals::default(),
        )
    }

    fn carried(rows: Vec<TaskRow>, returned: Vec<TaskRow>) -> Carried {
        try_carried(rows, returned).expect("tasks")
    }

    #[test]
    fn carried_tasks_are_kept_past_changes_to_other_names_only() {
        let c = carried(vec![row(&["a", "shared:b"])], vec![row(&["r"])]);
        let changed =
            |names: &[&str]| -> Vec<String> { names.iter().map(|n| n.to_string()).collect() };
        assert!(c.untouched_by(&[]));
        assert!(c.untouched_by(&changed(&["x", "shared:y", "\u{1}left:z"])));
        // Shared access to b released, or a shared user of b that left: it never held up a task
        // that shares b.
        assert!(c.untouched_by(&changed(&["shared:b"])));
        assert!(c.untouched_by(&[format!("{LEFT_PREFIX}shared:b")]));
        // A held lock released: a task it hid may be handed out after the carried ones.
        assert!(c.untouched_by(&changed(&["held"])));
        // A claim put back: checked first by the pass itself.
        assert!(c.untouched_by(&[format!("{REQUEUED_PREFIX}{}", TaskId(Uuid::new_v4()))]));
        for touching in ["a", "shared:a", "b", "r", "shared:r", "*"] {
            assert!(!c.untouched_by(&changed(&[touching])), "{touching}");
        }
        assert!(!c.untouched_by(&[format!("{LEFT_PREFIX}b")]));
        assert!(!c.untouched_by(&[format!("{LEFT_PREFIX}shared:a")]));
        assert!(!c.untouched_by(&[format!("{LEFT_PREFIX}r")]));
    }

    #[test]
    fn carried_claims_put_back_stand_in_for_a_read_of_exactly_those() {
        let (r1, r2) = (row(&["r1"]), row(&["r2"]));
        let c = carried(Vec::new(), vec![r1.clone(), r2.clone()]);
        let ids = |rows: Vec<TaskRow>| rows.iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(
            c.returned_if(&[r2.id, r1.id]).map(ids),
            Some(vec![r1.id, r2.id])
        );
        assert!(
            c.returned_if(&[r1.id]).is_none(),
            "one was handed out: read"
        );
        assert!(
            c.returned_if(&[r1.id, r2.id, TaskId(Uuid::new_v4())])
                .is_none(),
            "one more put back: read"
        );
        assert!(try_carried(Vec::new(), Vec::new()).is_none());
        let page = c.page();
        assert!(
            page.full && page.tasks.is_empty(),
            "no page rest: a pass reads on"
        );
    }

    #[test]
    fn a_hint_read_against_the_log_just_before_is_trusted_until_the_window_ends() {
        let t0 = Instant::now();
        let h = hint(t0, 7, 3);
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(trusted_until(&h, "e1", 3, None, WINDOW, at(50)), Some(t0));
        assert_eq!(trusted_until(&h, "e1", 3, None, WINDOW, at(200)), Some(t0));
        assert_eq!(trusted_until(&h, "e1", 3, None, WINDOW, at(201)), None);
    }

    #[test]
    fn a_change_made_through_this_replica_ends_the_trust_at_once() {
        let t0 = Instant::now();
        let h = hint(t0, 7, 3);
        assert_eq!(trusted_until(&h, "e1", 4, None, WINDOW, t0), None);
    }

    #[test]
    fn a_counter_read_after_the_hint_extends_the_trust_unless_it_moved() {
        let t0 = Instant::now();
        let h = hint(t0, 7, 3);
        let at = |ms| t0 + Duration::from_millis(ms);
        // Read 150 ms after the hint, not moved: trusted until 200 ms after that read.
        let unmoved = Some((7, at(150)));
        assert_eq!(
            trusted_until(&h, "e1", 3, unmoved, WINDOW, at(300)),
            Some(at(150))
        );
        assert_eq!(trusted_until(&h, "e1", 3, unmoved, WINDOW, at(351)), None);
        // Moved back (a failover lost the last changes): no trust either.
        assert_eq!(
            trusted_until(&h, "e1", 3, Some((6, at(1))), WINDOW, at(2)),
            None
        );
        // Moved (a change through another replica): no trust, however fresh the hint.
        assert_eq!(
            trusted_until(&h, "e1", 3, Some((8, at(1))), WINDOW, at(2)),
            None
        );
        // A read sent before the hint's own tells nothing new, moved or not.
        let h = hint(at(100), 7, 3);
        assert_eq!(
            trusted_until(&h, "e1", 3, Some((5, at(50))), WINDOW, at(150)),
            Some(at(100))
        );
    }

    #[test]
    fn a_hint_of_another_lock_state_is_not_trusted() {
        let t0 = Instant::now();
        let h = hint(t0, 7, 3);
        assert_eq!(trusted_until(&h, "e2", 3, None, WINDOW, t0), None);
    }

    #[test]
    fn no_window_means_no_trust() {
        let t0 = Instant::now();
        let h = hint(t0, 7, 3);
        assert_eq!(trusted_until(&h, "e1", 3, None, Duration::ZERO, t0), None);
    }
}
