//! Long-poll FetchTask: what wakes a waiting call (the insert trigger's NOTIFY, Pulp's own
//! `pulp_worker_wakeup`, a release by another lease, a release through another replica), that
//! an idle fleet of waiters costs one pass per wake-up instead of one per waiter, that the oldest
//! task goes to the longest waiter, that a waiter going away strands nobody, the waiter limit,
//! and shutdown. The safety re-check is set to a minute wherever a test proves a wake-up, so
//! nothing but that wake-up can hand out the task.

use crate::support;

use std::time::Duration;

use crate::support::{eventually, id, sessions_wait_on_locks, Env};
use dispatch_broker::proto::{FetchTaskRequest, Task};
use tonic::Code;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(20);
const NEVER: Duration = Duration::from_secs(60);
/// A pass stall longer than any test's wait for a held-up pass, shorter than `LONG` (a call
/// whose wait is shorter than the stall does not wait for a running pass).
const HOLD: Duration = Duration::from_secs(15);

/// A broker whose waiting fetches wake only on notifications and this replica's own RPCs.
async fn no_polling() -> Env {
    Env::with(|a| {
        a.fetch.recheck = NEVER;
        a.fetch.wake_poll = NEVER;
    })
    .await
}

fn wait_request(lease: &str, wait: Duration) -> FetchTaskRequest {
    FetchTaskRequest {
        wait: Some(wait.try_into().unwrap()),
        ..support::fetch_request(lease)
    }
}

fn spawn_wait(
    env: &Env,
    lease: &str,
) -> tokio::task::JoinHandle<Result<Option<Task>, tonic::Status>> {
    spawn_wait_starting(env, lease, false)
}

/// [`spawn_wait`], with `start` asking the grant to start the task.
fn spawn_wait_starting(
    env: &Env,
    lease: &str,
    start: bool,
) -> tokio::task::JoinHandle<Result<Option<Task>, tonic::Status>> {
    let mut client = env.client.clone();
    let request = FetchTaskRequest {
        start,
        ..wait_request(lease, LONG)
    };
    tokio::spawn(async move {
        client
            .fetch_task(request)
            .await
            .map(|r| r.into_inner().task)
    })
}

/// Waits until `n` FetchTask calls wait in the broker's queue.
async fn waiting_reach(env: &Env, n: usize) {
    eventually(LONG, || async { env.broker().waiters.len() >= n })
        .await
        .expect("the fetches are waiting");
}

