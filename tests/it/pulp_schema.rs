//! The broker on a database whose schema pulpcore 3.123.1's own migrations made
//! (tests/fixtures/pulpcore-3.123.1-schema.sql): `migrate` changes nothing and finds everything,
//! the rows the broker writes satisfy Pulp's constraints, and readiness look-ups use Pulp's
//! partial GIN index.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use crate::support::{id, shared_pg, Env};
use dispatch_broker::metrics::Stats;
use dispatch_broker::tasks::Tasks;
use uuid::Uuid;

const PULP_SCHEMA: &str = include_str!("../fixtures/pulpcore-3.123.1-schema.sql");

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
    let db = connect(&url).await;
    (url, db)
}

/// A client on `url` (its connection driven in the background).
async fn connect(url: &str) -> tokio_postgres::Client {
    let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    db
}

/// The broker's task store on `url`, one connection.
async fn task_store(url: &str) -> Tasks {
    Tasks::connect(url, 1, Duration::from_secs(5), Arc::new(Stats::default()))
        .await
        .unwrap()
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

/// Writes to a task (as a claim does, briefly holding a write lock on core_task).
async fn touch(db: &tokio_postgres::Client, task: Uuid) {
    db.execute(
        "UPDATE core_task SET pulp_last_updated = now() WHERE pulp_id = $1",
        &[&task],
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn migrate_changes_nothing_on_a_pulp_database_and_finds_everything() {
    let (url, db) = pulp_database_client().await;
    let before = schema_fingerprint(&db).await;
    let tasks = task_store(&url).await;
    let outcome = tasks.migrate(false, false, false, false).await.unwrap();
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

/// Up to where the resource queues know every task is read from the open writers of core_task
/// (queue_known.sql). A writer that ends while that is read is no writer: it must not make the
/// answer "cannot tell" (which left the queues' first load knowing nothing, and so catching up
/// with nothing, for a minute, whenever a claim was in flight at that instant). Writers here
/// are short UPDATEs in a loop, as claims are.
#[tokio::test]
async fn a_writer_that_ends_while_the_known_position_is_read_does_not_make_it_unknown() {
    let (url, db) = pulp_database_client().await;
    let task = pulp_task(&db, &["prn:file.repository:A"]).await;
    let tasks = task_store(&url).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for _ in 0..2 {
        let writer = connect(&url).await;
        let stop = Arc::clone(&stop);
        writers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                touch(&writer, task).await;
                n += 1;
            }
            n
        }));
    }
    let mut unknown = 0;
    let reads = 1_500;
    for _ in 0..reads {
        if tasks.queue_known().await.unwrap().is_none() {
            unknown += 1;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut updates = 0;
    for w in writers {
        updates += w.await.unwrap();
    }
    println!("{unknown} of {reads} reads could not tell, beside {updates} updates");
    assert!(updates > 100, "the writers ran: {updates} updates");
    assert_eq!(unknown, 0, "{unknown} of {reads} reads could not tell");
}

/// A writer left open by a session whose activity is not tracked (track_activities off: no
/// transaction start to read) still keeps the known position from passing it: queue_known.sql
/// answers "cannot tell" until it ends, then a position again.
#[tokio::test]
async fn an_open_writer_whose_activity_is_not_tracked_still_counts() {
    let (url, db) = pulp_database_client().await;
    let task = pulp_task(&db, &["prn:file.repository:A"]).await;
    let tasks = task_store(&url).await;
    let writer = connect(&url).await;
    writer
        .batch_execute("SET track_activities = off")
        .await
        .unwrap();
    writer.execute("BEGIN", &[]).await.unwrap();
    touch(&writer, task).await;
    assert_eq!(
        tasks.queue_known().await.unwrap(),
        None,
        "an untracked open writer"
    );
    writer.execute("COMMIT", &[]).await.unwrap();
    assert!(
        tasks.queue_known().await.unwrap().is_some(),
        "the writer ended"
    );
}

/// The broker relies on Pulp's insert trigger stamping pulp_created (no task can appear older
/// than one already handed out): with the trigger disabled it names what is missing and how to
/// enable it (and so refuses to start), and with it enabled again it finds everything.
#[tokio::test]
async fn a_pulp_database_without_its_stamping_trigger_is_refused() {
    let (url, db) = pulp_database_client().await;
    let tasks = task_store(&url).await;
    db.batch_execute("ALTER TABLE core_task DISABLE TRIGGER on_insert_timestamp_task_trigger")
        .await
        .unwrap();
    let missing = tasks.missing_schema().await.unwrap();
    assert_eq!(missing.len(), 1, "{missing:?}");
    assert!(
        missing[0].contains("ENABLE TRIGGER on_insert_timestamp_task_trigger"),
        "{missing:?}"
    );
    let refused = tasks.prepare().await.expect_err("refuses to start");
    assert!(refused.to_string().contains("pulp_created"), "{refused}");
    db.batch_execute("ALTER TABLE core_task ENABLE TRIGGER on_insert_timestamp_task_trigger")
        .await
        .unwrap();
    assert_eq!(tasks.missing_schema().await.unwrap(), Vec::<String>::new());
    tasks.prepare().await.unwrap();
}

/// Fair dispatch's indexes (fair_indexes.sql).
const FAIR_INDEXES: &[&str] = &[
    "dispatch_groups_idx",
    "dispatch_immediate_idx",
    "dispatch_task_groups_idx",
];

/// The definitions of the indexes named `names`, by name.
async fn index_defs(db: &tokio_postgres::Client, names: &[&str]) -> Vec<String> {
    db.query(
        "SELECT indexdef FROM pg_indexes WHERE indexname = ANY($1) ORDER BY indexname",
        &[&names],
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
    let tasks = task_store(&url).await;
    let first = tasks.migrate(true, false, false, false).await.unwrap();
    assert!(first.lanes_index_created && !first.created);
    assert!(first.missing.is_empty());
    assert!(
        first.optional.len() == 2
            && first.optional[0].contains("--fair-indexes")
            && first.optional[1].contains("--gin-fastupdate-off"),
        "{:?}",
        first.optional
    );
    let again = tasks.migrate(true, false, false, false).await.unwrap();
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
    let fresh = connect(&fresh_url).await;
    assert_eq!(
        index_defs(&db, &["dispatch_lanes_idx"]).await,
        index_defs(&fresh, &["dispatch_lanes_idx"]).await
    );
    assert_eq!(index_defs(&db, &["dispatch_lanes_idx"]).await.len(), 1);
}

#[tokio::test]
async fn migrate_fair_indexes_adds_exactly_the_fresh_databases_indexes_and_nothing_else() {
    let (url, db) = pulp_database_client().await;
    let before = schema_fingerprint(&db).await;
    let tasks = task_store(&url).await;
    let first = tasks.migrate(false, false, false, true).await.unwrap();
    assert!(first.fair_indexes_created && !first.created && !first.domain_column_added);
    assert!(
        !first.task_group_column_added,
        "Pulp's core_task has task_group_id"
    );
    assert!(first.missing.is_empty());
    assert!(
        !first.optional.iter().any(|o| o.contains("--fair-indexes")),
        "{:?}",
        first.optional
    );
    let again = tasks.migrate(false, false, false, true).await.unwrap();
    assert!(!again.fair_indexes_created, "valid indexes are left alone");
    let added: Vec<String> = schema_fingerprint(&db)
        .await
        .into_iter()
        .filter(|item| !before.contains(item))
        .collect();
    assert_eq!(added.len(), 3, "added: {added:?}");
    let fresh_url = tokio::task::spawn_blocking(support::fresh_database)
        .await
        .unwrap();
    let fresh = connect(&fresh_url).await;
    assert_eq!(
        index_defs(&db, FAIR_INDEXES).await,
        index_defs(&fresh, FAIR_INDEXES).await
    );
    assert_eq!(index_defs(&db, FAIR_INDEXES).await.len(), 3);
    // Pulp's database has pulp_domain_id already: a directed page reads one domain's tasks.
    assert!(tasks.has_fair_indexes().await.unwrap());
    // The directory by task group is a skip scan of dispatch_task_groups_idx (its expression is
    // the statement's), in a generic plan as the broker's sessions make it.
    db.batch_execute(&format!(
        "SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off; \
         PREPARE by_task_group(bigint) AS {}",
        dispatch_broker::tasks::sql::GROUPS_WAITING_BY_TASK_GROUP.as_str()
    ))
    .await
    .unwrap();
    let plan: String = db
        .query("EXPLAIN EXECUTE by_task_group(100)", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0) + "\n")
        .collect();
    assert!(plan.contains("dispatch_task_groups_idx"), "{plan}");
    assert!(!plan.contains("Sort"), "{plan}");
}

#[tokio::test]
async fn migrate_gin_fastupdate_off_changes_only_the_index_storage_parameter() {
    let (url, db) = pulp_database_client().await;
    let before = schema_fingerprint(&db).await;
    let tasks = task_store(&url).await;
    let first = tasks.migrate(false, false, true, false).await.unwrap();
    assert!(first.gin_fastupdate_changed && !first.created);
    assert!(
        !first
            .optional
            .iter()
            .any(|o| o.contains("--gin-fastupdate-off")),
        "{:?}",
        first.optional
    );
    let again = tasks.migrate(false, false, true, false).await.unwrap();
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
    let redis = tokio::task::spawn_blocking(|| dispatch_testkit::Redis::start().unwrap())
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
    let db = connect(&url).await;
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
    let sql = dispatch_broker::tasks::sql::CANDIDATES.replace("$page_size", "32");
    db.batch_execute(&format!(
        "PREPARE candidates(text[], timestamptz, uuid, timestamptz, uuid, text[], int[]) AS {sql}"
    ))
    .await
    .unwrap();
    let plan: String = db
        .query(
            "EXPLAIN EXECUTE candidates('{}', NULL, NULL, NULL, NULL, '{}', '{}')",
            &[],
        )
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
        sql::LANES_USERS.as_str(),
        "ARRAY['prn:file.repository:7', 'shared:prn:file.repository:7']",
    )
    .await;
    assert!(
        users.contains("Bitmap Index Scan on pulp_task_resources_index"),
        "{users}"
    );
}

/// A Pulp database with R0's head running, `blocked` tasks waiting on R0 behind it and 50 tasks of
/// other repositories after them (one of them running), its GIN pending list merged as the
/// broker's `--gin-clean-interval` keeps it. Returns a client and the position (pulp_created,
/// pulp_id) of R0's newest task, where a fetch's scan hint stands in steady state.
async fn incident_database(blocked: usize) -> (tokio_postgres::Client, String, String) {
    let (_url, db) = pulp_database_client().await;
    let task = |state: &str, count: usize, record: &str| {
        format!(
            "INSERT INTO core_task (pulp_id, pulp_created, state, name, logging_cid, reserved_resources_record, \
                 pulp_domain_id, versions, pulp_api_version) \
             SELECT gen_random_uuid(), clock_timestamp(), '{state}', 't', 'c', {record}, d.pulp_id, ''::hstore, 'v3' \
             FROM core_domain d, generate_series(1, {count}) AS i;"
        )
    };
    let r0 = "ARRAY['prn:python.repository:R0', 'shared:pdrn:D1']";
    db.batch_execute(&format!(
        "SET session_replication_role = replica; {} {} {} {} SET session_replication_role = origin;",
        task("running", 1, r0),
        task("waiting", blocked, r0),
        task("running", 1, "ARRAY['prn:file.repository:O0', 'shared:pdrn:D1']"),
        task("waiting", 50, "ARRAY['prn:file.repository:O' || i, 'shared:pdrn:D1']"),
    ))
    .await
    .unwrap();
    db.query(dispatch_broker::tasks::sql::GIN_CLEAN, &[])
        .await
        .unwrap();
    // Statistics as autovacuum gathers them after such a backlog arrives (with and without
    // them the generic plans differ).
    db.batch_execute("ANALYZE core_task").await.unwrap();
    let row = db
        .query_one(
            "SELECT pulp_created::text, pulp_id::text FROM core_task \
             WHERE reserved_resources_record @> ARRAY['prn:python.repository:R0'] \
             ORDER BY pulp_created DESC, pulp_id DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap();
    (db, row.get(0), row.get(1))
}

/// The planner settings the broker reads candidates.sql under, for a whole session (one where
/// only candidates.sql runs).
fn candidates_settings() -> String {
    dispatch_broker::tasks::sql::CANDIDATES_SETTINGS.replace("SET LOCAL", "SET")
}

/// The rows of `execute`, run as the broker runs candidates.sql and task.sql: in a read-only
/// transaction under candidates_settings.sql.
async fn rows_under_candidates_settings(
    db: &tokio_postgres::Client,
    execute: &str,
) -> Vec<tokio_postgres::Row> {
    db.batch_execute(&format!(
        "BEGIN READ ONLY; {}",
        dispatch_broker::tasks::sql::CANDIDATES_SETTINGS
    ))
    .await
    .unwrap();
    let rows = db.query(execute, &[]).await.unwrap();
    db.batch_execute("COMMIT").await.unwrap();
    rows
}

/// [`buffers`] in a transaction under planner `settings` (`SET LOCAL` lines), as the broker
/// runs the statement (the generic plan is built at the first execution, under them).
async fn buffers_under(db: &tokio_postgres::Client, settings: &str, execute: &str) -> u64 {
    db.batch_execute(&format!("BEGIN READ ONLY; {settings}"))
        .await
        .unwrap();
    let pages = buffers(db, execute).await;
    db.batch_execute("COMMIT").await.unwrap();
    pages
}

/// Shared buffers (8 kB pages) one execution of a prepared statement reads, as the broker's
/// sessions run it: generic plan, sequential scans off.
async fn buffers(db: &tokio_postgres::Client, execute: &str) -> u64 {
    let rows = db
        .query(
            &format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {execute}"),
            &[],
        )
        .await
        .unwrap();
    let plan: serde_json::Value = rows[0].get(0);
    if std::env::var_os("SHOW_PLANS").is_some() {
        eprintln!("{execute}\n{plan:#}");
    }
    let top = &plan[0]["Plan"];
    top["Shared Hit Blocks"].as_u64().unwrap() + top["Shared Read Blocks"].as_u64().unwrap()
}

/// What the fetch path's statements read on a Pulp database at `blocked`: candidates from the
/// scan hint's position, the exact readiness look-up of a task behind the backlog (task.sql,
/// ClaimTask's), and hiding.sql for a running task's names.
async fn fetch_reads(blocked: usize, plain_index: bool) -> Vec<(&'static str, u64)> {
    let (db, created, id) = incident_database(blocked).await;
    if !plain_index {
        // The planner's other choice for the page: Pulp's (state, pulp_created) index. Which one
        // a generic plan takes depends on the statistics, so both must read little.
        db.batch_execute("DROP INDEX core_task_pulp_cr_10223f_idx")
            .await
            .unwrap();
    }
    // Fair dispatch's indexes, for its directed pages.
    for statement in dispatch_broker::tasks::sql::FAIR_INDEXES
        .split(";\n")
        .filter(|s| s.contains("CREATE"))
    {
        db.batch_execute(statement).await.unwrap();
    }
    db.batch_execute("ANALYZE core_task").await.unwrap();
    let domain: String = db
        .query_one("SELECT pulp_domain_id::text FROM core_task LIMIT 1", &[])
        .await
        .unwrap()
        .get(0);
    db.batch_execute(&format!(
        "SET enable_seqscan = off; SET plan_cache_mode = force_generic_plan; SET jit = off; \
         SET max_parallel_workers_per_gather = 0; \
         PREPARE directed(text[], timestamptz, uuid, timestamptz, uuid, text[], int[], uuid, uuid[]) AS {}; \
         PREPARE candidates(text[], timestamptz, uuid, timestamptz, uuid, text[], int[]) AS {}; \
         PREPARE task(uuid[], timestamptz, uuid, text[], int[]) AS {}; \
         PREPARE hiding(timestamptz, uuid, text[]) AS {}; \
         PREPARE seen(uuid[]) AS {}; \
         PREPARE queue_page(timestamptz, uuid) AS {};",
        dispatch_broker::tasks::candidates_sql(
            8,
            Some(dispatch_broker::tasks::Directed::Group(Uuid::nil()))
        ),
        dispatch_broker::tasks::sql::CANDIDATES.replace("$page_size", "8"),
        dispatch_broker::tasks::sql::TASK.as_str(),
        dispatch_broker::tasks::sql::HIDING.as_str(),
        dispatch_broker::tasks::sql::TASK_SEEN.as_str(),
        dispatch_broker::tasks::sql::QUEUE_PAGE,
    ))
    .await
    .unwrap();
    let other: String = db
        .query_one(
            "SELECT pulp_id::text FROM core_task WHERE state = 'waiting' \
             AND reserved_resources_record @> ARRAY['prn:file.repository:O7']",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let mut reads = Vec::new();
    // Twice each: the first execution of a prepared statement may still be a custom plan.
    for _ in 0..2 {
        reads = vec![
            (
                "candidates.sql from the hint",
                buffers_under(
                    &db,
                    dispatch_broker::tasks::sql::CANDIDATES_SETTINGS,
                    &format!(
                        "EXECUTE candidates('{{}}', '{created}', '{id}', NULL, NULL, '{{}}', '{{}}')"
                    ),
                )
                .await,
            ),
            (
                // The domain's head is R0's blocked queue: the page and the same domain read
                // ahead each read their bounded scan of it.
                "candidates.sql, a directed page with a group read ahead",
                buffers_under(
                    &db,
                    dispatch_broker::tasks::sql::CANDIDATES_SETTINGS,
                    &format!(
                        "EXECUTE directed('{{}}', NULL, NULL, NULL, NULL, '{{}}', '{{}}', \
                         '{domain}', ARRAY['{domain}']::uuid[])"
                    ),
                )
                .await,
            ),
            (
                "task.sql behind the backlog",
                buffers_under(
                    &db,
                    dispatch_broker::tasks::sql::CANDIDATES_SETTINGS,
                    &format!("EXECUTE task(ARRAY['{other}']::uuid[], NULL, NULL, '{{}}', '{{}}')"),
                )
                .await,
            ),
            (
                "hiding.sql for a running task's names",
                buffers(
                    &db,
                    &format!(
                        "EXECUTE hiding('{created}', '{id}', \
                         ARRAY['prn:file.repository:O0', 'shared:pdrn:D1'])"
                    ),
                )
                .await,
            ),
            (
                "task_seen.sql for a start's holders and lanes",
                buffers(
                    &db,
                    &format!("EXECUTE seen(ARRAY['{other}', '{id}']::uuid[])"),
                )
                .await,
            ),
            (
                "queue_page.sql catching up from the hint",
                buffers_under(
                    &db,
                    dispatch_broker::tasks::sql::QUEUE_PAGE_SETTINGS,
                    &format!("EXECUTE queue_page('{created}', '{id}')"),
                )
                .await,
            ),
        ];
    }
    reads
}

/// The guard for a flat FetchTask on Pulp's own schema: each statement a steady-state fetch runs
/// reads about as many pages with 20,000 tasks blocked on one repository as with 1,000, under
/// the plans the broker runs (generic). A plan that reads the backlog (a bitmap of Pulp's plain
/// pulp_created index ANDed with the GIN match, a walk of the blocked queue) fails it.
#[tokio::test]
async fn fetch_statements_read_no_more_with_a_larger_backlog() {
    for plain_index in [true, false] {
        let small = fetch_reads(1_000, plain_index).await;
        let large = fetch_reads(20_000, plain_index).await;
        for ((name, at_small), (_, at_large)) in small.iter().zip(&large) {
            assert!(
                *at_large <= at_small * 3 / 2 + 8,
                "{name} reads {at_large} pages with 20,000 blocked, {at_small} with 1,000 \
                 (Pulp's plain pulp_created index {})",
                if plain_index { "there" } else { "dropped" }
            );
        }
    }
}

/// What the sweeper's statements that look for claims and cancels read on a Pulp database at
/// `blocked`: claimed_since.sql (claims without a lock) and finish_orphan_cancels.sql. They run
/// every sweep; at 1,000,000 blocked their plans read a million index entries (a bitmap of Pulp's
/// state index, of the app_lock_id index's NULLs) for 200 ms of a 2-core machine's CPU each.
/// Also what a fetch round's claim (claim_round.sql, of two tasks of the backlog, rolled back)
/// and a batch of FinishTask calls (finish.sql) read: they must find their rows by primary key
/// whatever the statistics.
/// `statistics`: "none" (never analyzed: the planner's default guesses), "before" (those of the
/// database before the backlog arrived, as until autovacuum's next ANALYZE) or "fresh". The
/// planner guessed a handful of rows in the first two.
async fn sweeper_reads(blocked: usize, statistics: &str) -> Vec<(&'static str, u64)> {
    let (_url, db) = pulp_database_client().await;
    let worker = Uuid::new_v4();
    db.execute(
        "INSERT INTO core_appstatus (pulp_id, pulp_created, app_type, name, versions, ttl, \
             last_heartbeat) \
         VALUES ($1, now(), 'worker', 'w', ''::hstore, interval '30 seconds', now())",
        &[&worker],
    )
    .await
    .unwrap();
    let task = |state: &str, count: usize, record: &str, app_lock: &str| {
        format!(
            "INSERT INTO core_task (pulp_id, pulp_created, pulp_last_updated, state, name, logging_cid, \
                 reserved_resources_record, pulp_domain_id, versions, pulp_api_version, app_lock_id) \
             SELECT gen_random_uuid(), clock_timestamp() - interval '1 hour', \
                 clock_timestamp() - interval '1 hour', '{state}', 't', 'c', {record}, d.pulp_id, \
                 ''::hstore, 'v3', {app_lock} \
             FROM core_domain d, generate_series(1, {count}) AS i;"
        )
    };
    let r0 = "ARRAY['prn:python.repository:R0', 'shared:pdrn:D1']";
    let claimed = format!("'{worker}'::uuid");
    db.batch_execute(&task("running", 1, r0, &claimed))
        .await
        .unwrap();
    if statistics == "before" {
        db.batch_execute("ANALYZE core_task").await.unwrap();
    }
    db.batch_execute(&format!(
        "SET session_replication_role = replica; {} {} SET session_replication_role = origin;",
        task("waiting", blocked, r0, "NULL"),
        task(
            "running",
            1,
            "ARRAY['prn:file.repository:O0', 'shared:pdrn:D1']",
            &claimed
        ),
    ))
    .await
    .unwrap();
    if statistics == "fresh" {
        db.batch_execute("ANALYZE core_task").await.unwrap();
    }
    db.batch_execute(&format!(
        "SET enable_seqscan = off; SET plan_cache_mode = force_generic_plan; SET jit = off; \
         SET max_parallel_workers_per_gather = 0; \
         PREPARE claimed_since(double precision) AS {}; \
         PREPARE finish_orphan_cancels AS {}; \
         PREPARE held AS {} SELECT count(*) FROM held; \
         PREPARE claim_round(uuid[], uuid[], boolean[]) AS {}; \
         PREPARE finish(uuid[], uuid[], text[], text[]) AS {}; \
         PREPARE end_tasks(uuid[], uuid, text) AS {};",
        dispatch_broker::tasks::sql::CLAIMED_SINCE.as_str(),
        dispatch_broker::tasks::sql::FINISH_ORPHAN_CANCELS,
        dispatch_broker::states::in_sql(include_str!("../../src/tasks/held.sql")),
        dispatch_broker::tasks::sql::CLAIM_ROUND,
        dispatch_broker::tasks::sql::FINISH.as_str(),
        dispatch_broker::tasks::sql::END_TASKS,
    ))
    .await
    .unwrap();
    let two: Vec<Uuid> = db
        .query(
            "SELECT pulp_id FROM core_task WHERE state = 'waiting' ORDER BY pulp_id DESC LIMIT 2",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let claim_round = format!(
        "EXECUTE claim_round(ARRAY['{}', '{}']::uuid[], ARRAY['{worker}', '{worker}']::uuid[], \
         ARRAY[false, true])",
        two[0], two[1]
    );
    let mut reads = Vec::new();
    for _ in 0..2 {
        reads = vec![
            (
                "claimed_since.sql",
                buffers(&db, "EXECUTE claimed_since(60)").await,
            ),
            (
                "finish_orphan_cancels.sql",
                buffers(&db, "EXECUTE finish_orphan_cancels").await,
            ),
            ("held.sql", buffers(&db, "EXECUTE held").await),
        ];
        db.batch_execute("BEGIN").await.unwrap();
        reads.push(("claim_round.sql", buffers(&db, &claim_round).await));
        let finish = format!(
            "EXECUTE finish(ARRAY['{}', '{}']::uuid[], ARRAY['{worker}', '{worker}']::uuid[], \
             ARRAY['completed', 'failed'], ARRAY[NULL, 'why'])",
            two[0], two[1]
        );
        reads.push(("finish.sql", buffers(&db, &finish).await));
        db.batch_execute("ROLLBACK").await.unwrap();
        // An ended lease's tasks: the running one it claimed, and a waiting one.
        let running: Uuid = db
            .query_one(
                "SELECT pulp_id FROM core_task WHERE app_lock_id = $1 LIMIT 1",
                &[&worker],
            )
            .await
            .unwrap()
            .get(0);
        let end_tasks = format!(
            "EXECUTE end_tasks(ARRAY['{running}', '{}']::uuid[], '{worker}', 'why')",
            two[0]
        );
        db.batch_execute("BEGIN").await.unwrap();
        reads.push(("end_tasks.sql", buffers(&db, &end_tasks).await));
        db.batch_execute("ROLLBACK").await.unwrap();
    }
    reads
}

/// Buffers one page of queue_page.sql reads from the queue's head with `blocked` tasks waiting on
/// R0, with the statistics from before they arrived (as until autovacuum's next ANALYZE after a
/// burst), under the settings the resource queues read it with.
async fn queue_page_from_the_head(blocked: usize) -> u64 {
    let (_url, db) = pulp_database_client().await;
    pulp_task(&db, &["prn:file.repository:A"]).await;
    db.batch_execute("ANALYZE core_task").await.unwrap();
    db.batch_execute(&format!(
        "SET session_replication_role = replica; \
         INSERT INTO core_task (pulp_id, pulp_created, state, name, logging_cid, \
             reserved_resources_record, pulp_domain_id, versions, pulp_api_version) \
         SELECT gen_random_uuid(), clock_timestamp(), 'waiting', 't', 'c', \
             ARRAY['prn:python.repository:R0', 'shared:pdrn:D1'], d.pulp_id, ''::hstore, 'v3' \
         FROM core_domain d, generate_series(1, {blocked}); \
         SET session_replication_role = origin;"
    ))
    .await
    .unwrap();
    db.batch_execute(&format!(
        "SET enable_seqscan = off; SET plan_cache_mode = force_generic_plan; SET jit = off; \
         SET max_parallel_workers_per_gather = 0; {} \
         PREPARE queue_page(timestamptz, uuid) AS {};",
        dispatch_broker::tasks::sql::QUEUE_PAGE_SETTINGS.replace("SET LOCAL", "SET"),
        dispatch_broker::tasks::sql::QUEUE_PAGE,
    ))
    .await
    .unwrap();
    let mut read = 0;
    for _ in 0..2 {
        read = buffers(&db, "EXECUTE queue_page(NULL, NULL)").await;
    }
    read
}

/// A load of the resource queues reads the queue from its head a page (5,000 tasks) at a time:
/// each page must read about a page's worth, whatever follows it. With statistics from before a
/// burst, the generic plan bitmapped Pulp's state index and sorted every waiting task after the
/// position for each page (at 1,000,000 a load then took 35-69 s).
#[tokio::test]
async fn a_queue_page_reads_a_page_not_the_backlog() {
    let small = queue_page_from_the_head(20_000).await;
    let large = queue_page_from_the_head(60_000).await;
    println!("queue_page.sql from the head: {small} buffers at 20,000, {large} at 60,000");
    assert!(
        large <= small * 3 / 2 + 8,
        "queue_page.sql reads {large} buffers at 60,000 waiting, {small} at 20,000"
    );
}

/// The sweeper runs beside every fetch: what it reads each turn must not grow with the backlog
/// either (at 1,000,000 blocked it took a core for 200 ms per statement, and the fetches that
/// overlapped it waited), whatever the statistics say.
#[tokio::test]
async fn sweeper_statements_read_no_more_with_a_larger_backlog() {
    for statistics in ["none", "before", "fresh"] {
        let small = sweeper_reads(1_000, statistics).await;
        let large = sweeper_reads(20_000, statistics).await;
        println!("statistics {statistics}: {small:?} at 1,000, {large:?} at 20,000");
        for ((name, at_small), (_, at_large)) in small.iter().zip(&large) {
            assert!(
                *at_large <= at_small * 3 / 2 + 8,
                "{name} reads {at_large} pages with 20,000 blocked, {at_small} with 1,000 \
                 (statistics: {statistics})"
            );
        }
    }
}

/// Inserts tasks on distinct repositories the way pulpcore's dispatch does, through Pulp's
/// insert trigger: their GIN entries go to the index's pending list (on by default).
async fn fill_pending_list(db: &tokio_postgres::Client) {
    db.batch_execute(
        "INSERT INTO core_task (pulp_id, pulp_created, state, name, logging_cid, reserved_resources_record, \
             pulp_domain_id, versions, pulp_api_version) \
         SELECT gen_random_uuid(), now(), 'waiting', 't', 'c', \
                ARRAY['prn:file.repository:P' || i, 'shared:pdrn:D1'], d.pulp_id, ''::hstore, 'v3' \
         FROM core_domain d, generate_series(1, 2000) AS i",
    )
    .await
    .unwrap();
}

/// Pages a merge of the pending list moves now (0: it was empty).
async fn pending_pages(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        "SELECT gin_clean_pending_list('pulp_task_resources_index'::regclass)",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// Pages read once R0's head finished (R0's next tasks come first, and `blocked` tasks use R0),
/// with the end of the queue's head passed (the 256th incomplete task, as the resource queues
/// say) and without: by candidates.sql for the first page from the queue's head, and by task.sql
/// for R0's next task (a claim of it put back, or ClaimTask).
async fn next_head_reads(blocked: usize) -> NextHeadReads {
    let (db, _, _) = incident_database(blocked).await;
    db.batch_execute(&format!(
        "SET enable_seqscan = off; SET plan_cache_mode = force_generic_plan; SET jit = off; \
         SET max_parallel_workers_per_gather = 0; {} \
         PREPARE candidates(text[], timestamptz, uuid, timestamptz, uuid, text[], int[]) AS {}; \
         PREPARE task(uuid[], timestamptz, uuid, text[], int[]) AS {}; \
         UPDATE core_task SET state = 'completed' WHERE state = 'running' \
         AND reserved_resources_record @> ARRAY['prn:python.repository:R0'];",
        candidates_settings(),
        dispatch_broker::tasks::sql::CANDIDATES.replace("$page_size", "8"),
        dispatch_broker::tasks::sql::TASK.as_str(),
    ))
    .await
    .unwrap();
    let next: String = db
        .query_one(
            "SELECT pulp_id::text FROM core_task WHERE state = 'waiting' \
             AND reserved_resources_record @> ARRAY['prn:python.repository:R0'] \
             ORDER BY pulp_created, pulp_id LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let near = db
        .query_one(
            "SELECT pulp_created::text, pulp_id::text FROM core_task \
             WHERE state IN ('waiting', 'running', 'canceling') \
             ORDER BY pulp_created, pulp_id OFFSET 255 LIMIT 1",
            &[],
        )
        .await
        .unwrap();
    let (created, id): (String, String) = (near.get(0), near.get(1));
    // R0's queue is busy (and long): the broker names it so, with its users.
    let users: i64 = db
        .query_one(
            "SELECT count(*) FROM core_task WHERE state IN ('waiting', 'running', 'canceling') \
             AND reserved_resources_record @> ARRAY['prn:python.repository:R0']",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let busy = format!("'{{prn:python.repository:R0}}', '{{{users}}}'");
    let mut reads = NextHeadReads::default();
    // Twice each: the first execution of a prepared statement may still be a custom plan.
    for _ in 0..2 {
        reads.page = buffers(
            &db,
            &format!("EXECUTE candidates('{{}}', NULL, NULL, '{created}', '{id}', {busy})"),
        )
        .await;
        reads.page_by_name = buffers(
            &db,
            "EXECUTE candidates('{}', NULL, NULL, NULL, NULL, '{}', '{}')",
        )
        .await;
        reads.task = buffers(
            &db,
            &format!("EXECUTE task(ARRAY['{next}']::uuid[], '{created}', '{id}', {busy})"),
        )
        .await;
        reads.task_by_name = buffers(
            &db,
            &format!("EXECUTE task(ARRAY['{next}']::uuid[], NULL, NULL, '{{}}', '{{}}')"),
        )
        .await;
    }
    reads
}

/// What [`next_head_reads`] measures, in pages.
#[derive(Debug, Default)]
struct NextHeadReads {
    page: u64,
    page_by_name: u64,
    task: u64,
    task_by_name: u64,
}

/// Once R0's head finished, the exact look-up of R0's next tasks reads the few tasks older than
/// them, not R0's queue, in the page (candidates.sql) and when R0's next task is looked up by id
/// (task.sql: a claim of it put back, ClaimTask): flat from 1,000 to 20,000 blocked, where the
/// look-up by R0's name (what a task deeper in the queue gets) grows with the queue.
#[tokio::test]
async fn the_next_task_of_a_long_queue_is_looked_up_against_the_older_tasks() {
    let small = next_head_reads(1_000).await;
    let large = next_head_reads(20_000).await;
    println!("pages at R0's next task, 1,000 blocked: {small:?}; 20,000 blocked: {large:?}");
    for (statement, small, large, small_by_name, large_by_name) in [
        (
            "candidates.sql",
            small.page,
            large.page,
            small.page_by_name,
            large.page_by_name,
        ),
        (
            "task.sql",
            small.task,
            large.task,
            small.task_by_name,
            large.task_by_name,
        ),
    ] {
        support::no_fetch_reads_more_at_20_000(
            &format!("of {statement} at R0's next task"),
            &[small as i64],
            &[large as i64],
        );
        assert!(
            large_by_name > 5 * small_by_name.max(1) && large_by_name > 5 * large,
            "{statement}: the look-up by name does not grow: the test proves nothing \
             ({small_by_name} / {large_by_name})"
        );
    }
}

/// A task near the queue's head whose conflict keys name no busy queue is looked up through the
/// GIN index: it reads its resources' few users, not every incomplete task older than it (here
/// 3,000 tasks of other repositories running before it, as a large fleet's are). With a busy
/// queue's entry among its keys it reads those older tasks, and both ways count the same.
#[tokio::test]
async fn a_task_near_the_head_with_no_busy_queue_reads_its_resources_users() {
    let (_url, db) = pulp_database_client().await;
    pulp_tasks_bulk(
        &db,
        3_000,
        "'running'",
        "ARRAY['prn:file.repository:F' || i, 'shared:prn:core.domain:D']",
    )
    .await;
    pulp_tasks_bulk(
        &db,
        2,
        "'waiting'",
        "ARRAY['prn:file.repository:X', 'shared:prn:core.domain:D']",
    )
    .await;
    let task: Uuid = db
        .query_one(
            "SELECT pulp_id FROM core_task WHERE state = 'waiting' \
             ORDER BY pulp_created DESC, pulp_id DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    db.batch_execute(&format!(
        // (The broker keeps the GIN index's pending list merged: `--gin-clean-interval`.)
        "ANALYZE core_task; SELECT gin_clean_pending_list('pulp_task_resources_index'); \
         SET enable_seqscan = off; SET plan_cache_mode = force_generic_plan; \
         SET jit = off; SET max_parallel_workers_per_gather = 0; {} \
         PREPARE task(uuid[], timestamptz, uuid, text[], int[]) AS {}",
        candidates_settings(),
        dispatch_broker::tasks::sql::TASK.as_str(),
    ))
    .await
    .unwrap();
    let near = "'infinity', 'ffffffff-ffff-ffff-ffff-ffffffffffff'";
    let not_busy = format!("EXECUTE task(ARRAY['{task}']::uuid[], {near}, '{{}}', '{{}}')");
    let busy = format!(
        "EXECUTE task(ARRAY['{task}']::uuid[], {near}, ARRAY['prn:file.repository:X'], ARRAY[{}])",
        dispatch_broker::ready::BUSY_QUEUE
    );
    // Past the end of the queue's head, only a long queue's entry bounds a look-up against the
    // older tasks; a busy queue's that is not long leaves it to the GIN index.
    let past = |users: usize| {
        format!(
            "EXECUTE task(ARRAY['{task}']::uuid[], NULL, NULL, ARRAY['prn:file.repository:X'], \
             ARRAY[{users}])"
        )
    };
    let (busy_past, long_past) = (
        past(dispatch_broker::ready::LONG_QUEUE - 1),
        past(dispatch_broker::ready::LONG_QUEUE),
    );
    let (mut users, mut older, mut not_long, mut long) = (0, 0, 0, 0);
    // Twice each: the first execution of a prepared statement may still be a custom plan.
    for _ in 0..2 {
        users = buffers(&db, &not_busy).await;
        older = buffers(&db, &busy).await;
        not_long = buffers(&db, &busy_past).await;
        long = buffers(&db, &long_past).await;
    }
    println!(
        "pages: through its resources' users {users}, against the older tasks {older}; past the \
         head, a busy queue's entry {not_long}, a long queue's {long}"
    );
    assert!(
        not_long == users && long > users + 5,
        "past the head, a busy queue's entry read {not_long} pages and a long queue's {long} \
         (through the GIN index alone: {users})"
    );
    assert!(
        users * 4 < older,
        "the look-up of a task with no busy queue read {users} pages, against the older tasks \
         {older}"
    );
    for execute in [&not_busy, &busy, &busy_past, &long_past] {
        let rows = rows_under_candidates_settings(&db, execute).await;
        let conflicts: Option<i64> = rows[0].get(6);
        assert_eq!(conflicts, Some(1), "{execute}: one older task of X");
    }
}

/// With Pulp's pending list on (a fresh Pulp database), the broker merges it every
/// `--gin-clean-interval`, so readiness look-ups do not read it; 0 leaves it alone.
#[tokio::test]
async fn the_broker_keeps_the_gin_pending_list_merged() {
    for (interval, merged_by_broker) in [("0s", false), ("100ms", true)] {
        let url = tokio::task::spawn_blocking(pulp_database).await.unwrap();
        let redis = tokio::task::spawn_blocking(|| dispatch_testkit::Redis::start().unwrap())
            .await
            .unwrap();
        let env = Env::on(url, redis, |args| {
            args.gin_clean_interval = humantime::parse_duration(interval).unwrap();
        })
        .await;
        // Autovacuum (an analyze too) merges the pending list as well: only the broker may here.
        env.db
            .batch_execute("ALTER TABLE core_task SET (autovacuum_enabled = off)")
            .await
            .unwrap();
        fill_pending_list(&env.db).await;
        // Fifteen intervals: the broker has merged what is pending by then, if it merges at all
        // (looking earlier would merge it here and hide the broker's work).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let pending = pending_pages(&env.db).await;
        if merged_by_broker {
            assert_eq!(pending, 0, "the broker left {pending} pending pages");
        } else {
            assert!(pending > 0, "nothing was pending: the test proves nothing");
        }
    }
}

/// A Pulp database on a Postgres of its own that keeps pg_stat_statements, and a broker on it.
async fn measured_pulp(
    tweak: impl FnOnce(&mut dispatch_broker::config::ServeArgs),
) -> (dispatch_testkit::Postgres, Env) {
    support::measured_env("pulp", &[PULP_SCHEMA], tweak).await
}

/// Pages (8 kB buffers) the fetch path's reads (candidates.sql, task.sql for the claims put
/// back, hiding.sql) took since the last call, once every pass has ended.
async fn fetch_pages(env: &Env) -> i64 {
    env.broker().passes.idle().await;
    support::statement_pages(
        &env.db,
        &["%candidates.sql:%", "%task.sql:%", "%hiding.sql:%"],
    )
    .await
}

const R0: &str = "prn:file.repository:R0";

/// Inserts `n` tasks in one statement with Pulp's insert trigger off (a backlog that arrived at
/// once), every NOT NULL column filled as pulpcore's dispatch does: `state` and `record` are SQL
/// expressions over `i` (1 to `n`).
async fn pulp_tasks_bulk(db: &tokio_postgres::Client, n: usize, state: &str, record: &str) {
    db.batch_execute(&format!(
        "BEGIN; SET LOCAL session_replication_role = replica; \
         INSERT INTO core_task (pulp_id, pulp_created, pulp_last_updated, state, name, \
             logging_cid, reserved_resources_record, pulp_domain_id, versions, immediate, \
             deferred, pulp_api_version) \
         SELECT gen_random_uuid(), clock_timestamp(), now(), {state}, 'sync', 'cid', {record}, \
                d.pulp_id, hstore('core', '3.123.1'), false, true, 'v3' \
         FROM core_domain d, generate_series(1, {n}) AS i WHERE d.name = 'default'; \
         COMMIT;"
    ))
    .await
    .expect("insert pulp tasks");
}

/// Tasks of other repositories (F<i> for i in `range`) in `domain` (their shared entry),
/// inserted as pulpcore's dispatch does.
async fn other_tasks(db: &tokio_postgres::Client, domain: &str, range: std::ops::Range<usize>) {
    for i in range {
        pulp_task(db, &[&format!("prn:file.repository:F{i}"), domain]).await;
    }
}

/// R0's head task (of domain D1), fetched and started under the lease "busy"; returns the lease
/// and the task.
async fn r0_head_running(env: &mut Env) -> (String, dispatch_broker::proto::Task) {
    pulp_task(&env.db, &[R0, "shared:prn:core.domain:D1"]).await;
    let busy = env.open("busy").await;
    let head = env.fetch(&busy).await.expect("the head task");
    env.start(&busy, &head).await;
    (busy, head)
}

/// `blocked` waiting tasks on R0 (in domain D1), inserted at once and merged into the GIN index,
/// as the broker does every second (the look-ups would otherwise read the backlog's pending
/// entries).
async fn r0_backlog(env: &Env, blocked: usize) {
    pulp_tasks_bulk(
        &env.db,
        blocked,
        "'waiting'",
        &format!("ARRAY['{R0}', 'shared:prn:core.domain:D1']"),
    )
    .await;
    env.db
        .query(dispatch_broker::tasks::sql::GIN_CLEAN, &[])
        .await
        .unwrap();
}

/// How the queue after R0's head is set up and moved (see [`pages_after_the_head`]).
#[derive(Clone, Copy, Debug)]
struct AfterTheHead {
    /// The statistics are gathered after the backlog arrived; else they are those from before
    /// it (as until autovacuum's next ANALYZE).
    fresh: bool,
    /// The leases put their claims back instead of finishing their tasks.
    put_back: bool,
    /// That many tasks of a third domain run from before R0's head on (so R0's next task lies
    /// past the end of the queue's head).
    older_running: usize,
    /// The shared entry of the other repositories' tasks: another domain's, or R0's own (one
    /// Pulp domain for all, as in the Pulp bench).
    others_domain: &'static str,
}

/// Pages the fetch path read in each fetch once R0's head finished, on Pulp's schema: R0's head
/// runs, `blocked` tasks wait behind it (inserted in one statement), 20 tasks of other
/// repositories after them; the head finishes; then rounds as the Pulp bench's: 5 leases each
/// fetch a task, then all finish theirs (one of them R0's next task: the queue moves) or put
/// their claims back (R0's next task among them, checked first by the next pass), and 5 new
/// tasks of other repositories arrive.
async fn pages_after_the_head(blocked: usize, case: AfterTheHead) -> Vec<i64> {
    let AfterTheHead {
        fresh,
        put_back,
        older_running,
        others_domain,
    } = case;
    let (_pg, mut env) = measured_pulp(|args| {
        args.fetch.hint_max_age = Duration::from_secs(3600);
    })
    .await;
    pulp_tasks_bulk(
        &env.db,
        older_running,
        "'running'",
        "ARRAY['prn:file.repository:O' || i, 'shared:prn:core.domain:D3']",
    )
    .await;
    let (busy, head) = r0_head_running(&mut env).await;
    env.db.batch_execute("ANALYZE core_task").await.unwrap();
    r0_backlog(&env, blocked).await;
    if fresh {
        env.db.batch_execute("ANALYZE core_task").await.unwrap();
    }
    other_tasks(&env.db, others_domain, 0..20).await;
    env.settle_queues().await;
    env.finish(&busy, &head, "completed").await;
    let mut leases = Vec::new();
    for i in 0..5 {
        leases.push(env.open(&format!("w{i}")).await);
    }
    fetch_pages(&env).await;
    let mut pages = Vec::new();
    for round in 0..4 {
        let mut fetched = Vec::new();
        for lease in &leases {
            let task = env.fetch(lease).await.expect("a ready task");
            pages.push(fetch_pages(&env).await);
            fetched.push((lease.clone(), task));
        }
        // What was handed out: R0's oldest incomplete task, and no other R0 task.
        let ids: Vec<Uuid> = fetched.iter().map(|(_, t)| id(t)).collect();
        let (r0_handed_out, older_r0): (i64, i64) = env
            .db
            .query_one(
                "SELECT count(*), coalesce(sum((SELECT count(*) FROM core_task u \
                     WHERE u.reserved_resources_record @> ARRAY[$2] \
                       AND u.state IN ('waiting', 'running', 'canceling') \
                       AND (u.pulp_created, u.pulp_id) < (t.pulp_created, t.pulp_id))), 0)::bigint \
                 FROM core_task t \
                 WHERE t.pulp_id = ANY ($1) AND t.reserved_resources_record @> ARRAY[$2]",
                &[&ids, &R0],
            )
            .await
            .map(|row| (row.get(0), row.get(1)))
            .unwrap();
        assert_eq!(
            (r0_handed_out, older_r0),
            (1, 0),
            "round {round}: R0's tasks handed out, and incomplete R0 tasks older than them"
        );
        for (lease, task) in fetched {
            if put_back {
                env.release(&lease, &task)
                    .await
                    .expect("put the claim back");
            } else {
                env.start(&lease, &task).await;
                env.finish(&lease, &task, "completed").await;
            }
        }
        other_tasks(&env.db, others_domain, 20 + round * 5..25 + round * 5).await;
    }
    env.shutdown().await;
    pages
}

/// The guard for the queue after its head: once R0's head finished, each round hands out R0's
/// next task (exactly one R0 task, with no incomplete R0 task older than it) and other
/// repositories', and no fetch reads R0's queue, whatever statistics the
/// generic plans were made with, whether the tasks finish (the queue moves) or their claims are
/// put back (R0's next task is then checked first by the next pass), whether R0's next task lies
/// within the end of the queue's head or past it, and whether the other repositories share R0's
/// domain (a resource then every task uses, shared).
#[tokio::test]
async fn no_fetch_reads_the_queue_behind_its_head() {
    let (d1, d2) = ("shared:prn:core.domain:D1", "shared:prn:core.domain:D2");
    let case = |fresh, put_back, older_running, others_domain| AfterTheHead {
        fresh,
        put_back,
        older_running,
        others_domain,
    };
    for case in [
        case(false, false, 0, d2),
        case(true, false, 0, d2),
        case(false, true, 0, d2),
        case(false, false, 300, d2),
        case(false, false, 300, d1),
    ] {
        let small = pages_after_the_head(1_000, case).await;
        let large = pages_after_the_head(20_000, case).await;
        support::no_fetch_reads_more_at_20_000(
            &format!("of the fetch path, {case:?}"),
            &small,
            &large,
        );
    }
}

/// candidates.sql's exact look-up gives the same count whichever way it reads: through the GIN
/// index, against the older tasks near the queue's head (with a busy queue's entry among the
/// task's conflict keys; without one it reads through the GIN index), and against the older
/// tasks up to a long queue's bound (within it, and past it, where it falls back to the GIN
/// index); and task.sql's, the same look-up by task id, gives the page's counts.
#[tokio::test]
async fn the_exact_look_up_counts_the_same_whichever_way_it_reads() {
    let (_url, db) = pulp_database_client().await;
    // A mixed queue of 800 tasks over five repositories in both modes and a shared domain, in
    // every state (a few without a record), none running (a running task's names are held, and
    // the page skips what they hide). Half are incomplete: the later ones have more than a long
    // queue's 256 incomplete tasks before them.
    pulp_tasks_bulk(
        &db,
        800,
        "(ARRAY['waiting', 'waiting', 'waiting', 'canceling', 'completed', 'failed', 'canceled', \
                'skipped'])[1 + i % 8]",
        "CASE WHEN i % 37 = 0 THEN NULL \
              WHEN i % 3 = 0 THEN ARRAY['shared:R' || (i % 5), 'shared:D'] \
              ELSE ARRAY['R' || (i % 5), 'shared:D'] END",
    )
    .await;
    db.batch_execute(
        "SET enable_seqscan = off; SET plan_cache_mode = force_generic_plan; SET jit = off;",
    )
    .await
    .unwrap();
    db.batch_execute(&format!(
        "PREPARE candidates(text[], timestamptz, uuid, timestamptz, uuid, text[], int[]) AS {}",
        dispatch_broker::tasks::sql::CANDIDATES.replace("$page_size", "1000")
    ))
    .await
    .unwrap();
    let entries = "ARRAY['R0','R1','R2','R3','R4','shared:R0','shared:R1','shared:R2',\
                   'shared:R3','shared:R4','D','shared:D']";
    let counts = |users: i32| format!("array_fill({users}, ARRAY[12])");
    let near = "'infinity', 'ffffffff-ffff-ffff-ffff-ffffffffffff'";
    let busy = dispatch_broker::ready::BUSY_QUEUE as i32;
    let long = dispatch_broker::ready::LONG_QUEUE as i32;
    let ways = [
        ("through the GIN index", "NULL, NULL, '{}', '{}'".to_owned()),
        (
            "near the head, a busy queue's entry among its keys",
            format!("{near}, {entries}, {}", counts(busy)),
        ),
        (
            "near the head, no busy queue's entry among its keys",
            format!("{near}, '{{}}', '{{}}'"),
        ),
        (
            "within a long queue's bound",
            format!("NULL, NULL, {entries}, {}", counts(1_000_000)),
        ),
        (
            "not a long queue's",
            format!("NULL, NULL, {entries}, {}", counts(long - 1)),
        ),
        (
            // D is among every task's conflict keys (and so is its one long queue here): a task
            // with up to 256 incomplete tasks before it is within the bound, a later one past it.
            "within and past a long queue's bound",
            format!("NULL, NULL, ARRAY['D'], ARRAY[{long}]"),
        ),
    ];
    let incomplete: i64 = db
        .query_one(
            "SELECT count(*) FROM core_task WHERE state IN ('waiting', 'canceling')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        incomplete > i64::from(long) + 50,
        "{incomplete} incomplete tasks: none is past a long queue's bound"
    );
    let mut answers = Vec::new();
    // Twice each way: the first executions of a prepared statement may be custom plans.
    for (way, params) in ways.iter().chain(ways.iter()) {
        let rows = rows_under_candidates_settings(
            &db,
            &format!("EXECUTE candidates('{{}}', NULL, NULL, {params})"),
        )
        .await;
        let counts: Vec<(Option<Uuid>, Option<i64>)> =
            rows.iter().map(|r| (r.get(0), r.get(6))).collect();
        answers.push((way, counts));
    }
    let (_, reference) = &answers[0];
    let older: Vec<i64> = reference.iter().filter_map(|(_, c)| *c).collect();
    assert!(
        older.len() >= 60 && older.contains(&0) && older.iter().any(|c| *c > 3),
        "the page does not mix ready tasks and tasks behind more than three: {older:?}"
    );
    for (way, counts) in &answers {
        assert_eq!(counts, reference, "the look-up {way} counts otherwise");
    }
    // task.sql, which makes the same look-up for tasks by id (ClaimTask, claims put back),
    // counts as the page does, every way.
    db.batch_execute(&format!(
        "PREPARE task(uuid[], timestamptz, uuid, text[], int[]) AS {}",
        dispatch_broker::tasks::sql::TASK.as_str()
    ))
    .await
    .unwrap();
    let ids: Vec<Uuid> = reference.iter().filter_map(|(id, _)| *id).collect();
    let expected: std::collections::BTreeMap<Uuid, i64> = reference
        .iter()
        .filter_map(|(id, c)| Some(((*id)?, (*c)?)))
        .collect();
    let id_list = ids
        .iter()
        .map(|id| format!("'{id}'"))
        .collect::<Vec<_>>()
        .join(",");
    for (way, params) in ways.iter().chain(ways.iter()) {
        let rows = rows_under_candidates_settings(
            &db,
            &format!("EXECUTE task(ARRAY[{id_list}]::uuid[], {params})"),
        )
        .await;
        let counts: std::collections::BTreeMap<Uuid, i64> =
            rows.iter().map(|r| (r.get(0), r.get(6))).collect();
        assert_eq!(
            counts, expected,
            "task.sql's look-up {way} counts otherwise"
        );
    }
}

/// Pages task.sql read when a lease claimed R0's next task by id (ClaimTask) once R0's head
/// finished, with `blocked` tasks on R0 behind it, on Pulp's schema; with the resource queues
/// (`queues`: the look-up reads the few tasks older than it) or without (through the GIN index:
/// R0's whole queue).
async fn claim_pages(blocked: usize, queues: bool) -> i64 {
    let (_pg, mut env) = measured_pulp(|args| {
        args.fetch.resource_queues = queues;
    })
    .await;
    let (busy, head) = r0_head_running(&mut env).await;
    r0_backlog(&env, blocked).await;
    env.db.batch_execute("ANALYZE core_task").await.unwrap();
    env.settle_queues().await;
    env.finish(&busy, &head, "completed").await;
    let next: Uuid = env
        .db
        .query_one(
            "SELECT pulp_id FROM core_task WHERE state = 'waiting' \
             AND reserved_resources_record @> ARRAY[$1] ORDER BY pulp_created, pulp_id LIMIT 1",
            &[&R0],
        )
        .await
        .unwrap()
        .get(0);
    let lease = env.open("claimer").await;
    support::statement_pages(&env.db, &["%task.sql:%"]).await;
    let claimed = env
        .claim(&lease, next)
        .await
        .expect("ClaimTask")
        .expect("R0's next task is ready once its head finished");
    assert_eq!(id(&claimed), next);
    let pages = support::statement_pages(&env.db, &["%task.sql:%"]).await;
    env.shutdown().await;
    pages
}

/// ClaimTask of R0's next task, once R0's head finished, reads as many pages with 20,000 tasks
/// on R0 as with 1,000: the broker gives task.sql where the queue's head ends. Without the
/// resource queues (the GIN look-up) it grows, which shows what the test measures.
#[tokio::test]
async fn claiming_the_next_task_of_a_long_queue_reads_no_more_with_a_larger_backlog() {
    let (small, large) = (
        claim_pages(1_000, true).await,
        claim_pages(20_000, true).await,
    );
    let (small_gin, large_gin) = (
        claim_pages(1_000, false).await,
        claim_pages(20_000, false).await,
    );
    println!(
        "task.sql pages for ClaimTask of R0's next task: {small} / {large} at 1,000 / 20,000 \
         blocked ({small_gin} / {large_gin} through the GIN index)"
    );
    support::no_fetch_reads_more_at_20_000("of ClaimTask at R0's next task", &[small], &[large]);
    assert!(
        large_gin > 5 * small_gin.max(1) && large_gin > 5 * large.max(1),
        "the GIN look-up does not grow: the test proves nothing ({small_gin} / {large_gin})"
    );
}

/// On Pulp's database a domain is named by its name (`core_domain.name`): SetFairness reads the
/// names when it meets one this replica has not seen among waiting tasks, and the override holds
/// for that domain's tasks. An unknown name is NOT_FOUND and changes nothing.
#[tokio::test]
async fn set_fairness_names_a_pulp_domain_by_its_name() {
    use dispatch_broker::proto::SetFairnessRequest;
    let url = tokio::task::spawn_blocking(pulp_database).await.unwrap();
    let redis = tokio::task::spawn_blocking(|| dispatch_testkit::Redis::start().unwrap())
        .await
        .unwrap();
    let mut env = Env::on(url, redis, |_| {}).await;
    env.db
        .batch_execute(
            "INSERT INTO core_domain (pulp_id, pulp_created, pulp_last_updated, name, description, \
                 storage_class, storage_settings, redirect_to_object_storage, \
                 hide_guarded_distributions, pulp_labels, default_content_guard_id) \
             VALUES (gen_random_uuid(), now(), now(), 'other', NULL, \
                 'pulpcore.app.models.storage.FileSystem', '{}'::jsonb, true, false, ''::hstore, NULL)",
        )
        .await
        .unwrap();
    let mut admin = dispatch_broker::proto::admin_client::AdminClient::connect(format!(
        "http://{}",
        env.broker().addr
    ))
    .await
    .unwrap();
    let unknown = admin
        .set_fairness(SetFairnessRequest {
            domain: "nope".into(),
            cap: Some(1),
            reason: "test".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    assert!(env
        .broker()
        .locks
        .fair_overrides()
        .await
        .unwrap()
        .is_empty());
    // No task of "other" has been seen yet: its name is read from core_domain.
    admin
        .set_fairness(SetFairnessRequest {
            domain: "other".into(),
            cap: Some(1),
            reason: "test".into(),
            ..Default::default()
        })
        .await
        .expect("a Pulp domain named by its name");
    let mut others = Vec::new();
    for i in 0..2 {
        let id = Uuid::new_v4();
        env.db
            .execute(
                "INSERT INTO core_task (pulp_id, pulp_created, pulp_last_updated, state, name, \
                     logging_cid, reserved_resources_record, pulp_domain_id, versions, immediate, \
                     deferred, pulp_api_version) \
                 SELECT $1, now(), now(), 'waiting', 'pulpcore.app.tasks.base.general_create', \
                        'cid', ARRAY['prn:file.repository:o' || $2::text], d.pulp_id, \
                        hstore('core', '3.123.1'), false, true, 'v3' \
                 FROM core_domain d WHERE d.name = 'other'",
                &[&id, &i.to_string()],
            )
            .await
            .unwrap();
        others.push(id);
    }
    let w = env.open("1@host").await;
    let first = env.fetch(&w).await.expect("the first task of other");
    assert_eq!(id(&first), others[0]);
    assert!(
        env.fetch(&w).await.is_none(),
        "other is at its cap of 1 while its first task runs"
    );
    env.shutdown().await;
}
