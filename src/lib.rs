//! dispatch-broker: one central gRPC service that owns all lock state for a fleet of task workers.
//!
//! Workers open a lease, fetch or claim tasks (each grant locks the task's resources under that
//! lease and carries a fencing token), and release the locks when done. Tasks stay in PostgreSQL
//! (Pulp's `core_task`); locks and leases live in Redis and change only through the Lua scripts
//! in `lua/`. The readiness rule (`ready`) is pure and shared by everything that decides.
#![forbid(unsafe_code)]

pub mod admin;
pub mod cli;
pub mod config;
pub mod dispatch;
pub mod error;
pub mod grpc;
pub mod keda;
pub mod lanes;
pub mod leases;
pub mod locks;
pub mod metrics;
pub mod ready;
pub mod security;
pub mod server;
pub mod shutdown;
pub mod tasks;
pub mod testkit;
pub mod worker;

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
