//! What the broker needs of the schema, and the report `dispatch-broker migrate` prints.

/// Columns the broker reads or writes, as `table.column`.
pub const REQUIRED_COLUMNS: &[&str] = &[
    "core_task.pulp_id",
    "core_task.pulp_created",
    "core_task.pulp_last_updated",
    "core_task.state",
    "core_task.name",
    "core_task.reserved_resources_record",
    "core_task.app_lock_id",
    "core_task.versions",
    "core_task.immediate",
    "core_task.started_at",
    "core_task.finished_at",
    "core_task.error",
    "core_task.pulp_domain_id",
    "core_task.task_group_id",
    "core_appstatus.pulp_id",
    "core_appstatus.pulp_created",
    "core_appstatus.pulp_last_updated",
    "core_appstatus.app_type",
    "core_appstatus.name",
    "core_appstatus.versions",
    "core_appstatus.ttl",
    "core_appstatus.last_heartbeat",
];

/// What `migrate` did and found.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// True when the tables were created now; false when they were already there.
    pub created: bool,
    /// True when `--lanes-index` built the lane gauge's index now.
    pub lanes_index_created: bool,
    /// True when `--fair-indexes` built fair dispatch's indexes now.
    pub fair_indexes_created: bool,
    /// True when `pulp_domain_id` was added to a table made by an older `migrate`.
    pub domain_column_added: bool,
    /// True when `task_group_id` was added to a table made by an older `migrate`.
    pub task_group_column_added: bool,
    /// True when `--notify-trigger` installed the insert notification trigger now.
    pub notify_trigger_created: bool,
    /// True when `--gin-fastupdate-off` turned off the GIN index's pending list now.
    pub gin_fastupdate_changed: bool,
    /// What the broker needs and the database still lacks.
    pub missing: Vec<String>,
    /// What the broker can do without but runs better with, and how to add it.
    pub optional: Vec<String>,
}

/// Compares the items `schema_check.sql` found with what the broker needs.
pub fn missing(present: &[String]) -> Vec<String> {
    let mut missing: Vec<String> = REQUIRED_COLUMNS
        .iter()
        .filter(|c| !present.iter().any(|p| p == *c))
        .map(|c| format!("column {c}"))
        .collect();
    if !present.iter().any(|p| p.starts_with("index:")) {
        missing.push(
            "a GIN index on core_task(reserved_resources_record) (pulp_task_resources_index)"
                .to_owned(),
        );
    }
    if !present.iter().any(|p| p == "extension:hstore") {
        missing.push("the hstore extension".to_owned());
    }
    if present.iter().any(|p| p == "core_task.pulp_created")
        && !present.iter().any(|p| p == "stamp-trigger")
    {
        missing.push(
            "an enabled insert trigger that stamps core_task.pulp_created (Pulp's \
             on_insert_timestamp_task_trigger: without it a task could appear older than one \
             already handed out; if it was disabled, `ALTER TABLE core_task ENABLE TRIGGER \
             on_insert_timestamp_task_trigger`)"
                .to_owned(),
        );
    }
    missing
}

/// The optional pieces `present` lacks, each with the command that adds it.
pub fn optional(present: &[String]) -> Vec<String> {
    let mut optional = Vec::new();
    if !present.iter().any(|p| p == "lanes-index") {
        optional.push(
            "the lane gauge's index dispatch_lanes_idx (add it with `dispatch-broker migrate \
             --lanes-index`; without it Postgres sorts every incomplete task for each count)"
                .to_owned(),
        );
    }
    if !present.iter().any(|p| p == "fair-indexes") {
        optional.push(
            "fair dispatch's indexes dispatch_groups_idx and dispatch_immediate_idx (add them \
             with `dispatch-broker migrate --fair-indexes`; without them tasks are handed out in \
             queue order: no shares among domains, no express lane for immediate tasks; caps \
             and the reserve still hold)"
                .to_owned(),
        );
    }
    if present.iter().any(|p| p.starts_with("index:"))
        && !present.iter().any(|p| p == "gin-fastupdate-off")
    {
        optional.push(
            "fastupdate = off on the GIN index of reserved resources (set it with \
             `dispatch-broker migrate --gin-fastupdate-off`; with its pending list on, readiness \
             look-ups slow down as tasks change state until the next vacuum)"
                .to_owned(),
        );
    }
    optional
}

