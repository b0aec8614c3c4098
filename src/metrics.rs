//! Metric names, the broker's own counters, and the Prometheus endpoint.
//!
//! Every metric name is a const here and described once at start-up. `Stats` keeps the counts
//! the broker reports about itself (Postgres statements, Redis calls, fetches, sweeps) in atomics,
//! so tests and benchmarks read exact costs; each count also goes to the `metrics` facade, which
//! the Prometheus recorder renders on `/metrics`. Per-fetch costs are counted with a task-local
//! counter around each fetch pass, so concurrent fetches do not mix.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Instant;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tonic::codegen::http;

/// Postgres statements executed.
pub const POSTGRES_STATEMENTS_TOTAL: &str = "dispatch_postgres_statements_total";
/// Redis calls made (script invocations and commands).
pub const REDIS_CALLS_TOTAL: &str = "dispatch_redis_calls_total";
/// FetchTask calls by outcome (`claimed`, `none_ready`, `error`).
pub const FETCH_TOTAL: &str = "dispatch_fetch_total";
/// Tasks a fetch pass handed to other waiting FetchTask calls than its own (shared scans).
pub const FETCH_SHARED_TOTAL: &str = "dispatch_fetch_shared_total";
/// Fetch passes still running after `--fetch-pass-stall`: calls waiting for them stopped
/// waiting and made passes of their own.
pub const FETCH_PASS_STALLS_TOTAL: &str = "dispatch_fetch_pass_stalls_total";
/// Postgres statements per fetch pass.
pub const FETCH_POSTGRES_STATEMENTS: &str = "dispatch_fetch_postgres_statements";
/// Redis calls per fetch pass.
pub const FETCH_REDIS_CALLS: &str = "dispatch_fetch_redis_calls";
/// Locks released, by path (`release`, `finish`, `cancel`, `close`, `sweep`, `revoke`,
/// `force_release`, `fetch_failure`, `app_status_gone`).
pub const LOCKS_RELEASED_TOTAL: &str = "dispatch_locks_released_total";
/// Expired leases swept.
pub const LEASES_SWEPT_TOTAL: &str = "dispatch_leases_swept_total";
/// Leases ended because their `core_appstatus` row was deleted outside the broker.
pub const LEASES_APP_STATUS_GONE_TOTAL: &str = "dispatch_leases_app_status_gone_total";
/// Locks of finished tasks released by the reconciler.
pub const LOCKS_RECONCILED_TOTAL: &str = "dispatch_locks_reconciled_total";
/// Rebuilds of lost lock state.
pub const LOCK_STATE_REBUILDS_TOTAL: &str = "dispatch_lock_state_rebuilds_total";
/// RPC latency by method and status.
pub const RPC_DURATION_SECONDS: &str = "dispatch_rpc_duration_seconds";
/// Backend errors answered to clients, by backend (`redis`, `postgres`).
pub const BACKEND_ERRORS_TOTAL: &str = "dispatch_backend_errors_total";
/// Failed writes of the workers' `last_heartbeat` (tried again a second later).
pub const HEARTBEAT_WRITE_ERRORS_TOTAL: &str = "dispatch_heartbeat_write_errors_total";
/// Lanes: incomplete tasks no older incomplete task conflicts with.
pub const LANES: &str = "dispatch_lanes";
/// Lanes minus live leases: Pulp's KEDA gauge.
pub const WAITING_TASKS: &str = "dispatch_waiting_tasks";
/// Live leases.
pub const LIVE_LEASES: &str = "dispatch_live_leases";
/// Age of the served lane count.
pub const LANE_AGE_SECONDS: &str = "dispatch_lane_age_seconds";
/// Lane computations by kind: `full` (the whole queue) or `maintained` (what changed since the
/// last).
pub const LANE_PASSES_TOTAL: &str = "dispatch_lane_passes_total";
/// Failed refreshes of the lane gauge.
pub const LANE_ERRORS_TOTAL: &str = "dispatch_lane_errors_total";

/// Audited operator actions, by action (`revoke_lease`, `force_release`).
pub const ADMIN_ACTIONS_TOTAL: &str = "dispatch_admin_actions_total";

/// Leases opened through this replica (per replica: how the fleet spreads over replicas).
pub const LEASES_OPENED_TOTAL: &str = "dispatch_leases_opened_total";

