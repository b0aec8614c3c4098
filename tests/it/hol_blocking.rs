//! The head-of-line incident (seed hol-blocking.txt): thousands of tasks on one repository at
//! the head of the queue, its oldest task running, and other domains' tasks behind them. Every
//! fetch must hand out another domain's task, and a fetch's cost in Postgres statements and Redis
//! calls must not grow with the number of blocked tasks.

use crate::support;

use crate::support::{id, Env};
use dispatch_broker::metrics::StatsSnapshot;
use uuid::Uuid;

const REPO: &str = "prn:python.repository:R0";
const DOMAIN1: &str = "shared:prn:core.domain:D1";
const OTHERS: usize = 50;
const LEASES: usize = 10;

/// R0's head task running under the lease "busy", and `blocked` tasks on R0 behind it (the
/// insert trigger bypassed); returns the lease and the head.
async fn blocked_behind_a_running_head(
    env: &mut Env,
    blocked: usize,
) -> (String, dispatch_broker::proto::Task) {
    let head = env.task(&[REPO, DOMAIN1]).await;
    let busy = env.open("busy").await;
    let running = env.fetch(&busy).await.expect("the head task");
    assert_eq!(id(&running), head);
    env.start(&busy, &running).await;
    env.tasks_bulk(blocked, &[REPO, DOMAIN1]).await;
    (busy, running)
}

/// `n` tasks of another domain (repositories F0, F1, ...), after everything queued so far.
async fn other_domain_tasks(env: &Env, n: usize) {
    for i in 0..n {
        env.task(&[
            &format!("prn:file.repository:F{i}"),
            "shared:prn:core.domain:D2",
        ])
        .await;
    }
}

/// Runs the incident with `blocked` waiting tasks behind the running one; returns the cost of
/// every fetch.
async fn incident(blocked: usize) -> Vec<StatsSnapshot> {
    let mut env = Env::new().await;
    blocked_behind_a_running_head(&mut env, blocked).await;
    let mut others = std::collections::HashSet::new();
    for i in 0..OTHERS {
        others.insert(
            env.task(&[
                &format!("prn:file.repository:F{i}"),
                "shared:prn:core.domain:D2",
            ])
            .await,
        );
    }
    let mut leases = Vec::new();
    for n in 0..LEASES {
        leases.push(env.open(&format!("w{n}")).await);
    }
    // The resource queues have read the queue (as they have a second after it changed).
    env.settle_queues().await;
    let mut costs = Vec::new();
    // The costs are the passes' own; the background walks that renew the scan hint are not in
    // them, so they are bounded here: walks start at least the hint's age limit (1 s by
    // default) apart, one at a time, so a fetch that started one each time would show.
    let loop_started = std::time::Instant::now();
    let walks = env.broker().stats.snapshot().hint_walks;
    for i in 0..OTHERS {
        let lease = leases[i % LEASES].clone();
        let before = env.broker().stats.snapshot();
        let task = env
            .fetch(&lease)
            .await
            .expect("a task from the other domain");
        // The pass answers as soon as it has the grant; what it does after (the scan hint's
        // look-up) belongs to this fetch too.
        env.broker().passes.idle().await;
        costs.push(env.broker().stats.snapshot() - before);
        assert!(
            others.remove(&id(&task)),
            "fetch {i} handed out {:?}, not a D2 task",
            task.exclusive_resources
        );
    }
    assert!(others.is_empty());
    let walks = env.broker().stats.snapshot().hint_walks - walks;
    let most = loop_started.elapsed().as_secs() + 2;
    assert!(
        walks <= most,
        "{walks} background walks during {OTHERS} fetches (at most {most} expected)"
    );
    // For a failure's message: the sessions with a transaction open a second or longer (an open
    // writer of core_task keeps the resource queues' knowledge from moving), and the queues' size.
    let open: String = env
        .db
        .query_one(
            "SELECT coalesce(string_agg(state || ' since ' || (now() - xact_start)::text \
                 || ': ' || left(query, 60), '; '), 'none') \
             FROM pg_stat_activity \
             WHERE xact_start < now() - interval '1 second' AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    println!(
        "{blocked} blocked: transactions open 1 s or longer: {open}; resource queues hold {:?} tasks",
        env.broker().resource_queues.task_count()
    );
    assert!(
        env.fetch(&leases[0]).await.is_none(),
        "R0's queue stays blocked while its head runs"
    );
    env.shutdown().await;
    costs
}

