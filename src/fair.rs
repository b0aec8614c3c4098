//! Fair dispatch across groups: which *ready* task a lease gets when several groups wait, and
//! which ready tasks must wait for a cap or the reserve. Pure: no I/O.
//!
//! The readiness rule (`ready`) is untouched: it decides whether a task may run at all, and FIFO
//! per resource holds. This rule only orders the ready tasks (docs/design.md, "Fair dispatch"):
//!
//! - A task's **group** is its `core_task.pulp_domain_id` (`--fair-by domain`, the default), its
//!   `core_task.task_group_id` (`--fair-by task-group`; tasks of no task group are one group), or
//!   one group for every task (`--fair-by none`: plain FIFO).
//! - A group's **usage** is the number of its tasks that hold locks now (claimed or running, on
//!   any replica: Redis counts them), divided by its **weight** (1 unless the policy says).
//! - **Immediate** tasks (Pulp's `immediate`) go first among ready tasks. Then the group with the
//!   lowest usage goes first; on a tie, the group whose oldest waiting task is oldest. Within a
//!   group, the oldest ready task, as without fairness.
//! - A group at its **cap** (at most N tasks holding locks at once) gets nothing until one of its
//!   tasks ends; other groups are not held up by it. A **deferred** (not immediate) task is not
//!   handed out while deferred tasks hold at least `live leases - reserve` task locks: that much
//!   capacity stays free for immediate tasks.
//!
//! With one group, no cap and no reserve, the order is plain FIFO. The caps and the reserve are
//! enforced atomically by the acquire script, so two replicas never exceed a cap together; this
//! module's [`Rules::holds_back`] says the same in words for ExplainTask.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::Deserialize;
use uuid::Uuid;

/// What fairness groups tasks by (`--fair-by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FairBy {
    /// Every task in one group: plain FIFO among ready tasks (no express lane; caps and weights
    /// do not apply; the reserve still does).
    None,
    /// Pulp's domain (`core_task.pulp_domain_id`).
    #[default]
    Domain,
    /// Pulp's task group (`core_task.task_group_id`); the tasks of no task group are one group
    /// (the nil id). The policy names task groups by id.
    TaskGroup,
}

/// A task's group under `by`, from its domain and task group (the one place the key is chosen).
pub fn group_of(by: FairBy, domain: Uuid, task_group: Option<Uuid>) -> Group {
    match by {
        FairBy::None => Uuid::nil(),
        FairBy::Domain => domain,
        FairBy::TaskGroup => task_group.unwrap_or_else(Uuid::nil),
    }
}

/// A group: a domain's `pulp_id` (the nil id is the one group of `--fair-by none`).
pub type Group = Uuid;

/// What the policy says of one group.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Rule {
    /// Its weight (`None`: the default weight).
    pub weight: Option<f64>,
    /// At most this many of its tasks hold locks at once (`None`: no cap).
    pub cap: Option<u32>,
}

/// The policy as written: groups by domain name or id.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// The weight of a group the policy does not name.
    pub default_weight: f64,
    /// Leases' worth of capacity kept for immediate tasks.
    pub reserve: u32,
    /// Rules by domain name (Pulp's `core_domain.name`) or by id (its `pulp_id`).
    pub groups: BTreeMap<String, Rule>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            default_weight: 1.0,
            reserve: 0,
            groups: BTreeMap::new(),
        }
    }
}

