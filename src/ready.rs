//! The readiness rule and the lane count: pure decisions over plain data, no I/O.
//!
//! Dispatch (`dispatch`), the gauge and every later explanation of "why is this task waiting" call
//! into this module; none of them may carry a second copy of the rule.
//!
//! The rule (DESIGN.md): order incomplete tasks by `(pulp_created, pulp_id)`. A waiting, unclaimed
//! task T is *ready* when no older incomplete task conflicts with T and no held lock conflicts with
//! T. Two tasks *conflict* when one needs a resource exclusively that the other needs in any mode.

use std::collections::{BTreeMap, HashMap};

use crate::ids::TaskId;

/// The prefix that marks shared access in `reserved_resources_record`.
pub const SHARED_PREFIX: &str = "shared:";

/// A task's resources, split by access mode.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources {
    /// Names the task needs alone.
    pub exclusive: Vec<String>,
    /// Names the task needs alongside other shared users (without the `shared:` prefix).
    pub shared: Vec<String>,
}

impl Resources {
    /// Parses a `reserved_resources_record`: `shared:NAME` is shared access to NAME, a bare NAME is
    /// exclusive. A name needed both ways counts as exclusive; duplicates collapse.
    pub fn from_record<S: AsRef<str>>(record: &[S]) -> Self {
        let mut exclusive: Vec<String> = Vec::new();
        let mut shared: Vec<String> = Vec::new();
        for entry in record {
            let entry = entry.as_ref();
            match entry.strip_prefix(SHARED_PREFIX) {
                Some(name) => shared.push(name.to_owned()),
                None => exclusive.push(entry.to_owned()),
            }
        }
        exclusive.sort();
        exclusive.dedup();
        shared.sort();
        shared.dedup();
        shared.retain(|name| exclusive.binary_search(name).is_err());
        Resources { exclusive, shared }
    }

    /// True when the task needs no resource at all.
    pub fn is_empty(&self) -> bool {
        self.exclusive.is_empty() && self.shared.is_empty()
    }

    /// True when `self` and `other` conflict.
    pub fn conflicts_with(&self, other: &Resources) -> bool {
        self.conflicts(other).next().is_some()
    }

    /// Every resource on which `self` and `other` conflict, with the mode each needs it in: one
    /// needs it exclusively and the other in any mode. (The one statement of "conflict" that
    /// everything else asks.)
    pub fn conflicts<'a>(&'a self, other: &'a Resources) -> impl Iterator<Item = Conflict<'a>> {
        let exclusive = self.exclusive.iter().filter_map(move |r| {
            let theirs = if other.exclusive.contains(r) {
                Mode::Exclusive
            } else if other.shared.contains(r) {
                Mode::Shared
            } else {
                return None;
            };
            Some(Conflict {
                resource: r,
                mine: Mode::Exclusive,
                theirs,
            })
        });
        let shared = self
            .shared
            .iter()
            .filter(move |r| other.exclusive.contains(r))
            .map(|r| Conflict {
                resource: r,
                mine: Mode::Shared,
                theirs: Mode::Exclusive,
            });
        exclusive.chain(shared)
    }

    /// C(T): the record entries whose presence in another task's `reserved_resources_record`
    /// means that task conflicts with this one: `r` and `shared:r` for each exclusive `r`, and `r`
    /// for each shared `r`. A positive overlap (`&&`) with this set is the one GIN look-up that
    /// decides readiness against older tasks.
    pub fn conflict_keys(&self) -> Vec<String> {
        let mut keys = Vec::with_capacity(self.exclusive.len() * 2 + self.shared.len());
        for r in &self.exclusive {
            keys.push(r.clone());
            keys.push(format!("{SHARED_PREFIX}{r}"));
        }
        keys.extend(self.shared.iter().cloned());
        keys
    }
}

/// How a task needs a resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// Alone (a bare name in the record).
    Exclusive,
    /// Alongside other shared users (`shared:NAME`).
    Shared,
}

