//! One test per leak path of the seed lock-leaks.txt, as each shows up in a broker world, plus
//! the lease and lock-state cases of invariants 1-5. Every test ends by checking that Redis holds
//! exactly the locks it expects.

use crate::support;

use std::time::Duration;

use crate::support::{eventually, id, kill_waiting_broker_sessions, Env};
use dispatch_broker::ids::TaskId;
use dispatch_broker::proto::*;
use tonic::Code;

const TTL: Duration = Duration::from_secs(2);
const SWEEP: Duration = Duration::from_millis(250);

async fn sweeping_env() -> Env {
    Env::with(|a| a.sweep_interval = SWEEP).await
}

/// Path 1: a failure after the locks were acquired in FetchTask (the claim's Postgres session is
/// terminated while it waits on the task's row) leaves no lock and the task in the queue.
#[tokio::test]
async fn path1_a_failure_after_acquiring_leaves_no_lock() {
    let mut env = Env::new().await;
    let task = env.task(&["a", "shared:d"]).await;
    let lease = env.open("w").await;
    let blocker = support::RowLock::take(&env.db_url, task).await;
    let fetch = env.spawn_fetch(&lease);
    let env_ref = &env;
    assert!(
        eventually(Duration::from_secs(10), || async {
            env_ref.locked_tasks().await.contains(&task.to_string())
        })
        .await
        .is_some(),
        "the fetch took the locks and waits in its claim"
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            kill_waiting_broker_sessions(&env_ref.db).await > 0
        })
        .await
        .is_some(),
        "the claim's session was terminated"
    );
    let status = fetch.await.unwrap().expect_err("the fetch fails");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("postgres"), "{status:?}");
    blocker.rollback().await;
    env.assert_locks(&[]).await;
    assert_eq!(env.app_lock(task).await, None);
    // The test terminated a broker session; a pooled connection may still turn out closed once
    // (UNAVAILABLE, which a worker retries). Once more at most, as a worker would.
    let again = match env.try_fetch(&lease, &[]).await {
        Err(status) if status.code() == Code::Unavailable => env.try_fetch(&lease, &[]).await,
        other => other,
    };
    assert_eq!(
        id(&again.expect("fetch").expect("the task is still there")),
        task
    );
    env.shutdown().await;
}

/// Path 2a: a worker set its task final (as Pulp's worker does) and died before ReleaseLocks:
/// the reconciler frees the locks.
#[tokio::test]
async fn path2_a_final_task_left_locked_is_reconciled() {
    let mut env = sweeping_env().await;
    env.task(&["a"]).await;
    let lease = env.open("w").await;
    let t = env.fetch(&lease).await.unwrap();
    env.start(&lease, &t).await;
    env.set_state(id(&t), "completed").await;
    let env_ref = &env;
    let took = eventually(Duration::from_secs(10), || async {
        env_ref.locked_tasks().await.is_empty()
    })
    .await
    .expect("the reconciler released the locks");
    println!("locks of a completed task released after {took:?} (sweep interval {SWEEP:?})");
    env.assert_locks(&[]).await;
    assert!(env.broker().background_stats.snapshot().locks_reconciled >= 1);
    env.shutdown().await;
}

