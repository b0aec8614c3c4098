//! Carried tasks: the rest of the page a fetch pass read, and the claims put back it checked,
//! kept with the scan hint for the next pass to judge instead of reading them again.

use std::collections::HashSet;
use std::time::Instant;

use crate::ids::TaskId;

use super::queues;
use crate::locks::Change;
use crate::tasks::TaskRow;

/// The rest of a page: the tasks after a scan hint's position that the pass which read the page
/// did not reach (it had served everyone before), and the claims put back that the hint checks
/// first, as the pass read them. The next pass that uses the hint judges them instead of reading
/// them again, so a fetch costs no page read: a pass that trusts the hint (see
/// [`super::hint::trusted_until`]), or one whose read of the changes since the hint shows none that touches a
/// name of theirs (see [`Carried::untouched_by`]), while they are younger than
/// `--fetch-hint-max-age` and [`super::RECENT`] (so that one this replica handed out since is known as
/// such).
///
/// The rule still decides as for a page read then. Their exact look-up (`older_conflicts`) was
/// made when the page was read, and it stays true: no older conflicting task can appear later,
/// since the insert trigger Pulp's schema must have (`on_insert_timestamp_task`; `migrate`
/// checks for it) stamps a task only once the inserts of every task sharing a resource with it
/// have committed (per-resource advisory locks). What else makes a ready task unready is caught
/// where it is for every candidate: a lock taken since (through any replica) by the acquire
/// script, a task claimed, canceled or finished since by the claim. What a carried task cannot
/// show is a change that made it ready: a lock released on one of its names, or a waiting task
/// with one that left. Those are recorded with the name, and a pass that reads one does not use
/// the carried tasks; one made through another replica is seen once the trust ends, as for the
/// hint itself. A task judged not ready from a carried row reserves its names in the hint the
/// pass leaves, as one read afresh does, so what makes it ready later drops that hint.
///
/// Nor do carried tasks show a task between them that a held lock hid from the page and that
/// became ready since (its lock released), or a claim put back since that lies between them. The
/// second is read (the claims put back are read by id unless carried) and judged in queue order
/// with the carried tasks. For the first, a pass that read the release uses the carried tasks
/// only when the resource queues (or, for what they cannot tell or when they are off, Postgres:
/// hiding.sql) say the released lock hid no waiting task before the last of them
/// ([`super::Dispatch::hid_among`]); otherwise it reads its page. Such a task is not in conflict
/// with the carried ones (FIFO per resource holds); with the hint trusted, a newer carried task
/// may go first until the trust ends. It is never left behind: the page's held entries count
/// among the names the hint a pass leaves relies on (`hiding`), so a release read later drops
/// that hint, and a pass that used carried tasks after reading a release leaves no hint that
/// relies on the released name (it drops the hint instead).
#[derive(Debug)]
pub(super) struct Carried {
    /// In queue order, all after the hint's position.
    pub(super) rows: Vec<TaskRow>,
    /// The claims put back that the hint checks first (its `returned`), oldest first.
    pub(super) returned: Vec<TaskRow>,
    /// The held entries the page skipped tasks by.
    pub(super) held: Vec<String>,
    /// When the page was read.
    pub(super) read_at: Instant,
    /// When the claims put back were read (a task this replica handed out since then is
    /// known as such, see `Seen::Left`).
    pub(super) returned_read_at: Instant,
    /// Where the resource queues' removals stood before the page was read: a holder of a held
    /// entry that ended since may be gone from them (see `queues::Queues::split_hiding`).
    pub(super) removals: queues::Removals,
}

impl Carried {
    /// A page's rest and the claims put back still waiting, if there is a task among them.
    pub(super) fn of(
        rest: impl IntoIterator<Item = TaskRow>,
        returned: (Vec<TaskRow>, Instant),
        held: Vec<String>,
        read_at: Instant,
        removals: queues::Removals,
    ) -> Option<Carried> {
        let rows: Vec<TaskRow> = rest.into_iter().collect();
        let (returned, returned_read_at) = returned;
        // (With none, their read time must not age the page's.)
        let returned_read_at = if returned.is_empty() {
            read_at
        } else {
            returned_read_at
        };
        (!rows.is_empty() || !returned.is_empty()).then_some(Carried {
            rows,
            returned,
            held,
            read_at,
            returned_read_at,
            removals,
        })
    }

    /// Whether none of the changes `changed` (as the change log records them) can have made a
    /// carried task ready: only then may a pass that read them use the carried tasks. A claim put
    /// back is no such change (the pass reads it by id unless it is among the carried ones, and
    /// judges it in order). A released lock that only hid tasks between them is none either
    /// (see [`Carried`]). Everything else is recorded with the name whose lock was released or whose
    /// waiting task left (`shared:` when that was shared access, which only conflicted with the
    /// tasks that need the name exclusively), or as `*` (anything).
    pub(super) fn untouched_by(&self, changed: &[String]) -> bool {
        let rows = || self.rows.iter().chain(&self.returned);
        let exclusive: HashSet<&str> = rows()
            .flat_map(|r| r.candidate.resources.exclusive.iter().map(String::as_str))
            .collect();
        let shared: HashSet<&str> = rows()
            .flat_map(|r| r.candidate.resources.shared.iter().map(String::as_str))
            .collect();
        changed.iter().all(|n| match Change::of(n) {
            Change::Requeued(_) => true,
            Change::All => false,
            Change::Left { name, shared: true } | Change::Released { name, shared: true } => {
                !exclusive.contains(name)
            }
            Change::Left { name, .. } | Change::Released { name, .. } => {
                !exclusive.contains(name) && !shared.contains(name)
            }
        })
    }

    /// The carried claims put back, when they are exactly those of `ids` (in any order).
    pub(super) fn returned_if(&self, ids: &[TaskId]) -> Option<Vec<TaskRow>> {
        let carried: HashSet<TaskId> = self.returned.iter().map(|r| r.id).collect();
        (carried.len() == ids.len() && ids.iter().all(|id| carried.contains(id)))
            .then(|| self.returned.clone())
    }

    /// The tasks as a page to judge: marked full, so that a pass that judged them all without
    /// serving everyone reads on from the last.
    pub(super) fn page(&self) -> crate::tasks::Page {
        crate::tasks::Page {
            tasks: self.rows.clone(),
            full: true,
            held: self.held.clone(),
            tail: None,
            whole: false,
        }
    }
}
