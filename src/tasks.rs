//! Postgres: the task table (`core_task`) and worker rows (`core_appstatus`). The only module that
//! runs SQL. Every statement is a `.sql` file beside this module, prepared at start-up so a broken
//! query or a missing column fails at boot.
//!
//! This module never decides readiness; it reports the facts (`older_conflicts`) that
//! `ready::judge` decides on.

pub mod gin;
mod lanes;
pub use lanes::{LaneReads, Survey};
pub mod migrate;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row};
use uuid::Uuid;

use crate::ids::TaskId;

use crate::metrics::Stats;
use crate::ready::{Candidate, Key, LaneCounter, Repair, Resources, Seen};
use crate::states::TaskState;

/// Every statement the broker runs, by name, for preparing at start-up.
pub mod sql {
    use std::sync::LazyLock;

    /// A statement of one file, with the task state lists written in ([`crate::states::in_sql`]).
    macro_rules! with_states {
        ($file:literal) => {
            LazyLock::new(|| crate::states::in_sql(include_str!($file)))
        };
    }

    /// The planner settings queue_page.sql is read under (see the file).
    pub const QUEUE_PAGE_SETTINGS: &str = include_str!("tasks/queue_page_settings.sql");
    /// The planner settings candidates.sql is read under (see the file).
    pub const CANDIDATES_SETTINGS: &str = include_str!("tasks/candidates_settings.sql");
    /// candidates.sql as it runs (with held.sql's and writers.sql's CTEs in front and the
    /// readiness look-up written in), but for its page size (`$page_size`, see
    /// `candidates_sql`).
    pub static CANDIDATES: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        with_readiness_lookup(
            concat!(
                include_str!("tasks/held.sql"),
                ",\n",
                include_str!("tasks/writers.sql"),
                include_str!("tasks/candidates.sql")
            ),
            ["$4", "$5", "$6", "$7"],
        )
    });
    /// task.sql as it runs, with the readiness look-up written in.
    pub static TASK: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        with_readiness_lookup(include_str!("tasks/task.sql"), ["$2", "$3", "$4", "$5"])
    });
    /// The exact readiness look-up candidates.sql and task.sql share (see the file).
    const READINESS_LOOKUP: &str = include_str!("tasks/readiness_lookup.sql");

    /// `statement` with readiness_lookup.sql in place of its `-- $readiness_lookup` line, its
    /// parameters named as `params` (the end of the queue's head, then the busy queues).
    fn with_readiness_lookup(statement: &str, params: [&str; 4]) -> String {
        let [near_created, near_id, busy_entries, busy_users] = params;
        let lookup = READINESS_LOOKUP
            .replace("$near_created", near_created)
            .replace("$near_id", near_id)
            .replace("$busy_entries", busy_entries)
            .replace("$busy_users", busy_users)
            .replace("$long_queue", &crate::ready::LONG_QUEUE.to_string());
        assert_eq!(
            statement.matches("\n-- $readiness_lookup\n").count(),
            1,
            "one place for the readiness look-up"
        );
        let composed = crate::states::in_sql(
            &statement.replace("\n-- $readiness_lookup\n", &format!("\n{lookup}")),
        );
        assert!(
            !composed.contains("$near_")
                && !composed.contains("$busy_")
                && !composed.contains("$long_"),
            "a placeholder of readiness_lookup.sql was left unnamed"
        );
        composed
    }
    pub const CLAIM: &str = include_str!("tasks/claim.sql");
    pub const CLAIM_ROUND: &str = include_str!("tasks/claim_round.sql");
    pub static REQUEUE: LazyLock<String> = with_states!("tasks/requeue.sql");
    pub const START: &str = include_str!("tasks/start.sql");
    pub const STARTED: &str = include_str!("tasks/started.sql");
    pub static FINISH: LazyLock<String> = with_states!("tasks/finish.sql");
    /// finish.sql waiting for rows another transaction holds, for a task the batch skipped.
    pub static FINISH_WAITING: LazyLock<String> = LazyLock::new(|| {
        FINISH.replace(
            "FOR NO KEY UPDATE OF t SKIP LOCKED",
            "FOR NO KEY UPDATE OF t",
        )
    });
    pub const TASK_STATE: &str = include_str!("tasks/task_state.sql");
    pub const CANCEL: &str = include_str!("tasks/cancel.sql");
    pub const INSERT_APP_STATUS: &str = include_str!("tasks/insert_app_status.sql");
    pub const APP_STATUS_EXISTS: &str = include_str!("tasks/app_status_exists.sql");
    pub const HEARTBEAT: &str = include_str!("tasks/heartbeat.sql");
    pub const REQUEUE_CLAIMED: &str = include_str!("tasks/requeue_claimed.sql");
    pub const FAIL_RUNNING: &str = include_str!("tasks/fail_running.sql");
    pub const DELETE_APP_STATUS: &str = include_str!("tasks/delete_app_status.sql");
    pub const SCHEMA_CHECK: &str = include_str!("tasks/schema_check.sql");
    pub static MIGRATE: LazyLock<String> = with_states!("tasks/migrate.sql");
    pub const LANES_INDEX: &str = include_str!("tasks/lanes_index.sql");
    pub const FAIR_INDEXES: &str = include_str!("tasks/fair_indexes.sql");
    /// groups_waiting.sql by domain.
    pub static GROUPS_WAITING: LazyLock<String> = LazyLock::new(|| {
        include_str!("tasks/groups_waiting.sql").replace("$group", super::DOMAIN_GROUP)
    });
    /// groups_waiting.sql by task group.
    pub static GROUPS_WAITING_BY_TASK_GROUP: LazyLock<String> = LazyLock::new(|| {
        include_str!("tasks/groups_waiting.sql").replace("$group", super::TASK_GROUP_GROUP)
    });
    pub const DOMAIN_NAMES: &str = include_str!("tasks/domain_names.sql");
    pub const DOMAIN_TABLE: &str = include_str!("tasks/domain_table.sql");
    pub const NOTIFY_TRIGGER: &str = include_str!("tasks/notify_trigger.sql");
    pub const GIN_FASTUPDATE: &str = include_str!("tasks/gin_fastupdate.sql");
    pub const GIN_CLEAN: &str = include_str!("tasks/gin_clean.sql");
    pub const END_TASKS: &str = include_str!("tasks/end_tasks.sql");
    pub static LOCK_TARGETS: LazyLock<String> = with_states!("tasks/lock_targets.sql");
    pub static CLAIMED_SINCE: LazyLock<String> = with_states!("tasks/claimed_since.sql");
    pub static CLAIMED_TASKS: LazyLock<String> = with_states!("tasks/claimed_tasks.sql");
    pub const LANES: &str = include_str!("tasks/lanes.sql");
    pub const LANES_NEWER: &str = include_str!("tasks/lanes_newer.sql");
    pub const LANES_LATE: &str = concat!(
        "WITH\n",
        include_str!("tasks/writers.sql"),
        include_str!("tasks/lanes_late.sql")
    );
    pub const LANES_GONE: &str = include_str!("tasks/lanes_gone.sql");
    pub const QUEUE_PAGE: &str = include_str!("tasks/queue_page.sql");
    pub const QUEUE_KNOWN: &str = concat!(
        "WITH\n",
        include_str!("tasks/writers.sql"),
        include_str!("tasks/queue_known.sql")
    );
    pub static TASK_SEEN: LazyLock<String> = with_states!("tasks/task_seen.sql");
    pub static LANES_USERS: LazyLock<String> = with_states!("tasks/lanes_users.sql");
    pub const LANES_PAGE: &str = include_str!("tasks/lanes_page.sql");
    pub static HIDING: LazyLock<String> = with_states!("tasks/hiding.sql");
    pub const FINISH_ORPHAN_CANCELS: &str = include_str!("tasks/finish_orphan_cancels.sql");
    pub static ANY_INCOMPLETE: LazyLock<String> = with_states!("tasks/any_incomplete.sql");

    pub const CANCELING: &str = include_str!("tasks/canceling.sql");
    pub static OLDER_CONFLICTS: LazyLock<String> = with_states!("tasks/older_conflicts.sql");
    pub const TASK_FACTS: &str = include_str!("tasks/task_facts.sql");

    /// Set in the lane gauge's transactions: its queue-order reads (lanes.sql, lanes_page.sql,
    /// lanes_newer.sql) must be the ordered range scans of `dispatch_lanes_idx`. Without these
    /// the generic plans on Pulp's schema walk Pulp's `pulp_created` index, completed tasks
    /// included, and sort. (Where the index is missing, a sort is still planned: disabling only
    /// penalises.)
    pub const ORDERED_SCANS: &str = "SET LOCAL enable_sort = off; \
        SET LOCAL enable_incremental_sort = off; SET LOCAL enable_bitmapscan = off";
    /// Set before lanes_users.sql, the one look-up by name (a bitmap of the GIN index, sorted).
    pub const LOOKUP_BY_NAME: &str = "SET LOCAL enable_sort = on; SET LOCAL enable_bitmapscan = on";

    /// The statements the broker runs (prepared at start-up), but for [`CANDIDATES`] and
    /// [`TASK`], which are put together at run time.
    pub static ALL: LazyLock<[&str; 38]> = LazyLock::new(|| {
        [
            GROUPS_WAITING.as_str(),
            GROUPS_WAITING_BY_TASK_GROUP.as_str(),
            DOMAIN_TABLE,
            QUEUE_PAGE,
            QUEUE_KNOWN,
            TASK_SEEN.as_str(),
            GIN_CLEAN,
            LANES_LATE,
            LANES_NEWER,
            LANES_GONE,
            LANES_USERS.as_str(),
            LANES_PAGE,
            CANCELING,
            TASK_FACTS,
            OLDER_CONFLICTS.as_str(),
            FINISH_ORPHAN_CANCELS,
            HIDING.as_str(),
            LOCK_TARGETS.as_str(),
            CLAIMED_SINCE.as_str(),
            LANES,
            ANY_INCOMPLETE.as_str(),
            END_TASKS,
            CLAIMED_TASKS.as_str(),
            CLAIM,
            CLAIM_ROUND,
            REQUEUE.as_str(),
            START,
            STARTED,
            FINISH.as_str(),
            FINISH_WAITING.as_str(),
            TASK_STATE,
            CANCEL,
            INSERT_APP_STATUS,
            APP_STATUS_EXISTS,
            HEARTBEAT,
            REQUEUE_CLAIMED,
            FAIL_RUNNING,
            DELETE_APP_STATUS,
        ]
    });
}