impl Mode {
    /// `exclusive` or `shared`, as the API and the CLI say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Exclusive => "exclusive",
            Mode::Shared => "shared",
        }
    }
}

/// One resource two tasks (or a task and a held lock) conflict on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conflict<'a> {
    /// The resource name (without `shared:`).
    pub resource: &'a str,
    /// How the task asking needs it.
    pub mine: Mode,
    /// How the other task (or lock) needs it.
    pub theirs: Mode,
}

/// Resources reserved by the tasks seen so far in queue order (each incomplete task reserves its
/// resources even when it cannot run), plus those of held locks: name -> reserved exclusively.
#[derive(Debug, Clone, Default)]
pub struct Reservations {
    names: HashMap<String, bool, foldhash::fast::RandomState>,
}

impl Reservations {
    /// True when a task needing `resources` conflicts with anything reserved.
    pub fn conflicts_with(&self, resources: &Resources) -> bool {
        resources.exclusive.iter().any(|r| self.touches(r))
            || resources.shared.iter().any(|r| self.is_exclusive(r))
    }

    /// True when `name` is reserved in any mode.
    pub fn touches(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// True when `name` is reserved exclusively.
    pub fn is_exclusive(&self, name: &str) -> bool {
        self.names.get(name).copied().unwrap_or(false)
    }

    /// Reserves `name` for everything that comes later (exclusive wins).
    fn reserve_name(&mut self, name: &str, exclusive: bool) {
        match self.names.get_mut(name) {
            Some(held) => *held |= exclusive,
            None => {
                self.names.insert(name.to_owned(), exclusive);
            }
        }
    }

    /// Reserves `resources` for everything that comes later.
    pub fn reserve(&mut self, resources: &Resources) {
        for name in &resources.exclusive {
            self.reserve_name(name, true);
        }
        for name in &resources.shared {
            self.reserve_name(name, false);
        }
    }

    /// Reserves a held lock on one resource.
    pub fn reserve_lock(&mut self, name: &str, mode: Mode) {
        self.reserve_name(name, mode == Mode::Exclusive);
    }
}

/// A resource with tasks waiting behind it (the survey of the gauge's pass).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockedResource {
    /// The resource name (without `shared:`).
    pub resource: String,
    /// Incomplete tasks after the head of its queue that conflict on it.
    pub behind: u32,
    /// The oldest incomplete task that needs it: the head of its queue.
    pub head: TaskId,
}

/// What dispatch knows about one waiting, unclaimed task while it walks the queue.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The task's resources.
    pub resources: Resources,
    /// The number of older incomplete tasks that conflict with it (from the exact GIN look-up).
    pub older_conflicts: i64,
    /// The task's `versions`: component -> minimum version. `None` when they could not be read,
    /// which makes the task incompatible with every lease (fail closed).
    pub versions: Option<BTreeMap<String, String>>,
}

/// Why a candidate is or is not handed to a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Ready and compatible: try to lock and claim it.
    Ready,
    /// An older incomplete task conflicts with it.
    BlockedByOlder,
    /// Something seen earlier in this pass (a held lock, an older unready task) conflicts with it.
    BlockedByReserved,
    /// The lease's component versions do not satisfy the task's.
    Incompatible,
}

/// Everything that keeps one candidate from one lease, judged all at once (ExplainTask reports
/// every reason; dispatch acts on the first, [`Obstacles::verdict`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Obstacles {
    /// An older incomplete task conflicts with it.
    pub older: bool,
    /// Something reserved (a held lock, an older unready task seen in this pass) conflicts.
    pub reserved: bool,
    /// The lease's component versions do not satisfy the task's.
    pub incompatible: bool,
}

impl Obstacles {
    /// The verdict dispatch acts on: the first obstacle in rule order, or ready.
    pub fn verdict(&self) -> Verdict {
        if self.older {
            Verdict::BlockedByOlder
        } else if self.reserved {
            Verdict::BlockedByReserved
        } else if self.incompatible {
            Verdict::Incompatible
        } else {
            Verdict::Ready
        }
    }