/// Grants a worker reported it never received (Heartbeat's `undelivered`) that went back to
/// the queue.
pub const UNDELIVERED_GRANTS_TOTAL: &str = "dispatch_undelivered_grants_total";

/// Pending-list pages of the GIN index on reserved resources merged by the broker
/// (`--gin-clean-interval`).
pub const GIN_PENDING_MERGED_PAGES_TOTAL: &str = "dispatch_gin_pending_merged_pages_total";

/// Background walks from the queue's head that renewed the scan hint (`--fetch-hint-max-age`).
pub const FETCH_HINT_WALKS_TOTAL: &str = "dispatch_fetch_hint_walks_total";

/// Fetch passes that started where the resource queues put the first waiting lane, instead of at
/// the queue's head or their scan hint.
pub const FETCH_QUEUE_STARTS_TOTAL: &str = "dispatch_fetch_queue_starts_total";

/// Fetch passes that used a scan hint read against the change log shortly before, without
/// reading the log (or the lease) again first.
pub const FETCH_HINTS_TRUSTED_TOTAL: &str = "dispatch_fetch_hints_trusted_total";

/// Fetch passes that took the changes since their scan hint from what this replica's own calls
/// recorded (they alone changed the log since), without reading the log (or the lease).
pub const FETCH_OWN_CHANGES_TOTAL: &str = "dispatch_fetch_own_changes_total";

/// Fetch passes that judged the tasks carried with their scan hint (the rest of the page the pass
/// before them read) instead of reading a first page.
pub const FETCH_PAGES_CARRIED_TOTAL: &str = "dispatch_fetch_pages_carried_total";

/// Directed passes of fair dispatch, by outcome: `granted` (the caller got a task) or `dry`
/// (nothing ready in that page).
pub const FAIR_DIRECTED_PASSES_TOTAL: &str = "dispatch_fair_directed_passes_total";

/// Ready tasks fairness held back at the acquire, by why: `cap` (its group is at its cap) or
/// `reserve` (kept for immediate tasks).
pub const FAIR_HELD_BACK_TOTAL: &str = "dispatch_fair_held_back_total";

/// Fairness policy files refused (they did not parse, or named a bad value); the policy in force
/// stayed.
pub const FAIR_POLICY_REFUSED_TOTAL: &str = "dispatch_fair_policy_refused_total";

/// Seconds from a task's creation to its grant, by group (the first `--fair-metric-groups`
/// groups seen by name or id, the rest as `other`).
pub const TASK_WAIT_SECONDS: &str = "dispatch_task_wait_seconds";

/// Seconds from a task's start to its final state, by group (labelled as
/// [`TASK_WAIT_SECONDS`]): recorded when the broker records the final state (FinishTask) or
/// releases the locks of a task Pulp ended (ReleaseLocks).
pub const TASK_RUN_SECONDS: &str = "dispatch_task_run_seconds";

/// Tasks holding locks (claimed or running, on every replica) by group, as each replica read it
/// last (every `--fair-refresh`): the first `--fair-metric-groups` groups seen by name or id,
/// the rest summed as `other`.
pub const GROUP_RUNNING: &str = "dispatch_group_running";

/// Waiting tasks by group (labelled as [`TASK_WAIT_SECONDS`]), as the last full lane pass counted
/// them (every `--lane-full-interval`; tasks younger than `--lane-cutoff` not yet).
pub const GROUP_WAITING: &str = "dispatch_group_waiting";

