//! The operator's view: why a task waits, who holds what, which resources block the most tasks,
//! and the two audited ways out (revoking a lease, releasing a lock whose holder is gone).
//!
//! Every judgement here calls `ready` (the rule dispatch uses); this module only gathers the
//! facts (the task and its older conflicts from Postgres, held locks and live leases from Redis)
//! and names them. Reads never walk all tasks or scan the Redis keyspace: their cost is the
//! explained task's older conflicts, the locks held and the leases alive. The only writes are
//! `revoke` and `force_release`, which take the sweeper's own paths and are audited (a warn log
//! line, a counter, and the record returned to the caller). No other way to remove a lock
//! exists.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::dispatch::Queue;
use crate::error::{Error, Result};
use crate::ids::{FencingToken, LeaseId, TaskId};
use crate::lanes::Lanes;
use crate::leases::{from_ms, Leases};
use crate::locks::{HeldLock, LeaseView, Locks};
use crate::metrics::Stats;
use crate::ready::{self, BlockedResource, Mode, Reservations, Resources};
use crate::states::TaskState;
use crate::tasks::{parse_versions, Tasks};

/// Live leases an explanation weighs at most (a fleet far larger than any seen).
const MAX_LEASES_WEIGHED: usize = 10_000;

/// The operator's view over one broker's stores.
#[derive(Clone)]
pub struct Admin {
    tasks: Tasks,
    locks: Locks,
    leases: Leases,
    lanes: Arc<Lanes>,
    waiters: Arc<Queue>,
    stats: Arc<Stats>,
    queues: Arc<crate::dispatch::queues::Queues>,
    fairness: crate::dispatch::Fairness,
    known_leases: crate::dispatch::KnownLeases,
}

/// Who holds a lock (or has a task).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The task whose lock it is.
    pub task_id: String,
    /// The holding lease.
    pub lease_id: String,
    /// The lease's worker; `None` when the lease record is gone.
    pub worker: Option<String>,
    /// The grant's fencing token.
    pub fencing_token: FencingToken,
    /// The lease's expiry; `None` when the lease record is gone.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The lease is alive now (Redis server time).
    pub lease_alive: bool,
}

impl Holder {
    fn of(lock: &HeldLock, now_ms: i64) -> Holder {
        Holder {
            task_id: lock.task_id.clone(),
            lease_id: lock.lease_id.clone(),
            worker: lock.worker.clone(),
            fencing_token: lock.fencing_token,
            lease_expires_at: lock.lease_expires_ms.map(from_ms),
            lease_alive: lock.lease_expires_ms.is_some_and(|e| e > now_ms),
        }
    }

    fn describe(&self) -> String {
        let worker = self.worker.as_deref().unwrap_or("(lease record gone)");
        let life = match (self.lease_alive, self.lease_expires_at) {
            (true, Some(at)) => format!("alive until {}", at.format("%H:%M:%S")),
            (false, Some(at)) => format!("expired at {}, not yet swept", at.format("%H:%M:%S")),
            _ => "lease gone".to_owned(),
        };
        format!(
            "worker {worker} (lease {}, fencing token {}, {life})",
            self.lease_id, self.fencing_token
        )
    }
}

/// The locks held on one resource in one mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceLock {
    /// The resource.
    pub resource: String,
    /// How it is held.
    pub mode: Mode,
    /// Its holders, oldest grant first.
    pub holders: Vec<Holder>,
}

/// An older incomplete task that conflicts with the explained one.
#[derive(Debug, Clone)]
pub struct Older {
    /// `pulp_id`.
    pub id: TaskId,
    /// `state`.
    pub state: TaskState,
    /// `name`.
    pub name: String,
    /// `pulp_created`.
    pub created: DateTime<Utc>,
    /// The resources it conflicts on: (name, how the explained task wants it, how this one
    /// needs it).
    pub conflicts: Vec<(String, Mode, Mode)>,
}

/// What the Fairness call reports.
#[derive(Debug, Clone)]
pub struct FairnessReport {
    /// What tasks are grouped by.
    pub by: crate::fair::FairBy,
    /// Where the policy in force came from.
    pub source: crate::dispatch::fairness::Source,
    /// Leases kept for immediate tasks.
    pub reserve: u32,
    /// The weight of a domain the policy does not name.
    pub default_weight: f64,
    /// Live leases now.
    pub live_leases: u32,
    /// Deferred tasks holding locks now.
    pub deferred_running: u32,
    /// Whether fair dispatch's indexes exist.
    pub directed: bool,
    /// Every domain running, waiting or named.
    pub groups: Vec<crate::dispatch::fairness::GroupView>,
    /// The overrides in force, each in words.
    pub overrides: Vec<String>,
}