/// A final state to record for a task its holder finished (finish.sql).
#[derive(Debug, Clone, PartialEq)]
pub struct Finishing {
    pub task: TaskId,
    /// The core_appstatus row that claimed it.
    pub app_status: Uuid,
    pub state: TaskState,
    /// Why it failed, if it did.
    pub reason: Option<String>,
}

/// The outcome of each of `tasks`, in order, from `rows` keyed by their first column (a task id),
/// each made by `outcome`. A task with no row, or named again after its row went to its first
/// place, gets `missing`.
fn per_task<T>(
    tasks: &[TaskId],
    rows: &[Row],
    missing: impl Fn(TaskId) -> Result<T, Error>,
    outcome: impl Fn(&Row) -> Result<T, Error>,
) -> Result<Vec<T>, Error> {
    let mut found = std::collections::HashMap::with_capacity(rows.len());
    for row in rows {
        let task: TaskId = row.try_get(0)?;
        found.insert(task, row);
    }
    tasks
        .iter()
        .map(|task| match found.remove(task) {
            Some(row) => outcome(row),
            None => missing(*task),
        })
        .collect()
}

/// What finishing one task found (finish.sql).
#[derive(Debug, Clone, PartialEq)]
pub enum Ended {
    /// Finished now: its state, and how long it ran.
    Finished { state: String, ran: Option<Ran> },
    /// Not its holder's incomplete task (or named twice, and finished for the first).
    NotFinished,
    /// Another transaction holds its row: not tried.
    RowLocked,
}

/// What claiming one task of a round found (claim_round.sql).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// Claimed now; when it started too, at what time.
    Claimed(Option<DateTime<Utc>>),
    /// Canceled, finished or claimed elsewhere since it was read.
    NotClaimable,
    /// Another transaction holds its row: not tried.
    RowLocked,
    /// Postgres refused it because the lease's `core_appstatus` row is gone (the foreign key
    /// of `app_lock_id`): nothing was claimed.
    AppStatusGone,
}

/// What putting a claim back found (requeue.sql).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Requeued {
    /// The task went back to the queue now.
    pub requeued: bool,
    /// It is running (or canceling) under this worker row, and was left alone.
    pub running_here: bool,
    /// It is final and ran: for how long.
    pub ran: Option<Ran>,
}

/// How long a task that ended ran (from `started_at` to `finished_at`), and its domain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ran {
    pub domain: Uuid,
    pub task_group: Option<Uuid>,
    pub seconds: f64,
}

/// A [`Ran`] from a row's domain (column `at`), task group (`at + 1`) and seconds (`at + 2`),
/// when the domain and the seconds are there.
fn ran(row: &Row, at: usize) -> Result<Option<Ran>, Error> {
    let domain: Option<Uuid> = row.try_get(at)?;
    let task_group: Option<Uuid> = row.try_get(at + 1)?;
    let seconds: Option<f64> = row.try_get(at + 2)?;
    Ok(domain.zip(seconds).map(|(domain, seconds)| Ran {
        domain,
        task_group,
        seconds,
    }))
}

/// A task's group as SQL writes it under `--fair-by domain` (dispatch_groups_idx's key) ...
const DOMAIN_GROUP: &str = "t.pulp_domain_id";
/// ... and under `--fair-by task-group` (dispatch_task_groups_idx's key: no task group is the nil
/// id).
const TASK_GROUP_GROUP: &str =
    "coalesce(t.task_group_id, '00000000-0000-0000-0000-000000000000'::uuid)";

/// The most tasks one read of queue_page.sql returns (its LIMIT).
pub const QUEUE_PAGE_ROWS: usize = 5000;

/// Failures of the task store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No connection could be had (Postgres down, unreachable, or the pool exhausted).
    #[error("postgres is unreachable: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    /// A statement failed.
    #[error("postgres statement failed: {}", describe(.0))]
    Db(#[from] tokio_postgres::Error),
    /// Postgres did not answer within the configured timeout.
    #[error("postgres did not answer within {0:?}")]
    Timeout(Duration),
    /// The database lacks something the broker needs.
    #[error("the database schema is missing {0}; run `dispatch-broker migrate` on an empty database, or pulpcore's migrations")]
    Schema(String),
    /// The pool could not be built from the configuration.
    #[error("invalid postgres configuration: {0}")]
    Config(String),
    /// A read's answer lacks what it always holds (a bug in the broker's SQL).
    #[error("postgres answered unexpectedly: {0}")]
    Unexpected(String),
    /// A write's answer lacks what it always holds (a bug in the broker's SQL): whether the
    /// write took effect is not known.
    #[error("postgres answered a write unexpectedly: {0}")]
    UnexpectedWrite(String),
    /// The failure of a batched statement, which every call in the batch shares
    /// (`crate::batch`).
    #[error(transparent)]
    Batch(std::sync::Arc<Error>),
}

impl Error {
    /// True when the statement certainly did not take effect: the server answered with an error
    /// (a single-statement transaction that reports an error did not commit). False for lost
    /// connections and timeouts, whose outcome is unknown.
    pub fn certainly_not_applied(&self) -> bool {
        match self {
            Error::Db(e) => e.as_db_error().is_some(),
            Error::Pool(_) | Error::Schema(_) | Error::Config(_) | Error::Unexpected(_) => true,
            Error::Timeout(_) | Error::UnexpectedWrite(_) => false,
            Error::Batch(e) => e.certainly_not_applied(),
        }
    }

    /// True when the server refused the statement (it answered with an error, so nothing
    /// committed): not when Postgres could not be reached or did not answer.
    pub fn is_refused(&self) -> bool {
        match self {
            Error::Db(e) => e.as_db_error().is_some(),
            Error::Batch(e) => e.is_refused(),
            Error::Pool(_)
            | Error::Timeout(_)
            | Error::Schema(_)
            | Error::Config(_)
            | Error::Unexpected(_)
            | Error::UnexpectedWrite(_) => false,
        }
    }

    /// True when Postgres refused a claim for its foreign key: the `core_appstatus` row it names
    /// is gone (deleted outside the broker). The claim statements write no other reference.
    pub fn app_status_gone(&self) -> bool {
        match self {
            Error::Db(e) => {
                e.code() == Some(&tokio_postgres::error::SqlState::FOREIGN_KEY_VIOLATION)
            }
            Error::Batch(e) => e.app_status_gone(),
            Error::Pool(_)
            | Error::Timeout(_)
            | Error::Schema(_)
            | Error::Config(_)
            | Error::Unexpected(_)
            | Error::UnexpectedWrite(_) => false,
        }
    }

    /// True when the fault is the broker's or its configuration's (a schema it cannot use, SQL
    /// that answered unexpectedly), not Postgres being unavailable.
    pub fn is_broker_fault(&self) -> bool {
        match self {
            Error::Schema(_)
            | Error::Config(_)
            | Error::Unexpected(_)
            | Error::UnexpectedWrite(_) => true,
            Error::Pool(_) | Error::Db(_) | Error::Timeout(_) => false,
            Error::Batch(e) => e.is_broker_fault(),
        }
    }
}

/// A waiting task as dispatch sees it.
#[derive(Debug, Clone)]
pub struct TaskRow {
    /// `pulp_id`.
    pub id: TaskId,
    /// `pulp_created`.
    pub created: DateTime<Utc>,
    /// `name`.
    pub name: String,
    /// `immediate`.
    pub immediate: bool,
    /// `pulp_domain_id`: its group for fair dispatch by domain (`fair::group_of`).
    pub domain: Uuid,
    /// `task_group_id`: its group for fair dispatch by task group.
    pub task_group: Option<Uuid>,
    /// The decision inputs for `ready::judge`.
    pub candidate: Candidate,
}

/// What a directed page of candidates holds (fair dispatch): one group's waiting tasks, or the
/// immediate ones, in queue order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Directed {
    /// The tasks of one domain (`pulp_domain_id`).
    Group(Uuid),
    /// The tasks of one task group (`task_group_id`; the nil id: of none).
    TaskGroup(Uuid),
    /// Pulp's immediate tasks.
    Immediate,
}

impl Directed {
    /// The group a page of one group's tasks is of (`None`: the immediate tasks').
    pub fn group(self) -> Option<Uuid> {
        match self {
            Directed::Group(g) | Directed::TaskGroup(g) => Some(g),
            Directed::Immediate => None,
        }
    }
}

/// How many waiting tasks of its group or kind a directed page reads at most, per row it returns
/// (candidates.sql's `$scan`).
pub const DIRECTED_SCAN_PER_ROW: i64 = 4;

/// How many groups besides its own a directed page of a group reads ahead, at most (a quarter of
/// its rows each), for the next directed passes to judge without a read of their own.
pub const READ_AHEAD: usize = 7;