/// Every metric name above (the dashboard test checks its queries against this list).
pub const ALL: &[&str] = &[
    POSTGRES_STATEMENTS_TOTAL,
    REDIS_CALLS_TOTAL,
    FETCH_TOTAL,
    FETCH_SHARED_TOTAL,
    FETCH_PASS_STALLS_TOTAL,
    FETCH_POSTGRES_STATEMENTS,
    FETCH_REDIS_CALLS,
    LOCKS_RELEASED_TOTAL,
    LEASES_SWEPT_TOTAL,
    LEASES_APP_STATUS_GONE_TOTAL,
    LOCKS_RECONCILED_TOTAL,
    LOCK_STATE_REBUILDS_TOTAL,
    RPC_DURATION_SECONDS,
    BACKEND_ERRORS_TOTAL,
    HEARTBEAT_WRITE_ERRORS_TOTAL,
    LANES,
    WAITING_TASKS,
    LIVE_LEASES,
    LANE_AGE_SECONDS,
    LANE_ERRORS_TOTAL,
    LANE_PASSES_TOTAL,
    ADMIN_ACTIONS_TOTAL,
    LEASES_OPENED_TOTAL,
    UNDELIVERED_GRANTS_TOTAL,
    GIN_PENDING_MERGED_PAGES_TOTAL,
    FETCH_HINT_WALKS_TOTAL,
    FETCH_QUEUE_STARTS_TOTAL,
    FETCH_HINTS_TRUSTED_TOTAL,
    FETCH_OWN_CHANGES_TOTAL,
    FETCH_PAGES_CARRIED_TOTAL,
    FAIR_DIRECTED_PASSES_TOTAL,
    FAIR_HELD_BACK_TOTAL,
    FAIR_POLICY_REFUSED_TOTAL,
    TASK_WAIT_SECONDS,
    TASK_RUN_SECONDS,
    GROUP_RUNNING,
    GROUP_WAITING,
];

/// Describes every metric once, at start-up.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(POSTGRES_STATEMENTS_TOTAL, "Postgres statements executed.");
    describe_counter!(
        FAIR_DIRECTED_PASSES_TOTAL,
        "Directed passes of fair dispatch by outcome (granted, dry)."
    );
    describe_counter!(
        FAIR_HELD_BACK_TOTAL,
        "Ready tasks held back at the acquire by fairness, by why (cap, reserve)."
    );
    describe_counter!(
        FAIR_POLICY_REFUSED_TOTAL,
        "Fairness policy files refused; the policy in force stayed."
    );
    describe_gauge!(
        GROUP_RUNNING,
        "Tasks holding locks (claimed or running, every replica) by group."
    );
    describe_histogram!(
        TASK_WAIT_SECONDS,
        Unit::Seconds,
        "Seconds from a task's creation to its grant, by group."
    );
    describe_gauge!(
        GROUP_WAITING,
        "Waiting tasks by group, as the last full lane pass counted them."
    );
    describe_histogram!(
        TASK_RUN_SECONDS,
        Unit::Seconds,
        "Seconds from a task's start to its final state, by group."
    );
    describe_counter!(REDIS_CALLS_TOTAL, "Redis script invocations and commands.");
    describe_counter!(FETCH_TOTAL, "FetchTask calls by outcome.");
    describe_counter!(
        FETCH_SHARED_TOTAL,
        "Tasks a fetch pass handed to other waiting FetchTask calls than its own."
    );
    describe_counter!(
        FETCH_PASS_STALLS_TOTAL,
        "Fetch passes still running after --fetch-pass-stall (the calls waiting for them made passes of their own)."
    );
    describe_histogram!(
        FETCH_POSTGRES_STATEMENTS,
        "Postgres statements per fetch pass."
    );
    describe_histogram!(FETCH_REDIS_CALLS, "Redis calls per fetch pass.");
    describe_counter!(LOCKS_RELEASED_TOTAL, "Task locks released, by path.");
    describe_counter!(LEASES_SWEPT_TOTAL, "Expired leases swept.");
    describe_counter!(
        LEASES_APP_STATUS_GONE_TOTAL,
        "Leases ended because their core_appstatus row was deleted outside the broker."
    );
    describe_counter!(
        LOCKS_RECONCILED_TOTAL,
        "Locks of finished tasks released by the reconciler."
    );
    describe_counter!(
        LOCK_STATE_REBUILDS_TOTAL,
        "Rebuilds of lock state lost by Redis."
    );
    describe_histogram!(
        RPC_DURATION_SECONDS,
        Unit::Seconds,
        "RPC latency by method and status."
    );
    describe_counter!(
        BACKEND_ERRORS_TOTAL,
        "Backend errors answered to clients, by backend."
    );
    describe_counter!(
        HEARTBEAT_WRITE_ERRORS_TOTAL,
        "Failed writes of the workers' last_heartbeat (tried again a second later)."
    );
    describe_gauge!(
        LANES,
        "Incomplete tasks that no older incomplete task conflicts with."
    );
    describe_gauge!(
        WAITING_TASKS,
        "Lanes minus live leases (Pulp's KEDA gauge)."
    );
    describe_gauge!(LIVE_LEASES, "Live worker leases.");
    describe_gauge!(
        LANE_AGE_SECONDS,
        Unit::Seconds,
        "Age of the served lane count."
    );
    describe_counter!(LANE_ERRORS_TOTAL, "Failed refreshes of the lane gauge.");
    describe_counter!(
        LANE_PASSES_TOTAL,
        "Lane computations by kind: full (the whole queue) or maintained (what changed)."
    );
    describe_counter!(LEASES_OPENED_TOTAL, "Leases opened through this replica.");
    describe_counter!(
        UNDELIVERED_GRANTS_TOTAL,
        "Grants a worker reported it never received, put back in the queue."
    );
    describe_counter!(
        GIN_PENDING_MERGED_PAGES_TOTAL,
        "Pending-list pages of the GIN index on reserved resources merged by the broker."
    );
    describe_counter!(
        FETCH_HINT_WALKS_TOTAL,
        "Background walks from the queue's head that renewed the scan hint."
    );
    describe_counter!(
        FETCH_QUEUE_STARTS_TOTAL,
        "Fetch passes that started where the resource queues put the first waiting lane, instead of at the queue's head or their scan hint."
    );
    describe_counter!(
        FETCH_HINTS_TRUSTED_TOTAL,
        "Fetch passes that used a scan hint read against the change log shortly before, without reading the log (or the lease) again first."
    );
    describe_counter!(
        FETCH_OWN_CHANGES_TOTAL,
        "Fetch passes that took the changes since their scan hint from what this replica's own calls recorded (they alone changed the log since), without reading the log (or the lease)."
    );
    describe_counter!(
        FETCH_PAGES_CARRIED_TOTAL,
        "Fetch passes that judged the tasks carried with their scan hint (the rest of the page the pass before them read) instead of reading a first page."
    );
    describe_counter!(
        ADMIN_ACTIONS_TOTAL,
        "Audited operator actions (revoke_lease, force_release)."
    );
}