    /// True when the task is ready by the rule (no older task, no reservation conflicts),
    /// whatever this lease's versions or wishes.
    pub fn ready_by_rule(&self) -> bool {
        !self.older && !self.reserved
    }
}

/// Every obstacle between one candidate and one lease.
pub fn obstacles(
    candidate: &Candidate,
    reserved: &Reservations,
    lease_versions: &BTreeMap<String, String>,
) -> Obstacles {
    Obstacles {
        older: candidate.older_conflicts > 0,
        reserved: reserved.conflicts_with(&candidate.resources),
        incompatible: !runs_on(candidate, lease_versions),
    }
}

/// True when a lease with these component versions may run the candidate (a task whose versions
/// could not be read runs nowhere).
pub fn runs_on(candidate: &Candidate, lease_versions: &BTreeMap<String, String>) -> bool {
    candidate
        .versions
        .as_ref()
        .is_some_and(|needed| is_compatible(needed, lease_versions))
}

/// Judges one candidate for one lease. Candidates must be judged oldest first, and every
/// candidate that is not handed out must be passed to [`Reservations::reserve`] before the next
/// one is judged: a task that cannot run still reserves its resources.
pub fn judge(
    candidate: &Candidate,
    reserved: &Reservations,
    lease_versions: &BTreeMap<String, String>,
) -> Verdict {
    obstacles(candidate, reserved, lease_versions).verdict()
}

/// Pulp's compatibility rule: every component the task names must be present in the worker's
/// versions with a release at least as new. Extra worker components do not matter; a task with no
/// versions runs anywhere.
pub fn is_compatible(
    task_versions: &BTreeMap<String, String>,
    worker_versions: &BTreeMap<String, String>,
) -> bool {
    task_versions.iter().all(|(component, needed)| {
        worker_versions
            .get(component)
            .is_some_and(|have| compare_releases(have, needed) != std::cmp::Ordering::Less)
    })
}

/// Compares release numbers the way Pulp's (PEP 440) comparison does for the versions Pulp
/// ships: dotted numbers compared numerically (`3.123.1` < `3.124`; `3.1` == `3.1.0`), a
/// pre-release or development suffix (`3.124.0.dev0`, `3.124.0rc1`) before its release, and a
/// `post` suffix after it. Two suffixes of the same kind compare equal.
pub fn compare_releases(a: &str, b: &str) -> std::cmp::Ordering {
    let parse = |v: &str| -> (Vec<u64>, u8) {
        let mut numbers = Vec::new();
        let mut rank = 1; // 0: pre-release or dev, 1: release, 2: post-release
        for part in v.trim().trim_start_matches(['v', 'V']).split('.') {
            let digits: String = part.chars().take_while(|c| c.is_ascii_digit()).collect();
            let suffix = &part[digits.len()..];
            if !digits.is_empty() {
                numbers.push(digits.parse().unwrap_or(u64::MAX));
            }
            if !suffix.is_empty() || digits.is_empty() {
                rank = if suffix.contains("post") { 2 } else { 0 };
                break;
            }
        }
        while numbers.last() == Some(&0) {
            numbers.pop();
        }
        (numbers, rank)
    };
    parse(a).cmp(&parse(b))
}

/// Checks that a version string is one [`compare_releases`] understands: dot-separated parts,
/// none empty, the first starting with a digit.
pub fn is_valid_release(v: &str) -> bool {
    let v = v.trim().trim_start_matches(['v', 'V']);
    v.chars().next().is_some_and(|c| c.is_ascii_digit())
        && v.split('.').all(|part| !part.is_empty())
}

mod counter;
pub use counter::{Class, Key, LaneCounter, Repair};
pub mod queues;
pub use queues::{ResourceQueues, Seen, Start, BUSY_QUEUE, LONG_QUEUE};

#[cfg(test)]
mod tests;