#[tokio::test]
async fn other_domains_are_served_at_once_and_fetch_cost_does_not_grow_with_the_blocked_queue() {
    let small = incident(1_000).await;
    let large = incident(20_000).await;
    let summary = |costs: &[StatsSnapshot]| {
        let pg: Vec<u64> = costs.iter().map(|c| c.fetch_postgres_statements).collect();
        let redis: Vec<u64> = costs.iter().map(|c| c.fetch_redis_calls).collect();
        (
            *pg.iter().max().unwrap(),
            *redis.iter().max().unwrap(),
            pg,
            redis,
        )
    };
    let (pg_small, redis_small, pgs, rs) = summary(&small);
    let (pg_large, redis_large, pgl, rl) = summary(&large);
    println!("per-fetch cost with  1,000 blocked: postgres statements {pgs:?}, redis calls {rs:?}");
    println!("per-fetch cost with 20,000 blocked: postgres statements {pgl:?}, redis calls {rl:?}");
    // Not the same sequence at both sizes: a pass judges the rest of the page the last pass read
    // only within a second of that read (see `Carried`), so on a loaded machine a fetch now and
    // then reads a page of its own and the page reads shift. What must not happen is more of
    // them with the larger queue: at most one extra page read per page of fetches.
    let total = |costs: &[u64]| costs.iter().sum::<u64>();
    assert!(
        total(&pgl) <= total(&pgs) + (OTHERS / 8) as u64,
        "postgres statements grew with the blocked queue: {} at 20,000, {} at 1,000",
        total(&pgl),
        total(&pgs)
    );
    assert!(
        total(&rl) <= total(&rs) + (OTHERS / 8) as u64,
        "redis calls grew with the blocked queue: {} at 20,000, {} at 1,000",
        total(&rl),
        total(&rs)
    );
    // The candidate page, the claim, and the scan hint's look-up of what hides older tasks; a
    // pass without a hint also checks the resource queues' holders and lanes.
    assert!(
        pg_small <= 4 && pg_large <= 4,
        "a fetch took more than 4 statements"
    );
    // Lease check, acquire, and the check that the lease still holds the claimed task.
    assert!(
        redis_small <= 3 && redis_large <= 3,
        "a fetch took more than 3 redis calls"
    );
}

/// A broker (options adjusted by `tweak`) on a Postgres of the test's own that keeps statement
/// statistics (pg_stat_statements), and that Postgres.
async fn measured(
    tweak: impl FnOnce(&mut dispatch_broker::config::ServeArgs),
) -> (dispatch_testkit::Postgres, Env) {
    support::measured_env("own", &*support::BROKER_SCHEMA, tweak).await
}

/// Pages candidates.sql read since the last count, once every pass has ended.
async fn pages_when_idle(env: &Env) -> i64 {
    env.broker().passes.idle().await;
    candidate_pages(&env.db).await
}

/// Pages (8 kB buffers) candidates.sql read since the last call, all calls together.
async fn candidate_pages(db: &tokio_postgres::Client) -> i64 {
    support::statement_pages(db, &["%candidates.sql:%"]).await
}