/// An override of the fairness policy an operator asks for (SetFairness), checked for form.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FairnessOverride {
    /// The domain, by name or id (with `weight` and `cap`).
    pub domain: Option<String>,
    /// Its new weight (more than 0).
    pub weight: Option<f64>,
    /// Its new cap (`Some(None)`: no cap).
    pub cap: Option<Option<u32>>,
    /// The new reserve.
    pub reserve: Option<u32>,
    /// Drop every override instead.
    pub reset: bool,
}

/// What SetFairness answers besides the audit record: the policy in force now.
pub const OVERRIDE_NOTE: &str = "this override is not in the policy file: every replica applies it until the policy file changes (or Redis loses its data); write it into the policy file to keep it";

/// Why a task is where it is.
#[derive(Debug, Clone)]
pub struct Explanation {
    /// `pulp_id`.
    pub task_id: TaskId,
    /// `name`.
    pub name: String,
    /// `state`.
    pub state: TaskState,
    /// `pulp_created`.
    pub created: DateTime<Utc>,
    /// Its resources.
    pub resources: Resources,
    /// Its component versions (`None`: unreadable, so no worker qualifies).
    pub versions: Option<BTreeMap<String, String>>,
    /// One line for a person.
    pub summary: String,
    /// Waiting, unclaimed, and ready by the rule.
    pub ready: bool,
    /// Who has it (claimed or running).
    pub holder: Option<Holder>,
    /// The oldest older incomplete tasks that conflict with it.
    pub older: Vec<Older>,
    /// How many older incomplete tasks conflict with it.
    pub older_total: u64,
    /// Held locks that conflict with it.
    pub conflicting_locks: Vec<ResourceLock>,
    /// Ready by the rule, but held back by fair dispatch: why, for a person (its domain's cap,
    /// or the reserve for immediate tasks).
    pub held_back: Option<String>,
    /// Live leases now.
    pub live_leases: u32,
    /// There are live leases and none can run it.
    pub incompatible_with_every_live_lease: bool,
}

/// One page of something, with where the next begins.
#[derive(Debug, Clone)]
pub struct Page<T> {
    /// This page.
    pub items: Vec<T>,
    /// The token of the next page; `None` on the last.
    pub next: Option<String>,
    /// Items matching on all pages.
    pub total: u64,
}

/// A lease as ListLeases shows it.
#[derive(Debug, Clone)]
pub struct LeaseSummary {
    /// The lease as Redis holds it.
    pub lease: LeaseView,
    /// Its worker's versions.
    pub versions: BTreeMap<String, String>,
    /// Alive now.
    pub alive: bool,
}

/// A resource from the gauge's survey, with its head explained now.
#[derive(Debug, Clone)]
pub struct Blocked {
    /// The resource and how many tasks wait behind its head.
    pub survey: BlockedResource,
    /// The head, explained now; `None` when it was deleted since the survey.
    pub head: Option<Explanation>,
}

/// The survey of blocked resources.
#[derive(Debug, Clone)]
pub struct BlockedReport {
    /// Most tasks behind first.
    pub resources: Vec<Blocked>,
    /// How old the survey is.
    pub age: Duration,
    /// Where it comes from.
    pub source: SurveySource,
}

/// Where BlockedResources' counts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SurveySource {
    /// This replica's resource queues: every incomplete task, read from the task table within
    /// a second of its arrival.
    ResourceQueues,
    /// The lane gauge's last full pass (tasks younger than `--lane-cutoff` not counted).
    LaneGauge,
}

impl SurveySource {
    /// `resource_queues` or `lane_gauge`, as the API says it.
    pub fn as_str(self) -> &'static str {
        match self {
            SurveySource::ResourceQueues => "resource_queues",
            SurveySource::LaneGauge => "lane_gauge",
        }
    }
}

/// What an audited action did, as logged, counted and returned.
#[derive(Debug, Clone)]
pub struct AuditRecord {
    /// `revoke_lease`, `force_release` or `set_fairness`.
    pub action: &'static str,
    /// Who asked (the credential's name).
    pub actor: String,
    /// The lease or resource acted on.
    pub target: String,
    /// Why, as given.
    pub reason: String,
    /// When.
    pub at: DateTime<Utc>,
    /// What changed.
    pub outcome: String,
}

