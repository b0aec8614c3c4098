//! proto <-> domain conversions. Every check on client input lives here, so a bad request is
//! refused before it reaches Redis or Postgres.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tonic::Status;
use uuid::Uuid;

use crate::ids::TaskId;

use crate::config::LimitArgs;
use crate::dispatch::{Finish, Grant};
use crate::ids::FencingToken;
use crate::leases::OpenLease;
use crate::proto;
use crate::ready::is_valid_release;
use crate::states::TaskState;

/// Parses a required id field.
pub fn parse_id(field: &str, value: &str) -> Result<Uuid, Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    Uuid::parse_str(value)
        .map_err(|_| Status::invalid_argument(format!("{field} {} is not a UUID", echo(value))))
}

/// A client's value as an error message quotes it: a bounded prefix (the value may be a
/// megabyte of anything), quoted and escaped.
fn echo(value: &str) -> String {
    let shown: String = value.chars().take(40).collect();
    let more = if shown.len() < value.len() { "..." } else { "" };
    format!("{shown:?}{more}")
}

/// A fencing token must be one the broker handed out (never 0).
pub fn fencing_token(token: u64) -> Result<FencingToken, Status> {
    if token == 0 {
        return Err(Status::invalid_argument(
            "fencing_token is required: pass the token that came with the task",
        ));
    }
    Ok(FencingToken(token))
}

/// An optional, non-negative duration; unset is zero.
pub fn duration_or_zero(
    field: &str,
    value: Option<prost_types::Duration>,
) -> Result<Duration, Status> {
    match value {
        None => Ok(Duration::ZERO),
        Some(d) => Duration::try_from(d).map_err(|_| {
            Status::invalid_argument(format!("{field} must be a non-negative duration"))
        }),
    }
}

/// A name field within `--max-name-bytes`.
fn name_within(field: &str, value: &str, limits: &LimitArgs) -> Result<(), Status> {
    if value.len() > limits.name_bytes {
        return Err(Status::invalid_argument(format!(
            "{field} is {} bytes; at most {} are accepted (--max-name-bytes)",
            value.len(),
            limits.name_bytes
        )));
    }
    Ok(())
}

/// Validates OpenLease.
pub fn open_lease(
    request: proto::OpenLeaseRequest,
    limits: &LimitArgs,
) -> Result<OpenLease, Status> {
    let worker_name = request.worker_name.trim().to_owned();
    if worker_name.is_empty() {
        return Err(Status::invalid_argument(
            "worker_name is required (e.g. \"1234@host\")",
        ));
    }
    name_within("worker_name", &worker_name, limits)?;
    if worker_name.contains(char::is_control) {
        return Err(Status::invalid_argument(
            "worker_name contains control characters; use printable text such as \"1234@host\"",
        ));
    }
    if request.versions.len() > limits.versions {
        return Err(Status::invalid_argument(format!(
            "versions has {} components; at most {} are accepted (--max-versions)",
            request.versions.len(),
            limits.versions
        )));
    }
    let mut versions = BTreeMap::new();
    for (component, version) in request.versions {
        if component.is_empty() {
            return Err(Status::invalid_argument(
                "versions has an empty component name",
            ));
        }
        name_within("a versions component name", &component, limits)?;
        name_within(&format!("versions[{component:?}]"), &version, limits)?;
        if !is_valid_release(&version) {
            return Err(Status::invalid_argument(format!(
                "versions[{component:?}] = {version:?} is not a dotted release number such as \"3.123.1\""
            )));
        }
        versions.insert(component, version);
    }
    let ttl = match request.ttl {
        None => None,
        Some(d) => Some(
            Duration::try_from(d)
                .map_err(|_| Status::invalid_argument("ttl must be a positive duration"))?,
        ),
    };
    let app_status_id = if request.app_status_id.is_empty() {
        None
    } else {
        Some(parse_id("app_status_id", &request.app_status_id)?)
    };
    let open_id = if request.open_id.is_empty() {
        None
    } else {
        Some(parse_id("open_id", &request.open_id)?)
    };
    Ok(OpenLease {
        worker_name,
        versions,
        ttl,
        app_status_id,
        open_id,
    })
}

