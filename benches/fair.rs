//! Fair dispatch across domains (docs/benchmarks.md, "Fair dispatch"), on pulpcore 3.123.1's
//! schema (`tests/fixtures/`) with fair dispatch's indexes: domain D1 has dispatched N ready
//! tasks on distinct repositories (default 17,000); one second after 10 workers start, D2
//! dispatches 200 and D3 50 immediate tasks, through Pulp's insert trigger, with Pulp's wake-up
//! notification. Every task takes 20-50 ms (uniform); a worker fetches with `start`, sleeps, and
//! finishes. One run per setting, in the same process: plain FIFO (`--fair-by none`), fair 1:1:1,
//! fair 2:1:1, a cap of 3 on D1, a reserve of 2 for immediate tasks.
//!
//! Reports per domain the wait (creation to grant) p50/p99 and the time from the domain's first
//! task's creation to its last task's end, and the overall throughput against FIFO's; writes
//! `benches/results/fair.svg` (completed tasks over time per domain, FIFO against fair 1:1:1).
//!
//! D1's backlog is inserted in one statement with Pulp's insert trigger off (its per-row check
//! reads every incomplete task of the domain: 17,000 rows one by one would take minutes), each
//! row stamped with `clock_timestamp()` as the trigger would; D2's and D3's arrive through it.
//!
//! Run: `cargo bench --bench fair` (or `-- 2000` for a quick run with a smaller backlog).
//!
//! `cargo bench --bench fair -- cost [DOMAINS]`: what fairness costs a fetch with many domains
//! waiting. The same 20,000 ready tasks, all of one domain or spread over DOMAINS domains (10,000
//! by default, two tasks each); one worker fetches (no wait, with `start`) and finishes at once,
//! 2,000 fetches after 200 to warm up (one at a time: the fetch's own cost, not contention);
//! FetchTask's p50 / p99 as the worker sees it, the ratio against one domain, in the same
//! process, and per task fetched and finished the Postgres statements and Redis calls (those of
//! the fetch's passes apart) and the directed passes, from the broker's counters.

#[path = "support/incident.rs"]
mod incident;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use dispatch_broker::config::ServeArgs;
use dispatch_broker::fair::FairBy;
use dispatch_testkit::{Postgres, Redis};
use dispatch_worker::{FinalState, Worker};
use incident::{percentile, quiet};
use plotters::prelude::*;
use uuid::Uuid;

const WORKERS: usize = 10;
const D2_TASKS: i32 = 200;
const D3_TASKS: i32 = 50;
const DOMAINS: [(&str, u128); 3] = [("D1", 0xd1), ("D2", 0xd2), ("D3", 0xd3)];
const PULP_SCHEMA: &str = include_str!("../tests/fixtures/pulpcore-3.123.1-schema.sql");

struct Setting {
    name: &'static str,
    by: FairBy,
    policy: &'static str,
}

const SETTINGS: [Setting; 5] = [
    Setting {
        name: "FIFO (--fair-by none)",
        by: FairBy::None,
        policy: "",
    },
    Setting {
        name: "fair 1:1:1",
        by: FairBy::Domain,
        policy: "",
    },
    Setting {
        name: "fair 2:1:1",
        by: FairBy::Domain,
        policy: "[groups.D1]\nweight = 2\n",
    },
    Setting {
        name: "fair, cap 3 on D1",
        by: FairBy::Domain,
        policy: "[groups.D1]\ncap = 3\n",
    },
    Setting {
        name: "fair, reserve 2",
        by: FairBy::Domain,
        policy: "reserve = 2\n",
    },
];

/// One task as it ended: its domain, created, started, finished (seconds since the workers
/// started).
struct Done {
    domain: usize,
    created: f64,
    started: f64,
    finished: f64,
}

struct Run {
    done: Vec<Done>,
    elapsed: Duration,
}

async fn insert(db: &tokio_postgres::Client, domain: usize, n: i32, immediate: bool, bulk: bool) {
    let (name, id) = DOMAINS[domain];
    let id = Uuid::from_u128(id);
    let columns = "pulp_id, state, name, logging_cid, reserved_resources_record, pulp_domain_id, \
                   versions, immediate, deferred, pulp_api_version";
    let values = format!(
        "gen_random_uuid(), 'waiting', 'sync', '', \
         ARRAY['prn:file.filerepository:{name}-' || i, 'shared:prn:core.domain:{id}'], \
         '{id}'::uuid, ''::hstore, {immediate}, true, 'v3'"
    );
    let statement = if bulk {
        format!(
            "BEGIN; SET LOCAL session_replication_role = replica; \
             INSERT INTO core_task ({columns}, pulp_created) \
             SELECT {values}, clock_timestamp() FROM generate_series(1, {n}) i; COMMIT; \
             ANALYZE core_task"
        )
    } else {
        format!(
            "INSERT INTO core_task ({columns}) SELECT {values} FROM generate_series(1, {n}) i; \
             SELECT pg_notify('pulp_worker_wakeup', 'unblocked')"
        )
    };
    db.batch_execute(&statement).await.unwrap();
}