/// What an audited release did.
#[derive(Debug, Clone, Default)]
pub struct Released {
    /// Task locks released.
    pub locks: u32,
    /// Claimed tasks put back in the queue.
    pub requeued: u32,
    /// Running tasks failed with the reason.
    pub failed: u32,
}

/// Logs and counts an audited action: the one place an operator's write is recorded.
fn audit(record: &AuditRecord) {
    crate::metrics::admin_action(record.action);
    tracing::warn!(
        action = record.action,
        actor = %record.actor,
        target = %record.target,
        reason = %record.reason,
        outcome = %record.outcome,
        "admin action"
    );
}

impl Admin {
    /// The operator's view over these stores; `waiters` are woken after a release; `queues`
    /// (this replica's resource queues) count the blocked resources when they are kept.
    pub fn new(
        tasks: Tasks,
        locks: Locks,
        leases: Leases,
        lanes: Arc<Lanes>,
        stats: Arc<Stats>,
        dispatch: &crate::dispatch::Dispatch,
    ) -> Self {
        let waiters = dispatch.waiters();
        let queues = dispatch.resource_queues();
        Admin {
            fairness: dispatch.fairness(),
            known_leases: dispatch.known_leases(),
            tasks,
            locks,
            leases,
            lanes,
            waiters,
            stats,
            queues,
        }
    }

    /// What every explanation weighs besides the task: the held locks and the live leases'
    /// versions, read once per call (BlockedResources explains many heads with one reading).
    async fn facts(&self) -> Result<Facts> {
        let (now_ms, held) = self.locks.lock_table().await?;
        let leases = self
            .locks
            .lease_table("", false, "", MAX_LEASES_WEIGHED, false)
            .await?;
        Ok(Facts {
            now_ms,
            held,
            live_leases: leases.total.min(u64::from(u32::MAX)) as u32,
            versions: leases
                .leases
                .iter()
                .map(|l| parse_versions(&l.versions).unwrap_or_default())
                .collect(),
        })
    }

    /// ExplainTask: listing at most `max_older` older conflicting tasks.
    pub async fn explain(&self, task_id: TaskId, max_older: usize) -> Result<Explanation> {
        let facts = self.facts().await?;
        self.explain_with(task_id, max_older, &facts).await
    }

