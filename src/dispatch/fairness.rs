//! Fair dispatch in the fetch pipeline (the rule itself is `crate::fair`).
//!
//! A pass in queue order hands out the oldest ready task. When several groups wait (or an
//! immediate task does), a fetch first makes *directed passes*: a page of the immediate tasks,
//! then a page of each group in the order [`Rules::order`] gives, reading through
//! `dispatch_groups_idx` / `dispatch_immediate_idx` at most a few pages' rows each, however long
//! the others' queues are. The first ready task found goes to the caller; the readiness rule and
//! the acquire script decide it as for any grant. When no directed page holds one (their heads
//! wait on older tasks), the pass in queue order runs as before, so fairness never leaves a
//! ready task idle. A group whose page held nothing ready is *dry* until the next directory
//! read, so a fetch does not re-read it.
//!
//! The *directory* (which groups have waiting tasks, each with its oldest; whether an immediate
//! task waits) is read by each replica every `--fair-refresh` (groups_waiting.sql: a skip scan,
//! one index descent per group), every eighth while fair dispatch is not engaged, and at once on
//! a task notification. A group that starts waiting is served by the pass in queue order
//! until the next read. The policy file is read at the same pace and applied when it changed; a
//! file that cannot be used is refused with the line named, and the policy in force stays.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::fair::{FairBy, Group, Overrides, Policy, Rules, Standing};
use crate::ids::TaskId;
use crate::locks::Admission;
use crate::metrics::Stats;
use crate::ready::Class;
use crate::shutdown::Shutdown;
use crate::tasks::{Directed, TaskRow, Tasks};

/// Groups a fetch makes directed passes for, at most (after the express lane).
pub const MAX_DIRECTED: usize = 3;

/// Groups the directory reads at most.
pub const MAX_GROUPS: i64 = 10_000;

/// Fair dispatch's settings (`--fair-*`).
#[derive(Debug, Clone)]
pub struct FairSettings {
    /// What tasks are grouped by.
    pub by: FairBy,
    /// The policy file, if any.
    pub policy_file: Option<PathBuf>,
    /// How often the directory and the policy file are read.
    pub refresh: Duration,
    /// Groups that get a label of their own in `dispatch_task_wait_seconds` (the rest: `other`).
    pub metric_groups: usize,
}

/// Where the policy in force came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// No policy file: equal weights, no caps, no reserve.
    Default,
    /// The policy file, as last read.
    File,
}

impl Source {
    /// As the admin API names it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Source::Default => "default",
            Source::File => "file",
        }
    }
}

/// One group as the operator sees it (admin `Fairness`).
#[derive(Debug, Clone, PartialEq)]
pub struct GroupView {
    /// The group's id (`pulp_domain_id`).
    pub group: Group,
    /// The domain's name, when known.
    pub name: Option<String>,
    /// Its weight.
    pub weight: f64,
    /// Its cap.
    pub cap: Option<u32>,
    /// Its tasks holding locks now (every replica).
    pub running: u32,
    /// Whether it has waiting tasks (as of the last directory read).
    pub waiting: bool,
    /// Its share of the workers by weight, among the groups listed (running, waiting or named
    /// by the policy).
    pub share: f64,
}

#[derive(Debug)]
struct State {
    policy: Policy,
    source: Source,
    /// The hash of the policy file's text in force (0: no file): the base of the overrides.
    base: u64,
    /// The policy file as last read: its text's hash, or `None` when it could not be read.
    file_seen: Option<Option<u64>>,
    /// The overrides made at run time, as last read from Redis (made only over `base`).
    overrides: Overrides,
    names: HashMap<Group, String>,
    rules: Rules,
    /// The fair indexes exist: directed passes can read flat.
    directed: bool,
    directory: Directory,
    /// When the directory was last read.
    read_at: Option<Instant>,
    immediate_waiting: bool,
    dry: HashSet<Directed>,
}

/// A queue position: a task's (pulp_created, pulp_id).
pub(super) type Position = (DateTime<Utc>, TaskId);