/// A fresh database `name` with pulpcore's schema, `setup` run on it, then prepared as the
/// README's step 1 prepares Pulp's (`migrate --lanes-index --fair-indexes --gin-fastupdate-off`);
/// Redis emptied.
async fn pulp_database(
    pg: &Postgres,
    redis: &Redis,
    name: &str,
    setup: &str,
) -> (String, tokio_postgres::Client) {
    let url = pg.create_database(name).unwrap();
    pg.psql(name, PULP_SCHEMA).unwrap();
    let _ = std::process::Command::new("redis-cli")
        .args(["-u", &redis.url(), "FLUSHALL"])
        .output();
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    if !setup.is_empty() {
        db.batch_execute(setup).await.unwrap();
    }
    dispatch_broker::tasks::Tasks::connect(&url, 1, Duration::from_secs(10), Default::default())
        .await
        .unwrap()
        .migrate(true, false, true, true)
        .await
        .unwrap();
    (url, db)
}

async fn run(pg: &Postgres, redis: &Redis, n: usize, setting: &Setting, d1: i32) -> Run {
    let (url, db) = pulp_database(pg, redis, &format!("fair{n}"), "").await;
    for (name, id) in DOMAINS {
        db.execute(
            "INSERT INTO core_domain (pulp_id, pulp_created, name, storage_class, \
             storage_settings, redirect_to_object_storage, hide_guarded_distributions, \
             pulp_labels) VALUES ($1, now(), $2, 'x', '{}', false, false, ''::hstore)",
            &[&Uuid::from_u128(id), &name],
        )
        .await
        .unwrap();
    }
    insert(&db, 0, d1, false, true).await;

    let policy = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(policy.path(), setting.policy).unwrap();
    let mut args = ServeArgs::with_urls(&url, &redis.url());
    args.fair.by = setting.by;
    args.fair.policy = Some(policy.path().to_owned());
    let broker = dispatch_broker::server::start(&args).await.unwrap();
    let endpoint = format!("http://{}", broker.addr);
    let total = d1 + D2_TASKS + D3_TASKS;
    let started = Instant::now();
    let mut handles = Vec::new();
    for w in 0..WORKERS {
        let worker = Worker::connect(&endpoint, quiet(&format!("w{w}")))
            .await
            .unwrap();
        handles.push(tokio::spawn(async move {
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(w as u64);
            while let Some(task) = worker
                .next_task_started(Duration::from_secs(1))
                .await
                .unwrap()
            {
                let ms = rand::Rng::random_range(&mut rng, 20..=50);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                task.finish(FinalState::Completed, None).await.unwrap();
            }
            worker
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    insert(&db, 1, D2_TASKS, false, false).await;
    insert(&db, 2, D3_TASKS, true, false).await;
    loop {
        let left: i64 = db
            .query_one(
                "SELECT count(*) FROM core_task WHERE state <> 'completed'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    for handle in handles {
        // Each worker sees nothing ready for a second, then ends.
        handle.await.unwrap().close().await.unwrap();
    }
    let zero = chrono::Utc::now() - chrono::Duration::from_std(started.elapsed()).unwrap();
    let rows = db
        .query(
            "SELECT pulp_domain_id, pulp_created, started_at, finished_at FROM core_task",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len() as i32, total);
    let at = |t: chrono::DateTime<chrono::Utc>| (t - zero).num_microseconds().unwrap() as f64 / 1e6;
    let done = rows
        .iter()
        .map(|r| {
            let domain: Uuid = r.get(0);
            Done {
                domain: DOMAINS
                    .iter()
                    .position(|(_, id)| Uuid::from_u128(*id) == domain)
                    .unwrap(),
                created: at(r.get(1)),
                started: at(r.get(2)),
                finished: at(r.get(3)),
            }
        })
        .collect();
    broker.shutdown().await.unwrap();
    drop(db);
    Run { done, elapsed }
}

fn plot(fifo: &Run, fair: &Run, path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let root = SVGBackend::new(path, (1100, 420)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let panels = root.split_evenly((1, 2));
    let end = fifo.elapsed.max(fair.elapsed).as_secs_f64();
    for (panel, (title, run)) in panels
        .iter()
        .zip([("plain FIFO", fifo), ("fair dispatch, weights 1:1:1", fair)])
    {
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d(0f64..end, 0f64..100.0)
            .unwrap();
        chart
            .configure_mesh()
            .x_desc("seconds since the workers started")
            .y_desc("% of the domain's tasks completed")
            .draw()
            .unwrap();
        for (d, (name, _)) in DOMAINS.iter().enumerate() {
            let mut ends: Vec<f64> = run
                .done
                .iter()
                .filter(|t| t.domain == d)
                .map(|t| t.finished)
                .collect();
            ends.sort_by(f64::total_cmp);
            let all = ends.len() as f64;
            let mut series = vec![(0.0, 0.0)];
            series.extend(
                ends.iter()
                    .enumerate()
                    .map(|(i, t)| (*t, (i + 1) as f64 * 100.0 / all)),
            );
            series.push((end, 100.0));
            let color = Palette99::pick(d).to_rgba();
            let label = match d {
                0 => "D1 (the backlog)".to_owned(),
                2 => "D3 (immediate)".to_owned(),
                _ => name.to_string(),
            };
            chart
                .draw_series(LineSeries::new(series, color.stroke_width(2)))
                .unwrap()
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .unwrap();
    }
    root.present().unwrap();
    eprintln!("wrote {}", path.display());
}

fn seconds(d: f64) -> String {
    if d < 1.0 {
        format!("{:.0} ms", d * 1000.0)
    } else {
        format!("{d:.1} s")
    }
}

/// 20,000 ready tasks over `domains` domains on Pulp's schema; the FetchTask latencies of one
/// worker fetching and finishing.
async fn cost(
    pg: &Postgres,
    redis: &Redis,
    n: usize,
    domains: i32,
) -> (Vec<Duration>, dispatch_broker::metrics::StatsSnapshot) {
    const TASKS: i32 = 20_000;
    const WARM: usize = 200;
    const FETCHES: usize = 2_000;
    const COST_WORKERS: usize = 1;
    let setup = format!(
        "INSERT INTO core_domain (pulp_id, pulp_created, name, storage_class, storage_settings, \
         redirect_to_object_storage, hide_guarded_distributions, pulp_labels) \
         SELECT ('00000000-0000-0000-0000-' || lpad(to_hex(i), 12, '0'))::uuid, now(), 'd' || i, \
                'x', '{{}}', false, false, ''::hstore FROM generate_series(1, {domains}) i; \
         BEGIN; SET LOCAL session_replication_role = replica; \
         INSERT INTO core_task (pulp_id, pulp_created, state, name, logging_cid, \
             reserved_resources_record, pulp_domain_id, versions, immediate, deferred, pulp_api_version) \
         SELECT gen_random_uuid(), clock_timestamp(), 'waiting', 'sync', '', \
                ARRAY['prn:file.filerepository:' || i, 'shared:prn:core.domain:' || (i % {domains} + 1)], \
                ('00000000-0000-0000-0000-' || lpad(to_hex(i % {domains} + 1), 12, '0'))::uuid, \
                ''::hstore, false, true, 'v3' \
         FROM generate_series(1, {TASKS}) i; COMMIT; ANALYZE core_task"
    );
    let (url, _db) = pulp_database(pg, redis, &format!("cost{n}"), &setup).await;
    let args = ServeArgs::with_urls(&url, &redis.url());
    let broker = dispatch_broker::server::start(&args).await.unwrap();
    let endpoint = format!("http://{}", broker.addr);
    let left = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(WARM + FETCHES));
    let mut handles = Vec::new();
    for w in 0..COST_WORKERS {
        let worker = Worker::connect(&endpoint, quiet(&format!("w{w}")))
            .await
            .unwrap();
        let left = std::sync::Arc::clone(&left);
        let stats = std::sync::Arc::clone(&broker.stats);
        handles.push(tokio::spawn(async move {
            let mut times = Vec::new();
            let mut warm = None;
            while left
                .fetch_update(
                    std::sync::atomic::Ordering::SeqCst,
                    std::sync::atomic::Ordering::SeqCst,
                    |n| n.checked_sub(1),
                )
                .is_ok()
            {
                if times.len() == WARM / COST_WORKERS {
                    warm = Some(stats.snapshot());
                }
                let start = Instant::now();
                let task = worker.next_task_started(Duration::ZERO).await.unwrap();
                times.push(start.elapsed());
                if let Some(task) = task {
                    task.finish(FinalState::Completed, None).await.unwrap();
                }
            }
            let measured = stats.snapshot() - warm.unwrap_or_default();
            worker.close().await.unwrap();
            (times, measured)
        }));
    }
    let mut times = Vec::new();
    let mut measured = dispatch_broker::metrics::StatsSnapshot::default();
    for handle in handles {
        let (mine, counted) = handle.await.unwrap();
        measured = counted;
        // Each worker's first fetches warm the connections and prepared statements.
        times.extend(mine.into_iter().skip(WARM / COST_WORKERS));
    }
    broker.shutdown().await.unwrap();
    times.sort();
    (times, measured)
}

#[tokio::main]
async fn main() {
    if std::env::args().nth(1).as_deref() == Some("cost") {
        let domains: i32 = std::env::args()
            .nth(2)
            .and_then(|a| a.parse().ok())
            .unwrap_or(10_000);
        let (pg, redis) =
            tokio::task::spawn_blocking(|| (Postgres::start().unwrap(), Redis::start().unwrap()))
                .await
                .unwrap();
        let (one, one_counted) = cost(&pg, &redis, 0, 1).await;
        let (many, many_counted) = cost(&pg, &redis, 1, domains).await;
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!("| domains waiting | FetchTask p50 | p99 | p50 vs one domain | Postgres statements / fetch (in passes) | Redis calls / fetch (in passes) | directed passes / fetch |");
        println!("|---:|---:|---:|---:|---:|---:|---:|");
        for (n, times, c) in [(1, &one, one_counted), (domains, &many, many_counted)] {
            let per = |x: u64| x as f64 / times.len() as f64;
            println!(
                "| {n} | {:.2} ms | {:.2} ms | {:.2} | {:.2} ({:.2}) | {:.2} ({:.2}) | {:.2} |",
                ms(percentile(times, 0.5)),
                ms(percentile(times, 0.99)),
                ms(percentile(times, 0.5)) / ms(percentile(&one, 0.5)),
                per(c.postgres_statements),
                per(c.fetch_postgres_statements),
                per(c.redis_calls),
                per(c.fetch_redis_calls),
                per(c.directed_passes),
            );
        }
        return;
    }
    let d1: i32 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(17_000);
    let (pg, redis) =
        tokio::task::spawn_blocking(|| (Postgres::start().unwrap(), Redis::start().unwrap()))
            .await
            .unwrap();
    let mut runs = Vec::new();
    for (n, setting) in SETTINGS.iter().enumerate() {
        eprintln!(
            "{}: {d1} + {D2_TASKS} + {D3_TASKS} tasks, {WORKERS} workers",
            setting.name
        );
        runs.push(run(&pg, &redis, n, setting, d1).await);
    }
    let fifo_rate = {
        let r = &runs[0];
        r.done.len() as f64 / r.elapsed.as_secs_f64()
    };
    println!(
        "| setting | D1 wait p50 / p99 | D1 done after | D2 wait p50 / p99 | D2 done after | D3 wait p50 / p99 | D3 done after | tasks/s | vs FIFO |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (setting, run) in SETTINGS.iter().zip(&runs) {
        let mut cells = Vec::new();
        for d in 0..DOMAINS.len() {
            let mut waits: Vec<Duration> = run
                .done
                .iter()
                .filter(|t| t.domain == d)
                .map(|t| Duration::from_secs_f64((t.started - t.created).max(0.0)))
                .collect();
            waits.sort();
            let first = run
                .done
                .iter()
                .filter(|t| t.domain == d)
                .map(|t| t.created)
                .fold(f64::MAX, f64::min);
            let last = run
                .done
                .iter()
                .filter(|t| t.domain == d)
                .map(|t| t.finished)
                .fold(f64::MIN, f64::max);
            cells.push(format!(
                "{} / {}",
                seconds(percentile(&waits, 0.5).as_secs_f64()),
                seconds(percentile(&waits, 0.99).as_secs_f64())
            ));
            cells.push(seconds(last - first));
        }
        let rate = run.done.len() as f64 / run.elapsed.as_secs_f64();
        println!(
            "| {} | {} | {:.0} | {:.2} |",
            setting.name,
            cells.join(" | "),
            rate,
            rate / fifo_rate
        );
    }
    let per_domain: BTreeMap<&str, i32> = [("D1", d1), ("D2", D2_TASKS), ("D3", D3_TASKS)].into();
    eprintln!("tasks per domain: {per_domain:?}");
    plot(
        &runs[0],
        &runs[1],
        Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/benches/results/fair.svg"
        )),
    );
}
