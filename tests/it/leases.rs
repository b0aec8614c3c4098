//! Leases: open, heartbeat, close, and what closing does to the lease's tasks.

use std::time::Duration;

use crate::support::{id, lease_request, Env};
use dispatch_broker::proto::*;

#[tokio::test]
async fn open_creates_a_worker_row_that_pulp_would_accept_and_close_removes_it() {
    let mut env = Env::new().await;
    let lease = env
        .client
        .open_lease(OpenLeaseRequest {
            worker_name: "123@host".into(),
            versions: [
                ("core".into(), "3.123.1".into()),
                ("file".into(), "3.123.1".into()),
            ]
            .into(),
            ttl: Some(prost_types::Duration {
                seconds: 30,
                nanos: 0,
            }),
            app_status_id: String::new(),
            open_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(lease.lease_id, lease.app_status_id);
    let app: uuid::Uuid = lease.app_status_id.parse().unwrap();
    let row = env
        .db
        .query_one(
            "SELECT name, app_type, versions -> 'core', extract(epoch FROM ttl)::float8, \
                    last_heartbeat > now() - interval '1 minute' \
             FROM core_appstatus WHERE pulp_id = $1",
            &[&app],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "123@host");
    assert_eq!(row.get::<_, String>(1), "worker");
    assert_eq!(row.get::<_, String>(2), "3.123.1");
    assert_eq!(row.get::<_, f64>(3), 30.0);
    assert!(row.get::<_, bool>(4));
    let closed = env
        .client
        .close_lease(CloseLeaseRequest {
            lease_id: lease.lease_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(closed.released_locks, 0);
    let left: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM core_appstatus WHERE pulp_id = $1",
            &[&app],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
    env.shutdown().await;
}

#[tokio::test]
async fn each_lease_is_new_even_for_the_same_worker_name() {
    let mut env = Env::new().await;
    let a = env.open("same").await;
    let b = env.open("same").await;
    assert_ne!(a, b);
    env.shutdown().await;
}

#[tokio::test]
async fn heartbeats_keep_a_lease_alive_past_its_ttl() {
    let mut env = Env::new().await;
    let lease = env
        .open_with("w", &[], Some(Duration::from_millis(400)))
        .await;
    let mut last = None;
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(130)).await;
        let beat = env
            .client
            .heartbeat(HeartbeatRequest {
                lease_id: lease.clone(),
                ..Default::default()
            })
            .await
            .expect("alive")
            .into_inner();
        let expires = beat.expires_at.unwrap();
        if let Some(prev) = last {
            assert!(expires.seconds * 1000 + i64::from(expires.nanos / 1_000_000) >= prev);
        }
        last = Some(expires.seconds * 1000 + i64::from(expires.nanos / 1_000_000));
    }
    env.task(&["a"]).await;
    assert!(
        env.fetch(&lease).await.is_some(),
        "the lease outlived its TTL through heartbeats"
    );
    env.shutdown().await;
}

#[tokio::test]
async fn a_heartbeat_lists_only_the_tasks_whose_lock_names_its_lease() {
    let mut env = Env::new().await;
    env.task(&["a"]).await;
    let holder = env.open("holder").await;
    let other = env.open("other").await;
    let granted = env.fetch(&holder).await.expect("the task");
    // A stray entry in the other lease's registry (a registry names the tasks a lease holds, the
    // task's lock names the lease): the lock says the holder holds it, so the other does not.
    env.stray_registry_entry(&other, &granted.task_id).await;
    let beat = |lease: String| {
        let mut client = env.client.clone();
        async move {
            client
                .heartbeat(HeartbeatRequest {
                    lease_id: lease,
                    ..Default::default()
                })
                .await
                .expect("alive")
                .into_inner()
                .held_tasks
                .into_iter()
                .map(|t| (t.task_id, t.fencing_token))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(beat(other.clone()).await, vec![]);
    assert_eq!(
        beat(holder.clone()).await,
        vec![(granted.task_id.clone(), granted.fencing_token)]
    );
    env.shutdown().await;
}

/// A worker that reopens with its own core_appstatus row has two leases naming one row while the
/// first is not yet swept. Closing one of them ends (in Postgres) and releases (in Redis) only
/// the tasks whose lock names it, even with a stray entry for the other's task in its registry.
#[tokio::test]
async fn closing_a_lease_leaves_alone_a_task_whose_lock_names_another_lease() {
    let mut env = Env::new().await;
    let own = env.app_status("worker", "pulp-worker").await;
    let open = |name: &str| {
        let mut client = env.client.clone();
        let request = OpenLeaseRequest {
            app_status_id: own.to_string(),
            ..lease_request(name)
        };
        async move {
            client
                .open_lease(request)
                .await
                .unwrap()
                .into_inner()
                .lease_id
        }
    };
    let holder = open("pulp-worker").await;
    let other = open("pulp-worker").await;
    let task = env.task(&["a"]).await;
    let granted = env.fetch(&holder).await.expect("the task");
    env.start(&holder, &granted).await;
    env.stray_registry_entry(&other, &granted.task_id).await;
    env.client
        .close_lease(CloseLeaseRequest { lease_id: other })
        .await
        .unwrap();
    assert_eq!(
        env.state(task).await,
        "running",
        "the holder's task was ended by another lease's close"
    );
    env.assert_locks(&[&granted]).await;
    env.finish(&holder, &granted, "completed").await;
    env.shutdown().await;
}

#[tokio::test]
async fn heartbeat_lists_the_leases_tasks_that_were_asked_to_cancel() {
    let mut env = Env::new().await;
    env.task(&["a"]).await;
    env.task(&["b"]).await;
    let lease = env.open("w").await;
    let t1 = env.fetch(&lease).await.unwrap();
    let t2 = env.fetch(&lease).await.unwrap();
    env.start(&lease, &t1).await;
    env.start(&lease, &t2).await;
    let cancel = env.cancel(id(&t1)).await.unwrap();
    assert_eq!(cancel.state, "canceling");
    assert!(cancel.holder_notified);
    let beat = env
        .client
        .heartbeat(HeartbeatRequest {
            lease_id: lease.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(beat.cancel_task_ids, vec![t1.task_id.clone()]);
    // The holder finishes it as canceled and releases in the same call.
    let done = env.finish(&lease, &t1, "canceled").await;
    assert_eq!(done.state, "canceled");
    assert!(done.released);
    env.assert_locks(&[&t2]).await;
    env.shutdown().await;
}

#[tokio::test]
async fn close_requeues_claimed_tasks_fails_running_ones_and_releases_every_lock() {
    let mut env = Env::new().await;
    let a = env.task(&["a"]).await;
    let b = env.task(&["b", "shared:d"]).await;
    let lease = env.open("w").await;
    let ta = env.fetch(&lease).await.unwrap();
    let tb = env.fetch(&lease).await.unwrap();
    env.start(&lease, &ta).await;
    let closed = env
        .client
        .close_lease(CloseLeaseRequest {
            lease_id: lease.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            closed.released_locks,
            closed.requeued_tasks,
            closed.failed_tasks
        ),
        (2, 1, 1)
    );
    assert_eq!(env.state(a).await, "failed");
    assert_eq!(
        env.error_of(a).await["reason"],
        "Aborted during worker shutdown."
    );
    assert_eq!(env.state(b).await, "waiting");
    assert_eq!(env.app_lock(b).await, None);
    env.assert_locks(&[]).await;
    // The requeued task goes to the next worker; the closed lease is gone.
    let next = env.open("next").await;
    assert_eq!(id(&env.fetch(&next).await.unwrap()), id(&tb));
    let again = env
        .client
        .close_lease(CloseLeaseRequest { lease_id: lease })
        .await
        .unwrap_err();
    assert_eq!(again.code(), tonic::Code::NotFound);
    env.shutdown().await;
}

#[tokio::test]
async fn releasing_a_claimed_task_that_never_started_puts_it_back_in_the_queue() {
    let mut env = Env::new().await;
    let a = env.task(&["a"]).await;
    let w1 = env.open("w1").await;
    let t = env.fetch(&w1).await.unwrap();
    assert!(env.release(&w1, &t).await.unwrap());
    assert_eq!(env.app_lock(a).await, None);
    let w2 = env.open("w2").await;
    let again = env.fetch(&w2).await.unwrap();
    assert_eq!(id(&again), a);
    assert!(again.fencing_token > t.fencing_token);
    // The first holder's late release with its old token changes nothing for the new holder.
    let late = env.release(&w1, &t).await.unwrap_err();
    assert_eq!(late.code(), tonic::Code::FailedPrecondition);
    env.assert_locks(&[&again]).await;
    env.shutdown().await;
}

/// A retry of an OpenLease whose answer was lost (same `open_id`) gets the lease the first call
/// opened, not a second one; the row made for the retry is removed; the id cannot be reused for
/// another row; once that lease ended, the same id opens a new one.
#[tokio::test]
async fn an_open_lease_retried_with_its_open_id_answers_the_lease_the_first_call_opened() {
    let mut env = Env::new().await;
    let open_id = uuid::Uuid::new_v4().to_string();
    let request = OpenLeaseRequest {
        open_id: open_id.clone(),
        ..lease_request("w")
    };
    let first = env
        .client
        .open_lease(request.clone())
        .await
        .unwrap()
        .into_inner();
    let again = env
        .client
        .open_lease(request.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.lease_id, first.lease_id);
    assert_eq!(again.app_status_id, first.app_status_id);
    assert!(again.adopted_tasks.is_empty());
    let rows: i64 = env
        .db
        .query_one("SELECT count(*) FROM core_appstatus", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "the row made for the retry is removed");
    async fn leases(env: &Env) -> u64 {
        env.broker()
            .locks
            .lease_table("", true, "", 100, false)
            .await
            .unwrap()
            .total
    }
    assert_eq!(leases(&env).await, 1);

    // The lease answered to both works as one.
    let task = env.task(&["a"]).await;
    let t = env.fetch(&again.lease_id).await.unwrap();
    assert_eq!(id(&t), task);
    // A retry after the lease was used answers it with what it holds.
    let third = env
        .client
        .open_lease(request.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(third.lease_id, first.lease_id);
    assert_eq!(
        third
            .adopted_tasks
            .iter()
            .map(|h| (h.task_id.clone(), h.fencing_token))
            .collect::<Vec<_>>(),
        vec![(task.to_string(), t.fencing_token)]
    );
    env.finish(&first.lease_id, &t, "completed").await;

    // The same id naming another row is refused, and changes nothing.
    let own = env.app_status("worker", "own").await;
    let refused = env
        .client
        .open_lease(OpenLeaseRequest {
            app_status_id: own.to_string(),
            ..request.clone()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("open_id") && refused.message().contains(&first.app_status_id),
        "{}",
        refused.message()
    );
    assert_eq!(leases(&env).await, 1);
    // So is an id that opened a lease on a named row, sent again naming none.
    let named = OpenLeaseRequest {
        app_status_id: own.to_string(),
        open_id: uuid::Uuid::new_v4().to_string(),
        ..lease_request("own")
    };
    env.client.open_lease(named.clone()).await.unwrap();
    let refused = env
        .client
        .open_lease(OpenLeaseRequest {
            app_status_id: String::new(),
            ..named
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert_eq!(leases(&env).await, 2);

    // Once the lease ended, the id opens a new one.
    env.client
        .close_lease(CloseLeaseRequest {
            lease_id: first.lease_id.clone(),
        })
        .await
        .unwrap();
    let after = env.client.open_lease(request).await.unwrap().into_inner();
    assert_ne!(after.lease_id, first.lease_id);
    assert_ne!(after.app_status_id, first.app_status_id);
    env.shutdown().await;
}

/// An open whose Redis call timed out (the broker removed the row it made, not knowing whether
/// the lease was opened) whose script ran all the same once Redis woke: the retry with the same
/// open id is not handed that lease, whose row is gone, but one that works; the other is ended.
/// The state that leaves (a live lease for the open id, its broker-made row deleted) is made
/// directly: whether a frozen Redis still runs the script of a call that timed out depends on
/// when the broker's connection sent it, which a loaded machine does not make certain.
#[tokio::test]
async fn a_retry_of_an_open_that_timed_out_in_redis_gets_a_lease_whose_row_exists() {
    let mut env = Env::new().await;
    let request = OpenLeaseRequest {
        open_id: uuid::Uuid::new_v4().to_string(),
        ..lease_request("w")
    };
    let unseen = env
        .client
        .open_lease(request.clone())
        .await
        .unwrap()
        .into_inner();
    let gone: uuid::Uuid = unseen.app_status_id.parse().unwrap();
    env.db
        .execute("DELETE FROM core_appstatus WHERE pulp_id = $1", &[&gone])
        .await
        .unwrap();
    async fn leases(env: &Env) -> u64 {
        env.broker()
            .locks
            .lease_table("", false, "", 100, false)
            .await
            .unwrap()
            .total
    }
    assert_eq!(
        leases(&env).await,
        1,
        "a lease nobody knows, on a row that is gone"
    );
    async fn rows(env: &Env) -> i64 {
        env.db
            .query_one("SELECT count(*) FROM core_appstatus", &[])
            .await
            .unwrap()
            .get(0)
    }
    assert_eq!(rows(&env).await, 0, "the failed call removed its row");

    let lease = env.client.open_lease(request).await.unwrap().into_inner();
    assert_ne!(lease.lease_id, unseen.lease_id);
    assert_eq!(rows(&env).await, 1);
    let row: uuid::Uuid = lease.app_status_id.parse().unwrap();
    let task = env.task(&["a"]).await;
    let t = env.fetch(&lease.lease_id).await.expect("the lease works");
    assert_eq!(id(&t), task);
    assert_eq!(env.app_lock(task).await, Some(row));
    assert_eq!(leases(&env).await, 1, "the lease without a row was ended");
    env.shutdown().await;
}

#[tokio::test]
async fn a_pulp_worker_can_bring_its_own_app_status_row() {
    let mut env = Env::new().await;
    let own = env.app_status("worker", "pulp-worker").await;
    let lease = env
        .client
        .open_lease(OpenLeaseRequest {
            app_status_id: own.to_string(),
            ..lease_request("pulp-worker")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(lease.app_status_id, own.to_string());
    let task = env.task(&["a"]).await;
    let t = env.fetch(&lease.lease_id).await.unwrap();
    assert_eq!(env.app_lock(task).await, Some(own));
    env.finish(&lease.lease_id, &t, "completed").await;
    env.client
        .close_lease(CloseLeaseRequest {
            lease_id: lease.lease_id,
        })
        .await
        .unwrap();
    let left: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM core_appstatus WHERE pulp_id = $1",
            &[&own],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 1, "the worker's own row is the worker's to remove");
    env.shutdown().await;
}

/// The distinct `last_heartbeat` values of `rows`.
async fn stamps(
    db: &tokio_postgres::Client,
    rows: &[uuid::Uuid],
) -> std::collections::BTreeSet<String> {
    db.query(
        "SELECT last_heartbeat::text FROM core_appstatus WHERE pulp_id = ANY($1)",
        &[&rows],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get::<_, String>(0))
    .collect()
}

/// Opens a lease with a 30 s TTL; its lease id and worker row.
async fn lease_and_row(env: &mut Env, name: &str) -> (String, uuid::Uuid) {
    let lease = env
        .client
        .open_lease(OpenLeaseRequest {
            worker_name: name.into(),
            versions: [("core".into(), "3.123.1".into())].into(),
            ttl: Some(prost_types::Duration {
                seconds: 30,
                nanos: 0,
            }),
            app_status_id: String::new(),
            open_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    (lease.lease_id, lease.app_status_id.parse().unwrap())
}

#[tokio::test]
async fn the_rows_of_leases_that_beat_are_written_together_and_only_theirs() {
    let mut env = Env::new().await;
    let mut beating = Vec::new();
    for i in 0..5 {
        beating.push(lease_and_row(&mut env, &format!("w{i}")).await);
    }
    let (_, silent) = lease_and_row(&mut env, "silent").await;
    let rows: Vec<uuid::Uuid> = beating.iter().map(|(_, r)| *r).collect();
    // Beats close together are written in one statement (one transaction's now()); a write that
    // fell between them would make two stamps, so up to three tries.
    let mut together = false;
    for _ in 0..3 {
        env.db
            .execute(
                "UPDATE core_appstatus SET last_heartbeat = '2000-01-01' WHERE pulp_id = ANY($1) OR pulp_id = $2",
                &[&rows, &silent],
            )
            .await
            .unwrap();
        for (lease, _) in &beating {
            env.client
                .heartbeat(HeartbeatRequest {
                    lease_id: lease.clone(),
                    ..Default::default()
                })
                .await
                .expect("alive");
        }
        let written = crate::support::eventually(Duration::from_secs(5), || async {
            !stamps(&env.db, &rows)
                .await
                .iter()
                .any(|s| s.starts_with("2000"))
        })
        .await;
        assert!(
            written.is_some(),
            "every beat's row is written within a second"
        );
        if stamps(&env.db, &rows).await.len() == 1 {
            together = true;
            break;
        }
    }
    assert!(together, "five beats were never written in one statement");
    let silent_stamp: String = env
        .db
        .query_one(
            "SELECT last_heartbeat::text FROM core_appstatus WHERE pulp_id = $1",
            &[&silent],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        silent_stamp.starts_with("2000"),
        "a lease that did not beat keeps its stamp: {silent_stamp}"
    );
    env.shutdown().await;
}

/// A grant whose answer never reached its worker stays held by the live lease. Heartbeats list
/// what the lease holds, with fencing tokens; handed back (`undelivered`) under its token by its
/// own lease, the task goes back to the queue although the grant started it, and its locks are
/// released. Handed back by another lease, or under another token, it is left alone.
#[tokio::test]
async fn a_grant_handed_back_as_undelivered_goes_back_to_the_queue() {
    let mut env = Env::new().await;
    let a = env.task(&["a"]).await;
    env.task(&["b"]).await;
    let lease = env.open("w").await;
    let other = env.open("v").await;
    let ta = env.fetch_started(&lease).await.expect("granted");
    let tb = env.fetch_started(&lease).await.expect("granted");
    assert_eq!(id(&ta), a);
    let beat = |lease: &str, back: Vec<HeldTask>| HeartbeatRequest {
        lease_id: lease.to_owned(),
        undelivered: back,
    };
    let listed = env
        .client
        .heartbeat(beat(&lease, vec![]))
        .await
        .unwrap()
        .into_inner()
        .held_tasks;
    let mut listed: Vec<(String, u64)> = listed
        .into_iter()
        .map(|h| (h.task_id, h.fencing_token))
        .collect();
    listed.sort();
    let mut expected = vec![
        (ta.task_id.clone(), ta.fencing_token),
        (tb.task_id.clone(), tb.fencing_token),
    ];
    expected.sort();
    assert_eq!(listed, expected, "the heartbeat lists what the lease holds");
    let a_back = |token: u64| HeldTask {
        task_id: ta.task_id.clone(),
        fencing_token: token,
    };
    // Another lease's word, or another token: nothing changes.
    env.client
        .heartbeat(beat(&other, vec![a_back(ta.fencing_token)]))
        .await
        .unwrap();
    env.client
        .heartbeat(beat(&lease, vec![a_back(ta.fencing_token + 1000)]))
        .await
        .unwrap();
    env.settled_stats().await;
    assert_eq!(env.state(a).await, "running");
    env.assert_locks(&[&ta, &tb]).await;
    // Its own lease, under its token: back in the queue, its locks released.
    env.client
        .heartbeat(beat(&lease, vec![a_back(ta.fencing_token)]))
        .await
        .unwrap();
    env.settled_stats().await;
    assert_eq!(env.state(a).await, "waiting");
    assert_eq!(env.app_lock(a).await, None);
    env.assert_locks(&[&tb]).await;
    let again = env.fetch(&other).await.expect("the task is ready again");
    assert_eq!(id(&again), a);
    let listed = env
        .client
        .heartbeat(beat(&lease, vec![]))
        .await
        .unwrap()
        .into_inner()
        .held_tasks;
    assert_eq!(listed.len(), 1, "the lease holds b only");
    assert_eq!(listed[0].task_id, tb.task_id);
    env.shutdown().await;
}

/// A lease whose `core_appstatus` row was deleted outside the broker (here as pulpcore's own
/// workers' clean-up of missing processes does it: the tasks' claims cleared, as Django's SET_NULL
/// does, and the row deleted, in one transaction) is ended at its next beat's write, as the
/// sweeper ends an expired lease: its running task fails ("Worker has gone missing."), its locks
/// are released, its worker hears NOT_FOUND and opens a new lease. Before, such a lease lived on,
/// and every claim for it broke the foreign key. Another lease is left alone.
#[tokio::test]
async fn a_lease_whose_row_was_deleted_is_ended_at_its_next_beat() {
    let mut env = Env::new().await;
    let a = env.task(&["a"]).await;
    let b = env.task(&["b"]).await;
    let (gone, gone_row) = lease_and_row(&mut env, "gone").await;
    let (kept, kept_row) = lease_and_row(&mut env, "kept").await;
    let ta = env.fetch(&gone).await.unwrap();
    env.start(&gone, &ta).await;
    let tb = env.fetch(&kept).await.unwrap();
    assert_eq!((id(&ta), id(&tb)), (a, b));
    env.db
        .batch_execute(&format!(
            "BEGIN; \
             UPDATE core_task SET app_lock_id = NULL WHERE app_lock_id = '{gone_row}'; \
             DELETE FROM core_appstatus WHERE pulp_id = '{gone_row}'; \
             COMMIT"
        ))
        .await
        .unwrap();
    let client = env.client.clone();
    let beat = move |lease: String| {
        let mut client = client.clone();
        async move {
            client
                .heartbeat(HeartbeatRequest {
                    lease_id: lease,
                    ..Default::default()
                })
                .await
        }
    };
    // Redis still knows the lease, so this beat is answered; its row's write finds no row.
    beat(gone.clone())
        .await
        .expect("the lease is alive in Redis");
    let ended = crate::support::eventually(Duration::from_secs(10), || async {
        matches!(beat(gone.clone()).await, Err(s) if s.code() == tonic::Code::NotFound)
    })
    .await;
    assert!(ended.is_some(), "the lease without a row was never ended");
    let fetched = env.try_fetch(&gone, &[]).await.unwrap_err();
    assert_eq!(fetched.code(), tonic::Code::NotFound);
    // The lease is expired first (so NOT_FOUND), its tasks ended and its locks released next.
    let released = crate::support::eventually(Duration::from_secs(5), || async {
        env.locked_tasks().await.len() == 1
    })
    .await;
    assert!(
        released.is_some(),
        "the ended lease's lock was not released"
    );
    env.assert_locks(&[&tb]).await;
    assert_eq!(env.state(a).await, "failed");
    assert_eq!(env.error_of(a).await["reason"], "Worker has gone missing.");
    assert_eq!(
        env.state(b).await,
        "waiting",
        "the other lease's claim stands"
    );
    assert_eq!(env.app_lock(b).await, Some(kept_row));
    // The other lease beats on, and its row is written.
    env.db
        .execute(
            "UPDATE core_appstatus SET last_heartbeat = '2000-01-01' WHERE pulp_id = $1",
            &[&kept_row],
        )
        .await
        .unwrap();
    beat(kept.clone()).await.expect("the other lease is alive");
    let written = crate::support::eventually(Duration::from_secs(5), || async {
        !stamps(&env.db, &[kept_row])
            .await
            .iter()
            .any(|s| s.starts_with("2000"))
    })
    .await;
    assert!(written.is_some(), "the other lease's row is still written");
    env.shutdown().await;
}

/// A claim that breaks the foreign key (the lease's `core_appstatus` row was deleted outside the
/// broker) ends the lease at once, with no heartbeat needed: the fetch hears NOT_FOUND, and the
/// task is left waiting and unlocked for the next worker. Before, the fetch failed with Postgres'
/// error, and every later pass for the lease locked, claimed and released again.
#[tokio::test]
async fn a_claim_that_finds_the_leases_row_gone_ends_the_lease() {
    let mut env = Env::new().await;
    let a = env.task(&["a"]).await;
    let (lease, row) = lease_and_row(&mut env, "gone").await;
    env.db
        .execute("DELETE FROM core_appstatus WHERE pulp_id = $1", &[&row])
        .await
        .unwrap();
    let fetched = env.try_fetch(&lease, &[]).await.unwrap_err();
    assert_eq!(fetched.code(), tonic::Code::NotFound, "{fetched:?}");
    let lease_id = dispatch_broker::ids::LeaseId(lease.parse().unwrap());
    let ended = crate::support::eventually(Duration::from_secs(5), || async {
        env.broker().locks.lease(lease_id).await.unwrap().is_none()
    })
    .await;
    assert!(ended.is_some(), "the lease was not ended");
    env.assert_locks(&[]).await;
    assert_eq!(env.state(a).await, "waiting");
    assert_eq!(env.app_lock(a).await, None);
    let next = env.open("next").await;
    assert_eq!(id(&env.fetch(&next).await.unwrap()), a);
    env.shutdown().await;
}

/// Two leases on one worker's own row (a worker that reopened under it while its old lease still
/// lived) that beat together: when the row is deleted, the write that does not find it ends both.
#[tokio::test]
async fn every_lease_that_beat_with_a_deleted_row_is_ended() {
    let mut env = Env::new().await;
    let own = env.app_status("worker", "pulp-worker").await;
    let mut leases = Vec::new();
    for _ in 0..2 {
        leases.push(
            env.client
                .open_lease(OpenLeaseRequest {
                    app_status_id: own.to_string(),
                    ..lease_request("pulp-worker")
                })
                .await
                .unwrap()
                .into_inner()
                .lease_id,
        );
    }
    env.db
        .execute("DELETE FROM core_appstatus WHERE pulp_id = $1", &[&own])
        .await
        .unwrap();
    for lease in &leases {
        env.client
            .heartbeat(HeartbeatRequest {
                lease_id: lease.clone(),
                ..Default::default()
            })
            .await
            .expect("alive in Redis until the write");
    }
    for lease in leases {
        let id = dispatch_broker::ids::LeaseId(lease.parse().unwrap());
        let ended = crate::support::eventually(Duration::from_secs(5), || async {
            env.broker().locks.lease(id).await.unwrap().is_none()
        })
        .await;
        assert!(ended.is_some(), "lease {lease} was not ended");
    }
    env.shutdown().await;
}