    async fn explain_with(
        &self,
        task_id: TaskId,
        max_older: usize,
        facts: &Facts,
    ) -> Result<Explanation> {
        // The readiness look-up (older conflicts) only for a task that waits unclaimed.
        let facts_row = self
            .tasks
            .task_facts(task_id)
            .await?
            .ok_or(Error::TaskNotFound(task_id))?;
        let task = if facts_row.state == TaskState::Waiting && facts_row.app_lock_id.is_none() {
            // Through the GIN index (no resource queues here): an operator's question, not on
            // the fetch path.
            self.tasks
                .task(task_id, &crate::tasks::Near::default())
                .await?
                .ok_or(Error::TaskNotFound(task_id))?
        } else {
            facts_row
        };
        let now_ms = facts.now_ms;
        let own = task_id.to_string();
        let holder = facts
            .held
            .iter()
            .find(|l| l.task_id == own)
            .map(|l| Holder::of(l, now_ms));
        let candidate = &task.row.candidate;
        let mut explanation = Explanation {
            task_id,
            name: task.row.name.clone(),
            state: task.state,
            created: task.row.created,
            resources: candidate.resources.clone(),
            versions: candidate.versions.clone(),
            summary: String::new(),
            ready: false,
            holder,
            older: Vec::new(),
            older_total: 0,
            conflicting_locks: Vec::new(),
            held_back: None,
            live_leases: facts.live_leases,
            incompatible_with_every_live_lease: false,
        };
        if task.state.is_final() {
            explanation.summary = match &explanation.holder {
                None => format!("{}: finished, holds nothing", task.state),
                Some(h) => format!(
                    "{}: finished, but its lock is still held by {}; the reconciler releases it",
                    task.state,
                    h.describe()
                ),
            };
            return Ok(explanation);
        }
        if task.state != TaskState::Waiting {
            explanation.summary = match &explanation.holder {
                Some(h) => format!("{} on {}", task.state, h.describe()),
                None => format!(
                    "{}, claimed by worker row {}, but no lock is held for it: the sweeper \
                     ends it when that worker's lease ends, and the reconciler rebuilds lost \
                     locks",
                    task.state,
                    task.app_lock_id
                        .map(|a| a.to_string())
                        .unwrap_or_else(|| "(none)".into())
                ),
            };
            return Ok(explanation);
        }
        if let Some(app_status) = task.app_lock_id {
            explanation.summary = match &explanation.holder {
                Some(h) => format!(
                    "claimed (worker row {app_status}), not started yet: {}",
                    h.describe()
                ),
                None => format!(
                    "claimed by worker row {app_status} without a lock (an immediate task marked \
                     for that worker, or a claim the reconciler puts back); only ClaimTask by \
                     that worker hands it out"
                ),
            };
            return Ok(explanation);
        }

        // Waiting and unclaimed: every reason, judged by the rule.
        explanation.older_total = candidate.older_conflicts.max(0) as u64;
        if explanation.older_total > 0 && max_older > 0 {
            let keys = candidate.resources.conflict_keys();
            explanation.older = self
                .tasks
                .older_conflicts(task_id, &keys, max_older as i64)
                .await?
                .into_iter()
                .map(|o| Older {
                    conflicts: candidate
                        .resources
                        .conflicts(&o.resources)
                        .map(|c| (c.resource.to_owned(), c.mine, c.theirs))
                        .collect(),
                    id: o.id,
                    state: o.state,
                    name: o.name,
                    created: o.created,
                })
                .collect();
        }
        let mut reserved = Reservations::default();
        let mut conflicting: BTreeMap<(String, Mode), Vec<Holder>> = BTreeMap::new();
        // Its own lock (a grant under way) is no obstacle.
        for lock in facts.held.iter().filter(|l| l.task_id != own) {
            let locked = Resources {
                exclusive: lock.exclusive.clone(),
                shared: lock.shared.clone(),
            };
            for c in candidate.resources.conflicts(&locked) {
                reserved.reserve_lock(c.resource, c.theirs);
                conflicting
                    .entry((c.resource.to_owned(), c.theirs))
                    .or_default()
                    .push(Holder::of(lock, now_ms));
            }
        }
        explanation.conflicting_locks = resource_locks(conflicting);
        let rule = ready::obstacles(candidate, &reserved, &BTreeMap::new());
        let compatible = facts
            .versions
            .iter()
            .filter(|versions| !ready::obstacles(candidate, &reserved, versions).incompatible)
            .count();
        explanation.ready = rule.ready_by_rule();
        if explanation.ready {
            let standing = self.locks.standing().await?;
            let group = self.fairness.group_of_row(&task.row);
            explanation.held_back = self
                .fairness
                .rules()
                .holds_back(&standing, &group, task.row.immediate)
                .map(|why| match why {
                    crate::fair::HeldBack::Cap { cap } => format!(
                        "{} {} is at its cap of {cap} running",
                        self.fairness.group_word(),
                        self.fairness.name_of(group)
                    ),
                    other => other.to_string(),
                });
        }
        explanation.incompatible_with_every_live_lease =
            !facts.versions.is_empty() && compatible == 0;
        explanation.summary = summary(&explanation);
        Ok(explanation)
    }

    /// Fairness: the policy in force and each domain's share, with what holds locks now.
    pub async fn fairness(&self) -> Result<FairnessReport> {
        let standing = self.locks.standing().await?;
        let (_, source) = self.fairness.policy();
        let rules = self.fairness.rules();
        Ok(FairnessReport {
            by: self.fairness.by(),
            source,
            reserve: rules.reserve,
            default_weight: rules.default_weight,
            live_leases: standing.live_leases,
            deferred_running: standing.deferred,
            directed: self.fairness.directed(),
            groups: self.fairness.view(&standing),
            overrides: self.fairness.overrides(),
        })
    }

