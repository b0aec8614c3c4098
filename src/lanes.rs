//! The lane gauge: how many incomplete tasks (older than a cut-off) no older incomplete task
//! conflicts with — the same rule as dispatch (`ready::LaneCounter`), Pulp's
//! `count_waiting_tasks_for_metric`. `waiting_tasks` = lanes - live leases is Pulp's KEDA gauge.
//! Fair dispatch's caps and reserve limit the count (`fair::Rules::lanes`): a domain capped at 3
//! is 3 lanes at most, and while deferred lanes wait the reserve's leases are counted too.
//!
//! The count is computed at most once per interval across all replicas (a Redis lock) and shared
//! through Redis with its time of computation; every replica serves that cached value to
//! /metrics, to KEDA and to the StreamIsActive push. When a computation fails, the last value is
//! served with its growing age and an error counter rises. Whether any task is incomplete (a
//! cheap EXISTS) is checked every `activity_check`, and at the next refresh after a task
//! notification while the queue is inactive, so a task arriving in an empty queue is pushed to
//! KEDA within about a second while an idle broker leaves the task table alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::dispatch::Fairness;
use crate::error::Result;
use crate::locks::Locks;
use crate::metrics;
use crate::ready::{BlockedResource, LaneCounter};
use crate::shutdown::Shutdown;
use crate::tasks::{LaneReads, Tasks};

/// What the gauge serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gauge {
    /// Lanes, as last computed by any replica (0 before the first computation).
    pub lanes: u64,
    /// When that value was computed (ms since the epoch, Redis server time; 0: never).
    pub computed_at_ms: i64,
    /// Redis server time at the last refresh (ms), to judge the value's age.
    pub observed_at_ms: i64,
    /// Live leases at the last refresh.
    pub live_leases: u64,
    /// Whether any task is incomplete (waiting, running or canceling).
    pub active: bool,
    /// When this replica last read the shared value (its age keeps growing from here while
    /// Redis cannot be read).
    pub observed_locally: Option<Instant>,
    /// Whether activity was checked at least once (KEDA's push waits for it).
    pub activity_known: bool,
}

impl Gauge {
    /// Publishes the gauge's values to the metrics recorder.
    pub fn publish(&self) {
        ::metrics::gauge!(metrics::LANES).set(self.lanes as f64);
        ::metrics::gauge!(metrics::WAITING_TASKS).set(self.waiting_tasks() as f64);
        ::metrics::gauge!(metrics::LIVE_LEASES).set(self.live_leases as f64);
        ::metrics::gauge!(metrics::LANE_AGE_SECONDS).set(self.age().as_secs_f64());
    }

    /// Pulp's KEDA gauge: lanes not already served by a live worker.
    pub fn waiting_tasks(&self) -> u64 {
        self.lanes.saturating_sub(self.live_leases)
    }

    /// Age of the served lane count.
    pub fn age(&self) -> Duration {
        if self.computed_at_ms == 0 {
            return Duration::ZERO;
        }
        let at_last_read =
            Duration::from_millis((self.observed_at_ms - self.computed_at_ms).max(0) as u64);
        at_last_read
            + self
                .observed_locally
                .map(|t| t.elapsed())
                .unwrap_or_default()
    }
}

/// How many of the most blocked resources each computation keeps (BlockedResources serves
/// from them).
pub const SURVEY_KEEP: usize = 100;

/// The survey of blocked resources as stored beside the lane count: `[[resource, behind,
/// head], ...]`.
pub fn encode_survey(blocked: &[BlockedResource]) -> String {
    let rows: Vec<serde_json::Value> = blocked
        .iter()
        .map(|b| serde_json::json!([b.resource, b.behind, b.head.to_string()]))
        .collect();
    serde_json::Value::Array(rows).to_string()
}

/// Reads what [`encode_survey`] wrote; rows it cannot read are left out.
pub fn decode_survey(json: &str) -> Vec<BlockedResource> {
    let rows: Vec<(String, u32, String)> = serde_json::from_str(json).unwrap_or_default();
    rows.into_iter()
        .filter_map(|(resource, behind, head)| {
            Some(BlockedResource {
                resource,
                behind,
                head: head.parse().ok()?,
            })
        })
        .collect()
}

/// How many domains' waiting tasks each full pass stores (the most waiting first); the rest are
/// stored as one sum.
pub const WAITING_KEEP: usize = 1_000;

