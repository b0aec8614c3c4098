//! Authentication and TLS: a bearer token on worker calls (health and KEDA's scaler stay open), TLS
//! with certificates made in the test (rcgen), and mutual TLS. A rejected call changes nothing.

use crate::support;

use std::time::Duration;

use crate::support::Env;
use dispatch_worker::{Worker, WorkerConfig};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};
use tonic::Code;

const TOKEN: &str = "s3cret-token-for-the-test";

struct Pki {
    ca_pem: String,
    server: (String, String),
    /// A server certificate for "broker.example" only (reached at 127.0.0.1, the name must be
    /// given).
    named_server: (String, String),
    client: (String, String),
}

fn pki() -> Pki {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    Pki {
        ca_pem: ca.pem(),
        server: leaf(vec!["localhost".into()]),
        named_server: leaf(vec!["broker.example".into()]),
        client: leaf(vec!["worker-1".into()]),
    }
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn config(token: Option<&str>, tls: Option<ClientTlsConfig>) -> WorkerConfig {
    let mut config = WorkerConfig::new("w");
    config.token = token.map(str::to_owned);
    config.tls = tls;
    config.retry = dispatch_worker::RetryPolicy::none();
    config.call_timeout = Duration::from_secs(5);
    config
}

async fn app_status_rows(env: &Env) -> i64 {
    env.db
        .query_one("SELECT count(*) FROM core_appstatus", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn worker_calls_need_the_bearer_token_and_a_rejected_call_does_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = write(&dir, "token", &format!("{TOKEN}\n"));
    let env = Env::with(|a| a.security.auth_token_file = Some(token_file)).await;
    let endpoint = format!("http://{}", env.broker().addr);
    let task = env.task(&["a"]).await;

    for token in [None, Some("wrong")] {
        let err = Worker::connect(&endpoint, config(token, None))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(Code::Unauthenticated), "{err}");
        assert!(err.to_string().contains("bearer token"), "{err}");
    }
    assert_eq!(app_status_rows(&env).await, 0, "no lease row was made");

    let worker = Worker::connect(&endpoint, config(Some(TOKEN), None))
        .await
        .unwrap();
    let guard = worker.next_task(Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(guard.id(), task.to_string());
    guard.release().await.unwrap();
    worker.close().await.unwrap();

    // Health stays open (probes carry no token).
    let channel = tonic::transport::Endpoint::from_shared(endpoint)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await;
    assert!(health.is_ok(), "{health:?}");
}

#[tokio::test]
async fn tls_serves_clients_that_trust_the_ca_and_plaintext_gets_nothing() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (
        write(&dir, "server.pem", &pki.server.0),
        write(&dir, "server.key", &pki.server.1),
    );
    let env = Env::with(|a| {
        a.security.tls_cert = Some(cert);
        a.security.tls_key = Some(key);
    })
    .await;
    let port = env.broker().addr.port();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost");
    let worker = Worker::connect(format!("https://localhost:{port}"), config(None, Some(tls)))
        .await
        .expect("TLS with the right CA");
    worker.close().await.unwrap();

    let plain = Worker::connect(format!("http://127.0.0.1:{port}"), config(None, None))
        .await
        .unwrap_err();
    // The connection fails below gRPC (tonic reports a transport error).
    assert!(plain.to_string().contains("transport error"), "{plain}");
    assert_eq!(app_status_rows(&env).await, 0);
}

#[tokio::test]
async fn mutual_tls_needs_a_client_certificate_from_the_ca() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, ca) = (
        write(&dir, "server.pem", &pki.server.0),
        write(&dir, "server.key", &pki.server.1),
        write(&dir, "ca.pem", &pki.ca_pem),
    );
    let env = Env::with(|a| {
        a.security.tls_cert = Some(cert);
        a.security.tls_key = Some(key);
        a.security.tls_client_ca = Some(ca);
    })
    .await;
    let endpoint = format!("https://localhost:{}", env.broker().addr.port());
    let base = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost");

    let anonymous = Worker::connect(&endpoint, config(None, Some(base.clone())))
        .await
        .unwrap_err();
    assert!(
        anonymous.to_string().contains("transport error"),
        "{anonymous}"
    );
    assert_eq!(app_status_rows(&env).await, 0);

    let with_identity = base.identity(Identity::from_pem(&pki.client.0, &pki.client.1));
    let worker = Worker::connect(&endpoint, config(None, Some(with_identity)))
        .await
        .expect("mutual TLS with a certificate from the CA");
    assert!(worker.next_task(Duration::ZERO).await.unwrap().is_none());
    worker.close().await.unwrap();
}

#[tokio::test]
async fn an_empty_or_missing_token_file_stops_the_start_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let empty = write(&dir, "empty", "  \n");
    let db = tokio::task::spawn_blocking(support::fresh_database)
        .await
        .unwrap();
    let mut args = support::default_args(&db, "redis://127.0.0.1:1/");
    args.security.auth_token_file = Some(empty);
    let err = dispatch_broker::server::start(&args).await.err().unwrap();
    assert!(err.to_string().contains("is empty"), "{err}");
    args.security.auth_token_file =
        Some(write(&dir, "example", "CHANGE-ME-to-a-long-random-token"));
    let err = dispatch_broker::server::start(&args).await.err().unwrap();
    assert!(err.to_string().contains("example token"), "{err}");
    args.security.auth_token_file = Some(dir.path().join("missing"));
    let err = dispatch_broker::server::start(&args).await.err().unwrap();
    assert!(
        err.to_string().contains("cannot read --auth-token-file"),
        "{err}"
    );
}