    /// SetFairness: records an override of the fairness policy in Redis (every replica reads it
    /// within `--fair-refresh`; this one applies it at once), or drops them all. Audited.
    pub async fn set_fairness(
        &self,
        actor: &str,
        change: FairnessOverride,
        reason: &str,
    ) -> Result<(AuditRecord, FairnessReport)> {
        use crate::fair::override_fields;
        let target = match (&change.domain, change.reset) {
            (_, true) => "overrides".to_owned(),
            (Some(domain), false) => domain.clone(),
            (None, false) => "reserve".to_owned(),
        };
        let group = match &change.domain {
            Some(name) => {
                let mut group = self.fairness.domain_named(name);
                if group.is_none() && self.fairness.by() == crate::fair::FairBy::Domain {
                    // A domain this replica has not seen waiting yet: its name is read now.
                    self.fairness.learn_names(self.tasks.domain_names().await?);
                    group = self.fairness.domain_named(name);
                }
                Some(group.ok_or_else(|| Error::NoSuchDomain(name.clone()))?)
            }
            None => None,
        };
        if group.is_some() && self.fairness.by() == crate::fair::FairBy::None {
            return Err(Error::Refused(
                "fair dispatch groups no tasks by domain here (--fair-by none): weights and caps do not apply; only the reserve does".into(),
            ));
        }
        let mut fields = Vec::new();
        if let (Some(g), Some(w)) = (group, change.weight) {
            fields.push(override_fields::weight(g, w));
        }
        if let (Some(g), Some(c)) = (group, change.cap) {
            fields.push(override_fields::cap(g, c));
        }
        if let Some(r) = change.reserve {
            fields.push(override_fields::reserve(r));
        }
        let this = self.clone();
        let (actor, reason) = (actor.to_owned(), reason.to_owned());
        let record = detached(async move {
            intent("set_fairness", &actor, &target, &reason);
            let kept =
                if change.reset {
                    this.locks.drop_fair_overrides().await?;
                    Vec::new()
                } else {
                    match this
                        .locks
                        .override_fairness(this.fairness.base(), &fields)
                        .await?
                    {
                        Ok(kept) => kept,
                        Err(_) => return Err(Error::Refused(
                            "the overrides kept were made over another policy file: the policy \
                             file changed since (or the replicas disagree on it while a new one \
                             rolls out). Nothing was changed. Once every replica reads the same \
                             file, drop the old overrides with `dispatch-broker fairness reset`, \
                             then set this one again"
                                .into(),
                        )),
                    }
                };
            this.fairness
                .set_overrides(crate::fair::Overrides::from_fields(&kept));
            // A cap lifted or a reserve lowered may free a waiting task.
            this.waiters.wake();
            let outcome = if change.reset {
                "every override dropped".to_owned()
            } else {
                let overrides = this.fairness.overrides();
                format!("overrides in force: {}", overrides.join("; "))
            };
            let record = AuditRecord {
                action: "set_fairness",
                actor,
                target,
                reason,
                at: Utc::now(),
                outcome,
            };
            audit(&record);
            Ok(record)
        })
        .await?;
        Ok((record, self.fairness().await?))
    }

    /// ListLeases.
    pub async fn leases(
        &self,
        worker_contains: &str,
        include_expired: bool,
        page_size: usize,
        after: &str,
    ) -> Result<Page<LeaseSummary>> {
        // One more than the page: whether it exists says whether there is a next page.
        let page = self
            .locks
            .lease_table(worker_contains, include_expired, after, page_size + 1, true)
            .await?;
        let now = page.now_ms;
        let mut items: Vec<LeaseSummary> = page
            .leases
            .into_iter()
            .map(|lease| LeaseSummary {
                versions: parse_versions(&lease.versions).unwrap_or_default(),
                alive: lease.expires_ms > now,
                lease,
            })
            .collect();
        let next = if items.len() > page_size {
            items.truncate(page_size);
            items.last().map(|l| l.lease.lease_id.clone())
        } else {
            None
        };
        Ok(Page {
            items,
            next,
            total: page.total,
        })
    }