static RECORDER: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder (once per process) and returns its handle; `None` when
/// another recorder was installed first.
pub fn recorder() -> Option<PrometheusHandle> {
    RECORDER
        .get_or_init(|| {
            let latency = [
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
            ];
            let counts = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0];
            // A task's wait and run: from 10 ms to 4 hours.
            let durations = [
                0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0,
            ];
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(RPC_DURATION_SECONDS.into()), &latency)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Suffix("_statements".into()), &counts)
                })
                .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_calls".into()), &counts))
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(TASK_WAIT_SECONDS.into()), &durations)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(TASK_RUN_SECONDS.into()), &durations)
                })
                .and_then(|b| b.install_recorder())
                .map_err(|e| tracing::warn!(error = %e, "no prometheus recorder"))
                .ok();
            describe();
            handle
        })
        .clone()
}

/// Serves `GET /metrics` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    handle: PrometheusHandle,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            async move {
                (
                    [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    handle.render(),
                )
            }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Counts one audited operator action.
pub fn admin_action(action: &'static str) {
    metrics::counter!(ADMIN_ACTIONS_TOTAL, "action" => action).increment(1);
}

/// Counts a lane computation of this kind (`full` or `maintained`).
pub fn lane_pass(kind: &'static str) {
    metrics::counter!(LANE_PASSES_TOTAL, "kind" => kind).increment(1);
}

/// Counts pending-list pages of the GIN index merged into it.
pub fn gin_pending_merged(pages: u64) {
    metrics::counter!(GIN_PENDING_MERGED_PAGES_TOTAL).increment(pages);
}

/// Sets the waiting tasks of each group label (labels not given are set to 0).
pub fn groups_waiting(waiting: &std::collections::BTreeMap<String, u64>, all: &[String]) {
    for label in all {
        let n = waiting.get(label).copied().unwrap_or(0);
        metrics::gauge!(GROUP_WAITING, "group" => label.clone()).set(n as f64);
    }
}

/// Counts a failed refresh of the lane gauge.
pub fn lane_error() {
    metrics::counter!(LANE_ERRORS_TOTAL).increment(1);
}

/// Counts a failed write of the workers' `last_heartbeat`.
pub fn heartbeat_write_error() {
    metrics::counter!(HEARTBEAT_WRITE_ERRORS_TOTAL).increment(1);
}