/// The groups with waiting tasks, as the directory read them and fetches learned since: each
/// with its oldest waiting task's position, and those not dry in that order, so that a fetch
/// finds the first groups of the fair order without looking at every group
/// ([`Rules::first_in_order`]).
#[derive(Debug, Default)]
struct Directory {
    /// Every group with waiting tasks, with its oldest waiting task's position.
    oldest: HashMap<Group, Position>,
    /// The groups not dry, by their oldest waiting task's position.
    open: BTreeSet<(Position, Group)>,
}

impl Directory {
    /// As read (every group open).
    fn read(waiting: Vec<(Group, Position)>) -> Self {
        Directory {
            open: waiting.iter().map(|(g, p)| (*p, *g)).collect(),
            oldest: waiting.into_iter().collect(),
        }
    }

    fn len(&self) -> usize {
        self.oldest.len()
    }

    fn contains(&self, group: &Group) -> bool {
        self.oldest.contains_key(group)
    }

    /// An open group's oldest waiting task's position (`None`: not waiting, or dry).
    fn open_at(&self, group: &Group) -> Option<Position> {
        let at = *self.oldest.get(group)?;
        self.open.contains(&(at, *group)).then_some(at)
    }

    /// The group is dry until the next read.
    fn close(&mut self, group: &Group) {
        if let Some(at) = self.oldest.get(group) {
            self.open.remove(&(*at, *group));
        }
    }

    /// A fetch handed out the group's task at `at`: its oldest waiting task is now at `next`, or,
    /// `None`, it has none left that this replica knows of (until the next read).
    fn advance(&mut self, group: &Group, at: Position, next: Option<Position>) {
        let Some(oldest) = self.oldest.get(group).copied() else {
            return;
        };
        if oldest > at {
            // Read since: the read knows better.
            return;
        }
        let was_open = self.open.remove(&(oldest, *group));
        match next {
            Some(next) => {
                self.oldest.insert(*group, next);
                if was_open {
                    self.open.insert((next, *group));
                }
            }
            None => {
                self.oldest.remove(group);
            }
        }
    }
}

/// The carried tasks of a directed page: its rest past the task a fetch handed out from it, or a
/// page read ahead, kept for the next directed pass of the same group (or of the immediate
/// tasks) to judge instead of reading them again, while younger than `--fetch-hint-max-age` (and
/// a second). Their exact look-ups stay true as those of a pass in queue order do
/// (`super::carried::Carried`): no older
/// conflicting task can appear later, and what made one unready since (a lock taken, the task
/// claimed, canceled or finished) is caught by the acquire script and the claim. What they
/// cannot show is what made a task ready since: a task of the group that a held lock hid from
/// the page, or a claim put back, goes after them until they are used or too old; FIFO per
/// resource holds (such a task conflicts with none of them, or their look-ups name it).
#[derive(Debug)]
pub(super) struct Carried {
    /// In queue order.
    pub(super) rows: Vec<TaskRow>,
    /// The page held every waiting task of its group as of the read (`Page::whole`).
    pub(super) whole: bool,
    /// When the page was read.
    pub(super) read_at: Instant,
}

#[derive(Debug, Default)]
struct CarriedPages {
    by_page: HashMap<Directed, Carried>,
    /// Kept until there are this many; then those too old are dropped.
    prune_at: usize,
}

/// Fair dispatch's state on one replica.
#[derive(Debug, Clone)]
pub struct Fairness {
    by: FairBy,
    state: Arc<RwLock<State>>,
    carried: Arc<Mutex<CarriedPages>>,
    labels: Arc<std::sync::Mutex<HashMap<Group, String>>>,
    max_labels: usize,
    inserted: Arc<tokio::sync::Notify>,
}

/// What fair dispatch makes of one fetch before the pass in queue order (see
/// [`Fairness::plan`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// The directed passes, in order.
    pub directed: Vec<Directed>,
    /// The groups next in the fair order after those of the directed passes, up to
    /// [`crate::tasks::READ_AHEAD`]: a page read for a group reads theirs ahead.
    pub ahead: Vec<Group>,
    /// Nothing the pass in queue order could grant: every deferred task is held back by the
    /// reserve, or every waiting group is at its cap. The fetch waits for a change instead.
    pub skip_queue_order: bool,
}