/// A task with its current state, for ClaimTask.
#[derive(Debug, Clone)]
pub struct TaskWithState {
    /// The task.
    pub row: TaskRow,
    /// `state`.
    pub state: TaskState,
    /// `app_lock_id`.
    pub app_lock_id: Option<Uuid>,
}

/// What CancelTask found and did.
#[derive(Debug, Clone)]
pub struct Cancel {
    /// The state before the call.
    pub before: TaskState,
    /// The state after the call.
    pub after: TaskState,
    /// Who had claimed the task.
    pub app_lock_id: Option<Uuid>,
}

/// What closing a lease did to its tasks.
#[derive(Debug, Clone, Default)]
pub struct LeaseTasksEnded {
    /// Claimed tasks put back in the queue.
    pub requeued: u32,
    /// Running tasks failed.
    pub failed: u32,
}

/// A claimed incomplete task and its worker, as a rebuild of lost lock state needs them.
#[derive(Debug, Clone)]
pub struct ClaimedTask {
    /// `pulp_id`.
    pub task_id: TaskId,
    /// Its resources.
    pub resources: Resources,
    /// `app_lock_id`: the worker row that claimed it.
    pub app_status_id: Uuid,
    /// The worker row's name.
    pub worker_name: String,
    /// The worker row's ttl in ms.
    pub worker_ttl_ms: i64,
    /// The worker's component versions.
    pub worker_versions: BTreeMap<String, String>,
    /// `pulp_domain_id`: its group for fair dispatch by domain.
    pub domain: Uuid,
    /// `immediate`.
    pub immediate: bool,
    /// `task_group_id`: its group for fair dispatch by task group.
    pub task_group: Option<Uuid>,
}

/// An older incomplete task that conflicts with an explained one.
#[derive(Debug, Clone)]
pub struct OlderTask {
    /// `pulp_id`.
    pub id: TaskId,
    /// `state`.
    pub state: TaskState,
    /// `name`.
    pub name: String,
    /// Its resources.
    pub resources: Resources,
    /// `pulp_created`.
    pub created: DateTime<Utc>,
}

/// Rows per page of `lanes_page.sql` (its LIMIT).
const LANE_PAGE_ROWS: usize = 512;

/// A counter's key as the statements take it.
pub fn key_bound(key: Key) -> (DateTime<Utc>, TaskId) {
    (
        DateTime::from_timestamp_micros(key.0).unwrap_or(DateTime::UNIX_EPOCH),
        key.1,
    )
}

/// A row of the lane statements (record, pulp_id, pulp_created): the task's key and record,
/// borrowed from the row.
fn lane_row(row: &Row) -> Result<(Key, Vec<&str>), Error> {
    let record: Option<Vec<&str>> = row.try_get(0)?;
    let id: TaskId = row.try_get(1)?;
    let created: DateTime<Utc> = row.try_get(2)?;
    Ok(((created.timestamp_micros(), id), record.unwrap_or_default()))
}

/// A lane statement's row (lanes.sql and its kin): [`lane_row`] and the task's class.
fn classed_lane_row(row: &Row) -> Result<(Key, Vec<&str>, crate::ready::Class), Error> {
    let (key, record) = lane_row(row)?;
    let class = crate::ready::Class {
        domain: row.try_get(3)?,
        immediate: row.try_get(4)?,
        task_group: row.try_get(5)?,
    };
    Ok((key, record, class))
}

/// What the resource queues tell candidates.sql's exact look-ups (see
/// readiness_lookup.sql): a task up to the end of the queue's head whose conflict keys include an
/// entry of a busy queue is looked up against the incomplete tasks older than it, and so is a
/// task whose conflict keys include entries of long queues, as long as those older tasks are no
/// more than the tasks that carry those entries; every other task against its resources' users.
#[derive(Debug, Clone, Default)]
pub struct Near {
    /// The end of the queue's head (None: not known).
    pub head_end: Option<(DateTime<Utc>, TaskId)>,
    /// The record entries of busy queues (long ones among them), and at the same index how many
    /// tasks carry each (candidates.sql's $6 and $7).
    pub busy_entries: Vec<String>,
    pub busy_users: Vec<i32>,
}

impl Near {
    /// `head_end`, and the busy queues as `ResourceQueues::busy_queues` lists them.
    pub fn new(head_end: Option<(DateTime<Utc>, TaskId)>, busy: Vec<(String, usize)>) -> Near {
        let (busy_entries, busy_users) = busy
            .into_iter()
            .map(|(entry, users)| (entry, i32::try_from(users).unwrap_or(i32::MAX)))
            .unzip();
        Near {
            head_end,
            busy_entries,
            busy_users,
        }
    }

    /// The end of the queue's head as the statements take it: its time and its id.
    fn head_end_params(&self) -> (Option<DateTime<Utc>>, Option<TaskId>) {
        (self.head_end.map(|a| a.0), self.head_end.map(|a| a.1))
    }
}

/// Handle on the task store.
#[derive(Clone)]
pub struct Tasks {
    pool: Pool,
    timeout: Duration,
    stats: Arc<Stats>,
    suspect: Arc<Suspect>,
}

/// Until when every pooled connection is checked before use, however recently it was used: set
/// for a second after a statement failed in a way that may have broken its connection (closed,
/// a fatal error such as a terminated session, a timeout). The pool hands out the connection
/// used last first, and the broken one may not be known closed yet when the next statement
/// takes it.
#[derive(Default)]
struct Suspect {
    until: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Suspect {
    fn note(&self, failure: &Error) {
        let broken = match failure {
            Error::Timeout(_) => true,
            Error::Db(e) => {
                e.is_closed()
                    || e.as_db_error()
                        .is_none_or(|d| matches!(d.severity(), "FATAL" | "PANIC"))
            }
            _ => false,
        };
        if broken {
            *self.until.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(std::time::Instant::now() + VERIFY_IDLE_AFTER);
        }
    }

    fn now(&self) -> bool {
        self.until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|until| std::time::Instant::now() < until)
    }
}

use crate::config::{VERIFY_IDLE_AFTER, VERIFY_IDLE_WITHIN};

async fn verify_idle(
    client: &mut deadpool_postgres::ClientWrapper,
    metrics: &deadpool_postgres::Metrics,
    suspect: &Suspect,
) -> Result<(), deadpool_postgres::HookError> {
    if metrics.last_used() < VERIFY_IDLE_AFTER && !suspect.now() {
        return Ok(());
    }
    // Bounded: deadpool runs hooks without its recycle timeout, and a connection that idled at
    // the bottom of the pool may have been dropped silently by the network.
    match tokio::time::timeout(VERIFY_IDLE_WITHIN, client.simple_query("")).await {
        Ok(answer) => answer
            .map(|_| ())
            .map_err(deadpool_postgres::HookError::Backend),
        Err(_) => Err(deadpool_postgres::HookError::message(
            "an idle connection did not answer its check in time",
        )),
    }
}

