//! The head-of-line incident the fetch and admin benches share: one repository's queue (R0 in
//! domain D1) of `blocked` waiting tasks behind its oldest task, which a busy worker runs, and
//! `others` tasks of other domains (one repository each, domain D2) behind them.
#![allow(dead_code)]

use std::time::Duration;

use dispatch_worker::{TaskGuard, Worker, WorkerConfig};

/// The seeded incident: the database, the busy worker and the running head.
pub struct Incident {
    pub db: tokio_postgres::Client,
    pub busy: Worker,
    pub head: TaskGuard,
}

/// Seeds the incident on a migrated database at `url`, served by the broker at `endpoint`.
pub async fn seed(url: &str, endpoint: &str, blocked: i32, others: i32) -> Incident {
    let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    db.batch_execute(
        "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) VALUES \
         (gen_random_uuid(), 'head', 'waiting', ARRAY['prn:python.repository:R0', 'shared:prn:core.domain:D1'])",
    )
    .await
    .unwrap();
    let busy = Worker::connect(endpoint, quiet("busy")).await.unwrap();
    let head = busy.next_task(Duration::ZERO).await.unwrap().unwrap();
    head.start().await.unwrap();
    db.batch_execute(&format!(
        "BEGIN; SET LOCAL session_replication_role = replica; \
         INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
         SELECT gen_random_uuid(), clock_timestamp(), 'blocked', 'waiting', \
                ARRAY['prn:python.repository:R0', 'shared:prn:core.domain:D1'] FROM generate_series(1, {blocked}); \
         INSERT INTO core_task (pulp_id, pulp_created, name, state, reserved_resources_record) \
         SELECT gen_random_uuid(), clock_timestamp(), 'other', 'waiting', \
                ARRAY['prn:file.repository:F' || i, 'shared:prn:core.domain:D2'] FROM generate_series(1, {others}) AS i; \
         COMMIT;"
    ))
    .await
    .unwrap();
    db.batch_execute("VACUUM ANALYZE core_task").await.unwrap();
    Incident { db, busy, head }
}

/// A worker whose heartbeats stay out of the measured window (one every 200 s).
pub fn quiet(name: &str) -> WorkerConfig {
    let mut config = WorkerConfig::new(name);
    config.ttl = Duration::from_secs(600);
    config
}

/// The `p` quantile of sorted, non-empty durations.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}
