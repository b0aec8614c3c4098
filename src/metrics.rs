//! Metric names and the broker's own counters.
//!
//! Every metric name is a const here. `Stats` keeps the counts the broker reports about itself
//! (Postgres statements, Redis calls, fetch outcomes) in atomics, so tests and benchmarks read the
//! exact per-fetch cost; each count also goes to the `metrics` facade.

use std::sync::atomic::{AtomicU64, Ordering};

/// Postgres statements executed.
pub const POSTGRES_STATEMENTS_TOTAL: &str = "dispatch_postgres_statements_total";
/// Redis calls made (script invocations and commands).
pub const REDIS_CALLS_TOTAL: &str = "dispatch_redis_calls_total";
/// FetchTask calls by outcome (`claimed`, `none_ready`, `error`).
pub const FETCH_TOTAL: &str = "dispatch_fetch_total";
/// Locks released, by path (`release`, `finish`, `cancel`, `close`, `fetch_failure`).
pub const LOCKS_RELEASED_TOTAL: &str = "dispatch_locks_released_total";

/// Expired leases swept.
pub const LEASES_SWEPT_TOTAL: &str = "dispatch_leases_swept_total";
/// Locks of finished tasks released by the reconciler.
pub const LOCKS_RECONCILED_TOTAL: &str = "dispatch_locks_reconciled_total";
/// Rebuilds of lost lock state.
pub const LOCK_STATE_REBUILDS_TOTAL: &str = "dispatch_lock_state_rebuilds_total";

/// Describes every metric once, at start-up.
pub fn describe() {
    metrics::describe_counter!(POSTGRES_STATEMENTS_TOTAL, "Postgres statements executed.");
    metrics::describe_counter!(REDIS_CALLS_TOTAL, "Redis script invocations and commands.");
    metrics::describe_counter!(FETCH_TOTAL, "FetchTask calls by outcome.");
    metrics::describe_counter!(LOCKS_RELEASED_TOTAL, "Task locks released, by path.");
    metrics::describe_counter!(LEASES_SWEPT_TOTAL, "Expired leases swept.");
    metrics::describe_counter!(
        LOCKS_RECONCILED_TOTAL,
        "Locks of finished tasks released by the reconciler."
    );
    metrics::describe_counter!(
        LOCK_STATE_REBUILDS_TOTAL,
        "Rebuilds of lock state lost by Redis."
    );
}

/// The broker's own counters.
#[derive(Debug, Default)]
pub struct Stats {
    postgres_statements: AtomicU64,
    redis_calls: AtomicU64,
    fetches: AtomicU64,
    leases_swept: AtomicU64,
    locks_reconciled: AtomicU64,
    rebuilds: AtomicU64,
}

/// A snapshot of [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Postgres statements executed.
    pub postgres_statements: u64,
    /// Redis calls made.
    pub redis_calls: u64,
    /// FetchTask and ClaimTask passes run.
    pub fetches: u64,
    /// Expired leases this replica swept.
    pub leases_swept: u64,
    /// Locks this replica's reconciler released.
    pub locks_reconciled: u64,
    /// Lock-state rebuilds this replica made.
    pub rebuilds: u64,
}

impl Stats {
    /// Counts one Postgres statement.
    pub fn postgres_statement(&self) {
        self.postgres_statements.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(POSTGRES_STATEMENTS_TOTAL).increment(1);
    }

    /// Counts one Redis call.
    pub fn redis_call(&self) {
        self.redis_calls.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(REDIS_CALLS_TOTAL).increment(1);
    }

    /// Counts one fetch with its outcome.
    pub fn fetch(&self, outcome: &'static str) {
        self.fetches.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(FETCH_TOTAL, "outcome" => outcome).increment(1);
    }

    /// Counts released task locks on a path.
    pub fn locks_released(&self, path: &'static str, n: u64) {
        metrics::counter!(LOCKS_RELEASED_TOTAL, "path" => path).increment(n);
    }

    /// Counts one swept lease.
    pub fn lease_swept(&self) {
        self.leases_swept.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(LEASES_SWEPT_TOTAL).increment(1);
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
            fetches: self.fetches.load(Ordering::Relaxed),
            leases_swept: self.leases_swept.load(Ordering::Relaxed),
            locks_reconciled: self.locks_reconciled.load(Ordering::Relaxed),
            rebuilds: self.rebuilds.load(Ordering::Relaxed),
        }
    }
}

impl std::ops::Sub for StatsSnapshot {
    type Output = StatsSnapshot;
    fn sub(self, earlier: StatsSnapshot) -> StatsSnapshot {
        StatsSnapshot {
            postgres_statements: self.postgres_statements - earlier.postgres_statements,
            redis_calls: self.redis_calls - earlier.redis_calls,
            fetches: self.fetches - earlier.fetches,
            leases_swept: self.leases_swept - earlier.leases_swept,
            locks_reconciled: self.locks_reconciled - earlier.locks_reconciled,
            rebuilds: self.rebuilds - earlier.rebuilds,
        }
    }
}
