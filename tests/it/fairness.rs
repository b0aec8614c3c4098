//! Fair dispatch through the gRPC API: a small domain is served before a big backlog of another,
//! caps hold across two replicas, immediate tasks go first and the reserve keeps leases for
//! them, the policy file is reloaded and a bad one is refused.

use std::time::Duration;

use uuid::Uuid;

use crate::support::*;
use dispatch_broker::fair::Rule;
use dispatch_broker::proto::Task;

const D1: Uuid = Uuid::from_u128(0xd1);
const D2: Uuid = Uuid::from_u128(0xd2);

/// Inserts a waiting task of `domain` needing `resource`.
async fn task_in(env: &Env, domain: Uuid, resource: &str, immediate: bool) -> Uuid {
    let id = Uuid::new_v4();
    env.db
        .execute(
            "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record, pulp_domain_id, immediate) \
             VALUES ($1, 'test.task', 'waiting', $2, $3, $4)",
            &[&id, &vec![resource.to_owned()], &domain, &immediate],
        )
        .await
        .expect("insert task");
    id
}

/// Waits until the broker's directory knows `n` domains with waiting tasks (`--fair-refresh`).
async fn directory_knows(env: &Env, n: usize) {
    let fairness = env.broker().fairness.clone();
    let seen = eventually(Duration::from_secs(10), || {
        let fairness = fairness.clone();
        async move {
            let standing = dispatch_broker::fair::Standing::default();
            fairness
                .view(&standing)
                .iter()
                .filter(|g| g.waiting)
                .count()
                >= n
        }
    })
    .await;
    assert!(
        seen.is_some(),
        "the directory never showed {n} waiting domains"
    );
}

/// Waits until the broker's directory shows an immediate task waiting (`--fair-refresh`).
async fn engaged(env: &Env) {
    let fairness = env.broker().fairness.clone();
    let seen = eventually(Duration::from_secs(10), || {
        let fairness = fairness.clone();
        async move { fairness.engaged() }
    })
    .await;
    assert!(
        seen.is_some(),
        "the directory never showed the immediate task"
    );
}

/// FetchTask with a `wait`, as workers call it: a task that arrives is found once the broker
/// has read it (the directory is read on the task's notification).
async fn fetch_waiting(
    client: &mut dispatch_broker::proto::broker_client::BrokerClient<tonic::transport::Channel>,
    lease: &str,
) -> Option<Task> {
    let mut request = fetch_request(lease);
    request.wait = Some(prost_types::Duration {
        seconds: 5,
        nanos: 0,
    });
    client
        .fetch_task(request)
        .await
        .expect("FetchTask")
        .into_inner()
        .task
}

fn policy_file(text: &str) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text).unwrap();
    file
}

fn fast(args: &mut dispatch_broker::config::ServeArgs) {
    args.fair.refresh = Duration::from_millis(50);
}

fn domain_of(tasks: &[(Uuid, Uuid)], task: &Task) -> Uuid {
    tasks.iter().find(|(t, _)| *t == id(task)).unwrap().1
}

#[tokio::test]
async fn a_small_domain_is_served_before_a_big_backlog() {
    let mut env = Env::with(fast).await;
    let mut all = Vec::new();
    for i in 0..20 {
        all.push((task_in(&env, D1, &format!("big{i}"), false).await, D1));
    }
    let lease = env.open("w").await;
    // Only D1 waits: plain FIFO.
    let mut held = Vec::new();
    for (want, _) in &all[..4] {
        let t = env.fetch(&lease).await.expect("a task of D1");
        assert_eq!(id(&t), *want, "FIFO while one domain waits");
        held.push(t);
    }
    let small: Vec<Uuid> = {
        let mut v = Vec::new();
        for i in 0..3 {
            v.push(task_in(&env, D2, &format!("small{i}"), false).await);
        }
        v
    };
    all.extend(small.iter().map(|t| (*t, D2)));
    directory_knows(&env, 2).await;
    // D1 runs 4, D2 none: D2's tasks go first, oldest first, until D2 catches up.
    for want in &small {
        let t = env.fetch(&lease).await.expect("a task");
        assert_eq!(id(&t), *want, "D2's oldest task first");
        held.push(t);
    }
    // D2 has nothing left: D1's next in FIFO order.
    let t = env.fetch(&lease).await.expect("a task of D1");
    assert_eq!(domain_of(&all, &t), D1);
    assert_eq!(id(&t), all[4].0);
    held.push(t);
    env.assert_locks(&held.iter().collect::<Vec<_>>()).await;
}

#[tokio::test]
async fn weights_give_a_domain_its_share_of_what_runs() {
    let policy = policy_file("[groups.\"00000000-0000-0000-0000-0000000000d2\"]\nweight = 3\n");
    let path = policy.path().to_owned();
    let mut env = Env::with(move |a| {
        fast(a);
        a.fair.policy = Some(path);
    })
    .await;
    let mut all = Vec::new();
    for i in 0..10 {
        all.push((task_in(&env, D1, &format!("a{i}"), false).await, D1));
        all.push((task_in(&env, D2, &format!("b{i}"), false).await, D2));
    }
    directory_knows(&env, 2).await;
    let lease = env.open("w").await;
    let mut running = [0u32; 2];
    for _ in 0..8 {
        let t = env.fetch(&lease).await.expect("a task");
        running[usize::from(domain_of(&all, &t) == D2)] += 1;
    }
    // Usage = running / weight: D2 at weight 3 holds three times D1's count.
    assert_eq!(running, [2, 6], "8 workers at weights 1:3");
}

