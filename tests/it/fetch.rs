//! FetchTask and ClaimTask: the readiness rule end to end, against real Postgres and Redis.

use crate::support;

use std::collections::HashSet;

use crate::support::{id, Env};

#[tokio::test]
async fn hands_out_the_oldest_ready_task_once() {
    let mut env = Env::new().await;
    let a = env.task(&["a"]).await;
    let b = env.task(&["b"]).await;
    let lease = env.open("w1").await;
    let first = env.fetch(&lease).await.expect("a task");
    assert_eq!(id(&first), a);
    assert!(first.fencing_token > 0);
    let second = env.fetch(&lease).await.expect("another task");
    assert_eq!(id(&second), b);
    assert!(second.fencing_token > first.fencing_token);
    assert!(env.fetch(&lease).await.is_none(), "nothing left");
    assert_eq!(env.app_lock(a).await, env.app_lock(b).await);
    assert!(env.app_lock(a).await.is_some(), "claimed in postgres");
    env.assert_locks(&[&first, &second]).await;
    env.shutdown().await;
}

#[tokio::test]
async fn a_newer_task_waits_for_an_older_conflicting_one() {
    let mut env = Env::new().await;
    let old = env.task(&["a"]).await;
    let young = env.task(&["a"]).await;
    let lease = env.open("w1").await;
    let t = env.fetch(&lease).await.unwrap();
    assert_eq!(id(&t), old);
    assert!(
        env.fetch(&lease).await.is_none(),
        "the second task conflicts with a held lock"
    );
    env.start(&lease, &t).await;
    env.finish(&lease, &t, "completed").await;
    let t2 = env.fetch(&lease).await.unwrap();
    assert_eq!(id(&t2), young);
    env.shutdown().await;
}

/// DESIGN.md's pitfall: T1 needs A and B, A is held; T2 (newer) needs only B. T2 is not handed
/// out until T1 has run, although a query excluding "tasks on A" would hide T1.
#[tokio::test]
async fn a_hidden_older_task_still_reserves_its_other_resources() {
    let mut env = Env::new().await;
    let t0 = env.task(&["A"]).await;
    let t1 = env.task(&["A", "B"]).await;
    let t2 = env.task(&["B"]).await;
    let w = env.open("w").await;
    let running = env.fetch(&w).await.unwrap();
    assert_eq!(id(&running), t0);
    env.start(&w, &running).await;
    let other = env.open("other").await;
    assert!(env.fetch(&other).await.is_none(), "T2 must wait for T1");
    env.finish(&w, &running, "completed").await;
    let g1 = env.fetch(&other).await.unwrap();
    assert_eq!(id(&g1), t1);
    assert!(env.fetch(&w).await.is_none(), "T2 conflicts with T1's lock");
    env.finish(&other, &g1, "completed").await;
    assert_eq!(id(&env.fetch(&w).await.unwrap()), t2);
    env.shutdown().await;
}

#[tokio::test]
async fn shared_holders_coexist_and_an_exclusive_request_waits_for_all_of_them() {
    let mut env = Env::new().await;
    let s1 = env.task(&["shared:r"]).await;
    let s2 = env.task(&["shared:r"]).await;
    let x = env.task(&["r"]).await;
    let s3 = env.task(&["shared:r"]).await;
    let w1 = env.open("w1").await;
    let w2 = env.open("w2").await;
    let g1 = env.fetch(&w1).await.unwrap();
    let g2 = env.fetch(&w2).await.unwrap();
    assert_eq!(
        (id(&g1), id(&g2)),
        (s1, s2),
        "both shared users run together"
    );
    assert!(
        env.fetch(&w1).await.is_none(),
        "the exclusive task waits, and s3 waits behind it"
    );
    env.finish(&w1, &g1, "completed").await;
    assert!(
        env.fetch(&w1).await.is_none(),
        "one shared holder is still there"
    );
    env.finish(&w2, &g2, "completed").await;
    let gx = env.fetch(&w1).await.unwrap();
    assert_eq!(id(&gx), x);
    assert_eq!(gx.exclusive_resources, vec!["r"]);
    assert!(env.fetch(&w2).await.is_none());
    env.finish(&w1, &gx, "completed").await;
    let g3 = env.fetch(&w2).await.unwrap();
    assert_eq!(id(&g3), s3);
    assert_eq!(g3.shared_resources, vec!["r"]);
    env.assert_locks(&[&g3]).await;
    env.shutdown().await;
}

