//! The gRPC edge: tonic adapters only. Converts proto messages to domain requests (bad input
//! becomes INVALID_ARGUMENT with a message a person can act on, before anything changes), calls
//! `leases` and `dispatch`, and maps domain errors to statuses in one exhaustive match.

mod admin;
mod convert;

pub use admin::AdminService;

use tonic::codegen::http;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::config::LimitArgs;
use crate::dispatch::Dispatch;
use crate::error::Error;
use crate::ids::{LeaseId, TaskId};
use crate::leases::Leases;
use crate::proto;
use convert::{duration_or_zero, parse_id, to_timestamp};

/// Implements `dispatch.v1.Broker`.
#[derive(Clone)]
pub struct BrokerService {
    leases: Leases,
    dispatch: Dispatch,
    limits: LimitArgs,
}

impl BrokerService {
    /// Wraps the domain services.
    pub fn new(leases: Leases, dispatch: Dispatch, limits: LimitArgs) -> Self {
        BrokerService {
            leases,
            dispatch,
            limits,
        }
    }
}

impl From<Error> for Status {
    fn from(error: Error) -> Status {
        let message = error.to_string();
        match &error {
            Error::Redis(_) => crate::metrics::backend_error("redis"),
            Error::Postgres(_) => crate::metrics::backend_error("postgres"),
            _ => {}
        }
        match error {
            Error::InvalidArgument(_) => Status::invalid_argument(message),
            Error::LeaseNotFound(_) | Error::NoSuchLease(_) => not_found(message, NOT_FOUND_LEASE),
            Error::NotYet(_) => Status::unavailable(message),
            Error::TaskNotFound(_) => not_found(message, NOT_FOUND_TASK),
            Error::AppStatusNotFound(_) => not_found(message, NOT_FOUND_APP_STATUS),
            Error::LockNotFound(_) => not_found(message, NOT_FOUND_LOCK),
            Error::NoSuchDomain(_) => not_found(message, NOT_FOUND_DOMAIN),
            Error::NotHolder(_) | Error::Refused(_) => Status::failed_precondition(message),
            Error::ResourceExhausted(_) => Status::resource_exhausted(message),
            Error::Redis(e) if e.is_protocol() => Status::internal(message),
            Error::Redis(_) => Status::unavailable(message),
            Error::Postgres(e) if e.is_broker_fault() => Status::internal(message),
            Error::Postgres(_) => Status::unavailable(message),
            Error::Internal(_) => Status::internal(message),
        }
    }
}

/// The metadata key that says what a NOT_FOUND status did not find (`lease`, `task` or
/// `app-status`), so clients tell "open a new lease" from "no such task" without parsing text.
pub const NOT_FOUND_KEY: &str = "dispatch-not-found";
/// [`NOT_FOUND_KEY`]: the lease is unknown or expired.
pub const NOT_FOUND_LEASE: &str = "lease";
/// [`NOT_FOUND_KEY`]: the task does not exist.
pub const NOT_FOUND_TASK: &str = "task";
/// [`NOT_FOUND_KEY`]: no lock is held on the resource (ForceRelease).
pub const NOT_FOUND_LOCK: &str = "lock";
/// [`NOT_FOUND_KEY`]: no domain has the name given (SetFairness).
pub const NOT_FOUND_DOMAIN: &str = "domain";
/// [`NOT_FOUND_KEY`]: the core_appstatus row named in OpenLease does not exist.
pub const NOT_FOUND_APP_STATUS: &str = "app-status";

fn not_found(message: String, what: &'static str) -> Status {
    let mut status = Status::not_found(message);
    status.metadata_mut().insert(
        NOT_FOUND_KEY,
        tonic::metadata::MetadataValue::from_static(what),
    );
    status
}

fn rpc_span(method: &'static str) -> tracing::Span {
    tracing::info_span!(
        "rpc",
        method,
        lease_id = tracing::field::Empty,
        task_id = tracing::field::Empty
    )
}

