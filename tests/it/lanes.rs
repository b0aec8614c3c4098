//! The lane gauge: equal to Pulp's algorithm on every queue, shared across replicas, served with
//! its age when computing fails; the Prometheus endpoint; KEDA's external scaler over gRPC.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use crate::support::{eventually, metric, own_postgres, BrokerProcess, Env};
use dispatch_broker::externalscaler::external_scaler_client::ExternalScalerClient;
use dispatch_broker::externalscaler::{GetMetricsRequest, ScaledObjectRef};
use dispatch_broker::metrics::Stats;
use dispatch_broker::tasks::Tasks;
use proptest::prelude::*;
use tonic::Code;

/// Pulp's algorithm, loaded all at once (`testkit::reference_lanes`).
async fn pulp_reference(db: &tokio_postgres::Client) -> u64 {
    dispatch_testkit::reference_lanes(db).await.unwrap()
}

/// A fresh database and a client that inserts tasks as they are (the insert trigger bypassed).
async fn fresh_queue() -> (String, tokio_postgres::Client) {
    let url = tokio::task::spawn_blocking(support::fresh_database)
        .await
        .unwrap();
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    db.batch_execute("SET session_replication_role = replica")
        .await
        .unwrap();
    (url, db)
}

#[derive(Debug, Clone)]
struct Row {
    record: Vec<String>,
    state: &'static str,
    /// Seconds in the past; small range so equal timestamps are common.
    age: u8,
}

fn arb_rows() -> impl Strategy<Value = Vec<Row>> {
    let entry = (0..5u8, prop::bool::weighted(0.4))
        .prop_map(|(r, shared)| format!("{}r{r}", if shared { "shared:" } else { "" }));
    let state = prop::sample::select(vec![
        "waiting",
        "waiting",
        "waiting",
        "running",
        "canceling",
        "completed",
    ]);
    let row = (prop::collection::vec(entry, 0..4), state, 0..4u8)
        .prop_map(|(record, state, age)| Row { record, state, age });
    prop::collection::vec(row, 0..300)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    /// Random queues, dense conflicts, mixed modes, many equal timestamps: the broker's count is
    /// Pulp's count.
    #[test]
    fn lanes_equal_pulps_algorithm_on_random_queues(rows in arb_rows()) {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async move {
            let (url, db) = fresh_queue().await;
            for row in &rows {
                db.execute(
                    "INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
                     VALUES (gen_random_uuid(), date_trunc('second', now()) - make_interval(secs => $1), 't', $2, $3)",
                    &[&(f64::from(row.age) + 1.0), &row.state, &row.record],
                )
                .await
                .unwrap();
            }
            let tasks = Tasks::connect(&url, 1, Duration::from_secs(5), Arc::new(Stats::default()))
                .await
                .unwrap();
            let broker = tasks.lanes(Duration::ZERO, 10).await.unwrap().lanes;
            let reference = pulp_reference(&db).await;
            assert_eq!(broker, reference, "{rows:?}");
        });
    }
}

/// The task store of a test database (one connection).
async fn store(url: &str) -> Tasks {
    Tasks::connect(url, 1, Duration::from_secs(5), Arc::new(Stats::default()))
        .await
        .unwrap()
}

/// Brings `counter` up to date, walking at most `walk_pages` pages before looking up by name;
/// fails if the pass fell back to a full one.
async fn maintained(
    tasks: &Tasks,
    counter: dispatch_broker::ready::LaneCounter,
    walk_pages: usize,
) -> dispatch_broker::ready::LaneCounter {
    let reads = dispatch_broker::tasks::LaneReads {
        walk_pages,
        ..Default::default()
    };
    tasks
        .maintain_lanes(counter, Duration::ZERO, reads)
        .await
        .unwrap()
        .expect("maintained without a full pass")
}