/// Refuses a list `field` of `n` `what` over `--max-skip-ids`.
fn within_max_skip_ids(
    field: &str,
    what: &str,
    n: usize,
    limits: &LimitArgs,
) -> Result<(), Status> {
    if n > limits.skip_ids {
        return Err(Status::invalid_argument(format!(
            "{field} has {n} {what}; at most {} are accepted (--max-skip-ids)",
            limits.skip_ids
        )));
    }
    Ok(())
}

/// Validates FetchTask's `skip_task_ids`.
pub fn skip_ids(ids: &[String], limits: &LimitArgs) -> Result<HashSet<TaskId>, Status> {
    within_max_skip_ids("skip_task_ids", "ids", ids.len(), limits)?;
    ids.iter()
        .map(|id| parse_id("skip_task_ids", id).map(TaskId))
        .collect()
}

/// Validates Heartbeat's `undelivered`: each a task id and a fencing token, at most as many as
/// skip ids are accepted (a worker holds few tasks).
pub fn undelivered(
    held: &[proto::HeldTask],
    limits: &LimitArgs,
) -> Result<Vec<(TaskId, FencingToken)>, Status> {
    within_max_skip_ids("undelivered", "tasks", held.len(), limits)?;
    held.iter()
        .map(|h| {
            let task = parse_id("undelivered.task_id", &h.task_id).map(TaskId)?;
            if h.fencing_token == 0 {
                return Err(Status::invalid_argument(format!(
                    "undelivered task {task} has no fencing_token; pass the one HeartbeatResponse.held_tasks gave"
                )));
            }
            Ok((task, FencingToken(h.fencing_token)))
        })
        .collect()
}

/// Validates FinishTask's state and error.
pub fn finish(state: String, error: String, limits: &LimitArgs) -> Result<Finish, Status> {
    if error.len() > limits.error_bytes {
        return Err(Status::invalid_argument(format!(
            "error is {} bytes; at most {} are accepted (--max-error-bytes)",
            error.len(),
            limits.error_bytes
        )));
    }
    if error.contains('\0') {
        return Err(Status::invalid_argument(
            "error contains a NUL character, which Postgres cannot store; remove or escape it",
        ));
    }
    let Some(state) = TaskState::parse(&state).filter(|s| s.is_final()) else {
        return Err(Status::invalid_argument(format!(
            "state {} is not a final state; use one of {}",
            echo(&state),
            TaskState::final_names()
        )));
    };
    let error = (!error.is_empty()).then_some(error);
    Ok(Finish { state, error })
}

/// A timestamp for the wire.
pub fn to_timestamp(t: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.timestamp(),
        nanos: t.timestamp_subsec_nanos() as i32,
    }
}

impl From<Grant> for proto::Task {
    fn from(grant: Grant) -> proto::Task {
        proto::Task {
            task_id: grant.task_id.to_string(),
            name: grant.name,
            exclusive_resources: grant.resources.exclusive,
            shared_resources: grant.resources.shared,
            fencing_token: grant.fencing_token.0,
            immediate: grant.immediate,
            created_at: Some(to_timestamp(grant.created_at)),
            started_at: grant.started_at.map(to_timestamp),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The request-to-domain conversions, fuzzed: whatever a client sends, a conversion never
    //! panics, what it accepts is within the limits, and what it refuses is INVALID_ARGUMENT
    //! with a short message.

    use super::*;
    use proptest::collection::{btree_map, vec};
    use proptest::prelude::*;
    use tonic::Code;

    fn small() -> LimitArgs {
        LimitArgs {
            message_bytes: 4096,
            skip_ids: 5,
            name_bytes: 16,
            versions: 3,
            error_bytes: 32,
        }
    }

    /// Strings a hostile client might send: empty, long, control characters, quotes, braces,
    /// Lua and Redis syntax, near-UUIDs.
    fn hostile() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            "\\PC{0,40}",
            ".{0,300}",
            "[0-9a-f-]{30,40}",
            Just("{dispatch}:x:*".to_owned()),
            Just("\"; redis.call('FLUSHALL') --".to_owned()),
            Just(" \t\n ".to_owned()),
            Just("3.123.1".to_owned()),
            any::<u128>().prop_map(|n| Uuid::from_u128(n).to_string()),
        ]
    }