#[tonic::async_trait]
impl proto::broker_server::Broker for BrokerService {
    async fn open_lease(
        &self,
        request: Request<proto::OpenLeaseRequest>,
    ) -> Result<Response<proto::Lease>, Status> {
        let span = rpc_span("OpenLease");
        let open = convert::open_lease(request.into_inner(), &self.limits)?;
        let lease = self.leases.open(open).instrument(span).await?;
        Ok(Response::new(proto::Lease {
            lease_id: lease.lease_id.to_string(),
            expires_at: Some(to_timestamp(lease.expires_at)),
            ttl: prost_types::Duration::try_from(lease.ttl).ok(),
            app_status_id: lease.app_status_id.to_string(),
            adopted_tasks: lease
                .adopted
                .into_iter()
                .map(|(task_id, fencing_token)| proto::HeldTask {
                    task_id,
                    fencing_token,
                })
                .collect(),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<proto::HeartbeatRequest>,
    ) -> Result<Response<proto::HeartbeatResponse>, Status> {
        let lease_id = LeaseId(parse_id("lease_id", &request.get_ref().lease_id)?);
        let undelivered = convert::undelivered(&request.get_ref().undelivered, &self.limits)?;
        let span = rpc_span("Heartbeat");
        span.record("lease_id", tracing::field::display(lease_id));
        let beat = self.leases.heartbeat(lease_id).instrument(span).await?;
        self.dispatch
            .return_undelivered(lease_id, beat.app_status, undelivered);
        Ok(Response::new(proto::HeartbeatResponse {
            expires_at: Some(to_timestamp(beat.expires_at)),
            cancel_task_ids: beat
                .cancel_task_ids
                .iter()
                .map(|id| id.to_string())
                .collect(),
            held_tasks: beat
                .held
                .iter()
                .map(|(task, token)| proto::HeldTask {
                    task_id: task.to_string(),
                    fencing_token: token.0,
                })
                .collect(),
        }))
    }

    async fn close_lease(
        &self,
        request: Request<proto::CloseLeaseRequest>,
    ) -> Result<Response<proto::CloseLeaseResponse>, Status> {
        let lease_id = LeaseId(parse_id("lease_id", &request.get_ref().lease_id)?);
        let span = rpc_span("CloseLease");
        span.record("lease_id", tracing::field::display(lease_id));
        let closed = self.leases.close(lease_id).instrument(span).await?;
        self.dispatch.forget_lease(lease_id);
        self.dispatch.wake();
        Ok(Response::new(proto::CloseLeaseResponse {
            released_locks: closed.released_locks,
            requeued_tasks: closed.requeued_tasks,
            failed_tasks: closed.failed_tasks,
        }))
    }

    async fn fetch_task(
        &self,
        request: Request<proto::FetchTaskRequest>,
    ) -> Result<Response<proto::FetchTaskResponse>, Status> {
        let request = request.into_inner();
        let lease_id = LeaseId(parse_id("lease_id", &request.lease_id)?);
        let wait = duration_or_zero("wait", request.wait)?;
        let skip = convert::skip_ids(&request.skip_task_ids, &self.limits)?;
        let span = rpc_span("FetchTask");
        span.record("lease_id", tracing::field::display(lease_id));
        let grant = self
            .dispatch
            .fetch(lease_id, wait, skip, request.start)
            .instrument(span)
            .await?;
        Ok(Response::new(proto::FetchTaskResponse {
            task: grant.map(proto::Task::from),
        }))
    }

    async fn claim_task(
        &self,
        request: Request<proto::ClaimTaskRequest>,
    ) -> Result<Response<proto::FetchTaskResponse>, Status> {
        let lease_id = LeaseId(parse_id("lease_id", &request.get_ref().lease_id)?);
        let task_id = TaskId(parse_id("task_id", &request.get_ref().task_id)?);
        let span = rpc_span("ClaimTask");
        span.record("lease_id", tracing::field::display(lease_id));
        span.record("task_id", tracing::field::display(task_id));
        let grant = self
            .dispatch
            .claim(lease_id, task_id)
            .instrument(span)
            .await?;
        Ok(Response::new(proto::FetchTaskResponse {
            task: grant.map(proto::Task::from),
        }))
    }

    async fn start_task(
        &self,
        request: Request<proto::StartTaskRequest>,
    ) -> Result<Response<proto::StartTaskResponse>, Status> {
        let r = request.get_ref();
        let lease_id = LeaseId(parse_id("lease_id", &r.lease_id)?);
        let task_id = TaskId(parse_id("task_id", &r.task_id)?);
        let token = convert::fencing_token(r.fencing_token)?;
        let span = rpc_span("StartTask");
        span.record("lease_id", tracing::field::display(lease_id));
        span.record("task_id", tracing::field::display(task_id));
        let started = self
            .dispatch
            .start(lease_id, task_id, token)
            .instrument(span)
            .await?;
        Ok(Response::new(proto::StartTaskResponse {
            started_at: Some(to_timestamp(started)),
        }))
    }

    async fn finish_task(
        &self,
        request: Request<proto::FinishTaskRequest>,
    ) -> Result<Response<proto::FinishTaskResponse>, Status> {
        let r = request.into_inner();
        let lease_id = LeaseId(parse_id("lease_id", &r.lease_id)?);
        let task_id = TaskId(parse_id("task_id", &r.task_id)?);
        let token = convert::fencing_token(r.fencing_token)?;
        let finish = convert::finish(r.state, r.error, &self.limits)?;
        let span = rpc_span("FinishTask");
        span.record("lease_id", tracing::field::display(lease_id));
        span.record("task_id", tracing::field::display(task_id));
        let (state, released) = self
            .dispatch
            .finish(lease_id, task_id, token, finish)
            .instrument(span)
            .await?;
        self.dispatch.wake();
        Ok(Response::new(proto::FinishTaskResponse { state, released }))
    }

    async fn release_locks(
        &self,
        request: Request<proto::ReleaseLocksRequest>,
    ) -> Result<Response<proto::ReleaseLocksResponse>, Status> {
        let r = request.get_ref();
        let lease_id = LeaseId(parse_id("lease_id", &r.lease_id)?);
        let task_id = TaskId(parse_id("task_id", &r.task_id)?);
        let token = convert::fencing_token(r.fencing_token)?;
        let span = rpc_span("ReleaseLocks");
        span.record("lease_id", tracing::field::display(lease_id));
        span.record("task_id", tracing::field::display(task_id));
        let released = self
            .dispatch
            .release(lease_id, task_id, token)
            .instrument(span)
            .await?;
        self.dispatch.wake();
        Ok(Response::new(proto::ReleaseLocksResponse { released }))
    }

    async fn cancel_task(
        &self,
        request: Request<proto::CancelTaskRequest>,
    ) -> Result<Response<proto::CancelTaskResponse>, Status> {
        let task_id = TaskId(parse_id("task_id", &request.get_ref().task_id)?);
        let span = rpc_span("CancelTask");
        span.record("task_id", tracing::field::display(task_id));
        let (state, holder_notified) = self.dispatch.cancel(task_id).instrument(span).await?;
        self.dispatch.wake();
        Ok(Response::new(proto::CancelTaskResponse {
            state: state.to_string(),
            holder_notified,
        }))
    }
}

/// Turns gRPC's "decoded message length too large" (`OUT_OF_RANGE` from tonic's decoder) into
/// `RESOURCE_EXHAUSTED`, the status gRPC gives an oversized request, with a message that names
/// the option. The request was refused before it was read: nothing changed.
#[derive(Debug, Clone, Copy)]
pub struct TooLargeLayer {
    /// `--max-message-bytes`.
    pub limit: usize,
}

impl<S> tower::Layer<S> for TooLargeLayer {
    type Service = TooLarge<S>;
    fn layer(&self, inner: S) -> TooLarge<S> {
        TooLarge {
            inner,
            limit: self.limit,
        }
    }
}

/// See [`TooLargeLayer`].
#[derive(Debug, Clone)]
pub struct TooLarge<S> {
    inner: S,
    limit: usize,
}

impl<S, B, RB> tower::Service<http::Request<B>> for TooLarge<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>> + Send,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let limit = self.limit;
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            let headers = response.headers();
            // (grpc-message is percent-encoded.)
            let out_of_range = headers.get("grpc-status").map(|v| v.as_bytes())
                == Some(b"11".as_slice())
                && headers.get("grpc-message").is_some_and(|m| {
                    String::from_utf8_lossy(m.as_bytes())
                        .replace("%20", " ")
                        .contains("decoded message length too large")
                });
            if out_of_range {
                let status = Status::resource_exhausted(format!(
                    "the request is larger than the broker accepts ({limit} bytes, \
                     --max-message-bytes); send less (fewer skip_task_ids, a shorter error text)"
                ));
                let replacement = status.into_http::<()>();
                for name in ["grpc-status", "grpc-message"] {
                    if let Some(value) = replacement.headers().get(name) {
                        response.headers_mut().insert(name, value.clone());
                    }
                }
            }
            Ok(response)
        })
    }
}
