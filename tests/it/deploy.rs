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
    assert_eq!(
        container["image"].as_str(),
        Some(concat!("dispatch-broker:", env!("CARGO_PKG_VERSION"))),
        "the image docs/operations.md's install section builds and tags"
    );
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

/// The shipped fairness policy is one the broker accepts, mounted where the ConfigMap's
/// `DISPATCH_FAIR_POLICY` says.
#[test]
fn the_shipped_fairness_policy_is_accepted_and_mounted_where_serve_reads_it() {
    let policy = load("fair-policy.yaml");
    let text = policy["data"]["policy.toml"].as_str().unwrap();
    dispatch_broker::fair::Policy::parse(text).expect("the shipped policy parses");
    let path = load("configmap.yaml")["data"]["DISPATCH_FAIR_POLICY"]
        .as_str()
        .unwrap()
        .to_owned();
    let deployment = load("deployment.yaml");
    let spec = &deployment["spec"]["template"]["spec"];
    let mount = spec["containers"][0]["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "fair-policy")
        .expect("the policy is mounted");
    let dir = mount["mountPath"].as_str().unwrap();
    assert_eq!(path, format!("{dir}/policy.toml"));
    let volume = spec["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "fair-policy")
        .unwrap();
    assert_eq!(
        volume["configMap"]["name"].as_str(),
        policy["metadata"]["name"].as_str()
    );
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

/// The build stage of deploy/Dockerfile: what its COPY lines take from the build context (source,
/// destination under WORKDIR) and the command its RUN line runs.
struct BuildStage {
    copies: Vec<(Vec<String>, String)>,
    run: Vec<String>,
}

fn build_stage(dockerfile: &str) -> BuildStage {
    let joined = dockerfile.replace("\\\n", " ");
    let mut stage = BuildStage {
        copies: Vec::new(),
        run: Vec::new(),
    };
    let mut froms = 0;
    for line in joined.lines().map(str::trim) {
        let words: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
        match words.first().map(String::as_str) {
            Some("FROM") => froms += 1,
            Some("COPY") if froms == 1 => {
                assert!(
                    !words[1].starts_with("--"),
                    "COPY flags are not understood by this test: {line}"
                );
                let (dest, sources) = words[1..].split_last().expect("COPY SRC... DEST");
                stage.copies.push((sources.to_vec(), dest.clone()));
            }
            Some("RUN") if froms == 1 => {
                assert!(stage.run.is_empty(), "one RUN in the build stage");
                stage.run = words[1..].to_vec();
            }
            _ => {}
        }
    }
    stage
}

/// `.dockerignore`'s patterns.
fn docker_ignored() -> Vec<String> {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/.dockerignore"))
        .expect("a .dockerignore keeps build output out of the build context")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            assert!(
                !l.starts_with('!'),
                "exceptions are not understood by this test: {l}"
            );
            l.trim_matches('/').to_owned()
        })
        .collect()
}

/// Whether a `.dockerignore` pattern matches a context-relative path (`**` any number of
/// components, `*` and `?` within one), as Docker matches them.
fn ignored_by(pattern: &str, path: &str) -> bool {
    fn glob(p: &[u8], s: &[u8]) -> bool {
        match (p.first(), s.first()) {
            (None, None) => true,
            (Some(b'*'), _) => glob(&p[1..], s) || (!s.is_empty() && glob(p, &s[1..])),
            (Some(b'?'), Some(_)) => glob(&p[1..], &s[1..]),
            (Some(a), Some(b)) if a == b => glob(&p[1..], &s[1..]),
            _ => false,
        }
    }
    fn parts(p: &[&str], s: &[&str]) -> bool {
        match (p.first(), s.first()) {
            (None, None) => true,
            (Some(&"**"), _) => parts(&p[1..], s) || (!s.is_empty() && parts(p, &s[1..])),
            (Some(a), Some(b)) => glob(a.as_bytes(), b.as_bytes()) && parts(&p[1..], &s[1..]),
            _ => false,
        }
    }
    let p: Vec<&str> = pattern.split('/').collect();
    let s: Vec<&str> = path.split('/').collect();
    parts(&p, &s)
}

/// Copies the context-relative path `rel` to `to` as Docker's COPY does, leaving out what
/// `.dockerignore` excludes.
fn copy_from_context(root: &Path, rel: &str, to: &Path, ignore: &[String]) {
    assert!(
        !ignore.iter().any(|p| ignored_by(p, rel)),
        "COPY {rel}: .dockerignore excludes it"
    );
    let from = root.join(rel);
    let meta = std::fs::metadata(&from)
        .unwrap_or_else(|e| panic!("COPY {rel}: not in the repository ({e})"));
    if meta.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(&from).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            let child = format!("{rel}/{name}");
            if !ignore.iter().any(|p| ignored_by(p, &child)) {
                copy_from_context(root, &child, &to.join(&name), ignore);
            }
        }
    } else {
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&from, to).unwrap();
    }
}

