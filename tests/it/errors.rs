//! Every error status a client can get, each with a message a person can act on, and each
//! changing nothing.

use crate::support;

use std::time::Duration;

use crate::support::Env;
use dispatch_broker::proto::*;
use tonic::Code;

fn expect_code<T: std::fmt::Debug>(result: Result<T, tonic::Status>, code: Code, words: &str) {
    let status = result.expect_err("the call must fail");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(words),
        "message {:?} should mention {words:?}",
        status.message()
    );
}

#[tokio::test]
async fn unknown_lease_is_not_found_everywhere() {
    let mut env = Env::new().await;
    let task = env.task(&["a"]).await;
    let unknown = uuid::Uuid::new_v4().to_string();
    expect_code(
        env.try_fetch(&unknown, &[]).await,
        Code::NotFound,
        "open a new lease",
    );
    expect_code(
        env.claim(&unknown, task).await,
        Code::NotFound,
        "unknown or expired",
    );
    let mut c = env.client.clone();
    expect_code(
        c.heartbeat(HeartbeatRequest {
            lease_id: unknown.clone(),
            ..Default::default()
        })
        .await,
        Code::NotFound,
        "unknown or expired",
    );
    expect_code(
        c.close_lease(CloseLeaseRequest {
            lease_id: unknown.clone(),
        })
        .await,
        Code::NotFound,
        "unknown or expired",
    );
    assert_eq!(env.app_lock(task).await, None);
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

#[tokio::test]
async fn expired_lease_is_not_found_and_must_be_reopened() {
    let mut env = Env::new().await;
    let task = env.task(&["a"]).await;
    let lease = env
        .open_with("w", &[], Some(Duration::from_millis(300)))
        .await;
    tokio::time::sleep(Duration::from_millis(450)).await;
    let mut c = env.client.clone();
    expect_code(
        c.heartbeat(HeartbeatRequest {
            lease_id: lease.clone(),
            ..Default::default()
        })
        .await,
        Code::NotFound,
        "open a new lease",
    );
    expect_code(
        env.try_fetch(&lease, &[]).await,
        Code::NotFound,
        "unknown or expired",
    );
    expect_code(
        env.claim(&lease, task).await,
        Code::NotFound,
        "unknown or expired",
    );
    assert_eq!(env.app_lock(task).await, None);
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

#[tokio::test]
async fn empty_and_malformed_ids_are_invalid_arguments() {
    let mut env = Env::new().await;
    let lease = env.open("w").await;
    expect_code(
        env.try_fetch("", &[]).await,
        Code::InvalidArgument,
        "lease_id is required",
    );
    expect_code(
        env.try_fetch("not-a-uuid", &[]).await,
        Code::InvalidArgument,
        "is not a UUID",
    );
    let mut c = env.client.clone();
    expect_code(
        c.fetch_task(FetchTaskRequest {
            lease_id: lease.clone(),
            wait: None,
            skip_task_ids: vec!["x".into()],
            start: false,
        })
        .await,
        Code::InvalidArgument,
        "skip_task_ids",
    );
    expect_code(
        c.fetch_task(FetchTaskRequest {
            lease_id: lease.clone(),
            wait: Some(prost_types::Duration {
                seconds: -1,
                nanos: 0,
            }),
            skip_task_ids: vec![],
            start: false,
        })
        .await,
        Code::InvalidArgument,
        "wait must be a non-negative duration",
    );
    expect_code(
        c.claim_task(ClaimTaskRequest {
            lease_id: lease.clone(),
            task_id: String::new(),
        })
        .await,
        Code::InvalidArgument,
        "task_id is required",
    );
    expect_code(
        c.cancel_task(CancelTaskRequest {
            task_id: "42".into(),
        })
        .await,
        Code::InvalidArgument,
        "is not a UUID",
    );
    expect_code(
        c.release_locks(ReleaseLocksRequest {
            lease_id: lease.clone(),
            task_id: uuid::Uuid::new_v4().to_string(),
            fencing_token: 0,
        })
        .await,
        Code::InvalidArgument,
        "fencing_token is required",
    );
    env.shutdown().await;
}

#[tokio::test]
async fn bad_open_lease_requests_are_invalid_arguments() {
    let env = Env::new().await;
    let mut c = env.client.clone();
    let base = support::lease_request("w");
    expect_code(
        c.open_lease(OpenLeaseRequest {
            worker_name: " ".into(),
            ..base.clone()
        })
        .await,
        Code::InvalidArgument,
        "worker_name is required",
    );
    expect_code(
        c.open_lease(OpenLeaseRequest {
            versions: [("core".into(), "latest".into())].into(),
            ..base.clone()
        })
        .await,
        Code::InvalidArgument,
        "not a dotted release number",
    );
    expect_code(
        c.open_lease(OpenLeaseRequest {
            ttl: Some(prost_types::Duration {
                seconds: 0,
                nanos: 1_000_000,
            }),
            ..base.clone()
        })
        .await,
        Code::InvalidArgument,
        "outside the accepted range",
    );
    expect_code(
        c.open_lease(OpenLeaseRequest {
            app_status_id: "nope".into(),
            ..base.clone()
        })
        .await,
        Code::InvalidArgument,
        "app_status_id",
    );
    expect_code(
        c.open_lease(OpenLeaseRequest {
            app_status_id: uuid::Uuid::new_v4().to_string(),
            ..base.clone()
        })
        .await,
        Code::NotFound,
        "core_appstatus row",
    );
    let rows: i64 = env
        .db
        .query_one("SELECT count(*) FROM core_appstatus", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "a refused OpenLease wrote a core_appstatus row");
    env.shutdown().await;
}

#[tokio::test]
async fn unknown_task_is_not_found() {
    let mut env = Env::new().await;
    let lease = env.open("w").await;
    let unknown = uuid::Uuid::new_v4();
    expect_code(
        env.claim(&lease, unknown).await,
        Code::NotFound,
        "does not exist",
    );
    expect_code(env.cancel(unknown).await, Code::NotFound, "does not exist");
    env.shutdown().await;
}

#[tokio::test]
async fn wrong_lease_or_stale_token_is_a_failed_precondition_and_releases_nothing() {
    let mut env = Env::new().await;
    env.task(&["a", "shared:d"]).await;
    let holder = env.open("holder").await;
    let other = env.open("other").await;
    let task = env.fetch(&holder).await.unwrap();
    expect_code(
        env.release(&other, &task).await,
        Code::FailedPrecondition,
        "does not hold",
    );
    let stale = Task {
        fencing_token: task.fencing_token + 100,
        ..task.clone()
    };
    expect_code(
        env.release(&holder, &stale).await,
        Code::FailedPrecondition,
        "stale",
    );
    let mut c = env.client.clone();
    expect_code(
        c.start_task(StartTaskRequest {
            lease_id: other.clone(),
            task_id: task.task_id.clone(),
            fencing_token: task.fencing_token,
        })
        .await,
        Code::FailedPrecondition,
        "does not hold",
    );
    expect_code(
        c.finish_task(FinishTaskRequest {
            lease_id: holder.clone(),
            task_id: task.task_id.clone(),
            fencing_token: stale.fencing_token,
            state: "completed".into(),
            error: String::new(),
        })
        .await,
        Code::FailedPrecondition,
        "stale",
    );
    expect_code(
        c.finish_task(FinishTaskRequest {
            lease_id: holder.clone(),
            task_id: task.task_id.clone(),
            fencing_token: task.fencing_token,
            state: "done".into(),
            error: String::new(),
        })
        .await,
        Code::InvalidArgument,
        "not a final state",
    );
    env.assert_locks(&[&task]).await;
    assert_eq!(env.state(support::id(&task)).await, "waiting");
    // The holder still releases; a second release is not an error.
    assert!(env.release(&holder, &task).await.unwrap());
    assert!(!env.release(&holder, &task).await.unwrap());
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

/// FinishTask calls that arrive together share their round trips (`src/batch.rs`), but each keeps
/// its own answer: a stale token or another lease's call is refused and changes nothing, while
/// the calls around it in the same batch finish their tasks and release their locks.
#[tokio::test]
async fn finishes_arriving_together_each_keep_their_own_answer() {
    let mut env = Env::new().await;
    let mut held = Vec::new();
    for n in 0..8 {
        env.task(&[&format!("r{n}"), "shared:d"]).await;
        let lease = env.open(&format!("w{n}")).await;
        let task = env.fetch(&lease).await.expect("a task for each lease");
        held.push((lease, task));
    }
    let calls = held.iter().enumerate().map(|(n, (lease, task))| {
        let mut c = env.client.clone();
        let request = FinishTaskRequest {
            // The second names the first's lease, the third a stale token; the rest are right.
            lease_id: if n == 1 {
                held[0].0.clone()
            } else {
                lease.clone()
            },
            task_id: task.task_id.clone(),
            fencing_token: task.fencing_token + u64::from(n == 2) * 100,
            state: if n % 2 == 0 { "completed" } else { "failed" }.into(),
            error: if n % 2 == 0 {
                String::new()
            } else {
                format!("error {n}")
            },
        };
        async move { c.finish_task(request).await }
    });
    let answers = futures::future::join_all(calls).await;
    for (n, answer) in answers.into_iter().enumerate() {
        match n {
            1 => expect_code(answer, Code::FailedPrecondition, "does not hold"),
            2 => expect_code(answer, Code::FailedPrecondition, "stale"),
            _ => {
                let answer = answer.expect("finished").into_inner();
                let state = if n % 2 == 0 { "completed" } else { "failed" };
                assert_eq!(answer.state, state, "task {n}");
                assert!(answer.released, "task {n}");
            }
        }
    }
    // Only the two refused calls' tasks stay claimed and locked.
    env.assert_locks(&[&held[1].1, &held[2].1]).await;
    for (n, (_, task)) in held.iter().enumerate() {
        let (state, error): (String, Option<serde_json::Value>) = {
            let row = env
                .db
                .query_one(
                    "SELECT state, error FROM core_task WHERE pulp_id = $1",
                    &[&support::id(task)],
                )
                .await
                .unwrap();
            (row.get(0), row.get(1))
        };
        match n {
            1 | 2 => assert_eq!(state, "waiting", "task {n} is untouched"),
            _ if n % 2 == 0 => assert_eq!((state.as_str(), error), ("completed", None)),
            _ => assert_eq!(
                (state.as_str(), error),
                (
                    "failed",
                    Some(serde_json::json!({ "reason": format!("error {n}") }))
                )
            ),
        }
    }
    env.shutdown().await;
}

/// When Postgres refuses a batch's final-state statement because of one call's task (here a
/// trigger of the test's refuses it), the batch is retried call by call: that call fails and
/// keeps its task and locks, every other call of the batch finishes and releases.
#[tokio::test]
async fn a_finish_batch_postgres_refuses_is_retried_call_by_call() {
    let mut env = Env::new().await;
    let mut held = Vec::new();
    for n in 0..8 {
        env.task(&[&format!("r{n}")]).await;
        let lease = env.open(&format!("w{n}")).await;
        let task = env.fetch(&lease).await.expect("a task for each lease");
        held.push((lease, task));
    }
    let refused = support::id(&held[5].1);
    env.db
        .batch_execute(&format!(
            "CREATE FUNCTION refuse_finish() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN IF NEW.pulp_id = '{refused}' AND NEW.state <> OLD.state THEN \
               RAISE EXCEPTION 'refused by the test'; END IF; RETURN NEW; END $$; \
             CREATE TRIGGER refuse_finish BEFORE UPDATE ON core_task \
             FOR EACH ROW EXECUTE FUNCTION refuse_finish();"
        ))
        .await
        .unwrap();
    let finish = |n: usize| {
        let mut c = env.client.clone();
        let (lease, task) = &held[n];
        let request = support::finish_request(lease.clone(), task, "completed");
        tokio::spawn(async move { c.finish_task(request).await })
    };
    // With Redis paused the first two calls' batches stay in flight (their holder checks wait),
    // so the other six gather into one batch, the refused call among them.
    env.redis.pause();
    let mut calls = vec![finish(0), finish(1)];
    tokio::time::sleep(Duration::from_millis(200)).await;
    calls.extend((2..8).map(finish));
    tokio::time::sleep(Duration::from_millis(200)).await;
    env.redis.resume();
    for (n, call) in calls.into_iter().enumerate() {
        let answer = call.await.unwrap();
        if n == 5 {
            let status = answer.expect_err("the refused call fails");
            assert!(
                status.message().contains("refused by the test"),
                "{status:?}"
            );
        } else {
            let answer = answer.expect("finished").into_inner();
            assert_eq!(answer.state, "completed", "task {n}");
            assert!(answer.released, "task {n}");
        }
    }
    assert_eq!(
        env.state(refused).await,
        "waiting",
        "the refused task is untouched"
    );
    env.assert_locks(&[&held[5].1]).await;
    env.shutdown().await;
}

/// A FinishTask whose task row another transaction holds (Pulp canceling it, say) waits for the
/// row on its own: the FinishTask calls after it are not held up behind it.
#[tokio::test]
async fn a_finish_waiting_on_a_row_lock_holds_up_no_other_finish() {
    let mut env = Env::new().await;
    env.task(&["a"]).await;
    env.task(&["b"]).await;
    let first = env.open("first").await;
    let second = env.open("second").await;
    let a = env.fetch(&first).await.expect("a");
    let b = env.fetch(&second).await.expect("b");
    let blocker = support::RowLock::take(&env.db_url, support::id(&a)).await;
    let waiting = {
        let mut c = env.client.clone();
        let request = support::finish_request(first.clone(), &a, "completed");
        tokio::spawn(async move { c.finish_task(request).await })
    };
    // The first finish waits on the row lock.
    support::sessions_wait_on_locks(&env, 1).await;
    let done = tokio::time::timeout(
        Duration::from_secs(20),
        env.finish(&second, &b, "completed"),
    )
    .await
    .expect("the second finish is not held up");
    assert_eq!(done.state, "completed");
    assert!(!waiting.is_finished(), "the first still waits for its row");
    blocker.commit().await;
    let first_done = waiting.await.unwrap().expect("finished").into_inner();
    assert_eq!(first_done.state, "completed");
    assert!(first_done.released);
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

/// A FinishTask retried after it finished the task (its answer lost with a replica or a
/// connection) is answered with the task's state and changes nothing. Another lease, or the
/// holder with another token, is still refused.
#[tokio::test]
async fn a_retried_finish_answers_the_tasks_state_and_changes_nothing() {
    let mut env = Env::new().await;
    env.task(&["a"]).await;
    let holder = env.open("holder").await;
    let other = env.open("other").await;
    let task = env.fetch(&holder).await.expect("a task");
    let first = env.finish(&holder, &task, "completed").await;
    assert_eq!((first.state.as_str(), first.released), ("completed", true));
    let finish = |lease: &str, state: &str, token: u64| FinishTaskRequest {
        lease_id: lease.into(),
        task_id: task.task_id.clone(),
        fencing_token: token,
        state: state.into(),
        error: "late".into(),
    };
    let mut c = env.client.clone();
    for state in ["completed", "failed"] {
        let again = c
            .finish_task(finish(&holder, state, task.fencing_token))
            .await
            .expect("a retry is answered")
            .into_inner();
        assert_eq!((again.state.as_str(), again.released), ("completed", false));
    }
    expect_code(
        c.finish_task(finish(&other, "failed", task.fencing_token))
            .await,
        Code::FailedPrecondition,
        "does not hold",
    );
    expect_code(
        c.finish_task(finish(&holder, "failed", task.fencing_token + 100))
            .await,
        Code::FailedPrecondition,
        "does not hold",
    );
    let row = env
        .db
        .query_one(
            "SELECT state, error FROM core_task WHERE pulp_id = $1",
            &[&support::id(&task)],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "completed");
    assert_eq!(row.get::<_, Option<serde_json::Value>>(1), None);
    // An unknown lease is still told so.
    expect_code(
        c.finish_task(finish(&uuid::Uuid::new_v4().to_string(), "failed", 1))
            .await,
        Code::NotFound,
        "open a new lease",
    );
    env.assert_locks(&[]).await;
    env.shutdown().await;
}
