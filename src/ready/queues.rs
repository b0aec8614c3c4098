//! Resource queues: every incomplete task, in queue order per resource, in memory.
//!
//! The structure DESIGN.md asks for to find candidates without reading the tasks in front of
//! them: for each resource, its incomplete tasks in `(pulp_created, pulp_id)` order, and kept
//! with it the tasks that are *lanes* by the rule over those queues (see [`super::counter`]: T is
//! first in the queue of every resource it needs exclusively, and no task needs one of its shared
//! resources exclusively before it). A task that is not a lane here has an older incomplete task
//! that conflicts with it, so it is not ready, as long as that older task is still incomplete.
//!
//! So dispatch may start a scan just before the oldest lane instead of at the queue's head, once
//! it has checked the tasks that make the others wait (the *holders*: the first user and the first
//! exclusive user of each resource) are still incomplete ([`ResourceQueues::start`]). A task the
//! queues have not seen (newer than [`ResourceQueues::known`]) is read by the scan itself. The
//! queues only ever move a scan's start; the exact look-up still decides every grant.
//!
//! Changes arrive in any order: [`ResourceQueues::insert`] takes a task older than others (a late
//! commit) and [`ResourceQueues::remove`] one from the middle; each re-judges only the tasks
//! whose place can change (the heads of the resources touched). Never does I/O.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;

use crate::ids::TaskId;

use super::{BlockedResource, Key, Resources};

type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
type Set<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;

/// A resource has a *long queue* when at least this many incomplete tasks need it in one mode
/// (exclusively, or shared): a record entry (`NAME` or `shared:NAME`) that many tasks carry makes
/// a look-up through it read that many tasks, so the exact look-up of a task whose conflict keys
/// include it first tries the tasks older than it (see [`ResourceQueues::busy_queues`]).
pub const LONG_QUEUE: usize = 256;

/// A resource has a *busy queue* when at least this many incomplete tasks need it in one mode (a
/// long queue is busy too). The exact look-up of a task near the queue's head reads the tasks
/// older than it when one of its conflict keys is a busy queue's entry, and through the GIN index
/// otherwise: that reads fewer than this many users of each of its resources (and their row
/// versions not yet vacuumed), where the tasks older than it may be hundreds.
pub const BUSY_QUEUE: usize = 32;

/// One resource's queue.
#[derive(Debug, Default)]
struct Queue {
    /// Every incomplete task that needs the resource, in any mode.
    users: BTreeSet<Key>,
    /// Those that need it exclusively.
    exclusive: BTreeSet<Key>,
    /// The count of removals (see [`ResourceQueues::removals`]) when a user was last removed.
    removed_at: u64,
}

impl Queue {
    /// The two places: the first user, and the first exclusive user.
    fn places(&self) -> (Option<Key>, Option<Key>) {
        (self.users.first().copied(), self.exclusive.first().copied())
    }
}

/// A task in the queues: when it was created and what it needs (interned names, exclusive?).
#[derive(Debug)]
struct Entry {
    created: i64,
    uses: Box<[(u32, bool)]>,
}

/// What a check of a task found (see [`ResourceQueues::start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Waiting and unclaimed (or canceled by Pulp while it waited: it holds no lock): a lane seen
    /// so stops a start, and a holder seen so is reserved by the scan.
    Waiting,
    /// Incomplete but not to be handed out (claimed, running or canceling): it keeps its places.
    Held,
    /// No longer incomplete (or deleted): remove it with [`ResourceQueues::remove`].
    Gone,
}

/// Every incomplete task, in queue order per resource, with the lanes and holders among them.
#[derive(Debug, Default)]
pub struct ResourceQueues {
    names: Map<String, u32>,
    /// Interned names by id.
    spelled: Vec<String>,
    queues: Map<u32, Queue>,
    tasks: Map<TaskId, Entry>,
    /// Every task, in queue order.
    order: BTreeSet<Key>,
    /// Tasks that are lanes by the rule over the queues.
    lanes: BTreeSet<Key>,
    /// Tasks that hold a place (first user or first exclusive user) of some resource, with how
    /// many places each holds.
    holders: BTreeMap<Key, u32>,
    /// The resources with a busy queue, by mode (true: exclusive).
    busy: Set<(u32, bool)>,
    /// Every incomplete task up to this position is in the queues (None: nothing is known).
    known: Option<Key>,
    /// How many tasks were removed so far.
    removals: u64,
}

