//! Property: on random small queues with some tasks already running, every task FetchTask hands
//! out is ready by the pure rule (`ready`), and it is the oldest ready one. The queue lives in
//! real Postgres, the locks in real Redis; the expectation is computed from what they hold.
//! The broker's background work is part of the input: when its resource queues catch up (at a
//! chosen step, and racing every step), and whether background walks renew the scan hint before
//! every pass. `PROPTEST_CASES=N` runs more cases than the default 32.

use std::sync::Arc;
use std::time::Duration;

use crate::support::{id, Env};
use dispatch_broker::ready::Resources;
use proptest::prelude::*;
use uuid::Uuid;

/// One task of the generated queue: its record, and what happens to it before the check.
#[derive(Debug, Clone)]
struct Spec {
    record: Vec<String>,
}

fn arb_queue() -> impl Strategy<Value = (Vec<Spec>, Vec<u8>, i64)> {
    let entry = (0..6u8, prop::bool::weighted(0.4))
        .prop_map(|(r, shared)| format!("{}r{r}", if shared { "shared:" } else { "" }));
    let spec = prop::collection::vec(entry, 0..4).prop_map(|record| Spec { record });
    // The history (what the "runner" lease and others do first), and the candidate page size
    // (small pages exercise the keyset paging and the exclusions carried between pages).
    (
        prop::collection::vec(spec, 1..30),
        prop::collection::vec(any::<u8>(), 0..10),
        1i64..6,
    )
}

/// The rule, from Postgres and Redis state: the oldest waiting, unclaimed task that no older
/// incomplete task and no held lock conflicts with.
async fn expected(env: &Env) -> Option<Uuid> {
    let rows = env
        .db
        .query(
            "SELECT pulp_id, state, app_lock_id, coalesce(reserved_resources_record, '{}') \
             FROM core_task ORDER BY pulp_created, pulp_id",
            &[],
        )
        .await
        .unwrap();
    let held = env.locked_tasks().await;
    let tasks: Vec<(Uuid, String, Option<Uuid>, Resources)> = rows
        .iter()
        .map(|r| {
            let record: Vec<String> = r.get(3);
            (
                r.get(0),
                r.get(1),
                r.get(2),
                Resources::from_record(&record),
            )
        })
        .collect();
    let incomplete = |s: &str| matches!(s, "waiting" | "running" | "canceling");
    let held_resources: Vec<&Resources> = tasks
        .iter()
        .filter(|t| held.contains(&t.0.to_string()))
        .map(|t| &t.3)
        .collect();
    tasks.iter().enumerate().find_map(|(i, t)| {
        let ready = t.1 == "waiting"
            && t.2.is_none()
            && !tasks[..i]
                .iter()
                .any(|u| incomplete(&u.1) && u.3.conflicts_with(&t.3))
            && !held_resources.iter().any(|h| h.conflicts_with(&t.3));
        ready.then_some(t.0)
    })
}

/// How the broker's background work meets the test's steps.
#[derive(Debug, Clone, Copy)]
struct Timing {
    /// The resource queues catch up just before this step (the inserts, then the history).
    settle_at: Option<usize>,
    /// Catch-ups also run all along, racing the inserts and the passes (a catch-up that reads
    /// while a task commits must not claim to know it without holding it).
    racing_catch_ups: bool,
    /// Every pass finds its scan hint old, so background walks race the passes.
    old_hints: bool,
}

fn arb_timing() -> impl Strategy<Value = Timing> {
    (prop::option::of(0..40usize), any::<bool>(), any::<bool>()).prop_map(
        |(settle_at, racing_catch_ups, old_hints)| Timing {
            settle_at,
            racing_catch_ups,
            old_hints,
        },
    )
}

/// Every task as Postgres and Redis hold it, for a failure's message.
async fn describe(env: &Env, ids: &[Uuid]) -> String {
    let locked = env.locked_tasks().await;
    let rows = env
        .db
        .query(
            "SELECT pulp_id, state, app_lock_id IS NOT NULL FROM core_task \
             ORDER BY pulp_created, pulp_id",
            &[],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|r| {
            let task: Uuid = r.get(0);
            let state: String = r.get(1);
            let claimed: bool = r.get(2);
            let n = ids.iter().position(|i| *i == task);
            let lock = if locked.contains(&task.to_string()) {
                " locked"
            } else {
                ""
            };
            format!(
                "task {n:?} {state}{}{lock}",
                if claimed { " claimed" } else { "" }
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

async fn check(queue: Vec<Spec>, history: Vec<u8>, page: i64, timing: Timing) {
    let mut env = Env::with(|args| {
        args.fetch.page = page;
        if timing.old_hints {
            args.fetch.hint_max_age = Duration::from_millis(1);
        }
    })
    .await;
    let racing = timing.racing_catch_ups.then(|| {
        let queues = Arc::clone(&env.broker().resource_queues);
        tokio::spawn(async move {
            loop {
                let _ = queues.settle().await;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    });
    let mut ids = Vec::new();
    for (n, spec) in queue.iter().enumerate() {
        if timing.settle_at == Some(n) {
            env.settle_queues().await;
        }
        let record: Vec<&str> = spec.record.iter().map(String::as_str).collect();
        ids.push(env.task(&record).await);
    }
    // Some tasks run already: a runner takes some and starts them, finishes some of those,
    // a second lease claims some without starting, and some tasks are canceled.
    let runner = env.open("runner").await;
    let claimer = env.open("claimer").await;
    let mut running = Vec::new();
    for (n, step) in history.iter().enumerate() {
        if timing.settle_at == Some(queue.len() + n) {
            env.settle_queues().await;
        }
        match step % 5 {
            0 if !running.is_empty() => {
                let t = running.remove(usize::from(*step) % running.len());
                env.finish(&runner, &t, "completed").await;
            }
            1 => {
                env.cancel(ids[usize::from(*step) % ids.len()])
                    .await
                    .unwrap();
            }
            2 => {
                env.fetch(&claimer).await;
            }
            _ => {
                if let Some(t) = env.fetch(&runner).await {
                    env.start(&runner, &t).await;
                    running.push(t);
                }
            }
        }
    }
    if timing.settle_at == Some(queue.len() + history.len()) {
        env.settle_queues().await;
    }
    // Now a fresh worker fetches until nothing is ready; each grant must be the rule's choice.
    let worker = env.open("worker").await;
    loop {
        let want = expected(&env).await;
        let got = env.fetch(&worker).await.map(|t| id(&t));
        if got != want {
            let state = describe(&env, &ids).await;
            panic!(
                "the worker got {got:?} where the rule hands out {want:?} (task {:?}); \
                 queue {queue:?}, history {history:?}, page {page}, {timing:?}; now: {state}",
                want.and_then(|w| ids.iter().position(|i| *i == w)),
            );
        }
        if got.is_none() {
            break;
        }
    }
    if let Some(racing) = racing {
        racing.abort();
    }
    env.shutdown().await;
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(32),
        .. ProptestConfig::default()
    })]

    #[test]
    fn every_fetched_task_is_the_oldest_ready_one(
        (queue, history, page) in arb_queue(),
        timing in arb_timing(),
    ) {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(check(queue, history, page, timing));
    }
}