#[tokio::test]
async fn the_token_can_come_from_dispatch_auth_token_instead_of_a_file() {
    // What `DISPATCH_AUTH_TOKEN=...` or `--auth-token` gives the parsed options.
    let env = Env::with(|a| a.security.auth_token = Some(format!(" {TOKEN} "))).await;
    let endpoint = format!("http://{}", env.broker().addr);
    let err = Worker::connect(&endpoint, config(Some("wrong"), None))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::Unauthenticated), "{err}");
    let worker = Worker::connect(&endpoint, config(Some(TOKEN), None))
        .await
        .unwrap();
    worker.close().await.unwrap();
    let db = tokio::task::spawn_blocking(support::fresh_database)
        .await
        .unwrap();
    let mut args = support::default_args(&db, "redis://127.0.0.1:1/");
    args.security.auth_token = Some("CHANGE-ME".into());
    let err = dispatch_broker::server::start(&args).await.err().unwrap();
    assert!(err.to_string().contains("DISPATCH_AUTH_TOKEN"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_binary_reads_dispatch_auth_token() {
    // The variable itself, as a deployment sets it: the real binary, no token on its command
    // line, the worker's token only in DISPATCH_AUTH_TOKEN (with the spaces a Secret may carry).
    let env = Env::new().await;
    let broker = support::BrokerProcess::start(
        &env.db_url,
        &env.redis.url(),
        &[],
        &[("DISPATCH_AUTH_TOKEN", &format!(" {TOKEN}\n"))],
    )
    .await;
    let endpoint = format!("http://{}", broker.addr);
    let wrong = Worker::connect(&endpoint, config(Some("wrong"), None)).await;
    let Err(err) = wrong else {
        panic!("a wrong token is accepted")
    };
    assert_eq!(err.code(), Some(Code::Unauthenticated), "{err}");
    let Err(anonymous) = Worker::connect(&endpoint, config(None, None)).await else {
        panic!("no token is accepted")
    };
    assert_eq!(anonymous.code(), Some(Code::Unauthenticated), "{anonymous}");
    let worker = Worker::connect(&endpoint, config(Some(TOKEN), None))
        .await
        .expect("the variable's token is accepted");
    worker.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_the_admin_commands_read_one_set_of_variables_and_the_old_names() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, ca) = (
        write(&dir, "server.pem", &pki.named_server.0),
        write(&dir, "server.key", &pki.named_server.1),
        write(&dir, "ca.pem", &pki.ca_pem),
    );
    let (client_cert, client_key) = (
        write(&dir, "client.pem", &pki.client.0),
        write(&dir, "client.key", &pki.client.1),
    );
    let env = Env::with(|a| {
        a.security.tls_cert = Some(cert);
        a.security.tls_key = Some(key);
        a.security.tls_client_ca = Some(ca.clone());
        a.security.admin_client_names = vec!["worker-1".into()];
    })
    .await;
    let addr = format!("https://127.0.0.1:{}", env.broker().addr.port());
    let run = |args: &[&str], vars: &[(&str, &std::ffi::OsStr)]| {
        tokio::task::block_in_place(|| {
            std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-broker"))
                .args(args)
                .envs(vars.iter().copied())
                .output()
                .unwrap()
        })
    };
    // The same settings under the current names and under health's old ones (still read).
    for names in [
        [
            "DISPATCH_ADDR",
            "DISPATCH_CLIENT_TLS_CA",
            "DISPATCH_CLIENT_TLS_DOMAIN",
            "DISPATCH_CLIENT_TLS_CERT",
            "DISPATCH_CLIENT_TLS_KEY",
        ],
        [
            "DISPATCH_HEALTH_ADDR",
            "DISPATCH_HEALTH_TLS_CA",
            "DISPATCH_HEALTH_TLS_DOMAIN",
            "DISPATCH_HEALTH_TLS_CERT",
            "DISPATCH_HEALTH_TLS_KEY",
        ],
    ] {
        let values = [
            addr.as_ref(),
            ca.as_os_str(),
            "broker.example".as_ref(),
            client_cert.as_os_str(),
            client_key.as_os_str(),
        ];
        let vars: Vec<(&str, &std::ffi::OsStr)> = names.into_iter().zip(values).collect();
        for command in [&["health"][..], &["leases", "--json"]] {
            let out = run(command, &vars);
            assert!(
                out.status.success(),
                "{command:?} with {names:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // Without the client certificate the broker refuses the connection.
        let out = run(&["health", "--timeout", "2s"], &vars[..3]);
        assert!(!out.status.success(), "{names:?}");
    }
    // Where both are set, the current name wins.
    let nowhere = format!(
        "https://127.0.0.1:{}",
        dispatch_testkit::free_port().unwrap()
    );
    let out = run(
        &["health", "--timeout", "2s"],
        &[
            ("DISPATCH_ADDR", nowhere.as_ref()),
            ("DISPATCH_HEALTH_ADDR", addr.as_ref()),
            ("DISPATCH_CLIENT_TLS_CA", ca.as_os_str()),
            ("DISPATCH_CLIENT_TLS_DOMAIN", "broker.example".as_ref()),
            ("DISPATCH_CLIENT_TLS_CERT", client_cert.as_os_str()),
            ("DISPATCH_CLIENT_TLS_KEY", client_key.as_os_str()),
        ],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(&nowhere));
    env.shutdown().await;
}