/// Pages (8 kB buffers) candidates.sql read in each of `fetches` fetches with `wait` 0 after the
/// first, when every waiting task is blocked: `blocked` tasks on R0 behind its running head and
/// nothing else. Then checks the queue still moves: the head finishes, and the next fetch hands
/// out R0's oldest waiting task.
async fn all_blocked(blocked: usize, fetches: usize, queues: bool) -> (i64, Vec<i64>) {
    // No background walk renews the hint during the test: what is measured is the fetches.
    let (pg, mut env) = measured(|args| {
        args.fetch.hint_max_age = std::time::Duration::from_secs(3600);
        args.fetch.resource_queues = queues;
    })
    .await;
    let (busy, running) = blocked_behind_a_running_head(&mut env, blocked).await;
    env.settle_queues().await;
    let oldest: uuid::Uuid = env
        .db
        .query_one(
            "SELECT pulp_id FROM core_task WHERE state = 'waiting' \
             ORDER BY pulp_created, pulp_id LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let worker = env.open("w").await;
    let mut pages = Vec::new();
    candidate_pages(&env.db).await;
    for _ in 0..=fetches {
        assert!(env.fetch(&worker).await.is_none(), "R0's queue is blocked");
        pages.push(pages_when_idle(&env).await);
    }
    env.finish(&busy, &running, "completed").await;
    let next = env
        .fetch(&worker)
        .await
        .expect("R0's next task once its head finished");
    assert_eq!(id(&next), oldest, "R0's oldest waiting task comes next");
    env.shutdown().await;
    drop(pg);
    (pages[0], pages[1..].to_vec())
}

#[tokio::test]
async fn a_queue_whose_tasks_are_all_blocked_is_not_read_again_by_every_fetch() {
    let (first_small, small) = all_blocked(1_000, 5, false).await;
    let (first_large, large) = all_blocked(20_000, 5, false).await;
    println!("candidates.sql pages per fetch,  1,000 blocked: first {first_small}, then {small:?}");
    println!("candidates.sql pages per fetch, 20,000 blocked: first {first_large}, then {large:?}");
    // The measure sees the walk: the first fetch (no scan hint yet) reads the blocked queue.
    assert!(
        first_large > 10 * first_small.max(1) / 2,
        "the first fetch at 20,000 blocked read {first_large} pages, at 1,000 {first_small}"
    );
    // Every later fetch starts where the first stopped: at the end of the queue.
    let most_small = *small.iter().max().unwrap();
    let most_large = *large.iter().max().unwrap();
    assert!(
        most_large <= most_small + 8,
        "later fetches read {large:?} pages at 20,000 blocked, {small:?} at 1,000"
    );
}

/// With the resource queues (the default), not even the first fetch reads the blocked queue: it
/// starts where the queues say the first task that can be ready is, here the queue's end. (Without
/// them the first fetch reads it: the test above.) And the queue still moves: once the head
/// finishes, R0's oldest waiting task is handed out next.
#[tokio::test]
async fn with_the_resource_queues_no_fetch_reads_the_blocked_queue() {
    let (first_small, small) = all_blocked(1_000, 2, true).await;
    let (first_large, large) = all_blocked(20_000, 2, true).await;
    println!("candidates.sql pages per fetch,  1,000 blocked: first {first_small}, then {small:?}");
    println!("candidates.sql pages per fetch, 20,000 blocked: first {first_large}, then {large:?}");
    let most_small = first_small.max(*small.iter().max().unwrap());
    let most_large = first_large.max(*large.iter().max().unwrap());
    assert!(
        most_large <= most_small + 8,
        "fetches read {first_large}, {large:?} pages at 20,000 blocked, {first_small}, {small:?} at 1,000"
    );
}

/// Waits `pause`, fetches a task of D2 with a hint old enough that the fetch starts a background
/// walk, and waits for that walk to end. Returns the task and an upper bound of how long the walk
/// took (from the fetch's start to the walk counted).
///
/// The hint must be older than `--fetch-hint-max-age` and than ten times the last walk (walks are
/// spaced so: see `dispatch::refresh`); `pause` is chosen so. Blocked tasks inserted outside the
/// broker leave the hint of the pass that handed out R0's head in place, so even the first fetch
/// of a test may start a walk: the first call waits that walk out too.
async fn fetch_with_a_walk(
    env: &mut Env,
    worker: &str,
    pause: std::time::Duration,
) -> (dispatch_broker::proto::Task, std::time::Duration) {
    tokio::time::sleep(pause).await;
    let walks = env.broker().stats.snapshot().hint_walks;
    let started = std::time::Instant::now();
    let task = env.fetch(worker).await.expect("a task of D2");
    env.broker().passes.idle().await;
    support::eventually(std::time::Duration::from_secs(30), || async {
        env.broker().stats.snapshot().hint_walks > walks
    })
    .await
    .expect("a background walk renewed the hint");
    (task, started.elapsed())
}

/// How long to wait after a walk that took at most `walk` for the hint to be old enough for the
/// next: the age limit, or ten walks if longer.
fn until_the_next_walk(
    max_age: std::time::Duration,
    walk: std::time::Duration,
) -> std::time::Duration {
    max_age.max(walk * 10) + max_age
}

/// The background walk that renews an old scan hint (`--fetch-hint-max-age`) keeps the blocked
/// queue behind it: the fetch after the walk reads only what lies after the blocked tasks.
#[tokio::test]
async fn the_walk_that_renews_the_hint_keeps_the_blocked_queue_behind_it() {
    let max_age = std::time::Duration::from_millis(300);
    // Without the resource queues, so that the first fetch and its walk read from the head.
    let (pg, mut env) = measured(|args| {
        args.fetch.hint_max_age = max_age;
        args.fetch.resource_queues = false;
    })
    .await;
    blocked_behind_a_running_head(&mut env, 20_000).await;
    other_domain_tasks(&env, 3).await;
    let worker = env.open("w").await;
    candidate_pages(&env.db).await;
    // The first fetch's hint was set before the blocked tasks came: it and the walk it starts
    // read the blocked queue.
    let (first, walk) = fetch_with_a_walk(&mut env, &worker, max_age).await;
    let walked = candidate_pages(&env.db).await;
    // Once the walk's hint is old, the next fetch still uses it and starts the walk that renews
    // it.
    let (second, _) =
        fetch_with_a_walk(&mut env, &worker, until_the_next_walk(max_age, walk)).await;
    candidate_pages(&env.db).await;
    // The fetch after the walk starts from the walk's hint.
    let third = env.fetch(&worker).await.expect("a task of D2");
    let after_walk = pages_when_idle(&env).await;
    println!(
        "candidates.sql pages: first fetch and its walk {walked}, fetch after a walk {after_walk}"
    );
    assert!(
        after_walk * 10 < walked,
        "the fetch after the walk read {after_walk} pages, the first fetch and its walk {walked}"
    );
    let ids: std::collections::HashSet<_> = [id(&first), id(&second), id(&third)].into();
    assert_eq!(ids.len(), 3, "three different tasks of D2");
    env.shutdown().await;
    drop(pg);
}

/// A shared lock's release frees only tasks that need its resource exclusively: a scan hint whose
/// passed-over tasks use the resource shared, as every task of a Pulp domain does
/// (`shared:` + the domain), survives it, and the next fetch does not read the blocked queue
/// again.
#[tokio::test]
async fn a_shared_release_keeps_a_hint_that_reserves_the_name_only_shared() {
    // Without the resource queues, so that the first fetch reads the blocked queue and a
    // dropped hint would show.
    let (pg, mut env) = measured(|args| {
        args.fetch.hint_max_age = std::time::Duration::from_secs(3600);
        args.fetch.resource_queues = false;
    })
    .await;
    let domain = "shared:prn:core.domain:D2";
    blocked_behind_a_running_head(&mut env, 20_000).await;
    // Hidden behind R0's running head, and holding up `waits` (through Y), which the pass then
    // passes over: the hint reserves Y exclusively and the domain shared.
    env.task(&[REPO, "prn:file.repository:Y"]).await;
    let waits = env.task(&["prn:file.repository:Y", domain]).await;
    let first = env.task(&["prn:file.repository:F1", domain]).await;
    let second = env.task(&["prn:file.repository:F2", domain]).await;
    let worker = env.open("w").await;
    candidate_pages(&env.db).await;
    let task = env.fetch(&worker).await.expect("F1");
    assert_eq!(id(&task), first);
    let walked = pages_when_idle(&env).await;
    env.start(&worker, &task).await;
    // Releases F1's lock on F1 and its shared lock on the domain.
    env.finish(&worker, &task, "completed").await;
    let task = env.fetch(&worker).await.expect("F2");
    assert_eq!(id(&task), second);
    let after_release = pages_when_idle(&env).await;
    println!("candidates.sql pages: first fetch {walked}, fetch after the shared release {after_release}");
    assert!(
        after_release * 10 < walked,
        "the fetch after the shared release read {after_release} pages, the first fetch {walked}"
    );
    assert_eq!(
        env.state(waits).await,
        "waiting",
        "Y's older task still holds it up"
    );
    env.shutdown().await;
    drop(pg);
}

/// Pages (8 kB buffers) hiding.sql read since the last `candidate_pages`.
async fn hiding_pages(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT coalesce(sum(shared_blks_hit + shared_blks_read), 0)::bigint \
         FROM pg_stat_statements WHERE query LIKE '%hiding.sql:%'",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// A scan hint dropped for a reason other than its blocked resource's release (here a closed
/// lease puts a claim back, which may sit anywhere): pages of hiding.sql read by the first fetch
/// and by the fetch after the drop, and of candidates.sql by the fetch after the drop.
async fn after_a_dropped_hint(queues: bool) -> (i64, i64, i64) {
    let (pg, mut env) = measured(|args| {
        args.fetch.hint_max_age = std::time::Duration::from_secs(3600);
        args.fetch.resource_queues = queues;
    })
    .await;
    blocked_behind_a_running_head(&mut env, 20_000).await;
    other_domain_tasks(&env, 3).await;
    env.settle_queues().await;
    let worker = env.open("w").await;
    candidate_pages(&env.db).await;
    env.fetch(&worker).await.expect("a task of D2");
    env.broker().passes.idle().await;
    let first = hiding_pages(&env.db).await;
    // A claim goes back to the queue: every hint is dropped.
    let other = env.open("other").await;
    env.fetch(&other).await.expect("a task of D2");
    env.broker().passes.idle().await;
    env.client
        .close_lease(dispatch_broker::proto::CloseLeaseRequest { lease_id: other })
        .await
        .expect("close the lease");
    candidate_pages(&env.db).await;
    env.fetch(&worker).await.expect("a task of D2");
    env.broker().passes.idle().await;
    let after_drop = hiding_pages(&env.db).await;
    let walked = candidate_pages(&env.db).await;
    println!(
        "resource queues {queues}: hiding.sql pages: first fetch {first}, fetch after the drop \
         {after_drop} (candidates.sql {walked})"
    );
    env.shutdown().await;
    drop(pg);
    (first, after_drop, walked)
}

/// Without the resource queues, the pass after a dropped hint walks from the head but does not
/// count the blocked resource's queue again: the dropped hint knew that its name hides tasks,
/// and it is still held.
#[tokio::test]
async fn a_dropped_hint_does_not_make_the_next_pass_count_the_blocked_queue_again() {
    let (first, after_drop, walked) = after_a_dropped_hint(false).await;
    assert!(
        walked > 200,
        "the fetch after the drop walked from the head: {walked} pages"
    );
    assert!(
        after_drop * 10 < first,
        "the fetch after the drop counted {after_drop} pages of hiding.sql, the first {first}"
    );
}

/// With the resource queues, neither: the pass after the drop starts where they say, and they
/// know which held names hide tasks (not even the first fetch counts R0's queue).
#[tokio::test]
async fn with_the_resource_queues_a_dropped_hint_costs_no_walk_from_the_head() {
    let (_, _, walked_from_head) = after_a_dropped_hint(false).await;
    let (first, after_drop, walked) = after_a_dropped_hint(true).await;
    assert!(
        walked * 10 < walked_from_head,
        "the fetch after the drop read {walked} pages of candidates.sql, {walked_from_head} without the queues"
    );
    assert!(
        first < 50 && after_drop < 50,
        "hiding.sql read {first} pages in the first fetch and {after_drop} after the drop"
    );
}

/// A task this broker finishes (FinishTask) leaves its resource queues at once, so the check of
/// the next pass's start does not read it (a primary-key probe per finished task, which at a
/// busy fleet's pace was most of what those checks read).
#[tokio::test]
async fn a_task_finished_through_the_broker_leaves_the_resource_queues_at_once() {
    let mut env = Env::new().await;
    env.free_tasks("prn:file.repository:Q", 3).await;
    env.settle_queues().await;
    let queues = std::sync::Arc::clone(&env.broker().resource_queues);
    let queued = || queues.task_count();
    assert_eq!(queued(), Some(3));
    let lease = env.open("worker").await;
    let task = env.fetch(&lease).await.expect("a task");
    env.start(&lease, &task).await;
    assert_eq!(queued(), Some(3), "a running task is still incomplete");
    env.finish(&lease, &task, "completed").await;
    assert_eq!(
        queued(),
        Some(2),
        "the finished task is still in the queues"
    );
    env.shutdown().await;
}

/// ... but only once its locks are released: a pass that read the lock held (and skipped what
/// it hides) must not find the queues saying the name hides nothing. The finish is held on the
/// task's row until Redis is frozen, so it records the final state and then waits to release:
/// the task is still in the queues meanwhile, and leaves them once the release went through.
#[tokio::test]
async fn a_finished_task_leaves_the_resource_queues_only_after_its_locks_are_released() {
    let mut env = Env::new().await;
    env.free_tasks("prn:file.repository:Q", 2).await;
    env.settle_queues().await;
    let queues = std::sync::Arc::clone(&env.broker().resource_queues);
    let lease = env.open("worker").await;
    let task = env.fetch(&lease).await.expect("a task");
    env.start(&lease, &task).await;
    let id: Uuid = task.task_id.parse().unwrap();
    let blocker = crate::support::RowLock::take(&env.db_url, id).await;
    let finishing = {
        let mut client = env.client.clone();
        let request = crate::support::finish_request(lease.as_str(), &task, "completed");
        tokio::spawn(async move { client.finish_task(request).await })
    };
    // The holder check is done (the finish waits on the row): freeze Redis, then let it go on.
    crate::support::sessions_wait_on_locks(&env, 1).await;
    env.redis.pause();
    blocker.rollback().await;
    while env.state(id).await != "completed" {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        queues.task_count(),
        Some(2),
        "the task left the queues while its lock was still held"
    );
    env.redis.resume();
    finishing
        .await
        .unwrap()
        .expect("the finish went through once Redis was back");
    assert_eq!(queues.task_count(), Some(1));
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

/// The resource queues never hide a task behind one that ended outside the broker: W waits
/// behind a running task and holds up Z; Pulp cancels W in Postgres alone (no lock released, so
/// nothing is recorded in Redis). When the next pass has no hint, the queues' check finds W gone
/// and the pass starts before Z, which is handed out before the newer task O2.
#[tokio::test]
async fn a_task_that_ended_outside_the_broker_does_not_hide_the_tasks_behind_it() {
    let mut env = Env::with(|args| {
        args.fetch.hint_max_age = std::time::Duration::from_secs(3600);
    })
    .await;
    let head = env.task(&["prn:file.repository:R9"]).await;
    let busy = env.open("busy").await;
    let running = env.fetch(&busy).await.expect("the head task");
    assert_eq!(id(&running), head);
    env.start(&busy, &running).await;
    let w = env
        .task(&["prn:file.repository:R9", "prn:file.repository:R1"])
        .await;
    let z = env.task(&["prn:file.repository:R1"]).await;
    env.task(&["prn:file.repository:O1"]).await;
    let o2 = env.task(&["prn:file.repository:O2"]).await;
    env.settle_queues().await;
    let worker = env.open("w").await;
    let first = env.fetch(&worker).await.expect("O1");
    assert_ne!(id(&first), z, "Z waits for W");
    env.broker().passes.idle().await;
    // Pulp cancels W in Postgres alone.
    env.db
        .execute(
            "UPDATE core_task SET state = 'canceled' WHERE pulp_id = $1",
            &[&w],
        )
        .await
        .unwrap();
    // A claim goes back to the queue: the hint is dropped, the next pass asks the queues.
    let other = env.open("other").await;
    assert_eq!(id(&env.fetch(&other).await.expect("O2")), o2);
    env.broker().passes.idle().await;
    env.client
        .close_lease(dispatch_broker::proto::CloseLeaseRequest { lease_id: other })
        .await
        .expect("close the lease");
    // (Were W's end not found by the queues' check, they would put the start after Z and the
    // pass would hand out O2: checked by breaking the check.)
    let next = env.fetch(&worker).await.expect("Z");
    assert_eq!(id(&next), z, "Z is the oldest ready task once W ended");
    env.shutdown().await;
}

/// Pages of candidates.sql that one background walk read, 20,000 tasks blocked behind R0's
/// running head: the pages of the walk and the fetch that started it, less those of a fetch
/// without a walk right after.
async fn pages_of_a_walk(queues: bool) -> i64 {
    let max_age = std::time::Duration::from_millis(300);
    let (pg, mut env) = measured(|args| {
        args.fetch.hint_max_age = max_age;
        args.fetch.resource_queues = queues;
    })
    .await;
    blocked_behind_a_running_head(&mut env, 20_000).await;
    other_domain_tasks(&env, 4).await;
    env.settle_queues().await;
    let worker = env.open("w").await;
    // (The hint of the pass that handed out R0's head is old by now: this fetch starts a walk.)
    let (_, walk) = fetch_with_a_walk(&mut env, &worker, max_age).await;
    // The next walk, with the fetch that starts it (it may end before the fetch's pass does).
    candidate_pages(&env.db).await;
    fetch_with_a_walk(&mut env, &worker, until_the_next_walk(max_age, walk)).await;
    let with_the_fetch = candidate_pages(&env.db).await;
    // A fetch alone: the walk's hint is fresh.
    let walks = env.broker().stats.snapshot().hint_walks;
    env.fetch(&worker).await.expect("a task of D2");
    let fetch_alone = pages_when_idle(&env).await;
    assert_eq!(
        env.broker().stats.snapshot().hint_walks,
        walks,
        "no walk beside the fetch alone"
    );
    env.shutdown().await;
    drop(pg);
    println!(
        "queues {queues}: a walk and its fetch {with_the_fetch} pages, a fetch alone {fetch_alone}"
    );
    (with_the_fetch - fetch_alone).max(0)
}

/// With the resource queues the walk that renews the hint starts where they say, as a pass does:
/// it does not read the blocked queue every time (without them it does).
#[tokio::test]
async fn with_the_resource_queues_the_walk_does_not_read_the_blocked_queue() {
    let from_head = pages_of_a_walk(false).await;
    let with_queues = pages_of_a_walk(true).await;
    println!("candidates.sql pages of one walk: {from_head} from the head, {with_queues} with the resource queues");
    // (A walk with the queues reads the tasks after where they say, about 25-40 pages here; one
    // that read a fifth of the blocked queue would fail.)
    assert!(
        with_queues * 5 < from_head,
        "the walk read {with_queues} pages with the queues, {from_head} from the head"
    );
}

/// An open writer of core_task (here a transaction that stays open after an UPDATE, as an idle
/// Pulp session may) keeps the resource queues' knowledge from moving past its start. Passes
/// still take from them that R0's name hides tasks (it hides them before that point, so before
/// any later one) and do not count R0's queue with hiding.sql.
#[tokio::test]
async fn an_open_writer_does_not_make_passes_count_the_blocked_queue() {
    let (pg, mut env) = measured(|args| {
        args.fetch.hint_max_age = std::time::Duration::from_secs(3600);
    })
    .await;
    blocked_behind_a_running_head(&mut env, 20_000).await;
    env.settle_queues().await;
    let (writer, conn) = tokio_postgres::connect(&env.db_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    writer
        .batch_execute("BEGIN; UPDATE core_task SET name = name WHERE false")
        .await
        .unwrap();
    // Tasks that arrive after the writer began: past where the queues' knowledge now ends.
    other_domain_tasks(&env, 3).await;
    env.settle_queues().await;
    let worker = env.open("w").await;
    candidate_pages(&env.db).await;
    for _ in 0..3 {
        env.fetch(&worker).await.expect("a task of D2");
        env.broker().passes.idle().await;
    }
    let counted = hiding_pages(&env.db).await;
    println!("hiding.sql pages in three fetches with a writer open: {counted}");
    assert!(
        counted < 50,
        "hiding.sql read {counted} pages: R0's queue was counted"
    );
    writer.batch_execute("ROLLBACK").await.unwrap();
    env.shutdown().await;
    drop(pg);
}

/// A measured broker (no background walk) with R0's head running, `blocked` tasks on R0 behind
/// it and five tasks of another domain after them, the resource queues caught up; the head's
/// lease and task.
async fn head_then_five_others(
    blocked: usize,
) -> (
    dispatch_testkit::Postgres,
    Env,
    String,
    dispatch_broker::proto::Task,
) {
    let (pg, mut env) = measured(|args| {
        args.fetch.hint_max_age = std::time::Duration::from_secs(3600);
    })
    .await;
    let (busy, running) = blocked_behind_a_running_head(&mut env, blocked).await;
    other_domain_tasks(&env, 5).await;
    env.settle_queues().await;
    (pg, env, busy, running)
}

/// Pages candidates.sql read in each of four fetches after R0's head finished, `blocked` tasks
/// on R0 behind it and five tasks of another domain after them: the first hands out R0's next
/// task, the others the other domain's.
async fn pages_after_the_head_finished(blocked: usize) -> Vec<i64> {
    let (pg, mut env, busy, running) = head_then_five_others(blocked).await;
    let worker = env.open("w").await;
    env.fetch(&worker).await.expect("F0");
    env.broker().passes.idle().await;
    env.finish(&busy, &running, "completed").await;
    candidate_pages(&env.db).await;
    let mut pages = Vec::new();
    let first = env.fetch(&worker).await.expect("R0's next task");
    pages.push(pages_when_idle(&env).await);
    assert!(
        first.exclusive_resources.iter().any(|r| r == REPO),
        "R0's next task comes first once its head finished"
    );
    for _ in 0..3 {
        env.fetch(&worker).await.expect("a task of D2");
        pages.push(pages_when_idle(&env).await);
    }
    env.shutdown().await;
    drop(pg);
    pages
}

/// Once R0's head finishes, neither the fetch that hands out R0's next task nor the ones after
/// it read R0's queue.
#[tokio::test]
async fn after_the_head_finishes_no_fetch_reads_the_blocked_queue() {
    let small = pages_after_the_head_finished(1_000).await;
    let large = pages_after_the_head_finished(20_000).await;
    support::no_fetch_reads_more_at_20_000(
        "of candidates.sql after the head finished",
        &small,
        &large,
    );
}

/// Pages candidates.sql read while three waiting calls were served after R0's head finished: R0's
/// next task to the longest waiter, tasks of another domain (queued behind R0's `blocked` tasks,
/// inserted without a wake-up) to the others.
async fn pages_serving_waiters_after_the_head(blocked: usize) -> i64 {
    let (pg, mut env) = measured(|args| {
        args.fetch.hint_max_age = std::time::Duration::from_secs(3600);
        args.fetch.recheck = std::time::Duration::from_secs(3600);
        args.fetch.wake_poll = std::time::Duration::from_secs(3600);
    })
    .await;
    let (busy, running) = blocked_behind_a_running_head(&mut env, blocked).await;
    let mut waiting = Vec::new();
    for i in 0..3 {
        let lease = env.open(&format!("w{i}")).await;
        let mut client = env.client.clone();
        let request = dispatch_broker::proto::FetchTaskRequest {
            wait: Some(std::time::Duration::from_secs(30).try_into().unwrap()),
            ..support::fetch_request(&lease)
        };
        waiting.push(tokio::spawn(async move {
            client
                .fetch_task(request)
                .await
                .map(|r| r.into_inner().task)
        }));
        support::eventually(std::time::Duration::from_secs(10), || async {
            env.broker().waiters.len() > i
        })
        .await
        .expect("the fetch waits");
    }
    for i in 0..2 {
        env.tasks_bulk(
            1,
            &[
                &format!("prn:file.repository:F{i}"),
                "shared:prn:core.domain:D2",
            ],
        )
        .await;
    }
    env.settle_queues().await;
    candidate_pages(&env.db).await;
    env.finish(&busy, &running, "completed").await;
    let mut got = Vec::new();
    for handle in waiting {
        let task = tokio::time::timeout(std::time::Duration::from_secs(20), handle)
            .await
            .expect("the waiting fetch returned")
            .unwrap()
            .unwrap()
            .expect("a task");
        got.push(task);
    }
    let pages = pages_when_idle(&env).await;
    assert!(
        got[0].exclusive_resources.iter().any(|r| r == REPO),
        "R0's next task goes to the longest waiter"
    );
    env.shutdown().await;
    drop(pg);
    pages
}

/// Once R0's next task is handed out, the waiting calls after it do not read R0's queue to reach
/// their tasks: their passes' hint ends before it, and they start where the resource queues say
/// (without that, 613 pages at 20,000 blocked against 116 at 1,000).
#[tokio::test]
async fn the_waiting_calls_served_after_the_head_finishes_do_not_read_the_blocked_queue() {
    let small = pages_serving_waiters_after_the_head(1_000).await;
    let large = pages_serving_waiters_after_the_head(20_000).await;
    println!(
        "candidates.sql pages while serving the waiting calls: {small} at 1,000, {large} at 20,000"
    );
    // (R0's queue is about 500 pages at 20,000; how many passes serve the three calls varies.)
    assert!(
        large <= small * 3 / 2 + 100,
        "serving them read {large} pages at 20,000 blocked, {small} at 1,000"
    );
}

/// Pages candidates.sql read in each of three fetches that pass R0's next task over (it is in
/// their `skip_task_ids`, as for a worker that cannot run it) once R0's head finished, with
/// `blocked` tasks on R0 behind it and five tasks of another domain after them.
async fn pages_passing_the_next_task_over(blocked: usize) -> Vec<i64> {
    let (pg, mut env, busy, running) = head_then_five_others(blocked).await;
    env.finish(&busy, &running, "completed").await;
    let next: Uuid = env
        .db
        .query_one(
            "SELECT pulp_id FROM core_task WHERE state = 'waiting' \
             ORDER BY pulp_created, pulp_id LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let worker = env.open("w").await;
    candidate_pages(&env.db).await;
    let mut pages = Vec::new();
    for _ in 0..3 {
        let task = env
            .try_fetch(&worker, &[next])
            .await
            .unwrap()
            .expect("a task of D2");
        assert!(
            task.exclusive_resources.iter().all(|r| r != REPO),
            "the fetch hands out a task of the other domain"
        );
        pages.push(pages_when_idle(&env).await);
    }
    env.shutdown().await;
    drop(pg);
    pages
}

/// A fetch that passes over R0's next task (ready, but not for this worker) does not read R0's
/// queue to reach the other domain's tasks behind it: the resource queues say where the next
/// page may start.
#[tokio::test]
async fn a_fetch_that_passes_the_next_task_over_does_not_read_the_blocked_queue() {
    let small = pages_passing_the_next_task_over(1_000).await;
    let large = pages_passing_the_next_task_over(20_000).await;
    support::no_fetch_reads_more_at_20_000(
        "of candidates.sql passing R0's next task over",
        &small,
        &large,
    );
}