/// Counts a backend error answered to a client.
pub fn backend_error(backend: &'static str) {
    metrics::counter!(BACKEND_ERRORS_TOTAL, "backend" => backend).increment(1);
}

/// Calls made by one fetch pass, shared with the tasks it spawns (see [`pass_calls`]). The tally
/// is recorded when the pass and every task it spawned are done with it (the last clone
/// dropped), so a step that outlives the pass (a grant being delivered) is counted in its pass
/// too.
#[derive(Debug, Clone)]
pub struct PassCalls(Arc<PassTally>);

#[derive(Debug)]
struct PassTally {
    postgres: AtomicU64,
    redis: AtomicU64,
    stats: Arc<Stats>,
}

impl Drop for PassTally {
    fn drop(&mut self) {
        let (postgres, redis) = (
            self.postgres.load(Ordering::Relaxed),
            self.redis.load(Ordering::Relaxed),
        );
        self.stats
            .fetch_postgres_statements
            .fetch_add(postgres, Ordering::Relaxed);
        self.stats
            .fetch_redis_calls
            .fetch_add(redis, Ordering::Relaxed);
        metrics::histogram!(FETCH_POSTGRES_STATEMENTS).record(postgres as f64);
        metrics::histogram!(FETCH_REDIS_CALLS).record(redis as f64);
    }
}

/// The counters of the fetch pass this task runs in, if any: a task the pass spawns counts its
/// calls in them through [`counted_in`].
pub fn pass_calls() -> Option<PassCalls> {
    PASS.try_with(PassCalls::clone).ok()
}

/// Runs `future` with its calls counted in `calls` (those of the pass that spawned it).
pub async fn counted_in<T>(
    calls: Option<PassCalls>,
    future: impl std::future::Future<Output = T>,
) -> T {
    match calls {
        Some(calls) => PASS.scope(calls, future).await,
        None => future.await,
    }
}

tokio::task_local! {
    static PASS: PassCalls;
}

/// Runs one fetch pass, recording how many Postgres statements and Redis calls it made (in
/// `stats` and in the per-pass histograms) once it and the tasks it spawned are done.
pub async fn count_pass<T>(stats: &Arc<Stats>, pass: impl std::future::Future<Output = T>) -> T {
    let calls = PassCalls(Arc::new(PassTally {
        postgres: AtomicU64::new(0),
        redis: AtomicU64::new(0),
        stats: Arc::clone(stats),
    }));
    PASS.scope(calls, pass).await
}

/// The broker's own counters.
#[derive(Debug, Default)]
pub struct Stats {
    postgres_statements: AtomicU64,
    redis_calls: AtomicU64,
    fetch_postgres_statements: AtomicU64,
    fetch_redis_calls: AtomicU64,
    fetch_passes: AtomicU64,
    shared: AtomicU64,
    stalls: AtomicU64,
    leases_swept: AtomicU64,
    locks_reconciled: AtomicU64,
    rebuilds: AtomicU64,
    hint_walks: AtomicU64,
    queue_starts: AtomicU64,
    hints_trusted: AtomicU64,
    own_changes: AtomicU64,
    pages_carried: AtomicU64,
    directed_passes: AtomicU64,
    directed_dry: AtomicU64,
}

/// A snapshot of [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Postgres statements executed.
    pub postgres_statements: u64,
    /// Redis calls made.
    pub redis_calls: u64,
    /// Postgres statements made by fetch passes themselves (not by the background work that
    /// shares these counters, such as the resource queues' catch-ups or a hint's walk).
    pub fetch_postgres_statements: u64,
    /// Redis calls made by fetch passes themselves.
    pub fetch_redis_calls: u64,
    /// Fetch passes run: what the count of `dispatch_fetch_postgres_statements` (one
    /// observation per pass) shows once no pass runs.
    pub fetch_passes: u64,
    /// Tasks passes handed to other waiting calls than their own.
    pub shared: u64,
    /// Passes still running after `--fetch-pass-stall`.
    pub stalls: u64,
    /// Expired leases this replica swept.
    pub leases_swept: u64,
    /// Locks this replica's reconciler released.
    pub locks_reconciled: u64,
    /// Lock-state rebuilds this replica made.
    pub rebuilds: u64,
    /// Background walks that renewed this replica's scan hint.
    pub hint_walks: u64,
    /// Passes that started where the resource queues said.
    pub queue_starts: u64,
    /// Passes that trusted their scan hint (no change log read first).
    pub hints_trusted: u64,
    /// Passes that took the changes since their hint from this replica's own calls.
    pub own_changes: u64,
    /// Passes that judged a carried page instead of reading a first page.
    pub pages_carried: u64,
    /// Fair dispatch's directed passes made.
    pub directed_passes: u64,
    /// Directed passes that handed out nothing.
    pub directed_dry: u64,
}