/// The waiting tasks by domain as stored beside the lane count: `{"top": [[domain, n], ...],
/// "rest": n}`, most first.
pub fn encode_waiting(waiting: impl Iterator<Item = (uuid::Uuid, u64)>) -> String {
    let mut all: Vec<(uuid::Uuid, u64)> = waiting.collect();
    all.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let rest: u64 = all.iter().skip(WAITING_KEEP).map(|(_, n)| n).sum();
    all.truncate(WAITING_KEEP);
    let top: Vec<serde_json::Value> = all
        .iter()
        .map(|(d, n)| serde_json::json!([d.to_string(), n]))
        .collect();
    serde_json::json!({ "top": top, "rest": rest }).to_string()
}

/// Reads what [`encode_waiting`] wrote: the domains kept, and the sum of the rest. Rows it
/// cannot read are left out.
pub fn decode_waiting(json: &str) -> (Vec<(uuid::Uuid, u64)>, u64) {
    #[derive(serde::Deserialize, Default)]
    struct Stored {
        top: Vec<(String, u64)>,
        rest: u64,
    }
    let stored: Stored = serde_json::from_str(json).unwrap_or_default();
    let top = stored
        .top
        .into_iter()
        .filter_map(|(d, n)| Some((d.parse().ok()?, n)))
        .collect();
    (top, stored.rest)
}

/// Tuning of the gauge.
#[derive(Debug, Clone, Copy)]
pub struct LaneConfig {
    /// How often the lane count is recomputed (by one replica for all).
    pub interval: Duration,
    /// Tasks younger than this are not counted yet.
    pub cutoff: Duration,
    /// How often the count reads the whole queue (and surveys it); in between it is maintained
    /// from what changed.
    pub full_interval: Duration,
    /// How often live leases and the shared count are refreshed (and activity, after a task
    /// notification).
    pub refresh: Duration,
    /// How often activity (for the StreamIsActive push) is checked in Postgres without a task
    /// notification.
    pub activity_check: Duration,
}

/// The gauge of one replica.
pub struct Lanes {
    tasks: Tasks,
    locks: Locks,
    /// Its caps and reserve limit the lanes counted.
    fairness: Fairness,
    config: LaneConfig,
    replica: String,
    state: watch::Sender<Gauge>,
    /// Signalled on every task notification (`dispatch::wakeups`): an inactive queue may have
    /// become active.
    inserted: Arc<tokio::sync::Notify>,
    /// The counter of this replica's last computation, to maintain at its next one.
    kept: tokio::sync::Mutex<Option<Kept>>,
    /// The stamp of the survey whose waiting tasks by domain this replica published last, and
    /// the labels it has published (set to 0 when a later survey leaves them out).
    waiting_published: std::sync::Mutex<(i64, Vec<String>)>,
}

/// A counter kept between computations, and when it last read the whole queue.
struct Kept {
    counter: LaneCounter,
    full_at: Instant,
}

/// A counter tracks at most this many tasks (places and lanes); a queue with more lanes is
/// counted by full passes only, so memory stays bounded.
pub const TRACK_LIMIT: usize = 50_000;

impl Lanes {
    /// Builds the gauge; call [`Lanes::run`] to keep it current.
    pub fn new(
        tasks: Tasks,
        locks: Locks,
        fairness: Fairness,
        config: LaneConfig,
        replica: String,
    ) -> Self {
        Lanes {
            tasks,
            locks,
            fairness,
            config,
            replica,
            state: watch::channel(Gauge::default()).0,
            inserted: Arc::new(tokio::sync::Notify::new()),
            kept: tokio::sync::Mutex::new(None),
            waiting_published: std::sync::Mutex::new((0, Vec::new())),
        }
    }

    /// The value served now.
    pub fn current(&self) -> Gauge {
        *self.state.borrow()
    }

    /// The survey of blocked resources from the last computation (any replica's), and its age;
    /// `None` before the first computation.
    pub async fn survey(&self) -> Result<Option<(Vec<BlockedResource>, Duration)>> {
        let (json, at, now) = self.locks.blocked_survey().await?;
        Ok(json.map(|json| {
            (
                decode_survey(&json),
                Duration::from_millis((now - at).max(0) as u64),
            )
        }))
    }

    /// Computes the lane count and the survey now by reading the whole queue, whoever computed
    /// them last (an operator asking for blocked resources before the first computation, and
    /// tests).
    pub async fn compute_now(&self) -> Result<()> {
        self.compute(true).await.map(|_| ())
    }