impl ResourceQueues {
    /// How many tasks the queues hold.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// True when they hold no task.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Every incomplete task up to this position is in the queues.
    pub fn known(&self) -> Option<Key> {
        self.known
    }

    /// How many tasks were removed so far (see [`ResourceQueues::hides`]).
    pub fn removals(&self) -> u64 {
        self.removals
    }

    /// Says that every incomplete task up to `position` has been inserted. Never moves back.
    pub fn know_up_to(&mut self, position: Key) {
        if self.known.is_none_or(|k| k < position) {
            self.known = Some(position);
        }
    }

    /// The lanes, oldest first.
    pub fn lanes(&self) -> impl Iterator<Item = Key> + '_ {
        self.lanes.iter().copied()
    }

    /// The holders of places, oldest first.
    pub fn holders(&self) -> impl Iterator<Item = Key> + '_ {
        self.holders.keys().copied()
    }

    /// Whether at least half of the `n` tasks after a position (up to the end of what is known)
    /// are not lanes, and there are `n`: a scan that starts at the position would read through
    /// blocked tasks, where [`ResourceQueues::start`] may let it skip them.
    pub fn blocked_after(&self, position: Key, n: usize) -> bool {
        let Some(known) = self.known else {
            return false;
        };
        if known <= position {
            return false;
        }
        let next: Vec<&Key> = self
            .order
            .range((Bound::Excluded(position), Bound::Included(known)))
            .take(n)
            .collect();
        // A lane right after the position is what a scan reads first anyway (a walk's hint ends
        // just before one): a start would not move it.
        next.len() >= n
            && !self.lanes.contains(next[0])
            && next.iter().filter(|k| !self.lanes.contains(k)).count() * 2 >= n
    }

    /// The resources with a busy queue (long ones among them), as the record entries that many
    /// tasks carry (`NAME` for the exclusive users, `shared:NAME` for the shared ones), each with
    /// how many tasks carry it.
    pub fn busy_queues(&self) -> Vec<(String, usize)> {
        self.busy
            .iter()
            .filter_map(|&(name, exclusive)| {
                let queue = self.queues.get(&name)?;
                let spelled = &self.spelled[name as usize];
                Some(if exclusive {
                    (spelled.clone(), queue.exclusive.len())
                } else {
                    (
                        format!("{}{spelled}", super::SHARED_PREFIX),
                        queue.users.len() - queue.exclusive.len(),
                    )
                })
            })
            .collect()
    }

    /// The `n` resources with the most tasks behind the head of their queue that conflict with
    /// it (most first, then by name), as [`super::LaneCounter::most_blocked`] counts them over
    /// the same tasks: every user after the head that needs the resource exclusively, or comes
    /// at or after its first exclusive user. Reads every queue once.
    pub fn most_blocked(&self, n: usize) -> Vec<BlockedResource> {
        let mut blocked: Vec<BlockedResource> = self
            .queues
            .iter()
            .filter_map(|(&name, queue)| {
                let head = *queue.users.first()?;
                let first_exclusive = *queue.exclusive.first()?;
                // The shared users before the first exclusive one conflict with nothing older;
                // the head is not behind itself.
                let free = if head == first_exclusive {
                    1
                } else {
                    queue.users.range(..first_exclusive).count()
                };
                let behind = queue.users.len() - free;
                (behind > 0).then(|| BlockedResource {
                    resource: self.spelled[name as usize].clone(),
                    behind: u32::try_from(behind).unwrap_or(u32::MAX),
                    head: head.1,
                })
            })
            .collect();
        blocked.sort_unstable_by(|a, b| {
            b.behind
                .cmp(&a.behind)
                .then_with(|| a.resource.cmp(&b.resource))
        });
        blocked.truncate(n);
        blocked
    }

    /// The position of the `n`th task in queue order (1-based), if there are that many.
    pub fn nth(&self, n: usize) -> Option<Key> {
        self.order.iter().nth(n.checked_sub(1)?).copied()
    }

    fn intern(&mut self, name: &str) -> u32 {
        if let Some(id) = self.names.get(name) {
            return *id;
        }
        let id = u32::try_from(self.spelled.len()).unwrap_or(u32::MAX);
        self.names.insert(name.to_owned(), id);
        self.spelled.push(name.to_owned());
        id
    }

    /// Adds an incomplete task (its record as in `reserved_resources_record`). A task already in
    /// the queues is left as it is (false).
    pub fn insert<S: AsRef<str>>(&mut self, key: Key, record: &[S]) -> bool {
        if self.tasks.contains_key(&key.1) {
            return false;
        }
        let resources = Resources::from_record(record);
        let mut uses: Vec<(u32, bool)> = Vec::new();
        for name in &resources.exclusive {
            let id = self.intern(name);
            uses.push((id, true));
        }
        for name in &resources.shared {
            let id = self.intern(name);
            uses.push((id, false));
        }
        let mut judge = vec![key];
        for &(name, exclusive) in &uses {
            let queue = self.queues.entry(name).or_default();
            let before = queue.places();
            queue.users.insert(key);
            if exclusive {
                queue.exclusive.insert(key);
            }
            mark_busy(&mut self.busy, name, queue);
            let after = queue.places();
            // Newer tasks whose place may be lost to this one: a task older than others can only
            // take places from them.
            let after_key = (Bound::Excluded(key), Bound::Unbounded);
            if exclusive {
                // Every later user of the resource, up to and with the first exclusive one (no
                // lane lies beyond it on this resource).
                for u in queue.users.range(after_key) {
                    if self.lanes.contains(u) {
                        judge.push(*u);
                    }
                    if queue.exclusive.contains(u) {
                        judge.push(*u);
                        break;
                    }
                }
            } else if let Some(e) = queue.exclusive.range(after_key).next() {
                judge.push(*e);
            }
            self.move_places(before, after);
        }
        self.order.insert(key);
        self.tasks.insert(
            key.1,
            Entry {
                created: key.0,
                uses: uses.into_boxed_slice(),
            },
        );
        for k in judge {
            self.judge(k);
        }
        true
    }

    /// Removes a task that is no longer incomplete; the tasks behind it may become lanes. Returns
    /// false when it was not in the queues.
    pub fn remove(&mut self, id: &TaskId) -> bool {
        let Some(entry) = self.tasks.remove(id) else {
            return false;
        };
        let key = (entry.created, *id);
        self.order.remove(&key);
        self.lanes.remove(&key);
        self.removals += 1;
        let mut judge = Vec::new();
        for &(name, exclusive) in entry.uses.iter() {
            let Some(queue) = self.queues.get_mut(&name) else {
                continue;
            };
            let before = queue.places();
            queue.users.remove(&key);
            queue.removed_at = self.removals;
            if exclusive {
                queue.exclusive.remove(&key);
                // The head run may be lanes now: users up to and with the first exclusive one.
                for u in &queue.users {
                    judge.push(*u);
                    if queue.exclusive.contains(u) {
                        break;
                    }
                }
            } else if let Some(e) = queue.exclusive.first() {
                judge.push(*e);
            }
            let after = queue.places();
            mark_busy(&mut self.busy, name, queue);
            if queue.users.is_empty() {
                self.queues.remove(&name);
            }
            self.move_places(before, after);
        }
        for k in judge {
            self.judge(k);
        }
        true
    }

    /// Moves the holder counts from a resource's old places to its new ones.
    fn move_places(
        &mut self,
        before: (Option<Key>, Option<Key>),
        after: (Option<Key>, Option<Key>),
    ) {
        if before == after {
            return;
        }
        for key in [before.0, before.1].into_iter().flatten() {
            if let Some(n) = self.holders.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    self.holders.remove(&key);
                }
            }
        }
        for key in [after.0, after.1].into_iter().flatten() {
            *self.holders.entry(key).or_insert(0) += 1;
        }
    }

    /// Re-judges whether a task is a lane.
    fn judge(&mut self, key: Key) {
        let Some(entry) = self.tasks.get(&key.1) else {
            return;
        };
        let lane = entry.uses.iter().all(|&(name, exclusive)| {
            self.queues.get(&name).is_some_and(|q| {
                if exclusive {
                    q.users.first() == Some(&key)
                } else {
                    q.exclusive.first().is_none_or(|e| *e > key)
                }
            })
        });
        if lane {
            self.lanes.insert(key);
        } else {
            self.lanes.remove(&key);
        }
    }

    /// Whether a held lock on a record entry (`NAME` or `shared:NAME`) hides a task older than
    /// `before`: a task in the queues before it needs NAME in a mode that conflicts with the
    /// entry's, and is not the lock's holder. A shared lock's holders never need NAME
    /// exclusively, so any exclusive user counts. An exclusive lock's holder H is one of NAME's
    /// users, and the first: it was ready when it was handed out (no older incomplete task used
    /// NAME), and no older one can appear since (the insert trigger). So one user before `before`
    /// is H itself, and it takes two to hide one, unless a user of NAME was removed since
    /// `since` (a count of [`ResourceQueues::removals`] taken before the held locks were read;
    /// None: these queues were not in place then, so anything may have gone): H may have ended
    /// and gone from the queues meanwhile, leaving only a task it hid (None: ask Postgres). Were
    /// that rule ever broken outside the broker, a release would leave a scan hint in place until
    /// the next walk: a delay, never a grant. A task that ended but is still in the queues may
    /// make the answer yes where none hides (a hint then drops once too often, never once too
    /// rarely). Only meaningful for positions up to [`ResourceQueues::known`].
    pub fn hides(&self, entry: &str, before: Key, since: Option<u64>) -> Option<bool> {
        let (name, exclusive) = match entry.strip_prefix(super::SHARED_PREFIX) {
            Some(name) => (name, false),
            None => (entry, true),
        };
        let Some(queue) = self.names.get(name).and_then(|id| self.queues.get(id)) else {
            return Some(false);
        };
        if !exclusive {
            return Some(queue.exclusive.first().is_some_and(|k| *k < before));
        }
        match queue.users.range(..before).take(2).count() {
            0 => Some(false),
            1 if since.is_none_or(|s| queue.removed_at > s) => None,
            1 => Some(false),
            _ => Some(true),
        }
    }

    /// The tasks a start after `from` must check, oldest first: the first `limit` holders and
    /// lanes after `from` (merged in queue order) up to [`ResourceQueues::known`] that `seen`
    /// does not name yet.
    pub fn to_check(
        &self,
        seen: &HashMap<TaskId, Seen>,
        limit: usize,
        from: Option<Key>,
    ) -> Vec<TaskId> {
        let Some(known) = self.known else {
            return Vec::new();
        };
        let unseen = |k: &&Key| **k <= known && !seen.contains_key(&k.1);
        let mut keys: Vec<Key> = self
            .holders
            .keys()
            .filter(unseen)
            .take(limit)
            .chain(
                self.lanes
                    .iter()
                    .filter(|k| from.is_none_or(|f| **k > f))
                    .filter(unseen)
                    .take(limit),
            )
            .copied()
            .collect();
        keys.sort_unstable();
        keys.dedup();
        keys.truncate(limit);
        keys.into_iter().map(|k| k.1).collect()
    }

    /// Where a scan may start: every waiting, unclaimed task at or before [`Start::after`] is not
    /// ready by the rule, given what `seen` says of the tasks it names (checked holders and lanes,
    /// see [`ResourceQueues::to_check`], once every task seen [`Seen::Gone`] has been removed).
    /// It is the position just before the first task that is a lane and waiting, or that was not
    /// checked (a holder or a lane), and at most [`ResourceQueues::known`]. None when nothing is
    /// known.
    ///
    /// Why it holds: a waiting task W before that position is not a lane, so a task older than W
    /// holds a place W needs; that holder is older than the position, so it was checked and is
    /// still incomplete: W conflicts with an older incomplete task.
    ///
    /// With `from`, only the lanes after it stop the position (a scan that has judged the tasks up
    /// to `from` may go on from there): the waiting tasks between `from` and the position are not
    /// ready, for the same reason. The holders are still every one from the head (a task after
    /// `from` may wait for one before it).
    pub fn start(&self, seen: &HashMap<TaskId, Seen>, from: Option<Key>) -> Option<Start> {
        let known = self.known?;
        // Holders and lanes are sorted: the first one that stops a run stops it.
        let holder = self
            .holders
            .keys()
            .take_while(|k| **k <= known)
            .find(|k| !matches!(seen.get(&k.1), Some(Seen::Waiting | Seen::Held)))
            .map(|k| (*k, true));
        let lane = self
            .lanes
            .iter()
            .skip_while(|k| from.is_some_and(|f| **k <= f))
            .take_while(|k| **k <= known)
            .find(|k| seen.get(&k.1) != Some(&Seen::Held))
            .map(|k| (*k, seen.get(&k.1) != Some(&Seen::Waiting)));
        let stop = match (holder, lane) {
            (Some(h), Some(l)) => Some(h.min(l)),
            (h, l) => h.or(l),
        };
        let mut waiting = Vec::new();
        let mut held = Vec::new();
        let after = stop.map_or(known, |(key, _)| before(key));
        for key in self.holders.keys().take_while(|k| **k <= after) {
            let Some(entry) = self.tasks.get(&key.1) else {
                continue;
            };
            match seen.get(&key.1) {
                Some(Seen::Waiting) => waiting.push(self.record(entry)),
                Some(Seen::Held) => held.push(self.record(entry)),
                _ => {}
            }
        }
        Some(Start {
            after,
            unchecked: stop.is_some_and(|(_, unchecked)| unchecked),
            waiting,
            held,
        })
    }

    /// A task's record as Postgres spells it.
    fn record(&self, entry: &Entry) -> Vec<String> {
        entry
            .uses
            .iter()
            .map(|&(name, exclusive)| {
                let name = &self.spelled[name as usize];
                if exclusive {
                    name.clone()
                } else {
                    format!("{}{name}", super::SHARED_PREFIX)
                }
            })
            .collect()
    }
}