#[tokio::test]
async fn a_capped_domain_waits_and_the_others_get_the_workers_on_every_replica() {
    let policy = policy_file("[groups.\"00000000-0000-0000-0000-0000000000d1\"]\ncap = 2\n");
    let path = policy.path().to_owned();
    let mut env = Env::with(move |a| {
        fast(a);
        a.fair.policy = Some(path);
    })
    .await;
    let mut d1 = Vec::new();
    for i in 0..6 {
        d1.push(task_in(&env, D1, &format!("a{i}"), false).await);
    }
    let (other, mut other_client) = env.second_replica().await;
    let here = env.open("here").await;
    let there = open_on(&mut other_client, "there").await;
    // Two replicas, each fetching in turn: D1 gets exactly its cap, in FIFO order.
    let first = env.fetch(&here).await.expect("D1's first task");
    let second = fetch_on(&mut other_client, &there)
        .await
        .expect("D1's second task");
    assert_eq!((id(&first), id(&second)), (d1[0], d1[1]));
    assert!(env.fetch(&here).await.is_none(), "D1 is at its cap of 2");
    assert!(
        fetch_on(&mut other_client, &there).await.is_none(),
        "on the other replica too"
    );
    // Another domain is not held up by D1's cap.
    let d2 = task_in(&env, D2, "b0", false).await;
    let t = fetch_waiting(&mut other_client, &there)
        .await
        .expect("D2's task");
    assert_eq!(id(&t), d2);
    // When one of D1's tasks ends, D1's next in FIFO order may run.
    env.start(&here, &first).await;
    env.finish(&here, &first, "completed").await;
    let t = env.fetch(&here).await.expect("D1's third task");
    assert_eq!(id(&t), d1[2]);
    assert!(env.fetch(&here).await.is_none(), "D1 is at its cap again");
    // The operator is told why D1's next task waits.
    let mut admin = admin_of(&env).await;
    let why = explained(&mut admin, d1[3]).await;
    assert!(
        why.summary.contains(&format!(
            "held back by fair dispatch: domain {D1} is at its cap of 2 running"
        )),
        "{}",
        why.summary
    );
    let held = env.broker().locks.standing().await.unwrap();
    assert_eq!(held.running_of(&D1), 2);
    assert_eq!(held.running_of(&D2), 1);
    // The operator's view of the shares, over gRPC and through the CLI.
    let report = admin
        .fairness(dispatch_broker::proto::FairnessRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (report.fair_by.as_str(), report.source.as_str()),
        ("domain", "file")
    );
    assert!(report.directed);
    assert_eq!(report.live_leases, 2);
    assert_eq!(report.deferred_running, 3);
    let d1_share = report
        .domains
        .iter()
        .find(|d| d.domain_id == D1.to_string())
        .expect("D1 listed");
    assert_eq!(
        (d1_share.cap, d1_share.running, d1_share.waiting),
        (Some(2), 2, true)
    );
    let d2_share = report
        .domains
        .iter()
        .find(|d| d.domain_id == D2.to_string())
        .expect("D2 listed");
    assert_eq!((d2_share.cap, d2_share.running), (None, 1));
    assert_eq!(d1_share.share, 0.5);
    let text = cli(format!("http://{}", env.broker().addr), &["fairness"]).await;
    let d1_row = text
        .lines()
        .find(|l| l.contains(&D1.to_string()))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        d1_row.contains(" 2 ") && d1_row.contains("yes") && d1_row.contains("50%"),
        "{text}"
    );
    assert!(text.contains("policy from the policy file"), "{text}");
    // A replica goes away: the count is Redis's, so the cap holds on the one left.
    other.shutdown().await.unwrap();
    assert!(env.fetch(&here).await.is_none(), "D1 is still at its cap");
}

#[tokio::test]
async fn immediate_tasks_go_first_and_the_reserve_keeps_leases_for_them() {
    let policy = policy_file("reserve = 1\n");
    let path = policy.path().to_owned();
    let mut env = Env::with(move |a| {
        fast(a);
        a.fair.policy = Some(path);
    })
    .await;
    let mut deferred = Vec::new();
    for i in 0..5 {
        deferred.push(task_in(&env, D1, &format!("d{i}"), false).await);
    }
    let quick = task_in(&env, D1, "q0", true).await;
    engaged(&env).await;
    let leases = [
        env.open("a").await,
        env.open("b").await,
        env.open("c").await,
    ];
    // Newer than every deferred task, the immediate task goes first.
    let t = env.fetch(&leases[0]).await.expect("the immediate task");
    assert_eq!(id(&t), quick, "the immediate task goes first");
    let a = env.fetch(&leases[1]).await.expect("a deferred task");
    assert_eq!(id(&a), deferred[0]);
    let b = env.fetch(&leases[2]).await.expect("a deferred task");
    assert_eq!(id(&b), deferred[1]);
    // Three leases, reserve 1: with two deferred tasks holding locks, the third waits.
    env.start(&leases[0], &t).await;
    env.finish(&leases[0], &t, "completed").await;
    assert!(
        env.fetch(&leases[0]).await.is_none(),
        "deferred tasks may hold at most 3 - 1 leases"
    );
    // An immediate task takes the lease kept for it.
    let quick2 = task_in(&env, D1, "q1", true).await;
    let got = fetch_waiting(&mut env.client, &leases[0])
        .await
        .expect("the second immediate task");
    assert_eq!(id(&got), quick2);
}