impl Stats {
    /// Counts one Postgres statement.
    pub fn postgres_statement(&self) {
        self.postgres_statements.fetch_add(1, Ordering::Relaxed);
        let _ = PASS.try_with(|c| c.0.postgres.fetch_add(1, Ordering::Relaxed));
        metrics::counter!(POSTGRES_STATEMENTS_TOTAL).increment(1);
    }

    /// Counts one Redis call.
    pub fn redis_call(&self) {
        self.redis_calls.fetch_add(1, Ordering::Relaxed);
        let _ = PASS.try_with(|c| c.0.redis.fetch_add(1, Ordering::Relaxed));
        metrics::counter!(REDIS_CALLS_TOTAL).increment(1);
    }

    /// Counts one FetchTask call by its outcome.
    pub fn fetch(&self, outcome: &'static str) {
        metrics::counter!(FETCH_TOTAL, "outcome" => outcome).increment(1);
    }

    /// Counts one pass over the queue (a waiting FetchTask makes several).
    pub fn fetch_pass(&self) {
        self.fetch_passes.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one task a pass handed to another waiting call than its own.
    pub fn fetch_shared(&self) {
        self.shared.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(FETCH_SHARED_TOTAL).increment(1);
    }

    /// Counts a background walk that renewed the scan hint.
    pub fn hint_walk(&self) {
        self.hint_walks.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(FETCH_HINT_WALKS_TOTAL).increment(1);
    }

    /// Counts a pass that started where the resource queues said.
    pub fn queue_start(&self) {
        self.queue_starts.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(FETCH_QUEUE_STARTS_TOTAL).increment(1);
    }

    /// Counts a fetch pass that trusted its scan hint.
    pub fn hint_trusted(&self) {
        self.hints_trusted.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(FETCH_HINTS_TRUSTED_TOTAL).increment(1);
    }

    /// Counts a fetch pass that took the changes since its hint from this replica's own calls.
    pub fn own_changes_used(&self) {
        self.own_changes.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(FETCH_OWN_CHANGES_TOTAL).increment(1);
    }

    /// Counts a fetch pass that judged a carried page instead of reading a first page.
    pub fn page_carried(&self) {
        self.pages_carried.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(FETCH_PAGES_CARRIED_TOTAL).increment(1);
    }

    /// Counts a directed pass of fair dispatch.
    pub fn directed_pass(&self, granted: bool) {
        self.directed_passes.fetch_add(1, Ordering::Relaxed);
        if !granted {
            self.directed_dry.fetch_add(1, Ordering::Relaxed);
        }
        metrics::counter!(FAIR_DIRECTED_PASSES_TOTAL, "outcome" => if granted { "granted" } else { "dry" })
            .increment(1);
    }

    /// Counts a ready task fairness held back.
    pub fn held_back(&self, why: &'static str) {
        metrics::counter!(FAIR_HELD_BACK_TOTAL, "why" => why).increment(1);
    }

    /// Counts a refused policy file.
    pub fn policy_refused(&self) {
        metrics::counter!(FAIR_POLICY_REFUSED_TOTAL).increment(1);
    }

    /// Sets the tasks holding locks of each group label (labels not given are set to 0).
    pub fn groups_running(
        &self,
        running: &std::collections::BTreeMap<String, u32>,
        all: &[String],
    ) {
        for label in all {
            let n = running.get(label).copied().unwrap_or(0);
            metrics::gauge!(GROUP_RUNNING, "group" => label.clone()).set(f64::from(n));
        }
    }

    /// Records how long a granted task waited, under its group's label.
    pub fn task_waited(&self, group: String, seconds: f64) {
        metrics::histogram!(TASK_WAIT_SECONDS, "group" => group).record(seconds);
    }

    /// Records how long a task that ended ran, under its group's label.
    pub fn task_ran(&self, group: String, seconds: f64) {
        metrics::histogram!(TASK_RUN_SECONDS, "group" => group).record(seconds);
    }

    /// Counts a fetch pass that outlasted `--fetch-pass-stall`.
    pub fn fetch_pass_stalled(&self) {
        self.stalls.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(FETCH_PASS_STALLS_TOTAL).increment(1);
    }

    /// Counts released task locks on a path.
    pub fn locks_released(&self, path: &'static str, n: u64) {
        metrics::counter!(LOCKS_RELEASED_TOTAL, "path" => path).increment(n);
    }

    /// Counts a grant its worker never received, put back in the queue.
    pub fn undelivered_returned(&self) {
        metrics::counter!(UNDELIVERED_GRANTS_TOTAL).increment(1);
    }

    /// Counts one lease opened through this replica.
    pub fn lease_opened(&self) {
        metrics::counter!(LEASES_OPENED_TOTAL).increment(1);
    }

    /// Counts one swept lease.
    pub fn lease_swept(&self) {
        self.leases_swept.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(LEASES_SWEPT_TOTAL).increment(1);
    }

    /// Counts one lease ended because its `core_appstatus` row is gone.
    pub fn lease_app_status_gone(&self) {
        metrics::counter!(LEASES_APP_STATUS_GONE_TOTAL).increment(1);
    }

    /// Counts one reconciled lock.
    pub fn lock_reconciled(&self) {
        self.locks_reconciled.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(LOCKS_RECONCILED_TOTAL).increment(1);
    }

    /// Counts one rebuild of lost lock state.
    pub fn rebuild(&self) {
        self.rebuilds.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(LOCK_STATE_REBUILDS_TOTAL).increment(1);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            postgres_statements: self.postgres_statements.load(Ordering::Relaxed),
            redis_calls: self.redis_calls.load(Ordering::Relaxed),
            fetch_postgres_statements: self.fetch_postgres_statements.load(Ordering::Relaxed),
            fetch_redis_calls: self.fetch_redis_calls.load(Ordering::Relaxed),
            fetch_passes: self.fetch_passes.load(Ordering::Relaxed),
            shared: self.shared.load(Ordering::Relaxed),
            stalls: self.stalls.load(Ordering::Relaxed),
            leases_swept: self.leases_swept.load(Ordering::Relaxed),
            locks_reconciled: self.locks_reconciled.load(Ordering::Relaxed),
            rebuilds: self.rebuilds.load(Ordering::Relaxed),
            hint_walks: self.hint_walks.load(Ordering::Relaxed),
            queue_starts: self.queue_starts.load(Ordering::Relaxed),
            hints_trusted: self.hints_trusted.load(Ordering::Relaxed),
            own_changes: self.own_changes.load(Ordering::Relaxed),
            pages_carried: self.pages_carried.load(Ordering::Relaxed),
            directed_passes: self.directed_passes.load(Ordering::Relaxed),
            directed_dry: self.directed_dry.load(Ordering::Relaxed),
        }
    }
}