impl Fairness {
    /// Fairness with `policy` in force (read from a file whose text hashes to `base`, or 0);
    /// `directed` when the fair indexes exist.
    pub fn new(by: FairBy, policy: Policy, source: Source, base: u64, directed: bool) -> Self {
        let rules = policy.resolve(&HashMap::new());
        Fairness {
            by,
            state: Arc::new(RwLock::new(State {
                policy,
                source,
                base,
                file_seen: None,
                overrides: Overrides::default(),
                names: HashMap::new(),
                rules,
                directed,
                directory: Directory::default(),
                read_at: None,
                immediate_waiting: false,
                dry: HashSet::new(),
            })),
            carried: Arc::new(Mutex::new(CarriedPages::default())),
            labels: Arc::new(std::sync::Mutex::new(HashMap::new())),
            max_labels: 20,
            inserted: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// Gives the first `n` groups seen a metric label of their own.
    pub fn with_metric_groups(mut self, n: usize) -> Self {
        self.max_labels = n;
        self
    }

    /// A group's metric label: its domain's name (or id) for the first groups seen, `other` for
    /// the rest, so a fleet of 10,000 domains does not make 10,000 series.
    pub fn label(&self, group: Group) -> String {
        let Ok(mut labels) = self.labels.lock() else {
            return "other".into();
        };
        if let Some(label) = labels.get(&group) {
            return label.clone();
        }
        if labels.len() >= self.max_labels {
            return "other".into();
        }
        let label = self
            .read()
            .names
            .get(&group)
            .cloned()
            .unwrap_or_else(|| group.to_string());
        labels.insert(group, label.clone());
        label
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// A task's group, from its domain and task group (`fair::group_of`).
    pub fn group_of(&self, domain: Uuid, task_group: Option<Uuid>) -> Group {
        crate::fair::group_of(self.by, domain, task_group)
    }

    /// A waiting task's group.
    pub fn group_of_row(&self, row: &crate::tasks::TaskRow) -> Group {
        self.group_of(row.domain, row.task_group)
    }

    /// What the acquire script checks for a task of `group`.
    pub fn admission(&self, group: Group, immediate: bool) -> Admission {
        let state = self.read();
        Admission {
            group,
            immediate,
            cap: match self.by {
                FairBy::None => None,
                FairBy::Domain | FairBy::TaskGroup => state.rules.cap(&group),
            },
            reserve: state.rules.reserve,
        }
    }

    /// The directed page of one group's tasks, under this grouping.
    pub(super) fn directed_group(&self, group: Group) -> Directed {
        match self.by {
            FairBy::TaskGroup => Directed::TaskGroup(group),
            FairBy::None | FairBy::Domain => Directed::Group(group),
        }
    }

    /// The lane gauge's count from the lanes by class (`ready::LaneCounter::lanes_by_class`)
    /// and what holds locks now, under the caps and the reserve in force (`fair::Rules::lanes`;
    /// no caps under `--fair-by none`).
    pub fn lanes(
        &self,
        by_class: impl IntoIterator<Item = (Class, u64)>,
        standing: &Standing,
    ) -> u64 {
        let state = self.read();
        let lanes = by_class
            .into_iter()
            .map(|(c, n)| (self.group_of(c.domain, c.task_group), c.immediate, n));
        match self.by {
            FairBy::None => Rules {
                default_weight: state.rules.default_weight,
                reserve: state.rules.reserve,
                by_group: HashMap::new(),
            }
            .lanes(lanes, standing),
            FairBy::Domain | FairBy::TaskGroup => state.rules.lanes(lanes, standing),
        }
    }

    /// What the operator calls a group: `domain`, `task group`, or `group` (one for all).
    pub fn group_word(&self) -> &'static str {
        match self.by {
            FairBy::Domain => "domain",
            FairBy::TaskGroup => "task group",
            FairBy::None => "group",
        }
    }

    /// What tasks are grouped by.
    pub fn by(&self) -> FairBy {
        self.by
    }

    /// Whether fair dispatch's indexes exist (directed passes can be made).
    pub fn directed(&self) -> bool {
        self.read().directed
    }

    /// A group's domain name, or its id where no name is known.
    pub fn name_of(&self, group: Group) -> String {
        self.read()
            .names
            .get(&group)
            .cloned()
            .unwrap_or_else(|| group.to_string())
    }

    /// The rules in force.
    pub fn rules(&self) -> Rules {
        self.read().rules.clone()
    }

    /// The policy in force and where it came from.
    pub fn policy(&self) -> (Policy, Source) {
        let state = self.read();
        (state.policy.clone(), state.source.clone())
    }

    /// Notified on every task notification: the directory is read again at once.
    pub fn insert_signal(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.inserted)
    }

    /// Whether a fetch needs the standing (what holds locks) before its passes: directed passes
    /// are made, or a cap or the reserve may hold tasks back.
    pub fn needs_standing(&self) -> bool {
        let state = self.read();
        self.engaged_in(&state) || state.rules.reserve > 0 || state.rules.has_caps()
    }

    fn engaged_in(&self, state: &State) -> bool {
        self.by != FairBy::None
            && state.directed
            && (state.immediate_waiting || state.directory.len() > 1)
    }

    /// Whether fetches make directed passes now (several domains, or an immediate task, wait),
    /// so passes in queue order serve only their own caller.
    pub fn engaged(&self) -> bool {
        self.engaged_in(&self.read())
    }

    /// What a fetch does before (or instead of) the pass in queue order, given what holds locks
    /// now: the immediate tasks' page first, then the groups' pages in the fair order (none of
    /// them while the reserve holds every deferred task back), and whether the pass in queue
    /// order may be left out because nothing it meets could be granted.
    pub fn plan(&self, standing: &Standing) -> Plan {
        let state = self.read();
        let deferred_held = matches!(
            state.rules.holds_back(standing, &Uuid::nil(), false),
            Some(crate::fair::HeldBack::Reserve { .. })
        );
        let all_capped = self.by != FairBy::None
            && state.directed
            && state.directory.len() > 0
            && state.all_capped(standing);
        let mut plan = Plan {
            directed: Vec::new(),
            ahead: Vec::new(),
            // The directory may be a read behind: an immediate task it does not know yet is
            // found once it is read (a task notification has it read at once).
            // (Never under `--fair-by none`: without the immediate tasks' page, the pass in
            // queue order is what finds them.)
            skip_queue_order: self.engaged_in(&state)
                && (deferred_held || (all_capped && !state.immediate_waiting)),
        };
        if !self.engaged_in(&state) {
            return plan;
        }
        if state.immediate_waiting && !state.dry.contains(&Directed::Immediate) {
            plan.directed.push(Directed::Immediate);
        }
        if state.directory.len() > 1 && !deferred_held {
            let mut first = state.rules.first_in_order(
                standing,
                state.directory.open.iter().copied(),
                |g| state.directory.open_at(g),
                MAX_DIRECTED + crate::tasks::READ_AHEAD,
            );
            plan.ahead = first.split_off(first.len().min(MAX_DIRECTED));
            plan.directed
                .extend(first.into_iter().map(|g| self.directed_group(g)));
        }
        plan
    }

    /// The rest of `directed`'s last page, when younger than `max_age` (taken: one pass judges
    /// it).
    pub(super) fn take_carried(&self, directed: Directed, max_age: Duration) -> Option<Carried> {
        let mut carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
        carried
            .by_page
            .remove(&directed)
            .filter(|l| l.read_at.elapsed() <= max_age)
    }

    /// Whether `directed`'s page has a rest younger than `max_age` (a read needs not read it
    /// ahead).
    pub(super) fn has_carried(&self, directed: Directed, max_age: Duration) -> bool {
        let carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
        carried
            .by_page
            .get(&directed)
            .is_some_and(|l| l.read_at.elapsed() <= max_age)
    }

    /// Keeps the rest of `directed`'s page for the next pass (those older than `max_age` are
    /// dropped now and then).
    pub(super) fn carry(&self, directed: Directed, rest: Carried, max_age: Duration) {
        let mut carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
        carried.by_page.insert(directed, rest);
        if carried.by_page.len() >= carried.prune_at {
            carried
                .by_page
                .retain(|_, l| l.read_at.elapsed() <= max_age);
            carried.prune_at = (carried.by_page.len() * 2).max(64);
        }
    }

    /// A directed pass handed out the task at `at` from `directed`'s page, read at `read_at`:
    /// the group's oldest waiting task is now at `next` (the oldest of the page's tasks not
    /// handed out), or, with none and a `whole` page, the group (or the immediate tasks) has
    /// none left that this replica knows of until the next directory read (unless the directory
    /// was read after the page: it knows better). The fair order follows without a read.
    pub(super) fn handed_out(
        &self,
        directed: Directed,
        at: Position,
        next: Option<Position>,
        whole: bool,
        read_at: Instant,
    ) {
        if next.is_none() && !whole {
            return;
        }
        let mut state = self.write();
        if next.is_none() && state.read_at.is_some_and(|r| r > read_at) {
            return;
        }
        match directed.group() {
            Some(g) => state.directory.advance(&g, at, next),
            None if next.is_none() => {
                state.dry.insert(Directed::Immediate);
            }
            None => {}
        }
    }

    /// A directed page held nothing ready: skip it until the next directory read.
    pub fn dry(&self, directed: Directed) {
        let mut state = self.write();
        if let Some(g) = directed.group() {
            state.directory.close(&g);
        }
        state.dry.insert(directed);
    }

    /// Puts `policy` in force, read from a file whose text hashes to `base` (0: none).
    pub fn set_policy(&self, policy: Policy, source: Source, base: u64) {
        let mut state = self.write();
        if state.base != base && !state.overrides.is_empty() && state.overrides.base != base {
            tracing::warn!("the overrides made at run time no longer apply: the policy file changed; `dispatch-broker fairness reset` drops them");
        }
        state.policy = policy;
        state.source = source;
        state.base = base;
        state.resolve();
    }

    /// Puts the overrides read from Redis in force (over the policy file they were made
    /// against only); says whether they differ from those in force.
    pub fn set_overrides(&self, overrides: Overrides) -> bool {
        if self.read().overrides == overrides {
            return false;
        }
        let mut state = self.write();
        if !overrides.is_empty() && overrides.base != state.base {
            tracing::warn!("overrides made at run time over another policy file are kept in redis and not applied; `dispatch-broker fairness reset` drops them");
        }
        state.overrides = overrides;
        state.resolve();
        true
    }

    /// The base of overrides made now: the hash of the policy file's text in force (0: none).
    pub fn base(&self) -> u64 {
        self.read().base
    }

    /// The overrides kept, each in words; those made over another policy file, which are not
    /// applied, say so.
    pub fn overrides(&self) -> Vec<String> {
        let state = self.read();
        let lines = state.overrides.describe(|g| {
            state
                .names
                .get(&g)
                .cloned()
                .unwrap_or_else(|| g.to_string())
        });
        if state.overrides.base == state.base {
            return lines;
        }
        lines
            .into_iter()
            .map(|l| format!("not applied (made over another policy file): {l}"))
            .collect()
    }

    /// Takes the domains' names as read now (an operator named one this replica has not seen).
    pub fn learn_names(&self, names: HashMap<Group, String>) {
        let mut state = self.write();
        state.names = names;
        state.resolve();
    }

    /// A domain named by its name (Pulp's `core_domain.name`) or id, as the directory knows
    /// it; `None` for a name it does not know.
    pub fn domain_named(&self, name_or_id: &str) -> Option<Group> {
        if let Ok(id) = name_or_id.parse() {
            return Some(id);
        }
        self.read()
            .names
            .iter()
            .find(|(_, n)| n.as_str() == name_or_id)
            .map(|(g, _)| *g)
    }

    /// Every group running or waiting, for the operator.
    pub fn view(&self, standing: &Standing) -> Vec<GroupView> {
        let state = self.read();
        let waiting: HashSet<Group> = state.directory.oldest.keys().copied().collect();
        let groups: HashSet<Group> = standing
            .running
            .keys()
            .chain(&waiting)
            .chain(state.rules.by_group.keys())
            .copied()
            .collect();
        let total_weight: f64 = groups.iter().map(|g| state.rules.weight(g)).sum();
        let mut view: Vec<GroupView> = groups
            .into_iter()
            .map(|g| GroupView {
                group: g,
                name: state.names.get(&g).cloned(),
                weight: state.rules.weight(&g),
                cap: state.rules.cap(&g),
                running: standing.running_of(&g),
                waiting: waiting.contains(&g),
                share: if total_weight > 0.0 {
                    state.rules.weight(&g) / total_weight
                } else {
                    0.0
                },
            })
            .collect();
        view.sort_by(|a, b| b.running.cmp(&a.running).then(a.group.cmp(&b.group)));
        view
    }

    /// Reads the directory (and, when unknown groups appear, the domains' names); true when a
    /// group started waiting or an immediate task did, or a dry page may be read again.
    pub async fn refresh(&self, tasks: &Tasks) -> Result<bool, crate::tasks::Error> {
        // A policy naming a domain by a name not resolved yet: the names are read (caps by name
        // hold with or without the fair indexes).
        if self.unresolved_names() {
            let names = tasks.domain_names().await?;
            let mut state = self.write();
            state.names = names;
            state.resolve();
        }
        let directed = self.read().directed;
        if !directed {
            return Ok(false);
        }
        let read_at = Instant::now();
        let (waiting, immediate_waiting) = tasks.groups_waiting(self.by, MAX_GROUPS).await?;
        // Names are domains' (task groups have none).
        let unknown = self.by == FairBy::Domain && {
            let state = self.read();
            waiting.iter().any(|(g, _)| !state.names.contains_key(g))
        };
        let names = if unknown {
            Some(tasks.domain_names().await?)
        } else {
            None
        };
        let news = {
            let state = self.read();
            !state.dry.is_empty()
                || (immediate_waiting && !state.immediate_waiting)
                || waiting.iter().any(|(g, _)| !state.directory.contains(g))
        };
        // Built before the lock is taken: fetches plan meanwhile.
        let directory = Directory::read(waiting);
        let mut state = self.write();
        if let Some(names) = names {
            state.names = names;
            state.resolve();
        }
        state.directory = directory;
        state.read_at = Some(read_at);
        state.immediate_waiting = immediate_waiting;
        state.dry.clear();
        // Only news to fair dispatch: a fetch in queue order finds what it needs without.
        Ok(news && self.engaged_in(&state))
    }

    /// Whether the policy names a domain by a name not known yet.
    fn unresolved_names(&self) -> bool {
        let state = self.read();
        self.by == FairBy::Domain
            && state
                .policy
                .groups
                .keys()
                .any(|k| k.parse::<Uuid>().is_err() && !state.names.values().any(|n| n == k))
    }

    /// Reads the policy file if it changed since the last read; refuses a file that cannot be
    /// used (logged with the line, counted), keeping the policy in force.
    pub fn reload(&self, path: &std::path::Path, stats: &Stats) {
        // What was last read: the text's hash, or `None` for a file that could not be read.
        let seen = std::fs::read_to_string(path).map(|text| (hash(&text), text));
        let now = seen.as_ref().ok().map(|(h, _)| *h);
        if self.read().file_seen == Some(now) {
            return;
        }
        self.write().file_seen = Some(now);
        let (base, text) = match seen {
            Ok(seen) => seen,
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot read the fairness policy file; the policy in force stays");
                stats.policy_refused();
                return;
            }
        };
        match Policy::parse(&text) {
            Ok(policy) => {
                let changed = {
                    let state = self.read();
                    state.policy != policy || state.source != Source::File || state.base != base
                };
                if changed {
                    tracing::info!(path = %path.display(), groups = policy.groups.len(), reserve = policy.reserve, "fairness policy read");
                    self.set_policy(policy, Source::File, base);
                }
            }
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "fairness policy refused; the policy in force stays");
                stats.policy_refused();
            }
        }
    }

    /// Reads the directory and the policy file every `settings.refresh`, and the directory
    /// again on every task notification (at most every 20 ms), until shutdown. A read that finds
    /// a group newly waiting, or an immediate task, wakes a waiting fetch to serve it.
    pub async fn run(
        self,
        tasks: Tasks,
        settings: FairSettings,
        stats: Arc<Stats>,
        waiters: Arc<super::Queue>,
        locks: crate::locks::Locks,
        shutdown: Shutdown,
    ) {
        let mut labelled: Vec<String> = Vec::new();
        let mut tick = tokio::time::interval(settings.refresh);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Ticks since the directory was last read (the first tick reads it).
        let mut ticks = IDLE_READ_EVERY - 1;
        loop {
            let notified = tokio::select! {
                _ = tick.tick() => {
                    if let Some(path) = &settings.policy_file {
                        self.reload(path, &stats);
                    }
                    match locks.fair_overrides().await {
                        Ok(fields) => {
                            if self.set_overrides(Overrides::from_fields(&fields)) {
                                tracing::info!(overrides = ?self.overrides(), "fairness overrides read");
                                // A cap lifted or a reserve lowered may free a waiting task.
                                waiters.wake();
                            }
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "fair dispatch could not read the overrides");
                        }
                    }
                    false
                }
                () = self.inserted.notified() => true,
                () = shutdown.fired() => return,
            };
            ticks = ticks.saturating_add(1);
            if read_due(notified, self.engaged(), ticks) {
                ticks = 0;
                // A notification woke a waiting fetch already, perhaps before this read: one is
                // woken again when the read shows what fair dispatch did not know (a domain or an
                // immediate task newly waiting, or a page that was dry).
                match self.refresh(&tasks).await {
                    Ok(true) => waiters.wake(),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "fair dispatch could not read which groups wait");
                    }
                }
            }
            if self.by != FairBy::None {
                if let Ok(standing) = locks.standing().await {
                    let mut running: std::collections::BTreeMap<String, u32> = Default::default();
                    for (group, n) in &standing.running {
                        *running.entry(self.label(*group)).or_default() += n;
                    }
                    for label in running.keys() {
                        if !labelled.contains(label) {
                            labelled.push(label.clone());
                        }
                    }
                    stats.groups_running(&running, &labelled);
                }
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
                () = shutdown.fired() => return,
            }
        }
    }
}