#[tokio::test]
async fn incompatible_and_skipped_tasks_are_passed_over_without_locks() {
    let mut env = Env::new().await;
    let newer = env
        .task_with(&["a"], "plugin.task", &[("core", "3.200.0")])
        .await;
    let fine = env
        .task_with(&["b"], "core.task", &[("core", "3.100")])
        .await;
    let skipped = env.task(&["c"]).await;
    let unknown_component = env.task_with(&["d"], "rpm.task", &[("rpm", "3.0")]).await;
    let after_skipped = env.task(&["c"]).await;
    let lease = env.open("w").await;
    let g = env.fetch(&lease).await.unwrap();
    assert_eq!(id(&g), fine);
    let none = env.try_fetch(&lease, &[skipped]).await.unwrap();
    assert!(
        none.is_none(),
        "skipped task still reserves c for the task after it"
    );
    env.assert_locks(&[&g]).await;
    assert_eq!(env.app_lock(newer).await, None);
    assert_eq!(env.app_lock(unknown_component).await, None);
    assert_eq!(env.app_lock(after_skipped).await, None);
    let mut client = env.client.clone();
    let upgraded = client
        .open_lease(dispatch_broker::proto::OpenLeaseRequest {
            worker_name: "upgraded".into(),
            versions: [("core".into(), "3.200.1".into())].into(),
            ttl: None,
            app_status_id: String::new(),
            open_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .lease_id;
    assert_eq!(id(&env.fetch(&upgraded).await.unwrap()), newer);
    env.shutdown().await;
}

#[tokio::test]
async fn concurrent_fetches_never_hand_out_a_task_twice() {
    let env = Env::new().await;
    for i in 0..60 {
        env.task(&[&format!("r{}", i % 20), "shared:prn:core.domain:d"])
            .await;
    }
    let mut handles = Vec::new();
    for w in 0..8 {
        let mut client = env.client.clone();
        handles.push(tokio::spawn(async move {
            let lease = client
                .open_lease(support::lease_request(format!("w{w}")))
                .await
                .unwrap()
                .into_inner()
                .lease_id;
            let mut got = Vec::new();
            let mut idle = 0;
            while idle < 3 {
                let task = client
                    .fetch_task(support::fetch_request(lease.clone()))
                    .await
                    .unwrap()
                    .into_inner()
                    .task;
                match task {
                    Some(t) => {
                        idle = 0;
                        client
                            .finish_task(support::finish_request(lease.clone(), &t, "completed"))
                            .await
                            .unwrap();
                        got.push(t.task_id);
                    }
                    None => {
                        idle += 1;
                        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
                    }
                }
            }
            got
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    let distinct: HashSet<_> = all.iter().collect();
    assert_eq!(distinct.len(), all.len(), "a task was handed out twice");
    assert_eq!(all.len(), 60, "every task ran exactly once");
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

#[tokio::test]
async fn claim_task_takes_exactly_that_task_when_ready_and_changes_nothing_otherwise() {
    let mut env = Env::new().await;
    let a1 = env.task(&["a"]).await;
    let a2 = env.task(&["a"]).await;
    let b = env.task(&["b"]).await;
    let lease = env.open("w").await;
    assert!(
        env.claim(&lease, a2).await.unwrap().is_none(),
        "a1 is older"
    );
    assert_eq!(env.app_lock(a2).await, None);
    env.assert_locks(&[]).await;
    let gb = env.claim(&lease, b).await.unwrap().expect("b is ready");
    assert_eq!(id(&gb), b);
    let ga = env.claim(&lease, a1).await.unwrap().expect("a1 is ready");
    assert!(
        env.claim(&lease, a1).await.unwrap().is_none(),
        "already claimed"
    );
    env.assert_locks(&[&gb, &ga]).await;
    env.shutdown().await;
}

/// Pulp's dispatch() marks an immediate task with the dispatching process's own row before
/// asking whether it may run now: ClaimTask by a lease on that row takes it; a lease on another
/// row does not, and a fetch never hands it out.
#[tokio::test]
async fn claim_task_takes_a_task_marked_with_the_leases_own_row_and_no_other() {
    let mut env = Env::new().await;
    let api = env.app_status("api", "api@host").await;
    let other = env.app_status("api", "other-api@host").await;
    let mine = env.task(&["a"]).await;
    let theirs = env.task(&["b"]).await;
    for (task, row) in [(mine, api), (theirs, other)] {
        env.db
            .execute(
                "UPDATE core_task SET app_lock_id = $2 WHERE pulp_id = $1",
                &[&task, &row],
            )
            .await
            .unwrap();
    }
    let lease = env
        .client
        .open_lease(dispatch_broker::proto::OpenLeaseRequest {
            app_status_id: api.to_string(),
            ..support::lease_request("api@host")
        })
        .await
        .unwrap()
        .into_inner()
        .lease_id;
    let worker = env.open("w").await;
    assert!(
        env.fetch(&worker).await.is_none(),
        "marked tasks are not in the queue"
    );
    assert!(
        env.claim(&lease, theirs).await.unwrap().is_none(),
        "another row's mark"
    );
    assert_eq!(env.app_lock(theirs).await, Some(other));
    let granted = env
        .claim(&lease, mine)
        .await
        .unwrap()
        .expect("its own mark");
    assert_eq!(id(&granted), mine);
    assert_eq!(env.app_lock(mine).await, Some(api));
    env.assert_locks(&[&granted]).await;
    assert!(env.release(&lease, &granted).await.unwrap());
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

/// A task canceled after its locks were taken and before the claim: never handed out, no lock.
/// The test holds the task's row lock so that the broker's claim has to wait, checks that the
/// broker holds the Redis locks at that moment, cancels, and lets the claim go on.
#[tokio::test]
async fn a_task_canceled_between_lock_and_claim_is_not_handed_out_and_keeps_no_lock() {
    let mut env = Env::new().await;
    let task = env.task(&["a", "shared:d"]).await;
    let lease = env.open("w").await;
    let blocker = support::RowLock::take(&env.db_url, task).await;
    let fetch = env.spawn_fetch(&lease);
    // Wait until the broker holds the locks and is blocked in its claim.
    let mut locked = false;
    for _ in 0..200 {
        if env.locked_tasks().await.contains(&task.to_string()) {
            locked = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(locked, "the fetch took the task's locks");
    blocker
        .execute(
            "UPDATE core_task SET state = 'canceled', finished_at = now() WHERE pulp_id = $1",
            task,
        )
        .await;
    blocker.commit().await;
    let got = fetch.await.unwrap().expect("fetch succeeds");
    assert!(got.is_none(), "a canceled task was handed out");
    env.assert_locks(&[]).await;
    assert_eq!(env.state(task).await, "canceled");
    env.shutdown().await;
}

#[tokio::test]
async fn fetch_with_wait_returns_a_task_inserted_while_waiting() {
    let mut env = Env::new().await;
    let lease = env.open("w").await;
    let mut client = env.client.clone();
    let lease2 = lease.clone();
    let waiting = tokio::spawn(async move {
        client
            .fetch_task(dispatch_broker::proto::FetchTaskRequest {
                lease_id: lease2,
                wait: Some(prost_types::Duration {
                    seconds: 20,
                    nanos: 0,
                }),
                skip_task_ids: vec![],
                start: false,
            })
            .await
            .unwrap()
            .into_inner()
            .task
    });
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let task = env.task(&["a"]).await;
    let got = waiting
        .await
        .unwrap()
        .expect("the waiting fetch got the new task");
    assert_eq!(id(&got), task);
    env.shutdown().await;
}

/// A scan hint remembers which held resources hide older waiting tasks from the scan; when
/// the hint moves forward those names must stay remembered, so that releasing one of them drops
/// the hint and the hidden task is handed out at once (not after `--fetch-hint-max-age`).
#[tokio::test]
async fn a_task_hidden_behind_a_held_lock_is_handed_out_once_the_lock_is_released() {
    let mut env = Env::with(|a| a.fetch.hint_max_age = std::time::Duration::from_secs(3600)).await;
    let a = env.task(&["x"]).await;
    let holder = env.open("holder").await;
    let running = env.fetch(&holder).await.expect("a");
    assert_eq!(id(&running), a);
    env.start(&holder, &running).await;
    // b waits behind a; the scan skips it because x is held.
    let b = env.task(&["x"]).await;
    let c1 = env.task(&["y1"]).await;
    let c2 = env.task(&["y2"]).await;
    let (w1, w2, w3) = (
        env.open("w1").await,
        env.open("w2").await,
        env.open("w3").await,
    );
    // The first pass sets the hint at c1, the second moves it to c2 (nothing it relies on
    // changed in between).
    assert_eq!(id(&env.fetch(&w1).await.expect("c1")), c1);
    assert_eq!(id(&env.fetch(&w2).await.expect("c2")), c2);
    assert!(env.fetch(&w3).await.is_none(), "b still waits for a");
    env.finish(&holder, &running, "completed").await;
    let next = env.fetch(&w3).await.expect("b, now that x is free");
    assert_eq!(id(&next), b);
    env.shutdown().await;
}

/// Options under which a pass may trust its scan hint for two `wake_poll` intervals, and hints
/// are never renewed by a walk meanwhile.
fn trusting(
    wake_poll: std::time::Duration,
) -> impl FnOnce(&mut dispatch_broker::config::ServeArgs) {
    move |a| {
        a.fetch.hint_max_age = std::time::Duration::from_secs(3600);
        a.fetch.wake_poll = wake_poll;
        a.fetch.recheck = wake_poll;
    }
}

/// A pass whose scan hint was read against the change log shortly before, with no change made
/// through this replica since, uses it without reading the log or the lease again: a fetch then
/// costs the acquire and the holder check only. A change made through this replica drops that
/// trust at once, however long `--fetch-wake-poll` is: the task the release freed is handed out
/// by the next fetch.
#[tokio::test]
async fn a_hint_read_just_before_is_trusted_until_this_replica_changes_something() {
    // Two polls: far longer than the test.
    let mut env = Env::with(trusting(std::time::Duration::from_secs(600))).await;
    let a = env.task(&["x"]).await;
    let holder = env.open("holder").await;
    let running = env.fetch(&holder).await.expect("a");
    assert_eq!(id(&running), a);
    env.start(&holder, &running).await;
    let b = env.task(&["x"]).await;
    let c1 = env.task(&["y1"]).await;
    let c2 = env.task(&["y2"]).await;
    let w = env.open("w").await;
    // The first fetch reads the lease and the change log, and leaves a hint.
    assert_eq!(id(&env.fetch(&w).await.expect("c1")), c1);
    // (Each pass answers as soon as it has its grant: its counts are complete once it ended.)
    let before = env.settled_stats().await;
    assert_eq!(id(&env.fetch(&w).await.expect("c2")), c2);
    let trusted = env.settled_stats().await - before;
    assert_eq!(trusted.hints_trusted, 1, "the pass trusted its hint");
    assert_eq!(
        trusted.fetch_redis_calls, 2,
        "acquire and the holder check only: {trusted:?}"
    );
    // Nothing else is ready: the pass trusts its hint, and looks the lease up at its end.
    let before = env.settled_stats().await;
    assert!(env.fetch(&w).await.is_none(), "b still waits for a");
    let empty = env.settled_stats().await - before;
    assert_eq!(empty.hints_trusted, 1);
    assert_eq!(empty.fetch_redis_calls, 1, "the lease look-up: {empty:?}");
    env.finish(&holder, &running, "completed").await;
    let before = env.settled_stats().await;
    let next = env.fetch(&w).await.expect("b, now that x is free");
    assert_eq!(id(&next), b);
    assert_eq!(
        (env.settled_stats().await - before).hints_trusted,
        0,
        "the finish went through this replica"
    );
    env.shutdown().await;
}

/// A pass whose hint is not trusted only because this replica's own calls changed lock state
/// since takes those changes from what the calls recorded, without reading the change log or
/// the lease: the finishes of a busy fleet no longer cost each pass after them a Redis call. The
/// changes are judged as read ones are (a release the hint relies on drops it), and a change made
/// elsewhere in between has the pass read the log.
#[tokio::test]
async fn a_pass_judges_its_hint_by_the_changes_this_replica_made_without_reading_them_back() {
    let mut env = Env::with(trusting(std::time::Duration::from_secs(600))).await;
    let (_other, mut other_client) = env.second_replica().await;
    let a = env.task(&["x"]).await;
    let holder = env.open("holder").await;
    let running = env.fetch(&holder).await.expect("a");
    assert_eq!(id(&running), a);
    env.start(&holder, &running).await;
    let b = env.task(&["x"]).await;
    let free = env.free_tasks("y", 4).await;
    let w = env.open("w").await;
    // The first fetch reads the lease and the change log, and leaves a hint past b (x is held).
    let first = env.fetch(&w).await.expect("a free task");
    assert_eq!(id(&first), free[0]);
    env.start(&w, &first).await;

    // A finish through this replica, of a task the hint does not rely on.
    env.finish(&w, &first, "completed").await;
    let before = env.settled_stats().await;
    let second = env.fetch(&w).await.expect("the next free task");
    assert_eq!(id(&second), free[1]);
    let pass = env.settled_stats().await - before;
    assert_eq!((pass.own_changes, pass.hints_trusted), (1, 0), "{pass:?}");
    assert_eq!(
        pass.fetch_redis_calls, 2,
        "acquire and the holder check only: {pass:?}"
    );

    // The finish of a, whose lock x hid b: the change drops the hint, and b goes out.
    env.finish(&holder, &running, "completed").await;
    let before = env.settled_stats().await;
    assert_eq!(id(&env.fetch(&w).await.expect("b")), b);
    assert_eq!((env.settled_stats().await - before).own_changes, 1);

    // A claim put back through this replica (ReleaseLocks before it started): its release and
    // the requeue it records are both known; the pass checks the requeued task first.
    let third = env.fetch(&w).await.expect("the next free task");
    assert!(env.release(&w, &third).await.unwrap());
    let before = env.settled_stats().await;
    assert_eq!(env.fetch(&w).await.map(|t| id(&t)), Some(id(&third)));
    let pass = env.settled_stats().await - before;
    assert_eq!((pass.own_changes, pass.hints_trusted), (1, 0), "{pass:?}");

    // A release through another replica, then a finish through this one: the log holds a change
    // this replica did not make between the hint and its own, so the pass reads it.
    let elsewhere = support::open_on(&mut other_client, "elsewhere").await;
    let there = support::fetch_on(&mut other_client, &elsewhere)
        .await
        .expect("a free task");
    other_client
        .release_locks(dispatch_broker::proto::ReleaseLocksRequest {
            lease_id: elsewhere,
            task_id: there.task_id.clone(),
            fencing_token: there.fencing_token,
        })
        .await
        .unwrap();
    env.start(&w, &second).await;
    env.finish(&w, &second, "completed").await;
    let before = env.settled_stats().await;
    assert!(env.fetch(&w).await.is_some(), "a free task");
    let read = env.settled_stats().await - before;
    assert_eq!((read.own_changes, read.hints_trusted), (0, 0), "{read:?}");
    assert_eq!(
        read.fetch_redis_calls, 3,
        "the lease and the log, acquire, holder check: {read:?}"
    );
    env.shutdown().await;
}

/// A pass on its own changes uses the lease as this replica last read it, as a trusted pass does:
/// a lease ended through another replica (holding nothing, so the log did not change) still gets
/// NOT_FOUND, from the acquire script.
#[tokio::test]
async fn a_lease_ended_elsewhere_is_told_not_found_by_a_pass_on_own_changes() {
    let mut env = Env::with(trusting(std::time::Duration::from_secs(600))).await;
    let (_other, mut other_client) = env.second_replica().await;
    env.free_tasks("y", 4).await;
    let (w, idle) = (env.open("w").await, env.open("idle").await);
    let first = env.fetch(&w).await.expect("a free task");
    let its = env.fetch(&idle).await.expect("a free task");
    env.start(&idle, &its).await;
    env.finish(&idle, &its, "completed").await;
    other_client
        .close_lease(dispatch_broker::proto::CloseLeaseRequest {
            lease_id: idle.clone(),
        })
        .await
        .unwrap();
    env.start(&w, &first).await;
    env.finish(&w, &first, "completed").await;
    let before = env.settled_stats().await;
    let gone = env.try_fetch(&idle, &[]).await.unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");
    let pass = env.settled_stats().await - before;
    assert_eq!(pass.own_changes, 1, "{pass:?}");
    env.shutdown().await;
}

/// A change made through another replica reaches a replica whose passes trust their hints
/// within two `--fetch-wake-poll` intervals (each replica reads Redis's change counter every
/// interval): the task freed there may wait for that long, never longer.
#[tokio::test]
async fn a_change_through_another_replica_ends_the_trust_in_a_hint_within_two_polls() {
    let poll = std::time::Duration::from_millis(100);
    let mut env = Env::with(trusting(poll)).await;
    let (other, mut other_client) = env.second_replica().await;
    let a = env.task(&["x"]).await;
    let holder = support::open_on(&mut other_client, "holder").await;
    let running = support::fetch_on(&mut other_client, &holder).await.unwrap();
    assert_eq!(id(&running), a);
    let b = env.task(&["x"]).await;
    env.free_tasks("y", 3).await;
    let (w1, w2, w3) = (
        env.open("w1").await,
        env.open("w2").await,
        env.open("w3").await,
    );
    // The first pass passes over b (x is held) and sets the hint after a free task.
    let first = env.fetch(&w1).await.expect("a free task");
    assert_ne!(id(&first), b);
    other_client
        .release_locks(dispatch_broker::proto::ReleaseLocksRequest {
            lease_id: holder,
            task_id: running.task_id.clone(),
            fencing_token: running.fencing_token,
        })
        .await
        .unwrap();
    // a went back to the queue (it never started): the oldest again, and ready.
    let mut handed_out = vec![id(&env.fetch(&w2).await.expect("a task"))];
    if !handed_out.contains(&a) {
        // Handed out past the change (the hint was trusted): after two polls it is seen.
        tokio::time::sleep(poll * 3).await;
        handed_out.push(id(&env.fetch(&w3).await.expect("a task")));
    }
    assert!(
        handed_out.contains(&a),
        "the task freed through the other replica was handed out within two polls: {handed_out:?}"
    );
    other.shutdown().await.unwrap();
    env.shutdown().await;
}

/// A lease that ended through another replica gets NOT_FOUND from a pass that took it from
/// memory and trusted its hint: from the acquire script when a task is ready for it, from the
/// look-up at the pass's end when none is.
#[tokio::test]
async fn an_ended_lease_gets_not_found_from_a_pass_that_trusted_its_hint() {
    let mut env = Env::with(trusting(std::time::Duration::from_secs(600))).await;
    let (other, mut other_client) = env.second_replica().await;
    env.free_tasks("y", 3).await;
    let (w1, w2, w3) = (
        env.open("w1").await,
        env.open("w2").await,
        env.open("w3").await,
    );
    // Started, so that closing the leases fails them rather than putting them back.
    for lease in [&w1, &w2] {
        let task = env.fetch(lease).await.expect("a task");
        env.start(lease, &task).await;
    }
    for lease in [&w1, &w2] {
        other_client
            .close_lease(dispatch_broker::proto::CloseLeaseRequest {
                lease_id: lease.clone(),
            })
            .await
            .unwrap();
    }
    let before = env.settled_stats().await;
    // A task is ready (y2): the acquire finds the lease gone.
    let gone = env.try_fetch(&w1, &[]).await.expect_err("w1 ended");
    assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");
    assert_eq!(
        (env.settled_stats().await - before).hints_trusted,
        1,
        "the pass trusted its hint"
    );
    assert!(env.fetch(&w3).await.is_some(), "y2");
    // Nothing is ready: no acquire runs, and the look-up at the pass's end finds the lease gone.
    let before = env.settled_stats().await;
    let gone = env.try_fetch(&w2, &[]).await.expect_err("w2 ended");
    assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");
    let pass = env.settled_stats().await - before;
    assert_eq!(pass.hints_trusted, 1, "{pass:?}");
    assert_eq!(
        pass.fetch_redis_calls, 1,
        "the lease look-up only: {pass:?}"
    );
    other.shutdown().await.unwrap();
    env.shutdown().await;
}

/// A pass that trusts its scan hint judges the rest of the page the pass before it read (carried
/// with the hint) instead of reading a page: while nothing changes, a fetch costs the claim as
/// its only Postgres statement. A change made through this replica ends the trust at once; a pass
/// that then reads the changes still uses the carried tasks when none of their names changed.
#[tokio::test]
async fn a_pass_that_trusts_its_hint_hands_out_the_rest_of_the_last_page_without_reading_it() {
    let mut env = Env::with(trusting(std::time::Duration::from_secs(600))).await;
    let free = env.free_tasks("y", 4).await;
    let w = env.open("w").await;
    let first = env.fetch(&w).await.expect("y0");
    assert_eq!(id(&first), free[0]);
    env.broker().passes.idle().await;
    for expected in &free[1..3] {
        let before = env.settled_stats().await;
        assert_eq!(id(&env.fetch(&w).await.expect("the next task")), *expected);
        let pass = env.settled_stats().await - before;
        assert_eq!(pass.pages_carried, 1, "{pass:?}");
        assert_eq!(
            pass.fetch_postgres_statements, 1,
            "the claim only: {pass:?}"
        );
    }
    env.finish(&w, &first, "completed").await;
    let before = env.settled_stats().await;
    assert_eq!(id(&env.fetch(&w).await.expect("y3")), free[3]);
    let pass = env.settled_stats().await - before;
    assert_eq!(
        (pass.hints_trusted, pass.pages_carried),
        (0, 1),
        "the finish went through this replica, and released y0 only: {pass:?}"
    );
    env.shutdown().await;
}

/// A pass that reads a change touching a carried task's names reads its page again: here a
/// waiting task that made a carried task not ready left the queue (Pulp canceled it, the sweeper
/// finished it), and the carried task, ready now, is handed out before a newer one. Judged from
/// its carried row it would have been passed over until the hint was renewed.
#[tokio::test]
async fn a_carried_task_whose_names_changed_is_judged_from_a_page_read_again() {
    let mut env = Env::with(|a| {
        trusting(std::time::Duration::from_secs(600))(a);
        a.sweep_interval = std::time::Duration::from_millis(200);
    })
    .await;
    env.task(&["x"]).await;
    let holder = env.open("holder").await;
    let running = env.fetch(&holder).await.expect("the task on x");
    env.start(&holder, &running).await;
    let y = env.task(&["y"]).await;
    // Waits for x (hidden from the page by the held lock), and holds up c through q.
    let blocker = env.task(&["x", "q"]).await;
    let c = env.task(&["q"]).await;
    env.task(&["d"]).await;
    let w = env.open("w").await;
    // Hands out y; carries c (not ready) and d.
    assert_eq!(id(&env.fetch(&w).await.expect("y")), y);
    env.broker().passes.idle().await;
    cancel_through_pulp(&env, blocker).await;
    assert!(
        support::eventually(std::time::Duration::from_secs(10), || async {
            env.state(blocker).await == "canceled"
        })
        .await
        .is_some(),
        "the sweeper finishes what Pulp canceled"
    );
    let before = env.settled_stats().await;
    let next = env.fetch(&w).await.expect("c, ready now");
    let pass = env.settled_stats().await - before;
    assert_eq!(id(&next), c, "{pass:?}");
    assert_eq!(pass.pages_carried, 0, "{pass:?}");
    env.shutdown().await;
}

/// A carried task that another replica handed out, or that was canceled, since the page was read
/// is not handed out again: the acquire script or the claim finds it gone, the next carried task
/// is handed out, and the gone one keeps no lock of this lease.
#[tokio::test]
async fn a_carried_task_taken_or_canceled_since_its_page_was_read_is_passed_by() {
    let mut env = Env::with(trusting(std::time::Duration::from_secs(600))).await;
    let (other, mut other_client) = env.second_replica().await;
    let free = env.free_tasks("y", 5).await;
    let w = env.open("w").await;
    let first = env.fetch(&w).await.expect("y0");
    assert_eq!(id(&first), free[0]);
    env.broker().passes.idle().await;
    // y1 goes to a lease of the other replica, y2 is canceled in Postgres while it waits.
    let elsewhere = support::open_on(&mut other_client, "elsewhere").await;
    let taken = support::fetch_on(&mut other_client, &elsewhere)
        .await
        .expect("y1");
    assert_eq!(id(&taken), free[1]);
    env.set_state(free[2], "canceled").await;
    let before = env.settled_stats().await;
    let next = env.fetch(&w).await.expect("y3");
    let pass = env.settled_stats().await - before;
    assert_eq!(pass.pages_carried, 1, "{pass:?}");
    assert_eq!(id(&next), free[3]);
    assert_eq!(env.state(free[2]).await, "canceled");
    env.assert_locks(&[&first, &taken, &next]).await;
    other.shutdown().await.unwrap();
    env.shutdown().await;
}

/// A task that a held lock hid from the carried page, and that the release of that lock made
/// ready, is handed out by the next fetch: the pass that reads the release reads its page again
/// (the resource queues say the lock hid a task among the carried ones), and no pass leaves a
/// hint that relies on the released lock.
#[tokio::test]
async fn a_task_hidden_among_the_carried_ones_is_handed_out_once_its_lock_is_released() {
    the_hidden_task_goes_out_next(true).await;
}

/// Without the resource queues to say whether the released lock hid a task among the carried
/// ones, Postgres says it (hiding.sql): the task it hid is handed out, as above. (It guards
/// against a wrong "nothing hid": it fails when that answer is forced; the next test shows that
/// Postgres is asked.)
#[tokio::test]
async fn without_resource_queues_a_task_hidden_among_the_carried_ones_is_handed_out() {
    the_hidden_task_goes_out_next(false).await;
}

/// [`carried_past_a_release`] with a hidden task, both ways: the next fetch hands it out.
async fn the_hidden_task_goes_out_next(resource_queues: bool) {
    for read_back in [false, true] {
        let (mut env, w, hidden, _) =
            carried_past_a_release(resource_queues, true, read_back).await;
        let next = env.fetch(&w).await.expect("a task");
        assert_eq!(
            Some(id(&next)),
            hidden,
            "the task on x, the oldest ready now (read back: {read_back})"
        );
        env.shutdown().await;
    }
}

/// A released lock that hid no task among the carried ones leaves them usable: without the
/// resource queues, Postgres says so in one statement (hiding.sql) and the pass judges the
/// carried tasks instead of reading its page.
#[tokio::test]
async fn a_released_lock_that_hid_nothing_leaves_the_carried_tasks_in_use() {
    for read_back in [false, true] {
        let (mut env, w, _, free) = carried_past_a_release(false, false, read_back).await;
        let before = env.settled_stats().await;
        let next = env.fetch(&w).await.expect("d0");
        let pass = env.settled_stats().await - before;
        assert_eq!(id(&next), free[0]);
        assert_eq!(pass.pages_carried, 1, "{pass:?}");
        assert_eq!(pass.own_changes, u64::from(!read_back), "{pass:?}");
        env.shutdown().await;
    }
}

/// A task on x runs; then y, (with `hidden`) a task on x, and three free tasks `d` wait. Lease w
/// fetches y, so the d tasks are carried (the task on x is hidden from that page: x is held);
/// then the task on x finishes through this replica (with `read_back`, a lease of this replica
/// that holds nothing is closed right after, a call that does not say what it changed, so the
/// next pass reads the change log instead of taking this replica's own changes). Returns the
/// broker, w, the hidden task and the d tasks.
async fn carried_past_a_release(
    resource_queues: bool,
    hidden: bool,
    read_back: bool,
) -> (Env, String, Option<uuid::Uuid>, Vec<uuid::Uuid>) {
    let mut env = Env::with(move |a| {
        trusting(std::time::Duration::from_secs(600))(a);
        a.fetch.resource_queues = resource_queues;
    })
    .await;
    env.task(&["x"]).await;
    let holder = env.open("holder").await;
    let running = env.fetch(&holder).await.expect("the task on x");
    env.start(&holder, &running).await;
    let y = env.task(&["y"]).await;
    let hidden = match hidden {
        true => Some(env.task(&["x"]).await),
        false => None,
    };
    let free = env.free_tasks("d", 3).await;
    let w = env.open("w").await;
    assert_eq!(id(&env.fetch(&w).await.expect("y")), y);
    let spare = env.open("spare").await;
    env.broker().passes.idle().await;
    env.finish(&holder, &running, "completed").await;
    if read_back {
        env.client
            .close_lease(dispatch_broker::proto::CloseLeaseRequest { lease_id: spare })
            .await
            .unwrap();
    }
    (env, w, hidden, free)
}

/// The same with the lock released through another replica while this one trusts its hint: a
/// newer carried task may go first until the trust ends (two polls), and then the hidden task is
/// handed out: the hint the trusting pass left relies on the lock (its page's held entry), so the
/// release drops it.
#[tokio::test]
async fn a_task_hidden_among_the_carried_ones_is_handed_out_once_another_replicas_release_is_seen()
{
    let poll = std::time::Duration::from_millis(100);
    let mut env = Env::with(trusting(poll)).await;
    let (other, mut other_client) = env.second_replica().await;
    env.task(&["x"]).await;
    let holder = support::open_on(&mut other_client, "holder").await;
    let running = support::fetch_on(&mut other_client, &holder)
        .await
        .expect("the task on x");
    let y = env.task(&["y"]).await;
    let hidden = env.task(&["x"]).await;
    env.free_tasks("d", 4).await;
    let w = env.open("w").await;
    assert_eq!(id(&env.fetch(&w).await.expect("y")), y);
    env.broker().passes.idle().await;
    other_client
        .finish_task(support::finish_request(holder, &running, "completed"))
        .await
        .unwrap();
    let mut handed_out = vec![id(&env.fetch(&w).await.expect("a task"))];
    if handed_out[0] != hidden {
        // A carried task went first (the hint was trusted): after two polls the release is seen.
        env.broker().passes.idle().await;
        tokio::time::sleep(poll * 3).await;
        handed_out.push(id(&env.fetch(&w).await.expect("a task")));
    }
    assert_eq!(
        handed_out.last(),
        Some(&hidden),
        "the task on x once the release is seen: {handed_out:?}"
    );
    other.shutdown().await.unwrap();
    env.shutdown().await;
}

/// A claim put back after the page that is carried was read, and that lies past the scan hint's
/// position (it was claimed, so the page skipped it), is judged with the carried tasks in queue
/// order: the oldest ready task is handed out.
#[tokio::test]
async fn a_claim_put_back_among_the_carried_tasks_is_handed_out_in_order() {
    let mut env = Env::with(trusting(std::time::Duration::from_secs(600))).await;
    let c1 = env.task(&["c1"]).await;
    let put_back = env.task(&["p"]).await;
    env.task(&["c2"]).await;
    env.task(&["c3"]).await;
    let other = env.open("other").await;
    let claimed = env
        .claim(&other, put_back)
        .await
        .unwrap()
        .expect("claimed by id");
    let w = env.open("w").await;
    // Hands out c1; carries c2 and c3 (the claimed task was skipped).
    assert_eq!(id(&env.fetch(&w).await.expect("c1")), c1);
    env.broker().passes.idle().await;
    assert!(env.release(&other, &claimed).await.unwrap());
    let before = env.settled_stats().await;
    let next = env.fetch(&w).await.expect("a task");
    let pass = env.settled_stats().await - before;
    assert_eq!(id(&next), put_back, "the oldest ready task: {pass:?}");
    env.shutdown().await;
}

/// Claims put back behind the scan hint's position are handed out again before the carried
/// tasks, oldest first, though this replica handed them out after the carried page was read: they
/// are judged as of their own read.
#[tokio::test]
async fn claims_put_back_go_before_the_carried_tasks() {
    let mut env = Env::with(trusting(std::time::Duration::from_secs(600))).await;
    let ids = env.free_tasks("t", 5).await;
    let w = env.open("w").await;
    // The first pass reads the page and carries the rest; the second hands out from it.
    let first = env.fetch(&w).await.expect("t0");
    let second = env.fetch(&w).await.expect("t1");
    assert_eq!((id(&first), id(&second)), (ids[0], ids[1]));
    env.broker().passes.idle().await;
    assert!(env.release(&w, &first).await.unwrap());
    assert!(env.release(&w, &second).await.unwrap());
    let before = env.settled_stats().await;
    let again = vec![
        id(&env.fetch(&w).await.expect("a task")),
        id(&env.fetch(&w).await.expect("a task")),
    ];
    let passes = env.settled_stats().await - before;
    assert_eq!(again, vec![ids[0], ids[1]], "{passes:?}");
    assert!(passes.pages_carried >= 1, "{passes:?}");
    assert_eq!(id(&env.fetch(&w).await.expect("t2")), ids[2]);
    env.shutdown().await;
}

/// A change made outside the broker (a Pulp process finishing the task that blocked another, in
/// Postgres only) is seen once the scan hint is older than `--fetch-hint-max-age`: a walk in the
/// background renews the hint, and the freed task is handed out without anything changing
/// through the broker.
#[tokio::test]
async fn a_task_freed_outside_the_broker_is_handed_out_once_the_hint_is_renewed() {
    let mut env = Env::with(|a| a.fetch.hint_max_age = std::time::Duration::from_millis(200)).await;
    // Run by a Pulp API process, not through the broker: running, claimed by nobody.
    let outside = env.task(&["q"]).await;
    env.db
        .execute(
            "UPDATE core_task SET state = 'running' WHERE pulp_id = $1",
            &[&outside],
        )
        .await
        .unwrap();
    let freed = env.task(&["q"]).await;
    let other = env.task(&["free"]).await;
    let (w1, w2) = (env.open("w1").await, env.open("w2").await);
    // The pass passes over `freed` (q is held) and sets its hint after `other`.
    assert_eq!(id(&env.fetch(&w1).await.expect("other")), other);
    env.db
        .execute(
            "UPDATE core_task SET state = 'completed', finished_at = now() WHERE pulp_id = $1",
            &[&outside],
        )
        .await
        .unwrap();
    let mut handed_out = None;
    for _ in 0..100 {
        if let Some(task) = env.fetch(&w2).await {
            handed_out = Some(id(&task));
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        handed_out,
        Some(freed),
        "the freed task was never handed out"
    );
    env.shutdown().await;
}

/// A task released before it started goes back to the queue and is handed out again at once,
/// by the same broker that granted it (which remembers its recent grants to keep passes that
/// read their page earlier from claiming them again).
#[tokio::test]
async fn a_task_released_before_it_started_is_handed_out_again_at_once() {
    let mut env = Env::new().await;
    let task = env.task(&["a"]).await;
    let (w1, w2) = (env.open("w1").await, env.open("w2").await);
    let granted = env.fetch(&w1).await.expect("the task");
    assert!(env.release(&w1, &granted).await.unwrap());
    assert_eq!(env.state(task).await, "waiting");
    let again = env.fetch(&w2).await.expect("the same task, at once");
    assert_eq!(id(&again), task);
    assert!(again.fencing_token > granted.fencing_token);
    env.shutdown().await;
}

/// Claims put back in the queue sit before the scan hint's position, which does not move back
/// for them (that would make the next pass read the blocked queue again): each pass checks them
/// first, so they are handed out again at once, oldest first, however long the hint lives.
#[tokio::test]
async fn claims_put_back_behind_the_hint_are_handed_out_again_oldest_first() {
    let mut env = Env::with(|a| a.fetch.hint_max_age = std::time::Duration::from_secs(3600)).await;
    let blocker = env.task(&["x"]).await;
    let holder = env.open("holder").await;
    let running = env.fetch(&holder).await.expect("the blocker");
    assert_eq!(id(&running), blocker);
    env.start(&holder, &running).await;
    // Blocked behind the running task: the hint is set past it.
    env.task(&["x"]).await;
    let tasks = [
        env.task(&["a"]).await,
        env.task(&["b"]).await,
        env.task(&["c"]).await,
    ];
    let mut granted = Vec::new();
    for name in ["w1", "w2", "w3"] {
        let lease = env.open(name).await;
        let task = env.fetch(&lease).await.expect("a free task");
        granted.push((lease, task));
    }
    assert_eq!(
        granted.iter().map(|(_, t)| id(t)).collect::<Vec<_>>(),
        tasks
    );
    for (lease, task) in granted.iter().rev() {
        assert!(env.release(lease, task).await.unwrap(), "put back");
    }
    let again = env.open("again").await;
    let mut order = Vec::new();
    for _ in 0..3 {
        let task = env.fetch(&again).await.expect("a task put back");
        order.push(id(&task));
        env.start(&again, &task).await;
    }
    assert_eq!(order, tasks, "handed out again oldest first");
    assert!(
        env.fetch(&again).await.is_none(),
        "the blocked task still waits"
    );
    env.shutdown().await;
}

/// A world with long-lived scan hints whose sweeper finishes what Pulp canceled within 200 ms.
async fn sweeping_env() -> Env {
    Env::with(|a| {
        a.fetch.hint_max_age = std::time::Duration::from_secs(3600);
        a.sweep_interval = std::time::Duration::from_millis(200);
    })
    .await
}

/// Pulp's cancel API on a waiting task: `canceling`, claimed by nobody.
async fn cancel_through_pulp(env: &Env, task: uuid::Uuid) {
    env.db
        .execute(
            "UPDATE core_task SET state = 'canceling' WHERE pulp_id = $1",
            &[&task],
        )
        .await
        .unwrap();
}

/// The first task a lease is handed within about ten seconds of fetching (wait 0) every 100 ms.
async fn fetch_within_ten_seconds(env: &mut Env, lease: &str) -> Option<uuid::Uuid> {
    for _ in 0..100 {
        if let Some(task) = env.fetch(lease).await {
            return Some(id(&task));
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    None
}

/// x runs; a task needing x and y (in the mode `y_entry` says) waits for it, and a task needing
/// y exclusively waits for that one. Pulp cancels the middle task while nobody holds it (the
/// broker's sweeper finishes it): the task behind it is handed out within ten seconds.
async fn blocked_by_a_task_pulp_canceled(y_entry: &str) {
    let mut env = sweeping_env().await;
    env.task(&["x"]).await;
    let holder = env.open("holder").await;
    let running = env.fetch(&holder).await.expect("the task on x");
    env.start(&holder, &running).await;
    let canceled = env.task(&["x", y_entry]).await;
    let blocked = env.task(&["y"]).await;
    let free = env.task(&["z"]).await;
    let w = env.open("w").await;
    assert_eq!(id(&env.fetch(&w).await.expect("the free task")), free);
    cancel_through_pulp(&env, canceled).await;
    let handed_out = fetch_within_ten_seconds(&mut env, &w).await;
    assert_eq!(handed_out, Some(blocked));
    assert_eq!(env.state(canceled).await, "canceled");
    env.shutdown().await;
}

/// A waiting task that Pulp cancels while nobody holds it keeps the scan hints that rely only on
/// held locks, but a task it blocked is handed out at once.
#[tokio::test]
async fn a_task_blocked_by_a_waiting_task_pulp_canceled_is_handed_out() {
    blocked_by_a_task_pulp_canceled("y").await;
}

/// The same with a shared reservation: the task Pulp canceled needed y shared, the task behind
/// it needs y exclusively and is handed out once it left.
#[tokio::test]
async fn a_task_waiting_for_a_shared_user_pulp_canceled_is_handed_out() {
    blocked_by_a_task_pulp_canceled("shared:y").await;
}

/// A task the scan hint skipped as conflicting with a waiting shared user of its resource (it
/// arrived after the hint was taken) is handed out once Pulp cancels that shared user.
#[tokio::test]
async fn a_task_skipped_behind_a_shared_user_pulp_canceled_is_handed_out() {
    let mut env = sweeping_env().await;
    env.task(&["b"]).await;
    let holder = env.open("holder").await;
    let running = env.fetch(&holder).await.expect("the task on b");
    env.start(&holder, &running).await;
    // Hidden behind b; it holds up `shared_user` through a.
    env.task(&["b", "a"]).await;
    let shared_user = env.task(&["shared:a", "shared:y"]).await;
    let free = env.task(&["z"]).await;
    let w = env.open("w").await;
    assert_eq!(id(&env.fetch(&w).await.expect("the free task")), free);
    // Needs y alone: behind the shared user, so the next pass skips it and the hint passes it.
    let skipped = env.task(&["y"]).await;
    assert!(
        env.fetch(&w).await.is_none(),
        "y's task waits for the shared user"
    );
    cancel_through_pulp(&env, shared_user).await;
    let handed_out = fetch_within_ten_seconds(&mut env, &w).await;
    assert_eq!(handed_out, Some(skipped));
    env.shutdown().await;
}

/// A task inserted by a transaction still open when a pass read the queue, and committed after a
/// newer task, is not behind the scan hint: the hint's end at the queue's tail is no later than
/// the start of any open writer of core_task.
#[tokio::test]
async fn a_task_committed_after_a_newer_one_is_not_behind_the_hint() {
    let mut env = Env::with(|a| a.fetch.hint_max_age = std::time::Duration::from_secs(3600)).await;
    env.task(&["r"]).await;
    let holder = env.open("holder").await;
    let running = env.fetch(&holder).await.expect("the task on r");
    env.start(&holder, &running).await;
    env.task(&["r"]).await;
    let w = env.open("w").await;
    assert!(env.fetch(&w).await.is_none(), "r's queue is blocked");
    // A writer stamps its task (the insert trigger) and stays open.
    let (writer, conn) = tokio_postgres::connect(&env.db_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let late = uuid::Uuid::new_v4();
    writer.batch_execute("BEGIN").await.unwrap();
    writer
        .execute(
            "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
             VALUES ($1, 'late', 'waiting', ARRAY['z'])",
            &[&late],
        )
        .await
        .unwrap();
    // A newer task on the blocked resource commits first; a pass reads the queue to its tail.
    env.task(&["r"]).await;
    assert!(env.fetch(&w).await.is_none(), "only r's tasks are visible");
    writer.batch_execute("COMMIT").await.unwrap();
    let task = env.fetch(&w).await.expect("the task committed late");
    assert_eq!(id(&task), late);
    env.shutdown().await;
}

/// A task Pulp canceled while it waited (`canceling`, claimed by nobody) holds nothing: the task
/// behind it is judged by the exact look-up, not hidden as if a lock were held, and is handed out
/// once the sweeper has finished the canceled one, whatever the scan hint's age.
#[tokio::test]
async fn a_task_behind_one_pulp_is_canceling_is_handed_out_once_it_is_canceled() {
    // The sweeper finishes what Pulp canceled: not before the first fetch (its first turn runs
    // at start-up, the next after 2 s), and well within the wait below.
    let mut env = Env::with(|a| {
        a.fetch.hint_max_age = std::time::Duration::from_secs(3600);
        a.sweep_interval = std::time::Duration::from_secs(2);
    })
    .await;
    let canceling = env.task(&["a"]).await;
    cancel_through_pulp(&env, canceling).await;
    let behind = env.task(&["a"]).await;
    let free = env.task(&["z"]).await;
    let w = env.open("w").await;
    let first = env.fetch(&w).await.expect("a task");
    let mut handed_out = vec![id(&first)];
    for _ in 0..100 {
        // Both, in whatever order: the sweeper may finish the canceled task before the first
        // fetch.
        if handed_out.contains(&behind) && handed_out.contains(&free) {
            break;
        }
        if let Some(task) = env.fetch(&w).await {
            handed_out.push(id(&task));
        } else {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    assert!(handed_out.contains(&free), "{handed_out:?}");
    assert!(
        handed_out.contains(&behind),
        "the task behind was never handed out"
    );
    assert_eq!(env.state(canceling).await, "canceled");
    env.shutdown().await;
}

#[tokio::test]
async fn a_fetch_that_starts_its_task_hands_it_out_running_in_one_call() {
    let mut env = Env::new().await;
    let task = env.task(&["a"]).await;
    let lease = env.open("w").await;
    let granted = env.fetch_started(&lease).await.expect("the task");
    assert_eq!(id(&granted), task);
    assert!(
        granted.started_at.is_some(),
        "the grant says when it started"
    );
    assert_eq!(env.state(task).await, "running");
    let row = env
        .db
        .query_one(
            "SELECT started_at IS NOT NULL, app_lock_id IS NOT NULL FROM core_task \
             WHERE pulp_id = $1",
            &[&task],
        )
        .await
        .unwrap();
    assert!(
        row.get::<_, bool>(0) && row.get::<_, bool>(1),
        "started and claimed"
    );
    env.assert_locks(&[&granted]).await;
    // StartTask has nothing left to do: it answers when the task started, and nothing changes.
    let again = env
        .client
        .start_task(crate::support::start_request(&lease, &granted))
        .await
        .expect("a start of a task its holder started is answered")
        .into_inner();
    assert_eq!(again.started_at, granted.started_at);
    assert_eq!(env.state(task).await, "running");
    env.assert_locks(&[&granted]).await;
    assert_eq!(
        env.finish(&lease, &granted, "completed").await.state,
        "completed"
    );
    env.assert_locks(&[]).await;
    // Without `start` the grant is claimed and waits for StartTask, as before.
    let other = env.task(&["b"]).await;
    let plain = env.fetch(&lease).await.expect("the other task");
    assert!(plain.started_at.is_none());
    assert_eq!(env.state(other).await, "waiting");
    assert!(env.app_lock(other).await.is_some());
    env.shutdown().await;
}

#[tokio::test]
async fn closing_a_lease_fails_a_task_its_fetch_started_and_requeues_one_only_claimed() {
    let mut env = Env::new().await;
    let started = env.task(&["a"]).await;
    let claimed = env.task(&["b"]).await;
    let lease = env.open("w").await;
    assert_eq!(id(&env.fetch_started(&lease).await.unwrap()), started);
    assert_eq!(id(&env.fetch(&lease).await.unwrap()), claimed);
    let closed = env
        .client
        .close_lease(dispatch_broker::proto::CloseLeaseRequest {
            lease_id: lease.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((closed.failed_tasks, closed.requeued_tasks), (1, 1));
    assert_eq!(env.state(started).await, "failed");
    assert_eq!(env.state(claimed).await, "waiting");
    assert_eq!(env.app_lock(claimed).await, None);
    env.assert_locks(&[]).await;
    env.shutdown().await;
}
