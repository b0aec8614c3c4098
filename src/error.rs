//! The broker's domain errors. `grpc` maps each to a gRPC status in one exhaustive match.

use uuid::Uuid;

use crate::{locks, tasks};

/// Why a broker operation did not happen.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed; the message says what to fix.
    #[error("{0}")]
    InvalidArgument(String),
    /// The lease is unknown or expired.
    #[error("lease {0} is unknown or expired; open a new lease with OpenLease (pass your app_status_id to keep tasks you are running)")]
    LeaseNotFound(String),
    /// The task does not exist.
    #[error("task {0} does not exist")]
    TaskNotFound(crate::ids::TaskId),
    /// The core_appstatus row named in OpenLease does not exist.
    #[error(
        "core_appstatus row {0} does not exist; pass an existing row or leave app_status_id empty"
    )]
    AppStatusNotFound(Uuid),
    /// An operator named a lease that does not exist (any more).
    #[error("no lease {0}: it was closed or swept already; `dispatch-broker leases --include-expired` lists the leases there are")]
    NoSuchLease(String),
    /// What was asked for is not there yet; the message says when to retry.
    #[error("{0}")]
    NotYet(String),
    /// No lock is held on the resource.
    #[error("no lock is held on {0}; `dispatch-broker locks` lists the held ones")]
    LockNotFound(String),
    /// An operator named a domain the broker does not know by that name.
    #[error("no domain named {0}: `dispatch-broker fairness` lists the domains the broker knows; name a domain by its pulp_id to set a rule for one it has not seen yet")]
    NoSuchDomain(String),
    /// An operator's action was refused because it would be unsafe; the message says why and
    /// what to do instead.
    #[error("{0}")]
    Refused(String),
    /// The caller does not hold what it acts on (wrong lease, stale fencing token, task moved on).
    #[error("{0}")]
    NotHolder(String),
    /// A limit that protects the service was reached; the message says which and what to do.
    #[error("{0}")]
    ResourceExhausted(String),
    /// Redis failed.
    #[error("lock store (redis) unavailable: {0}")]
    Redis(#[from] locks::Error),
    /// Postgres failed.
    #[error("task store (postgres) unavailable: {0}")]
    Postgres(#[from] tasks::Error),
    /// A bug: a background step panicked.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Result of a broker operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;