/// A policy file that cannot be used, with the line it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BadPolicy {
    /// The 1-based line the problem is on (`None`: the file as a whole).
    pub line: Option<usize>,
    /// What is wrong, naming the line, and what to write instead.
    pub message: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    default_weight: Option<toml::Spanned<toml::Value>>,
    reserve: Option<toml::Spanned<toml::Value>>,
    groups: Option<BTreeMap<String, GroupFile>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupFile {
    weight: Option<toml::Spanned<toml::Value>>,
    cap: Option<toml::Spanned<toml::Value>>,
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

impl Policy {
    /// Reads a policy file (TOML, see docs/configuration.md "The fairness policy"). Refuses an
    /// unknown key, a weight that is not a positive number, a cap or reserve that is not a whole
    /// number of at least zero, naming the line.
    pub fn parse(text: &str) -> Result<Policy, BadPolicy> {
        let file: PolicyFile = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| line_of(text, s.start));
            let message = e.message().trim_end().to_owned();
            BadPolicy {
                line,
                message: match line {
                    Some(line) => format!("line {line}: {message}"),
                    None => message,
                },
            }
        })?;
        let bad = |span: std::ops::Range<usize>, what: String| {
            let line = line_of(text, span.start);
            BadPolicy {
                line: Some(line),
                message: format!("line {line}: {what}"),
            }
        };
        let weight = |v: &toml::Spanned<toml::Value>, key: &str| -> Result<f64, BadPolicy> {
            let w = match v.get_ref() {
                toml::Value::Integer(i) => *i as f64,
                toml::Value::Float(f) => *f,
                other => {
                    return Err(bad(
                        v.span(),
                        format!("{key} must be a number above 0, not a {}", other.type_str()),
                    ))
                }
            };
            if w.is_finite() && w > 0.0 {
                Ok(w)
            } else {
                Err(bad(
                    v.span(),
                    format!("{key} must be a number above 0, not {w}"),
                ))
            }
        };
        let count = |v: &toml::Spanned<toml::Value>, key: &str| -> Result<u32, BadPolicy> {
            match v.get_ref() {
                toml::Value::Integer(i) => u32::try_from(*i).map_err(|_| {
                    bad(
                        v.span(),
                        format!(
                            "{key} must be a whole number from 0 to {}, not {i}",
                            u32::MAX
                        ),
                    )
                }),
                other => Err(bad(
                    v.span(),
                    format!(
                        "{key} must be a whole number of at least 0, not a {}",
                        other.type_str()
                    ),
                )),
            }
        };
        let mut policy = Policy::default();
        if let Some(w) = &file.default_weight {
            policy.default_weight = weight(w, "default_weight")?;
        }
        if let Some(r) = &file.reserve {
            policy.reserve = count(r, "reserve")?;
        }
        for (name, g) in file.groups.unwrap_or_default() {
            let rule = Rule {
                weight: g
                    .weight
                    .as_ref()
                    .map(|w| weight(w, &format!("groups.\"{name}\".weight")))
                    .transpose()?,
                cap: g
                    .cap
                    .as_ref()
                    .map(|c| count(c, &format!("groups.\"{name}\".cap")))
                    .transpose()?,
            };
            if name.trim().is_empty() {
                return Err(BadPolicy {
                    line: None,
                    message: "a group needs a name: [groups.\"<domain name or id>\"]".into(),
                });
            }
            policy.groups.insert(name, rule);
        }
        Ok(policy)
    }

    /// The rules by group id, given the domains' names (`names`: id -> name). A group named in
    /// the policy both by name and by id takes the entry by id.
    pub fn resolve(&self, names: &HashMap<Group, String>) -> Rules {
        let mut by_group: HashMap<Group, Rule> = HashMap::new();
        let by_name: HashMap<&str, Group> = names.iter().map(|(g, n)| (n.as_str(), *g)).collect();
        for (key, rule) in &self.groups {
            if let Some(g) = by_name.get(key.as_str()) {
                by_group.entry(*g).or_insert(*rule);
            }
        }
        for (key, rule) in &self.groups {
            if let Ok(g) = key.parse::<Uuid>() {
                by_group.insert(g, *rule);
            }
        }
        Rules {
            default_weight: self.default_weight,
            reserve: self.reserve,
            by_group,
        }
    }
}

/// **Overrides**: changes of the policy made at run time (the admin API's `SetFairness`), by
/// group id. They are kept in Redis, so every replica applies them, and only over the policy
/// file they were made against (its text's hash, `base`; 0 for no file, where they hold until
/// dropped): a new policy file ends them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    /// The hash of the policy file's text they were made against (0: no file).
    pub base: u64,
    /// A new reserve.
    pub reserve: Option<u32>,
    /// New weights.
    pub weights: BTreeMap<Group, f64>,
    /// New caps (`None`: the cap removed).
    pub caps: BTreeMap<Group, Option<u32>>,
}