#[tokio::test]
async fn the_policy_file_is_reloaded_and_a_bad_one_is_refused() {
    let policy = policy_file("[groups.\"00000000-0000-0000-0000-0000000000d1\"]\ncap = 1\n");
    let path = policy.path().to_owned();
    let mut env = Env::with(move |a| {
        fast(a);
        a.fair.policy = Some(path);
    })
    .await;
    for i in 0..4 {
        task_in(&env, D1, &format!("a{i}"), false).await;
    }
    let lease = env.open("w").await;
    assert!(env.fetch(&lease).await.is_some());
    assert!(env.fetch(&lease).await.is_none(), "cap 1");
    // Raised in the file: in force within --fair-refresh, without a restart.
    std::fs::write(
        policy.path(),
        "[groups.\"00000000-0000-0000-0000-0000000000d1\"]\ncap = 2\n",
    )
    .unwrap();
    let fairness = env.broker().fairness.clone();
    let cap_of = move || fairness.rules().cap(&D1);
    let raised = eventually(Duration::from_secs(10), || {
        let cap_of = cap_of.clone();
        async move { cap_of() == Some(2) }
    })
    .await;
    assert!(raised.is_some(), "the new cap was never read");
    assert!(env.fetch(&lease).await.is_some(), "cap 2");
    assert!(env.fetch(&lease).await.is_none(), "cap 2");
    // A bad file is refused: the policy in force stays.
    std::fs::write(
        policy.path(),
        "[groups.\"00000000-0000-0000-0000-0000000000d1\"]\ncap = 3\nweight = 0\n",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (policy_now, _) = env.broker().fairness.policy();
    assert_eq!(
        policy_now.groups["00000000-0000-0000-0000-0000000000d1"],
        Rule {
            weight: None,
            cap: Some(2)
        }
    );
    assert!(env.fetch(&lease).await.is_none(), "still cap 2");
}

#[tokio::test]
async fn a_bad_policy_file_stops_the_start_naming_the_line() {
    let policy = policy_file("reserve = 1\n\n[groups.a]\nwieght = 2\n");
    let db_url = tokio::task::spawn_blocking(fresh_database).await.unwrap();
    let redis = tokio::task::spawn_blocking(|| dispatch_testkit::Redis::start().unwrap())
        .await
        .unwrap();
    let mut args = default_args(&db_url, &redis.url());
    args.fair.policy = Some(policy.path().to_owned());
    let e = dispatch_broker::server::start(&args)
        .await
        .err()
        .expect("a bad policy file stops the start");
    let message = format!("{e:#}");
    assert!(message.contains("--fair-policy"), "{message}");
    assert!(message.contains("line 4"), "{message}");
    assert!(message.contains("wieght"), "{message}");
}

#[tokio::test]
async fn a_cap_still_holds_after_redis_lost_its_state_and_locks_were_rebuilt() {
    let policy = policy_file("[groups.\"00000000-0000-0000-0000-0000000000d1\"]\ncap = 2\n");
    let path = policy.path().to_owned();
    let mut env = Env::with(move |a| {
        fast(a);
        a.fair.policy = Some(path);
        a.sweep_interval = Duration::from_millis(200);
    })
    .await;
    for i in 0..4 {
        task_in(&env, D1, &format!("a{i}"), false).await;
    }
    let lease = env.open("w").await;
    let first = env.fetch(&lease).await.expect("D1's first task");
    env.start(&lease, &first).await;
    env.fetch(&lease).await.expect("D1's second task");
    // Redis loses everything; the broker rebuilds the locks of the claimed tasks from Postgres,
    // and counts them under their domain again.
    use deadpool_redis::redis;
    let client = redis::Client::open(env.redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let locks = env.broker().locks.clone();
    let rebuilt = eventually(Duration::from_secs(20), || {
        let locks = locks.clone();
        async move { locks.standing().await.is_ok_and(|s| s.running_of(&D1) == 2) }
    })
    .await;
    assert!(
        rebuilt.is_some(),
        "the rebuild did not count D1's two tasks"
    );
    let d2 = task_in(&env, D2, "b0", false).await;
    let other = env.open("w2").await;
    let t = fetch_waiting(&mut env.client, &other)
        .await
        .expect("D2's task: D1 is at its cap");
    assert_eq!(id(&t), d2);
    assert!(
        env.fetch(&other).await.is_none(),
        "D1 is still at its cap of 2"
    );
}

#[tokio::test]
async fn a_capped_domains_immediate_task_does_not_hold_up_another_domains() {
    // Two leases, a reserve of one: with one deferred task running, only immediate tasks may
    // go out, and D1's are held back entirely by its cap of 0.
    let policy =
        policy_file("reserve = 1\n[groups.\"00000000-0000-0000-0000-0000000000d1\"]\ncap = 0\n");
    let path = policy.path().to_owned();
    let mut env = Env::with(move |a| {
        fast(a);
        a.fair.policy = Some(path);
    })
    .await;
    let first = env.open("w1").await;
    let second = env.open("w2").await;
    task_in(&env, D2, "d0", false).await;
    env.fetch(&first).await.expect("the deferred task");
    let held = task_in(&env, D1, "a0", true).await;
    let other = task_in(&env, D2, "b0", true).await;
    engaged(&env).await;
    let t = fetch_waiting(&mut env.client, &second)
        .await
        .expect("D2's immediate task");
    assert_eq!(
        id(&t),
        other,
        "D1's older immediate task is held back by its cap, D2's is not"
    );
    assert_eq!(env.state(held).await, "waiting");
}

#[tokio::test]
async fn the_sweep_counts_the_tasks_holding_locks_anew() {
    let mut env = Env::with(|a| {
        fast(a);
        a.sweep_interval = Duration::from_millis(100);
    })
    .await;
    task_in(&env, D1, "a0", false).await;
    let lease = env.open("w").await;
    env.fetch(&lease).await.expect("a task");
    // A count gone wrong (a lock released by a broker from before fair dispatch would leave
    // one): the next sweep counts from the locks themselves.
    use deadpool_redis::redis;
    let client = redis::Client::open(env.redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("HSET")
        .arg("{dispatch}:running")
        .arg(D1.to_string())
        .arg(7)
        .arg(D2.to_string())
        .arg(3)
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("{dispatch}:deferred")
        .arg(10)
        .query_async(&mut conn)
        .await
        .unwrap();
    let locks = env.broker().locks.clone();
    let fixed = eventually(Duration::from_secs(10), || {
        let locks = locks.clone();
        async move {
            locks
                .standing()
                .await
                .is_ok_and(|s| s.running_of(&D1) == 1 && s.running_of(&D2) == 0 && s.deferred == 1)
        }
    })
    .await;
    assert!(fixed.is_some(), "the counts were not made right");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_shows_each_domains_wait_and_running_tasks() {
    // A broker process of its own: its /metrics shows its own series only. (The in-process
    // broker's lane interval is short: the lane lock it leaves behind expires at once.)
    let mut env = Env::with(|a| a.lanes.interval = Duration::from_millis(200)).await;
    env.broker.take().unwrap().shutdown().await.unwrap();
    task_in(&env, D1, "a0", false).await;
    task_in(&env, D1, "a1", false).await;
    task_in(&env, D2, "b0", false).await;
    let broker = BrokerProcess::start(
        &env.db_url,
        &env.redis.url(),
        &[
            "--fair-refresh",
            "50ms",
            "--lane-cutoff",
            "0s",
            "--lane-interval",
            "200ms",
        ],
        &[],
    )
    .await;
    let mut client = broker.client().await;
    let lease = open_on(&mut client, "w").await;
    // The first lane pass (a full pass) counts the waiting tasks by domain.
    let (w1, w2) = (
        format!("dispatch_group_waiting{{group=\"{D1}\"}}"),
        format!("dispatch_group_waiting{{group=\"{D2}\"}}"),
    );
    let counted = eventually(Duration::from_secs(10), || async {
        let page = broker.metrics().await;
        metric(&page, &w1) == Some(2.0) && metric(&page, &w2) == Some(1.0)
    })
    .await;
    let page = broker.metrics().await;
    assert!(counted.is_some(), "D1 has 2 waiting, D2 1:\n{page}");
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(fetch_on(&mut client, &lease).await.expect("a task"));
    }
    let (d1, d2) = (
        format!("dispatch_group_running{{group=\"{D1}\"}}"),
        format!("dispatch_group_running{{group=\"{D2}\"}}"),
    );
    let served = eventually(Duration::from_secs(10), || async {
        let page = broker.metrics().await;
        metric(&page, &d1) == Some(2.0) && metric(&page, &d2) == Some(1.0)
    })
    .await;
    let page = broker.metrics().await;
    assert!(served.is_some(), "D1 runs 2, D2 runs 1:\n{page}");
    assert_eq!(
        metric(
            &page,
            &format!("dispatch_task_wait_seconds_count{{group=\"{D1}\"}}")
        ),
        Some(2.0),
        "{page}"
    );
    // A task run time is recorded when the broker records the final state (FinishTask) and
    // when it releases the locks of a task Pulp ended itself (ReleaseLocks).
    let d2 = pulp_task_of(&env, D2).await;
    let d2_task = got
        .iter()
        .position(|t| id(t) == d2)
        .expect("D2's task was handed out");
    let by_pulp = got.remove(d2_task);
    for t in got.iter().chain([&by_pulp]) {
        client
            .start_task(dispatch_broker::proto::StartTaskRequest {
                lease_id: lease.clone(),
                task_id: t.task_id.clone(),
                fencing_token: t.fencing_token,
            })
            .await
            .expect("StartTask");
    }
    client
        .finish_task(finish_request(lease.clone(), &got[0], "completed"))
        .await
        .expect("FinishTask");
    env.db
        .execute(
            "UPDATE core_task SET state = 'failed', finished_at = now() WHERE pulp_id = $1",
            &[&id(&by_pulp)],
        )
        .await
        .unwrap();
    // A client's retry of the release records nothing more.
    for _ in 0..2 {
        client
            .release_locks(dispatch_broker::proto::ReleaseLocksRequest {
                lease_id: lease.clone(),
                task_id: by_pulp.task_id.clone(),
                fencing_token: by_pulp.fencing_token,
            })
            .await
            .expect("ReleaseLocks");
    }
    let page = broker.metrics().await;
    for (domain, ran) in [(D1, 1.0), (D2, 1.0)] {
        assert_eq!(
            metric(
                &page,
                &format!("dispatch_task_run_seconds_count{{group=\"{domain}\"}}")
            ),
            Some(ran),
            "{page}"
        );
    }
}

/// The one task of `domain` (a test's domain with a single task).
async fn pulp_task_of(env: &Env, domain: Uuid) -> Uuid {
    env.db
        .query_one(
            "SELECT pulp_id FROM core_task WHERE pulp_domain_id = $1",
            &[&domain],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn a_page_one_lease_cannot_take_is_read_again_for_the_next() {
    // The domains are read once a minute here: a page marked dry would stay dry.
    let mut env = Env::with(|a| a.fair.refresh = Duration::from_secs(60)).await;
    // D2's one task, the oldest, needs a component the first worker lacks.
    let newer = Uuid::new_v4();
    env.db
        .execute(
            "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record, pulp_domain_id, versions) \
             VALUES ($1, 'test.task', 'waiting', '{b0}', $2, hstore('core', '9.0'))",
            &[&newer, &D2],
        )
        .await
        .unwrap();
    let d1 = [
        task_in(&env, D1, "a0", false).await,
        task_in(&env, D1, "a1", false).await,
    ];
    directory_knows(&env, 2).await;
    let old = env.open("old").await;
    let t = env.fetch(&old).await.expect("a task of D1");
    assert_eq!(id(&t), d1[0]);
    // At once (before the next read of the domains): D2's page was not dry for this lease.
    let new = env.open_with("new", &[("core", "9.0")], None).await;
    let t = env.fetch(&new).await.expect("D2's task");
    assert_eq!(
        id(&t),
        newer,
        "D2 runs nothing, D1 one: D2's task goes first"
    );
}

#[tokio::test]
async fn the_lane_gauge_counts_a_capped_domain_at_its_cap_and_the_reserve_in_full() {
    let policy =
        policy_file("reserve = 2\n[groups.\"00000000-0000-0000-0000-0000000000d1\"]\ncap = 3\n");
    let path = policy.path().to_owned();
    let env = Env::with(move |a| {
        fast(a);
        a.fair.policy = Some(path);
        a.lanes.cutoff = Duration::ZERO;
        a.lanes.full_interval = Duration::from_secs(3600);
    })
    .await;
    for i in 0..6 {
        task_in(&env, D1, &format!("d1-{i}"), false).await;
    }
    for i in 0..2 {
        task_in(&env, D2, &format!("d2-{i}"), false).await;
    }
    let quick = task_in(&env, D2, "q", true).await;
    let lanes = env.broker().lanes.clone();
    lanes.compute_now().await.unwrap();
    // 9 tasks could run by the readiness rule; D1 runs at most 3 of its 6, and while the 5
    // deferred lanes run, 2 leases stay kept for immediate tasks: 5 + max(1, 2).
    assert_eq!(lanes.current().lanes, 7);
    // A maintained pass: a deferred arrival, then the immediate task ends.
    task_in(&env, D2, "d2-2", false).await;
    assert_eq!(lanes.compute(false).await.unwrap(), "maintained");
    assert_eq!(lanes.current().lanes, 8);
    env.db
        .execute(
            "UPDATE core_task SET state = 'completed' WHERE pulp_id = $1",
            &[&quick],
        )
        .await
        .unwrap();
    assert_eq!(lanes.compute(false).await.unwrap(), "maintained");
    assert_eq!(lanes.current().lanes, 8, "6 deferred lanes and the reserve");
    // Without the cap and the reserve, every lane counts.
    std::fs::write(policy.path(), "").unwrap();
    env.broker()
        .fairness
        .reload(policy.path(), &Default::default());
    lanes.compute_now().await.unwrap();
    assert_eq!(lanes.current().lanes, 9);
}

/// An admin client of the broker of `env`.
async fn admin_of(
    env: &Env,
) -> dispatch_broker::proto::admin_client::AdminClient<tonic::transport::Channel> {
    dispatch_broker::proto::admin_client::AdminClient::connect(format!(
        "http://{}",
        env.broker().addr
    ))
    .await
    .unwrap()
}

/// ExplainTask's answer for `task`.
async fn explained(
    admin: &mut dispatch_broker::proto::admin_client::AdminClient<tonic::transport::Channel>,
    task: Uuid,
) -> dispatch_broker::proto::Explanation {
    admin
        .explain_task(dispatch_broker::proto::ExplainTaskRequest {
            task_id: task.to_string(),
            max_conflicts: 0,
        })
        .await
        .unwrap()
        .into_inner()
}

/// SetFairness through the admin API.
async fn set_fairness(
    admin: &mut dispatch_broker::proto::admin_client::AdminClient<tonic::transport::Channel>,
    request: dispatch_broker::proto::SetFairnessRequest,
) -> Result<dispatch_broker::proto::SetFairnessResponse, tonic::Status> {
    admin.set_fairness(request).await.map(|r| r.into_inner())
}

/// Runs the CLI against the broker at `addr`; its standard output (it must succeed).
async fn cli(addr: String, args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-broker"))
            .args(&args)
            .args(["--addr", &addr])
            .env_remove("DISPATCH_ADMIN_TOKEN")
            .env_remove("DISPATCH_ADMIN_TOKEN_FILE")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[tokio::test]
async fn an_override_holds_on_every_replica_until_the_policy_file_changes() {
    use dispatch_broker::proto::SetFairnessRequest;
    let policy = policy_file("[groups.\"00000000-0000-0000-0000-0000000000d1\"]\ncap = 1\n");
    let path = policy.path().to_owned();
    let mut env = Env::with(move |a| {
        fast(a);
        a.fair.policy = Some(path);
    })
    .await;
    let mut d1 = Vec::new();
    for i in 0..5 {
        d1.push(task_in(&env, D1, &format!("a{i}"), false).await);
    }
    let (_other, mut other_client) = env.second_replica().await;
    let here = env.open("here").await;
    let there = open_on(&mut other_client, "there").await;
    let t = env.fetch(&here).await.expect("D1's first task");
    assert_eq!(id(&t), d1[0]);
    assert!(env.fetch(&here).await.is_none(), "D1 is at its cap of 1");
    let addr = format!("http://{}", env.broker().addr);
    let mut admin = admin_of(&env).await;
    // Bad requests are refused, naming what to fix, and change nothing.
    let refused = [
        (
            SetFairnessRequest {
                domain: D1.to_string(),
                weight: Some(0.0),
                reason: "r".into(),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "not more than 0",
        ),
        (
            SetFairnessRequest {
                domain: D1.to_string(),
                cap: Some(-1),
                reason: "r".into(),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "give 0 or more",
        ),
        (
            SetFairnessRequest {
                domain: "nope".into(),
                cap: Some(3),
                reason: "r".into(),
                ..Default::default()
            },
            tonic::Code::NotFound,
            "no domain named nope",
        ),
        (
            SetFairnessRequest {
                reason: "r".into(),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "nothing to override",
        ),
        (
            SetFairnessRequest {
                domain: D1.to_string(),
                cap: Some(3),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "reason is required",
        ),
    ];
    for (request, code, says) in refused {
        let e = set_fairness(&mut admin, request).await.unwrap_err();
        assert_eq!(e.code(), code, "{}", e.message());
        assert!(e.message().contains(says), "{}", e.message());
    }
    assert!(
        env.broker()
            .locks
            .fair_overrides()
            .await
            .unwrap()
            .is_empty(),
        "a refused override changes nothing"
    );
    // D1's cap raised to 3 at run time: audited, shown, and noted as not in the file.
    let r = set_fairness(
        &mut admin,
        SetFairnessRequest {
            domain: D1.to_string(),
            cap: Some(3),
            reason: "the backlog must drain".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let audit = r.audit.unwrap();
    assert_eq!(
        (audit.action.as_str(), audit.target.as_str()),
        ("set_fairness", D1.to_string().as_str())
    );
    assert!(r.note.contains("not in the policy file"), "{}", r.note);
    let report = r.fairness.unwrap();
    assert_eq!(report.overrides, [format!("cap of {D1}: 3")]);
    let share = report
        .domains
        .iter()
        .find(|d| d.domain_id == D1.to_string())
        .unwrap();
    assert_eq!(share.cap, Some(3));
    // The other replica applies it within --fair-refresh. (Which of D1's waiting tasks it hands
    // out is not promised: they are on distinct resources, so no order binds them, and a pass
    // that met d1[1] and d1[2] held back by the old cap walks on; the override may arrive before
    // it meets d1[3]. design.md, "Fair dispatch".)
    let second = fetch_waiting(&mut other_client, &there)
        .await
        .expect("D1's second task, on the other replica");
    let third = env.fetch(&here).await.expect("D1's third task");
    assert_ne!(id(&second), id(&third));
    for t in [&second, &third] {
        assert!(d1[1..].contains(&id(t)), "a waiting task of D1");
    }
    assert!(
        env.fetch(&here).await.is_none(),
        "D1 is at its new cap of 3"
    );
    // Through the CLI: the override is shown, and said not to be in the file; reset drops it.
    let text = cli(
        addr.clone(),
        &[
            "fairness",
            "set",
            "--domain",
            &D1.to_string(),
            "--weight",
            "2",
            "--reason",
            "cli",
        ],
    )
    .await;
    assert!(text.contains("set_fairness"), "{text}");
    assert!(text.contains("not in the policy file"), "{text}");
    assert!(text.contains(&format!("weight of {D1}: 2")), "{text}");
    let text = cli(addr.clone(), &["fairness", "reset", "--reason", "done"]).await;
    assert!(text.contains("every override dropped"), "{text}");
    let report = admin
        .fairness(dispatch_broker::proto::FairnessRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(report.overrides.is_empty());
    // A new policy file ends the overrides made over the old one.
    set_fairness(
        &mut admin,
        SetFairnessRequest {
            reserve: Some(1),
            reason: "r".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    std::fs::write(
        policy.path(),
        "# edited\n[groups.\"00000000-0000-0000-0000-0000000000d1\"]\ncap = 1\n",
    )
    .unwrap();
    let fairness = env.broker().fairness.clone();
    let ended = eventually(Duration::from_secs(10), || {
        let fairness = fairness.clone();
        async move { fairness.rules().reserve == 0 }
    })
    .await;
    assert!(ended.is_some(), "{:?}", env.broker().fairness.overrides());
    assert_eq!(
        env.broker().fairness.overrides(),
        ["not applied (made over another policy file): reserve: 1"]
    );
    // A new override is refused until the old ones are dropped: a replica still on the old
    // file must not erase what was made over the new one.
    let e = set_fairness(
        &mut admin,
        SetFairnessRequest {
            reserve: Some(2),
            reason: "r".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{}", e.message());
    assert!(e.message().contains("fairness reset"), "{}", e.message());
    cli(addr.clone(), &["fairness", "reset", "--reason", "new file"]).await;
    set_fairness(
        &mut admin,
        SetFairnessRequest {
            reserve: Some(2),
            reason: "r".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(env.broker().fairness.rules().reserve, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_fetching_at_once_get_a_capped_domains_oldest_tasks() {
    let policy = policy_file("[groups.\"00000000-0000-0000-0000-0000000000d1\"]\ncap = 2\n");
    let path = policy.path().to_owned();
    let mut env = Env::with(move |a| {
        fast(a);
        a.fair.policy = Some(path);
    })
    .await;
    let mut d1 = Vec::new();
    for i in 0..8 {
        d1.push(task_in(&env, D1, &format!("a{i}"), false).await);
    }
    // Four workers wait at once: one pass serves them all, and D1's cap leaves room for two.
    // Whatever the order the attempts reach Redis in, the two are D1's oldest.
    let mut calls = Vec::new();
    for w in 0..4 {
        let lease = env.open(&format!("w{w}")).await;
        let mut client = env.client.clone();
        calls.push(tokio::spawn(async move {
            let mut request = fetch_request(&lease);
            request.wait = Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            });
            client
                .fetch_task(request)
                .await
                .expect("FetchTask")
                .into_inner()
                .task
        }));
    }
    let mut got: Vec<Uuid> = Vec::new();
    for call in calls {
        if let Some(t) = call.await.unwrap() {
            got.push(id(&t));
        }
    }
    got.sort();
    let mut oldest = vec![d1[0], d1[1]];
    oldest.sort();
    assert_eq!(got, oldest, "D1's two oldest tasks, and no other");
}

#[tokio::test]
async fn by_task_group_a_task_group_is_capped_and_the_tasks_of_none_get_the_workers() {
    const G1: Uuid = Uuid::from_u128(0x91);
    let policy = policy_file("[groups.\"00000000-0000-0000-0000-000000000091\"]\ncap = 1\n");
    let path = policy.path().to_owned();
    let mut env = Env::with(move |a| {
        fast(a);
        a.fair.by = dispatch_broker::fair::FairBy::TaskGroup;
        a.fair.policy = Some(path);
    })
    .await;
    // One domain: three tasks of task group G1, then two of no task group.
    let mut g1 = Vec::new();
    for i in 0..3 {
        let id = task_in(&env, D1, &format!("g{i}"), false).await;
        env.db
            .execute(
                "UPDATE core_task SET task_group_id = $2 WHERE pulp_id = $1",
                &[&id, &G1],
            )
            .await
            .unwrap();
        g1.push(id);
    }
    let none = [
        task_in(&env, D1, "n0", false).await,
        task_in(&env, D1, "n1", false).await,
    ];
    directory_knows(&env, 2).await;
    let leases = [
        env.open("a").await,
        env.open("b").await,
        env.open("c").await,
        env.open("d").await,
    ];
    let t = env.fetch(&leases[0]).await.expect("G1's first task");
    assert_eq!(id(&t), g1[0]);
    // G1 is at its cap of 1: the tasks of no task group get the next workers, in FIFO order.
    let t = env
        .fetch(&leases[1])
        .await
        .expect("a task of no task group");
    assert_eq!(id(&t), none[0]);
    let t = env
        .fetch(&leases[2])
        .await
        .expect("a task of no task group");
    assert_eq!(id(&t), none[1]);
    assert!(env.fetch(&leases[3]).await.is_none(), "G1 is at its cap");
    let mut admin = admin_of(&env).await;
    let why = explained(&mut admin, g1[1]).await;
    assert!(
        why.summary
            .contains(&format!("task group {G1} is at its cap of 1 running")),
        "{}",
        why.summary
    );
    let report = admin
        .fairness(dispatch_broker::proto::FairnessRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(report.fair_by, "task-group");
    let share = report
        .domains
        .iter()
        .find(|d| d.domain_id == G1.to_string())
        .expect("G1 listed");
    assert_eq!((share.cap, share.running), (Some(1), 1));
}

#[tokio::test]
async fn a_rebuild_of_the_lock_state_keeps_the_overrides() {
    let mut env = Env::with(|a| {
        fast(a);
        a.sweep_interval = Duration::from_millis(200);
    })
    .await;
    let fields = [dispatch_broker::fair::override_fields::cap(D1, Some(1))];
    let kept = env
        .broker()
        .locks
        .override_fairness(0, &fields)
        .await
        .unwrap()
        .expect("no overrides of another policy file");
    assert_eq!(kept.len(), 2, "{kept:?}");
    task_in(&env, D1, "a0", false).await;
    let lease = env.open("w").await;
    env.fetch(&lease).await.expect("D1's task");
    // The epoch goes (Redis lost part of its data): the broker rebuilds the lock state, which
    // deletes every key but the few it keeps.
    use deadpool_redis::redis;
    let client = redis::Client::open(env.redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("DEL")
        .arg("{dispatch}:epoch")
        .query_async(&mut conn)
        .await
        .unwrap();
    let rebuilt = eventually(Duration::from_secs(20), || {
        let mut conn = conn.clone();
        async move {
            let epoch: Option<String> = redis::cmd("GET")
                .arg("{dispatch}:epoch")
                .query_async(&mut conn)
                .await
                .unwrap();
            epoch.is_some()
        }
    })
    .await;
    assert!(rebuilt.is_some(), "the lock state was not rebuilt");
    let overrides = env.broker().locks.fair_overrides().await.unwrap();
    assert!(
        overrides
            .iter()
            .any(|(f, v)| f == &format!("cap:{D1}") && v == "1"),
        "{overrides:?}"
    );
}

#[tokio::test]
async fn the_rest_of_a_directed_page_is_judged_without_a_read_and_a_task_canceled_since_is_not_handed_out(
) {
    let mut env = Env::with(fast).await;
    let mut a = Vec::new();
    let mut b = Vec::new();
    for i in 0..3 {
        a.push(task_in(&env, D1, &format!("a{i}"), false).await);
    }
    for i in 0..3 {
        b.push(task_in(&env, D2, &format!("b{i}"), false).await);
    }
    directory_knows(&env, 2).await;
    let lease = env.open("w").await;
    let first = env.fetch(&lease).await.expect("D1's oldest");
    assert_eq!(id(&first), a[0]);
    let second = env.fetch(&lease).await.expect("D2's oldest");
    assert_eq!(id(&second), b[0], "D1 runs one, D2 none");
    // D1's page held a[1] and a[2] past the task handed out; a[1] is canceled since.
    env.cancel(a[1]).await.expect("CancelTask");
    let carried = env.broker().stats.snapshot().pages_carried;
    let third = env.fetch(&lease).await.expect("a task");
    assert_eq!(
        id(&third),
        a[2],
        "each runs one: D1's oldest waiting task is older than D2's, and the canceled one is skipped"
    );
    assert!(
        env.broker().stats.snapshot().pages_carried > carried,
        "D1's page was judged from what the first fetch read"
    );
    env.assert_locks(&[&first, &second, &third]).await;
    assert_eq!(env.state(a[1]).await, "canceled");
}

#[tokio::test]
async fn a_groups_page_reads_the_next_groups_ahead_and_their_passes_read_nothing() {
    let mut env = Env::with(fast).await;
    let a0 = task_in(&env, D1, "a0", false).await;
    task_in(&env, D1, "a1", false).await;
    let b0 = task_in(&env, D2, "b0", false).await;
    directory_knows(&env, 2).await;
    let lease = env.open("w").await;
    let first = env.fetch(&lease).await.expect("D1's oldest");
    assert_eq!(id(&first), a0);
    // D1 runs one, D2 none: D2's task, from what D1's page read ahead.
    let before = env.settled_stats().await;
    let second = env.fetch(&lease).await.expect("D2's task");
    let spent = env.settled_stats().await - before;
    assert_eq!(id(&second), b0);
    assert_eq!(
        spent.fetch_postgres_statements, 1,
        "the claim only, no page read: {spent:?}"
    );
    assert!(spent.pages_carried >= 1, "{spent:?}");
    env.assert_locks(&[&first, &second]).await;
}

#[tokio::test]
async fn carried_tasks_that_are_not_ready_do_not_make_their_group_dry() {
    let mut env = Env::with(fast).await;
    let a0 = task_in(&env, D1, "q", false).await;
    let a1 = task_in(&env, D1, "y", false).await;
    // D2's first two tasks wait for a0 (older, same resource); its third is free.
    task_in(&env, D2, "q", false).await;
    task_in(&env, D2, "q", false).await;
    let b2 = task_in(&env, D2, "x", false).await;
    directory_knows(&env, 2).await;
    let lease = env.open("w").await;
    let first = env.fetch(&lease).await.expect("D1's oldest");
    assert_eq!(id(&first), a0);
    // D1's page read D2's first two tasks ahead: neither is ready. D2's page is read again
    // rather than D2 called dry (the pass in queue order would then hand out D1's a1).
    let second = env.fetch(&lease).await.expect("a task");
    assert_eq!(
        id(&second),
        b2,
        "D2 runs nothing, D1 one: D2's ready task, not D1's {a1}"
    );
    env.assert_locks(&[&first, &second]).await;
}