/// Path 2b and 4: a worker that died mid-task (stopped heartbeating, never released): its locks
/// are swept, its running task fails "Worker has gone missing.", the task it had claimed but not
/// started goes to another lease.
#[tokio::test]
async fn path2_and_4_a_dead_workers_locks_are_swept_and_its_tasks_dealt_with() {
    let mut env = sweeping_env().await;
    let running = env.task(&["a"]).await;
    let claimed = env.task(&["b", "shared:d"]).await;
    let dead = env.open_with("dead", &[], Some(TTL)).await;
    let t1 = env.fetch(&dead).await.unwrap();
    env.start(&dead, &t1).await;
    let t2 = env.fetch(&dead).await.unwrap();
    assert_eq!((id(&t1), id(&t2)), (running, claimed));
    let last_heartbeat = std::time::Instant::now();
    env.client
        .heartbeat(HeartbeatRequest {
            lease_id: dead.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let env_ref = &env;
    eventually(Duration::from_secs(10), || async {
        env_ref.locked_tasks().await.is_empty()
    })
    .await
    .expect("the dead lease's locks are swept");
    println!(
        "locks gone {:?} after the last heartbeat (TTL {TTL:?}, sweep interval {SWEEP:?})",
        last_heartbeat.elapsed()
    );
    assert_eq!(env.state(running).await, "failed");
    assert_eq!(
        env.error_of(running).await["reason"],
        "Worker has gone missing."
    );
    assert_eq!(env.state(claimed).await, "waiting");
    let other = env.open("other").await;
    let again = env.fetch(&other).await.unwrap();
    assert_eq!(id(&again), claimed);
    env.assert_locks(&[&again]).await;
    let gone = env
        .client
        .heartbeat(HeartbeatRequest {
            lease_id: dead,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);
    env.shutdown().await;
}

/// Path 3: CancelTask while Postgres fails mid-way (its session is terminated while it waits on
/// the task's row): the call fails, nothing is half-done, and a retry cancels and releases.
#[tokio::test]
async fn path3_cancel_failing_half_way_changes_nothing_and_a_retry_completes_it() {
    let mut env = Env::with(|a| a.backend_timeout = Duration::from_millis(500)).await;
    let task = env.task(&["a"]).await;
    let lease = env.open("w").await;
    let t = env.fetch(&lease).await.unwrap();
    let blocker = support::RowLock::take(&env.db_url, task).await;
    let mut client = env.client.clone();
    let cancel = tokio::spawn(async move {
        client
            .cancel_task(CancelTaskRequest {
                task_id: task.to_string(),
            })
            .await
    });
    let env_ref = &env;
    eventually(Duration::from_secs(10), || async {
        kill_waiting_broker_sessions(&env_ref.db).await > 0
    })
    .await
    .expect("the cancel's session was terminated");
    let status = cancel.await.unwrap().expect_err("the cancel fails");
    assert_eq!(status.code(), Code::Unavailable);
    blocker.rollback().await;
    assert_eq!(env.state(task).await, "waiting", "nothing half-done");
    env.assert_locks(&[&t]).await;
    let retry = env.cancel(task).await.unwrap();
    assert_eq!(retry.state, "canceled");
    env.assert_locks(&[]).await;

    // Half-way the other way: Postgres commits the cancel, then the lock release cannot reach
    // Redis. The call fails UNAVAILABLE; a retry (the task is final now) releases the lock.
    let second = env.task(&["b"]).await;
    let t2 = env.fetch(&lease).await.unwrap();
    assert_eq!(id(&t2), second);
    env.redis.pause();
    let failed = env.cancel(second).await;
    env.redis.resume();
    let status = failed.expect_err("redis was paused");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(env.state(second).await, "canceled");
    let retry = env.cancel(second).await.unwrap();
    assert_eq!(
        (retry.state.as_str(), retry.holder_notified),
        ("canceled", false)
    );
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

/// Path 5: CancelTask on a waiting task racing FetchTask from several leases, many times: a canceled task is never handed out
/// after the cancel succeeded, and no lock for it remains.
#[tokio::test]
async fn path5_cancel_racing_fetches_never_leaks_a_lock_or_hands_out_a_canceled_task() {
    let env = Env::new().await;
    let mut leases = Vec::new();
    for n in 0..4 {
        let mut c = env.client.clone();
        leases.push(
            c.open_lease(support::lease_request(format!("w{n}")))
                .await
                .unwrap()
                .into_inner()
                .lease_id,
        );
    }
    for round in 0..25 {
        let task = env.task(&[&format!("r{round}"), "shared:d"]).await;
        let mut fetches = Vec::new();
        for lease in &leases {
            let mut c = env.client.clone();
            let lease = lease.clone();
            fetches.push(tokio::spawn(async move {
                c.fetch_task(support::fetch_request(lease.clone()))
                    .await
                    .unwrap()
                    .into_inner()
                    .task
                    .map(|t| (lease, t))
            }));
        }
        let mut c = env.client.clone();
        let cancel = c
            .cancel_task(dispatch_broker::proto::CancelTaskRequest {
                task_id: task.to_string(),
            })
            .await
            .unwrap()
            .into_inner();
        let mut granted = Vec::new();
        for f in fetches {
            if let Some(g) = f.await.unwrap() {
                granted.push(g);
            }
        }
        assert!(granted.len() <= 1, "round {round}: handed out twice");
        assert_eq!(
            cancel.state, "canceled",
            "round {round}: waiting or claimed task is canceled"
        );
        assert_eq!(env.state(task).await, "canceled");
        // A grant may have been made before the cancel; its holder cannot start it now.
        for (lease, t) in granted {
            let start = c
                .start_task(dispatch_broker::proto::StartTaskRequest {
                    lease_id: lease,
                    task_id: t.task_id,
                    fencing_token: t.fencing_token,
                })
                .await;
            assert!(start.is_err(), "round {round}: a canceled task was started");
        }
        env.assert_locks(&[]).await;
    }
    env.shutdown().await;
}

/// Path 6: ReleaseLocks while Redis is briefly down (paused): the call rides out the pause with
/// its retries and succeeds, the claimed task goes back to the queue, and no lock remains. A
/// release that still fails answers UNAVAILABLE, and the lock goes with the lease.
#[tokio::test]
async fn path6_release_while_redis_is_briefly_down_leaves_no_lock() {
    let mut env = Env::with(|a| {
        a.sweep_interval = SWEEP;
        a.backend_timeout = Duration::from_millis(300);
    })
    .await;
    let task = env.task(&["a"]).await;
    let lease = env.open("w").await;
    let t = env.fetch(&lease).await.unwrap();
    env.redis.pause();
    let mut client = env.client.clone();
    let release = tokio::spawn({
        let t = t.clone();
        let lease = lease.clone();
        async move {
            client
                .release_locks(ReleaseLocksRequest {
                    lease_id: lease,
                    task_id: t.task_id,
                    fencing_token: t.fencing_token,
                })
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(350)).await;
    env.redis.resume();
    let released = release.await.unwrap();
    println!("release during a redis pause answered {released:?}");
    assert!(
        released
            .expect("the retries ride out the pause")
            .into_inner()
            .released
    );
    env.assert_locks(&[]).await;
    assert_eq!(env.app_lock(task).await, None, "back in the queue");

    // Redis down for longer than the retries: UNAVAILABLE naming Redis; the lock goes with the
    // lease (here: closed once Redis is back).
    let t = env.fetch(&lease).await.unwrap();
    env.redis.pause();
    let failed = env.release(&lease, &t).await;
    env.redis.resume();
    let status = failed.expect_err("redis stayed down");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("redis"), "{status:?}");
    env.client
        .close_lease(CloseLeaseRequest { lease_id: lease })
        .await
        .unwrap();
    env.assert_locks(&[]).await;
    assert_eq!(env.state(task).await, "waiting");
    env.shutdown().await;
}

/// A worker restarted under the same name gets a new lease, does not inherit its previous
/// incarnation's locks, and is not blocked by them past that lease's expiry.
#[tokio::test]
async fn a_restarted_worker_is_not_blocked_by_its_previous_incarnation() {
    let mut env = sweeping_env().await;
    let first = env.task(&["repo"]).await;
    let second = env.task(&["repo"]).await;
    let old = env.open_with("1234@host", &[], Some(TTL)).await;
    let t = env.fetch(&old).await.unwrap();
    env.start(&old, &t).await;
    let new = env
        .open_with("1234@host", &[], Some(Duration::from_secs(30)))
        .await;
    assert_ne!(old, new);
    let not_mine = env.release(&new, &t).await.unwrap_err();
    assert_eq!(not_mine.code(), Code::FailedPrecondition);
    let env_ref = &env;
    eventually(Duration::from_secs(10), || async {
        env_ref.state(first).await == "failed"
    })
    .await
    .expect("the old incarnation's lease is swept");
    let next = env.fetch(&new).await.unwrap();
    assert_eq!(id(&next), second);
    env.assert_locks(&[&next]).await;
    env.shutdown().await;
}

/// A swept lease's late ReleaseLocks with its old token changes nothing a new holder owns.
#[tokio::test]
async fn a_swept_leases_late_release_changes_nothing_for_the_new_holder() {
    let mut env = sweeping_env().await;
    let task = env.task(&["a", "shared:d"]).await;
    let old = env.open_with("old", &[], Some(TTL)).await;
    let stale = env.fetch(&old).await.unwrap();
    let env_ref = &env;
    eventually(Duration::from_secs(10), || async {
        env_ref.app_lock(task).await.is_none()
    })
    .await
    .expect("swept and requeued");
    let new = env.open("new").await;
    let fresh = env.fetch(&new).await.unwrap();
    assert_eq!(id(&fresh), task);
    assert!(fresh.fencing_token > stale.fencing_token);
    let late = env.release(&old, &stale).await.unwrap_err();
    assert_eq!(
        late.code(),
        Code::NotFound,
        "the old lease is gone: {late:?}"
    );
    let mut c = env.client.clone();
    let late_finish = c
        .finish_task(FinishTaskRequest {
            lease_id: old.clone(),
            task_id: stale.task_id.clone(),
            fencing_token: stale.fencing_token,
            state: "failed".into(),
            error: "late".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(late_finish.code(), Code::NotFound, "{late_finish:?}");
    env.assert_locks(&[&fresh]).await;
    assert_eq!(env.state(task).await, "waiting");
    env.shutdown().await;
}

/// Redis killed and restarted empty while a task runs: nothing is granted until the running
/// task's locks are rebuilt from Postgres; its worker reopens with its app_status_id, takes the
/// locks back with a fresh token, and finishes the task; no conflicting task is handed out.
#[tokio::test]
async fn redis_restarted_empty_rebuilds_running_locks_before_dispatch_resumes() {
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_secs(30)).await;
    let running = env.task(&["a", "shared:d"]).await;
    let behind = env.task(&["a"]).await;
    let free = env.task(&["b"]).await;
    let worker = env
        .client
        .open_lease(support::lease_request("w"))
        .await
        .unwrap()
        .into_inner();
    let t = env.fetch(&worker.lease_id).await.unwrap();
    assert_eq!(id(&t), running);
    env.start(&worker.lease_id, &t).await;

    let rebuilds_before = env.broker().background_stats.snapshot().rebuilds;
    env.redis.restart().unwrap();
    // The first calls notice: unavailable while rebuilding (or a dropped connection), then the
    // old lease is unknown.
    let mut saw_rebuilding = false;
    let env_ref = &mut env;
    let lease = worker.lease_id.clone();
    let mut outcome = None;
    for _ in 0..200 {
        match env_ref.try_fetch(&lease, &[]).await {
            Err(s) if s.code() == Code::Unavailable => {
                saw_rebuilding |= s.message().contains("being rebuilt");
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            other => {
                outcome = Some(other);
                break;
            }
        }
    }
    assert!(
        saw_rebuilding,
        "a call said the lock state is being rebuilt"
    );
    let status = outcome
        .expect("the broker recovered")
        .expect_err("the old lease is gone");
    assert_eq!(status.code(), Code::NotFound);
    // Before any new grant, the running task's locks are back.
    let rebuilt = env.broker().locks.held_task_locks().await.unwrap();
    assert_eq!(rebuilt.len(), 1, "{rebuilt:?}");
    assert_eq!(rebuilt[0].0, running.to_string());
    assert!(
        rebuilt[0].2 > t.fencing_token,
        "fresh fencing token above every earlier one"
    );
    // The worker reopens with its row and takes its task back.
    let reopened = env
        .client
        .open_lease(OpenLeaseRequest {
            worker_name: "w".into(),
            versions: Default::default(),
            ttl: None,
            app_status_id: worker.app_status_id.clone(),
            open_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reopened.adopted_tasks.len(), 1);
    assert_eq!(reopened.adopted_tasks[0].task_id, running.to_string());
    let adopted = Task {
        fencing_token: reopened.adopted_tasks[0].fencing_token,
        ..t.clone()
    };
    // Another worker gets only the unrelated task.
    let other = env.open("other").await;
    let got = env.fetch(&other).await.unwrap();
    assert_eq!(id(&got), free);
    assert!(
        env.fetch(&other).await.is_none(),
        "the task behind the running one waits"
    );
    let done = env.finish(&reopened.lease_id, &adopted, "completed").await;
    assert!(done.released);
    let last = env.fetch(&other).await.unwrap();
    assert_eq!(id(&last), behind);
    env.assert_locks(&[&got, &last]).await;
    assert_eq!(
        env.broker().background_stats.snapshot().rebuilds,
        rebuilds_before + 1
    );
    env.shutdown().await;
}

/// After Redis restarted empty, a worker's reopen whose answer was lost is retried with the same
/// `open_id`: the retry gets the lease that took over the rebuilt locks, with the task and its
/// token, and the task finishes under it (before, the retry opened a second lease that adopted
/// nothing: the task was reported lost and stayed locked by a lease nobody knew until it
/// expired, when the sweeper failed it).
#[tokio::test]
async fn a_reopen_retried_after_its_answer_was_lost_gets_the_lease_that_adopted_the_tasks() {
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_secs(30)).await;
    let running = env.task(&["a"]).await;
    let behind = env.task(&["a"]).await;
    let own = env.app_status("worker", "w").await;
    let worker = env
        .client
        .open_lease(OpenLeaseRequest {
            app_status_id: own.to_string(),
            ..support::lease_request("w")
        })
        .await
        .unwrap()
        .into_inner();
    let t = env.fetch(&worker.lease_id).await.unwrap();
    assert_eq!(id(&t), running);
    env.start(&worker.lease_id, &t).await;
    env.redis.restart().unwrap();
    assert!(
        support::until_lease_gone(&env, &worker.lease_id, Duration::from_secs(10)).await,
        "the old lease is gone once the locks are rebuilt"
    );

    let reopen = OpenLeaseRequest {
        app_status_id: own.to_string(),
        open_id: uuid::Uuid::new_v4().to_string(),
        ..support::lease_request("w")
    };
    // The first answer is lost on the way; the worker sends the same request again.
    let unseen = env
        .client
        .open_lease(reopen.clone())
        .await
        .unwrap()
        .into_inner();
    let retried = env.client.open_lease(reopen).await.unwrap().into_inner();
    assert_eq!(retried.lease_id, unseen.lease_id);
    let adopted: Vec<_> = retried
        .adopted_tasks
        .iter()
        .map(|h| (h.task_id.clone(), h.fencing_token))
        .collect();
    assert_eq!(
        adopted,
        unseen
            .adopted_tasks
            .iter()
            .map(|h| (h.task_id.clone(), h.fencing_token))
            .collect::<Vec<_>>()
    );
    assert_eq!(adopted.len(), 1);
    assert_eq!(adopted[0].0, running.to_string());
    let held = Task {
        fencing_token: adopted[0].1,
        ..t.clone()
    };
    let done = env.finish(&retried.lease_id, &held, "completed").await;
    assert!(done.released);
    assert_eq!(env.state(running).await, "completed");
    let next = env.fetch(&retried.lease_id).await.unwrap();
    assert_eq!(id(&next), behind);
    env.assert_locks(&[&next]).await;
    env.shutdown().await;
}

/// A StartTask whose answer was lost is made again while the first is still under way (both
/// wait on the task's row, held by another transaction): the first starts the task, the retry is
/// answered with the time it started rather than told to leave it, and the task stays the
/// holder's, running and locked, to be finished. Before, the retry was refused ("do not run
/// it"), and a worker that never ran the task left it running under its lease until the lease
/// ended and failed it.
#[tokio::test]
async fn a_start_retried_after_its_answer_was_lost_is_answered_with_when_it_started() {
    let mut env = Env::new().await;
    let task = env.task(&["a"]).await;
    let lease = env.open("w").await;
    let t = env.fetch(&lease).await.unwrap();
    let blocker = support::RowLock::take(&env.db_url, task).await;
    let start = |env: &Env| {
        let mut client = env.client.clone();
        let request = support::start_request(&lease, &t);
        tokio::spawn(async move { client.start_task(request).await })
    };
    let first = start(&env);
    support::sessions_wait_on_locks(&env, 1).await;
    let retry = start(&env);
    support::sessions_wait_on_locks(&env, 2).await;
    blocker.rollback().await;
    let first = first.await.unwrap().expect("the first start").into_inner();
    let retry = retry
        .await
        .unwrap()
        .expect("the retry is answered, not refused")
        .into_inner();
    assert!(first.started_at.is_some());
    assert_eq!(retry.started_at, first.started_at);
    assert_eq!(env.state(task).await, "running");
    env.assert_locks(&[&t]).await;
    assert_eq!(env.finish(&lease, &t, "completed").await.state, "completed");
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

/// A start that went through (its answer lost) and a cancel after it: the retried start is
/// answered, not refused, so the worker does not drop a task it holds; the heartbeat tells it of
/// the cancel, and it ends the task canceled, its locks released.
#[tokio::test]
async fn a_start_retried_after_a_cancel_is_answered_and_the_cancel_reaches_the_holder() {
    let mut env = Env::new().await;
    let task = env.task(&["a"]).await;
    let lease = env.open("w").await;
    let t = env.fetch(&lease).await.unwrap();
    env.start(&lease, &t).await;
    let canceled = env.cancel(task).await.expect("cancel");
    assert_eq!(canceled.state, "canceling");
    let again = env
        .client
        .start_task(support::start_request(&lease, &t))
        .await
        .expect("the retried start is answered")
        .into_inner();
    assert!(again.started_at.is_some());
    let beat = env
        .client
        .heartbeat(HeartbeatRequest {
            lease_id: lease.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(beat.cancel_task_ids, vec![task.to_string()]);
    assert_eq!(env.finish(&lease, &t, "canceled").await.state, "canceled");
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

/// Two broker replicas sweeping the same Redis never process one lease twice.
#[tokio::test]
async fn two_replicas_sweeping_at_once_never_double_process_a_lease() {
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_millis(50)).await;
    let mut args = env.args.clone();
    args.listen = "127.0.0.1:0".parse().unwrap();
    let second = dispatch_broker::server::start(&args).await.unwrap();
    const LEASES: usize = 12;
    for n in 0..LEASES {
        env.task(&[&format!("r{n}")]).await;
        let lease = env.open_with(&format!("w{n}"), &[], Some(TTL)).await;
        let t = env.fetch(&lease).await.unwrap();
        env.start(&lease, &t).await;
    }
    let env_ref = &env;
    let second_ref = &second;
    eventually(Duration::from_secs(15), || async {
        // Besides both replicas' own ticks, drive turns of both at the same instant.
        let (a, b) = tokio::join!(env_ref.broker().sweeper.turn(), second_ref.sweeper.turn());
        a.is_ok()
            && b.is_ok()
            && env_ref.broker().background_stats.snapshot().leases_swept
                + second_ref.background_stats.snapshot().leases_swept
                >= LEASES as u64
    })
    .await
    .expect("every lease swept");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (a, b) = (
        env.broker().background_stats.snapshot().leases_swept,
        second.background_stats.snapshot().leases_swept,
    );
    println!("replica sweeps: {a} + {b}");
    assert_eq!(a + b, LEASES as u64, "a lease was swept twice");
    let failed: i64 = env
        .db
        .query_one("SELECT count(*) FROM core_task WHERE state = 'failed'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(failed, LEASES as i64);
    env.assert_locks(&[]).await;
    second.shutdown().await.unwrap();
    env.shutdown().await;
}

async fn reconciling_env() -> Env {
    Env::with(|a| {
        a.sweep_interval = SWEEP;
        a.backend_timeout = Duration::from_millis(500);
    })
    .await
}

/// A lock left on a task that was never claimed (a grant that failed half-way, with the broker
/// unable to take it back at the time) is released by the reconciler although its lease lives.
#[tokio::test]
async fn a_lock_left_on_an_unclaimed_task_is_reconciled() {
    let mut env = reconciling_env().await;
    let task = env.task(&["a", "shared:d"]).await;
    let lease = env.open("w").await;
    let resources = dispatch_broker::ready::Resources::from_record(&["a", "shared:d"]);
    let granted = env
        .broker()
        .locks
        .acquire(
            lease.parse().unwrap(),
            TaskId(task),
            &resources,
            dispatch_broker::locks::Admission::counted(uuid::Uuid::nil(), false),
        )
        .await
        .unwrap();
    assert!(matches!(
        granted,
        dispatch_broker::locks::Acquire::Granted { .. }
    ));
    let env_ref = &env;
    eventually(Duration::from_secs(15), || async {
        env_ref.locked_tasks().await.is_empty()
    })
    .await
    .expect("the stray lock is released");
    let again = env.fetch(&lease).await.unwrap();
    assert_eq!(id(&again), task);
    env.assert_locks(&[&again]).await;
    env.shutdown().await;
}

/// A claim left without its lock (the lock was lost) goes back to the queue when the task had
/// not started; a running task without its lock makes the broker rebuild the lock state, which
/// locks it again.
#[tokio::test]
async fn claims_without_locks_are_requeued_or_locked_again() {
    let mut env = reconciling_env().await;
    let waiting = env.task(&["a"]).await;
    let running = env.task(&["b"]).await;
    let lease = env.open("w").await;
    let t1 = env.fetch(&lease).await.unwrap();
    let t2 = env.fetch(&lease).await.unwrap();
    assert_eq!((id(&t1), id(&t2)), (waiting, running));
    env.start(&lease, &t2).await;
    let rebuilds = env.broker().background_stats.snapshot().rebuilds;
    for t in [&t1, &t2] {
        env.broker()
            .locks
            .force_release(t.task_id.parse().unwrap())
            .await
            .unwrap();
    }
    let env_ref = &env;
    eventually(Duration::from_secs(20), || async {
        env_ref.app_lock(waiting).await.is_none()
            && env_ref.broker().background_stats.snapshot().rebuilds > rebuilds
            && env_ref.locked_tasks().await.contains(&running.to_string())
    })
    .await
    .expect("the waiting claim was requeued and the running task locked again");
    assert_eq!(env.state(running).await, "running");
    env.assert_locks(&[&t2]).await;
    env.shutdown().await;
}

/// A task a Pulp API process runs itself (an immediate task: claimed by the API's own
/// core_appstatus row, which holds no lease) is not the broker's claim: the reconciler leaves it
/// alone (no requeue, no rebuild), and the readiness rule still keeps conflicting tasks back.
#[tokio::test]
async fn a_task_run_by_a_pulp_api_process_is_left_alone() {
    let mut env = reconciling_env().await;
    let api = env.app_status("api", "api@host").await;
    let immediate = env.task(&["a"]).await;
    env.db
        .execute(
            "UPDATE core_task SET app_lock_id = $2, state = 'running', \
             pulp_last_updated = now() - interval '1 hour' WHERE pulp_id = $1",
            &[&immediate, &api],
        )
        .await
        .unwrap();
    let behind = env.task(&["a"]).await;
    let rebuilds = env.broker().background_stats.snapshot().rebuilds;
    let lease = env.open("w").await;
    // Several reconciler turns pass.
    tokio::time::sleep(SWEEP * 6).await;
    assert_eq!(env.app_lock(immediate).await, Some(api));
    assert_eq!(env.state(immediate).await, "running");
    assert_eq!(env.broker().background_stats.snapshot().rebuilds, rebuilds);
    assert!(
        env.fetch(&lease).await.is_none(),
        "{behind} waits behind it"
    );
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

/// An entry of the lease expiry set that is not a lease id (the broker only writes UUIDs; this
/// one came from elsewhere) is dropped by a sweep, and the sweep goes on: a real expired lease
/// behind it is swept too.
#[tokio::test]
async fn an_expiry_entry_that_is_not_a_lease_id_is_dropped_and_the_sweep_goes_on() {
    use deadpool_redis::redis;
    let mut env = reconciling_env().await;
    let task = env.task(&["a"]).await;
    let lease = env
        .open_with(
            "w",
            &[("core", "3.123.1")],
            Some(Duration::from_millis(200)),
        )
        .await;
    let granted = env.fetch(&lease).await.expect("the task");
    assert_eq!(support::id(&granted), task);
    let client = redis::Client::open(env.redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    // Expired long before the real lease, so they come first in the sweep's batch: text that is
    // no UUID, and a UUID spelled otherwise than the broker writes it.
    let odd = [
        "not-a-lease".to_owned(),
        uuid::Uuid::new_v4().to_string().to_uppercase(),
    ];
    for entry in &odd {
        let _: i64 = redis::cmd("ZADD")
            .arg("{dispatch}:leases")
            .arg(1)
            .arg(entry)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let dropped = support::eventually(Duration::from_secs(15), || {
        let (mut conn, odd) = (conn.clone(), odd.clone());
        async move {
            for entry in &odd {
                let score: Option<f64> = redis::cmd("ZSCORE")
                    .arg("{dispatch}:leases")
                    .arg(entry)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                if score.is_some() {
                    return false;
                }
            }
            true
        }
    })
    .await;
    assert!(dropped.is_some(), "an entry stayed in the expiry set");
    // The real lease expired meanwhile (no heartbeats): swept, its claim requeued, no lock left.
    let requeued = support::eventually(Duration::from_secs(15), || async {
        env.db
            .query_one(
                "SELECT app_lock_id IS NULL FROM core_task WHERE pulp_id = $1",
                &[&task],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;
    assert!(requeued.is_some(), "the expired lease's claim was requeued");
    env.assert_locks(&[]).await;
}