/// While fair dispatch is not engaged (one group or none waits, no immediate task), the
/// directory is read on every task notification and every this many ticks of `--fair-refresh`
/// (a group that starts waiting is notified: its insert's notification has the directory read
/// at once).
pub const IDLE_READ_EVERY: u32 = 8;

/// Whether a tick (or a task notification, `notified`) has the directory read: always while
/// fair dispatch is `engaged` or on a notification, else every [`IDLE_READ_EVERY`]-th tick
/// (`ticks` since the last read, this one included).
pub fn read_due(notified: bool, engaged: bool, ticks: u32) -> bool {
    notified || engaged || ticks >= IDLE_READ_EVERY
}

/// A policy file text's hash: the same on every replica and every version (the base of the
/// overrides made over it).
pub fn hash(text: &str) -> u64 {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(text.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    // Never 0, which stands for "no file".
    u64::from_be_bytes(first).max(1)
}

impl State {
    /// Whether every waiting group holds as many task locks as its cap. Only the groups
    /// holding locks and those capped at 0 can: the others are not looked at one by one when
    /// there are more waiting groups than those.
    fn all_capped(&self, standing: &Standing) -> bool {
        let may_be = standing.running.values().filter(|r| **r > 0).count()
            + self
                .rules
                .by_group
                .values()
                .filter(|r| r.cap == Some(0))
                .count();
        self.directory.len() <= may_be
            && self
                .directory
                .oldest
                .keys()
                .all(|g| self.rules.at_cap(standing, g))
    }

    /// The rules from the policy, the domains' names and the overrides (when made over this
    /// policy file).
    fn resolve(&mut self) {
        let mut rules = self.policy.resolve(&self.names);
        if self.overrides.base == self.base {
            self.overrides.apply(&mut rules);
        }
        self.rules = rules;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(second: i64, id: u128) -> Position {
        (
            DateTime::from_timestamp(second, 0).unwrap(),
            TaskId(Uuid::from_u128(id)),
        )
    }

    fn g(n: u128) -> Group {
        Uuid::from_u128(n)
    }

    fn open(d: &Directory) -> Vec<Group> {
        d.open.iter().map(|(_, g)| *g).collect()
    }

    #[test]
    fn the_directory_is_read_on_every_tick_while_engaged_and_every_eighth_else() {
        assert!(read_due(false, true, 1));
        assert!(read_due(true, false, 1));
        let idle: Vec<bool> = (1..=9).map(|t| read_due(false, false, t)).collect();
        assert_eq!(
            idle,
            [false, false, false, false, false, false, false, true, true]
        );
    }

    #[test]
    fn the_directory_keeps_open_groups_by_their_oldest_task() {
        let mut d = Directory::read(vec![
            (g(1), at(30, 1)),
            (g(2), at(10, 2)),
            (g(3), at(20, 3)),
        ]);
        assert_eq!(open(&d), [g(2), g(3), g(1)]);
        // Dry: still waiting, no longer open.
        d.close(&g(3));
        assert_eq!(open(&d), [g(2), g(1)]);
        assert_eq!(d.len(), 3);
        assert_eq!(d.open_at(&g(3)), None);
        assert_eq!(d.open_at(&g(2)), Some(at(10, 2)));
        // A task handed out: the group's next task is its oldest.
        d.advance(&g(2), at(10, 2), Some(at(40, 4)));
        assert_eq!(open(&d), [g(1), g(2)]);
        assert_eq!(d.open_at(&g(2)), Some(at(40, 4)));
        // A dry group stays closed when it moves on.
        d.advance(&g(3), at(20, 3), Some(at(50, 5)));
        assert_eq!(d.open_at(&g(3)), None);
        assert!(d.contains(&g(3)));
        // None left: no longer waiting.
        d.advance(&g(1), at(30, 1), None);
        assert!(!d.contains(&g(1)));
        assert_eq!(open(&d), [g(2)]);
    }

    #[test]
    fn a_read_since_the_page_knows_better_than_the_page() {
        let mut d = Directory::read(vec![(g(1), at(30, 1))]);
        // The page was read before the task at 30 became the oldest: its grant at 20 is old news.
        d.advance(&g(1), at(20, 9), None);
        assert_eq!(d.open_at(&g(1)), Some(at(30, 1)));
    }

    #[test]
    fn the_plan_directs_the_first_groups_of_the_fair_order_among_many() {
        let fairness = Fairness::new(FairBy::Domain, Policy::default(), Source::Default, 0, true);
        let waiting: Vec<(Group, Position)> =
            (1..=10_000u128).map(|n| (g(n), at(n as i64, n))).collect();
        fairness.write().directory = Directory::read(waiting);
        // Groups 1 and 2 hold locks: the idle groups with the oldest tasks go first.
        let standing = Standing {
            running: [(g(1), 1), (g(2), 1)].into_iter().collect(),
            deferred: 2,
            live_leases: 4,
        };
        let plan = fairness.plan(&standing);
        assert_eq!(
            plan.directed,
            [3, 4, 5].map(|n| Directed::Group(g(n))).to_vec()
        );
        fairness.dry(Directed::Group(g(4)));
        assert_eq!(
            fairness.plan(&standing).directed,
            [3, 5, 6].map(|n| Directed::Group(g(n))).to_vec()
        );
    }
}
