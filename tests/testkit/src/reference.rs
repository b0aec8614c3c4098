//! Reading the configuration reference (docs/configuration.md) against the command lines: the
//! broker's tests and the test kit's own use it, so that drift fails CI.

use std::collections::BTreeMap;

/// Option (`--long`, or `<ID>` for a positional argument) -> environment variable (`none`).
pub type Options = BTreeMap<String, String>;

/// The heading that starts the part of the reference about the test kit's binaries.
pub const TESTKIT_HEADING: &str = "# The demo and the sandbox";

/// The reference split in two: the broker's subcommands, and the test kit's binaries.
pub fn parts(doc: &str) -> (&str, &str) {
    doc.split_once(&format!("\n{TESTKIT_HEADING}"))
        .expect("docs/configuration.md has a part about the demo and the sandbox")
}

/// The options of `cmd` that are (`global`) or are not global, as the reference lists them.
pub fn command_options(cmd: &clap::Command, global: bool) -> Options {
    cmd.get_arguments()
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        .filter(|a| a.is_global_set() == global)
        .map(|a| {
            let option = match a.get_long() {
                Some(long) => format!("--{long}"),
                None => format!("<{}>", a.get_id().as_str().to_uppercase()),
            };
            let env = a
                .get_env()
                .map(|e| e.to_string_lossy().into_owned())
                .unwrap_or_else(|| "none".into());
            (option, env)
        })
        .collect()
}

/// Every `## name` section's table (`| option | environment variable | default | meaning |`)
/// in `doc`; sections without one are left out.
pub fn documented_options(doc: &str) -> BTreeMap<String, Options> {
    let mut documented: BTreeMap<String, Options> = BTreeMap::new();
    let mut section = None;
    for line in doc.lines() {
        if let Some(name) = line.strip_prefix("## ") {
            section = Some(name.trim().to_string());
            documented.entry(name.trim().to_string()).or_default();
        } else if line.starts_with("| `") {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let option = cells[1].trim_matches('`').to_string();
            let env = cells[2].trim_matches('`').to_string();
            let section = section
                .clone()
                .expect("a table under a `## subcommand` heading");
            let table = documented.get_mut(&section).unwrap();
            assert!(
                table.insert(option.clone(), env).is_none(),
                "{option} is listed twice under {section} in the reference"
            );
        }
    }
    documented.retain(|_, table| !table.is_empty());
    documented
}
