//! Transient outages and shutdown: with Redis or Postgres down, calls fail UNAVAILABLE naming the
//! backend, quickly, and the broker recovers on its own when the backend returns; on SIGTERM the
//! server exits 0 and leaves leases alone.

use crate::support;

use std::time::Duration;

use crate::support::{eventually, id, own_postgres, Env};
use dispatch_broker::proto::broker_client::BrokerClient;
use dispatch_broker::proto::*;
use tonic::Code;

fn with_deadline<T>(message: T, deadline: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline);
    request
}

/// A broker on a Postgres of the test's own (so that it can kill it), with calls to the
/// backends timing out after 500 ms.
async fn on_own_postgres() -> (dispatch_testkit::Postgres, Env) {
    let (pg, url) = tokio::task::spawn_blocking(own_postgres).await.unwrap();
    let redis = tokio::task::spawn_blocking(|| dispatch_testkit::Redis::start().unwrap())
        .await
        .unwrap();
    let env = Env::on(url, redis, |a| {
        a.backend_timeout = Duration::from_millis(500)
    })
    .await;
    (pg, env)
}

/// Restarts the test's own Postgres and connects the test's client to it again.
async fn restart_postgres(pg: &mut dispatch_testkit::Postgres, env: &mut Env) {
    tokio::task::block_in_place(|| pg.restart().unwrap());
    let (db, conn) = tokio_postgres::connect(&env.db_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    env.db = db;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_answers_unavailable_naming_postgres_and_the_broker_recovers() {
    let (mut pg, mut env) = on_own_postgres().await;
    let task = env.task(&["a"]).await;
    let lease = env.open("w").await;
    tokio::task::block_in_place(|| pg.kill());
    let mut client = env.client.clone();
    let status = client
        .fetch_task(with_deadline(
            support::fetch_request(lease.clone()),
            Duration::from_secs(5),
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("postgres"), "{status:?}");
    restart_postgres(&mut pg, &mut env).await;
    let env_ref = &mut env;
    let lease_ref = &lease;
    let mut got = None;
    for _ in 0..100 {
        if let Ok(Some(t)) = env_ref.try_fetch(lease_ref, &[]).await {
            got = Some(t);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(id(&got.expect("the broker recovered")), task);
    env.shutdown().await;
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_answers_unavailable_naming_redis_without_hanging() {
    let mut env = Env::with(|a| {
        a.backend_timeout = Duration::from_millis(500);
        a.sweep_interval = Duration::from_millis(200);
    })
    .await;
    env.task(&["a"]).await;
    let lease = env.open("w").await;
    env.redis.kill();
    let mut client = env.client.clone();
    for call in 0..2 {
        let status = client
            .fetch_task(with_deadline(
                support::fetch_request(lease.clone()),
                Duration::from_secs(5),
            ))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "call {call}: {status:?}");
        assert!(
            status.message().contains("redis"),
            "call {call}: {status:?}"
        );
    }
    let status = client
        .heartbeat(with_deadline(
            HeartbeatRequest {
                lease_id: lease.clone(),
                ..Default::default()
            },
            Duration::from_secs(5),
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    // Readiness (gRPC health, service "") turns NOT_SERVING; liveness (the Broker service) not.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", env.broker().addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status_of = |service: &'static str| {
        let mut health = health.clone();
        async move {
            health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap()
                .into_inner()
                .status
        }
    };
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    eventually(Duration::from_secs(5), || async {
        status_of("").await == not_serving
    })
    .await
    .expect("readiness follows the backends");
    assert_eq!(status_of("dispatch.v1.Broker").await, serving);
    // Redis comes back empty: the state is rebuilt and new leases work.
    env.redis.restart().unwrap();
    let env_ref = &mut env;
    let mut reopened = None;
    for _ in 0..100 {
        let mut c = env_ref.client.clone();
        if let Ok(l) = c.open_lease(support::lease_request("w2")).await {
            reopened = Some(l.into_inner().lease_id);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let lease = reopened.expect("the broker recovered");
    assert!(env.fetch(&lease).await.is_some());
    eventually(Duration::from_secs(5), || async {
        status_of("").await == serving
    })
    .await
    .expect("ready again once redis is back");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_server_with_status_0_and_leaves_leases_alone() {
    let env = Env::new().await;
    let port = dispatch_testkit::free_port().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-broker"))
        .args([
            "serve",
            "--postgres-url",
            &env.db_url,
            "--redis-url",
            &env.redis.url(),
        ])
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut client = None;
    for _ in 0..200 {
        if let Ok(c) = BrokerClient::connect(endpoint.clone()).await {
            client = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mut client = client.expect("the binary serves");
    let lease = client
        .open_lease(support::lease_request("w"))
        .await
        .unwrap()
        .into_inner()
        .lease_id;
    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = tokio::task::block_in_place(|| child.wait()).unwrap();
    assert_eq!(status.code(), Some(0), "exit status after SIGTERM");
    // The lease outlives the broker process: the in-process broker still knows it.
    let mut other = env.client.clone();
    other
        .heartbeat(HeartbeatRequest {
            lease_id: lease,
            ..Default::default()
        })
        .await
        .expect("the lease is still alive");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_while_postgres_is_down_keeps_the_lease_and_its_row_is_written_once_it_is_back()
{
    let (mut pg, mut env) = on_own_postgres().await;
    let lease = env.open("w").await;
    env.db
        .execute(
            "UPDATE core_appstatus SET last_heartbeat = '2000-01-01'",
            &[],
        )
        .await
        .unwrap();
    tokio::task::block_in_place(|| pg.kill());
    // The lease lives in Redis: the beat is answered; its row waits for Postgres.
    env.client
        .heartbeat(HeartbeatRequest {
            lease_id: lease.clone(),
            ..Default::default()
        })
        .await
        .expect("a heartbeat needs Redis only");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    restart_postgres(&mut pg, &mut env).await;
    let db = &env.db;
    let written = eventually(Duration::from_secs(10), || async move {
        db.query_one(
            "SELECT last_heartbeat > '2001-01-01' FROM core_appstatus",
            &[],
        )
        .await
        .is_ok_and(|r| r.get::<_, bool>(0))
    })
    .await;
    assert!(
        written.is_some(),
        "the row of a beat made while Postgres was down is written once it is back"
    );
    env.shutdown().await;
    drop(pg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_row_of_a_lease_that_expired_while_postgres_was_down_is_not_written() {
    let (mut pg, mut env) = on_own_postgres().await;
    // The worker brings its own row, as a Pulp worker does: ending its lease leaves the row.
    let row = env.app_status("worker", "w").await;
    let lease = env
        .client
        .open_lease(OpenLeaseRequest {
            worker_name: "w".into(),
            versions: [("core".into(), "3.123.1".into())].into(),
            ttl: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            app_status_id: row.to_string(),
            open_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .lease_id;
    env.db
        .execute(
            "UPDATE core_appstatus SET last_heartbeat = '2000-01-01'",
            &[],
        )
        .await
        .unwrap();
    tokio::task::block_in_place(|| pg.kill());
    env.client
        .heartbeat(HeartbeatRequest {
            lease_id: lease,
            ..Default::default()
        })
        .await
        .expect("a heartbeat needs Redis only");
    // The worker beats no more: its lease expires while Postgres is down.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    restart_postgres(&mut pg, &mut env).await;
    // Long enough for a write retried every second to have happened.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stamp: String = env
        .db
        .query_one(
            "SELECT last_heartbeat::text FROM core_appstatus WHERE pulp_id = $1",
            &[&row],
        )
        .await
        .expect("the worker's own row stays")
        .get(0);
    assert!(
        stamp.starts_with("2000"),
        "a gone worker's row is not made to look alive: {stamp}"
    );
    env.shutdown().await;
    drop(pg);
}
