//! deploy/: every manifest parses, and names, ports and labels agree with each other, with the
//! Dockerfile and with the binary's own defaults and environment variables.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use clap::CommandFactory;
use dispatch_broker::config::{Cli, Command};
use serde_norway::Value;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes");

fn load(name: &str) -> Value {
    let text = std::fs::read_to_string(Path::new(DIR).join(name)).unwrap();
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{name} does not parse: {e}"))
}

fn s<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, key| &v[*key])
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    v.as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    (
                        k.as_str().unwrap().to_owned(),
                        v.as_str().unwrap().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn subset(small: &BTreeMap<String, String>, big: &BTreeMap<String, String>) -> bool {
    !small.is_empty() && small.iter().all(|(k, v)| big.get(k) == Some(v))
}

/// Every `DISPATCH_*` variable `serve` reads.
fn serve_env_vars() -> BTreeSet<String> {
    let cli = Cli::command();
    let serve = cli.find_subcommand("serve").unwrap();
    serve
        .get_arguments()
        .chain(cli.get_arguments())
        .filter_map(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
        .collect()
}

fn default_ports() -> (u16, u16) {
    let cli = <Cli as clap::Parser>::parse_from([
        "dispatch-broker",
        "serve",
        "--postgres-url",
        "x",
        "--redis-url",
        "y",
    ]);
    match cli.command {
        Command::Serve(args) => (args.listen.port(), args.metrics_listen.port()),
        _ => unreachable!(),
    }
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn kustomization_lists_every_manifest() {
    let k = load("kustomization.yaml");
    let listed: BTreeSet<String> = k["resources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect();
    let present: BTreeSet<String> = std::fs::read_dir(DIR)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    assert_eq!(listed, present);
}

#[test]
fn names_ports_and_labels_agree() {
    let deployment = load("deployment.yaml");
    let service = load("service.yaml");
    let configmap = load("configmap.yaml");
    let secret = load("secret.yaml");
    let podmonitor = load("podmonitor.yaml");
    let scaled = load("worker-scaledobject.yaml");
    let namespace = load("kustomization.yaml")["namespace"]
        .as_str()
        .unwrap()
        .to_owned();

    assert_eq!(deployment["spec"]["replicas"].as_u64(), Some(2));
    let pod_labels = labels(s(&deployment, &["spec", "template", "metadata", "labels"]));
    assert!(subset(
        &labels(s(&deployment, &["spec", "selector", "matchLabels"])),
        &pod_labels
    ));
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let ports: BTreeMap<String, u64> = container["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_owned(),
                p["containerPort"].as_u64().unwrap(),
            )
        })
        .collect();
    let (grpc_default, metrics_default) = default_ports();
    assert_eq!(
        ports["grpc"],
        u64::from(grpc_default),
        "gRPC port = the binary's default"
    );
    assert_eq!(
        ports["metrics"],
        u64::from(metrics_default),
        "metrics port = the binary's default"
    );
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(
            container[probe]["grpc"]["port"].as_u64(),
            Some(ports["grpc"]),
            "{probe}"
        );
    }
    assert!(container["resources"]["requests"].is_mapping());
    let env_from: BTreeSet<String> = container["envFrom"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|e| {
            e["configMapRef"]["name"]
                .as_str()
                .or(e["secretRef"]["name"].as_str())
                .map(str::to_owned)
        })
        .collect();
    assert!(env_from.contains(configmap["metadata"]["name"].as_str().unwrap()));
    assert!(env_from.contains(secret["metadata"]["name"].as_str().unwrap()));

    // Every variable set is one the binary reads, and the listen ports match the container.
    let known = serve_env_vars();
    let data = configmap["data"].as_mapping().unwrap();
    for key in data
        .keys()
        .chain(secret["stringData"].as_mapping().unwrap().keys())
    {
        let key = key.as_str().unwrap();
        assert!(
            known.contains(key),
            "{key} is not an option of `dispatch-broker serve`"
        );
    }
    // Each token file the ConfigMap names is a key of the auth Secret, mounted where it says.
    let auth = load("auth-secret.yaml");
    let pod = s(&deployment, &["spec", "template", "spec"]);
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["secret"]["secretName"] == auth["metadata"]["name"])
        .expect("a volume of the auth Secret");
    let mount = pod["containers"][0]["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("the auth volume is mounted");
    for option in ["DISPATCH_AUTH_TOKEN_FILE", "DISPATCH_ADMIN_TOKEN_FILE"] {
        let token_file = configmap["data"][option].as_str().unwrap();
        let (dir, file) = token_file.rsplit_once('/').unwrap();
        assert_eq!(mount["mountPath"].as_str(), Some(dir), "{option}");
        let item = volume["secret"]["items"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|i| i["path"].as_str() == Some(file))
            .unwrap_or_else(|| panic!("{option}: no Secret item is mounted as {file}"));
        assert!(
            auth["stringData"][item["key"].as_str().unwrap()].is_string(),
            "{option}"
        );
    }
    assert!(secret["stringData"]["DISPATCH_POSTGRES_URL"].is_string());
    assert!(secret["stringData"]["DISPATCH_REDIS_URL"].is_string());
    assert_eq!(
        u64::from(port_of(
            configmap["data"]["DISPATCH_LISTEN"].as_str().unwrap()
        )),
        ports["grpc"]
    );
    assert_eq!(
        u64::from(port_of(
            configmap["data"]["DISPATCH_METRICS_LISTEN"]
                .as_str()
                .unwrap()
        )),
        ports["metrics"]
    );

    // The Service selects the pods and maps its ports to the named container ports.
    assert!(subset(&labels(&service["spec"]["selector"]), &pod_labels));
    let mut service_ports = BTreeMap::new();
    for p in service["spec"]["ports"].as_sequence().unwrap() {
        let target = p["targetPort"].as_str().unwrap();
        assert!(
            ports.contains_key(target),
            "targetPort {target} names no container port"
        );
        assert_eq!(p["port"].as_u64(), Some(ports[target]));
        service_ports.insert(
            p["name"].as_str().unwrap().to_owned(),
            p["port"].as_u64().unwrap(),
        );
    }

    // Prometheus scrapes the pods' metrics port.
    assert!(subset(
        &labels(&podmonitor["spec"]["selector"]["matchLabels"]),
        &pod_labels
    ));
    let endpoint = &podmonitor["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["port"].as_str(), Some("metrics"));
    assert_eq!(endpoint["path"].as_str(), Some("/metrics"));

    // KEDA reaches the broker's Service on its gRPC port.
    let trigger = &scaled["spec"]["triggers"][0];
    assert_eq!(trigger["type"].as_str(), Some("external"));
    let address = trigger["metadata"]["scalerAddress"].as_str().unwrap();
    let service_name = service["metadata"]["name"].as_str().unwrap();
    assert_eq!(
        address,
        format!("{service_name}.{namespace}.svc:{}", service_ports["grpc"])
    );
    let per_worker: f64 = trigger["metadata"][dispatch_broker::keda::TASKS_PER_WORKER]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(per_worker > 0.0);
    let raw = std::fs::read_to_string(Path::new(DIR).join("worker-scaledobject.yaml")).unwrap();
    assert!(
        raw.contains(dispatch_broker::metrics::WAITING_TASKS),
        "the prometheus alternative names the gauge"
    );
}

#[test]
fn the_dockerfile_matches_the_binary() {
    let docker =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/Dockerfile")).unwrap();
    let (grpc, metrics) = default_ports();
    assert!(
        docker.contains(&format!("EXPOSE {grpc} {metrics}")),
        "EXPOSE lists both ports"
    );
    assert!(docker.contains(&format!("DISPATCH_LISTEN=0.0.0.0:{grpc}")));
    assert!(docker.contains(&format!("DISPATCH_METRICS_LISTEN=0.0.0.0:{metrics}")));
    assert!(
        docker.contains("\"dispatch-broker\", \"health\""),
        "health check through gRPC health"
    );
    assert!(
        docker
            .lines()
            .any(|l| l.starts_with("USER ") && !l.contains("root")),
        "runs as non-root"
    );
    let known = serve_env_vars();
    for var in [
        "DISPATCH_LISTEN",
        "DISPATCH_METRICS_LISTEN",
        "DISPATCH_LOG_JSON",
    ] {
        assert!(known.contains(var), "{var}");
    }
}

#[test]
fn every_metric_the_dashboard_queries_exists() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/grafana/dispatch-broker.json"
    );
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).expect("dashboard is JSON");
    let known = dispatch_broker::metrics::ALL;
    let mut queried = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{}", panel["title"]);
        assert!(
            panel["description"].as_str().is_some_and(|d| !d.is_empty()),
            "{} says which question it answers",
            panel["title"]
        );
        for target in targets {
            let expr = target["expr"].as_str().expect("expr");
            // Every metric name in the query (histograms are queried by their series).
            let mut rest = expr;
            while let Some(at) = rest.find("dispatch_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|b| known.contains(b)))
                    .unwrap_or(&name)
                    .to_owned();
                assert!(
                    known.contains(&base.as_str()),
                    "{} queries {name}, which src/metrics.rs does not define",
                    panel["title"]
                );
                queried.insert(base);
            }
        }
    }
    // The panels the operator's guide promises.
    for name in [
        "dispatch_lanes",
        "dispatch_waiting_tasks",
        "dispatch_live_leases",
        "dispatch_fetch_total",
        "dispatch_rpc_duration_seconds",
        "dispatch_fetch_postgres_statements",
        "dispatch_leases_swept_total",
        "dispatch_locks_reconciled_total",
        "dispatch_backend_errors_total",
    ] {
        assert!(queried.contains(name), "no panel shows {name}");
    }
}

