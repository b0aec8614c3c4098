//! Pulp's task states (`core_task.state`), named once. Rust code takes them from [`TaskState`];
//! the SQL files write `$final_states` and `$incomplete_states` where they list them, and
//! [`in_sql`] puts the lists in when a statement is composed, so no file spells them out.

use std::fmt;

/// A value of `core_task.state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskState {
    /// Dispatched, not running yet (claimed or not).
    Waiting,
    /// Started by a worker.
    Running,
    /// Cancel asked while it ran; its worker ends it.
    Canceling,
    /// Ended well.
    Completed,
    /// Ended with an error.
    Failed,
    /// Canceled.
    Canceled,
    /// Ended without running.
    Skipped,
}

impl TaskState {
    /// Every state, incomplete ones first.
    pub const ALL: [TaskState; 7] = [
        TaskState::Waiting,
        TaskState::Running,
        TaskState::Canceling,
        TaskState::Completed,
        TaskState::Failed,
        TaskState::Canceled,
        TaskState::Skipped,
    ];
    /// The states a task ends in; it never leaves them.
    pub const FINAL: [TaskState; 4] = [
        TaskState::Completed,
        TaskState::Failed,
        TaskState::Canceled,
        TaskState::Skipped,
    ];
    /// The states of a task that has not ended.
    pub const INCOMPLETE: [TaskState; 3] =
        [TaskState::Waiting, TaskState::Running, TaskState::Canceling];

    /// The state as Pulp stores it.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Waiting => "waiting",
            TaskState::Running => "running",
            TaskState::Canceling => "canceling",
            TaskState::Completed => "completed",
            TaskState::Failed => "failed",
            TaskState::Canceled => "canceled",
            TaskState::Skipped => "skipped",
        }
    }

    /// The state Pulp stores as `s`, if any.
    pub fn parse(s: &str) -> Option<TaskState> {
        TaskState::ALL.into_iter().find(|state| state.as_str() == s)
    }

    /// Whether a task in this state has ended.
    pub fn is_final(self) -> bool {
        TaskState::FINAL.contains(&self)
    }

    /// Whether `s` names a final state.
    pub fn is_final_name(s: &str) -> bool {
        TaskState::parse(s).is_some_and(TaskState::is_final)
    }

    /// The final states' names, for messages: `completed, failed, canceled, skipped`.
    pub fn final_names() -> String {
        names(&TaskState::FINAL, ", ", "")
    }
}

impl fmt::Display for TaskState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn names(states: &[TaskState], separator: &str, quote: &str) -> String {
    states
        .iter()
        .map(|s| format!("{quote}{s}{quote}"))
        .collect::<Vec<_>>()
        .join(separator)
}

/// `statement` with the state lists written in: `$final_states` becomes
/// `'completed', 'failed', 'canceled', 'skipped'` and `$incomplete_states`
/// `'waiting', 'running', 'canceling'`.
pub fn in_sql(statement: &str) -> String {
    let composed = statement
        .replace("$final_states", &names(&TaskState::FINAL, ", ", "'"))
        .replace(
            "$incomplete_states",
            &names(&TaskState::INCOMPLETE, ", ", "'"),
        );
    assert!(
        !composed.contains("$final_") && !composed.contains("$incomplete_"),
        "a state list placeholder was left unnamed"
    );
    composed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_round_trips_and_final_and_incomplete_split_them() {
        for state in TaskState::ALL {
            assert_eq!(TaskState::parse(state.as_str()), Some(state));
            assert_ne!(
                TaskState::FINAL.contains(&state),
                TaskState::INCOMPLETE.contains(&state),
                "{state} is either final or incomplete"
            );
        }
        assert_eq!(TaskState::parse("Waiting"), None);
        assert!(TaskState::is_final_name("skipped"));
        assert!(!TaskState::is_final_name("canceling"));
        assert!(!TaskState::is_final_name("done"));
    }

    #[test]
    fn sql_gets_the_lists_as_pulp_writes_them() {
        assert_eq!(
            in_sql("WHERE state NOT IN ($final_states) OR state IN ($incomplete_states)"),
            "WHERE state NOT IN ('completed', 'failed', 'canceled', 'skipped') \
             OR state IN ('waiting', 'running', 'canceling')"
        );
    }

    /// No SQL file spells out a state list: each takes it from here.
    #[test]
    fn no_sql_file_lists_states_itself() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/tasks");
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "sql") {
                let text = std::fs::read_to_string(&path).unwrap();
                for list in [
                    names(&TaskState::FINAL, ", ", "'"),
                    names(&TaskState::INCOMPLETE, ", ", "'"),
                ] {
                    assert!(
                        !text.contains(&list),
                        "{} spells out {list}; write the placeholder instead",
                        path.display()
                    );
                }
            }
        }
    }
}