impl Tasks {
    /// Builds the pool and checks that Postgres answers.
    pub async fn connect(
        url: &str,
        pool_size: usize,
        timeout: Duration,
        stats: Arc<Stats>,
    ) -> Result<Self, Error> {
        let mut pg: tokio_postgres::Config = url
            .parse()
            .map_err(|e: tokio_postgres::Error| Error::Config(e.to_string()))?;
        pg.connect_timeout(timeout);
        pg.application_name("dispatch-broker");
        // The server gives up on a statement shortly before the broker stops waiting for it, so
        // a statement the broker reports as failed has (almost always) not committed later.
        let server_limit = timeout
            .saturating_sub(timeout / 5)
            .max(Duration::from_millis(50));
        // enable_seqscan=off: every statement of the broker is meant to go through an index
        // (the readiness look-ups through the GIN index, one per candidate). On a small or
        // freshly churned table the planner may otherwise pick a sequential scan for each of a
        // page's 32 look-ups (measured: 80 ms for one page instead of 3 ms). Only the lane
        // gauge's query turns it back on, for databases without `dispatch_lanes_idx`.
        // plan_cache_mode=force_generic_plan: each prepared statement is planned once per
        // connection instead of at every execution (Postgres keeps re-planning a statement whose
        // custom plans look cheaper than its generic one, as candidates.sql's do: planning was
        // most of Postgres's time per fetch). Every statement's generic plan is the intended index
        // path; candidates.sql carries its page size as a literal for that reason. jit=off: JIT
        // compiling costs milliseconds and is never worth it for these short statements.
        // max_parallel_workers_per_gather=0: starting parallel workers costs milliseconds too;
        // on Pulp's database, with statistics that overestimate the claimed tasks, the generic
        // plan of candidates.sql's `held` gathered two workers on every fetch (about 5 ms each).
        pg.options(format!(
            "-c statement_timeout={} -c enable_seqscan=off -c plan_cache_mode=force_generic_plan -c jit=off \
             -c max_parallel_workers_per_gather=0",
            server_limit.as_millis()
        ));
        let suspect = Arc::new(Suspect::default());
        let manager = Manager::from_config(
            pg,
            NoTls,
            // Fast: a connection whose socket closed is replaced at checkout; one that sat idle
            // for a while is also checked with an empty query first (`verify_idle`), so a
            // connection Postgres terminated (restart, failover, admin) is not handed out, while
            // a busy broker pays no extra round trip per statement.
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pool_size)
            // Last in, first out: at idle the same few connections take every statement, so they
            // stay fresh and skip `verify_idle`'s empty query (a transaction of its own); handed
            // out in turn (the default), every connection of the pool sat idle past
            // VERIFY_IDLE_AFTER and each statement cost two transactions.
            .queue_mode(deadpool::managed::QueueMode::Lifo)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout))
            .recycle_timeout(Some(timeout))
            .pre_recycle({
                let suspect = Arc::clone(&suspect);
                deadpool_postgres::Hook::async_fn(move |client, metrics| {
                    let suspect = Arc::clone(&suspect);
                    Box::pin(async move { verify_idle(client, metrics, &suspect).await })
                })
            })
            .build()
            .map_err(|e| Error::Config(e.to_string()))?;
        let tasks = Tasks {
            pool,
            timeout,
            stats,
            suspect,
        };
        drop(tasks.client().await?);
        Ok(tasks)
    }

    /// The same store, counting its statements in `stats`.
    pub fn with_stats(&self, stats: Arc<Stats>) -> Tasks {
        Tasks {
            stats,
            ..self.clone()
        }
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, Error> {
        Ok(self.pool.get().await?)
    }

    /// Checks the schema and prepares every request-path statement, so a missing column or a
    /// broken query stops the broker at start-up.
    pub async fn prepare(&self) -> Result<(), Error> {
        let missing = self.missing_schema().await?;
        if !missing.is_empty() {
            return Err(Error::Schema(missing.join(", ")));
        }
        let client = self.client().await?;
        // candidates.sql in the form that runs: with its page size written in.
        client.prepare_cached(&candidates_sql(1, None)).await?;
        client
            .prepare_cached(&candidates_sql(1, Some(Directed::Group(Uuid::nil()))))
            .await?;
        client
            .prepare_cached(&candidates_sql(1, Some(Directed::TaskGroup(Uuid::nil()))))
            .await?;
        client
            .prepare_cached(&candidates_sql(1, Some(Directed::Immediate)))
            .await?;
        client.prepare_cached(&sql::TASK).await?;
        for statement in *sql::ALL {
            client.prepare_cached(statement).await?;
        }
        Ok(())
    }

    /// Lists what the broker needs and the database lacks (empty when all is there).
    pub async fn missing_schema(&self) -> Result<Vec<String>, Error> {
        Ok(migrate::missing(&self.schema_items().await?))
    }

    /// Whether the lane gauge's index `dispatch_lanes_idx` exists and is valid (without it a
    /// walk of the queue sorts what it reads, and only full passes are worth it).
    pub async fn has_lanes_index(&self) -> Result<bool, Error> {
        Ok(self
            .schema_items()
            .await?
            .iter()
            .any(|i| i == "lanes-index"))
    }

    /// What `schema_check.sql` finds present.
    async fn schema_items(&self) -> Result<Vec<String>, Error> {
        let client = self.client().await?;
        let present: Vec<String> = self
            .timed(client.query(sql::SCHEMA_CHECK, &[]))
            .await?
            .iter()
            .map(|row| row.get(0))
            .collect();
        Ok(present)
    }

    /// Runs one statement under the timeout, counting it.
    async fn timed<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, Error> {
        self.timed_within(self.timeout, fut).await
    }

    /// [`Tasks::timed`] with a limit of its own.
    async fn timed_within<T>(
        &self,
        limit: Duration,
        fut: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, Error> {
        self.stats.postgres_statement();
        let outcome = tokio::time::timeout(limit, fut)
            .await
            .map_err(|_| Error::Timeout(limit))
            .and_then(|answer| answer.map_err(Error::from));
        if let Err(e) = &outcome {
            self.suspect.note(e);
        }
        outcome
    }

    async fn query(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, Error> {
        let client = self.client().await?;
        let prepared = client.prepare_cached(statement).await?;
        let rows = self.timed(client.query(&prepared, params)).await;
        if let Err(Error::Timeout(_)) = rows {
            // The server did not end the statement by its own timeout: the connection is stuck
            // (a network that dropped it silently, a wedged server). It is closed rather than
            // handed back, where the next statement (the pool hands out the last connection
            // first) would wait on it too.
            drop(deadpool_postgres::Object::take(client));
        }
        rows
    }

    /// A read-only statement. When the pooled connection turns out to have been closed by the
    /// server while it sat idle (a restart, a terminated session) before the pool noticed, the
    /// read is tried again on another connection (up to [`READ_TRIES`] in all): a read changes
    /// nothing, so repeating it is safe, and a client should not see a failure the broker can
    /// absorb.
    async fn query_read(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, Error> {
        retry_closed(|| self.query(statement, params)).await
    }

    /// [`Tasks::query_read`] in a read-only transaction of its own under planner `settings`
    /// (`SET LOCAL` lines), for a statement whose generic plan must not depend on how fresh the
    /// statistics are. One round trip: the transaction's start with the settings, the statement
    /// and the commit are sent together (an error in the statement makes the commit a rollback),
    /// and count as one statement.
    async fn query_read_under(
        &self,
        settings: &str,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, Error> {
        let begin = format!("BEGIN READ ONLY;\n{settings}");
        retry_closed(|| async {
            let client = self.client().await?;
            let prepared = client.prepare_cached(statement).await?;
            // Each request is sent when its future is first polled: all three go out together,
            // in this order (biased), before any answer is read.
            let sent = self
                .timed(async {
                    tokio::try_join!(
                        biased;
                        client.batch_execute(&begin),
                        client.query(&prepared, params),
                        client.batch_execute("COMMIT"),
                    )
                })
                .await;
            match sent {
                Ok((_, rows, _)) => Ok(rows),
                Err(e) => {
                    // The transaction may still be open (a statement that failed before it was
                    // sent, e.g. a parameter that does not encode, ends the join before the
                    // commit is sent): the connection is closed, not handed back to the pool,
                    // where the next statement would run inside it.
                    drop(deadpool_postgres::Object::take(client));
                    Err(e)
                }
            }
        })
        .await
    }

    /// One page of waiting, unclaimed tasks after `after` in queue order, skipping tasks that
    /// overlap `excluded` or the conflict keys of claimed and running tasks (candidates.sql).
    /// `near` says which tasks are looked up against the tasks older than them rather than
    /// against their resources' users.
    pub async fn candidates(
        &self,
        excluded: &[String],
        after: Option<(DateTime<Utc>, TaskId)>,
        near: &Near,
        limit: i64,
    ) -> Result<Page, Error> {
        let (after_created, after_id) = (after.map(|a| a.0), after.map(|a| a.1));
        let (tasks, closing) = self
            .candidate_rows(
                &candidates_sql(limit, None),
                excluded,
                after_created,
                after_id,
                near,
                &[],
            )
            .await?;
        Ok(Page {
            full: tasks.len() as i64 >= limit,
            tasks,
            held: closing.try_get(7)?,
            tail: closing.try_get(8)?,
            whole: false,
        })
    }

    /// A directed page (fair dispatch): the first `limit` waiting tasks of one group, or of the
    /// immediate tasks, that a pass could take, read flat (candidates.sql's `scope`); and with
    /// a group's, those of each group of `ahead` (a quarter as many each), read ahead for the
    /// next directed passes.
    pub async fn directed_pages(
        &self,
        near: &Near,
        limit: i64,
        directed: Directed,
        ahead: &[Uuid],
    ) -> Result<DirectedPages, Error> {
        let limit = limit.max(1);
        let ahead: &[Uuid] = match directed {
            Directed::Immediate => &[],
            _ => &ahead[..ahead.len().min(READ_AHEAD)],
        };
        let group = directed.group();
        let extra: Vec<&(dyn ToSql + Sync)> = match &group {
            Some(g) => vec![g, &ahead],
            None => Vec::new(),
        };
        let none: Option<DateTime<Utc>> = None;
        let (tasks, closing) = self
            .candidate_rows(
                &candidates_sql(limit, Some(directed)),
                &[],
                none,
                None,
                near,
                &extra,
            )
            .await?;
        let scanned: Option<serde_json::Value> = closing.try_get("scanned")?;
        let scanned = |g: &Uuid| {
            scanned
                .as_ref()
                .and_then(|s| s.get(g.to_string()))
                .and_then(serde_json::Value::as_i64)
        };
        // Fewer rows than its scan may read, and every one kept: every waiting task of the
        // group (or kind) as of the read.
        let page = |key: &Uuid, tasks: Vec<TaskRow>, rows: i64| {
            let whole = scanned(key).is_some_and(|n| {
                n < rows.saturating_mul(DIRECTED_SCAN_PER_ROW) && n == tasks.len() as i64
            });
            Page {
                full: tasks.len() as i64 >= rows,
                tasks,
                held: Vec::new(),
                tail: None,
                whole,
            }
        };
        let key_of = |row: &TaskRow| match directed {
            Directed::TaskGroup(_) => row.task_group.unwrap_or(Uuid::nil()),
            Directed::Group(_) | Directed::Immediate => row.domain,
        };
        let Some(lead) = group else {
            return Ok(DirectedPages {
                lead: page(&Uuid::nil(), tasks, limit),
                ahead: Vec::new(),
            });
        };
        let mut by_group: HashMap<Uuid, Vec<TaskRow>> = HashMap::new();
        for task in tasks {
            by_group.entry(key_of(&task)).or_default().push(task);
        }
        let ahead_rows = (limit / 4).max(1);
        Ok(DirectedPages {
            lead: page(&lead, by_group.remove(&lead).unwrap_or_default(), limit),
            ahead: ahead
                .iter()
                .filter(|g| **g != lead)
                .map(|g| {
                    (
                        *g,
                        page(g, by_group.remove(g).unwrap_or_default(), ahead_rows),
                    )
                })
                .collect(),
        })
    }

    /// candidates.sql's task rows and closing row.
    async fn candidate_rows(
        &self,
        statement: &str,
        excluded: &[String],
        after_created: Option<DateTime<Utc>>,
        after_id: Option<TaskId>,
        near: &Near,
        extra: &[&(dyn ToSql + Sync)],
    ) -> Result<(Vec<TaskRow>, tokio_postgres::Row), Error> {
        let (near_created, near_id) = near.head_end_params();
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![
            &excluded,
            &after_created,
            &after_id,
            &near_created,
            &near_id,
            &near.busy_entries,
            &near.busy_users,
        ];
        params.extend_from_slice(extra);
        let mut rows = self
            .query_read_under(sql::CANDIDATES_SETTINGS, statement, &params)
            .await?;
        let closing = rows
            .pop()
            .ok_or_else(|| Error::Unexpected("candidates.sql returned no closing row".into()))?;
        let id: Option<TaskId> = closing.try_get(0)?;
        if id.is_some() {
            return Err(Error::Unexpected(
                "candidates.sql's last row is not its closing row".into(),
            ));
        }
        let tasks: Vec<TaskRow> = rows.iter().map(task_row).collect::<Result<_, _>>()?;
        Ok((tasks, closing))
    }

    /// Which of `ids` are waiting and unclaimed, with their readiness facts, oldest first: the
    /// claims put back that a scan hint checks first (task.sql).
    pub async fn returned(&self, ids: &[TaskId], near: &Near) -> Result<Vec<TaskRow>, Error> {
        let mut rows: Vec<TaskRow> = self
            .tasks_looked_up(ids, near)
            .await?
            .into_iter()
            .filter(|t| t.state == TaskState::Waiting && t.app_lock_id.is_none())
            .map(|t| t.row)
            .collect();
        rows.sort_by_key(|r| (r.created, r.id));
        Ok(rows)
    }

    /// One task with its state and readiness facts; `None` for an unknown task.
    pub async fn task(&self, id: TaskId, near: &Near) -> Result<Option<TaskWithState>, Error> {
        Ok(self.tasks_looked_up(&[id], near).await?.into_iter().next())
    }

    /// task.sql: tasks by id with the readiness look-up, which reads as `near` says (as
    /// candidates.sql's does), under candidates.sql's planner settings.
    async fn tasks_looked_up(
        &self,
        ids: &[TaskId],
        near: &Near,
    ) -> Result<Vec<TaskWithState>, Error> {
        let (near_created, near_id) = near.head_end_params();
        let rows = self
            .query_read_under(
                sql::CANDIDATES_SETTINGS,
                &sql::TASK,
                &[
                    &ids,
                    &near_created,
                    &near_id,
                    &near.busy_entries,
                    &near.busy_users,
                ],
            )
            .await?;
        rows.iter().map(task_with_state).collect()
    }

    /// [`Tasks::task`] without the readiness look-up (`older_conflicts` is 0): for a task that
    /// is not waiting, cheap whatever its queues.
    pub async fn task_facts(&self, id: TaskId) -> Result<Option<TaskWithState>, Error> {
        Ok(self
            .tasks_by(sql::TASK_FACTS, &[id])
            .await?
            .into_iter()
            .next())
    }

    async fn tasks_by(&self, statement: &str, ids: &[TaskId]) -> Result<Vec<TaskWithState>, Error> {
        let rows = self.query_read(statement, &[&ids]).await?;
        rows.iter().map(task_with_state).collect()
    }

    /// Claims a waiting, unclaimed task for a worker row, and with `start` starts it too;
    /// `None` when it was not claimable, else when it started (`None` without `start`).
    pub async fn claim(
        &self,
        task: TaskId,
        app_status: Uuid,
        start: bool,
    ) -> Result<Option<Option<DateTime<Utc>>>, Error> {
        let rows = self
            .query(sql::CLAIM, &[&task, &app_status, &start])
            .await?;
        rows.first()
            .map(|row| row.try_get(0))
            .transpose()
            .map_err(Error::from)
    }

    /// [`Tasks::claim`] for a fetch round's tasks (task, core_appstatus row, start) in one
    /// statement: one outcome per task, in order. A task whose row another transaction holds is
    /// not tried ([`Claimed::RowLocked`]; [`Tasks::claim`] waits for it).
    pub async fn claim_round(
        &self,
        claims: &[(TaskId, Uuid, bool)],
    ) -> Result<Vec<Claimed>, Error> {
        let tasks: Vec<TaskId> = claims.iter().map(|c| c.0).collect();
        let rows_of: Vec<Uuid> = claims.iter().map(|c| c.1).collect();
        let start: Vec<bool> = claims.iter().map(|c| c.2).collect();
        let rows = self
            .query(sql::CLAIM_ROUND, &[&tasks, &rows_of, &start])
            .await?;
        per_task(
            &tasks,
            &rows,
            |task| {
                Err(Error::UnexpectedWrite(format!(
                    "claim_round.sql returned no row for task {task}"
                )))
            },
            |row| {
                Ok(if row.try_get(1)? {
                    Claimed::RowLocked
                } else if row.try_get(2)? {
                    Claimed::Claimed(row.try_get(3)?)
                } else {
                    Claimed::NotClaimable
                })
            },
        )
    }

    /// Puts a claimed task back in the queue; true when it went back. `started`: the grant
    /// being undone started it and was never delivered (a running task under this row goes
    /// back too); otherwise only a task that has not started does.
    pub async fn requeue(
        &self,
        task: TaskId,
        app_status: Uuid,
        started: bool,
    ) -> Result<bool, Error> {
        Ok(self.requeue_rows(task, app_status, started).await?.requeued)
    }

    /// [`Tasks::requeue`], also saying whether the task is running (or canceling) under this
    /// worker row, in which case it was left alone, and how long it ran if it is final (the
    /// release after Pulp ran it).
    pub async fn requeue_unless_running(
        &self,
        task: TaskId,
        app_status: Uuid,
    ) -> Result<Requeued, Error> {
        self.requeue_rows(task, app_status, false).await
    }

    async fn requeue_rows(
        &self,
        task: TaskId,
        app_status: Uuid,
        started: bool,
    ) -> Result<Requeued, Error> {
        let rows = self
            .query(&sql::REQUEUE, &[&task, &app_status, &started])
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| Error::Schema("requeue.sql returned no row".into()))?;
        Ok(Requeued {
            requeued: row.try_get(0)?,
            running_here: row.try_get(1)?,
            ran: ran(row, 2)?,
        })
    }

    /// Marks a claimed task running; `None` when it is neither this holder's waiting task nor
    /// its running one (a running one is answered with the time it started).
    pub async fn start(
        &self,
        task: TaskId,
        app_status: Uuid,
    ) -> Result<Option<DateTime<Utc>>, Error> {
        let rows = self.query(sql::START, &[&task, &app_status]).await?;
        if let Some(row) = rows.first() {
            return Ok(Some(row.try_get(0)?));
        }
        // No longer waiting: when it runs for this holder already, this is a retry of a start
        // whose answer was lost (or a start of a task the grant started), answered alike.
        let rows = self.query_read(sql::STARTED, &[&task, &app_status]).await?;
        rows.first()
            .map(|r| r.try_get(0))
            .transpose()
            .map_err(Error::from)
    }

    /// Records a final state (waiting for the task's row if another transaction holds it).
    pub async fn finish(&self, finishing: Finishing) -> Result<Ended, Error> {
        let mut ended = self.finish_all(&[finishing], true).await?;
        Ok(ended.pop().unwrap_or(Ended::NotFinished))
    }

    /// [`Tasks::finish`] for several tasks in one statement: one outcome per task, in order (a
    /// task named twice is finished for the first). Without `wait`, a task whose row another
    /// transaction holds is not tried ([`Ended::RowLocked`]).
    pub async fn finish_all(
        &self,
        finishing: &[Finishing],
        wait: bool,
    ) -> Result<Vec<Ended>, Error> {
        let tasks: Vec<TaskId> = finishing.iter().map(|f| f.task).collect();
        let rows_of: Vec<Uuid> = finishing.iter().map(|f| f.app_status).collect();
        let states: Vec<&str> = finishing.iter().map(|f| f.state.as_str()).collect();
        let reasons: Vec<Option<&str>> = finishing.iter().map(|f| f.reason.as_deref()).collect();
        let statement = if wait {
            &sql::FINISH_WAITING
        } else {
            &sql::FINISH
        };
        let rows = self
            .query(statement, &[&tasks, &rows_of, &states, &reasons])
            .await?;
        per_task(
            &tasks,
            &rows,
            |_| Ok(Ended::NotFinished),
            |r| {
                Ok(if r.try_get(1)? {
                    Ended::RowLocked
                } else if r.try_get(2)? {
                    Ended::Finished {
                        state: r.try_get(3)?,
                        ran: ran(r, 4)?,
                    }
                } else {
                    Ended::NotFinished
                })
            },
        )
    }

    /// A task's state and claim, without locking; `None` when unknown.
    pub async fn state(&self, task: TaskId) -> Result<Option<(String, Option<Uuid>)>, Error> {
        let client = self.client().await?;
        let prepared = client.prepare_cached(sql::TASK_STATE).await?;
        let rows = self.timed(client.query(&prepared, &[&task])).await?;
        rows.first()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .transpose()
    }

    /// Cancels a task in one transaction; `None` for an unknown task.
    pub async fn cancel(&self, task: TaskId) -> Result<Option<Cancel>, Error> {
        let mut client = self.client().await?;
        let state_stmt = client.prepare_cached(sql::TASK_STATE).await?;
        let cancel_stmt = client.prepare_cached(sql::CANCEL).await?;
        let tx = self.timed(client.transaction()).await?;
        let rows = self.timed(tx.query(&state_stmt, &[&task])).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let before = state_at(row, 0)?;
        let app_lock_id: Option<Uuid> = row.try_get(1)?;
        let changed = self.timed(tx.query(&cancel_stmt, &[&task])).await?;
        let after = match changed.first() {
            Some(r) => state_at(r, 0)?,
            None => before,
        };
        self.timed(tx.commit()).await?;
        Ok(Some(Cancel {
            before,
            after,
            app_lock_id,
        }))
    }

    /// Merges the pending list of each GIN index on `core_task` that has one (`gin_clean.sql`):
    /// `(index, pages merged)`.
    pub async fn clean_gin_pending_lists(&self) -> Result<Vec<(String, i64)>, Error> {
        let rows = self.query(sql::GIN_CLEAN, &[]).await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect()
    }

    /// Creates the `core_appstatus` row of a worker whose lease the broker opens.
    pub async fn insert_app_status(
        &self,
        id: Uuid,
        name: &str,
        versions: &BTreeMap<String, String>,
        ttl: Duration,
    ) -> Result<(), Error> {
        let keys: Vec<&str> = versions.keys().map(String::as_str).collect();
        let values: Vec<&str> = versions.values().map(String::as_str).collect();
        let secs = ttl.as_secs_f64();
        self.query(sql::INSERT_APP_STATUS, &[&id, &name, &keys, &values, &secs])
            .await?;
        Ok(())
    }

    /// Whether a `core_appstatus` row exists.
    pub async fn app_status_exists(&self, id: Uuid) -> Result<bool, Error> {
        Ok(!self
            .query_read(sql::APP_STATUS_EXISTS, &[&id])
            .await?
            .is_empty())
    }

    /// Refreshes the `last_heartbeat` of the workers' rows `app_status`, in one statement;
    /// returns the rows it found (one missing from the answer was deleted).
    pub async fn heartbeat(&self, app_status: &[Uuid]) -> Result<HashSet<Uuid>, Error> {
        let rows = self.query(sql::HEARTBEAT, &[&app_status]).await?;
        rows.iter().map(|r| Ok(r.try_get(0)?)).collect()
    }

    /// Every claimed task asked to cancel, with the row that claimed it.
    pub async fn canceling(&self) -> Result<Vec<(TaskId, Uuid)>, Error> {
        let rows = self.query_read(sql::CANCELING, &[]).await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect()
    }

    /// Ends the tasks of an ended lease in one transaction: claimed tasks that had not started
    /// go back to the queue, running ones fail with `reason`. When the broker created the worker
    /// row (one row per lease), every task claimed by that row is covered and the row is removed;
    /// otherwise only the tasks the lease held locks for are touched, and the worker's own row
    /// stays.
    pub async fn end_lease_tasks(
        &self,
        app_status: Uuid,
        task_ids: &[TaskId],
        reason: &str,
        owned_row: bool,
    ) -> Result<LeaseTasksEnded, Error> {
        let mut client = self.client().await?;
        let end = client.prepare_cached(sql::END_TASKS).await?;
        let requeue = client.prepare_cached(sql::REQUEUE_CLAIMED).await?;
        let fail = client.prepare_cached(sql::FAIL_RUNNING).await?;
        let delete = client.prepare_cached(sql::DELETE_APP_STATUS).await?;
        let tx = self.timed(client.transaction()).await?;
        let row = self
            .timed(tx.query_one(&end, &[&task_ids, &app_status, &reason]))
            .await?;
        let mut requeued: i64 = row.try_get(0)?;
        let mut failed: i64 = row.try_get(1)?;
        if owned_row {
            requeued += self.timed(tx.query(&requeue, &[&app_status])).await?.len() as i64;
            failed += self
                .timed(tx.query(&fail, &[&app_status, &reason]))
                .await?
                .len() as i64;
            self.timed(tx.execute(&delete, &[&app_status])).await?;
        }
        self.timed(tx.commit()).await?;
        Ok(LeaseTasksEnded {
            requeued: requeued as u32,
            failed: failed as u32,
        })
    }

    /// Removes a worker row the broker created (for a lease that failed to open).
    pub async fn delete_app_status(&self, app_status: Uuid) -> Result<(), Error> {
        self.query(sql::DELETE_APP_STATUS, &[&app_status]).await?;
        Ok(())
    }

    /// Among locked tasks, those whose lock serves no one: `(id, true)` when the task is final
    /// or gone, `(id, false)` when it is waiting and unclaimed.
    pub async fn lock_targets(&self, ids: &[TaskId]) -> Result<Vec<(TaskId, bool)>, Error> {
        let rows = self.query_read(&sql::LOCK_TARGETS, &[&ids]).await?;
        rows.iter()
            .map(|r| {
                let kind: String = r.try_get(1)?;
                Ok((r.try_get(0)?, kind == "final"))
            })
            .collect()
    }

    /// Claimed incomplete tasks untouched for `quiet`: `(id, state, app_lock_id)`.
    pub async fn claimed_since(
        &self,
        quiet: Duration,
    ) -> Result<Vec<(TaskId, TaskState, Uuid)>, Error> {
        let secs = quiet.as_secs_f64();
        let rows = self.query_read(&sql::CLAIMED_SINCE, &[&secs]).await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, state_at(r, 1)?, r.try_get(2)?)))
            .collect()
    }

    /// The `limit` oldest incomplete tasks older than `task` whose records overlap `keys` (its
    /// conflict keys), for ExplainTask.
    pub async fn older_conflicts(
        &self,
        task: TaskId,
        keys: &[String],
        limit: i64,
    ) -> Result<Vec<OlderTask>, Error> {
        let rows = self
            .query_read(&sql::OLDER_CONFLICTS, &[&task, &keys, &limit])
            .await?;
        rows.iter()
            .map(|r| {
                let record: Vec<String> = r.try_get(3)?;
                Ok(OlderTask {
                    id: r.try_get(0)?,
                    state: state_at(r, 1)?,
                    name: r.try_get(2)?,
                    resources: Resources::from_record(&record),
                    created: r.try_get(4)?,
                })
            })
            .collect()
    }

    /// Among `held` entries (what a scan skipped by), the names that hide a waiting task older
    /// than `position`.
    pub async fn hiding(
        &self,
        position: (DateTime<Utc>, TaskId),
        held: &[String],
    ) -> Result<Vec<String>, Error> {
        let rows = self
            .query_read(&sql::HIDING, &[&position.0, &position.1, &held])
            .await?;
        rows.iter()
            .map(|r| r.try_get(0).map_err(Error::from))
            .collect()
    }

    /// The next incomplete tasks after `after` (from the head when None) in queue order, with
    /// their records: at most [`QUEUE_PAGE_ROWS`] (queue_page.sql).
    pub async fn queue_page(&self, after: Option<Key>) -> Result<Vec<(Key, Vec<String>)>, Error> {
        let after = after.map(key_bound);
        let (created, id) = (after.map(|a| a.0), after.map(|a| a.1));
        let rows = self
            .query_read_under(sql::QUEUE_PAGE_SETTINGS, sql::QUEUE_PAGE, &[&created, &id])
            .await?;
        rows.iter()
            .map(|row| {
                let (key, record) = lane_row(row)?;
                Ok((key, record.into_iter().map(str::to_owned).collect()))
            })
            .collect()
    }

    /// Up to where a read of the queue that starts now sees every incomplete task
    /// (queue_known.sql): just before the oldest open writer's start, or now. None when a
    /// writer's start cannot be read.
    pub async fn queue_known(&self) -> Result<Option<Key>, Error> {
        let rows = self.query_read(sql::QUEUE_KNOWN, &[]).await?;
        let at: Option<DateTime<Utc>> = match rows.first() {
            Some(row) => row.try_get(0)?,
            None => None,
        };
        // (The last position of the previous microsecond: a task stamped at `at` is not known.)
        Ok(at.map(|at| (at.timestamp_micros() - 1, TaskId::MAX)))
    }

    /// What each task is now (task_seen.sql).
    pub async fn seen(&self, ids: &[TaskId]) -> Result<HashMap<TaskId, Seen>, Error> {
        let rows = self.query_read(&sql::TASK_SEEN, &[&ids]).await?;
        rows.iter()
            .map(|row| {
                let id: TaskId = row.try_get(0)?;
                let seen = match row.try_get::<_, &str>(1)? {
                    "waiting" => Seen::Waiting,
                    "held" => Seen::Held,
                    _ => Seen::Gone,
                };
                Ok((id, seen))
            })
            .collect()
    }

    /// Finishes, as canceled, tasks asked to cancel while unclaimed; returns the entries of
    /// their records (`NAME` or `shared:NAME`).
    pub async fn finish_orphan_cancels(&self) -> Result<Vec<String>, Error> {
        let rows = self.query(sql::FINISH_ORPHAN_CANCELS, &[]).await?;
        let mut entries = Vec::new();
        for row in &rows {
            let record: Vec<String> = row.try_get(0)?;
            entries.extend(record);
        }
        Ok(entries)
    }

    /// Whether any task is incomplete.
    pub async fn any_incomplete(&self) -> Result<bool, Error> {
        let rows = self.query_read(&sql::ANY_INCOMPLETE, &[]).await?;
        Ok(rows.first().map(|r| r.get(0)).unwrap_or(false))
    }

    /// Every claimed incomplete task with its worker row, for rebuilding lost lock state.
    pub async fn claimed_tasks(&self) -> Result<Vec<ClaimedTask>, Error> {
        let rows = self.query_read(&sql::CLAIMED_TASKS, &[]).await?;
        rows.iter()
            .map(|r| {
                let record: Vec<String> = r.try_get(1)?;
                let versions: Option<String> = r.try_get(5)?;
                Ok(ClaimedTask {
                    task_id: r.try_get(0)?,
                    resources: Resources::from_record(&record),
                    app_status_id: r.try_get(2)?,
                    worker_name: r.try_get(3)?,
                    worker_ttl_ms: r.try_get(4)?,
                    worker_versions: versions
                        .and_then(|v| serde_json::from_str(&v).ok())
                        .unwrap_or_default(),
                    domain: r.try_get(6)?,
                    immediate: r.try_get(7)?,
                    task_group: r.try_get(8)?,
                })
            })
            .collect()
    }

    /// Runs `migrate.sql` in one transaction when the database has no `core_task` table, and
    /// `lanes_index.sql` when `lanes_index` asks for it (dropping an invalid leftover of a failed
    /// concurrent build first); returns what is still missing afterwards (empty: ready to serve).
    pub async fn migrate(
        &self,
        lanes_index: bool,
        notify_trigger: bool,
        gin_fastupdate_off: bool,
        fair_indexes: bool,
    ) -> Result<migrate::Outcome, Error> {
        let mut client = self.client().await?;
        let exists: bool = client
            .query_one("SELECT to_regclass('core_task') IS NOT NULL", &[])
            .await?
            .get(0);
        let created = if exists {
            false
        } else {
            let tx = client.transaction().await?;
            tx.batch_execute(&sql::MIGRATE).await?;
            tx.batch_execute(sql::NOTIFY_TRIGGER).await?;
            tx.commit().await?;
            true
        };
        let notify_trigger_created = notify_trigger && !created;
        if notify_trigger_created {
            let tx = client.transaction().await?;
            tx.batch_execute(sql::NOTIFY_TRIGGER).await?;
            tx.commit().await?;
        }
        drop(client);
        // A table an older `migrate` made has no pulp_domain_id or task_group_id; Pulp's always
        // has both.
        let present = self.schema_items().await?;
        let own_schema = exists && !present.iter().any(|i| i == "core_domain");
        let domain_column_added = own_schema
            && self
                .add_column(
                    &present,
                    "pulp_domain_id",
                    "uuid NOT NULL DEFAULT '00000000-0000-0000-0000-000000000000'",
                )
                .await?;
        let task_group_column_added =
            own_schema && self.add_column(&present, "task_group_id", "uuid").await?;
        let fair_indexes_created = fair_indexes && !present.iter().any(|i| i == "fair-indexes");
        if fair_indexes_created {
            let client = self.client().await?;
            // The leftovers of a failed concurrent build are invalid: dropped, then built anew.
            let invalid = client
                .query(
                    "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
                     WHERE c.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid \
                       AND c.relname IN ('dispatch_groups_idx', 'dispatch_immediate_idx', \
                                         'dispatch_task_groups_idx')",
                    &[],
                )
                .await?;
            for row in invalid {
                let name: String = row.try_get(0)?;
                client
                    .batch_execute(&format!("DROP INDEX CONCURRENTLY IF EXISTS {name}"))
                    .await?;
            }
            for statement in sql::FAIR_INDEXES
                .split(";\n")
                .filter(|s| s.contains("CREATE"))
            {
                client.batch_execute(statement).await?;
            }
        }
        let gin_fastupdate_changed = gin_fastupdate_off
            && !self
                .schema_items()
                .await?
                .iter()
                .any(|i| i == "gin-fastupdate-off");
        if gin_fastupdate_changed {
            self.client()
                .await?
                .batch_execute(sql::GIN_FASTUPDATE)
                .await?;
        }
        let had_lanes_index = self
            .schema_items()
            .await?
            .iter()
            .any(|i| i == "lanes-index");
        let lanes_index_created = lanes_index && !had_lanes_index;
        if lanes_index_created {
            let client = self.client().await?;
            client
                .batch_execute("DROP INDEX CONCURRENTLY IF EXISTS dispatch_lanes_idx")
                .await?;
            client.batch_execute(sql::LANES_INDEX).await?;
        }
        let present = self.schema_items().await?;
        Ok(migrate::Outcome {
            created,
            lanes_index_created,
            fair_indexes_created,
            domain_column_added,
            task_group_column_added,
            notify_trigger_created,
            gin_fastupdate_changed,
            missing: migrate::missing(&present),
            optional: migrate::optional(&present),
        })
    }

    /// The groups with waiting tasks (at most `max`), each with its oldest waiting task's
    /// position, and whether an immediate task waits (groups_waiting.sql: a skip scan).
    pub async fn groups_waiting(
        &self,
        by: crate::fair::FairBy,
        max: i64,
    ) -> Result<(Vec<(Uuid, (DateTime<Utc>, TaskId))>, bool), Error> {
        let statement = match by {
            crate::fair::FairBy::TaskGroup => &sql::GROUPS_WAITING_BY_TASK_GROUP,
            _ => &sql::GROUPS_WAITING,
        };
        let mut rows = self.query_read(statement, &[&max]).await?;
        let closing = rows.pop().ok_or_else(|| {
            Error::Unexpected("groups_waiting.sql returned no closing row".into())
        })?;
        let immediate: Option<TaskId> = closing.try_get(2)?;
        let groups = rows
            .iter()
            .map(|r| Ok((r.try_get(0)?, (r.try_get(1)?, r.try_get(2)?))))
            .collect::<Result<_, Error>>()?;
        Ok((groups, immediate.is_some()))
    }

    /// Every domain's name by id (Pulp's `core_domain`); empty on the broker's own schema.
    pub async fn domain_names(&self) -> Result<HashMap<Uuid, String>, Error> {
        // The table alone, not the whole schema check (this runs whenever a domain is new).
        let has_domains: bool = self
            .query_read(sql::DOMAIN_TABLE, &[])
            .await?
            .first()
            .is_some_and(|r| r.get(0));
        if !has_domains {
            return Ok(HashMap::new());
        }
        let rows = self.query_read(sql::DOMAIN_NAMES, &[]).await?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect()
    }

    /// Adds `column` (of `definition`) to a `core_task` an older `migrate` made, when the schema
    /// items `present` lack it; true when it was added.
    async fn add_column(
        &self,
        present: &[String],
        column: &str,
        definition: &str,
    ) -> Result<bool, Error> {
        if present.iter().any(|i| *i == format!("core_task.{column}")) {
            return Ok(false);
        }
        self.client()
            .await?
            .batch_execute(&format!(
                "ALTER TABLE core_task ADD COLUMN IF NOT EXISTS {column} {definition}"
            ))
            .await?;
        Ok(true)
    }

    /// Whether fair dispatch's indexes exist and are valid (`migrate --fair-indexes`).
    pub async fn has_fair_indexes(&self) -> Result<bool, Error> {
        Ok(self
            .schema_items()
            .await?
            .iter()
            .any(|i| i == "fair-indexes"))
    }

    /// The pool, for tests and tools that need raw SQL.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
}

