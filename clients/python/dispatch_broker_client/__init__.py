"""Python client for dispatch-broker: a worker that leases, fetches, heartbeats and releases."""

from .worker import (
    BrokerError,
    CancelRequested,
    CancelResult,
    HeartbeatFailed,
    LeaseReopened,
    RetryPolicy,
    Task,
    TaskLost,
    TlsConfig,
    Worker,
    WorkerEvent,
)

__all__ = [
    "BrokerError",
    "CancelRequested",
    "CancelResult",
    "HeartbeatFailed",
    "LeaseReopened",
    "RetryPolicy",
    "Task",
    "TaskLost",
    "TlsConfig",
    "Worker",
    "WorkerEvent",
]