/// What happens to one task between two passes of the gauge.
#[derive(Debug, Clone, Copy)]
enum Change {
    Stays,
    Starts,
    Ends(&'static str),
    Deleted,
}

fn arb_changes() -> impl Strategy<Value = Vec<Change>> {
    let change = prop_oneof![
        4 => Just(Change::Stays),
        1 => Just(Change::Starts),
        1 => Just(Change::Ends("completed")),
        1 => Just(Change::Ends("canceled")),
        1 => Just(Change::Ends("canceling")),
        1 => Just(Change::Deleted),
    ];
    prop::collection::vec(change, 0..300)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    /// Between two passes tasks start, end, are canceled or deleted (heads, lanes and tasks deep
    /// in the queue alike) and new ones arrive: the maintained count is Pulp's count, whether
    /// the places are repaired by name or by walking the queue.
    #[test]
    fn a_maintained_count_is_pulps_count_after_any_changes(
        rows in arb_rows(),
        changes in arb_changes(),
        arrivals in arb_rows(),
        walk_pages in prop::sample::select(vec![0usize, 8]),
    ) {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async move {
            let (url, db) = fresh_queue().await;
            let insert = "INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
                          VALUES (gen_random_uuid(), date_trunc('second', now()) - make_interval(secs => $1), 't', $2, $3) \
                          RETURNING pulp_id";
            let mut ids = Vec::new();
            for row in &rows {
                let id: uuid::Uuid = db
                    .query_one(insert, &[&(f64::from(row.age) + 10.0), &row.state, &row.record])
                    .await
                    .unwrap()
                    .get(0);
                ids.push(id);
            }
            let tasks = store(&url).await;
            let counter = tasks.count_lanes(Duration::ZERO, usize::MAX).await.unwrap();
            assert_eq!(counter.lanes(), pulp_reference(&db).await);
            for (id, change) in ids.iter().zip(&changes) {
                match change {
                    Change::Stays => {}
                    Change::Starts => {
                        db.execute("UPDATE core_task SET state = 'running' WHERE pulp_id = $1 AND state = 'waiting'", &[id]).await.unwrap();
                    }
                    Change::Ends(state) => {
                        db.execute("UPDATE core_task SET state = $2 WHERE pulp_id = $1 AND state IN ('waiting', 'running')", &[id, state]).await.unwrap();
                    }
                    Change::Deleted => {
                        db.execute("DELETE FROM core_task WHERE pulp_id = $1", &[id]).await.unwrap();
                    }
                }
            }
            // Newer than every task counted (at most 4 s apart among themselves).
            for row in &arrivals {
                db.execute(insert, &[&(f64::from(row.age) + 1.0), &row.state, &row.record])
                    .await
                    .unwrap();
            }
            // No walk: every place repaired by name; eight pages: the walk reaches the end.
            let counter = maintained(&tasks, counter, walk_pages).await;
            assert_eq!(
                counter.lanes(),
                pulp_reference(&db).await,
                "{rows:?}\n{changes:?}\n{arrivals:?}"
            );
        });
    }
}

/// A database with these tasks, oldest first (one millisecond apart, ten seconds ago).
async fn queue_of(records: &[Vec<String>]) -> (String, tokio_postgres::Client, Vec<uuid::Uuid>) {
    let (url, db) = fresh_queue().await;
    let mut ids = Vec::new();
    for (i, record) in records.iter().enumerate() {
        let id: uuid::Uuid = db
            .query_one(
                "INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
                 VALUES (gen_random_uuid(), now() - interval '10 seconds' + make_interval(secs => $1), 't', 'waiting', $2) \
                 RETURNING pulp_id",
                &[&(i as f64 / 1000.0), record],
            )
            .await
            .unwrap()
            .get(0);
        ids.push(id);
    }
    (url, db, ids)
}

fn record(entries: &[&str]) -> Vec<String> {
    entries.iter().map(|e| e.to_string()).collect()
}

#[tokio::test]
async fn a_walk_that_stops_before_a_successor_is_continued_by_name() {
    // The head of x (sharing y) ends; x's and y's next users sit behind 600 tasks on r, past
    // the one page the walk may read.
    let mut records = vec![record(&["x", "shared:y"])];
    // More than one page of lanes_page.sql (512).
    records.extend((0..600).map(|_| record(&["r"])));
    records.push(record(&["x"]));
    records.push(record(&["y"]));
    let (url, db, ids) = queue_of(&records).await;
    let tasks = store(&url).await;
    let counter = tasks.count_lanes(Duration::ZERO, usize::MAX).await.unwrap();
    assert_eq!(counter.lanes(), 2);
    db.execute(
        "UPDATE core_task SET state = 'completed' WHERE pulp_id = $1",
        &[&ids[0]],
    )
    .await
    .unwrap();
    let counter = maintained(&tasks, counter, 1).await;
    // r's head, x's next user, y's exclusive user.
    assert_eq!(counter.lanes(), 3);
    assert_eq!(counter.lanes(), pulp_reference(&db).await);
}

