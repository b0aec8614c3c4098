//! The broker on a database whose schema pulpcore 3.123.1's own migrations made
//! (tests/fixtures/pulpcore-3.123.1-schema.sql): `migrate` changes nothing and finds everything,
//! the rows the broker writes satisfy Pulp's constraints, and readiness look-ups use Pulp's
//! partial GIN index.

#[path = "support/harness.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use dispatch_broker::metrics::Stats;
use dispatch_broker::tasks::Tasks;
use support::{id, shared_pg, Env};
use uuid::Uuid;

const PULP_SCHEMA: &str = include_str!("fixtures/pulpcore-3.123.1-schema.sql");

fn pulp_database() -> String {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let pg = shared_pg();
    let name = format!(
        "pulp{}_{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    pg.create_database(&name).expect("create pulp database");
    pg.psql(&name, PULP_SCHEMA).expect("load pulp schema");
    pg.url(&name)
}

/// A fresh Pulp database and a client on it.
async fn pulp_database_client() -> (String, tokio_postgres::Client) {
    let url = tokio::task::spawn_blocking(pulp_database).await.unwrap();
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    (url, db)
}

async fn schema_fingerprint(db: &tokio_postgres::Client) -> Vec<String> {
    db.query(
        "SELECT 'col ' || table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable \
         FROM information_schema.columns WHERE table_schema = 'public' \
         UNION ALL SELECT 'idx ' || indexdef FROM pg_indexes WHERE schemaname = 'public' \
         UNION ALL SELECT 'trg ' || tgname FROM pg_trigger WHERE NOT tgisinternal \
         UNION ALL SELECT 'fn ' || proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace \
         ORDER BY 1",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Inserts a task the way pulpcore's dispatch does: every NOT NULL column filled.
async fn pulp_task(db: &tokio_postgres::Client, record: &[&str]) -> Uuid {
    let id = Uuid::new_v4();
    let record: Vec<String> = record.iter().map(|s| s.to_string()).collect();
    db.execute(
        "INSERT INTO core_task (pulp_id, pulp_created, pulp_last_updated, state, name, logging_cid, \
             reserved_resources_record, pulp_domain_id, versions, immediate, deferred, pulp_api_version) \
         SELECT $1, now(), now(), 'waiting', 'pulpcore.app.tasks.base.general_create', 'cid', $2, \
                d.pulp_id, hstore('core', '3.123.1'), false, true, 'v3' \
         FROM core_domain d WHERE d.name = 'default'",
        &[&id, &record],
    )
    .await
    .expect("insert a pulp task");
    id
}

#[tokio::test]
async fn migrate_changes_nothing_on_a_pulp_database_and_finds_everything() {
    let (url, db) = pulp_database_client().await;
    let before = schema_fingerprint(&db).await;
    let tasks = Tasks::connect(&url, 1, Duration::from_secs(5), Arc::new(Stats::default()))
        .await
        .unwrap();
    let outcome = tasks.migrate(false, false, false).await.unwrap();
    assert!(!outcome.created);
    assert!(outcome.missing.is_empty(), "missing: {:?}", outcome.missing);
    assert!(
        outcome.optional.iter().any(|o| o.contains("--lanes-index")),
        "{:?}",
        outcome.optional
    );
    assert_eq!(
        schema_fingerprint(&db).await,
        before,
        "migrate changed a Pulp schema"
    );
}

async fn lanes_index_def(db: &tokio_postgres::Client) -> Vec<String> {
    db.query(
        "SELECT indexdef FROM pg_indexes WHERE indexname = 'dispatch_lanes_idx'",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[tokio::test]
async fn migrate_lanes_index_adds_exactly_the_fresh_databases_index_and_nothing_else() {
    let (url, db) = pulp_database_client().await;
    let before = schema_fingerprint(&db).await;
    // A failed concurrent build leaves an invalid index behind; migrate must replace it.
    db.batch_execute(
        "CREATE INDEX dispatch_lanes_idx ON core_task (pulp_created); \
         UPDATE pg_index SET indisvalid = false \
         WHERE indexrelid = 'dispatch_lanes_idx'::regclass",
    )
    .await
    .unwrap();
    let tasks = Tasks::connect(&url, 1, Duration::from_secs(5), Arc::new(Stats::default()))
        .await
        .unwrap();
    let first = tasks.migrate(true, false, false).await.unwrap();
    assert!(first.lanes_index_created && !first.created);
    assert!(first.missing.is_empty());
    assert!(
        first.optional.len() == 1 && first.optional[0].contains("--gin-fastupdate-off"),
        "{:?}",
        first.optional
    );
    let again = tasks.migrate(true, false, false).await.unwrap();
    assert!(!again.lanes_index_created, "a valid index is left alone");

    let added: Vec<String> = schema_fingerprint(&db)
        .await
        .into_iter()
        .filter(|item| !before.contains(item))
        .collect();
    assert_eq!(added.len(), 1, "added: {added:?}");
    // The same definition as migrate.sql gives a fresh database (the harness's template).
    let fresh_url = tokio::task::spawn_blocking(support::fresh_database)
        .await
        .unwrap();
    let (fresh, conn) = tokio_postgres::connect(&fresh_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    assert_eq!(lanes_index_def(&db).await, lanes_index_def(&fresh).await);
    assert_eq!(lanes_index_def(&db).await.len(), 1);
}

#[tokio::test]
async fn migrate_gin_fastupdate_off_changes_only_the_index_storage_parameter() {
    let (url, db) = pulp_database_client().await;
    let before = schema_fingerprint(&db).await;
    let tasks = Tasks::connect(&url, 1, Duration::from_secs(5), Arc::new(Stats::default()))
        .await
        .unwrap();
    let first = tasks.migrate(false, false, true).await.unwrap();
    assert!(first.gin_fastupdate_changed && !first.created);
    assert!(
        !first
            .optional
            .iter()
            .any(|o| o.contains("--gin-fastupdate-off")),
        "{:?}",
        first.optional
    );
    let again = tasks.migrate(false, false, true).await.unwrap();
    assert!(!again.gin_fastupdate_changed, "done once is done");
    let after = schema_fingerprint(&db).await;
    let removed: Vec<&String> = before.iter().filter(|i| !after.contains(i)).collect();
    let added: Vec<&String> = after.iter().filter(|i| !before.contains(i)).collect();
    assert_eq!(removed.len(), 1, "{removed:?}");
    assert_eq!(added.len(), 1, "{added:?}");
    assert_eq!(
        added[0].replace(" WITH (fastupdate=off)", ""),
        *removed[0],
        "only the storage parameter changed"
    );
    assert!(removed[0].contains("USING gin (reserved_resources_record)"));
}

#[tokio::test]
async fn the_broker_runs_unchanged_on_a_pulp_database() {
    let url = tokio::task::spawn_blocking(pulp_database).await.unwrap();
    let redis = tokio::task::spawn_blocking(|| dispatch_broker::testkit::Redis::start().unwrap())
        .await
        .unwrap();
    let mut env = Env::on(url, redis, |_| {}).await;
    let running = pulp_task(
        &env.db,
        &["prn:file.repository:1", "shared:prn:core.domain:x"],
    )
    .await;
    let blocked = pulp_task(&env.db, &["prn:file.repository:1"]).await;
    let free = pulp_task(&env.db, &["prn:file.repository:2"]).await;
    let w1 = env.open("1@host").await;
    let t = env.fetch(&w1).await.unwrap();
    assert_eq!(id(&t), running);
    env.start(&w1, &t).await;
    let w2 = env.open("2@host").await;
    let t2 = env.fetch(&w2).await.unwrap();
    assert_eq!(id(&t2), free, "the blocked task is passed over");
    let done = env.finish(&w1, &t, "completed").await;
    assert_eq!(done.state, "completed");
    let t3 = env.fetch(&w1).await.unwrap();
    assert_eq!(id(&t3), blocked);
    assert!(env.cancel(id(&t3)).await.unwrap().state == "canceled");
    // Closing leases removes the broker-made core_appstatus rows despite Pulp's plain foreign key.
    for lease in [w1, w2] {
        env.client
            .close_lease(dispatch_broker::proto::CloseLeaseRequest { lease_id: lease })
            .await
            .expect("close on a pulp schema");
    }
    let rows: i64 = env
        .db
        .query_one("SELECT count(*) FROM core_appstatus", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
    assert_eq!(
        env.state(free).await,
        "waiting",
        "closing requeues a claimed task"
    );
    assert_eq!(env.app_lock(free).await, None);
    env.assert_locks(&[]).await;
    env.shutdown().await;
}

/// The readiness look-up (a positive overlap, counted) must be served by Pulp's partial GIN
/// index, not by a scan of the task table.
#[tokio::test]
async fn the_readiness_lookup_uses_pulps_gin_index() {
    let url = tokio::task::spawn_blocking(pulp_database).await.unwrap();
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    pulp_task(
        &db,
        &["prn:python.repository:R0", "shared:prn:core.domain:D1"],
    )
    .await;
    db.batch_execute(
        "SET session_replication_role = replica; \
         INSERT INTO core_task (pulp_id, pulp_created, state, name, logging_cid, reserved_resources_record, \
             pulp_domain_id, versions, pulp_api_version) \
         SELECT gen_random_uuid(), clock_timestamp(), 'waiting', 't', 'c', \
                ARRAY['prn:python.repository:R0', 'shared:prn:core.domain:D1'], d.pulp_id, ''::hstore, 'v3' \
         FROM core_domain d, generate_series(1, 5000); \
         INSERT INTO core_task (pulp_id, pulp_created, state, name, logging_cid, reserved_resources_record, \
             pulp_domain_id, versions, pulp_api_version) \
         SELECT gen_random_uuid(), clock_timestamp(), 'completed', 't', 'c', \
                ARRAY['prn:file.repository:' || i], d.pulp_id, ''::hstore, 'v3' \
         FROM core_domain d, generate_series(1, 20000) AS i; \
         SET session_replication_role = origin; ANALYZE core_task;",
    )
    .await
    .unwrap();
    let sql = dispatch_broker::tasks::sql::CANDIDATES;
    db.batch_execute(&format!(
        "PREPARE candidates(text[], timestamptz, uuid, bigint) AS {sql}"
    ))
    .await
    .unwrap();
    let plan: String = db
        .query("EXPLAIN EXECUTE candidates('{}', NULL, NULL, 32)", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0) + "\n")
        .collect();
    assert!(
        plan.contains("Bitmap Index Scan on pulp_task_resources_index"),
        "the older-conflicts look-up does not use the GIN index:\n{plan}"
    );
    assert!(
        !plan.contains("Seq Scan on core_task u"),
        "the older-conflicts look-up scans the table:\n{plan}"
    );
}

/// The maintained lane pass's statements, planned as the broker plans them (generic plans,
/// sequential scans off) on Pulp's schema with `migrate --lanes-index`'s index: successors by
/// name through Pulp's GIN index, the walk and the arrivals as ordered ranges of
/// `dispatch_lanes_idx` (no sort), the ended tasks by primary key.
#[tokio::test]
async fn the_maintained_lane_pass_uses_the_intended_indexes() {
    let (_url, db) = pulp_database_client().await;
    pulp_task(&db, &["prn:python.repository:R0"]).await;
    db.batch_execute(
        "SET session_replication_role = replica; \
         INSERT INTO core_task (pulp_id, pulp_created, state, name, logging_cid, reserved_resources_record, \
             pulp_domain_id, versions, pulp_api_version) \
         SELECT gen_random_uuid(), clock_timestamp(), CASE WHEN i % 3 = 0 THEN 'completed' ELSE 'waiting' END, \
                't', 'c', ARRAY['prn:file.repository:' || (i % 500), 'shared:prn:core.domain:D1'], \
                d.pulp_id, ''::hstore, 'v3' \
         FROM core_domain d, generate_series(1, 20000) AS i; \
         SET session_replication_role = origin; ANALYZE core_task;",
    )
    .await
    .unwrap();
    db.batch_execute(dispatch_broker::tasks::sql::LANES_INDEX)
        .await
        .unwrap();
    use dispatch_broker::tasks::sql;
    db.batch_execute(&format!(
        "ANALYZE core_task; SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off; \
         BEGIN; {}",
        sql::ORDERED_SCANS
    ))
    .await
    .unwrap();
    let plan = |name: &str, params: &str, statement: &str, call: &str| {
        let (name, params, statement, call) = (
            name.to_owned(),
            params.to_owned(),
            statement.to_owned(),
            call.to_owned(),
        );
        let db = &db;
        async move {
            db.batch_execute(&format!("PREPARE {name}({params}) AS {statement}"))
                .await
                .unwrap();
            db.query(&format!("EXPLAIN EXECUTE {name}({call})"), &[])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, String>(0) + "\n")
                .collect::<String>()
        }
    };
    let page = plan(
        "page",
        "timestamptz, uuid, timestamptz, uuid",
        sql::LANES_PAGE,
        "now() - interval '1 hour', gen_random_uuid(), now(), gen_random_uuid()",
    )
    .await;
    assert!(
        page.contains("Index Scan using dispatch_lanes_idx"),
        "{page}"
    );
    assert!(!page.contains("Sort"), "{page}");
    let newer = plan(
        "newer",
        "double precision, timestamptz, uuid",
        sql::LANES_NEWER,
        "0, now() - interval '1 hour', gen_random_uuid()",
    )
    .await;
    assert!(newer.contains("dispatch_lanes_idx"), "{newer}");
    assert!(!newer.contains("Sort"), "{newer}");
    let full = plan("whole", "double precision", sql::LANES, "0").await;
    assert!(
        full.contains("Index Scan using dispatch_lanes_idx"),
        "{full}"
    );
    assert!(!full.contains("Sort"), "{full}");
    let gone = plan(
        "gone",
        "uuid[]",
        sql::LANES_GONE,
        "ARRAY[gen_random_uuid(), gen_random_uuid()]",
    )
    .await;
    assert!(gone.contains("core_task_pkey"), "{gone}");
    db.batch_execute(sql::LOOKUP_BY_NAME).await.unwrap();
    let users = plan(
        "users",
        "text[]",
        sql::LANES_USERS,
        "ARRAY['prn:file.repository:7', 'shared:prn:file.repository:7']",
    )
    .await;
    assert!(
        users.contains("Bitmap Index Scan on pulp_task_resources_index"),
        "{users}"
    );
}
