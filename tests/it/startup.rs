//! Start-up: the broker refuses to start, with one clear line, when a backend is unreachable or
//! the schema lacks something; `migrate` is idempotent; health and reflection are served.

use crate::support::{default_args, fresh_database, shared_pg, Env};
use dispatch_broker::server;
use dispatch_testkit::{free_port, Redis};

async fn start_error(postgres: &str, redis: &str) -> String {
    match server::start(&default_args(postgres, redis)).await {
        Ok(_) => panic!("the broker started"),
        Err(e) => format!("{e:#}"),
    }
}

#[tokio::test]
async fn refuses_to_start_when_a_backend_is_unreachable_or_the_schema_is_missing() {
    let redis = tokio::task::spawn_blocking(|| Redis::start().unwrap())
        .await
        .unwrap();
    let db = tokio::task::spawn_blocking(fresh_database).await.unwrap();
    let nowhere = free_port().unwrap();

    let e = start_error(
        &format!("postgres://postgres@127.0.0.1:{nowhere}/x"),
        &redis.url(),
    )
    .await;
    assert!(e.contains("cannot reach PostgreSQL"), "{e}");

    let e = start_error(&db, &format!("redis://127.0.0.1:{nowhere}/")).await;
    assert!(e.contains("cannot reach Redis"), "{e}");

    let empty = tokio::task::spawn_blocking(|| {
        let name = format!("empty{}", std::process::id());
        shared_pg().create_database(&name).unwrap()
    })
    .await
    .unwrap();
    let e = start_error(&empty, &redis.url()).await;
    assert!(
        e.contains("schema is missing") && e.contains("core_task.reserved_resources_record"),
        "{e}"
    );
}

#[tokio::test]
async fn the_binary_exits_with_one_line_on_bad_configuration() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-broker"))
        .args([
            "serve",
            "--postgres-url",
            "postgres://127.0.0.1:1/x",
            "--redis-url",
            "redis://127.0.0.1:1/",
        ])
        .args(["--redis-key-prefix", "{oops}"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--redis-key-prefix"), "{stderr}");
}

#[tokio::test]
async fn migrate_creates_the_schema_once_and_then_changes_nothing() {
    let url = tokio::task::spawn_blocking(|| {
        let name = format!("migrate{}", std::process::id());
        shared_pg().create_database(&name).unwrap()
    })
    .await
    .unwrap();
    let bin = env!("CARGO_BIN_EXE_dispatch-broker");
    let first = std::process::Command::new(bin)
        .args(["migrate", "--postgres-url", &url])
        .output()
        .unwrap();
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(String::from_utf8_lossy(&first.stdout).contains("created"));
    let second = std::process::Command::new(bin)
        .args(["migrate", "--postgres-url", &url])
        .output()
        .unwrap();
    assert!(second.status.success());
    let said = String::from_utf8_lossy(&second.stdout);
    assert!(
        said.contains("changed nothing") && said.contains("has everything"),
        "{said}"
    );
}

#[tokio::test]
async fn health_and_reflection_are_served_on_the_grpc_port() {
    let env = Env::new().await;
    let endpoint = format!("http://{}", env.broker().addr);
    let channel = tonic::transport::Endpoint::from_shared(endpoint)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    for service in ["", "dispatch.v1.Broker"] {
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    }
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = reflection
        .server_reflection_info(tokio_stream::iter(vec![request]))
        .await
        .unwrap()
        .into_inner();
    let reply = stream.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("unexpected reflection reply");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"dispatch.v1.Broker".to_string()),
        "{names:?}"
    );
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_subcommand_reports_a_serving_broker_and_fails_otherwise() {
    let env = Env::new().await;
    let bin = env!("CARGO_BIN_EXE_dispatch-broker");
    let addr = format!("http://{}", env.broker().addr);
    let ok = tokio::task::block_in_place(|| {
        std::process::Command::new(bin)
            .args(["health", "--addr", &addr])
            .output()
            .unwrap()
    });
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&ok.stdout).trim(), "serving");
    let nowhere = format!("http://127.0.0.1:{}", free_port().unwrap());
    let down = tokio::task::block_in_place(|| {
        std::process::Command::new(bin)
            .args(["health", "--addr", &nowhere, "--timeout", "2s"])
            .output()
            .unwrap()
    });
    assert!(!down.status.success());
    assert!(String::from_utf8_lossy(&down.stderr).contains(&nowhere));
    env.shutdown().await;
}