/// Reads an hstore rendered as JSON. A component without a version (`NULL`) needs the component
/// at any version; text that is not a JSON object gives `None` (incompatible with everything).
pub fn parse_versions(json: &str) -> Option<BTreeMap<String, String>> {
    let parsed: BTreeMap<String, Option<String>> = serde_json::from_str(json).ok()?;
    Some(
        parsed
            .into_iter()
            .map(|(component, version)| (component, version.unwrap_or_else(|| "0".to_owned())))
            .collect(),
    )
}

/// The server's message when there is one (tokio-postgres shows only "db error" otherwise).
fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => error.to_string(),
    }
}

fn task_row(row: &Row) -> Result<TaskRow, Error> {
    let record: Vec<String> = row.try_get(3)?;
    let versions: Option<String> = row.try_get(4)?;
    let versions = versions.as_deref().and_then(parse_versions);
    Ok(TaskRow {
        id: row.try_get(0)?,
        created: row.try_get(1)?,
        name: row.try_get(2)?,
        immediate: row.try_get(5)?,
        domain: row.try_get("domain")?,
        task_group: row.try_get("task_group")?,
        candidate: Candidate {
            resources: Resources::from_record(&record),
            older_conflicts: row.try_get(6)?,
            versions,
        },
    })
}

/// How many connections a read-only statement tries when each turns out closed.
const READ_TRIES: u32 = 4;

