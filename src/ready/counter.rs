//! The lane count, kept between passes.
//!
//! The rule, restated per resource: with `first(r)` the oldest incomplete task that needs `r` in
//! any mode and `first_exclusive(r)` the oldest that needs it exclusively, a task T is a lane when
//! it is `first(x)` for every `x` it needs exclusively and older than `first_exclusive(s)` (or
//! there is none) for every `s` it shares. (An older task conflicts with T exactly when it
//! touches one of T's exclusive resources or takes one of T's shared ones exclusively.)
//!
//! So the count depends on the tasks that hold one of these two places for some resource, and on
//! the lanes themselves: a task that is neither can finish (or vanish) without changing whether
//! any other task is a lane. [`LaneCounter`] remembers exactly those tasks ("tracked"), the two
//! places per resource, and the newest task it has seen (the watermark). The next pass then
//! reads only what changed: which tracked tasks are no longer incomplete, the tasks that take
//! over their places (a [`Repair`] fed the incomplete tasks that need the resources involved, in
//! queue order), and the tasks newer than the watermark. Its memory grows with the number of
//! distinct resources and of lanes, never with the tasks behind them.

use std::collections::HashMap;

use uuid::Uuid;

use crate::ids::TaskId;

use super::{BlockedResource, Resources, SHARED_PREFIX};

/// A task's place in the queue: `pulp_created` (microseconds since the epoch), then `pulp_id`.
pub type Key = (i64, TaskId);

type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Who holds the two places of one resource.
#[derive(Debug, Clone, Copy)]
struct Places {
    /// The oldest incomplete task that needs it in any mode (the head of its queue).
    first: Key,
    /// The oldest incomplete task that needs it exclusively.
    first_exclusive: Option<Key>,
    /// Tasks seen after the head that conflict on it (the survey; counted by full passes).
    behind: u32,
    /// Tasks seen that need it (a hint for how a repair reads it: many or few).
    users: u32,
}

/// What fair dispatch's caps and reserve ask of a lane (`fair::Rules::lanes`): its domain
/// (Pulp's `pulp_domain_id`) and task group (`task_group_id`), of which `fair::group_of` makes
/// its group, and whether it is immediate. The count itself ignores it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Class {
    pub domain: Uuid,
    pub immediate: bool,
    pub task_group: Option<Uuid>,
}

/// A task the count depends on: it holds a place, or it is a lane.
#[derive(Debug, Clone)]
struct Tracked {
    created: i64,
    resources: Resources,
    class: Class,
    lane: bool,
}

/// Counts lanes over incomplete tasks fed in `(pulp_created, pulp_id)` order, and keeps what it
/// needs to count again after tasks end and arrive without reading the whole queue (see the
/// module documentation). Every task reserves its resources, counted or not.
#[derive(Debug)]
pub struct LaneCounter {
    places: Map<String, Places>,
    tracked: Map<TaskId, Tracked>,
    lanes: u64,
    /// The lanes by class (their sum is `lanes`).
    by_class: Map<Class, u64>,
    /// Waiting tasks by class (immediate or not alike), as noted while a full pass fed them
    /// ([`LaneCounter::note_waiting`]).
    waiting: Map<Class, u64>,
    watermark: Option<Key>,
    /// Tasks fed since the counter was made.
    seen: u64,
    /// At most this many tasks are tracked; beyond it tracking stops (the count stays exact,
    /// only the next pass must read the whole queue again).
    track_limit: usize,
    /// The counter cannot be maintained: tracking hit its limit, or its reader said so
    /// ([`LaneCounter::invalidate`]).
    overflowed: bool,
}

impl Default for LaneCounter {
    fn default() -> Self {
        LaneCounter::with_track_limit(usize::MAX)
    }
}

/// How a task needs one resource.
fn entry_name(entry: &str) -> (&str, bool) {
    match entry.strip_prefix(SHARED_PREFIX) {
        Some(name) => (name, false),
        None => (entry, true),
    }
}

impl LaneCounter {
    /// A counter that stops tracking beyond `limit` tasks.
    pub fn with_track_limit(limit: usize) -> Self {
        LaneCounter {
            places: Map::default(),
            tracked: Map::default(),
            lanes: 0,
            by_class: Map::default(),
            waiting: Map::default(),
            watermark: None,
            seen: 0,
            track_limit: limit,
            overflowed: false,
        }
    }

    /// Lanes counted.
    pub fn lanes(&self) -> u64 {
        self.lanes
    }