    /// Computes the lane count: from what changed since this replica's last computation when
    /// it has one, a full pass was not asked for (`full`) and the last full pass is younger
    /// than `full_interval`; otherwise (or when maintaining would read about as much) from the
    /// whole queue, with a fresh survey. Says which kind it was.
    pub async fn compute(&self, full: bool) -> Result<&'static str> {
        let mut kept = self.kept.lock().await;
        // Taken out: a computation that fails leaves no counter behind, so the next one is full.
        let previous = kept.take();
        let mut maintained = None;
        if let Some(k) =
            previous.filter(|k| !full && k.full_at.elapsed() < self.config.full_interval)
        {
            if let Some(counter) = self
                .tasks
                .maintain_lanes(k.counter, self.config.cutoff, LaneReads::default())
                .await?
            {
                maintained = Some(Kept {
                    counter,
                    full_at: k.full_at,
                });
            }
        }
        let (now, survey, kind) = match maintained {
            Some(k) => (k, None, "maintained"),
            None => {
                let mut counter = self
                    .tasks
                    .count_lanes(self.config.cutoff, TRACK_LIMIT)
                    .await?;
                if !self.tasks.has_lanes_index().await? {
                    // Walking the queue would sort what it reads: full passes only.
                    counter.invalidate();
                }
                let survey = (
                    encode_survey(&counter.most_blocked(SURVEY_KEEP)),
                    encode_waiting(self.waiting_by_group(&counter)),
                );
                let k = Kept {
                    counter,
                    full_at: Instant::now(),
                };
                (k, Some(survey), "full")
            }
        };
        // What the readiness rule counts, limited by fair dispatch's caps and reserve (what
        // holds locks now counts as it is).
        let standing = self.locks.standing().await?;
        let lanes = self.fairness.lanes(now.counter.lanes_by_class(), &standing);
        tracing::trace!(
            lanes,
            uncapped = now.counter.lanes(),
            "lanes under caps and the reserve"
        );
        // The counter stays valid whether or not Redis takes the value.
        *kept = Some(now);
        drop(kept);
        let stamp = self
            .locks
            .store_lanes(
                lanes,
                survey.as_ref().map(|(b, w)| (b.as_str(), w.as_str())),
            )
            .await?;
        metrics::lane_pass(kind);
        self.state.send_modify(|g| {
            g.lanes = lanes;
            g.computed_at_ms = stamp;
            g.observed_at_ms = stamp;
            g.observed_locally = Some(Instant::now());
        });
        Ok(kind)
    }

    /// Watches the served value.
    pub fn subscribe(&self) -> watch::Receiver<Gauge> {
        self.state.subscribe()
    }

    /// What task notifications signal (for `dispatch::wakeups::listen`).
    pub fn insert_signal(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.inserted)
    }

    /// Refreshes every `refresh` until shutdown. Activity is checked in Postgres every
    /// `activity_check`, and at the next refresh after a task notification while the queue is
    /// inactive (the one change that must reach KEDA quickly: scaling from zero). An idle
    /// broker so asks the task table once per `activity_check`, not once per refresh.
    pub async fn run(self: Arc<Self>, shutdown: Shutdown) {
        let mut tick = tokio::time::interval(self.config.refresh);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_check: Option<Instant> = None;
        let mut notified = false;
        loop {
            let inactive = !self.current().active;
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.inserted.notified(), if inactive && !notified => {
                    notified = true;
                    continue;
                }
                _ = shutdown.fired() => return,
            }
            let check =
                notified || last_check.is_none_or(|t| t.elapsed() >= self.config.activity_check);
            let (checked, outcome) = self.refresh_with(check).await;
            if let Err(e) = outcome {
                metrics::lane_error();
                tracing::warn!(error = %e, "refreshing the lane gauge failed; serving the last value");
            }
            // A check that failed (Postgres unreachable) is retried at the next refresh, and a
            // notification waits for a check that succeeds.
            if checked {
                last_check = Some(Instant::now());
                notified = false;
            }
            self.current().publish();
        }
    }

    /// One refresh: activity, live leases, and the shared lane count (computed here when it is
    /// due and no other replica is computing it).
    pub async fn refresh(&self) -> Result<()> {
        self.refresh_with(true).await.1
    }

    /// [`Lanes::refresh`], asking Postgres about activity only when `check_activity`; also says
    /// whether activity was checked successfully.
    async fn refresh_with(&self, check_activity: bool) -> (bool, Result<()>) {
        // Activity needs only Postgres, the shared count only Redis: one failing does not stop
        // the other, and the served value's age keeps growing whichever fails.
        let activity = if check_activity {
            self.tasks.any_incomplete().await.map(Some)
        } else {
            Ok(None)
        };
        let checked = matches!(activity, Ok(Some(_)));
        if let Ok(Some(active)) = activity {
            self.state.send_modify(|g| {
                g.active = active;
                g.activity_known = true;
            });
        }
        let shared = self.refresh_shared().await;
        let outcome = match activity {
            Err(e) => Err(e.into()),
            Ok(_) => shared,
        };
        (checked, outcome)
    }

    async fn refresh_shared(&self) -> Result<()> {
        let (cached, computed_at_ms, now_ms, surveyed_at_ms) = self.locks.lanes_cache().await?;
        let live_leases = self.locks.live_lease_count().await?;
        self.state.send_modify(|g| {
            if let Some(lanes) = cached {
                g.lanes = lanes;
                g.computed_at_ms = computed_at_ms;
            }
            g.observed_at_ms = now_ms;
            g.observed_locally = Some(Instant::now());
            g.live_leases = live_leases;
        });
        self.publish_waiting(surveyed_at_ms).await?;
        let due =
            cached.is_none() || now_ms - computed_at_ms >= self.config.interval.as_millis() as i64;
        if due
            && self
                .locks
                .try_lanes_lock(&self.replica, self.config.interval)
                .await?
        {
            let started = Instant::now();
            let kind = self.compute(false).await?;
            tracing::debug!(lanes = self.current().lanes, kind, took = ?started.elapsed(), "lanes computed");
        }
        Ok(())
    }

    /// The waiting tasks a full pass counted, by group.
    fn waiting_by_group(&self, counter: &LaneCounter) -> impl Iterator<Item = (uuid::Uuid, u64)> {
        let mut by_group: std::collections::HashMap<uuid::Uuid, u64> = Default::default();
        for (class, n) in counter.waiting_by_class() {
            *by_group
                .entry(self.fairness.group_of(class.domain, class.task_group))
                .or_default() += n;
        }
        by_group.into_iter()
    }

    /// Publishes the waiting tasks by group of the survey stamped `surveyed_at_ms`
    /// (`dispatch_group_waiting`), once per survey: domains under their metric label, the rest
    /// as `other`; labels published before and left out now are set to 0.
    async fn publish_waiting(&self, surveyed_at_ms: i64) -> Result<()> {
        let published = self
            .waiting_published
            .lock()
            .map(|p| p.0)
            .unwrap_or_default();
        // Under `--fair-by none` there is one group: no series by group, as for running tasks.
        if surveyed_at_ms == 0
            || surveyed_at_ms == published
            || self.fairness.by() == crate::fair::FairBy::None
        {
            return Ok(());
        }
        let json = self.locks.lanes_waiting().await?.unwrap_or_default();
        let (top, rest) = decode_waiting(&json);
        let mut waiting: std::collections::BTreeMap<String, u64> = Default::default();
        for (group, n) in top {
            let label = self.fairness.label(group);
            *waiting.entry(label).or_default() += n;
        }
        if rest > 0 {
            *waiting.entry("other".into()).or_default() += rest;
        }
        if let Ok(mut p) = self.waiting_published.lock() {
            p.0 = surveyed_at_ms;
            for label in waiting.keys() {
                if !p.1.contains(label) {
                    p.1.push(label.clone());
                }
            }
            metrics::groups_waiting(&waiting, &p.1);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn the_waiting_tasks_by_domain_keep_the_most_waiting_and_sum_the_rest() {
        let domains: Vec<(Uuid, u64)> = (0..WAITING_KEEP as u128 + 3)
            .map(|n| (Uuid::from_u128(n), n as u64 + 1))
            .collect();
        let (top, rest) = decode_waiting(&encode_waiting(domains.iter().copied()));
        assert_eq!(top.len(), WAITING_KEEP);
        assert_eq!(top[0], *domains.last().unwrap(), "the most waiting first");
        // The three domains with the fewest (1, 2 and 3 waiting) are summed.
        assert_eq!(rest, 6);
        assert_eq!(decode_waiting("not json"), (Vec::new(), 0));
    }
}
