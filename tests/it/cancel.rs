//! CancelTask in each state.

use crate::support;

use crate::support::{id, Env};

#[tokio::test]
async fn a_waiting_task_is_canceled_at_once() {
    let mut env = Env::new().await;
    let task = env.task(&["a"]).await;
    let r = env.cancel(task).await.unwrap();
    assert_eq!((r.state.as_str(), r.holder_notified), ("canceled", false));
    assert_eq!(env.state(task).await, "canceled");
    let lease = env.open("w").await;
    assert!(env.fetch(&lease).await.is_none());
    env.shutdown().await;
}

#[tokio::test]
async fn a_claimed_task_that_has_not_started_is_canceled_and_its_locks_released() {
    let mut env = Env::new().await;
    let task = env.task(&["a", "shared:d"]).await;
    let next = env.task(&["a"]).await;
    let lease = env.open("w").await;
    let t = env.fetch(&lease).await.unwrap();
    let r = env.cancel(task).await.unwrap();
    assert_eq!((r.state.as_str(), r.holder_notified), ("canceled", false));
    env.assert_locks(&[]).await;
    // The former holder can neither start it nor release anything now.
    let mut c = env.client.clone();
    let start = c
        .start_task(dispatch_broker::proto::StartTaskRequest {
            lease_id: lease.clone(),
            task_id: t.task_id.clone(),
            fencing_token: t.fencing_token,
        })
        .await
        .unwrap_err();
    assert_eq!(start.code(), tonic::Code::FailedPrecondition);
    assert!(!env.release(&lease, &t).await.unwrap());
    let other = env.open("other").await;
    assert_eq!(id(&env.fetch(&other).await.unwrap()), next);
    env.shutdown().await;
}

#[tokio::test]
async fn a_running_task_becomes_canceling_and_a_final_task_is_unchanged() {
    let mut env = Env::new().await;
    let task = env.task(&["a"]).await;
    let lease = env.open("w").await;
    let t = env.fetch(&lease).await.unwrap();
    env.start(&lease, &t).await;
    let r = env.cancel(task).await.unwrap();
    assert_eq!((r.state.as_str(), r.holder_notified), ("canceling", true));
    let again = env.cancel(task).await.unwrap();
    assert_eq!(again.state, "canceling", "canceling twice changes nothing");
    env.assert_locks(&[&t]).await;
    env.finish(&lease, &t, "canceled").await;
    let done = env.cancel(task).await.unwrap();
    assert_eq!(
        (done.state.as_str(), done.holder_notified),
        ("canceled", false)
    );
    env.assert_locks(&[]).await;

    let finished = env.task(&["b"]).await;
    env.set_state(finished, "completed").await;
    let r = env.cancel(finished).await.unwrap();
    assert_eq!(r.state, "completed");
    env.shutdown().await;
}

/// Pulp's own cancel API marks a waiting task `canceling` and leaves it to a worker; the broker
/// finishes it as `canceled`, so it stops reserving its resources.
#[tokio::test]
async fn a_task_canceled_through_pulp_while_waiting_is_finished_and_frees_the_queue() {
    let mut env = Env::with(|a| a.sweep_interval = std::time::Duration::from_millis(200)).await;
    let canceled = env.task(&["a"]).await;
    let behind = env.task(&["a"]).await;
    env.set_state(canceled, "canceling").await;
    let lease = env.open("w").await;
    let env_ref = &env;
    support::eventually(std::time::Duration::from_secs(10), || async {
        env_ref.state(canceled).await == "canceled"
    })
    .await
    .expect("finished as canceled");
    let t = env
        .fetch(&lease)
        .await
        .expect("the task behind it is ready");
    assert_eq!(id(&t), behind);
    env.assert_locks(&[&t]).await;
    env.shutdown().await;
}