    /// ListLocks: resources whose name starts with `prefix`, oldest grant first.
    pub async fn locks(
        &self,
        prefix: &str,
        page_size: usize,
        after: Option<&str>,
    ) -> Result<Page<ResourceLock>> {
        let (now_ms, held) = self.locks.lock_table().await?;
        let mut by_resource: BTreeMap<(String, Mode), Vec<Holder>> = BTreeMap::new();
        for lock in &held {
            let modes = lock
                .exclusive
                .iter()
                .map(|r| (r, Mode::Exclusive))
                .chain(lock.shared.iter().map(|r| (r, Mode::Shared)));
            for (resource, mode) in modes.filter(|(r, _)| r.starts_with(prefix)) {
                by_resource
                    .entry((resource.clone(), mode))
                    .or_default()
                    .push(Holder::of(lock, now_ms));
            }
        }
        let mut all = resource_locks(by_resource);
        all.sort_by(|a, b| lock_order(a).cmp(&lock_order(b)));
        let total = all.len() as u64;
        let start = match after {
            Some(token) => {
                let after = parse_page_token(token)?;
                all.iter()
                    .position(|l| lock_order(l) > (after.0, after.1.as_str(), after.2))
                    .unwrap_or(all.len())
            }
            None => 0,
        };
        let items: Vec<ResourceLock> = all.into_iter().skip(start).take(page_size + 1).collect();
        let (items, next) = if items.len() > page_size {
            let items: Vec<ResourceLock> = items.into_iter().take(page_size).collect();
            let next = items.last().map(page_token);
            (items, next)
        } else {
            (items, None)
        };
        Ok(Page { items, next, total })
    }

    /// BlockedResources: the survey of the gauge's last pass, each head explained now.
    pub async fn blocked(&self, limit: usize) -> Result<BlockedReport> {
        // This replica's resource queues know every arrival within a second; without them (off,
        // or not loaded yet) the lane gauge's last full pass surveyed the queue.
        let (resources, age, source) =
            match self.queues.most_blocked(limit) {
                Some((resources, age)) => (resources, age, SurveySource::ResourceQueues),
                None => match self.lanes.survey().await? {
                    Some((resources, age)) => (resources, age, SurveySource::LaneGauge),
                    None => return Err(Error::NotYet(
                        "the lane gauge has not surveyed the queue yet (it does within a second \
                         of the broker starting, then with every full count, every \
                         --lane-full-interval); retry shortly"
                            .into(),
                    )),
                },
            };
        let facts = self.facts().await?;
        let mut out = Vec::new();
        for survey in resources.into_iter().take(limit) {
            let head = match self.explain_with(survey.head, 3, &facts).await {
                Ok(e) => Some(e),
                Err(Error::TaskNotFound(_)) => None,
                Err(e) => return Err(e),
            };
            out.push(Blocked { survey, head });
        }
        Ok(BlockedReport {
            resources: out,
            age,
            source,
        })
    }

    /// RevokeLease: the sweeper's path for one lease, now, whether it is alive or not. Runs to
    /// the end even if the caller goes away.
    pub async fn revoke(
        &self,
        actor: &str,
        lease_id: LeaseId,
        reason: &str,
    ) -> Result<(AuditRecord, Released)> {
        let this = self.clone();
        let (actor, reason) = (actor.to_owned(), reason.to_owned());
        detached(async move {
            intent("revoke_lease", &actor, &lease_id.to_string(), &reason);
            let revoked = this.leases.revoke(lease_id, &reason, "revoke").await;
            // Forgotten whatever the outcome: at worst the next call under it reads it again.
            this.known_leases.forget(lease_id);
            let closed = revoked?.ok_or_else(|| Error::NoSuchLease(lease_id.to_string()))?;
            this.waiters.wake();
            let released = Released {
                locks: closed.released_locks,
                requeued: closed.requeued_tasks,
                failed: closed.failed_tasks,
            };
            let record = AuditRecord {
                action: "revoke_lease",
                actor,
                target: lease_id.to_string(),
                reason,
                at: Utc::now(),
                outcome: outcome(&released),
            };
            audit(&record);
            Ok((record, released))
        })
        .await
    }

    /// ForceRelease: frees the locks on `resource` when none of its holders' leases is alive:
    /// an expired lease is ended as the sweeper would end it (all its locks); a lock whose lease
    /// record is gone is released (only if it is still the lock the operator saw) and its task
    /// put back (claimed) or failed (running) with the reason. Runs to the end even if the
    /// caller goes away.
    pub async fn force_release(
        &self,
        actor: &str,
        resource: &str,
        reason: &str,
    ) -> Result<(AuditRecord, Vec<Holder>, Released)> {
        let this = self.clone();
        let (actor, resource, reason) = (actor.to_owned(), resource.to_owned(), reason.to_owned());
        detached(async move {
            intent("force_release", &actor, &resource, &reason);
            let (holders, released) = this.force_release_now(&resource, &reason).await?;
            this.waiters.wake();
            let record = AuditRecord {
                action: "force_release",
                actor,
                target: resource,
                reason,
                at: Utc::now(),
                outcome: outcome(&released),
            };
            audit(&record);
            Ok((record, holders, released))
        })
        .await
    }

