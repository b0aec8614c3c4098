//! The Rust worker library (`dispatch_worker`) against a real broker on throwaway
//! PostgreSQL and Redis: grants, long polls, cancellation through heartbeats, lease loss (lost
//! tasks reported, rebuilt tasks adopted), background release of dropped guards, graceful
//! shutdown, and retrying a broker that is not up yet.

use std::sync::Arc;
use std::time::Duration;

use crate::support::{eventually, Env};
use dispatch_worker::{FinalState, Worker, WorkerConfig, WorkerError, WorkerEvent};
use tonic::Code;

const LONG: Duration = Duration::from_secs(20);

fn endpoint(env: &Env) -> String {
    format!("http://{}", env.broker().addr)
}

fn config(name: &str) -> WorkerConfig {
    let mut config = WorkerConfig::new(name);
    config.ttl = Duration::from_millis(900);
    config
}

async fn connect(env: &Env, name: &str) -> Worker {
    Worker::connect(endpoint(env), config(name))
        .await
        .expect("connect")
}

/// The next event matching `pick`, skipping others (heartbeat hiccups).
async fn next_event<T>(
    events: &mut tokio::sync::broadcast::Receiver<WorkerEvent>,
    mut pick: impl FnMut(WorkerEvent) -> Option<T>,
) -> T {
    tokio::time::timeout(LONG, async {
        loop {
            if let Some(found) = pick(events.recv().await.expect("event stream")) {
                return found;
            }
        }
    })
    .await
    .expect("the event arrived")
}

/// Waits until Redis holds no task lock.
async fn until_unlocked(env: &Env, why: &str) {
    assert!(
        eventually(LONG, || async { env.locked_tasks().await.is_empty() })
            .await
            .is_some(),
        "{why}"
    );
}

/// `Worker::run` with a handler that starts each task and finishes it after `hold`; shutdown
/// is signalled as soon as the first task has started.
fn run_until_first_started(
    worker: Worker,
    hold: Duration,
) -> tokio::task::JoinHandle<Result<u64, WorkerError>> {
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let mut started_tx = Some(started_tx);
    tokio::spawn(worker.run(
        move |guard| {
            let started = started_tx.take();
            async move {
                guard.start().await.unwrap();
                if let Some(started) = started {
                    let _ = started.send(());
                }
                tokio::time::sleep(hold).await;
                guard.finish(FinalState::Completed, None).await.unwrap();
            }
        },
        async move {
            let _ = started_rx.await;
        },
    ))
}

#[tokio::test]
async fn grants_come_oldest_first_and_finish_or_release_frees_the_locks() {
    let env = Env::new().await;
    let first = env.task(&["a", "shared:d"]).await;
    let second = env.task(&["a"]).await;
    let worker = connect(&env, "w").await;

    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(guard.id(), first.to_string());
    assert!(guard.fencing_token() > 0);
    assert!(
        worker.next_task(Duration::ZERO).await.unwrap().is_none(),
        "the second task waits behind the first"
    );
    env.assert_locks(&[&crate::support::as_sent(guard.task())])
        .await;
    guard.start().await.unwrap();
    assert_eq!(env.state(first).await, "running");
    let done = guard.finish(FinalState::Completed, None).await.unwrap();
    assert_eq!(done.state, "completed");
    assert!(done.released);
    assert_eq!(env.state(first).await, "completed");

    // Pulp-style: the worker records state itself and only releases the locks.
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(guard.id(), second.to_string());
    env.set_state(second, "completed").await;
    assert!(guard.release().await.unwrap());
    env.assert_locks(&[]).await;
    worker.close().await.unwrap();
}