#[test]
fn dockerignore_patterns_match_as_docker_matches_them() {
    assert!(ignored_by("target", "target"));
    assert!(!ignored_by("target", "src/target"));
    assert!(ignored_by("**/__pycache__", "__pycache__"));
    assert!(ignored_by(
        "**/__pycache__",
        "clients/python/tests/__pycache__"
    ));
    assert!(ignored_by("**/*.egg-info", "clients/python/x.egg-info"));
    assert!(!ignored_by("**/*.egg-info", "src"));
    let ignored = docker_ignored();
    for path in ["target", ".git"] {
        assert!(
            ignored.iter().any(|p| ignored_by(p, path)),
            ".dockerignore keeps {path} out"
        );
    }
}

/// The image builds from what the Dockerfile copies, without Docker: exactly the paths its COPY
/// lines name (less what .dockerignore excludes) go into a scratch directory, and its RUN's cargo
/// command runs there, as `cargo check` (the link step reads nothing from the context) with
/// `--offline` (dependencies come from the local cargo cache, as they did for this test's own
/// build). The scratch build has a target directory of its own that only ever held this scratch
/// copy, so nothing built from the repository itself can stand in for a missing file; it is kept
/// between runs, so only the first run checks the dependencies.
#[test]
fn the_image_builds_from_what_the_dockerfile_copies() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let docker = std::fs::read_to_string(root.join("deploy/Dockerfile")).unwrap();
    let stage = build_stage(&docker);
    assert!(
        !stage.copies.is_empty(),
        "the build stage copies the sources"
    );
    let ignore = docker_ignored();
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dockerfile-build");
    let context = scratch.join("src");
    if context.exists() {
        std::fs::remove_dir_all(&context).unwrap();
    }
    std::fs::create_dir_all(&context).unwrap();
    for (sources, dest) in &stage.copies {
        let into_dir = sources.len() > 1 || dest.ends_with('/');
        for source in sources {
            let name = Path::new(source).file_name().unwrap();
            let to = if into_dir {
                context.join(dest).join(name)
            } else {
                context.join(dest)
            };
            copy_from_context(root, source.trim_end_matches('/'), &to, &ignore);
        }
    }

    let [cargo, verb, args @ ..] = stage.run.as_slice() else {
        panic!("RUN has a cargo command: {:?}", stage.run);
    };
    assert_eq!(
        (cargo.as_str(), verb.as_str()),
        ("cargo", "build"),
        "{:?}",
        stage.run
    );
    assert!(
        args.contains(&"--locked".to_owned()),
        "the image builds with Cargo.lock's versions"
    );
    assert!(
        args.windows(2).any(|w| w == ["--bin", "dispatch-broker"]),
        "{:?}",
        stage.run
    );
    let out = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .arg("check")
        .args(args)
        .args(["--offline", "--quiet"])
        .current_dir(&context)
        .env("CARGO_TARGET_DIR", scratch.join("target"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "`cargo check {} --offline` on the Dockerfile's copy of the repository failed:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `rust-version` in Cargo.toml is no older than what any locked dependency declares it needs
/// (docs/operations.md's install section states it; clippy's `incompatible_msrv` checks the crate's own
/// use of the standard library against it).
#[test]
fn rust_version_covers_every_locked_dependency() {
    let host = std::process::Command::new("rustc")
        .arg("-vV")
        .output()
        .unwrap();
    let host = String::from_utf8_lossy(&host.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .expect("rustc -vV names the host");
    let out = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args(["--filter-platform", &host])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let version = |v: &str| -> Vec<u64> { v.split('.').map(|n| n.parse().unwrap()).collect() };
    let ours = version(env!("CARGO_PKG_RUST_VERSION"));
    let resolved: BTreeSet<&str> = metadata["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap())
        .collect();
    for package in metadata["packages"].as_array().unwrap() {
        let (Some(needs), Some(id)) = (package["rust_version"].as_str(), package["id"].as_str())
        else {
            continue;
        };
        if resolved.contains(id) {
            let mut needs = version(needs);
            needs.resize(ours.len().max(needs.len()), 0);
            let mut have = ours.clone();
            have.resize(needs.len(), 0);
            assert!(
                have >= needs,
                "{} {} needs Rust {}, but Cargo.toml says rust-version = {}",
                package["name"],
                package["version"],
                package["rust_version"],
                env!("CARGO_PKG_RUST_VERSION")
            );
        }
    }
}