impl std::ops::Sub for StatsSnapshot {
    type Output = StatsSnapshot;
    fn sub(self, earlier: StatsSnapshot) -> StatsSnapshot {
        StatsSnapshot {
            postgres_statements: self.postgres_statements - earlier.postgres_statements,
            redis_calls: self.redis_calls - earlier.redis_calls,
            fetch_postgres_statements: self.fetch_postgres_statements
                - earlier.fetch_postgres_statements,
            fetch_redis_calls: self.fetch_redis_calls - earlier.fetch_redis_calls,
            fetch_passes: self.fetch_passes - earlier.fetch_passes,
            shared: self.shared - earlier.shared,
            stalls: self.stalls - earlier.stalls,
            leases_swept: self.leases_swept - earlier.leases_swept,
            locks_reconciled: self.locks_reconciled - earlier.locks_reconciled,
            rebuilds: self.rebuilds - earlier.rebuilds,
            hint_walks: self.hint_walks - earlier.hint_walks,
            queue_starts: self.queue_starts - earlier.queue_starts,
            hints_trusted: self.hints_trusted - earlier.hints_trusted,
            own_changes: self.own_changes - earlier.own_changes,
            pages_carried: self.pages_carried - earlier.pages_carried,
            directed_passes: self.directed_passes - earlier.directed_passes,
            directed_dry: self.directed_dry - earlier.directed_dry,
        }
    }
}