async fn got(handle: tokio::task::JoinHandle<Result<Option<Task>, tonic::Status>>) -> Option<Task> {
    tokio::time::timeout(LONG, handle)
        .await
        .expect("the waiting fetch returned")
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn an_insert_wakes_a_waiting_fetch() {
    let mut env = no_polling().await;
    let lease = env.open("w").await;
    let waiting = spawn_wait(&env, &lease);
    waiting_reach(&env, 1).await;
    assert!(!waiting.is_finished(), "nothing to hand out yet");
    let task = env.task(&["a"]).await;
    let granted = got(waiting)
        .await
        .expect("woken by the insert trigger's NOTIFY");
    assert_eq!(id(&granted), task);
    env.shutdown().await;
}

#[tokio::test]
async fn pulps_own_wakeup_channel_wakes_a_waiting_fetch() {
    let mut env = no_polling().await;
    // As on Pulp's database: no trigger of the broker's; pulpcore's dispatch() notifies instead.
    env.db
        .batch_execute("DROP TRIGGER dispatch_task_notify ON core_task")
        .await
        .unwrap();
    let lease = env.open("w").await;
    let waiting = spawn_wait(&env, &lease);
    waiting_reach(&env, 1).await;
    let task = env.task(&["a"]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "an insert alone does not wake it here"
    );
    env.db
        .batch_execute("SELECT pg_notify('pulp_worker_wakeup', 'unblock')")
        .await
        .unwrap();
    assert_eq!(
        id(&got(waiting).await.expect("woken by Pulp's channel")),
        task
    );
    env.shutdown().await;
}

#[tokio::test]
async fn a_release_by_another_lease_wakes_the_waiter() {
    let mut env = no_polling().await;
    let first = env.task(&["a"]).await;
    let second = env.task(&["a"]).await;
    let holder = env.open("holder").await;
    let held = env.fetch(&holder).await.unwrap();
    assert_eq!(id(&held), first);
    let waiter = env.open("waiter").await;
    let waiting = spawn_wait(&env, &waiter);
    waiting_reach(&env, 1).await;
    assert!(!waiting.is_finished());
    env.finish(&holder, &held, "completed").await;
    assert_eq!(
        id(&got(waiting).await.expect("woken by the finish")),
        second
    );
    env.shutdown().await;
}

#[tokio::test]
async fn a_release_through_another_replica_wakes_the_waiter() {
    // This replica polls Redis's change counter; the release happens on a second replica.
    let mut env = Env::with(|a| {
        a.fetch.recheck = NEVER;
        a.fetch.wake_poll = Duration::from_millis(50);
    })
    .await;
    let (other, mut other_client) = env.second_replica().await;
    let first = env.task(&["a"]).await;
    let second = env.task(&["a"]).await;
    let holder = support::open_on(&mut other_client, "holder").await;
    let held = support::fetch_on(&mut other_client, &holder).await.unwrap();
    assert_eq!(id(&held), first);
    let waiter = env.open("waiter").await;
    let waiting = spawn_wait(&env, &waiter);
    waiting_reach(&env, 1).await;
    other_client
        .release_locks(dispatch_broker::proto::ReleaseLocksRequest {
            lease_id: holder,
            task_id: held.task_id.clone(),
            fencing_token: held.fencing_token,
        })
        .await
        .unwrap();
    // The released task went back to the queue (it never started) and is the oldest again.
    let granted = got(waiting)
        .await
        .expect("woken through Redis's change counter");
    assert_eq!(id(&granted), first);
    assert_ne!(id(&granted), second);
    other.shutdown().await.unwrap();
    env.shutdown().await;
}

#[tokio::test]
async fn an_idle_fleet_costs_one_pass_per_wake_up_not_one_per_waiter() {
    const WAITERS: u64 = 30;
    let mut env = Env::with(|a| {
        a.fetch.recheck = Duration::from_millis(100);
        a.fetch.wake_poll = Duration::from_millis(20);
    })
    .await;
    let mut handles = Vec::new();
    for n in 0..WAITERS {
        let lease = env.open(&format!("w{n}")).await;
        handles.push(spawn_wait(&env, &lease));
    }
    waiting_reach(&env, WAITERS as usize).await;
    let idle_start = env.broker().stats.snapshot().fetch_passes;
    let wakes_start = env.broker().waiters.generation();
    // Ten wake-ups (safety ticks) go by with nothing to hand out: counted by the broker, not
    // by the clock.
    eventually(LONG, || async {
        env.broker().waiters.generation() >= wakes_start + 10
    })
    .await
    .expect("ten wake-ups");
    let idle_passes = env.broker().stats.snapshot().fetch_passes - idle_start;
    let wakes = env.broker().waiters.generation() - wakes_start;
    assert!(
        (1..=wakes + 2).contains(&idle_passes),
        "{idle_passes} passes for {wakes} wake-ups: each wakes one waiter, not all {WAITERS}"
    );
    // They are all still served: 30 tasks go to the 30 waiters.
    for n in 0..WAITERS {
        env.task(&[&format!("r{n}")]).await;
    }
    let mut granted = Vec::new();
    for h in handles {
        granted.push(id(&got(h).await.expect("every waiter got a task")));
    }
    granted.sort();
    granted.dedup();
    assert_eq!(granted.len() as u64, WAITERS, "distinct tasks");
    env.shutdown().await;
}

#[tokio::test]
async fn the_oldest_task_goes_to_the_longest_waiter() {
    let mut env = no_polling().await;
    let (a, b) = (env.open("first").await, env.open("second").await);
    let longest = spawn_wait(&env, &a);
    waiting_reach(&env, 1).await;
    let newer = spawn_wait(&env, &b);
    waiting_reach(&env, 2).await;
    // Two tasks in one statement: one notification.
    env.db
        .batch_execute(
            "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), 't' || i, 'waiting', ARRAY['r' || i] \
             FROM generate_series(1, 2) AS i",
        )
        .await
        .unwrap();
    let (first, second) = (got(longest).await.unwrap(), got(newer).await.unwrap());
    assert_eq!((first.name.as_str(), second.name.as_str()), ("t1", "t2"));
    env.shutdown().await;
}

#[tokio::test]
async fn a_waiter_that_goes_away_strands_nobody_and_holds_nothing() {
    let mut env = no_polling().await;
    let (a, b) = (env.open("leaves").await, env.open("stays").await);
    let leaving = spawn_wait(&env, &a);
    waiting_reach(&env, 1).await;
    let staying = spawn_wait(&env, &b);
    waiting_reach(&env, 2).await;
    leaving.abort(); // the client disconnects while waiting
    let _ = leaving.await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let task = env.task(&["a"]).await;
    let granted = got(staying).await.expect("the remaining waiter was woken");
    assert_eq!(id(&granted), task);
    assert!(env.app_lock(task).await.is_some());
    env.assert_locks(&[&granted]).await;
    env.shutdown().await;
}

#[tokio::test]
async fn waiters_over_the_limit_get_resource_exhausted_and_change_nothing() {
    let mut env = Env::with(|a| a.fetch.max_waiters = 2).await;
    let lease = env.open("w").await;
    let _one = spawn_wait(&env, &lease);
    let _two = spawn_wait(&env, &lease);
    waiting_reach(&env, 2).await;
    let status = env
        .client
        .fetch_task(wait_request(&lease, LONG))
        .await
        .expect_err("over the limit");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("--fetch-max-waiters"),
        "{}",
        status.message()
    );
    // A call that does not wait is still answered.
    assert!(env.fetch(&lease).await.is_none());
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

#[tokio::test]
async fn shutdown_answers_waiting_calls_at_once_with_no_task() {
    let mut env = no_polling().await;
    let lease = env.open("w").await;
    // It asks to wait three times as long as the test waits for its answer (the longest wait
    // honoured, --fetch-max-wait): answered in time, it was answered by the shutdown.
    let mut client = env.client.clone();
    let request = wait_request(&lease, 3 * LONG);
    assert!(env.args.fetch.max_wait >= 3 * LONG);
    let waiting = tokio::spawn(async move {
        client
            .fetch_task(request)
            .await
            .map(|r| r.into_inner().task)
    });
    waiting_reach(&env, 1).await;
    let broker = env.broker.take().unwrap();
    let stopping = tokio::spawn(async move { broker.shutdown().await });
    let answer = tokio::time::timeout(LONG, waiting)
        .await
        .expect("answered before the wait ran out")
        .unwrap();
    assert!(matches!(answer, Ok(None)), "{answer:?}");
    stopping.await.unwrap().unwrap();
}

#[tokio::test]
async fn long_polls_arriving_at_an_idle_queue_join_it_without_a_pass() {
    let mut env = no_polling().await;
    let first = env.open("first").await;
    let before = env.broker().stats.snapshot().fetch_passes;
    let _first = spawn_wait(&env, &first);
    waiting_reach(&env, 1).await;
    assert_eq!(env.broker().stats.snapshot().fetch_passes, before + 1);
    let mut rest = Vec::new();
    for n in 0..10 {
        let lease = env.open(&format!("w{n}")).await;
        rest.push(spawn_wait(&env, &lease));
    }
    waiting_reach(&env, 11).await;
    assert_eq!(
        env.broker().stats.snapshot().fetch_passes,
        before + 1,
        "nothing woke the queue since the first pass found nothing: no new pass"
    );
    // An unknown lease is still told at once.
    let status = env
        .client
        .fetch_task(wait_request(&uuid::Uuid::new_v4().to_string(), LONG))
        .await
        .expect_err("unknown lease");
    assert_eq!(status.code(), Code::NotFound);
    // And they are all served when tasks come.
    let task = env.task(&["a"]).await;
    let granted = got(_first).await.expect("the longest waiter got it");
    assert_eq!(id(&granted), task);
    env.shutdown().await;
}

/// A worker that has just finished a task (Redis said its lease is alive) joins the idle queue
/// with no Redis call; once its lease is closed through this replica it is told at once.
#[tokio::test]
async fn a_long_poll_right_after_a_finish_joins_with_no_redis_call() {
    long_poll_right_after_a_finish(false).await;
}

/// As above, the lease revoked through the admin API of this replica.
#[tokio::test]
async fn a_lease_revoked_through_this_replica_is_told_at_once() {
    long_poll_right_after_a_finish(true).await;
}

async fn long_poll_right_after_a_finish(revoke: bool) {
    let mut env = no_polling().await;
    let worker = env.open("worker").await;
    env.task(&["a"]).await;
    let task = env.fetch(&worker).await.expect("the task");
    env.finish(&worker, &task, "completed").await;
    // Another waiter's pass finds nothing: the queue is known to be empty.
    let other = env.open("other").await;
    let _other = spawn_wait(&env, &other);
    waiting_reach(&env, 1).await;
    let before = env.broker().stats.snapshot();
    let waiting = spawn_wait(&env, &worker);
    waiting_reach(&env, 2).await;
    let after = env.broker().stats.snapshot();
    assert_eq!(
        after.redis_calls, before.redis_calls,
        "the lease was alive a moment ago: no Redis call to join"
    );
    assert_eq!(after.fetch_passes, before.fetch_passes, "and no pass");
    if revoke {
        dispatch_broker::proto::admin_client::AdminClient::connect(format!(
            "http://{}",
            env.broker().addr
        ))
        .await
        .expect("the admin API")
        .revoke_lease(dispatch_broker::proto::RevokeLeaseRequest {
            lease_id: worker.clone(),
            reason: "test".into(),
        })
        .await
        .expect("revoke the lease");
    } else {
        env.client
            .clone()
            .close_lease(dispatch_broker::proto::CloseLeaseRequest {
                lease_id: worker.clone(),
            })
            .await
            .expect("close the lease");
    }
    let status = env
        .client
        .fetch_task(wait_request(&worker, LONG))
        .await
        .expect_err("an ended lease");
    assert_eq!(status.code(), Code::NotFound);
    drop(waiting);
    env.shutdown().await;
}

/// When Postgres refuses a round's claim statement for one of its tasks (here: a waiter's
/// core_appstatus row is gone, so its claim breaks the foreign key), the round's tasks are
/// claimed one by one: the other waiter still gets its task, the one whose row is gone hears
/// NOT_FOUND, and its task is left unlocked and waiting.
#[tokio::test]
async fn a_round_whose_claim_postgres_refuses_is_claimed_task_by_task() {
    let mut env = no_polling().await;
    let waiters = queue_of_waiters(&mut env, 2).await;
    env.db
        .execute("DELETE FROM core_appstatus WHERE name = 'w1'", &[])
        .await
        .unwrap();
    insert_burst(&env, 2).await;
    let mut waiters = waiters.into_iter();
    let first = waiters.next().unwrap();
    let granted = got(first).await.expect("the longest waiter was served");
    assert_eq!(granted.name, "t1");
    let t2: uuid::Uuid = env
        .db
        .query_one("SELECT pulp_id FROM core_task WHERE name = 't2'", &[])
        .await
        .unwrap()
        .get(0);
    // The other waiter's claim of t2 found its lease's row gone: it hears NOT_FOUND (its lease
    // is ended), and t2 is left waiting and unlocked.
    let second = waiters.next().unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the waiter whose row is gone is answered")
        .unwrap()
        .expect_err("a lease whose row is gone");
    assert_eq!(refused.code(), Code::NotFound, "{refused:?}");
    waiting_reach_zero(&env).await;
    env.broker().passes.idle().await;
    assert_eq!(env.locked_tasks().await.len(), 1, "only t1 stays locked");
    assert_eq!(env.state(t2).await, "waiting");
    env.assert_locks(&[&granted]).await;
    env.shutdown().await;
}

/// Inserts `n` waiting tasks `t1`..`tn` (resources `r1`..`rn`, `t1` oldest) in one statement:
/// one notification.
async fn insert_burst(env: &Env, n: usize) {
    env.db
        .batch_execute(&format!(
            "INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
             SELECT gen_random_uuid(), now() + i * interval '1 ms', 't' || i, 'waiting', \
                    ARRAY['r' || i] \
             FROM generate_series(1, {n}) AS i"
        ))
        .await
        .unwrap();
}

/// `n` waiters queued in order, each under its own lease.
async fn queue_of_waiters(
    env: &mut Env,
    n: usize,
) -> Vec<tokio::task::JoinHandle<Result<Option<Task>, tonic::Status>>> {
    let mut handles = Vec::new();
    for i in 0..n {
        let lease = env.open(&format!("w{i}")).await;
        handles.push(spawn_wait(env, &lease));
        waiting_reach(env, i + 1).await;
    }
    handles
}

/// A burst of `n` tasks reaching `n` queued waiters: each waiter's task, oldest task to the
/// longest waiter, and what the broker spent on it.
async fn serve_burst(env: &mut Env, n: usize) -> dispatch_broker::metrics::StatsSnapshot {
    let handles = queue_of_waiters(env, n).await;
    let before = env.broker().stats.snapshot();
    insert_burst(env, n).await;
    let mut names = Vec::new();
    for h in handles {
        names.push(got(h).await.expect("every waiter is served").name);
    }
    let expected: Vec<String> = (1..=n).map(|i| format!("t{i}")).collect();
    assert_eq!(names, expected, "oldest task to the longest waiter");
    env.broker().stats.snapshot() - before
}

#[tokio::test]
async fn one_pass_hands_a_burst_of_ready_tasks_to_every_waiter_oldest_to_longest() {
    const N: usize = 20;
    let mut env = no_polling().await;
    let spent = serve_burst(&mut env, N).await;
    assert_eq!(
        spent.shared,
        N as u64 - 1,
        "one pass served the other waiters"
    );
    assert!(
        spent.fetch_passes <= 2,
        "{} passes for a burst of {N}: one scan serves them all",
        spent.fetch_passes
    );
    env.shutdown().await;
}

#[tokio::test]
async fn without_sharing_each_waiter_of_a_burst_makes_its_own_pass() {
    const N: usize = 20;
    let mut env = Env::with(|a| {
        a.fetch.recheck = NEVER;
        a.fetch.wake_poll = NEVER;
        a.fetch.share = 0;
    })
    .await;
    let spent = serve_burst(&mut env, N).await;
    assert_eq!(spent.shared, 0);
    assert!(
        spent.fetch_passes >= N as u64,
        "{} passes",
        spent.fetch_passes
    );
    env.shutdown().await;
}

#[tokio::test]
async fn a_shared_pass_keeps_each_waiters_versions_and_skips() {
    let mut env = no_polling().await;
    // A running task holds `x`; the task behind it waits for it.
    let head = env.task(&["x"]).await;
    let holder = env.open("holder").await;
    let running = env.fetch(&holder).await.unwrap();
    assert_eq!(id(&running), head);
    let behind = env.task(&["x"]).await;
    // The longest waiter skips `behind` and has an old core; the next has a new core.
    let old = env.open_with("old", &[("core", "3.100")], None).await;
    let mut client = env.client.clone();
    let skipping = tokio::spawn(async move {
        client
            .fetch_task(FetchTaskRequest {
                skip_task_ids: vec![behind.to_string()],
                ..wait_request(&old, LONG)
            })
            .await
            .map(|r| r.into_inner().task)
    });
    waiting_reach(&env, 1).await;
    let new = env.open_with("new", &[("core", "3.200")], None).await;
    let newer = spawn_wait(&env, &new);
    waiting_reach(&env, 2).await;
    let needs_new = env
        .task_with(&["y"], "needs.new", &[("core", "3.150")])
        .await;
    // `needs_new` woke the queue: the old core cannot take it, the new one can.
    let first = got(newer).await.expect("the new core's waiter got it");
    assert_eq!(id(&first), needs_new);
    assert!(!skipping.is_finished(), "nothing the old core may take yet");
    let again = spawn_wait(&env, &new);
    waiting_reach(&env, 2).await;
    let before = env.broker().stats.snapshot();
    env.finish(&holder, &running, "completed").await;
    // `behind` is ready now: skipped by the longest waiter, it goes to the next.
    assert_eq!(id(&got(again).await.expect("served")), behind);
    assert!(env.broker().stats.snapshot().shared > before.shared);
    assert!(!skipping.is_finished(), "the skipping waiter still waits");
    let plain = env.task(&["z"]).await;
    assert_eq!(id(&got(skipping).await.expect("served")), plain);
    env.shutdown().await;
}

/// Waits until no fetch of this replica waits.
async fn waiting_reach_zero(env: &Env) {
    eventually(LONG, || async { env.broker().waiters.is_empty() })
        .await
        .expect("no fetch waits");
}

/// Waits until a broker session of this test's database waits on a row lock.
async fn a_claim_waits_on_a_row_lock(env: &Env) {
    sessions_wait_on_locks(env, 1).await;
}

/// A broker whose waiting fetches wake only on Pulp's channel (the insert trigger is gone), so
/// a test can set the stage before the queue looks.
async fn woken_by_hand() -> Env {
    let env = Env::with(|a| {
        a.fetch.recheck = NEVER;
        a.fetch.wake_poll = NEVER;
        a.backend_timeout = Duration::from_secs(30);
    })
    .await;
    env.db
        .batch_execute("DROP TRIGGER dispatch_task_notify ON core_task")
        .await
        .unwrap();
    env
}

async fn wake_by_hand(env: &Env) {
    env.db
        .batch_execute("SELECT pg_notify('pulp_worker_wakeup', 'unblock')")
        .await
        .unwrap();
}

#[tokio::test]
async fn a_waiter_that_leaves_while_a_shared_pass_claims_its_task_leaves_nothing_behind() {
    leaving_while_a_shared_pass_claims(false, false).await;
}

#[tokio::test]
async fn a_waiter_that_leaves_while_a_shared_pass_claims_and_starts_its_task_leaves_it_waiting() {
    leaving_while_a_shared_pass_claims(true, false).await;
}

#[tokio::test]
async fn a_task_canceled_while_its_undelivered_started_grant_is_undone_ends_canceled_unlocked() {
    leaving_while_a_shared_pass_claims(true, true).await;
}

/// Two waiters; the second's claim waits on a row lock while it disconnects. `start`: the
/// leaving waiter asked its grant to start the task (the longest did not: each is served as
/// it asked). `cancel`: a CancelTask for that task queues behind the claim on the row lock, so
/// it finds the task started by the grant that is about to be undone.
async fn leaving_while_a_shared_pass_claims(start: bool, cancel: bool) {
    let mut env = woken_by_hand().await;
    let a = env.open("longest").await;
    let longest = spawn_wait(&env, &a);
    waiting_reach(&env, 1).await;
    let b = env.open("leaves").await;
    let leaving = spawn_wait_starting(&env, &b, start);
    waiting_reach(&env, 2).await;
    let first = env.task(&["a"]).await;
    let second = env.task(&["b"]).await;
    // The claim of `second` (for the second waiter) waits on this row lock.
    let blocker = support::RowLock::take(&env.db_url, second).await;
    let before = env.broker().stats.snapshot();
    wake_by_hand(&env).await;
    // The longest waiter's grant does not wait for the other's claim.
    let granted = got(longest).await.expect("the longest waiter was served");
    assert_eq!(id(&granted), first);
    assert!(granted.started_at.is_none(), "claimed, not started");
    assert_eq!(env.state(first).await, "waiting");
    a_claim_waits_on_a_row_lock(&env).await;
    leaving.abort(); // its client disconnects while the pass claims its task
    let _ = leaving.await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let canceling = cancel.then(|| {
        let mut client = env.client.clone();
        let task_id = second.to_string();
        tokio::spawn(async move {
            client
                .cancel_task(dispatch_broker::proto::CancelTaskRequest { task_id })
                .await
        })
    });
    if cancel {
        // (Behind the claim on the row lock.)
        sessions_wait_on_locks(&env, 2).await;
    }
    blocker.rollback().await;
    let env_ref = &env;
    eventually(LONG, || async {
        env_ref.broker().stats.snapshot().shared > before.shared
    })
    .await
    .expect("the pass granted `second` to the waiter that had left");
    if let Some(canceling) = canceling {
        canceling.await.unwrap().expect("cancel");
        // Nobody ran it: the undone grant leaves it canceled, unclaimed and unlocked.
        eventually(LONG, || async { env_ref.app_lock(second).await.is_none() })
            .await
            .expect("the undelivered grant was undone");
        assert_eq!(env.state(second).await, "canceled");
        env.assert_locks(&[&granted]).await;
        env.shutdown().await;
        return;
    }
    // The grant nobody took went back: unclaimed, unlocked, and handed out again.
    eventually(LONG, || async { env_ref.app_lock(second).await.is_none() })
        .await
        .expect("the undelivered grant was put back");
    assert_eq!(env.state(second).await, "waiting");
    let started: bool = env
        .db
        .query_one(
            "SELECT started_at IS NOT NULL FROM core_task WHERE pulp_id = $1",
            &[&second],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!started, "no start time left behind");
    env.assert_locks(&[&granted]).await;
    let again = env.fetch(&b).await.expect("handed out again");
    assert_eq!(id(&again), second);
    env.shutdown().await;
}

/// [`woken_by_hand`] with one fetch waiting, its worker's core at 3.200.
async fn woken_by_hand_with_a_new_waiter() -> (
    Env,
    tokio::task::JoinHandle<Result<Option<Task>, tonic::Status>>,
) {
    let mut env = woken_by_hand().await;
    let new = env.open_with("new", &[("core", "3.200")], None).await;
    let waiting = spawn_wait(&env, &new);
    waiting_reach(&env, 1).await;
    (env, waiting)
}

#[tokio::test]
async fn a_waiter_whose_attempt_fails_gets_the_next_ready_task_in_the_same_pass() {
    let (mut env, waiting) = woken_by_hand_with_a_new_waiter().await;
    // Another waiter, which can take neither task: the pass recruits it, and must not give up
    // on `second` while `first`'s attempt is under way.
    let old = env.open_with("old", &[("core", "3.100")], None).await;
    let _other = spawn_wait(&env, &old);
    waiting_reach(&env, 2).await;
    let first = env.task_with(&["a"], "t", &[("core", "3.150")]).await;
    let second = env.task_with(&["b"], "t", &[("core", "3.150")]).await;
    // `first` is canceled behind the broker's back while its claim waits: the claim finds it
    // gone.
    let blocker = support::RowLock::take(&env.db_url, first).await;
    blocker
        .execute(
            "UPDATE core_task SET state = 'canceled' WHERE pulp_id = $1",
            first,
        )
        .await;
    let before = env.broker().stats.snapshot();
    wake_by_hand(&env).await;
    a_claim_waits_on_a_row_lock(&env).await;
    blocker.commit().await;
    let granted = got(waiting)
        .await
        .expect("served although its first attempt failed (nothing else wakes it)");
    assert_eq!(id(&granted), second);
    assert_eq!(
        env.broker().stats.snapshot().fetch_passes - before.fetch_passes,
        1,
        "one pass"
    );
    env.assert_locks(&[&granted]).await;
    env.shutdown().await;
}

#[tokio::test]
async fn a_fetch_that_will_not_wait_is_served_alone_and_wakes_the_waiters() {
    let mut env = woken_by_hand().await;
    let waiter = env.open("waiter").await;
    let waiting = spawn_wait(&env, &waiter);
    waiting_reach(&env, 1).await;
    // Both ready, nothing wakes the waiter: the fetch below is the first to look.
    let first = env.task(&["a"]).await;
    let second = env.task(&["b"]).await;
    let now = env.open("now").await;
    let before = env.settled_stats().await;
    let got_now = env.fetch(&now).await.expect("the oldest ready task");
    assert_eq!(id(&got_now), first);
    // The waiter was woken and served by its own pass: the fetch that would not wait handed
    // it nothing (a round of two would have held its answer up).
    let granted = got(waiting)
        .await
        .expect("woken after the fetch that would not wait");
    assert_eq!(id(&granted), second);
    assert_eq!(
        env.settled_stats().await.shared - before.shared,
        0,
        "a fetch with no wait recruits nobody"
    );
    env.assert_locks(&[&got_now, &granted]).await;
    env.shutdown().await;
}

#[tokio::test]
async fn a_fetch_that_will_not_wait_wakes_the_waiters_for_a_task_it_cannot_take() {
    let (mut env, waiting) = woken_by_hand_with_a_new_waiter().await;
    // Ready, but too new for the caller below; nothing wakes the waiter.
    let task = env.task_with(&["a"], "t", &[("core", "3.150")]).await;
    let old = env.open_with("old", &[("core", "3.100")], None).await;
    assert!(env.fetch(&old).await.is_none(), "not compatible");
    let granted = got(waiting)
        .await
        .expect("woken by the pass that passed over it");
    assert_eq!(id(&granted), task);
    env.shutdown().await;
}

/// A broker for the combining tests: at most `passes` fetch passes at once, a running pass
/// holding waiting calls up for at most `stall`; waiting calls wake only by hand (no insert
/// trigger, no safety re-check), so what serves them is the end of a pass or its stall.
async fn combining(
    passes: u64,
    stall: Duration,
    tweak: impl FnOnce(&mut dispatch_broker::config::ServeArgs),
) -> Env {
    let env = Env::with(|a| {
        a.fetch.recheck = NEVER;
        a.fetch.wake_poll = NEVER;
        a.backend_timeout = Duration::from_secs(60);
        a.fetch.passes = passes;
        a.fetch.pass_stall = stall;
        tweak(a);
    })
    .await;
    env.db
        .batch_execute("DROP TRIGGER dispatch_task_notify ON core_task")
        .await
        .unwrap();
    env
}

/// A waiting call whose own pass is held up: its claim of a task waits on a row lock until the
/// returned lock ends. The task needs a plugin only that call's worker has, so no waiter is
/// given it. (Skipping a task it does not know of keeps the call off the known-empty queue, and
/// with a `wait` its pass counts among the running passes and recruits waiters, as a pass with
/// no `wait` would not.) Returns the lock, the call and the task.
async fn held_up_pass(
    env: &mut Env,
) -> (
    support::RowLock,
    tokio::task::JoinHandle<Result<Option<Task>, tonic::Status>>,
    uuid::Uuid,
) {
    let versions = [("core", "3.123.1"), ("rare", "1.0")];
    let first = env.task_with(&["x"], "x", &versions).await;
    let blocker = support::RowLock::take(&env.db_url, first).await;
    let lease = env.open_with("held-up", &versions, None).await;
    let mut client = env.client.clone();
    let request = FetchTaskRequest {
        skip_task_ids: vec![Uuid::new_v4().to_string()],
        ..wait_request(&lease, LONG)
    };
    let held_up = tokio::spawn(async move {
        client
            .fetch_task(request)
            .await
            .map(|r| r.into_inner().task)
    });
    a_claim_waits_on_a_row_lock(env).await;
    (blocker, held_up, first)
}

/// While one pass is held up, `n` waiting fetches arrive, each with a ready task `t1`..`tn`:
/// returns how many of them were served while the pass was still held up, what the broker
/// spent from their arrival until every call was served, and its counters in all.
async fn arrivals_during_a_pass(
    passes: u64,
    stall: Duration,
    n: usize,
) -> (
    usize,
    dispatch_broker::metrics::StatsSnapshot,
    dispatch_broker::metrics::StatsSnapshot,
) {
    let mut env = combining(passes, stall, |_| {}).await;
    let (blocker, held_up, first) = held_up_pass(&mut env).await;
    insert_burst(&env, n).await;
    let before = env.broker().stats.snapshot();
    let mut handles = Vec::new();
    for i in 0..n {
        let lease = env.open(&format!("w{i}")).await;
        handles.push(spawn_wait(&env, &lease));
    }
    let env_ref = &env;
    let settled = eventually(Duration::from_secs(5), || async {
        let finished = handles.iter().filter(|h| h.is_finished()).count();
        finished + env_ref.broker().waiters.len() >= n
    })
    .await;
    settled.expect("every arriving call was served or waits");
    // (A moment for calls that are served without the held-up pass ending.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    let served_meanwhile = handles.iter().filter(|h| h.is_finished()).count();
    blocker.rollback().await;
    assert_eq!(id(&got(held_up).await.expect("served")), first);
    let mut names = Vec::new();
    for h in handles {
        names.push(got(h).await.expect("every arriving call is served").name);
    }
    names.sort();
    let mut expected: Vec<String> = (1..=n).map(|i| format!("t{i}")).collect();
    expected.sort();
    assert_eq!(names, expected, "each task handed out once");
    let spent = env.broker().stats.snapshot() - before;
    let total = env.broker().stats.snapshot();
    env.shutdown().await;
    (served_meanwhile, spent, total)
}

#[tokio::test]
async fn calls_arriving_while_a_pass_runs_wait_for_it_and_one_pass_serves_them_all() {
    const N: usize = 8;
    let (served_meanwhile, spent, _) = arrivals_during_a_pass(1, HOLD, N).await;
    assert_eq!(
        served_meanwhile, 0,
        "with --fetch-passes 1 no call made a pass of its own while one ran"
    );
    // One pass after the held-up one serves all; a second may look once more for its caller.
    assert!(
        spent.fetch_passes <= 3,
        "{} passes for {N} calls that arrived together: one scan serves them all",
        spent.fetch_passes
    );
    assert!(spent.shared >= N as u64 - 1, "shared: {}", spent.shared);
}

#[tokio::test]
async fn without_a_pass_limit_each_arriving_call_makes_its_own_pass() {
    const N: usize = 8;
    let (served_meanwhile, spent, _) = arrivals_during_a_pass(0, HOLD, N).await;
    assert_eq!(
        served_meanwhile, N,
        "each call was served by its own pass at once"
    );
    assert!(
        spent.fetch_passes >= N as u64,
        "{} passes",
        spent.fetch_passes
    );
}

#[tokio::test]
async fn a_pass_held_up_past_the_stall_no_longer_holds_up_the_calls_waiting_for_it() {
    const N: usize = 8;
    let (served_meanwhile, _, total) =
        arrivals_during_a_pass(1, Duration::from_millis(50), N).await;
    assert_eq!(
        served_meanwhile, N,
        "every call was served while the held-up pass still waited on its row lock"
    );
    assert!(total.stalls >= 1, "the held-up pass was counted as stalled");
}

#[tokio::test]
async fn a_call_that_cannot_wait_for_a_running_pass_makes_its_own() {
    // Cut to no wait by --fetch-max-wait 0; a wait shorter than --fetch-pass-stall; a full
    // waiter queue.
    for case in ["max wait 0", "short wait", "queue full"] {
        let mut env = combining(1, NEVER, |a| match case {
            "max wait 0" => a.fetch.max_wait = Duration::ZERO,
            "queue full" => {
                // (A stall shorter than the queued call's wait, so that it joins.)
                a.fetch.max_waiters = 1;
                a.fetch.pass_stall = Duration::from_secs(15);
            }
            _ => a.fetch.pass_stall = Duration::from_secs(30),
        })
        .await;
        let (blocker, held_up, first) = held_up_pass(&mut env).await;
        let mut tasks = vec![env.task(&["a"]).await];
        let mut calls = Vec::new();
        if case == "queue full" {
            // The one place in the queue is taken by a call that joined for the running pass.
            tasks.push(env.task(&["b"]).await);
            let lease = env.open("queued").await;
            calls.push(spawn_wait(&env, &lease));
            waiting_reach(&env, 1).await;
        }
        let lease = env.open("arriving").await;
        let mut client = env.client.clone();
        let wait = if case == "short wait" {
            Duration::from_secs(10)
        } else {
            LONG
        };
        let request = wait_request(&lease, wait);
        calls.push(tokio::spawn(async move {
            client
                .fetch_task(request)
                .await
                .map(|r| r.into_inner().task)
        }));
        let mut served = Vec::new();
        for call in calls {
            let task = tokio::time::timeout(LONG, call)
                .await
                .expect("answered while the running pass is held up")
                .unwrap()
                .unwrap_or_else(|status| panic!("{case}: {status}"));
            served.push(id(&task.unwrap_or_else(|| panic!("{case}: served"))));
        }
        served.sort();
        tasks.sort();
        assert_eq!(served, tasks, "{case}");
        blocker.rollback().await;
        assert_eq!(id(&got(held_up).await.expect("served")), first);
        env.shutdown().await;
    }
}

#[tokio::test]
async fn a_waiter_whose_turn_comes_while_a_pass_runs_waits_for_that_pass() {
    const N: usize = 4;
    let mut env = combining(1, HOLD, |_| {}).await;
    // A pass finds nothing: the queue is known empty until the next wake-up.
    let idle = env.open("idle").await;
    assert!(env.fetch(&idle).await.is_none());
    // The held-up pass starts with nobody waiting (so it recruits nobody); then the waiters
    // join the known-empty queue without a pass and without asking for a turn when it ends:
    // only the turn they are given makes them wait for it.
    let (blocker, held_up, first) = held_up_pass(&mut env).await;
    let handles = queue_of_waiters(&mut env, N).await;
    insert_burst(&env, N).await;
    let before = env.broker().stats.snapshot();
    let generation = env.broker().waiters.generation();
    wake_by_hand(&env).await; // the longest waiter's turn, while the held-up pass runs
    let env_ref = &env;
    eventually(LONG, || async {
        env_ref.broker().waiters.generation() > generation
    })
    .await
    .expect("the wake-up arrived");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let served_meanwhile = handles.iter().filter(|h| h.is_finished()).count();
    assert_eq!(
        served_meanwhile, 0,
        "the turn waited for the running pass instead of starting a second one"
    );
    assert_eq!(
        env.broker().stats.snapshot().fetch_passes,
        before.fetch_passes
    );
    // Nothing else wakes the queue: the pass's end gives the deferred turn back.
    blocker.rollback().await;
    assert_eq!(id(&got(held_up).await.expect("served")), first);
    let mut names = Vec::new();
    for h in handles {
        names.push(
            got(h)
                .await
                .expect("every waiter is served once the pass ended")
                .name,
        );
    }
    let expected: Vec<String> = (1..=N).map(|i| format!("t{i}")).collect();
    assert_eq!(names, expected, "oldest task to the longest waiter");
    let spent = env.broker().stats.snapshot() - before;
    assert!(spent.fetch_passes <= 2, "{} passes", spent.fetch_passes);
    env.shutdown().await;
}

/// Waiters queued on a known-empty queue (no pass of their own, no turn asked for), then a
/// pass held up on a row lock: `plain` makes the held-up task one the waiters may take (the
/// longest waiter is recruited for it and its claim is the one held up), otherwise only the
/// held-up call may (the pass recruits every waiter, none accepting). Then `n` tasks arrive
/// and the queue is woken: every waiter not held up with it is served while the pass is held up
/// (past its stall), and every waiter in the end.
async fn waiters_behind_a_stalled_pass(plain: bool, n: usize) {
    let mut env = combining(1, Duration::from_millis(50), |_| {}).await;
    let idle = env.open("idle").await;
    assert!(env.fetch(&idle).await.is_none());
    let handles = queue_of_waiters(&mut env, n).await;
    let (blocker, held_up) = if plain {
        let first = env.task(&["x"]).await;
        let blocker = support::RowLock::take(&env.db_url, first).await;
        // A call that waits makes a pass that recruits (a call that will not wait serves
        // itself alone): skipping a task it does not know of keeps it off the known-empty
        // queue.
        let lease = env.open("skipping").await;
        let mut client = env.client.clone();
        let request = FetchTaskRequest {
            skip_task_ids: vec![Uuid::new_v4().to_string()],
            ..wait_request(&lease, LONG)
        };
        let held_up = tokio::spawn(async move { client.fetch_task(request).await });
        a_claim_waits_on_a_row_lock(&env).await;
        (blocker, held_up)
    } else {
        let (blocker, held_up, _) = held_up_pass(&mut env).await;
        let held_up = tokio::spawn(async move {
            held_up.await.unwrap().map(|task| {
                tonic::Response::new(dispatch_broker::proto::FetchTaskResponse { task })
            })
        });
        (blocker, held_up)
    };
    insert_burst(&env, n).await;
    wake_by_hand(&env).await;
    let expected = if plain { n - 1 } else { n };
    let _ = eventually(Duration::from_secs(5), || async {
        handles.iter().filter(|h| h.is_finished()).count() >= expected
    })
    .await;
    let served_meanwhile = handles.iter().filter(|h| h.is_finished()).count();
    assert_eq!(
        served_meanwhile, expected,
        "waiters served while the pass was held up past its stall"
    );
    blocker.rollback().await;
    held_up
        .await
        .unwrap()
        .expect("the held-up call is answered");
    for h in handles {
        got(h).await.expect("every waiter is served in the end");
    }
    env.shutdown().await;
}

#[tokio::test]
async fn a_stalled_pass_lets_go_of_the_waiters_it_recruited() {
    waiters_behind_a_stalled_pass(false, 4).await;
}

#[tokio::test]
async fn a_wake_up_passes_over_a_waiter_busy_in_a_held_up_pass() {
    waiters_behind_a_stalled_pass(true, 4).await;
}

/// A round whose holder check fails (Redis frozen right after the claim) undoes all of it: the
/// task it claimed goes back to the queue and its locks are released, and so are the locks of the
/// task it left to be claimed on its own (another transaction held that task's row). Nothing
/// stays locked for a task no worker has, long before the reconciler would look.
#[tokio::test]
async fn a_round_whose_holder_check_fails_lets_go_of_every_task_it_locked() {
    let mut env = Env::with(|a| {
        a.fetch.recheck = NEVER;
        a.fetch.wake_poll = NEVER;
        a.sweep_interval = NEVER;
        a.backend_timeout = Duration::from_millis(500);
    })
    .await;
    // Two tasks wait behind a head that holds their resource: both are ready once it finishes,
    // and one pass hands them to the two waiters in one round.
    let head_lease = env.open("head").await;
    env.task(&["h"]).await;
    let head = env.fetch(&head_lease).await.unwrap();
    env.start(&head_lease, &head).await;
    let t1 = env.task(&["shared:h", "r1"]).await;
    let t2 = env.task(&["shared:h", "r2"]).await;
    let waiters = queue_of_waiters(&mut env, 2).await;
    // t2's row is held by another transaction: the round leaves it to be claimed on its own.
    let row_held = support::RowLock::take(&env.db_url, t2).await;
    // The first waiter's core_appstatus row is locked too: the round's claim of t1 (its foreign
    // key check) waits for it, so the test knows when the claim is under way.
    let (db, conn) = tokio_postgres::connect(&env.db_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    db.batch_execute("BEGIN; SELECT 1 FROM core_appstatus WHERE name = 'w0' FOR UPDATE")
        .await
        .unwrap();
    env.finish(&head_lease, &head, "completed").await;
    sessions_wait_on_locks(&env, 1).await;
    // Redis stops answering before the claim ends: the holder check fails.
    env.redis.pause();
    db.batch_execute("ROLLBACK").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    env.redis.resume();
    env.broker().passes.idle().await;

    // Whatever the waiters heard, nothing stays locked that no worker was given, and t1 is not
    // left claimed by a waiter that never got it.
    let mut given = Vec::new();
    for waiter in waiters {
        if let Ok(Ok(Some(task))) = tokio::time::timeout(Duration::from_millis(100), waiter)
            .await
            .map(|joined| joined.unwrap())
        {
            given.push(task);
        }
    }
    assert!(
        given.iter().all(|t| id(t) != t2),
        "t2's row was held: it could not be claimed"
    );
    let settled = eventually(LONG, || async {
        let locked = env.locked_tasks().await;
        given.iter().all(|t| locked.contains(&t.task_id)) && locked.len() == given.len()
    })
    .await;
    assert!(
        settled.is_some(),
        "locks left for tasks nobody was given: {:?} (given {:?})",
        env.locked_tasks().await,
        given.iter().map(id).collect::<Vec<_>>()
    );
    if !given.iter().any(|t| id(t) == t1) {
        assert_eq!(env.state(t1).await, "waiting");
        assert_eq!(env.app_lock(t1).await, None, "t1 went back to the queue");
    }
    row_held.rollback().await;
    assert_eq!(env.state(t2).await, "waiting");
    assert_eq!(env.app_lock(t2).await, None);
    let refs: Vec<&Task> = given.iter().collect();
    env.assert_locks(&refs).await;
    env.shutdown().await;
}