#[test]
fn one_license_for_the_crate_and_the_python_package() {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = std::fs::read_to_string(format!("{root}/LICENSE")).expect("a LICENSE file");
    assert!(
        text.trim_start()
            .starts_with("GNU GENERAL PUBLIC LICENSE\n                       Version 2, June 1991"),
        "LICENSE holds the GPL version 2 text"
    );
    assert_eq!(env!("CARGO_PKG_LICENSE"), "GPL-2.0-or-later");
    let pyproject =
        std::fs::read_to_string(format!("{root}/clients/python/pyproject.toml")).unwrap();
    assert!(
        pyproject
            .lines()
            .any(|l| l.trim() == "license = \"GPL-2.0-or-later\""),
        "clients/python/pyproject.toml states the crate's license"
    );
    let shipped = std::fs::read_to_string(format!("{root}/clients/python/LICENSE"))
        .expect("the Python package ships the license text");
    assert_eq!(shipped, text, "the Python package ships the same LICENSE");
}

/// `serve` as the Deployment starts it (the ConfigMap's and the Secret's variables, as the
/// options they set) passes the broker's start-up checks: in particular it listens on 0.0.0.0
/// with the workers' and the admin token, so it is not refused as open to everyone.
#[test]
fn the_kubernetes_configuration_passes_the_start_up_checks() {
    let configmap = load("configmap.yaml");
    let secret = load("secret.yaml");
    let cli = Cli::command();
    let serve = cli.find_subcommand("serve").unwrap();
    let argv = |skip: &[&str]| {
        let mut argv = vec!["dispatch-broker".to_owned(), "serve".to_owned()];
        let vars = configmap["data"]
            .as_mapping()
            .unwrap()
            .iter()
            .chain(secret["stringData"].as_mapping().unwrap());
        for (key, value) in vars {
            let (key, value) = (key.as_str().unwrap(), value.as_str().unwrap());
            if skip.contains(&key) {
                continue;
            }
            let arg = serve
                .get_arguments()
                .chain(cli.get_arguments())
                .find(|a| a.get_env().is_some_and(|e| e == key))
                .unwrap_or_else(|| panic!("{key} is no option of serve"));
            let long = arg.get_long().unwrap();
            if matches!(arg.get_action(), clap::ArgAction::SetTrue) {
                if value == "true" {
                    argv.push(format!("--{long}"));
                }
            } else {
                argv.push(format!("--{long}={value}"));
            }
        }
        let Command::Serve(args) = <Cli as clap::Parser>::parse_from(argv).command else {
            unreachable!()
        };
        args
    };
    let args = argv(&[]);
    assert!(
        !args.listen.ip().is_loopback(),
        "the pods serve other hosts"
    );
    assert_eq!(args.validate(), Ok(()));
    // Without the tokens the same configuration would be refused.
    let open = argv(&["DISPATCH_AUTH_TOKEN_FILE", "DISPATCH_ADMIN_TOKEN_FILE"]);
    assert!(open
        .validate()
        .unwrap_err()
        .contains("--allow-unauthenticated"));
}