    /// The lanes by class, for the caps and the reserve (`fair::Rules::lanes`); classes
    /// without lanes are left out.
    pub fn lanes_by_class(&self) -> impl Iterator<Item = (Class, u64)> + '_ {
        self.by_class
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(c, n)| (*c, *n))
    }

    /// Notes a waiting task of `class` (a full pass notes every one it feeds; a maintained
    /// pass none, so the numbers are those of the counter's full pass).
    pub fn note_waiting(&mut self, class: Class) {
        let class = Class {
            immediate: false,
            ..class
        };
        *self.waiting.entry(class).or_default() += 1;
    }

    /// The waiting tasks by class (`immediate` always false) that
    /// [`LaneCounter::note_waiting`] noted.
    pub fn waiting_by_class(&self) -> impl Iterator<Item = (Class, u64)> + '_ {
        self.waiting.iter().map(|(c, n)| (*c, *n))
    }

    fn count(&mut self, class: Class, lane: bool) {
        if lane {
            self.lanes += 1;
            *self.by_class.entry(class).or_default() += 1;
        } else {
            self.lanes -= 1;
            if let Some(n) = self.by_class.get_mut(&class) {
                *n -= 1;
                if *n == 0 {
                    self.by_class.remove(&class);
                }
            }
        }
    }

    /// The newest task fed, if any.
    pub fn watermark(&self) -> Option<Key> {
        self.watermark
    }

    /// Tasks fed since the counter was made: the queue at its full pass and the arrivals since
    /// (a measure of what a full pass would read now).
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Whether the counter can be brought up to date by [`LaneCounter::gone`], a [`Repair`] and
    /// newer tasks (false once tracking hit its limit).
    pub fn maintainable(&self) -> bool {
        !self.overflowed
    }

    /// How many tasks are tracked.
    pub fn tracked(&self) -> usize {
        self.tracked.len()
    }

    /// The tracked tasks: the ones whose end changes the count. Ask which are no longer
    /// incomplete and pass those to [`LaneCounter::gone`].
    pub fn tracked_ids(&self) -> impl Iterator<Item = TaskId> + '_ {
        self.tracked.keys().copied()
    }

    /// Feeds the next-oldest incomplete task (newer than every task fed so far), of the
    /// default class.
    pub fn push_task<S: AsRef<str>>(&mut self, key: Key, record: &[S]) {
        self.push_classed(key, record, Class::default());
    }

    /// Feeds the next-oldest incomplete task (newer than every task fed so far), of `class`.
    pub fn push_classed<S: AsRef<str>>(&mut self, key: Key, record: &[S], class: Class) {
        debug_assert!(self.watermark.is_none_or(|w| w < key), "tasks out of order");
        let places = &self.places;
        let blocked = record.iter().any(|entry| {
            let (name, exclusive) = entry_name(entry.as_ref());
            match places.get(name) {
                None => false,
                Some(p) => exclusive || p.first_exclusive.is_some(),
            }
        });
        let lane = !blocked;
        let mut holds = false;
        // A record that names a resource twice (or both ways) is one use of it, exclusive if
        // any of them is: one task behind its head.
        let mut uses: Vec<(&str, bool)> = Vec::with_capacity(record.len());
        for entry in record {
            let (name, exclusive) = entry_name(entry.as_ref());
            match uses.iter_mut().find(|(n, _)| *n == name) {
                Some(used) => used.1 |= exclusive,
                None => uses.push((name, exclusive)),
            }
        }
        for (name, exclusive) in uses {
            match self.places.get_mut(name) {
                Some(p) => {
                    if p.first.1 != key.1 {
                        p.users = p.users.saturating_add(1);
                        if exclusive || p.first_exclusive.is_some() {
                            p.behind = p.behind.saturating_add(1);
                        }
                    }
                    if exclusive && p.first_exclusive.is_none() {
                        p.first_exclusive = Some(key);
                        holds = true;
                    }
                }
                None => {
                    self.places.insert(
                        name.to_owned(),
                        Places {
                            first: key,
                            first_exclusive: exclusive.then_some(key),
                            behind: 0,
                            users: 1,
                        },
                    );
                    holds = true;
                }
            }
        }
        if lane {
            self.count(class, true);
        }
        if lane || holds {
            self.track(key, Resources::from_record(record), class, lane);
        }
        self.watermark = Some(key);
        self.seen += 1;
    }

    /// Says that the counter must not be maintained: the next pass must read the whole queue
    /// (e.g. a task may still appear behind the watermark).
    pub fn invalidate(&mut self) {
        self.overflowed = true;
    }

    fn track(&mut self, key: Key, resources: Resources, class: Class, lane: bool) {
        // Beyond the limit tracking stops, but what is tracked stays until the counter is
        // dropped: a repair in progress still finds the lanes it tracks (and counts none twice).
        if self.tracked.len() >= self.track_limit {
            self.overflowed = true;
            return;
        }
        self.tracked.insert(
            key.1,
            Tracked {
                created: key.0,
                resources,
                class,
                lane,
            },
        );
    }

    /// Tracked tasks that are no longer incomplete (finished, canceled or deleted): uncounts the
    /// lanes among them and returns the repair of the places they held, to be fed the incomplete
    /// tasks that need its [`Repair::entries`], oldest first, and then passed to
    /// [`LaneCounter::repair`]. Ids that are not tracked are ignored.
    pub fn gone(&mut self, ids: &[TaskId]) -> Repair {
        let mut repair = Repair::default();
        for id in ids {
            let Some(t) = self.tracked.remove(id) else {
                continue;
            };
            if t.lane {
                self.count(t.class, false);
            }
            let key = (t.created, *id);
            let names = t.resources.exclusive.iter().chain(&t.resources.shared);
            for name in names {
                let Some(p) = self.places.get(name) else {
                    continue;
                };
                let first = p.first == key;
                let first_exclusive = p.first_exclusive == Some(key);
                if !first && !first_exclusive {
                    continue;
                }
                let need = repair.needs.entry(name.clone()).or_insert(Need {
                    users: p.users,
                    ..Need::default()
                });
                if first {
                    need.first_after = Some(key);
                }
                if first_exclusive {
                    need.exclusive_after = Some(key);
                }
            }
        }
        repair
    }

    /// Applies a repair fed every incomplete task up to the watermark that needs one of its
    /// resources after the place it repairs: moves the places, then counts the tasks that became
    /// lanes. Feed the tasks newer than the watermark afterwards.
    pub fn repair(&mut self, repair: Repair) {
        for (name, need) in &repair.needs {
            let Some(p) = self.places.get_mut(name) else {
                continue;
            };
            if need.first_after.is_some() {
                match need.first {
                    Some(first) => p.first = first,
                    None => {
                        // No task needs it any more (its exclusive place went with the last).
                        self.places.remove(name);
                        continue;
                    }
                }
            }
            if need.exclusive_after.is_some() {
                p.first_exclusive = need.first_exclusive;
            }
        }
        for (id, (created, resources, class)) in repair.candidates {
            let key = (created, id);
            let lane = self.is_lane(key, &resources);
            let holds = self.holds(key, &resources);
            match self.tracked.get_mut(&id) {
                Some(t) => {
                    let (was, class) = (t.lane, t.class);
                    t.lane = lane;
                    if was != lane {
                        self.count(class, lane);
                    }
                }
                None if lane || holds => {
                    if lane {
                        self.count(class, true);
                    }
                    self.track(key, resources, class, lane);
                }
                None => {}
            }
        }
    }

    /// The rule over the places: first for every exclusive resource, older than the first
    /// exclusive user of every shared one.
    fn is_lane(&self, key: Key, resources: &Resources) -> bool {
        resources
            .exclusive
            .iter()
            .all(|x| self.places.get(x).is_some_and(|p| p.first == key))
            && resources.shared.iter().all(|s| {
                self.places
                    .get(s)
                    .and_then(|p| p.first_exclusive)
                    .is_none_or(|e| e > key)
            })
    }

    fn holds(&self, key: Key, resources: &Resources) -> bool {
        resources
            .exclusive
            .iter()
            .chain(&resources.shared)
            .any(|r| {
                self.places
                    .get(r)
                    .is_some_and(|p| p.first == key || p.first_exclusive == Some(key))
            })
    }

    /// The `n` resources with the most tasks waiting behind their head (most first, then by
    /// name), as counted while the tasks were fed (a repair does not recount them).
    pub fn most_blocked(&self, n: usize) -> Vec<BlockedResource> {
        let mut blocked: Vec<BlockedResource> = self
            .places
            .iter()
            .filter(|(_, p)| p.behind > 0)
            .map(|(name, p)| BlockedResource {
                resource: name.clone(),
                behind: p.behind,
                head: p.first.1,
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
}

/// What one resource's repair looks for.
#[derive(Debug, Clone, Default)]
struct Need {
    /// Its first place was held by this (now gone) task: the next task that needs it takes it.
    first_after: Option<Key>,
    /// Its first exclusive place was held by this task: the next exclusive user takes it, and
    /// the shared users up to that one may have become lanes.
    exclusive_after: Option<Key>,
    first: Option<Key>,
    first_exclusive: Option<Key>,
    /// Users seen when the counter last fed tasks (how a repair should read them).
    users: u32,
}

impl Need {
    fn settled(&self) -> bool {
        (self.first_after.is_none() || self.first.is_some())
            && (self.exclusive_after.is_none() || self.first_exclusive.is_some())
    }
}

/// The places that gone tasks held, and what takes them over: feed it the incomplete tasks that
/// need its resources (at least those newer than [`Repair::from`]), oldest first. A reader may
/// walk the queue for a while (successors are usually near) and then split off the resources
/// still [`Repair::unsettled`] with [`Repair::take`] to feed them from a look-up by name.
#[derive(Debug, Default)]
pub struct Repair {
    needs: Map<String, Need>,
    /// Tasks that took a place or may have become lanes.
    candidates: Map<TaskId, (i64, Resources, Class)>,
}

impl Repair {
    /// True when no place needs repairing.
    pub fn is_empty(&self) -> bool {
        self.needs.is_empty()
    }

    /// The resources being repaired, with how many tasks needed each when last counted.
    pub fn resources(&self) -> impl Iterator<Item = (&str, u32)> + '_ {
        self.needs.iter().map(|(n, need)| (n.as_str(), need.users))
    }

    /// Splits off the repair of the named resources (to be fed from another reader: each part
    /// must see its own resources' users in order); [`Repair::merge`] joins them again.
    pub fn take<'a>(&mut self, names: impl IntoIterator<Item = &'a str>) -> Repair {
        let mut part = Repair::default();
        for name in names {
            if let Some((name, need)) = self.needs.remove_entry(name) {
                part.needs.insert(name, need);
            }
        }
        part
    }

    /// Joins a part split off with [`Repair::take`] after it was fed.
    pub fn merge(&mut self, part: Repair) {
        self.needs.extend(part.needs);
        self.candidates.extend(part.candidates);
    }

    /// The record entries of every task that needs one of the named resources, in any mode
    /// (`r` and `shared:r`), for an overlap look-up: the conflict keys of a task needing them
    /// all exclusively.
    pub fn entries<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        Resources {
            exclusive: names.into_iter().map(str::to_owned).collect(),
            shared: Vec::new(),
        }
        .conflict_keys()
    }

    /// The oldest place being repaired: no task older than it matters.
    pub fn from(&self) -> Option<Key> {
        self.needs
            .values()
            .flat_map(|need| [need.first_after, need.exclusive_after])
            .flatten()
            .min()
    }

    /// The resources that still look for a task to take a place (their shared users up to the
    /// new exclusive one must all be fed too), with how many tasks needed each when last
    /// counted.
    pub fn unsettled(&self) -> impl Iterator<Item = (&str, u32)> + '_ {
        self.needs
            .iter()
            .filter(|(_, need)| !need.settled())
            .map(|(n, need)| (n.as_str(), need.users))
    }

    /// Feeds the next incomplete task (oldest first; tasks that need none of the repaired
    /// resources, or come before the places repaired, are ignored), of the default class.
    pub fn feed<S: AsRef<str>>(&mut self, key: Key, record: &[S]) {
        self.feed_classed(key, record, Class::default());
    }

    /// [`Repair::feed`] for a task of `class`.
    pub fn feed_classed<S: AsRef<str>>(&mut self, key: Key, record: &[S], class: Class) {
        // Most tasks a walk reads need none of the resources repaired: check before parsing.
        if !record
            .iter()
            .any(|e| self.needs.contains_key(entry_name(e.as_ref()).0))
        {
            return;
        }
        let mut candidate = false;
        let resources = Resources::from_record(record);
        let uses = resources
            .exclusive
            .iter()
            .map(|r| (r, true))
            .chain(resources.shared.iter().map(|r| (r, false)));
        for (name, exclusive) in uses {
            let Some(need) = self.needs.get_mut(name.as_str()) else {
                continue;
            };
            if let Some(after) = need.first_after {
                if need.first.is_none() && key > after {
                    need.first = Some(key);
                    candidate = true;
                }
            }
            if let Some(after) = need.exclusive_after {
                if need.first_exclusive.is_none() && key > after {
                    if exclusive {
                        need.first_exclusive = Some(key);
                    }
                    // Shared users before the new exclusive one may be lanes now; the new
                    // exclusive one holds a place.
                    candidate = true;
                }
            }
        }
        if candidate {
            self.candidates.insert(key.1, (key.0, resources, class));
        }
    }
}

#[cfg(test)]
mod tests;
