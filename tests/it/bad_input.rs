//! The bad-input sweep: every RPC tried with empty, malformed, oversized and hostile values
//! against a broker that holds live state (a running task, a claimed task whose resource names
//! are full of Redis and Lua syntax, a waiting task, an expired lease). Each call must get the
//! expected status with a message that says what to do, and Postgres and Redis must be exactly as
//! they were. `cargo test --test it bad_input -- --nocapture` prints the table.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::{id, Env};
use deadpool_redis::redis;
use dispatch_broker::proto::broker_client::BrokerClient;
use dispatch_broker::proto::*;
use tonic::transport::Channel;
use tonic::Code;
use uuid::Uuid;

/// Everything the broker keeps, as text: both tables' rows, and every Redis key of the broker
/// with its value, except the sweeper's turn lock and the lane gauge's cache (background work
/// owns those).
async fn world(env: &Env) -> (Vec<String>, BTreeMap<String, Vec<u8>>) {
    let mut rows: Vec<String> = Vec::new();
    for table in ["core_task", "core_appstatus"] {
        for row in env
            .db
            .query(
                &format!("SELECT row(t.*)::text FROM {table} t ORDER BY pulp_id"),
                &[],
            )
            .await
            .unwrap()
        {
            rows.push(row.get(0));
        }
    }
    let client = redis::Client::open(env.redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("{dispatch}:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut values = BTreeMap::new();
    for key in keys {
        if [
            "{dispatch}:sweeper",
            "{dispatch}:lanes",
            "{dispatch}:lanes:lock",
        ]
        .contains(&key.as_str())
        {
            continue;
        }
        let mut dump: Vec<u8> = redis::cmd("DUMP")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        // Whether it expires, too (DUMP leaves the TTL out; the time left moves on its own).
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        dump.push(u8::from(ttl >= 0));
        values.insert(key, dump);
    }
    (rows, values)
}

fn duration(seconds: i64, nanos: i32) -> Option<prost_types::Duration> {
    Some(prost_types::Duration { seconds, nanos })
}

fn open(name: &str) -> OpenLeaseRequest {
    OpenLeaseRequest {
        worker_name: name.into(),
        versions: [("core".to_string(), "3.123.1".to_string())].into(),
        ttl: None,
        app_status_id: String::new(),
        open_id: String::new(),
    }
}

/// One case: which RPC, what was sent, the status code expected and words its message must have.
struct Case {
    rpc: &'static str,
    input: String,
    code: Code,
    words: &'static str,
    outcome: Result<(), tonic::Status>,
}

#[tokio::test]
async fn every_rpc_refuses_bad_input_with_the_right_status_and_changes_nothing() {
    let mut env = Env::new().await;
    // Live state the bad calls must not touch.
    let running = env
        .task(&["prn:file.repository:R1", "shared:prn:core.domain:D"])
        .await;
    let hostile = env
        .task(&[
            "{dispatch}:x:*",
            "shared:\"; redis.call('FLUSHALL') --",
            "prn:a b\tc]]\\",
        ])
        .await;
    let waiting = env.task(&["prn:file.repository:R1"]).await;
    // Ready: a bad FetchTask or ClaimTask wrongly accepted would take it.
    let ready = env.task(&["prn:file.repository:R9"]).await;
    let lease = env.open("holder@host").await;
    let other = env.open("other@host").await;
    let t1 = env.fetch(&lease).await.expect("the oldest task");
    assert_eq!(id(&t1), running);
    env.start(&lease, &t1).await;
    let t2 = env
        .fetch(&other)
        .await
        .expect("the task with hostile names");
    assert_eq!(id(&t2), hostile);
    let locked = env.locked_tasks().await;
    assert!(locked.contains(&hostile.to_string()), "{locked:?}");
    // An expired lease: opened with the shortest TTL, never heartbeating, swept.
    let expired = env
        .open_with("expired@host", &[], Some(Duration::from_millis(200)))
        .await;
    let mut c: BrokerClient<Channel> = env.client.clone();
    // (A heartbeat would renew it: wait past its TTL first.)
    tokio::time::sleep(Duration::from_millis(450)).await;
    let gone = c
        .heartbeat(HeartbeatRequest {
            lease_id: expired.clone(),
            ..Default::default()
        })
        .await;
    assert_eq!(
        gone.unwrap_err().code(),
        Code::NotFound,
        "the short lease expired"
    );
    // The sweeper finishes with it: its core_appstatus row goes too.
    let swept = support::eventually(Duration::from_secs(15), || async {
        env.db
            .query(
                "SELECT 1 FROM core_appstatus WHERE name = 'expired@host'",
                &[],
            )
            .await
            .unwrap()
            .is_empty()
    })
    .await;
    assert!(swept.is_some(), "the expired lease was swept");
    let redis_client = redis::Client::open(env.redis.url()).unwrap();
    let conn = redis_client
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let cleared = support::eventually(Duration::from_secs(15), || {
        let mut conn = conn.clone();
        let (key, member) = (format!("{{dispatch}}:lease:{expired}"), expired.clone());
        async move {
            let exists: bool = redis::cmd("EXISTS")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap();
            let score: Option<f64> = redis::cmd("ZSCORE")
                .arg("{dispatch}:leases")
                .arg(&member)
                .query_async(&mut conn)
                .await
                .unwrap();
            !exists && score.is_none()
        }
    })
    .await;
    assert!(cleared.is_some(), "the expired lease left Redis");

    let before = world(&env).await;
    let unknown = Uuid::new_v4().to_string();
    let token = t1.fencing_token;
    let running_id = running.to_string();
    let many_skips: Vec<String> = (0..10_000).map(|_| Uuid::new_v4().to_string()).collect();
    let megabyte = "w".repeat(1 << 20);
    let mut cases: Vec<Case> = Vec::new();
    macro_rules! case {
        ($rpc:expr, $input:expr, $code:expr, $words:expr, $call:expr) => {
            cases.push(Case {
                rpc: $rpc,
                input: $input.to_string(),
                code: $code,
                words: $words,
                outcome: $call.await.map(|_| ()),
            });
        };
    }

    // OpenLease
    case!(
        "OpenLease",
        "worker_name empty",
        Code::InvalidArgument,
        "worker_name is required",
        c.open_lease(open(""))
    );
    case!(
        "OpenLease",
        "worker_name of spaces",
        Code::InvalidArgument,
        "worker_name is required",
        c.open_lease(open("   "))
    );
    case!(
        "OpenLease",
        "worker_name of 300 bytes",
        Code::InvalidArgument,
        "--max-name-bytes",
        c.open_lease(open(&"w".repeat(300)))
    );
    case!(
        "OpenLease",
        "worker_name of 1 MB (message over --max-message-bytes)",
        Code::ResourceExhausted,
        "--max-message-bytes",
        c.open_lease(open(&megabyte))
    );
    case!(
        "OpenLease",
        "worker_name with a newline",
        Code::InvalidArgument,
        "control characters",
        c.open_lease(open("a\nb"))
    );
    case!(
        "OpenLease",
        "1,000 versions components",
        Code::InvalidArgument,
        "--max-versions",
        c.open_lease(OpenLeaseRequest {
            versions: (0..1000)
                .map(|i| (format!("c{i}"), "1.0".to_string()))
                .collect(),
            ..open("w")
        })
    );
    case!(
        "OpenLease",
        "version \"latest\"",
        Code::InvalidArgument,
        "dotted release number",
        c.open_lease(OpenLeaseRequest {
            versions: [("core".to_string(), "latest".to_string())].into(),
            ..open("w")
        })
    );
    case!(
        "OpenLease",
        "ttl 0",
        Code::InvalidArgument,
        "outside the accepted range",
        c.open_lease(OpenLeaseRequest {
            ttl: duration(0, 0),
            ..open("w")
        })
    );
    case!(
        "OpenLease",
        "ttl 10 years",
        Code::InvalidArgument,
        "outside the accepted range",
        c.open_lease(OpenLeaseRequest {
            ttl: duration(315_360_000, 0),
            ..open("w")
        })
    );
    case!(
        "OpenLease",
        "ttl -1 s",
        Code::InvalidArgument,
        "ttl must be a positive duration",
        c.open_lease(OpenLeaseRequest {
            ttl: duration(-1, 0),
            ..open("w")
        })
    );
    case!(
        "OpenLease",
        "app_status_id \"x\"",
        Code::InvalidArgument,
        "is not a UUID",
        c.open_lease(OpenLeaseRequest {
            app_status_id: "x".into(),
            ..open("w")
        })
    );
    case!(
        "OpenLease",
        "open_id \"x\"",
        Code::InvalidArgument,
        "open_id \"x\" is not a UUID",
        c.open_lease(OpenLeaseRequest {
            open_id: "x".into(),
            ..open("w")
        })
    );
    case!(
        "OpenLease",
        "app_status_id of no row",
        Code::NotFound,
        "core_appstatus",
        c.open_lease(OpenLeaseRequest {
            app_status_id: unknown.clone(),
            ..open("w")
        })
    );

    // Heartbeat and CloseLease
    for (rpc, heartbeat) in [("Heartbeat", true), ("CloseLease", false)] {
        for (input, lease_id, code, words) in [
            (
                "lease_id empty",
                String::new(),
                Code::InvalidArgument,
                "lease_id is required",
            ),
            (
                "lease_id \"x\"",
                "x".to_string(),
                Code::InvalidArgument,
                "is not a UUID",
            ),
            (
                "lease_id of 1 MB",
                megabyte.clone(),
                Code::ResourceExhausted,
                "--max-message-bytes",
            ),
            (
                "unknown lease",
                unknown.clone(),
                Code::NotFound,
                "open a new lease",
            ),
            (
                "expired lease",
                expired.clone(),
                Code::NotFound,
                "open a new lease",
            ),
        ] {
            if heartbeat {
                case!(
                    rpc,
                    input,
                    code,
                    words,
                    c.heartbeat(HeartbeatRequest {
                        lease_id,
                        ..Default::default()
                    })
                );
            } else {
                case!(
                    rpc,
                    input,
                    code,
                    words,
                    c.close_lease(CloseLeaseRequest { lease_id })
                );
            }
        }
    }

    // Heartbeat's undelivered grants: checked before anything is done (the lease is not even
    // renewed), and t1, which `lease` holds, stays held.
    for (input, held, words) in [
        (
            "undelivered task_id \"x\"",
            HeldTask {
                task_id: "x".into(),
                fencing_token: token,
            },
            "undelivered.task_id",
        ),
        (
            "undelivered without a fencing_token",
            HeldTask {
                task_id: running_id.clone(),
                fencing_token: 0,
            },
            "has no fencing_token",
        ),
    ] {
        case!(
            "Heartbeat",
            input,
            Code::InvalidArgument,
            words,
            c.heartbeat(HeartbeatRequest {
                lease_id: lease.clone(),
                undelivered: vec![held],
            })
        );
    }
    case!(
        "Heartbeat",
        "10,000 undelivered",
        Code::InvalidArgument,
        "--max-skip-ids",
        c.heartbeat(HeartbeatRequest {
            lease_id: lease.clone(),
            undelivered: many_skips
                .iter()
                .map(|id| HeldTask {
                    task_id: id.clone(),
                    fencing_token: 1,
                })
                .collect(),
        })
    );

    // FetchTask
    let fetch = |lease_id: &str| FetchTaskRequest {
        lease_id: lease_id.into(),
        wait: None,
        skip_task_ids: vec![],
        start: false,
    };
    case!(
        "FetchTask",
        "lease_id empty",
        Code::InvalidArgument,
        "lease_id is required",
        c.fetch_task(fetch(""))
    );
    case!(
        "FetchTask",
        "10,000 skip_task_ids",
        Code::InvalidArgument,
        "--max-skip-ids",
        c.fetch_task(FetchTaskRequest {
            skip_task_ids: many_skips.clone(),
            ..fetch(&other)
        })
    );
    case!(
        "FetchTask",
        "skip_task_ids [\"x\"]",
        Code::InvalidArgument,
        "skip_task_ids",
        c.fetch_task(FetchTaskRequest {
            skip_task_ids: vec!["x".into()],
            ..fetch(&other)
        })
    );
    case!(
        "FetchTask",
        "wait -1 s",
        Code::InvalidArgument,
        "non-negative",
        c.fetch_task(FetchTaskRequest {
            wait: duration(-1, 0),
            ..fetch(&other)
        })
    );
    case!(
        "FetchTask",
        "wait 10 years, unknown lease",
        Code::NotFound,
        "open a new lease",
        c.fetch_task(FetchTaskRequest {
            wait: duration(315_360_000, 0),
            ..fetch(&unknown)
        })
    );
    case!(
        "FetchTask",
        "expired lease",
        Code::NotFound,
        "open a new lease",
        c.fetch_task(fetch(&expired))
    );

    // ClaimTask
    let claim = |lease_id: &str, task_id: &str| ClaimTaskRequest {
        lease_id: lease_id.into(),
        task_id: task_id.into(),
    };
    case!(
        "ClaimTask",
        "task_id empty",
        Code::InvalidArgument,
        "task_id is required",
        c.claim_task(claim(&other, ""))
    );
    case!(
        "ClaimTask",
        "task that does not exist",
        Code::NotFound,
        "task",
        c.claim_task(claim(&other, &unknown))
    );
    case!(
        "ClaimTask",
        "unknown lease",
        Code::NotFound,
        "open a new lease",
        c.claim_task(claim(&unknown, &ready.to_string()))
    );
    case!(
        "ClaimTask",
        "a waiting task that is not ready",
        Code::Ok,
        "(succeeded)",
        c.claim_task(claim(&other, &waiting.to_string()))
    );

    // StartTask, FinishTask, ReleaseLocks: only the holder, with its token.
    let start = |lease_id: &str, token: u64| StartTaskRequest {
        lease_id: lease_id.into(),
        task_id: running_id.clone(),
        fencing_token: token,
    };
    case!(
        "StartTask",
        "fencing_token 0",
        Code::InvalidArgument,
        "fencing_token is required",
        c.start_task(start(&lease, 0))
    );
    case!(
        "StartTask",
        "stale fencing_token",
        Code::FailedPrecondition,
        "stale",
        c.start_task(start(&lease, token - 1))
    );
    case!(
        "StartTask",
        "another lease with the holder's token",
        Code::FailedPrecondition,
        "does not hold",
        c.start_task(start(&other, token))
    );
    let finish = |lease_id: &str, token: u64, state: &str, error: String| FinishTaskRequest {
        lease_id: lease_id.into(),
        task_id: running_id.clone(),
        fencing_token: token,
        state: state.into(),
        error,
    };
    case!(
        "FinishTask",
        "state \"running\"",
        Code::InvalidArgument,
        "not a final state",
        c.finish_task(finish(&lease, token, "running", String::new()))
    );
    case!(
        "FinishTask",
        "error of 100 KB",
        Code::InvalidArgument,
        "--max-error-bytes",
        c.finish_task(finish(&lease, token, "failed", "e".repeat(100 * 1024)))
    );
    case!(
        "FinishTask",
        "error with a NUL character",
        Code::InvalidArgument,
        "NUL",
        c.finish_task(finish(&lease, token, "failed", "bad\0byte".into()))
    );
    case!(
        "FinishTask",
        "another lease with the holder's token",
        Code::FailedPrecondition,
        "does not hold",
        c.finish_task(finish(&other, token, "completed", String::new()))
    );
    case!(
        "FinishTask",
        "expired lease",
        Code::NotFound,
        "open a new lease",
        c.finish_task(finish(&expired, token, "completed", String::new()))
    );
    let release = |lease_id: &str, task_id: &str, token: u64| ReleaseLocksRequest {
        lease_id: lease_id.into(),
        task_id: task_id.into(),
        fencing_token: token,
    };
    case!(
        "ReleaseLocks",
        "fencing_token 0",
        Code::InvalidArgument,
        "fencing_token is required",
        c.release_locks(release(&lease, &running_id, 0))
    );
    case!(
        "ReleaseLocks",
        "stale fencing_token",
        Code::FailedPrecondition,
        "stale",
        c.release_locks(release(&lease, &running_id, token + 1))
    );
    case!(
        "ReleaseLocks",
        "another lease with the holder's token",
        Code::FailedPrecondition,
        "does not hold",
        c.release_locks(release(&other, &running_id, token))
    );
    case!(
        "ReleaseLocks",
        "expired lease",
        Code::NotFound,
        "open a new lease",
        c.release_locks(release(&expired, &running_id, token))
    );
    case!(
        "ReleaseLocks",
        "the holder, while its task is running",
        Code::FailedPrecondition,
        "record its final state first",
        c.release_locks(release(&lease, &running_id, token))
    );

    // CancelTask
    case!(
        "CancelTask",
        "task_id \"x\"",
        Code::InvalidArgument,
        "is not a UUID",
        c.cancel_task(CancelTaskRequest {
            task_id: "x".into()
        })
    );
    case!(
        "CancelTask",
        "task that does not exist",
        Code::NotFound,
        "task",
        c.cancel_task(CancelTaskRequest {
            task_id: unknown.clone()
        })
    );

    let after = world(&env).await;

    println!("| RPC | input | status | message |");
    println!("|---|---|---|---|");
    let mut wrong = Vec::new();
    for case in &cases {
        let (code, message) = match &case.outcome {
            Ok(()) => (Code::Ok, "(succeeded)".to_string()),
            Err(s) => (s.code(), s.message().to_string()),
        };
        println!(
            "| {} | {} | {:?} | {} |",
            case.rpc,
            case.input,
            code,
            message.replace('|', "\\|")
        );
        if code != case.code || !message.contains(case.words) {
            wrong.push(format!(
                "{} with {}: got {code:?} {message:?}, expected {:?} mentioning {:?}",
                case.rpc, case.input, case.code, case.words
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert_eq!(before.0, after.0, "Postgres changed");
    assert_eq!(
        before.1.keys().collect::<Vec<_>>(),
        after.1.keys().collect::<Vec<_>>(),
        "Redis keys changed"
    );
    assert!(before.1 == after.1, "a Redis value changed");

    // The holders still work: the hostile names lock and unlock like any others.
    assert!(env.release(&other, &t2).await.unwrap());
    env.finish(&lease, &t1, "completed").await;
    assert_eq!(env.fetch(&other).await.map(|t| id(&t)), Some(hostile));
    env.shutdown().await;
}