#[tokio::test]
async fn a_long_poll_receives_a_task_inserted_while_it_waits() {
    let env = Env::new().await;
    let worker = connect(&env, "w").await;
    let waiting = {
        let worker = worker.clone();
        tokio::spawn(async move { worker.next_task(LONG).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let task = env.task(&["a"]).await;
    let guard = waiting
        .await
        .unwrap()
        .unwrap()
        .expect("a task before the wait ran out");
    assert_eq!(guard.id(), task.to_string());
    guard.release().await.unwrap();
    worker.close().await.unwrap();
}

#[tokio::test]
async fn a_cancel_reaches_the_holder_through_its_heartbeat() {
    let env = Env::new().await;
    let task = env.task(&["a"]).await;
    let holder = connect(&env, "holder").await;
    let other = connect(&env, "other").await;
    let mut events = holder.events();
    let guard = holder.next_task(Duration::ZERO).await.unwrap().unwrap();
    guard.start().await.unwrap();
    assert!(!guard.cancelled().is_cancelled());

    let answer = other.cancel(&task.to_string()).await.unwrap();
    assert_eq!(answer.state, "canceling");
    assert!(answer.holder_notified);
    tokio::time::timeout(LONG, guard.cancelled().cancelled())
        .await
        .expect("the cancel signal fired");
    let canceled = next_event(&mut events, |e| match e {
        WorkerEvent::CancelRequested { task_id } => Some(task_id),
        _ => None,
    })
    .await;
    assert_eq!(canceled, task.to_string());
    assert!(!guard.is_lost());
    let done = guard.finish(FinalState::Canceled, None).await.unwrap();
    assert_eq!(done.state, "canceled");
    env.assert_locks(&[]).await;
    holder.close().await.unwrap();
    other.close().await.unwrap();
}

#[tokio::test]
async fn a_lease_ended_elsewhere_is_replaced_and_its_tasks_reported_lost() {
    let mut env = Env::new().await;
    let task = env.task(&["a"]).await;
    let worker = connect(&env, "w").await;
    let mut events = worker.events();
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    guard.start().await.unwrap();
    let old = worker.lease_id();

    // The lease ends behind the worker's back (as when the sweeper expires it).
    env.client
        .close_lease(dispatch_broker::proto::CloseLeaseRequest {
            lease_id: old.clone(),
        })
        .await
        .unwrap();
    let (new, adopted, lost) = next_event(&mut events, |e| match e {
        WorkerEvent::LeaseReopened {
            new_lease_id,
            adopted_tasks,
            lost_tasks,
            ..
        } => Some((new_lease_id, adopted_tasks, lost_tasks)),
        _ => None,
    })
    .await;
    assert_ne!(new, old);
    assert_eq!(worker.lease_id(), new);
    assert!(adopted.is_empty());
    assert_eq!(lost, vec![task.to_string()]);
    assert!(guard.is_lost());
    assert!(guard.cancelled().is_cancelled());
    assert_eq!(
        env.state(task).await,
        "failed",
        "closing the lease failed it"
    );
    match guard.finish(FinalState::Completed, None).await {
        Err(WorkerError::Lost { task_id }) => assert_eq!(task_id, task.to_string()),
        other => panic!("a lost task cannot be finished: {other:?}"),
    }
    assert_eq!(env.state(task).await, "failed");

    // The new lease works.
    let next = env.task(&["b"]).await;
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(guard.id(), next.to_string());
    guard.release().await.unwrap();
    env.assert_locks(&[]).await;
    worker.close().await.unwrap();
}

/// A worker whose own core_appstatus row is gone when it must reopen its lease (Pulp's clean-up
/// of missing processes deleted it) opens the new lease under the row `replace_app_status`
/// gives; without one, the reopen fails with NOT_FOUND for the row.
#[tokio::test]
async fn a_worker_whose_own_row_is_gone_reopens_under_the_row_it_is_given() {
    let mut env = Env::new().await;
    let row = env.app_status("worker", "w").await;
    let spare = env.app_status("worker", "w").await;
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut with_row = config("w");
    with_row.app_status_id = Some(row.to_string());
    with_row.replace_app_status = Some({
        let asked = Arc::clone(&asked);
        Arc::new(move || {
            asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async move { Ok(spare.to_string()) })
        })
    });
    let mut without = config("v");
    let other = env.app_status("worker", "v").await;
    without.app_status_id = Some(other.to_string());
    let worker = Worker::connect(endpoint(&env), with_row).await.unwrap();
    let stuck = Worker::connect(endpoint(&env), without).await.unwrap();
    for (w, r) in [(&worker, row), (&stuck, other)] {
        env.db
            .execute("DELETE FROM core_appstatus WHERE pulp_id = $1", &[&r])
            .await
            .unwrap();
        // The broker may have ended the lease itself already, at a heartbeat's write.
        if let Err(status) = env
            .client
            .close_lease(dispatch_broker::proto::CloseLeaseRequest {
                lease_id: w.lease_id(),
            })
            .await
        {
            assert_eq!(status.code(), Code::NotFound, "{status:?}");
        }
    }
    let task = env.task(&["a"]).await;
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(guard.id(), task.to_string());
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(worker.app_status_id(), spare.to_string());
    assert_eq!(env.app_lock(task).await, Some(spare));
    guard.release().await.unwrap();
    let refused = stuck.next_task(Duration::ZERO).await.unwrap_err();
    assert!(refused.is_app_status_not_found(), "{refused}");
    worker.close().await.unwrap();
}

#[tokio::test]
async fn after_redis_loses_its_state_the_reopened_lease_adopts_the_running_task() {
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_secs(30)).await;
    let task = env.task(&["a"]).await;
    // Its heartbeats (a short TTL) meet the lost lease first.
    let (worker, mut events) = with_own_row(&env, "w", config("w").ttl).await;
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    guard.start().await.unwrap();
    let token = guard.fencing_token();

    env.redis.restart().unwrap();
    let (adopted, lost) = next_event(&mut events, |e| match e {
        WorkerEvent::LeaseReopened {
            adopted_tasks,
            lost_tasks,
            ..
        } => Some((adopted_tasks, lost_tasks)),
        _ => None,
    })
    .await;
    assert_eq!(adopted, vec![task.to_string()]);
    assert!(lost.is_empty());
    assert!(!guard.is_lost());
    assert!(guard.fencing_token() > token, "a fresh fencing token");
    let done = guard.finish(FinalState::Completed, None).await.unwrap();
    assert_eq!(done.state, "completed");
    env.assert_locks(&[]).await;
    worker.close().await.unwrap();
}

#[tokio::test]
async fn a_guard_dropped_without_release_releases_in_the_background() {
    let env = Env::new().await;
    env.task(&["a"]).await;
    let worker = connect(&env, "w").await;
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(env.locked_tasks().await.len(), 1);
    drop(guard);
    until_unlocked(&env, "the dropped guard's locks were released").await;
    worker.close().await.unwrap();
}

#[tokio::test]
async fn a_running_tasks_guard_dropped_without_finish_fails_the_task() {
    let env = Env::new().await;
    let task = env.task(&["a"]).await;
    let worker = connect(&env, "w").await;
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    guard.start().await.unwrap();
    drop(guard);
    until_unlocked(&env, "the dropped running task's locks were released").await;
    assert_eq!(env.state(task).await, "failed");
    worker.close().await.unwrap();
}

#[tokio::test]
async fn a_task_fetched_started_needs_no_start_and_its_dropped_guard_fails_it() {
    let env = Env::new().await;
    let first = env.task(&["a"]).await;
    let second = env.task(&["b"]).await;
    let worker = connect(&env, "w").await;
    let guard = worker
        .next_task_started(Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(guard.id(), first.to_string());
    assert_eq!(env.state(first).await, "running");
    guard.start().await.expect("started already: nothing to do");
    guard.finish(FinalState::Completed, None).await.unwrap();
    assert_eq!(env.state(first).await, "completed");
    // Dropped unfinished, it is failed like any running task (not released to run again).
    let guard = worker
        .next_task_started(Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(guard.id(), second.to_string());
    drop(guard);
    until_unlocked(&env, "the dropped running task's locks were released").await;
    assert_eq!(env.state(second).await, "failed");
    worker.close().await.unwrap();
}

#[tokio::test]
async fn run_lets_the_running_task_finish_on_shutdown_and_closes_the_lease() {
    let mut env = Env::new().await;
    let first = env.task(&["a"]).await;
    let second = env.task(&["b"]).await;
    // A TTL that a loaded machine's scheduling hiccups cannot outlast (this test is about
    // shutdown, not lease loss).
    let mut steady = config("w");
    steady.ttl = Duration::from_secs(10);
    let worker = Worker::connect(endpoint(&env), steady).await.unwrap();
    let lease = worker.lease_id();
    // Shutdown arrives while the first task runs.
    let run = run_until_first_started(worker, Duration::from_millis(300));
    let handled = tokio::time::timeout(LONG, run)
        .await
        .expect("run ended")
        .unwrap()
        .unwrap();
    assert_eq!(handled, 1);
    assert_eq!(env.state(first).await, "completed", "it finished in grace");
    assert_eq!(
        env.state(second).await,
        "waiting",
        "no fetch after shutdown"
    );
    assert_eq!(env.app_lock(second).await, None);
    env.assert_locks(&[]).await;
    let status = env
        .client
        .heartbeat(dispatch_broker::proto::HeartbeatRequest {
            lease_id: lease,
            ..Default::default()
        })
        .await
        .expect_err("the lease was closed");
    assert_eq!(status.code(), Code::NotFound);
}

#[tokio::test]
async fn a_task_still_running_when_the_grace_runs_out_is_failed_by_closing_the_lease() {
    let env = Env::new().await;
    let task = env.task(&["a"]).await;
    let mut short = config("w");
    short.shutdown_grace = Duration::from_millis(200);
    let worker = Worker::connect(endpoint(&env), short).await.unwrap();
    // The task ignores shutdown and cancellation.
    let run = run_until_first_started(worker, Duration::from_secs(3600));
    tokio::time::timeout(LONG, run)
        .await
        .expect("run ended after the grace")
        .unwrap()
        .unwrap();
    // Closing the lease failed it; nothing was released behind the lease's back first, so no
    // task is left running without a lock.
    assert_eq!(env.state(task).await, "failed");
    env.assert_locks(&[]).await;
}

#[tokio::test]
async fn a_release_that_fails_in_passing_is_retried_until_the_broker_answers() {
    let mut env = Env::new().await;
    env.task(&["a"]).await;
    let mut impatient = config("w");
    // A lease that cannot expire while the test waits (LONG): only the worker's retry can
    // release the locks, not the sweeper ending the lease while the broker was away.
    impatient.ttl = Duration::from_secs(60);
    impatient.retry = dispatch_worker::RetryPolicy {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(50),
        max_elapsed: Duration::from_millis(200),
    };
    let worker = Worker::connect(endpoint(&env), impatient).await.unwrap();
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    // The broker goes away (a rolling restart) just as the worker releases.
    let addr = env.broker().addr;
    env.broker.take().unwrap().shutdown().await.unwrap();
    let err = guard.release().await.unwrap_err();
    assert_eq!(err.code(), Some(Code::Unavailable), "{err}");
    // It comes back on the same address; the background retry releases the locks.
    let mut args = env.args.clone();
    args.listen = addr;
    env.broker = Some(dispatch_broker::server::start(&args).await.unwrap());
    until_unlocked(&env, "the release went through once the broker was back").await;
    worker.close().await.unwrap();
}

/// The retry budget counts from the first try, the tries included: against an address that
/// takes connections and never answers, every OpenLease try waits for its deadline, and
/// connecting gives up within the budget and one try. Counting only the waits between tries, it
/// went on for at least 3.5 s here (five tries of 500 ms besides 1 s of waits; with the defaults,
/// minutes).
#[tokio::test]
async fn a_call_that_never_gets_an_answer_gives_up_within_the_retry_budget() {
    // Connections are taken (the kernel's backlog) but nothing is ever read or answered.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut patient = config("unanswered");
    patient.call_timeout = Duration::from_millis(500);
    patient.retry = dispatch_worker::RetryPolicy {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(5),
        max_elapsed: Duration::from_secs(1),
    };
    let began = std::time::Instant::now();
    let outcome = tokio::time::timeout(
        LONG,
        Worker::connect(format!("http://{}", silent.local_addr().unwrap()), patient),
    )
    .await
    .expect("connect gave up");
    let took = began.elapsed();
    let Err(err) = outcome else {
        panic!("no broker answered, yet connect succeeded");
    };
    assert!(
        matches!(
            err.code(),
            Some(Code::DeadlineExceeded | Code::Unavailable | Code::Cancelled)
        ),
        "{err}"
    );
    assert!(
        took < Duration::from_millis(2_800),
        "gave up after {took:?}: the 1 s budget and one 500 ms try are about 1.5 s"
    );
}

#[tokio::test]
async fn connect_waits_for_a_broker_that_is_still_starting() {
    let port = dispatch_testkit::free_port().unwrap();
    let connecting = tokio::spawn(Worker::connect(
        format!("http://127.0.0.1:{port}"),
        config("early"),
    ));
    // The broker comes up on that port only after the worker began trying.
    let env = Env::with(|a| a.listen = format!("127.0.0.1:{port}").parse().unwrap()).await;
    let worker = tokio::time::timeout(LONG, connecting)
        .await
        .expect("connected")
        .unwrap()
        .expect("connect retried until the broker answered");
    let task = env.task(&["a"]).await;
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(guard.id(), task.to_string());
    guard.release().await.unwrap();
    worker.close().await.unwrap();
}

#[tokio::test]
async fn errors_name_the_call_and_the_status() {
    let env = Env::new().await;
    let worker = connect(&env, "w").await;
    let err = worker.cancel("not-a-uuid").await.unwrap_err();
    assert_eq!(err.code(), Some(Code::InvalidArgument));
    let text = err.to_string();
    assert!(
        text.starts_with("CancelTask failed: InvalidArgument"),
        "{text}"
    );
    let missing = uuid::Uuid::new_v4().to_string();
    let err = worker.claim(&missing).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound));
    assert!(
        !err.is_lease_not_found(),
        "a missing task is not a lost lease"
    );
    let bad = Worker::connect("not a uri", config("x")).await.unwrap_err();
    assert!(matches!(bad, WorkerError::Endpoint { .. }), "{bad}");
    worker.close().await.unwrap();
}

/// The worker library tells a lost lease from other NOT_FOUNDs by the broker's metadata key: the
/// two crates spell it the same.
#[test]
fn the_worker_library_reads_the_brokers_not_found_key() {
    assert_eq!(
        (
            dispatch_worker::NOT_FOUND_KEY,
            dispatch_worker::NOT_FOUND_LEASE,
            dispatch_worker::NOT_FOUND_APP_STATUS
        ),
        (
            dispatch_broker::grpc::NOT_FOUND_KEY,
            dispatch_broker::grpc::NOT_FOUND_LEASE,
            dispatch_broker::grpc::NOT_FOUND_APP_STATUS
        )
    );
}

/// A grant whose answer never reached the worker (lost with a replica or a connection: here, a
/// FetchTask under the worker's lease that the worker never sees) is handed back by the worker's
/// heartbeats and goes back to the queue, where another worker gets it. Without the hand-back
/// the lease would hold it, and its resource, for as long as the worker lives.
#[tokio::test]
async fn a_grant_that_never_arrived_is_handed_back_and_runs_elsewhere() {
    let env = Env::new().await;
    let task = env.task(&["a"]).await;
    let worker = connect(&env, "w").await;
    let lost = env
        .fetch_started(&worker.lease_id())
        .await
        .expect("the task was granted");
    assert_eq!(lost.task_id, task.to_string());
    assert!(
        eventually(LONG, || async { env.state(task).await == "waiting" })
            .await
            .is_some(),
        "the grant was not handed back"
    );
    assert_eq!(env.app_lock(task).await, None);
    let other = connect(&env, "v").await;
    let again = other
        .next_task(Duration::from_secs(5))
        .await
        .unwrap()
        .expect("the task is ready again");
    assert_eq!(again.id(), task.to_string());
    again.finish(FinalState::Completed, None).await.unwrap();
    worker.close().await.unwrap();
    other.close().await.unwrap();
    env.shutdown().await;
}

/// A task the worker did receive is never handed back, however many heartbeats list it while it
/// runs (and one received, finished, requeued and granted again is told apart by its token).
#[tokio::test]
async fn a_task_the_worker_holds_is_never_handed_back() {
    let env = Env::new().await;
    let task = env.task(&["a"]).await;
    let worker = connect(&env, "w").await;
    let held = worker
        .next_task_started(Duration::from_secs(5))
        .await
        .unwrap()
        .expect("a task");
    assert_eq!(held.id(), task.to_string());
    // Heartbeats every 300 ms (a third of the 900 ms TTL): ten of them list it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(env.state(task).await, "running");
    let done = held.finish(FinalState::Completed, None).await.unwrap();
    assert_eq!(done.state, "completed");
    worker.close().await.unwrap();
    env.shutdown().await;
}

/// A worker with its own core_appstatus row (as a Pulp worker has: reopening reuses it) and
/// lease TTL `ttl`, and its events.
async fn with_own_row(
    env: &Env,
    name: &str,
    ttl: Duration,
) -> (Worker, tokio::sync::broadcast::Receiver<WorkerEvent>) {
    let mut with_row = own_row_config(env, name).await;
    with_row.ttl = ttl;
    let worker = Worker::connect(endpoint(env), with_row).await.unwrap();
    let events = worker.events();
    (worker, events)
}

/// A worker's config with a `core_appstatus` row of its own and a TTL long enough that no
/// heartbeat reopens its lease while the test runs (tests tune it further before connecting).
async fn own_row_config(env: &Env, name: &str) -> WorkerConfig {
    let row = env.app_status("worker", name).await;
    let mut with_row = config(name);
    with_row.app_status_id = Some(row.to_string());
    with_row.ttl = Duration::from_secs(60);
    with_row
}

/// [`with_own_row`] with a TTL long enough that no heartbeat reopens its lease while the test
/// runs: only the call under test meets a lease the broker no longer knows.
async fn long_lived(
    env: &Env,
    name: &str,
) -> (Worker, tokio::sync::broadcast::Receiver<WorkerEvent>) {
    with_own_row(env, name, Duration::from_secs(60)).await
}

#[tokio::test]
async fn a_finish_made_while_redis_lost_its_state_goes_through_under_the_adopted_token() {
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_secs(30)).await;
    let task = env.task(&["a"]).await;
    let (worker, mut events) = long_lived(&env, "w").await;
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    guard.start().await.unwrap();

    // Redis comes back empty: the finish is the first call to meet the lost state.
    env.redis.restart().unwrap();
    let done = guard.finish(FinalState::Completed, None).await.unwrap();
    assert_eq!(done.state, "completed");
    assert_eq!(env.state(task).await, "completed");
    let adopted = next_event(&mut events, |e| match e {
        WorkerEvent::LeaseReopened { adopted_tasks, .. } => Some(adopted_tasks),
        _ => None,
    })
    .await;
    assert_eq!(
        adopted,
        vec![task.to_string()],
        "the finish reopened the lease"
    );
    env.assert_locks(&[]).await;
    worker.close().await.unwrap();
}