    async fn force_release_now(
        &self,
        resource: &str,
        reason: &str,
    ) -> Result<(Vec<Holder>, Released)> {
        let (now_ms, held) = self.locks.lock_table().await?;
        let holders: Vec<Holder> = held
            .iter()
            .filter(|l| {
                l.exclusive.iter().any(|r| r == resource) || l.shared.iter().any(|r| r == resource)
            })
            .map(|l| Holder::of(l, now_ms))
            .collect();
        if holders.is_empty() {
            return Err(Error::LockNotFound(resource.to_owned()));
        }
        if let Some(live) = holders.iter().find(|h| h.lease_alive) {
            return Err(Error::Refused(format!(
                "{resource} is held by task {} under a live lease: {}. ForceRelease frees only \
                 locks whose lease is expired or gone; if that worker is really gone, revoke its \
                 lease first (dispatch-broker revoke {} --reason ...)",
                live.task_id,
                live.describe(),
                live.lease_id
            )));
        }
        // Every holder's ids as the broker writes them (canonical UUID text), checked before
        // anything is released: a lock that names something else is refused, and nothing
        // changes.
        let mut ids = Vec::with_capacity(holders.len());
        for h in &holders {
            match (
                h.task_id.parse::<TaskId>().ok(),
                h.lease_id.parse::<LeaseId>().ok(),
            ) {
                (Some(task), Some(lease_id)) => ids.push((task, lease_id)),
                (task, _) => {
                    return Err(Error::Refused(format!(
                        "the lock on {resource} names {} {:?}, which is not an id the broker \
                         makes; nothing was released (look with `dispatch-broker locks \
                         {resource}`)",
                        if task.is_none() { "task" } else { "lease" },
                        if task.is_none() {
                            &h.task_id
                        } else {
                            &h.lease_id
                        }
                    )))
                }
            }
        }
        let mut released = Released::default();
        let mut ended_leases: Vec<LeaseId> = Vec::new();
        let mut done = Vec::new();
        for (h, (task, lease_id)) in holders.iter().zip(ids) {
            if h.lease_expires_at.is_some() {
                // Expired, not yet swept: a heartbeat can no longer revive it, so ending it is
                // the sweeper's own step, taken now.
                if !ended_leases.contains(&lease_id) {
                    ended_leases.push(lease_id);
                    if let Some(closed) = self
                        .leases
                        .revoke(lease_id, reason, "force_release")
                        .await?
                    {
                        released.locks += closed.released_locks;
                        released.requeued += closed.requeued_tasks;
                        released.failed += closed.failed_tasks;
                    }
                }
                done.push(h.clone());
                continue;
            }
            // The lease record is gone: release this lock only if it is still the one seen
            // (same lease and token, lease not back), then end the claim it left behind. Once
            // the lock is released the task cannot be granted again while it stays claimed, so
            // its claim is still the dead holder's.
            match self
                .locks
                .release_orphan(task, lease_id, h.fencing_token)
                .await?
            {
                Some(true) => {}
                Some(false) => continue,
                None => {
                    return Err(Error::Refused(format!(
                        "the lease {} holding {resource} came back meanwhile; nothing more was \
                         released (look again with `dispatch-broker locks {resource}`)",
                        h.lease_id
                    )))
                }
            }
            released.locks += 1;
            self.stats.locks_released("force_release", 1);
            done.push(h.clone());
            if let Some((_, Some(app_status))) = self.tasks.state(task).await? {
                let ended = self
                    .tasks
                    .end_lease_tasks(app_status, &[task], reason, false)
                    .await?;
                released.requeued += ended.requeued;
                released.failed += ended.failed;
                self.locks.note_changes(&["*"]).await?;
            }
        }
        Ok((done, released))
    }
}

/// Runs an audited write in its own task, so a caller that goes away (a CLI timeout, Ctrl-C)
/// cannot stop it half-way; a failure is logged with the action's intent.
async fn detached<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    tokio::spawn(async move {
        let outcome = work.await;
        if let Err(e) = &outcome {
            tracing::warn!(error = %e, "admin action not done");
        }
        outcome
    })
    .await
    .map_err(|e| Error::Internal(format!("an admin action stopped: {e}")))?
}