    fn refused_well(status: &Status) -> Result<(), TestCaseError> {
        prop_assert_eq!(status.code(), Code::InvalidArgument);
        prop_assert!(!status.message().is_empty());
        prop_assert!(status.message().len() < 1200, "{}", status.message().len());
        Ok(())
    }

    proptest! {
        #[test]
        fn ids_parse_exactly_the_uuids(value in hostile()) {
            match parse_id("task_id", &value) {
                Ok(id) => prop_assert_eq!(Some(id), Uuid::parse_str(&value).ok()),
                Err(status) => {
                    prop_assert!(Uuid::parse_str(&value).is_err());
                    refused_well(&status)?;
                }
            }
        }

        #[test]
        fn open_lease_accepts_only_what_fits(
            worker_name in hostile(),
            versions in btree_map(hostile(), hostile(), 0..6),
            ttl in proptest::option::of((any::<i64>(), any::<i32>())),
            app_status_id in hostile(),
        ) {
            let limits = small();
            let request = proto::OpenLeaseRequest {
                worker_name: worker_name.clone(),
                versions: versions.clone().into_iter().collect(),
                ttl: ttl.map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
                app_status_id: app_status_id.clone(),
                open_id: String::new(),
            };
            match open_lease(request, &limits) {
                Ok(open) => {
                    prop_assert!(!open.worker_name.is_empty());
                    prop_assert_eq!(open.worker_name.as_str(), worker_name.trim());
                    prop_assert!(open.worker_name.len() <= limits.name_bytes);
                    prop_assert!(!open.worker_name.contains(char::is_control));
                    prop_assert!(open.versions.len() <= limits.versions);
                    for (component, version) in &open.versions {
                        prop_assert!(!component.is_empty() && component.len() <= limits.name_bytes);
                        prop_assert!(is_valid_release(version));
                    }
                    prop_assert_eq!(open.app_status_id.is_some(), !app_status_id.is_empty());
                }
                Err(status) => refused_well(&status)?,
            }
        }

        #[test]
        fn skip_ids_are_bounded_uuids(ids in vec(hostile(), 0..9)) {
            let limits = small();
            match skip_ids(&ids, &limits) {
                Ok(set) => {
                    prop_assert!(ids.len() <= limits.skip_ids);
                    prop_assert!(set.len() <= ids.len());
                    prop_assert!(ids.iter().all(|i| Uuid::parse_str(i).is_ok()));
                }
                Err(status) => refused_well(&status)?,
            }
        }

        #[test]
        fn finish_takes_final_states_and_bounded_errors(state in hostile(), error in hostile()) {
            let limits = small();
            let final_state = TaskState::is_final_name(&state);
            match finish(state.clone(), error.clone(), &limits) {
                Ok(f) => {
                    prop_assert!(final_state);
                    prop_assert_eq!(f.state.as_str(), state);
                    prop_assert_eq!(f.error.is_some(), !error.is_empty());
                    prop_assert!(error.len() <= limits.error_bytes);
                }
                Err(status) => refused_well(&status)?,
            }
        }

        #[test]
        fn durations_are_never_negative(seconds in any::<i64>(), nanos in any::<i32>()) {
            let total = seconds as i128 * 1_000_000_000 + nanos as i128;
            match duration_or_zero("wait", Some(prost_types::Duration { seconds, nanos })) {
                Ok(d) => prop_assert_eq!(d.as_nanos() as i128, total),
                Err(status) => {
                    prop_assert!(total < 0, "{} refused", total);
                    refused_well(&status)?;
                }
            }
        }
    }

    #[test]
    fn a_megabyte_id_is_refused_with_a_short_message() {
        let status = parse_id("lease_id", &"x".repeat(1 << 20)).unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().len() < 120, "{}", status.message());
    }
}