/// The field names and values of one override, as Redis keeps them (`{prefix}:fair:overrides`).
pub mod override_fields {
    use super::Group;

    /// The field for a new reserve.
    pub fn reserve(reserve: u32) -> (String, String) {
        ("reserve".into(), reserve.to_string())
    }

    /// The field for a group's new weight.
    pub fn weight(group: Group, weight: f64) -> (String, String) {
        (format!("weight:{group}"), weight.to_string())
    }

    /// The field for a group's new cap (`None`: no cap).
    pub fn cap(group: Group, cap: Option<u32>) -> (String, String) {
        (
            format!("cap:{group}"),
            cap.map_or_else(|| "none".into(), |c| c.to_string()),
        )
    }
}

impl Overrides {
    /// Reads the fields Redis keeps (see [`override_fields`]); fields it cannot read are left
    /// out.
    pub fn from_fields(fields: &[(String, String)]) -> Overrides {
        let mut overrides = Overrides::default();
        for (field, value) in fields {
            match field.split_once(':') {
                None if field == "base" => overrides.base = value.parse().unwrap_or_default(),
                None if field == "reserve" => overrides.reserve = value.parse().ok(),
                Some(("weight", group)) => {
                    if let (Ok(g), Ok(w)) = (group.parse(), value.parse::<f64>()) {
                        if w.is_finite() && w > 0.0 {
                            overrides.weights.insert(g, w);
                        }
                    }
                }
                Some(("cap", group)) => {
                    if let Ok(g) = group.parse() {
                        match value.as_str() {
                            "none" => {
                                overrides.caps.insert(g, None);
                            }
                            n => {
                                if let Ok(c) = n.parse() {
                                    overrides.caps.insert(g, Some(c));
                                }
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        overrides
    }

    /// True when nothing is changed.
    pub fn is_empty(&self) -> bool {
        self.reserve.is_none() && self.weights.is_empty() && self.caps.is_empty()
    }

    /// Makes these overrides over `rules`.
    pub fn apply(&self, rules: &mut Rules) {
        if let Some(reserve) = self.reserve {
            rules.reserve = reserve;
        }
        for (group, weight) in &self.weights {
            rules.by_group.entry(*group).or_default().weight = Some(*weight);
        }
        for (group, cap) in &self.caps {
            rules.by_group.entry(*group).or_default().cap = *cap;
        }
    }

    /// Each override in words, for the operator ("cap of acme: 3"), `name_of` naming a group.
    pub fn describe(&self, name_of: impl Fn(Group) -> String) -> Vec<String> {
        let mut lines = Vec::new();
        if let Some(reserve) = self.reserve {
            lines.push(format!("reserve: {reserve}"));
        }
        for (group, weight) in &self.weights {
            lines.push(format!("weight of {}: {weight}", name_of(*group)));
        }
        for (group, cap) in &self.caps {
            let cap = cap.map_or_else(|| "none".to_owned(), |c| c.to_string());
            lines.push(format!("cap of {}: {cap}", name_of(*group)));
        }
        lines
    }
}

/// The policy by group id: what dispatch and the gauge apply.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rules {
    /// The weight of a group without a rule.
    pub default_weight: f64,
    /// Leases' worth of capacity kept for immediate tasks.
    pub reserve: u32,
    /// The groups with a rule.
    pub by_group: HashMap<Group, Rule>,
}

/// What holds locks now, on every replica (read from Redis at once).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Standing {
    /// Tasks holding locks, by group.
    pub running: HashMap<Group, u32>,
    /// Deferred (not immediate) tasks holding locks.
    pub deferred: u32,
    /// Leases alive now.
    pub live_leases: u32,
}

impl Standing {
    /// Tasks of `group` holding locks.
    pub fn running_of(&self, group: &Group) -> u32 {
        self.running.get(group).copied().unwrap_or(0)
    }
}

/// Why a ready task is not handed out now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldBack {
    /// Its group holds `cap` task locks already.
    Cap {
        /// The group's cap.
        cap: u32,
    },
    /// It is deferred, and deferred tasks hold all the leases but `reserve`.
    Reserve {
        /// The reserve.
        reserve: u32,
    },
}

impl fmt::Display for HeldBack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeldBack::Cap { cap } => write!(f, "its group is at its cap of {cap} running"),
            HeldBack::Reserve { reserve } => write!(
                f,
                "deferred tasks hold every lease but the {reserve} kept for immediate tasks"
            ),
        }
    }
}

