//! The operator's view (`dispatch.v1.Admin` and the CLI), black-box over gRPC against real
//! Postgres and Redis: every reason a task waits, the hol-blocking incident at a glance, the
//! audited revoke and force-release (and their refusals, which change nothing), paging, and the
//! admin credential.

use crate::support;

use std::time::Duration;

use crate::support::{eventually, id, Env};
use dispatch_broker::ids::{FencingToken, LeaseId, TaskId};
use dispatch_broker::proto::admin_client::AdminClient;
use dispatch_broker::proto::*;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::Code;
use uuid::Uuid;

const ADMIN: &str = "admin-token-for-the-test";
const WORKER: &str = "worker-token-for-the-test";

type Admin = AdminClient<
    tonic::service::interceptor::InterceptedService<
        Channel,
        Box<dyn FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Send>,
    >,
>;

async fn admin_with(env: &Env, token: Option<&str>) -> Admin {
    let channel = Channel::from_shared(format!("http://{}", env.broker().addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let header: Option<MetadataValue<_>> = token.map(|t| format!("Bearer {t}").parse().unwrap());
    AdminClient::with_interceptor(
        channel,
        Box::new(move |mut r: tonic::Request<()>| {
            if let Some(h) = &header {
                r.metadata_mut().insert("authorization", h.clone());
            }
            Ok(r)
        }),
    )
}

/// A broker with no authentication: the admin API is open.
/// A worker API client of `env`'s broker that sends `token` as its bearer token.
async fn broker_with(
    env: &Env,
    token: &str,
) -> dispatch_broker::proto::broker_client::BrokerClient<
    tonic::service::interceptor::InterceptedService<
        Channel,
        impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status>,
    >,
> {
    let channel = Channel::from_shared(format!("http://{}", env.broker().addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let header: MetadataValue<_> = format!("Bearer {token}").parse().unwrap();
    dispatch_broker::proto::broker_client::BrokerClient::with_interceptor(
        channel,
        move |mut r: tonic::Request<()>| {
            r.metadata_mut().insert("authorization", header.clone());
            Ok(r)
        },
    )
}

async fn admin(env: &Env) -> Admin {
    admin_with(env, None).await
}

async fn explain(admin: &mut Admin, task: Uuid) -> Explanation {
    admin
        .explain_task(ExplainTaskRequest {
            task_id: task.to_string(),
            max_conflicts: 0,
        })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test]
async fn an_older_conflicting_task_is_named_with_the_resource_and_both_modes() {
    let mut env = Env::new().await;
    let t1 = env.task_with(&["A", "shared:dom"], "sync", &[]).await;
    let t2 = env.task(&["shared:A"]).await;
    let mut admin = admin(&env).await;
    let _lease = env.open("w1").await;

    let e = explain(&mut admin, t2).await;
    assert_eq!(e.state, "waiting");
    assert!(!e.ready);
    assert_eq!(e.older_conflicts_total, 1);
    let older = &e.older_conflicts[0];
    assert_eq!(older.task_id, t1.to_string());
    assert_eq!(
        (older.state.as_str(), older.name.as_str()),
        ("waiting", "sync")
    );
    assert_eq!(
        older.conflicts,
        vec![ResourceConflict {
            resource: "A".into(),
            wanted: "shared".into(),
            held: "exclusive".into()
        }]
    );
    // The one line names the first blocker: the older task and where it conflicts.
    assert!(
        e.summary.contains(&format!(
            "waiting behind 1 older conflicting task (the oldest: task {t1}, waiting on A)"
        )),
        "{}",
        e.summary
    );

    let head = explain(&mut admin, t1).await;
    assert!(head.ready, "{head:?}");
    assert_eq!(head.older_conflicts_total, 0);
    assert_eq!(head.live_leases, 1);
    assert!(head.summary.starts_with("ready"), "{}", head.summary);
}

#[tokio::test]
async fn a_held_exclusive_lock_is_named_with_its_lease_worker_and_token() {
    let mut env = Env::new().await;
    let t1 = env.task(&["A"]).await;
    let lease = env.open("worker-one").await;
    let granted = env.fetch(&lease).await.unwrap();
    assert_eq!(id(&granted), t1);
    let t2 = env.task(&["A"]).await;
    let mut admin = admin(&env).await;

    let e = explain(&mut admin, t2).await;
    assert!(!e.ready);
    assert_eq!(e.conflicting_locks.len(), 1);
    let lock = &e.conflicting_locks[0];
    assert_eq!(
        (lock.resource.as_str(), lock.mode.as_str()),
        ("A", "exclusive")
    );
    let holder = &lock.holders[0];
    assert_eq!(holder.task_id, t1.to_string());
    assert_eq!(holder.lease_id, lease);
    assert_eq!(holder.worker_name, "worker-one");
    assert_eq!(holder.fencing_token, granted.fencing_token);
    assert!(holder.lease_alive && holder.lease_expires_at.is_some());
    // The one line names the first blocker: the lock, its task and its holder.
    assert!(
        e.summary.contains(&format!(
            "1 held lock conflicts (A held exclusive for task {t1} by worker worker-one (lease \
             {lease}, fencing token {}, alive until",
            granted.fencing_token
        )),
        "{}",
        e.summary
    );

    // The holder's own explanation names its holder.
    let held = explain(&mut admin, t1).await;
    assert_eq!(held.holder.as_ref().unwrap().lease_id, lease);
    assert!(held.summary.starts_with("claimed"), "{}", held.summary);
    env.start(&lease, &granted).await;
    let running = explain(&mut admin, t1).await;
    assert!(
        running.summary.starts_with("running on worker worker-one"),
        "{}",
        running.summary
    );
}

#[tokio::test]
async fn shared_locks_against_an_exclusive_request_list_every_holder_oldest_first() {
    let mut env = Env::new().await;
    env.task(&["shared:A"]).await;
    env.task(&["shared:A"]).await;
    let (l1, l2) = (env.open("w1").await, env.open("w2").await);
    let g1 = env.fetch(&l1).await.unwrap();
    let g2 = env.fetch(&l2).await.unwrap();
    let t3 = env.task(&["A"]).await;
    let mut admin = admin(&env).await;

    let e = explain(&mut admin, t3).await;
    assert_eq!(e.older_conflicts_total, 2);
    assert_eq!(e.conflicting_locks.len(), 1);
    let lock = &e.conflicting_locks[0];
    assert_eq!(lock.mode, "shared");
    let tokens: Vec<u64> = lock.holders.iter().map(|h| h.fencing_token).collect();
    assert_eq!(tokens, vec![g1.fencing_token, g2.fencing_token]);
    assert!(e.summary.contains("2 held locks conflict"), "{}", e.summary);
}

#[tokio::test]
async fn versions_no_live_lease_satisfies_are_a_reason_of_their_own() {
    let mut env = Env::new().await;
    let task = env.task_with(&["A"], "t", &[("core", "3.200")]).await;
    let mut admin = admin(&env).await;

    let alone = explain(&mut admin, task).await;
    assert!(alone.ready);
    assert_eq!(alone.live_leases, 0);
    assert!(
        alone.summary.contains("no worker is connected"),
        "{}",
        alone.summary
    );

    let _old = env.open("old-worker").await; // core 3.123.1
    let e = explain(&mut admin, task).await;
    assert!(e.ready, "ready by the rule");
    assert!(e.incompatible_with_every_live_lease);
    assert!(
        e.summary.contains("no live worker's versions satisfy it"),
        "{}",
        e.summary
    );
    assert_eq!(e.versions.get("core").map(String::as_str), Some("3.200"));

    env.open_with("new-worker", &[("core", "3.201")], None)
        .await;
    let e = explain(&mut admin, task).await;
    assert!(!e.incompatible_with_every_live_lease);
    assert!(e.summary.starts_with("ready: "), "{}", e.summary);
}

#[tokio::test]
async fn a_hidden_older_task_keeps_its_other_resources_t1_ab_t2_b() {
    // DESIGN.md's pitfall: A is locked; T1 needs A and B; T2 (newer) needs only B and is NOT
    // ready, because T1 reserves B even though it cannot run.
    let mut env = Env::new().await;
    env.task(&["A"]).await;
    let lease = env.open("w").await;
    let _running = env.fetch(&lease).await.unwrap();
    let t1 = env.task(&["A", "B"]).await;
    let t2 = env.task(&["B"]).await;
    let mut admin = admin(&env).await;

    let e2 = explain(&mut admin, t2).await;
    assert!(!e2.ready);
    assert!(e2.conflicting_locks.is_empty(), "B itself is not locked");
    assert_eq!(e2.older_conflicts_total, 1);
    assert_eq!(e2.older_conflicts[0].task_id, t1.to_string());
    assert_eq!(e2.older_conflicts[0].conflicts[0].resource, "B");
    // And dispatch agrees: nothing is handed out.
    let other = env.open("w2").await;
    assert!(env.fetch(&other).await.is_none());

    let e1 = explain(&mut admin, t1).await;
    assert_eq!(e1.conflicting_locks[0].resource, "A");
    assert_eq!(e1.older_conflicts_total, 1);
}

#[tokio::test]
async fn final_and_unknown_tasks_are_answered_plainly() {
    let mut env = Env::new().await;
    let task = env.task(&["A"]).await;
    let lease = env.open("w").await;
    let g = env.fetch(&lease).await.unwrap();
    env.start(&lease, &g).await;
    env.finish(&lease, &g, "completed").await;
    let mut admin = admin(&env).await;
    let e = explain(&mut admin, task).await;
    assert_eq!(e.summary, "completed: finished, holds nothing");

    let unknown = admin
        .explain_task(ExplainTaskRequest {
            task_id: Uuid::new_v4().to_string(),
            max_conflicts: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    assert_eq!(
        unknown.metadata().get("dispatch-not-found").unwrap(),
        "task"
    );
    let bad = admin
        .explain_task(ExplainTaskRequest {
            task_id: "nope".into(),
            max_conflicts: 500,
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
}

/// The incident: R0's head runs, many tasks wait behind it, other domains flow.
async fn hol_blocking(env: &mut Env) -> (Uuid, String) {
    let head = env.task(&["R0", "shared:dom-a"]).await;
    env.tasks_bulk(40, &["R0", "shared:dom-a"]).await;
    for i in 1..=3 {
        env.task(&[&format!("R{i}"), "shared:dom-b"]).await;
    }
    env.task(&["R1"]).await;
    let lease = env.open("incident-worker").await;
    let g = env.fetch(&lease).await.unwrap();
    assert_eq!(id(&g), head);
    env.start(&lease, &g).await;
    env.broker().lanes.compute_now().await.unwrap();
    // The resource queues have read the tasks (as they have a second after they arrived).
    env.settle_queues().await;
    (head, lease)
}

/// BlockedResources on the incident of [`hol_blocking`], counted by `source`.
async fn incident_report(env: &mut Env, source: &str) {
    let (head, lease) = hol_blocking(env).await;
    let mut admin = admin(env).await;

    let report = admin
        .blocked_resources(BlockedResourcesRequest { limit: 5 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(report.source, source);
    let top = &report.resources[0];
    assert_eq!(top.resource, "R0");
    assert_eq!(top.waiting, 40);
    let explained = top.head.as_ref().unwrap();
    assert_eq!(explained.task_id, head.to_string());
    assert_eq!(explained.state, "running");
    assert_eq!(explained.holder.as_ref().unwrap().lease_id, lease);
    assert_eq!(report.resources[1].resource, "R1");
    assert_eq!(report.resources[1].waiting, 1);
    assert_eq!(
        report.resources.len(),
        2,
        "shared users of dom-a/dom-b do not wait"
    );
    assert!(report.age.is_some() && report.computed_at.is_some());
}

#[tokio::test]
async fn blocked_resources_show_the_head_of_line_blocking_resource_first() {
    let mut env = Env::with(|a| a.lanes.cutoff = Duration::ZERO).await;
    incident_report(&mut env, "resource_queues").await;
}

/// Without the resource queues, the lane gauge's last full pass counts them, the same way.
#[tokio::test]
async fn without_the_resource_queues_the_lane_gauge_counts_the_blocked_resources() {
    let mut env = Env::with(|a| {
        a.lanes.cutoff = Duration::ZERO;
        a.fetch.resource_queues = false;
    })
    .await;
    incident_report(&mut env, "lane_gauge").await;
}

/// Tasks that arrive after the lane gauge's last full pass show at once (the resource queues
/// read them within a second), not a full interval later: the full pass at start saw nothing.
#[tokio::test]
async fn blocked_resources_show_tasks_that_arrived_after_the_gauges_full_pass() {
    let env = Env::with(|a| {
        a.lanes.cutoff = Duration::ZERO;
        a.lanes.full_interval = Duration::from_secs(3600);
    })
    .await;
    env.broker().lanes.compute_now().await.unwrap();
    let (survey, _) = env.broker().lanes.survey().await.unwrap().unwrap();
    assert!(survey.is_empty(), "{survey:?}");
    let head = env.task(&["R0"]).await;
    env.tasks_bulk(30, &["R0"]).await;
    env.settle_queues().await;
    let mut admin = admin(&env).await;
    let report = admin
        .blocked_resources(BlockedResourcesRequest { limit: 5 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(report.source, "resource_queues");
    assert_eq!(
        report
            .resources
            .iter()
            .map(|b| (b.resource.as_str(), b.waiting))
            .collect::<Vec<_>>(),
        vec![("R0", 30)]
    );
    assert_eq!(
        report.resources[0].head.as_ref().unwrap().task_id,
        head.to_string()
    );
}

#[tokio::test]
async fn revoke_takes_the_sweepers_path_with_the_reason_and_is_audited() {
    let mut env = Env::new().await;
    env.task(&["A"]).await;
    env.task(&["B"]).await;
    let lease = env.open("doomed").await;
    let claimed = env.fetch(&lease).await.unwrap();
    let running = env.fetch(&lease).await.unwrap();
    env.start(&lease, &running).await;
    let mut admin = admin(&env).await;

    // Refusals change nothing.
    for (lease_id, reason, code) in [
        (lease.clone(), "  ", Code::InvalidArgument),
        ("not-a-lease".to_owned(), "x", Code::InvalidArgument),
        (Uuid::new_v4().to_string(), "x", Code::NotFound),
    ] {
        let err = admin
            .revoke_lease(RevokeLeaseRequest {
                lease_id,
                reason: reason.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{err:?}");
    }
    env.assert_locks(&[&claimed, &running]).await;

    let r = admin
        .revoke_lease(RevokeLeaseRequest {
            lease_id: lease.clone(),
            reason: "disk of host7 died".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (r.released_locks, r.requeued_tasks, r.failed_tasks),
        (2, 1, 1)
    );
    let audit = r.audit.unwrap();
    assert_eq!(audit.action, "revoke_lease");
    assert_eq!(audit.actor, "anonymous");
    assert_eq!(audit.target, lease);
    assert_eq!(audit.reason, "disk of host7 died");
    env.assert_locks(&[]).await;
    assert_eq!(env.state(id(&claimed)).await, "waiting");
    assert_eq!(env.app_lock(id(&claimed)).await, None);
    assert_eq!(env.state(id(&running)).await, "failed");
    assert_eq!(
        env.error_of(id(&running)).await["reason"],
        "disk of host7 died"
    );
    let beat = env
        .client
        .heartbeat(HeartbeatRequest {
            lease_id: lease.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(beat.code(), Code::NotFound);
    // The requeued task goes to the next worker.
    let next = env.open("next").await;
    assert_eq!(id(&env.fetch(&next).await.unwrap()), id(&claimed));
}

/// A lock that names a task the broker never writes (not its UUID text) makes ForceRelease refuse
/// before it releases anything: the expired holder beside it keeps its lock and its task.
#[tokio::test]
async fn force_release_refuses_a_lock_it_cannot_read_and_changes_nothing() {
    use deadpool_redis::redis;
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_secs(3600)).await;
    env.task(&["A"]).await;
    let lease = env
        .open_with(
            "gone-worker",
            &[("core", "3.123.1")],
            Some(Duration::from_millis(300)),
        )
        .await;
    let g = env.fetch(&lease).await.unwrap();
    env.start(&lease, &g).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let client = redis::Client::open(env.redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: i64 = redis::cmd("SADD")
        .arg("{dispatch}:locked")
        .arg("NOT-A-TASK")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: i64 = redis::cmd("HSET")
        .arg("{dispatch}:task:NOT-A-TASK")
        .arg("lease")
        .arg(Uuid::new_v4().to_string())
        .arg("token")
        .arg(1)
        .arg("x")
        .arg("A")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut admin = admin(&env).await;
    let err = admin
        .force_release(ForceReleaseRequest {
            resource: "A".into(),
            reason: "worker unreachable".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("task \"NOT-A-TASK\"")
            && err.message().contains("nothing was released"),
        "{}",
        err.message()
    );
    let held: bool = redis::cmd("EXISTS")
        .arg(format!("{{dispatch}}:task:{}", g.task_id))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(held, "the expired holder's lock was released");
    assert_eq!(env.state(id(&g)).await, "running");
}

#[tokio::test]
async fn force_release_refuses_a_live_holder_and_frees_an_expired_ones_locks() {
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_secs(3600)).await;
    env.task(&["A", "shared:dom"]).await;
    let lease = env
        .open_with(
            "gone-worker",
            &[("core", "3.123.1")],
            Some(Duration::from_millis(300)),
        )
        .await;
    let g = env.fetch(&lease).await.unwrap();
    env.start(&lease, &g).await;
    let mut admin = admin(&env).await;

    let err = admin
        .force_release(ForceReleaseRequest {
            resource: "A".into(),
            reason: "worker unreachable".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains(&lease), "{}", err.message());
    assert!(err.message().contains("gone-worker"), "{}", err.message());
    env.assert_locks(&[&g]).await;

    for (resource, reason, code) in [
        ("", "x", Code::InvalidArgument),
        ("A", "", Code::InvalidArgument),
        ("nothing-holds-this", "x", Code::NotFound),
    ] {
        let err = admin
            .force_release(ForceReleaseRequest {
                resource: resource.into(),
                reason: reason.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{resource:?} {reason:?}: {err:?}");
    }
    env.assert_locks(&[&g]).await;

    // The lease expires; the sweeper is far away. The lock stays until an operator acts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    env.assert_locks(&[&g]).await;
    let r = admin
        .force_release(ForceReleaseRequest {
            resource: "shared:dom".into(),
            reason: "worker unreachable".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((r.released_locks, r.failed_tasks), (1, 1));
    assert_eq!(r.released[0].lease_id, lease);
    assert!(!r.released[0].lease_alive);
    assert_eq!(r.audit.unwrap().action, "force_release");
    env.assert_locks(&[]).await;
    assert_eq!(env.state(id(&g)).await, "failed");
}

#[tokio::test]
async fn force_release_frees_a_lock_whose_lease_record_is_gone() {
    let mut env = Env::with(|a| a.sweep_interval = Duration::from_secs(3600)).await;
    let task = env.task(&["A"]).await;
    let lease = env.open("w").await;
    let g = env.fetch(&lease).await.unwrap();
    // A leak: the lease's records vanish while its lock stays (what lock-leaks.txt describes).
    let client = deadpool_redis::redis::Client::open(env.redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = deadpool_redis::redis::cmd("DEL")
        .arg(format!("{{dispatch}}:lease:{lease}"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = deadpool_redis::redis::cmd("ZREM")
        .arg("{dispatch}:leases")
        .arg(&lease)
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut admin = admin(&env).await;
    let locks = admin
        .list_locks(ListLocksRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        locks.locks[0].holders[0].worker_name, "",
        "lease record gone"
    );

    let r = admin
        .force_release(ForceReleaseRequest {
            resource: "A".into(),
            reason: "leaked lock".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((r.released_locks, r.requeued_tasks), (1, 1));
    env.assert_locks(&[]).await;
    assert_eq!(env.app_lock(task).await, None);
    let next = env.open("next").await;
    assert_eq!(id(&env.fetch(&next).await.unwrap()), task);
    drop(g);
}

/// ListLeases shows under each lease the tasks whose lock names it: a stray entry in another
/// lease's registry does not make that lease look like a holder.
#[tokio::test]
async fn list_leases_shows_only_the_tasks_whose_lock_names_the_lease() {
    let mut env = Env::new().await;
    env.task(&["a"]).await;
    let holder = env.open("holder").await;
    let other = env.open("other").await;
    let granted = env.fetch(&holder).await.expect("the task");
    env.stray_registry_entry(&other, &granted.task_id).await;
    let leases = admin(&env)
        .await
        .list_leases(ListLeasesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .leases;
    let tasks_of = |lease: &str| {
        leases
            .iter()
            .find(|l| l.lease_id == lease)
            .map(|l| (l.task_ids.clone(), l.locks.len()))
            .expect("listed")
    };
    assert_eq!(tasks_of(&holder), (vec![granted.task_id.clone()], 1));
    assert_eq!(tasks_of(&other), (vec![], 0));
    env.shutdown().await;
}

#[tokio::test]
async fn leases_and_locks_page_through_everything_once() {
    let mut env = Env::new().await;
    let mut leases = Vec::new();
    for i in 0..5 {
        env.task(&[&format!("res-{i}"), "shared:dom"]).await;
        let lease = env.open(&format!("pager-{i}")).await;
        env.fetch(&lease).await.unwrap();
        leases.push(lease);
    }
    env.open("other").await;
    let mut admin = admin(&env).await;

    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = admin
            .list_leases(ListLeasesRequest {
                worker_contains: "pager".into(),
                include_expired: false,
                page_size: 2,
                page_token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(page.total, 5);
        assert!(page.leases.len() <= 2);
        for l in &page.leases {
            assert_eq!(l.task_ids.len(), 1);
            assert_eq!(l.locks.len(), 2, "{l:?}");
            assert!(l.alive);
        }
        seen.extend(page.leases.into_iter().map(|l| l.lease_id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    leases.sort();
    assert_eq!(seen, leases);

    let mut resources = Vec::new();
    let mut token = String::new();
    loop {
        let page = admin
            .list_locks(ListLocksRequest {
                resource_prefix: "res-".into(),
                page_size: 2,
                page_token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(page.total, 5);
        resources.extend(page.locks.into_iter().map(|l| l.resource));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(
        resources,
        ["res-0", "res-1", "res-2", "res-3", "res-4"],
        "oldest grant first"
    );
    let dom = admin
        .list_locks(ListLocksRequest {
            resource_prefix: "dom".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(dom.locks.len(), 1);
    assert_eq!(
        (dom.locks[0].mode.as_str(), dom.locks[0].holders.len()),
        ("shared", 5)
    );

    for bad in [
        ListLocksRequest {
            page_token: "garbage".into(),
            ..Default::default()
        },
        ListLocksRequest {
            page_size: 501,
            ..Default::default()
        },
    ] {
        let err = admin.list_locks(bad).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
    }
}

#[tokio::test]
async fn the_admin_api_needs_the_admin_token_and_a_workers_token_is_denied() {
    let dir = tempfile::tempdir().unwrap();
    let admin_file = dir.path().join("admin");
    std::fs::write(&admin_file, format!("{ADMIN}\n")).unwrap();
    let env = Env::with(|a| {
        a.security.auth_token = Some(WORKER.into());
        a.security.admin_token_file = Some(admin_file);
    })
    .await;
    let task = env.task(&["A"]).await;
    let request = || ExplainTaskRequest {
        task_id: task.to_string(),
        max_conflicts: 0,
    };
    let denied = admin_with(&env, Some(WORKER))
        .await
        .explain_task(request())
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    for token in [None, Some("wrong")] {
        let err = admin_with(&env, token)
            .await
            .explain_task(request())
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    }
    let ok = admin_with(&env, Some(ADMIN))
        .await
        .explain_task(request())
        .await
        .unwrap();
    assert_eq!(ok.into_inner().state, "waiting");
    // The admin token is not a worker's.
    let mut broker = broker_with(&env, ADMIN).await;
    let err = broker
        .open_lease(support::lease_request("w"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    // A revoke with the worker's token changes nothing: the live lease it names keeps its task
    // and the task's locks.
    let mut worker = broker_with(&env, WORKER).await;
    let lease = worker
        .open_lease(support::lease_request("w"))
        .await
        .unwrap()
        .into_inner()
        .lease_id;
    let held = worker
        .fetch_task(support::fetch_request(&lease))
        .await
        .unwrap()
        .into_inner()
        .task
        .expect("the worker holds task A");
    let err = admin_with(&env, Some(WORKER))
        .await
        .revoke_lease(RevokeLeaseRequest {
            lease_id: lease.clone(),
            reason: "x".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);
    env.assert_locks(&[&held]).await;
    let row = env
        .db
        .query_one(
            "SELECT state, app_lock_id IS NOT NULL FROM core_task WHERE pulp_id = $1",
            &[&task],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, bool>(1)),
        ("waiting".to_owned(), true),
        "the task stays claimed by the worker, not requeued or failed"
    );
    worker
        .heartbeat(HeartbeatRequest {
            lease_id: lease,
            ..Default::default()
        })
        .await
        .expect("the lease is still live");
}

#[tokio::test]
async fn with_worker_authentication_and_no_admin_token_the_admin_api_is_off() {
    let env = Env::with(|a| a.security.auth_token = Some(WORKER.into())).await;
    for token in [None, Some(WORKER)] {
        let err = admin_with(&env, token)
            .await
            .list_leases(ListLeasesRequest::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
        let err = admin_with(&env, token)
            .await
            .fairness(FairnessRequest {})
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
        assert!(
            err.message().contains("--admin-token-file"),
            "{}",
            err.message()
        );
    }
}

fn cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-broker"))
        .args(args)
        .env_remove("DISPATCH_ADMIN_TOKEN")
        .env_remove("DISPATCH_ADMIN_TOKEN_FILE")
        .output()
        .expect("run dispatch-broker")
}

#[tokio::test]
async fn the_cli_explains_lists_and_revokes_against_a_running_broker() {
    let mut env = Env::with(|a| {
        a.lanes.cutoff = Duration::ZERO;
        a.security.admin_token = Some(ADMIN.into());
    })
    .await;
    let (head, lease) = hol_blocking(&mut env).await;
    let addr = format!("http://{}", env.broker().addr);
    let waiting: Uuid = env
        .db
        .query_one(
            "SELECT pulp_id FROM core_task WHERE state = 'waiting' AND 'R0' = ANY(reserved_resources_record) \
             ORDER BY pulp_created DESC, pulp_id DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let run = |args: Vec<String>| async move {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            cli(&args)
        })
        .await
        .unwrap()
    };
    let with = |cmd: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
        v.extend([
            "--addr".into(),
            addr.clone(),
            "--admin-token".into(),
            ADMIN.into(),
        ]);
        v
    };

    let out = run(with(&["blocked"])).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = text.lines().nth(1).unwrap_or_default();
    assert!(first.trim_start().starts_with("R0"), "{text}");
    assert!(
        first.contains(&head.to_string()) && first.contains("running"),
        "{text}"
    );

    let out = run(with(&["blocked", "--json"])).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["resources"][0]["resource"], "R0");
    assert_eq!(json["resources"][0]["waiting"], 40);

    let out = run(with(&[
        "explain",
        &waiting.to_string(),
        "--max-conflicts",
        "3",
    ]))
    .await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("waiting behind 40 older conflicting tasks"),
        "{text}"
    );
    assert!(text.contains("older conflicting tasks (3 of 40"), "{text}");
    assert!(text.contains("incident-worker"), "{text}");

    let out = run(with(&["leases", "--json"])).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["leases"][0]["lease_id"], lease.as_str());

    let out = run(with(&["locks", "R0"])).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&head.to_string()), "{text}");

    // Errors say what to do.
    let out = run(vec![
        "explain".into(),
        head.to_string(),
        "--addr".into(),
        addr.clone(),
        "--admin-token".into(),
        "wrong".into(),
    ])
    .await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Unauthenticated") && err.contains("DISPATCH_ADMIN_TOKEN"),
        "{err}"
    );
    let out = run(with(&["explain", &Uuid::new_v4().to_string()])).await;
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    let out = run(vec![
        "leases".into(),
        "--addr".into(),
        format!(
            "http://127.0.0.1:{}",
            dispatch_testkit::free_port().unwrap()
        ),
    ])
    .await;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot reach the broker"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A live holder: force-release refuses, names it, and says what to do instead.
    let out = run(with(&["force-release", "R0", "--reason", "stuck?"])).await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("FailedPrecondition") && err.contains(&lease),
        "{err}"
    );
    assert!(err.contains("dispatch-broker revoke"), "{err}");

    let out = run(with(&["revoke", &lease, "--reason", "operator drill"])).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("revoke_lease") && text.contains("admin-token"),
        "{text}"
    );
    assert!(text.contains("1 task(s) failed"), "{text}");
    assert_eq!(env.state(head).await, "failed");
    assert!(eventually(Duration::from_secs(5), || async {
        env.locked_tasks().await.is_empty()
    })
    .await
    .is_some());
}

#[tokio::test]
async fn an_orphan_release_only_frees_the_lock_the_operator_saw() {
    // ForceRelease acts on what it read a moment before; the script re-checks it atomically.
    let mut env = Env::new().await;
    let task = env.task(&["A"]).await;
    let lease = env.open("w").await;
    let g = env.fetch(&lease).await.unwrap();
    let locks = &env.broker().locks;
    let id = TaskId(task);
    let lease: LeaseId = lease.parse().unwrap();
    // The lease lives: refused, nothing done.
    assert_eq!(
        locks
            .release_orphan(id, lease, FencingToken(g.fencing_token))
            .await
            .unwrap(),
        None
    );
    // Another lease or another token (the lock was granted anew meanwhile): nothing done.
    let other = LeaseId(Uuid::new_v4());
    assert_eq!(
        locks
            .release_orphan(id, other, FencingToken(g.fencing_token))
            .await
            .unwrap(),
        Some(false)
    );
    assert_eq!(
        locks
            .release_orphan(id, lease, FencingToken(g.fencing_token + 1))
            .await
            .unwrap(),
        Some(false)
    );
    env.assert_locks(&[&g]).await;
}

#[tokio::test]
async fn with_mutual_tls_an_admin_certificate_opens_the_admin_api_and_a_workers_does_not() {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let leaf = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let (server_cert, server_key) = leaf("localhost");
    let (cert, key, ca_file) = (
        write("server.pem", &server_cert),
        write("server.key", &server_key),
        write("ca.pem", &ca.pem()),
    );
    let env = Env::with(|a| {
        a.security.tls_cert = Some(cert);
        a.security.tls_key = Some(key);
        a.security.tls_client_ca = Some(ca_file);
        a.security.admin_client_names = vec!["ops-admin".into()];
    })
    .await;
    let endpoint = format!("https://localhost:{}", env.broker().addr.port());
    let channel_as = |name: &str| {
        let (cert, key) = leaf(name);
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca.pem()))
            .domain_name("localhost")
            .identity(Identity::from_pem(cert, key));
        let endpoint = endpoint.clone();
        async move {
            Channel::from_shared(endpoint)
                .unwrap()
                .tls_config(tls)
                .unwrap()
                .connect()
                .await
                .unwrap()
        }
    };
    let worker_channel = channel_as("worker-1").await;
    let mut broker =
        dispatch_broker::proto::broker_client::BrokerClient::new(worker_channel.clone());
    let lease = broker
        .open_lease(support::lease_request("w"))
        .await
        .unwrap()
        .into_inner()
        .lease_id;

    let denied = AdminClient::new(worker_channel)
        .list_leases(ListLeasesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(
        denied.message().contains("worker-1"),
        "{}",
        denied.message()
    );

    let mut admin = AdminClient::new(channel_as("ops-admin").await);
    let leases = admin
        .list_leases(ListLeasesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(leases.total, 1);
    let revoked = admin
        .revoke_lease(RevokeLeaseRequest {
            lease_id: lease,
            reason: "drill".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(revoked.audit.unwrap().actor, "cert:ops-admin");
}