#[tokio::test]
async fn a_release_made_while_redis_lost_its_state_goes_through_under_the_adopted_token() {
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_secs(30)).await;
    let task = env.task(&["a"]).await;
    let (worker, mut events) = long_lived(&env, "w").await;
    // Claimed, never started: the rebuild locks it again for the worker's row.
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();

    env.redis.restart().unwrap();
    assert!(
        guard.release().await.unwrap(),
        "released under the new token"
    );
    let adopted = next_event(&mut events, |e| match e {
        WorkerEvent::LeaseReopened { adopted_tasks, .. } => Some(adopted_tasks),
        _ => None,
    })
    .await;
    assert_eq!(adopted, vec![task.to_string()]);
    assert_eq!(env.state(task).await, "waiting");
    assert_eq!(env.app_lock(task).await, None, "back in the queue");
    env.assert_locks(&[]).await;
    worker.close().await.unwrap();
}

#[tokio::test]
async fn a_finish_retried_in_the_background_goes_through_under_the_token_a_rebuild_gave() {
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_secs(30)).await;
    let task = env.task(&["a"]).await;
    let mut impatient = own_row_config(&env, "w").await;
    impatient.retry = dispatch_worker::RetryPolicy {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(50),
        max_elapsed: Duration::from_millis(200),
    };
    let worker = Worker::connect(endpoint(&env), impatient).await.unwrap();
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    guard.start().await.unwrap();
    // The broker goes away as the worker finishes; Redis loses its state meanwhile.
    let addr = env.broker().addr;
    env.broker.take().unwrap().shutdown().await.unwrap();
    let err = guard.finish(FinalState::Completed, None).await.unwrap_err();
    assert_eq!(err.code(), Some(Code::Unavailable), "{err}");
    env.redis.restart().unwrap();
    let mut args = env.args.clone();
    args.listen = addr;
    env.broker = Some(dispatch_broker::server::start(&args).await.unwrap());
    // The background retry meets a lease the broker no longer knows, reopens under the row, and
    // finishes the adopted task under its new token.
    assert!(
        eventually(LONG, || async { env.state(task).await == "completed" })
            .await
            .is_some(),
        "the task's outcome was recorded"
    );
    until_unlocked(&env, "its locks were released").await;
    worker.close().await.unwrap();
}

