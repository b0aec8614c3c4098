//! The head-of-line incident (seed hol-blocking.txt): thousands of tasks on one repository at
//! the head of the queue, its oldest task running, and other domains' tasks behind them. Every
//! fetch must hand out another domain's task, and a fetch's cost in Postgres statements and Redis
//! calls must not grow with the number of blocked tasks.

#[path = "support/harness.rs"]
mod support;

use dispatch_broker::metrics::StatsSnapshot;
use support::{id, Env};

const REPO: &str = "prn:python.repository:R0";
const DOMAIN1: &str = "shared:prn:core.domain:D1";
const OTHERS: usize = 50;
const LEASES: usize = 10;

/// Runs the incident with `blocked` waiting tasks behind the running one; returns the cost of
/// every fetch.
async fn incident(blocked: usize) -> Vec<StatsSnapshot> {
    let mut env = Env::new().await;
    let head = env.task(&[REPO, DOMAIN1]).await;
    let busy = env.open("busy").await;
    let running = env.fetch(&busy).await.expect("the head task");
    assert_eq!(id(&running), head);
    env.start(&busy, &running).await;
    env.tasks_bulk(blocked, &[REPO, DOMAIN1]).await;
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
    let mut costs = Vec::new();
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
        let pg: Vec<u64> = costs.iter().map(|c| c.postgres_statements).collect();
        let redis: Vec<u64> = costs.iter().map(|c| c.redis_calls).collect();
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
    assert_eq!(
        pgs, pgl,
        "postgres statements per fetch changed with the blocked queue"
    );
    assert_eq!(
        rs, rl,
        "redis calls per fetch changed with the blocked queue"
    );
    // The candidate page, the claim, and the scan hint's look-up of what hides older tasks.
    assert!(
        pg_small <= 3 && pg_large <= 3,
        "a fetch took more than 3 statements"
    );
    // Lease check, acquire, and the check that the lease still holds the claimed task.
    assert!(
        redis_small <= 3 && redis_large <= 3,
        "a fetch took more than 3 redis calls"
    );
}