impl Rules {
    /// A group's weight.
    pub fn weight(&self, group: &Group) -> f64 {
        self.by_group
            .get(group)
            .and_then(|r| r.weight)
            .unwrap_or(self.default_weight)
    }

    /// A group's cap.
    pub fn cap(&self, group: &Group) -> Option<u32> {
        self.by_group.get(group).and_then(|r| r.cap)
    }

    /// The lane gauge's count under the caps and the reserve: how many leases it takes for
    /// every lane the caps allow to hold its locks at once, and the reserve beside them. `lanes`
    /// are the lanes the readiness rule counts by (group, immediate, how many), the tasks that
    /// hold locks now among them; `standing` says how many of each group hold locks.
    ///
    /// - What holds locks counts as it is, even beyond a cap lowered since (its leases are
    ///   busy); a group's tasks holding locks are taken to be its deferred lanes first.
    /// - The rest of a group's lanes wait: they count up to what its cap leaves, the immediate
    ///   ones first (as they go first).
    /// - While deferred lanes remain, the reserve counts in full (or the immediate lanes, if
    ///   more): deferred tasks use at most live leases minus the reserve, so running them all
    ///   takes that many leases more.
    pub fn lanes(
        &self,
        lanes: impl IntoIterator<Item = (Group, bool, u64)>,
        standing: &Standing,
    ) -> u64 {
        let mut by_group: HashMap<Group, (u64, u64)> = HashMap::new();
        for (group, immediate, n) in lanes {
            let counts = by_group.entry(group).or_default();
            if immediate {
                counts.0 += n;
            } else {
                counts.1 += n;
            }
        }
        for group in standing.running.keys() {
            by_group.entry(*group).or_default();
        }
        let (mut immediate, mut deferred) = (0u64, 0u64);
        for (group, (i, d)) in by_group {
            let running = u64::from(standing.running_of(&group));
            let (running_deferred, running_immediate) = (running.min(d), running - running.min(d));
            let places = self
                .cap(&group)
                .map_or(u64::MAX, u64::from)
                .saturating_sub(running);
            let waiting_immediate = i.saturating_sub(running_immediate).min(places);
            let waiting_deferred = (d - running_deferred).min(places - waiting_immediate);
            immediate += running_immediate + waiting_immediate;
            deferred += running_deferred + waiting_deferred;
        }
        if deferred == 0 {
            immediate
        } else {
            deferred + immediate.max(u64::from(self.reserve))
        }
    }

    /// Whether any group has a cap.
    pub fn has_caps(&self) -> bool {
        self.by_group.values().any(|r| r.cap.is_some())
    }

    /// Why a ready task of `group` may not be handed out now (the acquire script checks the
    /// same atomically), or `None`.
    pub fn holds_back(
        &self,
        standing: &Standing,
        group: &Group,
        immediate: bool,
    ) -> Option<HeldBack> {
        if let Some(cap) = self.cap(group) {
            if standing.running_of(group) >= cap {
                return Some(HeldBack::Cap { cap });
            }
        }
        if !immediate
            && self.reserve > 0
            && i64::from(standing.deferred)
                >= i64::from(standing.live_leases) - i64::from(self.reserve)
        {
            return Some(HeldBack::Reserve {
                reserve: self.reserve,
            });
        }
        None
    }

    /// A group's usage: its tasks holding locks over its weight.
    pub fn usage(&self, standing: &Standing, group: &Group) -> f64 {
        f64::from(standing.running_of(group)) / self.weight(group)
    }

    /// The waiting groups in the order they are served: lowest usage first, then the oldest
    /// waiting task first (`waiting`: each group with its oldest waiting task's queue position).
    /// Groups at their cap are left out.
    pub fn order<K: Ord + Copy>(&self, standing: &Standing, waiting: &[(Group, K)]) -> Vec<Group> {
        self.first(standing, waiting, waiting.len())
    }