#[tokio::test]
async fn a_writing_transaction_open_longer_than_the_cutoff_makes_the_next_pass_full() {
    let (url, _db, _) = queue_of(&[record(&["a"])]).await;
    let tasks = store(&url).await;
    let cutoff = Duration::from_millis(300);
    let counter = tasks.count_lanes(cutoff, usize::MAX).await.unwrap();
    assert!(counter.maintainable(), "no transaction open yet");
    let session = || async {
        let (other, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        other
    };
    // A transaction that only reads, however old, inserts nothing.
    let reader = session().await;
    reader
        .batch_execute("BEGIN; SELECT count(*) FROM core_task")
        .await
        .unwrap();
    // Another session inserts a task created before every task counted (a slow request, its
    // clock) and has not committed: a maintained pass would never look behind its watermark.
    let writer = session().await;
    writer
        .batch_execute(
            "BEGIN; INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
             VALUES (gen_random_uuid(), now() - interval '20 seconds', 't', 'waiting', ARRAY['b'])",
        )
        .await
        .unwrap();
    // Young (under the cut-off of 30 s here), the writer is no concern yet.
    let counter = tasks
        .maintain_lanes(counter, Duration::from_secs(30), Default::default())
        .await
        .unwrap()
        .expect("maintained");
    assert!(counter.maintainable(), "a young writer makes no pass full");
    tokio::time::sleep(cutoff * 2).await;
    let counter = tasks
        .maintain_lanes(counter, cutoff, Default::default())
        .await
        .unwrap()
        .expect("this pass is still maintained");
    assert!(
        !counter.maintainable(),
        "the next pass must read the whole queue"
    );
    // A full pass taken while the writer is open is no better.
    let full = tasks.count_lanes(cutoff, usize::MAX).await.unwrap();
    assert!(!full.maintainable());
    writer.batch_execute("COMMIT").await.unwrap();
    assert!(tasks
        .maintain_lanes(counter, cutoff, Default::default())
        .await
        .unwrap()
        .is_none());
    let counter = tasks.count_lanes(cutoff, usize::MAX).await.unwrap();
    assert_eq!(
        counter.lanes(),
        2,
        "the late task is counted by the full pass"
    );
    assert!(counter.maintainable(), "the old reader is no concern");
    reader.batch_execute("COMMIT").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lanes_index_the_gauge_reads_the_whole_queue_every_time() {
    let env = gauge_env(Duration::from_secs(3600)).await;
    env.task(&["a"]).await;
    let (db, conn) = tokio_postgres::connect(&env.db_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    db.batch_execute("DROP INDEX dispatch_lanes_idx")
        .await
        .unwrap();
    let lanes = Arc::clone(&env.broker().lanes);
    past_cutoff().await;
    assert_eq!(lanes.compute(true).await.unwrap(), "full");
    assert_eq!(lanes.compute(false).await.unwrap(), "full");
    assert_eq!(lanes.current().lanes, 1);
    env.shutdown().await;
}

/// A world whose broker's gauge settings are those of the broker processes below
/// (`--lane-cutoff 0s --lane-interval 100ms --lane-refresh 50ms`): its lanes lock lapses 100 ms
/// after it stops, so a process started then is the one replica that counts.
fn quick_gauge(a: &mut dispatch_broker::config::ServeArgs) {
    a.lanes.cutoff = Duration::ZERO;
    a.lanes.interval = Duration::from_millis(100);
    a.lanes.refresh = Duration::from_millis(50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gauge_is_served_to_prometheus_with_the_other_metrics() {
    // A broker process of its own, the only replica: its /metrics shows its own series only.
    let mut env = Env::with(quick_gauge).await;
    env.broker.take().unwrap().shutdown().await.unwrap();
    env.task(&["a"]).await;
    env.task(&["a"]).await;
    env.task(&["b"]).await;
    let broker = BrokerProcess::start(
        &env.db_url,
        &env.redis.url(),
        &[
            "--lane-cutoff",
            "0s",
            "--lane-interval",
            "100ms",
            "--lane-refresh",
            "50ms",
        ],
        &[],
    )
    .await;
    let mut client = broker.client().await;
    let lease = support::open_on(&mut client, "w").await;
    assert!(support::fetch_on(&mut client, &lease).await.is_some());
    // Two lanes (a, and b), one live lease: Pulp's KEDA gauge is one.
    let served = eventually(Duration::from_secs(10), || async {
        let page = broker.metrics().await;
        metric(&page, "dispatch_lanes") == Some(2.0)
            && metric(&page, "dispatch_live_leases") == Some(1.0)
    })
    .await;
    let page = broker.metrics().await;
    assert!(served.is_some(), "two lanes and one live lease:\n{page}");
    assert_eq!(metric(&page, "dispatch_waiting_tasks"), Some(1.0), "{page}");
    assert_eq!(
        metric(&page, "dispatch_fetch_total{outcome=\"claimed\"}"),
        Some(1.0),
        "its one fetch, and no other broker's:\n{page}"
    );
    for name in [
        "dispatch_lane_age_seconds ",
        "dispatch_rpc_duration_seconds_bucket{method=\"FetchTask\",status=\"Ok\"",
        "dispatch_fetch_postgres_statements_bucket",
        "dispatch_fetch_redis_calls_bucket",
        "dispatch_postgres_statements_total",
        "# HELP dispatch_lanes",
        "dispatch_lane_passes_total{kind=\"full\"}",
    ] {
        assert!(page.contains(name), "/metrics lacks {name}:\n{page}");
    }
}

/// The cut-off of [`gauge_env`]'s gauge: not zero, so that a statement of the broker writing
/// to the task table at the moment of a pass (open for milliseconds) is no late writer.
const GAUGE_CUTOFF: Duration = Duration::from_millis(500);

/// A broker whose gauge computes only when a test asks (`Lanes::compute`), with a full pass
/// every `full_interval`.
async fn gauge_env(full_interval: Duration) -> Env {
    Env::with(|a| {
        a.lanes.cutoff = GAUGE_CUTOFF;
        a.lanes.interval = Duration::from_secs(3600);
        a.lanes.full_interval = full_interval;
    })
    .await
}

/// Waits until the tasks inserted so far are older than [`GAUGE_CUTOFF`].
async fn past_cutoff() {
    tokio::time::sleep(GAUGE_CUTOFF + Duration::from_millis(100)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn between_full_passes_the_gauge_counts_what_changed() {
    let mut env = gauge_env(Duration::from_secs(3600)).await;
    let head = env.task(&["a"]).await;
    env.task(&["a"]).await;
    env.task(&["shared:d", "b"]).await;
    let lanes = Arc::clone(&env.broker().lanes);
    past_cutoff().await;
    assert_eq!(lanes.compute(true).await.unwrap(), "full");
    assert_eq!(lanes.current().lanes, 2);
    let (survey, _) = lanes.survey().await.unwrap().expect("a full pass surveys");
    assert_eq!(survey[0].head.0, head);
    // The head of a's queue ends; an exclusive user of d and a task on c arrive.
    let lease = env.open("w").await;
    let task = env.fetch(&lease).await.expect("the head of a");
    assert_eq!(support::id(&task), head);
    env.start(&lease, &task).await;
    env.finish(&lease, &task, "completed").await;
    env.task(&["d"]).await;
    env.task(&["c"]).await;
    past_cutoff().await;
    assert_eq!(lanes.compute(false).await.unwrap(), "maintained");
    // a's second task, the shared user of d, c; the exclusive user of d waits.
    assert_eq!(lanes.current().lanes, 3);
    // The survey is a full pass's: still the one that named the old head.
    let (survey, _) = lanes.survey().await.unwrap().unwrap();
    assert_eq!(survey[0].head.0, head);
    assert_eq!(lanes.compute(true).await.unwrap(), "full");
    assert_eq!(lanes.current().lanes, 3);
    let (survey, _) = lanes.survey().await.unwrap().unwrap();
    assert!(survey.iter().all(|b| b.head.0 != head), "{survey:?}");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_the_full_interval_passes_the_gauge_reads_the_whole_queue_again() {
    let env = gauge_env(Duration::ZERO).await;
    env.task(&["a"]).await;
    let lanes = Arc::clone(&env.broker().lanes);
    past_cutoff().await;
    lanes.compute(true).await.unwrap();
    assert_eq!(lanes.compute(false).await.unwrap(), "full");
    assert_eq!(lanes.current().lanes, 1);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_one_computation_per_interval() {
    let env = Env::with(|a| {
        a.lanes.cutoff = Duration::ZERO;
        a.lanes.interval = Duration::from_secs(3600);
        a.lanes.refresh = Duration::from_millis(50);
    })
    .await;
    let mut args = env.args.clone();
    args.listen = "127.0.0.1:0".parse().unwrap();
    args.metrics_listen = "127.0.0.1:0".parse().unwrap();
    let first = Arc::clone(&env.broker().lanes);
    eventually(Duration::from_secs(10), || async {
        first.current().computed_at_ms > 0
    })
    .await
    .expect("computed once");
    let stamp = first.current().computed_at_ms;
    let served = first.current().lanes;
    // Tasks arrive, but the shared value is not due for an hour: a second replica serves the
    // same computation instead of running its own.
    env.task(&["a"]).await;
    env.task(&["b"]).await;
    let second = dispatch_broker::server::start(&args).await.unwrap();
    let lanes2 = Arc::clone(&second.lanes);
    eventually(Duration::from_secs(10), || async {
        lanes2.current().computed_at_ms > 0
    })
    .await
    .expect("the second replica serves the shared value");
    assert_eq!(
        second.lanes.current().computed_at_ms,
        stamp,
        "computed again within the interval"
    );
    assert_eq!(
        second.lanes.current().lanes,
        served,
        "the shared, cached value"
    );
    assert_eq!(first.current().computed_at_ms, stamp);
    second.shutdown().await.unwrap();
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_computing_fails_the_last_value_is_served_with_its_age() {
    let (mut pg, url) = tokio::task::spawn_blocking(own_postgres).await.unwrap();
    let redis = tokio::task::spawn_blocking(|| dispatch_testkit::Redis::start().unwrap())
        .await
        .unwrap();
    let env = Env::on(url, redis, |a| {
        a.lanes.cutoff = Duration::ZERO;
        a.lanes.interval = Duration::from_millis(100);
        a.lanes.refresh = Duration::from_millis(50);
        a.backend_timeout = Duration::from_millis(300);
    })
    .await;
    env.task(&["a"]).await;
    let lanes = Arc::clone(&env.broker().lanes);
    eventually(Duration::from_secs(10), || async {
        lanes.current().lanes == 1
    })
    .await
    .expect("one lane");
    tokio::task::block_in_place(|| pg.kill());
    // No computation succeeds any more: the served value's age grows past several intervals
    // (100 ms) while the value stays.
    eventually(Duration::from_secs(20), || async {
        lanes.current().age() >= Duration::from_millis(700)
    })
    .await
    .expect("its age grows");
    assert_eq!(lanes.current().lanes, 1, "the last value is still served");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_computation_is_counted_on_metrics_and_the_last_value_still_served() {
    let (mut pg, url) = tokio::task::spawn_blocking(own_postgres).await.unwrap();
    let redis = tokio::task::spawn_blocking(|| dispatch_testkit::Redis::start().unwrap())
        .await
        .unwrap();
    let mut env = Env::on(url.clone(), redis, quick_gauge).await;
    env.broker.take().unwrap().shutdown().await.unwrap();
    env.task(&["a"]).await;
    let broker = BrokerProcess::start(
        &url,
        &env.redis.url(),
        &[
            "--lane-cutoff",
            "0s",
            "--lane-interval",
            "100ms",
            "--lane-refresh",
            "50ms",
            "--backend-timeout",
            "300ms",
        ],
        &[],
    )
    .await;
    let counted = |series: &'static str, want: fn(f64) -> bool| {
        let broker = &broker;
        move || async move { metric(&broker.metrics().await, series).is_some_and(want) }
    };
    eventually(
        Duration::from_secs(10),
        counted("dispatch_lanes", |v| v == 1.0),
    )
    .await
    .expect("one lane");
    tokio::task::block_in_place(|| pg.kill());
    eventually(
        Duration::from_secs(20),
        counted("dispatch_lane_errors_total", |v| v >= 1.0),
    )
    .await
    .expect("the failed computations are counted");
    let page = broker.metrics().await;
    assert_eq!(metric(&page, "dispatch_lanes"), Some(1.0), "{page}");
}

fn scaled(metadata: &[(&str, &str)]) -> ScaledObjectRef {
    ScaledObjectRef {
        name: "pulp-workers".into(),
        namespace: "pulp".into(),
        scaler_metadata: metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keda_scales_on_lanes_and_hears_of_the_first_task_at_once() {
    let env = Env::with(|a| {
        a.lanes.cutoff = Duration::ZERO;
        a.lanes.interval = Duration::from_millis(100);
        a.lanes.refresh = Duration::from_millis(100);
        // Only the insert notification can tell this broker the queue became active.
        a.lanes.activity_check = Duration::from_secs(3600);
    })
    .await;
    let mut keda = ExternalScalerClient::connect(format!("http://{}", env.broker().addr))
        .await
        .unwrap();
    let spec = keda
        .get_metric_spec(scaled(&[]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(spec.metric_specs[0].metric_name, "lanes");
    assert_eq!(spec.metric_specs[0].target_size_float, 1.0);
    let spec = keda
        .get_metric_spec(scaled(&[("tasksPerWorker", "2.5")]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(spec.metric_specs[0].target_size_float, 2.5);
    let bad = keda
        .get_metric_spec(scaled(&[("tasksPerWorker", "zero")]))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(
        !keda
            .is_active(scaled(&[]))
            .await
            .unwrap()
            .into_inner()
            .result
    );

    let mut stream = keda
        .stream_is_active(scaled(&[]))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert!(!first.result, "an empty queue is inactive");
    env.task(&["a"]).await;
    env.task(&["a"]).await;
    env.task(&["b"]).await;
    let pushed = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("a push")
        .unwrap()
        .unwrap();
    assert!(pushed.result, "the first task makes the scaler active");
    assert!(
        keda.is_active(scaled(&[]))
            .await
            .unwrap()
            .into_inner()
            .result
    );
    let lanes = Arc::clone(&env.broker().lanes);
    eventually(Duration::from_secs(10), || async {
        lanes.current().lanes == 2
    })
    .await
    .expect("two lanes");
    let metrics = keda
        .get_metrics(GetMetricsRequest {
            scaled_object_ref: Some(scaled(&[])),
            metric_name: "lanes".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(metrics.metric_values[0].metric_name, "lanes");
    assert_eq!(metrics.metric_values[0].metric_value, 2);
    assert_eq!(metrics.metric_values[0].metric_value_float, 2.0);
    // The push stream ends cleanly on broker shutdown.
    env.shutdown().await;
    let end = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("the stream ends");
    assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
}

#[tokio::test]
async fn without_a_notification_the_periodic_activity_check_still_finds_the_first_task() {
    let env = Env::with(|a| {
        a.lanes.refresh = Duration::from_millis(50);
        a.lanes.activity_check = Duration::from_millis(300);
    })
    .await;
    let lanes = activity_checked_once(&env).await;
    assert!(!lanes.current().active);
    // Inserted with triggers off: no notification reaches the broker.
    env.tasks_bulk(1, &["a"]).await;
    eventually(Duration::from_secs(10), || async { lanes.current().active })
        .await
        .expect("the periodic check sees the task");
}

#[tokio::test]
async fn an_idle_broker_does_not_poll_activity_between_periodic_checks() {
    let env = Env::with(|a| {
        a.lanes.refresh = Duration::from_millis(50);
        a.lanes.activity_check = Duration::from_secs(3600);
    })
    .await;
    let lanes = activity_checked_once(&env).await;
    // The listener signals once when it starts listening (what came before was not heard); let
    // that check pass first.
    let db = &env.db;
    eventually(Duration::from_secs(10), || async {
        db.query_one(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND query LIKE 'LISTEN%'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
            > 0
    })
    .await
    .expect("the broker listens");
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A task without a notification (triggers off): ten refreshes later nobody has asked.
    env.tasks_bulk(1, &["a"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !lanes.current().active,
        "activity is not polled on every refresh"
    );
    // A notified insert is checked at the next refresh.
    env.task(&["b"]).await;
    eventually(Duration::from_secs(10), || async { lanes.current().active })
        .await
        .expect("the notification makes the broker check");
}

/// The broker's gauge, once it has checked activity for the first time.
async fn activity_checked_once(env: &Env) -> Arc<dispatch_broker::lanes::Lanes> {
    let lanes = Arc::clone(&env.broker().lanes);
    eventually(Duration::from_secs(10), || async {
        lanes.current().activity_known
    })
    .await
    .expect("activity checked once");
    lanes
}

/// The full pass reads the whole queue in one statement: on a large queue it takes longer than
/// the backend timeout, which bounds the statements of calls a client waits on, not this
/// background pass. It completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pass_over_a_queue_longer_than_the_backend_timeout_completes() {
    let env = Env::with(|a| {
        a.lanes.cutoff = Duration::ZERO;
        // The server stops a statement after 160 ms; reading 400,000 tasks takes longer.
        a.backend_timeout = Duration::from_millis(200);
    })
    .await;
    env.tasks_bulk(400_000, &["a"]).await;
    let started = std::time::Instant::now();
    env.broker()
        .lanes
        .compute(true)
        .await
        .expect("the full pass completes");
    println!("full pass over 400,000 tasks: {:?}", started.elapsed());
    assert_eq!(
        env.broker().lanes.current().lanes,
        1,
        "one lane: the queue on a"
    );
    env.shutdown().await;
}