/// `dispatch-broker serve` with both backends unreachable, so only configuration can pass or fail.
fn serve_offline(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-broker"))
        .args([
            "serve",
            "--postgres-url",
            "postgres://127.0.0.1:1/x",
            "--redis-url",
            "redis://127.0.0.1:1/",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

#[tokio::test]
async fn an_exposed_broker_without_authentication_refuses_to_start_unless_told() {
    // On 0.0.0.0 with no credential: one line naming what to pass, before any backend is tried.
    for (args, env) in [
        (vec!["--listen", "0.0.0.0:0"], vec![]),
        (vec![], vec![("DISPATCH_LISTEN", "0.0.0.0:0")]),
    ] {
        let out = serve_offline(&args, &env);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        for named in ["--allow-unauthenticated", "--auth-token-file", "0.0.0.0:0"] {
            assert!(stderr.contains(named), "{stderr}");
        }
    }
    // With the flag, its variable or a token, start-up goes on (to the unreachable Postgres).
    for (args, env) in [
        (
            vec!["--listen", "0.0.0.0:0", "--allow-unauthenticated"],
            vec![],
        ),
        (
            vec!["--listen", "0.0.0.0:0"],
            vec![("DISPATCH_ALLOW_UNAUTHENTICATED", "true")],
        ),
        (
            vec!["--listen", "0.0.0.0:0"],
            vec![("DISPATCH_AUTH_TOKEN", "s3cret-token-for-the-test")],
        ),
    ] {
        let out = serve_offline(&args, &env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("cannot reach PostgreSQL"),
            "{args:?} {env:?}: {stderr}"
        );
    }
    // A loopback address needs neither (the default, the demo, the sandbox).
    let out = serve_offline(&["--listen", "127.0.0.1:0"], &[]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach PostgreSQL"));

    // And such a broker really serves on every interface: with the flag, and with a token.
    let open = Env::with(|a| {
        a.listen = "0.0.0.0:0".parse().unwrap();
        a.security.allow_unauthenticated = true;
    })
    .await;
    let port = open.broker().addr.port();
    assert!(open.broker().addr.ip().is_unspecified());
    let mut client = dispatch_broker::proto::broker_client::BrokerClient::connect(format!(
        "http://127.0.0.1:{port}"
    ))
    .await
    .unwrap();
    let lease = client
        .open_lease(dispatch_broker::proto::OpenLeaseRequest {
            worker_name: "w".into(),
            ..Default::default()
        })
        .await;
    assert!(lease.is_ok(), "{lease:?}");
    open.shutdown().await;
    let guarded = Env::with(|a| {
        a.listen = "0.0.0.0:0".parse().unwrap();
        a.security.auth_token = Some("s3cret-token-for-the-test".into());
    })
    .await;
    assert!(guarded.broker().addr.ip().is_unspecified());
    guarded.shutdown().await;
}

/// What the log says about the lock state at start, as an operator reads it: a first start on an
/// empty Redis is not a warning (nothing was claimed, so nothing was lost); a start after Redis
/// lost the locks of a claimed task rebuilds them and warns, naming what it restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_start_on_an_empty_redis_is_no_warning_and_a_rebuild_after_a_loss_is_one() {
    use crate::support::{eventually, BrokerProcess};
    use deadpool_redis::redis;
    let db_url = fresh_database();
    let redis_server = tokio::task::spawn_blocking(Redis::start)
        .await
        .unwrap()
        .expect("start redis");
    let lock_state_line = |log: &str| {
        log.lines()
            .find(|l| l.contains("lock state"))
            .map(str::to_owned)
    };
    let first = BrokerProcess::start(&db_url, &redis_server.url(), &[], &[]).await;
    let line = eventually(std::time::Duration::from_secs(30), || async {
        lock_state_line(&first.log()).is_some()
    })
    .await;
    assert!(line.is_some(), "no lock state line:\n{}", first.log());
    let log = first.log();
    let line = lock_state_line(&log).unwrap();
    assert!(
        line.contains("INFO") && line.contains("started in an empty redis"),
        "{log}"
    );
    assert!(!log.contains("WARN"), "a first start warned:\n{log}");

    // A claimed, locked task; then the broker stops and Redis loses everything.
    let (db, conn) = tokio_postgres::connect(&db_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    db.execute(
        "INSERT INTO core_task (pulp_id, name, state, reserved_resources_record) \
         VALUES (gen_random_uuid(), 'test.task', 'waiting', '{R}')",
        &[],
    )
    .await
    .unwrap();
    let mut client = first.client().await;
    let lease = crate::support::open_on(&mut client, "w").await;
    let task = crate::support::fetch_on(&mut client, &lease)
        .await
        .expect("the task");
    drop(first);
    let client = redis::Client::open(redis_server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();

    let second = BrokerProcess::start(&db_url, &redis_server.url(), &[], &[]).await;
    let line = eventually(std::time::Duration::from_secs(30), || async {
        lock_state_line(&second.log()).is_some()
    })
    .await;
    assert!(line.is_some(), "no lock state line:\n{}", second.log());
    let log = second.log();
    let line = lock_state_line(&log).unwrap();
    assert!(
        line.contains("WARN") && line.contains("rebuilt from postgres") && line.contains("locks=1"),
        "{log}"
    );
    // The restored lock is the task's.
    let locked: bool = redis::cmd("EXISTS")
        .arg(format!("{{dispatch}}:task:{}", task.task_id))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(locked, "the claimed task's lock was not restored");
}