/// `dispatch-broker migrate`: creates the schema on an empty database, or reports on an existing
/// one; fails when something the broker needs is missing.
pub async fn run(args: &crate::config::MigrateArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let stats = std::sync::Arc::new(crate::metrics::Stats::default());
    let tasks = super::Tasks::connect(
        &args.postgres.url,
        1,
        std::time::Duration::from_secs(10),
        stats,
    )
    .await
    .context("cannot reach PostgreSQL at --postgres-url")?;
    let outcome = tasks
        .migrate(
            args.lanes_index,
            args.notify_trigger,
            args.gin_fastupdate_off,
            args.fair_indexes,
        )
        .await
        .context("migrate failed")?;
    if outcome.created {
        println!("created core_appstatus, core_task, their indexes and the insert triggers");
    } else if outcome.lanes_index_created
        || outcome.fair_indexes_created
        || outcome.domain_column_added
        || outcome.task_group_column_added
        || outcome.notify_trigger_created
        || outcome.gin_fastupdate_changed
    {
        if outcome.lanes_index_created {
            println!("core_task already exists; added the lane gauge's index dispatch_lanes_idx");
        }
        if outcome.domain_column_added {
            println!("core_task already exists; added the column pulp_domain_id (every task in the default domain)");
        }
        if outcome.task_group_column_added {
            println!("core_task already exists; added the column task_group_id (no task in a task group)");
        }
        if outcome.fair_indexes_created {
            println!("core_task already exists; added fair dispatch's indexes dispatch_groups_idx, dispatch_immediate_idx and dispatch_task_groups_idx");
        }
        if outcome.notify_trigger_created {
            println!("core_task already exists; added the insert notification trigger dispatch_task_notify");
        }
        if outcome.gin_fastupdate_changed {
            println!("core_task already exists; turned off the pending list of its GIN index on reserved resources");
        }
    } else {
        println!("core_task already exists; changed nothing");
    }
    for piece in &outcome.optional {
        println!("optional, not present: {piece}");
    }
    if outcome.missing.is_empty() {
        println!("the database has everything dispatch-broker needs");
        Ok(())
    } else {
        anyhow::bail!(
            "the database lacks what dispatch-broker needs: {}",
            outcome.missing.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_each_missing_piece() {
        let mut present: Vec<String> = REQUIRED_COLUMNS.iter().map(|c| c.to_string()).collect();
        present.push("index:pulp_task_resources_index".into());
        present.push("extension:hstore".into());
        present.push("stamp-trigger".into());
        assert!(missing(&present).is_empty());
        present.retain(|p| p != "core_task.app_lock_id" && !p.starts_with("index:"));
        let m = missing(&present);
        assert_eq!(m.len(), 2, "{m:?}");
        assert!(m[0].contains("core_task.app_lock_id"));
        assert!(m[1].contains("GIN"));
        present.retain(|p| p != "stamp-trigger");
        let m = missing(&present);
        assert_eq!(m.len(), 3, "{m:?}");
        assert!(m[2].contains("on_insert_timestamp_task_trigger"));
    }

    #[test]
    fn suggests_the_lanes_index_until_it_is_there() {
        let mut present = vec!["extension:hstore".to_owned(), "fair-indexes".to_owned()];
        assert_eq!(optional(&present).len(), 1);
        assert!(optional(&present)[0].contains("--lanes-index"));
        present.push("lanes-index".into());
        assert!(optional(&present).is_empty());
    }

    #[test]
    fn suggests_the_fair_indexes_until_they_are_there() {
        let mut present = vec!["extension:hstore".to_owned(), "lanes-index".to_owned()];
        assert_eq!(optional(&present).len(), 1);
        assert!(optional(&present)[0].contains("--fair-indexes"));
        present.push("fair-indexes".into());
        assert!(optional(&present).is_empty());
    }
}