/// How long the lane gauge's full pass may read the queue in one statement (lanes.sql, without
/// `dispatch_lanes_idx`): it runs in the background, so the backend timeout does not apply.
pub const FULL_PASS_LIMIT: Duration = Duration::from_secs(60);

/// A directed page and the pages of the groups read ahead with it (`Tasks::directed_pages`).
#[derive(Debug)]
pub struct DirectedPages {
    /// The page asked for.
    pub lead: Page,
    /// Each group read ahead, with its page (empty when none of its first tasks could be taken).
    pub ahead: Vec<(Uuid, Page)>,
}

/// One page of candidates.sql.
#[derive(Debug)]
pub struct Page {
    /// The page's tasks, in queue order.
    pub tasks: Vec<TaskRow>,
    /// As many tasks as asked for: more may follow.
    pub full: bool,
    /// The held entries (of claimed and running tasks) the page skipped tasks by.
    pub held: Vec<String>,
    /// When the page is not full: every waiting task created up to it (committed then or
    /// later) was returned or skipped. `None` on a full page, or when an open writer's start
    /// cannot be read.
    pub tail: Option<DateTime<Utc>>,
    /// A directed page that holds every waiting task of its group (or every immediate one) as
    /// of the read: its scope read fewer rows than it may, and the page returned them all.
    pub whole: bool,
}

