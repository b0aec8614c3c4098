//! dispatch-broker: one central gRPC service that owns all lock state for a fleet of task workers.
//!
//! Workers open a lease, fetch or claim tasks (each grant locks the task's resources under that
//! lease and carries a fencing token), and release the locks when done. Tasks stay in PostgreSQL
//! (Pulp's `core_task`); locks and leases live in Redis and change only through the Lua scripts
//! in `lua/`. The readiness rule (`ready`) is pure and shared by everything that decides.
#![forbid(unsafe_code)]

pub mod admin;
pub mod batch;
pub mod cli;
pub mod config;
pub mod dispatch;
pub mod error;
pub mod fair;
pub mod grpc;
pub mod ids;
pub mod keda;
pub mod lanes;
pub mod leases;
pub mod locks;
pub mod metrics;
pub mod ready;
pub mod security;
pub mod server;
pub mod shutdown;
pub mod states;
pub mod tasks;

/// Generated protobuf and gRPC code for `dispatch.v1`.
pub mod proto {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("dispatch.v1");

    /// The encoded file descriptor set, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("dispatch_descriptor");
}

/// Generated code for KEDA's external scaler interface (`externalscaler`).
pub mod externalscaler {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("externalscaler");
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    /// The top-level modules each file of `src/` belongs to, and the top-level modules its code
    /// (not its comments, not its unit tests) names through `crate::`.
    fn module_imports() -> BTreeMap<String, BTreeSet<String>> {
        fn walk(dir: &Path, module: Option<&str>, out: &mut BTreeMap<String, BTreeSet<String>>) {
            for entry in std::fs::read_dir(dir).expect("read src") {
                let path = entry.expect("dir entry").path();
                let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
                let owner = module.map(str::to_owned).unwrap_or_else(|| stem.clone());
                if path.is_dir() {
                    walk(&path, Some(&owner), out);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let names = out.entry(owner.clone()).or_default();
                    let text = std::fs::read_to_string(&path).expect("read module");
                    let code = text.split("\n#[cfg(test)]\nmod tests").next().unwrap();
                    let code: Vec<&str> = code
                        .lines()
                        .filter(|l| !l.trim_start().starts_with("//"))
                        .collect();
                    names.extend(crate_paths(&code.join("\n")));
                    names.remove(&owner);
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
            None,
            &mut out,
        );
        for not_a_module in ["lib", "main"] {
            out.remove(not_a_module);
        }
        out
    }

    /// The first segment of every `crate::` path in `code`, groups included
    /// (`use crate::{a, b::C}` names `a` and `b`, over several lines too).
    fn crate_paths(code: &str) -> Vec<String> {
        let mut names = Vec::new();
        for (at, _) in code.match_indices("crate::") {
            let rest = &code[at + "crate::".len()..];
            let ident = |s: &str| -> String {
                s.trim_start()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect()
            };
            match rest.strip_prefix('{') {
                // Split the group at its top-level commas; each part starts with a module.
                Some(group) => {
                    let (mut depth, mut part) = (0, String::new());
                    for c in group.chars() {
                        match c {
                            '}' if depth == 0 => break,
                            ',' if depth == 0 => names.push(ident(&std::mem::take(&mut part))),
                            _ => {
                                depth += match c {
                                    '{' => 1,
                                    '}' => -1,
                                    _ => 0,
                                };
                                part.push(c);
                            }
                        }
                    }
                    names.push(ident(&part));
                }
                None => names.push(ident(rest)),
            }
        }
        names.retain(|n| !n.is_empty());
        names
    }

    #[test]
    fn crate_paths_reads_groups() {
        assert_eq!(crate_paths("use crate::metrics::Stats;"), ["metrics"]);
        assert_eq!(
            crate_paths("use crate::{locks, tasks::{A, B}, ready::C};"),
            ["locks", "tasks", "ready"]
        );
        assert_eq!(crate_paths("x(crate::a::f(), crate::b::G)"), ["a", "b"]);
    }

    /// No two modules import each other, directly or through others: each concept's module
    /// builds on the ones below it only.
    #[test]
    fn modules_import_each_other_in_no_loop() {
        let graph = module_imports();
        let reaches = |from: &str, to: &str| {
            let mut seen = BTreeSet::new();
            let mut todo = vec![from.to_owned()];
            while let Some(m) = todo.pop() {
                for next in graph.get(&m).into_iter().flatten() {
                    if next == to {
                        return true;
                    }
                    if seen.insert(next.clone()) {
                        todo.push(next.clone());
                    }
                }
            }
            false
        };
        let loops: Vec<String> = graph
            .iter()
            .flat_map(|(m, imports)| imports.iter().map(move |i| (m, i)))
            .filter(|(m, i)| reaches(i, m))
            .map(|(m, i)| format!("{m} -> {i} -> ... -> {m}"))
            .collect();
        assert!(
            loops.is_empty(),
            "import loops: {loops:#?}\ngraph: {graph:#?}"
        );
    }
}