/// A tower layer that records every RPC's latency by method and gRPC status.
#[derive(Debug, Clone, Copy, Default)]
pub struct RpcMetricsLayer;

impl<S> tower::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetrics<S>;
    fn layer(&self, inner: S) -> RpcMetrics<S> {
        RpcMetrics { inner }
    }
}

/// See [`RpcMetricsLayer`].
#[derive(Debug, Clone)]
pub struct RpcMetrics<S> {
    inner: S,
}

impl<S, B, RB> tower::Service<http::Request<B>> for RpcMetrics<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>> + Send,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = request
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        let started = Instant::now();
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await;
            let status = match &response {
                Ok(r) => r
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .map(|code| format!("{:?}", tonic::Code::from(code)))
                    .unwrap_or_else(|| "Ok".to_owned()),
                Err(_) => "TransportError".to_owned(),
            };
            metrics::histogram!(RPC_DURATION_SECONDS, "method" => method, "status" => status)
                .record(started.elapsed().as_secs_f64());
            response
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{count_pass, counted_in, pass_calls, Stats};
    use std::sync::Arc;

    /// A step a pass spawned (a grant being delivered, say) is counted in that pass, also when
    /// it makes its calls after the pass returned; the pass is recorded once both are done.
    #[tokio::test]
    async fn a_step_that_outlives_its_pass_is_counted_in_it() {
        let stats = Arc::new(Stats::default());
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let step = count_pass(&stats, async {
            stats.postgres_statement();
            let stats = Arc::clone(&stats);
            let step = tokio::spawn(counted_in(pass_calls(), async move {
                wait.await.unwrap();
                stats.postgres_statement();
                stats.redis_call();
            }));
            Some(step)
        })
        .await
        .expect("spawned");
        // Not recorded while the step may still count.
        assert_eq!(stats.snapshot().fetch_postgres_statements, 0);
        go.send(()).unwrap();
        step.await.unwrap();
        let done = stats.snapshot();
        assert_eq!(
            (done.fetch_postgres_statements, done.fetch_redis_calls),
            (2, 1)
        );
        // Calls outside any pass are not a pass's.
        stats.postgres_statement();
        assert_eq!(stats.snapshot().fetch_postgres_statements, 2);
        assert_eq!(stats.snapshot().postgres_statements, 3);
    }

    #[test]
    fn all_lists_every_metric_name() {
        let source = include_str!("metrics.rs");
        let declared: Vec<&str> = source
            .lines()
            .filter_map(|l| l.strip_prefix("pub const "))
            .filter_map(|l| l.split('"').nth(1))
            .collect();
        assert!(declared.len() > 10);
        for name in declared {
            assert!(super::ALL.contains(&name), "{name} is missing from ALL");
        }
    }

    /// docs/metrics.md lists exactly the metrics there are, each with the type it is described
    /// with here, so the reference cannot drift from the code.
    #[test]
    fn the_metrics_reference_lists_every_metric_with_its_type() {
        let source = include_str!("metrics.rs");
        let consts: std::collections::BTreeMap<&str, &str> = source
            .lines()
            .filter_map(|l| l.strip_prefix("pub const "))
            .filter_map(|l| Some((l.split(':').next()?, l.split('"').nth(1)?)))
            .collect();
        let mut described = std::collections::BTreeMap::new();
        for kind in ["counter", "gauge", "histogram"] {
            let call = format!("describe_{kind}!(");
            for (at, _) in source.match_indices(&call) {
                let name = source[at + call.len()..]
                    .trim_start()
                    .split(|c: char| c == ',' || c.is_whitespace())
                    .next()
                    .unwrap();
                if let Some(metric) = consts.get(name) {
                    described.insert(metric.to_string(), kind.to_string());
                }
            }
        }
        assert_eq!(
            described.len(),
            super::ALL.len(),
            "every metric is described"
        );

        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md"))
            .expect("docs/metrics.md");
        let mut documented = std::collections::BTreeMap::new();
        for row in doc.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`').to_string();
            assert!(
                documented
                    .insert(name.clone(), cells[2].to_string())
                    .is_none(),
                "{name} is listed twice in docs/metrics.md"
            );
        }
        assert_eq!(
            documented, described,
            "docs/metrics.md (left) against src/metrics.rs (right): name and type"
        );
    }
}
