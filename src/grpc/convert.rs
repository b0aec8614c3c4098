//! proto <-> domain conversions. Every check on client input lives here, so a bad request is
//! refused before it reaches Redis or Postgres.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tonic::Status;
use uuid::Uuid;

use crate::dispatch::{Finish, Grant, FINAL_STATES};
use crate::leases::OpenLease;
use crate::proto;
use crate::ready::is_valid_release;

/// Parses a required id field.
pub fn parse_id(field: &str, value: &str) -> Result<Uuid, Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    Uuid::parse_str(value)
        .map_err(|_| Status::invalid_argument(format!("{field} {value:?} is not a UUID")))
}

/// A fencing token must be one the broker handed out (never 0).
pub fn fencing_token(token: u64) -> Result<u64, Status> {
    if token == 0 {
        return Err(Status::invalid_argument(
            "fencing_token is required: pass the token that came with the task",
        ));
    }
    Ok(token)
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

/// Validates OpenLease.
pub fn open_lease(request: proto::OpenLeaseRequest) -> Result<OpenLease, Status> {
    let worker_name = request.worker_name.trim().to_owned();
    if worker_name.is_empty() {
        return Err(Status::invalid_argument(
            "worker_name is required (e.g. \"1234@host\")",
        ));
    }
    let mut versions = BTreeMap::new();
    for (component, version) in request.versions {
        if component.is_empty() {
            return Err(Status::invalid_argument(
                "versions has an empty component name",
            ));
        }
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
    Ok(OpenLease {
        worker_name,
        versions,
        ttl,
        app_status_id,
    })
}

/// Validates FinishTask's state and error.
pub fn finish(state: String, error: String) -> Result<Finish, Status> {
    if !FINAL_STATES.contains(&state.as_str()) {
        return Err(Status::invalid_argument(format!(
            "state {state:?} is not a final state; use one of {}",
            FINAL_STATES.join(", ")
        )));
    }
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
            fencing_token: grant.fencing_token,
            immediate: grant.immediate,
            created_at: Some(to_timestamp(grant.created_at)),
        }
    }
}