/// Notes whether a resource's queue is busy in each mode, after a change to it.
fn mark_busy(busy: &mut Set<(u32, bool)>, name: u32, queue: &Queue) {
    let exclusive = queue.exclusive.len();
    for (mode, users) in [(true, exclusive), (false, queue.users.len() - exclusive)] {
        if users >= BUSY_QUEUE {
            busy.insert((name, mode));
        } else {
            busy.remove(&(name, mode));
        }
    }
}

/// Where a scan may start (see [`ResourceQueues::start`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    /// Every waiting, unclaimed task up to this position is not ready by the rule.
    pub after: Key,
    /// The position stops at a task that was not checked: checking more may move it on.
    pub unchecked: bool,
    /// The records of the waiting holders up to it: they make tasks up to it wait, so a scan
    /// that starts there reserves their resources (a change to one of them may free a task).
    pub waiting: Vec<Vec<String>>,
    /// The records of the held holders (claimed or running) up to it: their locks make tasks up
    /// to it wait, so a scan that starts there counts their entries among the held ones it
    /// skipped by (their release may free a task, even when it happens before the scan reads
    /// which locks are held).
    pub held: Vec<Vec<String>>,
}

impl Start {
    /// Takes a scan to this start: reserves the waiting holders' resources (and hands their
    /// conflict keys to `exclude`, for the pages to skip), adds the held holders' entries to
    /// `held` (the held entries the scan skipped by), and returns the position.
    pub fn apply(
        self,
        reserved: &mut super::Reservations,
        held: &mut std::collections::HashSet<String>,
        mut exclude: impl FnMut(String),
    ) -> Key {
        for record in &self.waiting {
            let resources = Resources::from_record(record);
            reserved.reserve(&resources);
            resources.conflict_keys().into_iter().for_each(&mut exclude);
        }
        held.extend(self.held.into_iter().flatten());
        self.after
    }
}

/// The position just before a task's (no id lies between an id and its predecessor; for the
/// nil id, the last position of the previous microsecond, Postgres' resolution).
pub fn before(key: Key) -> Key {
    match key.1 .0.as_u128().checked_sub(1) {
        Some(previous) => (key.0, TaskId(uuid::Uuid::from_u128(previous))),
        None => (key.0 - 1, TaskId::MAX),
    }
}

#[cfg(test)]
mod tests;