#[tokio::test]
async fn a_finish_after_the_lease_ended_elsewhere_reports_the_task_lost() {
    let mut env = Env::new().await;
    let task = env.task(&["a"]).await;
    let (worker, _) = long_lived(&env, "w").await;
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    guard.start().await.unwrap();
    // The lease ends behind the worker's back before its heartbeat notices.
    env.client
        .close_lease(dispatch_broker::proto::CloseLeaseRequest {
            lease_id: worker.lease_id(),
        })
        .await
        .unwrap();
    match guard.finish(FinalState::Completed, None).await {
        Err(WorkerError::Lost { task_id }) => assert_eq!(task_id, task.to_string()),
        other => panic!("the new lease did not take the task over: {other:?}"),
    }
    assert_eq!(
        env.state(task).await,
        "failed",
        "closing the lease failed it"
    );
    env.assert_locks(&[]).await;
    worker.close().await.unwrap();
}

/// A reopen after Redis lost its state whose answer is lost (the broker adopted the rebuilt task
/// into the new lease; the worker gave up waiting) is retried with the same open id: the retry
/// gets that lease and the task, and the finish goes through. Without it the retry opened a
/// second lease that adopted nothing: the task was reported lost and stayed locked by a lease
/// nobody knew until the sweeper failed it.
#[tokio::test]
async fn a_reopen_whose_answer_was_lost_still_gets_the_adopted_task() {
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_secs(30)).await;
    let task = env.task(&["a"]).await;
    let mut impatient = own_row_config(&env, "w").await;
    impatient.call_timeout = Duration::from_secs(1);
    let worker = Worker::connect(endpoint(&env), impatient).await.unwrap();
    let mut events = worker.events();
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    guard.start().await.unwrap();

    // Redis comes back empty and the broker rebuilds the task's locks for the worker's row.
    env.redis.restart().unwrap();
    assert!(
        crate::support::until_lease_gone(&env, &worker.lease_id(), LONG).await,
        "the locks were rebuilt"
    );

    // The worker's reopen is held in Postgres (its row is checked first) ...
    let (db, conn) = tokio_postgres::connect(&env.db_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    db.batch_execute("BEGIN; LOCK TABLE core_appstatus IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let finishing = tokio::spawn(async move { guard.finish(FinalState::Completed, None).await });
    crate::support::sessions_wait_on_locks(&env, 1).await;
    // ... then reaches a Redis that answers only after the worker gave up on the call: the lease
    // is opened and adopts the task, and the answer goes nowhere.
    env.redis.pause();
    db.batch_execute("ROLLBACK").await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    env.redis.resume();

    let done = finishing.await.unwrap().expect("the finish went through");
    assert_eq!(done.state, "completed");
    assert_eq!(env.state(task).await, "completed");
    let adopted = next_event(&mut events, |e| match e {
        WorkerEvent::LeaseReopened { adopted_tasks, .. } => Some(adopted_tasks),
        _ => None,
    })
    .await;
    assert_eq!(adopted, vec![task.to_string()]);
    env.assert_locks(&[]).await;
    worker.close().await.unwrap();
}

/// A start whose answer does not come in time (the task's row is held by another transaction
/// for longer than the call's deadline; the start goes through once it is free) is made again:
/// the broker answers it with the time the task started, and the task runs and finishes. Before,
/// `start` failed (`DEADLINE_EXCEEDED`, and a retry was told "do not run it"), and the task
/// stayed running under the worker's lease, never run, until the lease ended and failed it.
#[tokio::test]
async fn a_start_whose_answer_was_lost_is_made_again_and_the_task_runs() {
    let env = Env::new().await;
    let task = env.task(&["a"]).await;
    let mut impatient = config("w");
    impatient.ttl = Duration::from_secs(60);
    impatient.call_timeout = Duration::from_millis(500);
    let worker = Worker::connect(endpoint(&env), impatient).await.unwrap();
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    let blocker = crate::support::RowLock::take(&env.db_url, task).await;
    let starting = tokio::spawn(async move {
        let started = guard.start().await;
        (guard, started)
    });
    crate::support::sessions_wait_on_locks(&env, 1).await;
    // Past the first call's deadline: the library made the call again.
    tokio::time::sleep(Duration::from_millis(800)).await;
    blocker.rollback().await;
    let (guard, started) = starting.await.unwrap();
    started.expect("the start went through");
    assert_eq!(env.state(task).await, "running");
    let done = guard.finish(FinalState::Completed, None).await.unwrap();
    assert_eq!(done.state, "completed");
    env.assert_locks(&[]).await;
    worker.close().await.unwrap();
}