/// Logs what an operator asked for, before anything changes.
fn intent(action: &str, actor: &str, target: &str, reason: &str) {
    tracing::warn!(action, actor, target, reason, "admin action requested");
}

/// What every explanation in one call weighs besides the task itself.
struct Facts {
    now_ms: i64,
    held: Vec<HeldLock>,
    live_leases: u32,
    versions: Vec<BTreeMap<String, String>>,
}

/// The one line an explanation of a waiting, unclaimed task opens with.
fn summary(e: &Explanation) -> String {
    let mut reasons = Vec::new();
    // Each reason names its first blocker: the oldest conflicting task and where it conflicts,
    // or the first conflicting lock and who holds it.
    if e.older_total > 0 {
        let first = e.older.first().map_or_else(String::new, |o| {
            let on = o
                .conflicts
                .first()
                .map_or_else(String::new, |(resource, _, _)| format!(" on {resource}"));
            format!(" (the oldest: task {}, {}{on})", o.id, o.state)
        });
        reasons.push(format!(
            "waiting behind {} older conflicting task{}{first}",
            e.older_total,
            if e.older_total == 1 { "" } else { "s" }
        ));
    }
    let locks: usize = e.conflicting_locks.iter().map(|l| l.holders.len()).sum();
    if locks > 0 {
        let first = e
            .conflicting_locks
            .iter()
            .find_map(|l| l.holders.first().map(|h| (l, h)))
            .map_or_else(String::new, |(l, h)| {
                format!(
                    " ({} held {} for task {} by {})",
                    l.resource,
                    l.mode.as_str(),
                    h.task_id,
                    h.describe()
                )
            });
        reasons.push(format!(
            "{locks} held lock{} conflict{}{first}",
            if locks == 1 { "" } else { "s" },
            if locks == 1 { "s" } else { "" }
        ));
    }
    if let Some(why) = &e.held_back {
        reasons.push(format!("held back by fair dispatch: {why}"));
    }
    if e.incompatible_with_every_live_lease {
        reasons.push("no live worker's versions satisfy it".into());
    } else if e.live_leases == 0 {
        reasons.push("no worker is connected (no live lease)".into());
    }
    match (e.ready, reasons.is_empty()) {
        (true, true) => {
            "ready: a compatible worker's FetchTask hands it out (oldest ready task first)".into()
        }
        (true, false) => format!("ready by the rule, but {}", reasons.join("; ")),
        (false, _) => reasons.join("; "),
    }
}

fn outcome(r: &Released) -> String {
    format!(
        "{} lock(s) released, {} task(s) requeued, {} task(s) failed",
        r.locks, r.requeued, r.failed
    )
}

/// Holders grouped by resource and mode, as [`ResourceLock`]s with the oldest grant first.
fn resource_locks(grouped: BTreeMap<(String, Mode), Vec<Holder>>) -> Vec<ResourceLock> {
    grouped
        .into_iter()
        .map(|((resource, mode), mut holders)| {
            holders.sort_by_key(|h| h.fencing_token);
            ResourceLock {
                resource,
                mode,
                holders,
            }
        })
        .collect()
}

/// ListLocks order: oldest grant first (fencing tokens only grow), then resource and mode.
fn lock_order(l: &ResourceLock) -> (u64, &str, Mode) {
    let oldest = l.holders.first().map(|h| h.fencing_token.0).unwrap_or(0);
    (oldest, l.resource.as_str(), l.mode)
}

/// A ListLocks page token: the sort key of the last resource shown.
fn page_token(l: &ResourceLock) -> String {
    let (token, resource, mode) = lock_order(l);
    format!("{token}:{}:{resource}", mode.as_str())
}

fn parse_page_token(token: &str) -> Result<(u64, String, Mode)> {
    let bad = || {
        Error::InvalidArgument(format!(
            "page_token {:?} is not one ListLocks returned; pass next_page_token unchanged, or \
             nothing for the first page",
            token.chars().take(40).collect::<String>()
        ))
    };
    let mut parts = token.splitn(3, ':');
    let fence = parts.next().and_then(|t| t.parse().ok()).ok_or_else(bad)?;
    let mode = match parts.next() {
        Some("exclusive") => Mode::Exclusive,
        Some("shared") => Mode::Shared,
        _ => return Err(bad()),
    };
    let resource = parts.next().ok_or_else(bad)?.to_owned();
    Ok((fence, resource, mode))
}