    /// The first `n` groups of [`Rules::order`], in order, in time linear in the number of
    /// groups (a fetch with 10,000 domains waiting sorts three of them, not all).
    pub fn first<K: Ord + Copy>(
        &self,
        standing: &Standing,
        waiting: &[(Group, K)],
        n: usize,
    ) -> Vec<Group> {
        let mut open: Vec<(f64, K, Group)> = waiting
            .iter()
            .filter(|(g, _)| !self.at_cap(standing, g))
            .map(|(g, k)| (self.usage(standing, g), *k, *g))
            .collect();
        let by = |a: &(f64, K, Group), b: &(f64, K, Group)| {
            a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2))
        };
        if n == 0 {
            return Vec::new();
        }
        if n < open.len() {
            open.select_nth_unstable_by(n - 1, by);
            open.truncate(n);
        }
        open.sort_by(by);
        open.into_iter().map(|(_, _, g)| g).collect()
    }

    /// The same as [`Rules::first`] over the open groups, in time that does not grow with the
    /// number of groups that hold no locks: `idle_first` yields the open groups in (key, group)
    /// order and `open` gives an open group's key (`None`: not open). A group holding no lock
    /// has usage 0 and every other a positive one (weights are finite and positive), so the
    /// order is the groups holding none by key, then those holding some by usage. The walk
    /// passes over at most the groups holding locks and those capped at 0.
    pub fn first_in_order<K: Ord + Copy>(
        &self,
        standing: &Standing,
        idle_first: impl IntoIterator<Item = (K, Group)>,
        open: impl Fn(&Group) -> Option<K>,
        n: usize,
    ) -> Vec<Group> {
        let mut first: Vec<Group> = idle_first
            .into_iter()
            .filter(|(_, g)| standing.running_of(g) == 0 && !self.at_cap(standing, g))
            .map(|(_, g)| g)
            .take(n)
            .collect();
        if first.len() < n {
            let mut running: Vec<(f64, K, Group)> = standing
                .running
                .iter()
                .filter(|(g, r)| **r > 0 && !self.at_cap(standing, g))
                .filter_map(|(g, _)| open(g).map(|k| (self.usage(standing, g), k, *g)))
                .collect();
            running.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
            first.extend(running.into_iter().map(|(_, _, g)| g).take(n - first.len()));
        }
        first
    }

    /// Whether `group` holds as many task locks as its cap.
    pub fn at_cap(&self, standing: &Standing, group: &Group) -> bool {
        self.cap(group)
            .is_some_and(|c| standing.running_of(group) >= c)
    }

    /// The rule in one function, over the ready tasks a pass could see (`ready`: group,
    /// immediate, queue position): the task fairness hands out next, or `None` when every one
    /// is held back. Immediate tasks first (oldest first), then the first group of
    /// [`Rules::order`] that has a ready task, its oldest. Dispatch reaches the same choice by
    /// reading the express lane first and then each group in this order (`dispatch`).
    pub fn choose<K: Ord + Copy>(
        &self,
        standing: &Standing,
        ready: &[(Group, bool, K)],
    ) -> Option<usize> {
        let admitted = |i: &usize| {
            let (g, immediate, _) = ready[*i];
            self.holds_back(standing, &g, immediate).is_none()
        };
        let oldest = |pick: &dyn Fn(&(Group, bool, K)) -> bool| {
            (0..ready.len())
                .filter(|i| pick(&ready[*i]))
                .filter(admitted)
                .min_by_key(|i| ready[*i].2)
        };
        if let Some(i) = oldest(&|t| t.1) {
            return Some(i);
        }
        let mut waiting: Vec<(Group, K)> = Vec::new();
        for (g, _, k) in ready {
            match waiting.iter_mut().find(|(w, _)| w == g) {
                Some(w) => w.1 = w.1.min(*k),
                None => waiting.push((*g, *k)),
            }
        }
        self.order(standing, &waiting)
            .into_iter()
            .find_map(|g| oldest(&|t| t.0 == g))
    }
}

#[cfg(test)]
mod tests;