impl Page {
    /// When the page is not full, the queue position every waiting task it did not return lies
    /// at or before (skipped), or `None`.
    pub fn end(&self) -> Option<(DateTime<Utc>, TaskId)> {
        if self.full {
            return None;
        }
        self.tail.map(|tail| (tail, TaskId::MAX))
    }
}

/// Runs a read, and again on another connection (up to [`READ_TRIES`] in all) while it fails
/// because its pooled connection had been closed by the server while it sat idle (a restart, a
/// terminated session) before the pool noticed: a read changes nothing, so repeating it is safe.
/// Each closed connection is discarded when it is handed back, so every try gets another; a
/// session terminated by an operator (or a restart) may leave several.
async fn retry_closed<F, Fut>(read: F) -> Result<Vec<Row>, Error>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Vec<Row>, Error>>,
{
    let mut tries = 1;
    loop {
        match read().await {
            Err(Error::Db(e)) if e.is_closed() && tries < READ_TRIES => tries += 1,
            other => return other,
        }
    }
}

/// The task state in column `at` of `row`; a state Pulp does not have is a schema error.
fn state_at(row: &Row, at: usize) -> Result<TaskState, Error> {
    let state: String = row.try_get(at)?;
    TaskState::parse(&state)
        .ok_or_else(|| Error::Schema(format!("core_task.state {state:?} is no state Pulp has")))
}

/// A row of task.sql or task_facts.sql.
fn task_with_state(row: &Row) -> Result<TaskWithState, Error> {
    Ok(TaskWithState {
        row: task_row(row)?,
        state: state_at(row, 7)?,
        app_lock_id: row.try_get(8)?,
    })
}

/// candidates.sql with its page size written in as a number (see the file's header): one
/// prepared statement per page size, each planned once per connection; for a directed page, the
/// `scope` it reads in place of every waiting task.
pub fn candidates_sql(limit: i64, directed: Option<Directed>) -> String {
    const FROM: &str = "FROM core_task t\n    -- $only\n";
    const SCOPE: &str = "-- $scope\n";
    const SCANNED: &str = "NULL::json -- $scanned\n";
    const TAIL: &str = "CASE WHEN (SELECT count(*) FROM page) < $page_size THEN (";
    for marker in [FROM, SCOPE, SCANNED, TAIL] {
        debug_assert_eq!(sql::CANDIDATES.matches(marker).count(), 1);
    }
    let limit = limit.max(1);
    let scan = limit.saturating_mul(DIRECTED_SCAN_PER_ROW);
    // The first rows of one group's (or kind's) waiting tasks, `scan` read at most, those the
    // page would skip left out, `rows` kept, each with how many its scan read.
    let bounded = |only: &str, order: &str, scan: i64, rows: i64| {
        format!(
            "SELECT w.* FROM (\n\
             \x20       SELECT x.*, count(*) OVER () AS scanned FROM (\n\
             \x20           SELECT * FROM core_task u WHERE u.state = 'waiting' AND {only}\n\
             \x20           ORDER BY {order}u.pulp_created, u.pulp_id LIMIT {scan}) x) w\n\
             \x20   WHERE (w.app_lock_id IS NULL) IS TRUE\n\
             \x20     AND NOT (coalesce(w.reserved_resources_record, '{{}}'::text[]) && (SELECT keys FROM excluded))\n\
             \x20   ORDER BY w.pulp_created, w.pulp_id LIMIT {rows}"
        )
    };
    let (scope, key, rows) = match directed {
        None => {
            return sql::CANDIDATES
                .replace(FROM, "FROM core_task t\n")
                .replace("$page_size", &limit.to_string());
        }
        Some(Directed::Immediate) => (
            bounded("u.immediate", "", scan, limit),
            "'00000000-0000-0000-0000-000000000000'::uuid".to_owned(),
            limit,
        ),
        Some(Directed::Group(_) | Directed::TaskGroup(_)) => {
            let group = match directed {
                Some(Directed::TaskGroup(_)) => TASK_GROUP_GROUP,
                _ => DOMAIN_GROUP,
            };
            let of = |alias: &str| group.replace("t.", &format!("{alias}."));
            let lead = bounded(
                &format!("{} = $8::uuid", of("u")),
                &format!("{}, ", of("u")),
                scan,
                limit,
            );
            let ahead_rows = (limit / 4).max(1);
            let ahead = bounded(
                &format!("{} = a.grp", of("u")),
                &format!("{}, ", of("u")),
                ahead_rows.saturating_mul(DIRECTED_SCAN_PER_ROW),
                ahead_rows,
            );
            (
                format!(
                    "({lead})\n    UNION ALL\n    \
                     SELECT v.* FROM unnest($9::uuid[]) AS a(grp) CROSS JOIN LATERAL (\n    {ahead}) v"
                ),
                of("s"),
                limit + ahead_rows.saturating_mul(READ_AHEAD as i64),
            )
        }
    };
    sql::CANDIDATES
        .replace(SCOPE, &format!("scope AS (\n    {scope}\n),\n"))
        .replace(FROM, "FROM scope t\n")
        .replace(
            SCANNED,
            &format!(
                "(SELECT json_object_agg(k, n) FROM (SELECT DISTINCT {key} AS k, s.scanned AS n FROM scope s) c)\n"
            ),
        )
        .replace(TAIL, "CASE WHEN false THEN (")
        .replace("$page_size", &rows.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read answered unexpectedly changed nothing; a write may have: a claim round whose
    /// answer lacks a task's row may have claimed it, so the grant is put back (requeued) before
    /// its locks go, not only let go (`dispatch::claiming`). Both are the broker's fault.
    #[test]
    fn a_write_answered_unexpectedly_may_have_taken_effect() {
        let read = Error::Unexpected("candidates.sql returned no closing row".into());
        let write = Error::UnexpectedWrite("claim_round.sql returned no row for task".into());
        assert!(read.certainly_not_applied());
        assert!(!write.certainly_not_applied());
        let batch = Error::Batch(std::sync::Arc::new(Error::UnexpectedWrite(
            "a batch".into(),
        )));
        assert!(!batch.certainly_not_applied());
        assert!(read.is_broker_fault() && write.is_broker_fault());
        assert!(!write.is_refused() && !write.app_status_gone());
    }

    #[test]
    fn a_finish_waiting_for_its_row_is_the_batch_statement_without_skip_locked() {
        assert!(sql::FINISH.contains("SKIP LOCKED"));
        assert!(!sql::FINISH_WAITING.contains("SKIP LOCKED"));
        assert_eq!(
            sql::FINISH_WAITING.as_str(),
            sql::FINISH.replace(" SKIP LOCKED", "")
        );
    }

    #[test]
    fn the_walk_knows_the_page_size_of_lanes_page_sql() {
        // A page shorter than LANE_PAGE_ROWS ends the walk: the two must agree.
        assert!(
            sql::LANES_PAGE.contains(&format!("LIMIT {LANE_PAGE_ROWS}\n")),
            "lanes_page.sql's LIMIT differs from LANE_PAGE_ROWS"
        );
    }

    /// A task store on a throwaway Postgres with a pool of `pool_size` connections.
    async fn throwaway(pool_size: usize) -> (dispatch_testkit::Postgres, Tasks) {
        let pg = tokio::task::spawn_blocking(dispatch_testkit::Postgres::start)
            .await
            .unwrap()
            .expect("start postgres");
        let tasks = Tasks::connect(
            &pg.url("postgres"),
            pool_size,
            Duration::from_secs(5),
            Arc::new(Stats::default()),
        )
        .await
        .unwrap();
        (pg, tasks)
    }

    /// Statements one after another take the connection used last, not each pooled connection
    /// in turn: at idle, a connection handed out in turn has sat idle past VERIFY_IDLE_AFTER and
    /// costs a verifying query (a transaction of its own) before every statement.
    #[tokio::test]
    async fn statements_one_after_another_reuse_the_last_connection() {
        let (_pg, tasks) = throwaway(4).await;
        // Four connections in the pool, all handed back.
        let held = futures::future::try_join_all((0..4).map(|_| tasks.client()))
            .await
            .unwrap();
        drop(held);
        let mut backends = std::collections::BTreeSet::new();
        for _ in 0..6 {
            let rows = tasks.query("SELECT pg_backend_pid()", &[]).await.unwrap();
            backends.insert(rows[0].get::<_, i32>(0));
        }
        assert_eq!(
            backends.len(),
            1,
            "six statements one after another ran on {} connections",
            backends.len()
        );
    }

    /// A read under planner settings that fails before its statement is sent (a parameter that
    /// does not encode) leaves no transaction open on a pooled connection: the next statement
    /// runs outside it, with the settings as they were.
    #[tokio::test]
    async fn a_read_under_settings_that_fails_leaves_no_transaction_behind() {
        let (_pg, tasks) = throwaway(1).await;
        let failed = tasks
            .query_read_under(
                sql::CANDIDATES_SETTINGS,
                "SELECT $1::int",
                &[&"not a number"],
            )
            .await;
        assert!(
            failed.is_err(),
            "the parameter encoded: the test proves nothing"
        );
        // (One connection in the pool: this runs where the failed read ran, or on its
        // replacement.)
        let rows = tasks
            .query(
                "SELECT current_setting('transaction_read_only'), current_setting('enable_sort')",
                &[],
            )
            .await
            .unwrap();
        let (read_only, sort): (String, String) = (rows[0].get(0), rows[0].get(1));
        assert_eq!(
            (read_only.as_str(), sort.as_str()),
            ("off", "on"),
            "the next statement ran inside the failed read's transaction"
        );
    }
}
