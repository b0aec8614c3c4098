//! `dispatch_worker`: the worker side of dispatch-broker's lease protocol, for workers written in
//! Rust.
//!
//! [`Worker::connect`] opens a lease and keeps it alive with heartbeats (every TTL/3, jittered) in
//! a background task. [`Worker::next_task`] long-polls `FetchTask` and hands out a [`TaskGuard`]:
//! the task, its fencing token, a cancellation signal that fires when a heartbeat reply asks for
//! the task to be canceled (or when the task is lost), and `start` / `finish` / `release`. A guard
//! dropped without any of them releases the task's locks in the background and says so in the log.
//!
//! When the broker answers `NOT_FOUND` for the lease (it expired, was closed, or Redis lost its
//! state), the worker opens a new lease under the same `core_appstatus` row when it can, keeps the
//! tasks the broker hands back (`adopted_tasks`, with new fencing tokens), and reports every other
//! task it held as lost: its guard's cancellation fires, [`TaskGuard::is_lost`] turns true, and a
//! [`WorkerEvent::LeaseReopened`] lists it. Nothing is kept silently. A task being finished or
//! released when that happens is adopted the same way: its call goes through under the new
//! lease and token, or ends with [`WorkerError::Lost`].
//!
//! Every call carries a deadline (`call_timeout`, plus the wait of a long poll). `UNAVAILABLE` and
//! `RESOURCE_EXHAUSTED` are retried with jittered exponential backoff ([`RetryPolicy`]); no other
//! status is.
#![forbid(unsafe_code)]

mod retry;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

pub use retry::RetryPolicy;

use proto::broker_client::BrokerClient;

/// Generated protobuf and gRPC client code for `dispatch.v1.Broker` (from `proto/`).
pub mod proto {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("dispatch.v1");
}

/// The metadata key by which the broker says what a `NOT_FOUND` status did not find; the same as
/// the broker's `grpc::NOT_FOUND_KEY` (a test of the broker compares them).
pub const NOT_FOUND_KEY: &str = "dispatch-not-found";
/// [`NOT_FOUND_KEY`]: the lease is unknown or expired.
pub const NOT_FOUND_LEASE: &str = "lease";
/// [`NOT_FOUND_KEY`]: the `core_appstatus` row named in OpenLease does not exist.
pub const NOT_FOUND_APP_STATUS: &str = "app-status";

/// Gives the id of the `core_appstatus` row a worker uses instead of its own when that row is
/// gone ([`WorkerConfig::replace_app_status`]); an error is the reason it could not.
pub type ReplaceAppStatus = Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = Result<String, String>> + Send>>
        + Send
        + Sync,
>;

type Client = BrokerClient<InterceptedService<Channel, Auth>>;

/// How a worker presents itself to the broker.
#[derive(Clone)]
pub struct WorkerConfig {
    /// The worker's name, e.g. `1234@host` (stored in `core_appstatus.name`).
    pub name: String,
    /// Component versions (e.g. `core` -> `3.123.1`); only tasks these satisfy are handed out.
    pub versions: BTreeMap<String, String>,
    /// Lease time to live; heartbeats go out every third of it.
    pub ttl: Duration,
    /// Bearer token sent as `authorization: Bearer <token>` on every call, when set.
    pub token: Option<String>,
    /// TLS to the broker (CA, server name, and a client identity for mutual TLS); `None` for
    /// plaintext (`http://` endpoints).
    pub tls: Option<tonic::transport::ClientTlsConfig>,
    /// The worker's own `core_appstatus` row (a Pulp worker passes its own); `None` lets the
    /// broker create one per lease.
    pub app_status_id: Option<String>,
    /// When the worker's own row (`app_status_id`) is gone at a reopen (Pulp's clean-up of
    /// missing processes deleted it), gives the row to use instead (one it wrote again, or a new
    /// one); `None`: the reopen fails with `NOT_FOUND` (`app-status`).
    pub replace_app_status: Option<ReplaceAppStatus>,
    /// Deadline of each call (a long poll gets its wait on top).
    pub call_timeout: Duration,
    /// Backoff for `UNAVAILABLE` and `RESOURCE_EXHAUSTED`.
    pub retry: RetryPolicy,
    /// How long [`Worker::run`] lets a running task finish after shutdown is signalled.
    pub shutdown_grace: Duration,
}

impl std::fmt::Debug for WorkerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerConfig")
            .field("name", &self.name)
            .field("versions", &self.versions)
            .field("ttl", &self.ttl)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("tls", &self.tls)
            .field("app_status_id", &self.app_status_id)
            .field("replace_app_status", &self.replace_app_status.is_some())
            .field("call_timeout", &self.call_timeout)
            .field("retry", &self.retry)
            .field("shutdown_grace", &self.shutdown_grace)
            .finish()
    }
}

impl WorkerConfig {
    /// Defaults: 30 s TTL, 10 s call deadline, 30 s shutdown grace, no token, no versions.
    pub fn new(name: impl Into<String>) -> Self {
        WorkerConfig {
            name: name.into(),
            versions: BTreeMap::new(),
            ttl: Duration::from_secs(30),
            token: None,
            tls: None,
            app_status_id: None,
            replace_app_status: None,
            call_timeout: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// What went wrong in a worker call.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The endpoint is not a valid URI.
    #[error("invalid broker endpoint {endpoint:?}: {reason}")]
    Endpoint {
        /// What was given.
        endpoint: String,
        /// Why it is not valid.
        reason: String,
    },
    /// The token cannot be sent as an HTTP header.
    #[error("the token contains characters that cannot be sent in a header")]
    Token,
    /// The broker answered with an error status (after retries, for `UNAVAILABLE` and `RESOURCE_EXHAUSTED`).
    #[error("{method} failed: {code:?}: {message}", code = status.code(), message = status.message())]
    Rpc {
        /// The RPC.
        method: &'static str,
        /// The broker's answer.
        status: Status,
    },
    /// The task is no longer this worker's (its lease ended and no new lease took it over).
    #[error("task {task_id} is lost: the lease that held it ended; do not record its results")]
    Lost {
        /// The task.
        task_id: String,
    },
    /// The worker is shutting down or closed.
    #[error("the worker is shutting down")]
    ShuttingDown,
    /// The worker's own `core_appstatus` row is gone and
    /// [`WorkerConfig::replace_app_status`] could not give another.
    #[error("the worker's core_appstatus row {app_status_id} is gone and no other could be had: {reason}")]
    AppStatusReplacement {
        /// The row that is gone.
        app_status_id: String,
        /// Why no other could be had.
        reason: String,
    },
}

impl WorkerError {
    /// The gRPC status code, for RPC errors.
    pub fn code(&self) -> Option<Code> {
        match self {
            WorkerError::Rpc { status, .. } => Some(status.code()),
            _ => None,
        }
    }

    /// True when the broker said the lease is unknown or expired.
    pub fn is_lease_not_found(&self) -> bool {
        match self {
            WorkerError::Rpc { status, .. } => is_lease_not_found(status),
            _ => false,
        }
    }

    /// True when the broker said the `core_appstatus` row named in OpenLease does not exist.
    pub fn is_app_status_not_found(&self) -> bool {
        match self {
            WorkerError::Rpc { status, .. } => not_found(status, NOT_FOUND_APP_STATUS),
            _ => false,
        }
    }
}

/// A mutex's value even if a panicking thread poisoned it (the data stays consistent: every
/// critical section here is a single insert, remove or copy).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn is_lease_not_found(status: &Status) -> bool {
    not_found(status, NOT_FOUND_LEASE)
}

/// Whether `status` is a NOT_FOUND for `what` ([`NOT_FOUND_KEY`]).
fn not_found(status: &Status, what: &str) -> bool {
    status.code() == Code::NotFound
        && status
            .metadata()
            .get(NOT_FOUND_KEY)
            .is_some_and(|v| v == what)
}

/// Things a worker's owner may want to know about, from [`Worker::events`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerEvent {
    /// The broker no longer knew the lease; a new one replaced it.
    LeaseReopened {
        /// The lease that ended.
        old_lease_id: String,
        /// The lease now in use.
        new_lease_id: String,
        /// Tasks held under the old lease that the new one took over (new fencing tokens).
        adopted_tasks: Vec<String>,
        /// Tasks held under the old lease that are no longer this worker's.
        lost_tasks: Vec<String>,
    },
    /// A heartbeat reply asked for this held task to be canceled.
    CancelRequested {
        /// The task.
        task_id: String,
    },
    /// A heartbeat failed (the lease lives on until its TTL runs out).
    HeartbeatFailed {
        /// What went wrong.
        error: String,
    },
}

/// Adds the bearer token to every call.
#[derive(Clone)]
pub struct Auth {
    header: Option<MetadataValue<Ascii>>,
}

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(header) = &self.header {
            request
                .metadata_mut()
                .insert("authorization", header.clone());
        }
        Ok(request)
    }
}

/// One held task's state, shared by its guard and the heartbeat loop.
#[derive(Debug)]
struct Held {
    token: AtomicU64,
    cancel: CancellationToken,
    lost: AtomicBool,
    /// Left to the lease's end (shutdown grace ran out): dropping the guard releases nothing,
    /// so closing the lease fails the task instead of leaving it running without a lock.
    detached: AtomicBool,
    /// StartTask succeeded: the task runs, so a dropped guard fails it instead of releasing it
    /// (the broker keeps a running task's locks until its final state is recorded).
    started: AtomicBool,
}

#[derive(Debug, Clone)]
struct LeaseState {
    lease_id: String,
    app_status_id: String,
    ttl: Duration,
    generation: u64,
}

struct Shared {
    client: Client,
    config: WorkerConfig,
    /// The worker's own row, to reopen under: `config.app_status_id`, or the row
    /// `config.replace_app_status` gave once that one was gone.
    own_row: Mutex<Option<String>>,
    lease: Mutex<LeaseState>,
    reopening: tokio::sync::Mutex<()>,
    held: Mutex<HashMap<String, Arc<Held>>>,
    /// Tasks being let go (finished or released, in the foreground or retried in the background):
    /// a reopened lease that adopts one gives it its new token, so the call goes through under it.
    ending: Mutex<Vec<(String, Arc<Held>)>>,
    /// Undelivered grants: what the heartbeats find of them (see [`Undelivered`]).
    undelivered: Mutex<Undelivered>,
    events: broadcast::Sender<WorkerEvent>,
    /// Fires when the worker stops fetching (shutdown began).
    stopping: CancellationToken,
    /// Fires when the lease is closed: the heartbeat loop ends.
    closed: CancellationToken,
    /// Fires when closing began: no lease is reopened from then on.
    closing: CancellationToken,
}

/// A connected worker with a live lease. Cheap to clone; every clone shares the lease.
#[derive(Clone)]
pub struct Worker {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("name", &self.shared.config.name)
            .field("lease", &self.shared.current())
            .finish()
    }
}

impl Worker {
    /// Connects to the broker at `endpoint` (e.g. `http://127.0.0.1:50051`), opens a lease and
    /// starts heartbeating. Retries `UNAVAILABLE` (a broker still starting) and `RESOURCE_EXHAUSTED` per `config.retry`.
    pub async fn connect(
        endpoint: impl Into<String>,
        config: WorkerConfig,
    ) -> Result<Worker, WorkerError> {
        let endpoint = endpoint.into();
        let mut builder =
            Channel::from_shared(endpoint.clone()).map_err(|e| WorkerError::Endpoint {
                endpoint: endpoint.clone(),
                reason: e.to_string(),
            })?;
        if let Some(tls) = config.tls.clone() {
            builder = builder.tls_config(tls).map_err(|e| WorkerError::Endpoint {
                endpoint: endpoint.clone(),
                reason: format!("TLS settings: {e}"),
            })?;
        }
        let channel = builder
            .connect_timeout(config.call_timeout)
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_while_idle(true)
            .connect_lazy();
        let header = match &config.token {
            Some(token) => Some(
                format!("Bearer {token}")
                    .parse()
                    .map_err(|_| WorkerError::Token)?,
            ),
            None => None,
        };
        let client = BrokerClient::with_interceptor(channel, Auth { header })
            .max_decoding_message_size(16 * 1024 * 1024);
        let (events, _) = broadcast::channel(256);
        let shared = Arc::new(Shared {
            client,
            lease: Mutex::new(LeaseState {
                lease_id: String::new(),
                app_status_id: config.app_status_id.clone().unwrap_or_default(),
                ttl: config.ttl,
                generation: 0,
            }),
            own_row: Mutex::new(config.app_status_id.clone()),
            config,
            reopening: tokio::sync::Mutex::new(()),
            held: Mutex::new(HashMap::new()),
            ending: Mutex::new(Vec::new()),
            undelivered: Mutex::new(Undelivered::default()),
            events,
            stopping: CancellationToken::new(),
            closed: CancellationToken::new(),
            closing: CancellationToken::new(),
        });
        let lease = shared
            .open_lease(shared.config.app_status_id.clone())
            .await?;
        shared.install(lease);
        tokio::spawn(heartbeat_loop(Arc::clone(&shared)));
        Ok(Worker { shared })
    }

    /// The lease in use now (it changes when the worker reopens one).
    pub fn lease_id(&self) -> String {
        self.shared.current().lease_id
    }

    /// The `core_appstatus` row the lease claims tasks for.
    pub fn app_status_id(&self) -> String {
        self.shared.current().app_status_id
    }

    /// Subscribes to [`WorkerEvent`]s (from now on).
    pub fn events(&self) -> broadcast::Receiver<WorkerEvent> {
        self.shared.events.subscribe()
    }

    /// Fires when shutdown began (see [`Worker::stop`]); fetches return no task from then on.
    pub fn stopping(&self) -> CancellationToken {
        self.shared.stopping.clone()
    }

    /// Stops fetching: waiting and later [`Worker::next_task`] calls return `None`. Held tasks
    /// are unaffected; [`Worker::close`] ends the lease.
    pub fn stop(&self) {
        self.shared.stopping.cancel();
    }

    /// Waits up to `wait` for the oldest ready task this worker may run, locked and claimed
    /// under its lease. `None` when nothing became ready in time or the worker is stopping.
    pub async fn next_task(&self, wait: Duration) -> Result<Option<TaskGuard>, WorkerError> {
        self.next_task_skipping(wait, &[]).await
    }

    /// [`Worker::next_task`], never handing out the tasks in `skip`.
    pub async fn next_task_skipping(
        &self,
        wait: Duration,
        skip: &[String],
    ) -> Result<Option<TaskGuard>, WorkerError> {
        self.fetch(wait, skip, false).await
    }

    /// [`Worker::next_task`], with the task started by its grant (`FetchTaskRequest.start`): one
    /// call instead of FetchTask and StartTask, for a worker that runs what it fetches at once.
    /// The task counts as running from the grant: if the lease ends before it is finished it is
    /// failed, not requeued. [`TaskGuard::start`] on it makes no call.
    pub async fn next_task_started(
        &self,
        wait: Duration,
    ) -> Result<Option<TaskGuard>, WorkerError> {
        self.fetch(wait, &[], true).await
    }

    async fn fetch(
        &self,
        wait: Duration,
        skip: &[String],
        start: bool,
    ) -> Result<Option<TaskGuard>, WorkerError> {
        let stopping = self.shared.stopping.clone();
        if stopping.is_cancelled() {
            return Ok(None);
        }
        let fetch = self
            .shared
            .with_lease("FetchTask", wait, |mut client, lease_id| {
                let request = proto::FetchTaskRequest {
                    lease_id,
                    wait: prost_types::Duration::try_from(wait).ok(),
                    skip_task_ids: skip.to_vec(),
                    start,
                };
                async move { client.fetch_task(request).await }
            });
        // Giving up a long poll at shutdown drops the call; the broker undoes a grant whose
        // caller went away, so nothing is left held.
        let (response, generation) = tokio::select! {
            response = fetch => response?,
            _ = stopping.cancelled() => return Ok(None),
        };
        Ok(response.task.and_then(|task| self.guard(task, generation)))
    }

    /// Immediate dispatch: locks and claims exactly `task_id` if it is ready now.
    pub async fn claim(&self, task_id: &str) -> Result<Option<TaskGuard>, WorkerError> {
        let (response, generation) = self
            .shared
            .with_lease("ClaimTask", Duration::ZERO, |mut client, lease_id| {
                let request = proto::ClaimTaskRequest {
                    lease_id,
                    task_id: task_id.to_owned(),
                };
                async move { client.claim_task(request).await }
            })
            .await?;
        Ok(response.task.and_then(|task| self.guard(task, generation)))
    }

    /// Cancels any task (waiting: canceled at once; running: its holder is told).
    pub async fn cancel(&self, task_id: &str) -> Result<proto::CancelTaskResponse, WorkerError> {
        let request = proto::CancelTaskRequest {
            task_id: task_id.to_owned(),
        };
        self.shared
            .call(
                "CancelTask",
                Duration::ZERO,
                self.shared.config.retry,
                |mut c| {
                    let request = request.clone();
                    async move { c.cancel_task(request).await }
                },
            )
            .await
    }

    /// Runs tasks one at a time with `handler` until `shutdown` completes: then stops fetching,
    /// lets the running task finish within `shutdown_grace`, and closes the lease (which fails a
    /// task still running after the grace). The handler owns each [`TaskGuard`] and should
    /// `start` and `finish` (or `release`) it. Returns the number of tasks handled.
    pub async fn run<H, Fut>(
        self,
        mut handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<u64, WorkerError>
    where
        H: FnMut(TaskGuard) -> Fut,
        Fut: Future<Output = ()>,
    {
        let stopping = self.stopping();
        let grace = self.shared.config.shutdown_grace;
        let mut shutdown = std::pin::pin!(shutdown);
        let mut handled = 0u64;
        let result = loop {
            let next = tokio::select! {
                _ = &mut shutdown => { self.stop(); break Ok(()) }
                next = self.next_task(Duration::from_secs(30)) => next,
            };
            let guard = match next {
                Ok(Some(guard)) => guard,
                Ok(None) if stopping.is_cancelled() => break Ok(()),
                Ok(None) => continue,
                Err(e) => break Err(e),
            };
            handled += 1;
            let task_id = guard.id().to_owned();
            let mut running = std::pin::pin!(handler(guard));
            tokio::select! {
                _ = &mut running => continue,
                _ = &mut shutdown => {}
            }
            self.stop();
            tracing::info!(%task_id, ?grace, "shutting down: letting the running task finish");
            if tokio::time::timeout(grace, &mut running).await.is_err() {
                tracing::warn!(%task_id, "the task did not finish within the grace period; closing the lease fails it");
                if let Some(held) = lock(&self.shared.held).get(&task_id) {
                    held.detached.store(true, Ordering::SeqCst);
                }
            }
            break Ok(());
        };
        self.stop();
        let closed = self.close().await;
        result.and(closed.map(|_| handled))
    }

    /// Ends the lease (CloseLease): the broker releases its locks, requeues claimed tasks that
    /// did not start and fails those still running. Heartbeats stop.
    pub async fn close(&self) -> Result<proto::CloseLeaseResponse, WorkerError> {
        self.stop();
        self.shared.closing.cancel();
        // A reopen under way finishes first, so the lease closed below is the last one.
        drop(self.shared.reopening.lock().await);
        let lease_id = self.lease_id();
        let result = self
            .shared
            .call(
                "CloseLease",
                Duration::ZERO,
                self.shared.config.retry,
                |mut c| {
                    let request = proto::CloseLeaseRequest {
                        lease_id: lease_id.clone(),
                    };
                    async move { c.close_lease(request).await }
                },
            )
            .await;
        self.shared.closed.cancel();
        let held: Vec<Arc<Held>> = self
            .shared
            .held
            .lock()
            .unwrap()
            .drain()
            .map(|e| e.1)
            .collect();
        for h in held {
            h.lost.store(true, Ordering::SeqCst);
            h.cancel.cancel();
        }
        for (_, h) in lock(&self.shared.ending).drain(..) {
            h.lost.store(true, Ordering::SeqCst);
        }
        match result {
            Err(e) if e.is_lease_not_found() => Ok(proto::CloseLeaseResponse::default()),
            other => other,
        }
    }

    /// A guard for a grant made under the lease of `generation`: lost at once if the lease was
    /// replaced while the call was under way (the replacement could not have adopted it); none
    /// when a heartbeat already handed the grant back as undelivered (the broker requeues it:
    /// running it here too could run it twice).
    fn guard(&self, task: proto::Task, generation: u64) -> Option<TaskGuard> {
        if !lock(&self.shared.undelivered).received(&task.task_id, task.fencing_token) {
            tracing::warn!(task_id = %task.task_id, "a grant arrived after it was handed back as undelivered; it is not run here");
            return None;
        }
        let held_map = lock(&self.shared.held);
        let lost = self.shared.current().generation != generation;
        let held = Arc::new(Held {
            token: AtomicU64::new(task.fencing_token),
            cancel: CancellationToken::new(),
            lost: AtomicBool::new(lost),
            detached: AtomicBool::new(false),
            started: AtomicBool::new(task.started_at.is_some()),
        });
        if lost {
            held.cancel.cancel();
            tracing::warn!(task_id = %task.task_id, "a grant arrived under a lease that was replaced meanwhile; the task is lost");
        }
        let mut held_map = held_map;
        if !lost {
            held_map.insert(task.task_id.clone(), Arc::clone(&held));
        }
        drop(held_map);
        Some(TaskGuard {
            task,
            held,
            shared: Arc::clone(&self.shared),
            done: false,
        })
    }
}

impl Shared {
    fn current(&self) -> LeaseState {
        lock(&self.lease).clone()
    }

    fn emit(&self, event: WorkerEvent) {
        let _ = self.events.send(event);
    }

    /// One RPC with a deadline, retrying what [`retry::retryable`] names per `policy`.
    async fn call<T, F, Fut>(
        &self,
        method: &'static str,
        wait: Duration,
        policy: RetryPolicy,
        f: F,
    ) -> Result<T, WorkerError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.call_retrying(method, wait, policy, retry::retryable, f)
            .await
    }

    /// [`Shared::call`], retrying the codes `retried` names.
    async fn call_retrying<T, F, Fut>(
        &self,
        method: &'static str,
        wait: Duration,
        policy: RetryPolicy,
        retried: fn(Code) -> bool,
        mut f: F,
    ) -> Result<T, WorkerError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = self.config.call_timeout + wait;
        let mut attempt = 0;
        // The budget counts from the first try: tries that wait for their deadline spend it too.
        let began = tokio::time::Instant::now();
        loop {
            let status = match tokio::time::timeout(deadline, f(self.client.clone())).await {
                Ok(Ok(response)) => return Ok(response.into_inner()),
                Ok(Err(status)) => status,
                Err(_) => Status::deadline_exceeded(format!(
                    "no answer within {deadline:?} (call_timeout plus the wait)"
                )),
            };
            if !retried(status.code()) || self.closed.is_cancelled() {
                return Err(WorkerError::Rpc { method, status });
            }
            let Some(delay) = policy.delay(attempt, began.elapsed(), rand::random()) else {
                return Err(WorkerError::Rpc { method, status });
            };
            tracing::debug!(method, attempt, ?delay, error = %status.message(), "broker unavailable; retrying");
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    /// A call made with the current lease id; when the broker no longer knows the lease, opens a
    /// new one (once) and makes the call again.
    async fn with_lease<T, F, Fut>(
        &self,
        method: &'static str,
        wait: Duration,
        f: F,
    ) -> Result<(T, u64), WorkerError>
    where
        F: FnMut(Client, String) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.with_lease_retrying(method, wait, retry::retryable, || Ok(()), f)
            .await
    }

    /// [`Shared::with_lease`], retrying the codes `retried`, with `check` before each call (also
    /// the one after a reopen): its error ends the call instead.
    async fn with_lease_retrying<T, F, Fut>(
        &self,
        method: &'static str,
        wait: Duration,
        retried: fn(Code) -> bool,
        check: impl Fn() -> Result<(), WorkerError>,
        mut f: F,
    ) -> Result<(T, u64), WorkerError>
    where
        F: FnMut(Client, String) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut reopened = false;
        loop {
            check()?;
            let lease = self.current();
            match self
                .call_retrying(method, wait, self.config.retry, retried, |c| {
                    f(c, lease.lease_id.clone())
                })
                .await
                .map(|reply| (reply, lease.generation))
            {
                Err(e) if e.is_lease_not_found() && !reopened && !self.closing.is_cancelled() => {
                    self.reopen(lease.generation, method).await?;
                    reopened = true;
                }
                other => return other,
            }
        }
    }

    async fn open_lease(&self, app_status_id: Option<String>) -> Result<proto::Lease, WorkerError> {
        let request = proto::OpenLeaseRequest {
            worker_name: self.config.name.clone(),
            versions: self.config.versions.clone().into_iter().collect(),
            ttl: prost_types::Duration::try_from(self.config.ttl).ok(),
            app_status_id: app_status_id.unwrap_or_default(),
            // One id for this open and its retries: a retry after a lost answer gets the lease
            // the first call opened (and the tasks it adopted), not a second one.
            open_id: uuid::Uuid::new_v4().to_string(),
        };
        // Also retried when no answer came: the same open id gets the same lease.
        self.call_retrying(
            "OpenLease",
            Duration::ZERO,
            self.config.retry,
            retry::repeatable,
            |mut c| {
                let request = request.clone();
                async move { c.open_lease(request).await }
            },
        )
        .await
    }

    fn install(&self, lease: proto::Lease) -> LeaseState {
        let ttl = lease
            .ttl
            .and_then(|t| Duration::try_from(t).ok())
            .unwrap_or(self.config.ttl);
        let mut current = lock(&self.lease);
        *current = LeaseState {
            lease_id: lease.lease_id,
            app_status_id: lease.app_status_id,
            ttl,
            generation: current.generation + 1,
        };
        current.clone()
    }

    /// Replaces the lease the broker no longer knows (unless another caller already did since
    /// `seen_generation`). Tries the same `core_appstatus` row first, so tasks the broker rebuilt
    /// after losing Redis come back; every other held task is reported lost.
    async fn reopen(&self, seen_generation: u64, why: &str) -> Result<(), WorkerError> {
        let _one_at_a_time = self.reopening.lock().await;
        let old = self.current();
        if old.generation != seen_generation {
            return Ok(());
        }
        if self.closing.is_cancelled() {
            return Err(WorkerError::ShuttingDown);
        }
        // Only the worker's own (configured) row is reused: a row the broker made belongs to the
        // old lease until the sweeper ends it, and ending it requeues or fails every task claimed
        // for that row and deletes it, so a new lease on it would lose its tasks.
        let own_row = lock(&self.own_row).clone();
        let lease = match self.open_lease(own_row.clone()).await {
            Ok(lease) => lease,
            Err(e) if e.is_app_status_not_found() && own_row.is_some() => {
                let Some(replace) = self.config.replace_app_status.clone() else {
                    return Err(e);
                };
                let replacement =
                    replace()
                        .await
                        .map_err(|reason| WorkerError::AppStatusReplacement {
                            app_status_id: own_row.clone().unwrap_or_default(),
                            reason,
                        })?;
                tracing::warn!(
                    gone = own_row.as_deref().unwrap_or_default(),
                    replacement = %replacement,
                    why,
                    "the worker's core_appstatus row is gone; opening a new lease with another"
                );
                *lock(&self.own_row) = Some(replacement.clone());
                self.open_lease(Some(replacement)).await?
            }
            Err(e) => return Err(e),
        };
        let adopted: HashMap<String, u64> = lease
            .adopted_tasks
            .iter()
            .map(|t| (t.task_id.clone(), t.fencing_token))
            .collect();
        let (mut adopted_tasks, mut lost_tasks) = (Vec::new(), Vec::new());
        // Tokens are updated before the new lease is installed: a call made in between goes out
        // under the old lease with the new token, is told NOT_FOUND and made again once this
        // reopen is done, never under the new lease with the old token (refused for good).
        let new = {
            let mut held = lock(&self.held);
            held.retain(|task_id, h| match adopted.get(task_id) {
                Some(token) => {
                    h.token.store(*token, Ordering::SeqCst);
                    adopted_tasks.push(task_id.clone());
                    true
                }
                None => {
                    h.lost.store(true, Ordering::SeqCst);
                    h.cancel.cancel();
                    lost_tasks.push(task_id.clone());
                    false
                }
            });
            // Tasks being finished or released: the call goes on under the new token, or ends
            // as lost (the broker ended the task with the old lease, or it finished already).
            // A task also held is a newer grant of it: the call letting go of the old one is
            // stale and must not act under the new grant's token.
            for (task_id, h) in lock(&self.ending).iter() {
                let token = adopted.get(task_id).filter(|_| !held.contains_key(task_id));
                let (took, list) = match token {
                    Some(token) => {
                        h.token.store(*token, Ordering::SeqCst);
                        (true, &mut adopted_tasks)
                    }
                    None => {
                        h.lost.store(true, Ordering::SeqCst);
                        (false, &mut lost_tasks)
                    }
                };
                if !list.contains(task_id) {
                    list.push(task_id.clone());
                }
                tracing::debug!(%task_id, adopted = took, "a task being let go under the old lease");
            }
            self.install(lease)
        };
        // The adopted tasks this worker still has (held, or being finished or released) are
        // received under their new tokens; any other the new lease adopted is a grant that never
        // arrived, or one this worker no longer runs (see `Undelivered`): handed back.
        {
            let mut undelivered = lock(&self.undelivered);
            for task_id in &adopted_tasks {
                undelivered.received(task_id, adopted[task_id]);
            }
        }
        tracing::warn!(
            old_lease = %old.lease_id,
            new_lease = %new.lease_id,
            why,
            adopted = ?adopted_tasks,
            lost = ?lost_tasks,
            "the broker no longer knew the lease; opened a new one"
        );
        self.emit(WorkerEvent::LeaseReopened {
            old_lease_id: old.lease_id,
            new_lease_id: new.lease_id,
            adopted_tasks,
            lost_tasks,
        });
        Ok(())
    }

    async fn heartbeat(&self) -> Result<(), WorkerError> {
        let lease = self.current();
        // Retry only within a third of the TTL: the next beat comes after that anyway.
        let policy = self.config.retry.within(lease.ttl / 3);
        let undelivered = lock(&self.undelivered).due_now(lease.generation);
        let sent = Instant::now();
        let result = self
            .call("Heartbeat", Duration::ZERO, policy, |mut c| {
                let request = proto::HeartbeatRequest {
                    lease_id: lease.lease_id.clone(),
                    undelivered: undelivered.clone(),
                };
                async move { c.heartbeat(request).await }
            })
            .await;
        match result {
            Ok(reply) => {
                if !undelivered.is_empty() {
                    for h in &undelivered {
                        tracing::warn!(task_id = %h.task_id, "the broker holds a grant for this worker that never arrived; handed back");
                    }
                    lock(&self.undelivered).reported(&undelivered);
                }
                let held = lock(&self.held);
                lock(&self.undelivered).listed(&reply.held_tasks, lease.generation, sent);
                for task_id in reply.cancel_task_ids {
                    if let Some(h) = held.get(&task_id) {
                        if !h.cancel.is_cancelled() {
                            tracing::info!(%task_id, "cancel requested");
                            h.cancel.cancel();
                            self.emit(WorkerEvent::CancelRequested { task_id });
                        }
                    }
                }
                Ok(())
            }
            Err(e) if e.is_lease_not_found() => self.reopen(lease.generation, "Heartbeat").await,
            Err(e) => Err(e),
        }
    }
}

/// Grants the broker made for this worker that never arrived (the answer was lost with a
/// replica or a connection): the lease holds them, so nothing else may run them, and nobody here
/// runs them. A task the heartbeats list as held that this worker never received, in two
/// heartbeats in a row (an answer on its way arrives well within a heartbeat's period), is one:
/// the next heartbeat hands it back (`HeartbeatRequest.undelivered`), and the following ones do
/// again while the heartbeats still list it (the broker acts once, and only on the grant under
/// its token: it requeues the task, then releases its locks). Once a grant is handed back, an answer bringing it
/// after all is not run; one that arrives before that takes it off the list.
#[derive(Debug, Default)]
struct Undelivered {
    /// Grants received under this worker's leases (task and fencing token), with when: kept
    /// while a heartbeat lists them, and until one sent after they arrived.
    received: HashMap<(String, u64), Instant>,
    /// Listed and never received at the last heartbeat, with the fencing token and the lease
    /// generation they were listed under.
    suspects: HashMap<String, (u64, u64)>,
    /// To hand back with the next heartbeat, with the lease generation.
    due: Vec<(proto::HeldTask, u64)>,
    /// Handed back (or being handed back): the grant's fencing token, and when (kept for
    /// [`HANDED_BACK_FOR`]). The same task granted again has a new token.
    handed_back: HashMap<String, (u64, Instant)>,
}

/// How long a handed-back grant is remembered, so that its answer, if it arrives after all, is
/// not run (an answer is never delayed anywhere near this long).
const HANDED_BACK_FOR: Duration = Duration::from_secs(3600);

/// Most grants handed back by one heartbeat (the broker refuses more than `--max-skip-ids`,
/// 1,000 by default); the rest go with the next ones.
const HAND_BACK_AT_ONCE: usize = 100;

impl Undelivered {
    /// Notes a grant that arrived; false when it was handed back already (it must not run here).
    fn received(&mut self, task_id: &str, token: u64) -> bool {
        let now = Instant::now();
        self.handed_back
            .retain(|_, (_, at)| now.duration_since(*at) < HANDED_BACK_FOR);
        if self
            .handed_back
            .get(task_id)
            .is_some_and(|(t, _)| *t == token)
        {
            return false;
        }
        // Arrived late but before its hand-back: it is this worker's after all.
        self.suspects.remove(task_id);
        self.due.retain(|(h, _)| h.task_id != task_id);
        self.received.insert((task_id.to_owned(), token), now);
        true
    }

    /// What a heartbeat sent at `sent` listed as held under the lease of `generation`.
    fn listed(&mut self, held: &[proto::HeldTask], generation: u64, sent: Instant) {
        // A grant received before the heartbeat was sent and not listed was let go (finished or
        // released): it is never listed again under that token.
        self.received.retain(|(task_id, token), at| {
            *at >= sent
                || held
                    .iter()
                    .any(|h| h.task_id == *task_id && h.fencing_token == *token)
        });
        let mut suspects = HashMap::new();
        for h in held {
            if self
                .received
                .contains_key(&(h.task_id.clone(), h.fencing_token))
            {
                continue;
            }
            let handed_back = self
                .handed_back
                .get(&h.task_id)
                .is_some_and(|(t, _)| *t == h.fencing_token);
            let twice = self.suspects.get(&h.task_id) == Some(&(h.fencing_token, generation));
            if handed_back || twice {
                if !self.due.iter().any(|(d, _)| d.task_id == h.task_id) {
                    self.due.push((h.clone(), generation));
                }
            } else {
                suspects.insert(h.task_id.clone(), (h.fencing_token, generation));
            }
        }
        self.suspects = suspects;
    }

    /// The grants to hand back with a heartbeat of the lease of `generation`; from now on an
    /// answer bringing one of them is not run.
    fn due_now(&mut self, generation: u64) -> Vec<proto::HeldTask> {
        self.due.retain(|(_, g)| *g == generation);
        let now = Instant::now();
        let out: Vec<proto::HeldTask> = self
            .due
            .iter()
            .take(HAND_BACK_AT_ONCE)
            .map(|(h, _)| h.clone())
            .collect();
        for h in &out {
            self.handed_back
                .insert(h.task_id.clone(), (h.fencing_token, now));
        }
        out
    }

    /// The broker has these (it acts on them after answering).
    fn reported(&mut self, handed_back: &[proto::HeldTask]) {
        self.due
            .retain(|(h, _)| !handed_back.iter().any(|r| r.task_id == h.task_id));
    }
}

async fn heartbeat_loop(shared: Arc<Shared>) {
    loop {
        let ttl = shared.current().ttl;
        let period = retry::jitter(ttl / 3, rand::random());
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = shared.closed.cancelled() => return,
        }
        if let Err(e) = shared.heartbeat().await {
            if shared.closed.is_cancelled() {
                return;
            }
            tracing::warn!(error = %e, "heartbeat failed");
            shared.emit(WorkerEvent::HeartbeatFailed {
                error: e.to_string(),
            });
        }
    }
}

/// A task this worker holds: its locks stay held until `finish`, `release`, or drop (which
/// releases in the background).
pub struct TaskGuard {
    task: proto::Task,
    held: Arc<Held>,
    shared: Arc<Shared>,
    done: bool,
}

impl std::fmt::Debug for TaskGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskGuard")
            .field("task_id", &self.task.task_id)
            .field("fencing_token", &self.fencing_token())
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// A final state for [`TaskGuard::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalState {
    /// The task ran to its end.
    Completed,
    /// The task failed.
    Failed,
    /// The task stopped because it was asked to cancel.
    Canceled,
    /// The task was not run.
    Skipped,
}

impl FinalState {
    fn as_str(self) -> &'static str {
        match self {
            FinalState::Completed => "completed",
            FinalState::Failed => "failed",
            FinalState::Canceled => "canceled",
            FinalState::Skipped => "skipped",
        }
    }
}

impl TaskGuard {
    /// The task as the broker handed it out.
    pub fn task(&self) -> &proto::Task {
        &self.task
    }

    /// The task's id.
    pub fn id(&self) -> &str {
        &self.task.task_id
    }

    /// The fencing token of this grant (a new one when a reopened lease adopted the task).
    pub fn fencing_token(&self) -> u64 {
        self.held.token.load(Ordering::SeqCst)
    }

    /// Fires when a heartbeat reply asks for the task to be canceled, or when the task is lost.
    pub fn cancelled(&self) -> CancellationToken {
        self.held.cancel.clone()
    }

    /// True when the task is no longer this worker's (its lease ended and no new lease took it
    /// over): stop working on it; its results must not be recorded.
    pub fn is_lost(&self) -> bool {
        self.held.lost.load(Ordering::SeqCst)
    }

    /// Marks the task running (StartTask), for workers that keep task state through the broker.
    /// A task whose grant started it ([`Worker::next_task_started`]) is not started again.
    pub async fn start(&self) -> Result<(), WorkerError> {
        self.check_held()?;
        if self.task.started_at.is_some() {
            return Ok(());
        }
        let task_id = self.task.task_id.clone();
        let held = Arc::clone(&self.held);
        // Also retried when no answer came: the broker answers a start its holder already made
        // with the time it started. A reopen that did not take the task over ends it as lost.
        self.shared
            .with_lease_retrying(
                "StartTask",
                Duration::ZERO,
                retry::repeatable,
                || self.check_held(),
                |mut c, lease_id| {
                    // Read at each attempt: a reopened lease that adopted the task gave a new
                    // token.
                    let request = proto::StartTaskRequest {
                        lease_id,
                        task_id: task_id.clone(),
                        fencing_token: held.token.load(Ordering::SeqCst),
                    };
                    async move { c.start_task(request).await }
                },
            )
            .await?;
        self.held.started.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Records the final state (with `error` for a failure) and releases the locks.
    pub async fn finish(
        mut self,
        state: FinalState,
        error: Option<String>,
    ) -> Result<proto::FinishTaskResponse, WorkerError> {
        self.done = true;
        self.check_held()?;
        let going = self.let_go(LetGo::Finish {
            state,
            error: error.unwrap_or_default(),
        });
        let result = going.finish().await;
        if let Err(e) = &result {
            if transient(e) {
                tracing::warn!(task_id = %going.task_id, error = %e, "FinishTask failed; retrying in the background");
                going.keep_trying(Duration::from_secs(1));
            }
        }
        result
    }

    /// Releases the task's locks (ReleaseLocks); for workers that record task state themselves,
    /// as Pulp's do. Returns false when they were already released.
    pub async fn release(mut self) -> Result<bool, WorkerError> {
        self.done = true;
        self.check_held()?;
        let going = self.let_go(LetGo::Release);
        let result = going.release().await;
        if let Err(e) = &result {
            if transient(e) {
                tracing::warn!(task_id = %going.task_id, error = %e, "ReleaseLocks failed; retrying in the background");
                going.keep_trying(Duration::from_secs(1));
            }
        }
        result
    }

    fn check_held(&self) -> Result<(), WorkerError> {
        if self.is_lost() {
            return Err(WorkerError::Lost {
                task_id: self.task.task_id.clone(),
            });
        }
        Ok(())
    }

    fn forget(&self) {
        lock(&self.shared.held).remove(&self.task.task_id);
    }

    /// Moves the task from the held ones to those being let go (see [`Shared::ending`]), in one
    /// step under the lock a reopen takes first, so a reopen sees it in one or the other.
    fn let_go(&self, how: LetGo) -> Going {
        let mut held = lock(&self.shared.held);
        held.remove(&self.task.task_id);
        lock(&self.shared.ending).push((self.task.task_id.clone(), Arc::clone(&self.held)));
        drop(held);
        Going {
            shared: Arc::clone(&self.shared),
            task_id: self.task.task_id.clone(),
            held: Arc::clone(&self.held),
            how,
        }
    }
}

/// How a held task is let go.
#[derive(Debug, Clone)]
enum LetGo {
    Finish { state: FinalState, error: String },
    Release,
}

/// A held task being let go: FinishTask or ReleaseLocks, made under the lease current at each
/// attempt and the task's token as it is then. A lease reopened meanwhile (Redis lost its state,
/// the broker rebuilt it) adopted the task under a new token, or did not take it over: then the
/// task is lost and the call ends with [`WorkerError::Lost`].
struct Going {
    shared: Arc<Shared>,
    task_id: String,
    held: Arc<Held>,
    how: LetGo,
}

impl Going {
    /// One call that lets the task go, with the worker's retries of `UNAVAILABLE` and one reopen
    /// of a lease the broker no longer knows.
    async fn call<T, F, Fut>(&self, method: &'static str, mut f: F) -> Result<T, WorkerError>
    where
        F: FnMut(Client, String, u64) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        // Checked before every call: a reopen that did not take the task over ends it here, not
        // with one more call under the new lease and the old token.
        let not_lost = || match self.held.lost.load(Ordering::SeqCst) {
            true => Err(WorkerError::Lost {
                task_id: self.task_id.clone(),
            }),
            false => Ok(()),
        };
        self.shared
            .with_lease_retrying(
                method,
                Duration::ZERO,
                retry::retryable,
                not_lost,
                |c, lease_id| f(c, lease_id, self.held.token.load(Ordering::SeqCst)),
            )
            .await
            .map(|(reply, _)| reply)
    }

    async fn finish(&self) -> Result<proto::FinishTaskResponse, WorkerError> {
        let LetGo::Finish { state, error } = &self.how else {
            unreachable!("finish() of a release")
        };
        self.call("FinishTask", |mut c, lease_id, fencing_token| {
            let request = proto::FinishTaskRequest {
                lease_id,
                task_id: self.task_id.clone(),
                fencing_token,
                state: state.as_str().to_owned(),
                error: error.clone(),
            };
            async move { c.finish_task(request).await }
        })
        .await
    }

    async fn release(&self) -> Result<bool, WorkerError> {
        self.call("ReleaseLocks", |mut c, lease_id, fencing_token| {
            let request = proto::ReleaseLocksRequest {
                lease_id,
                task_id: self.task_id.clone(),
                fencing_token,
            };
            async move { c.release_locks(request).await }
        })
        .await
        .map(|r| r.released)
    }

    async fn attempt(&self) -> Result<(), WorkerError> {
        match self.how {
            LetGo::Finish { .. } => self.finish().await.map(|_| ()),
            LetGo::Release => self.release().await.map(|_| ()),
        }
    }

    fn method(&self) -> &'static str {
        match self.how {
            LetGo::Finish { .. } => "FinishTask",
            LetGo::Release => "ReleaseLocks",
        }
    }

    /// Keeps making the call in the background (the first attempt after `first_delay`, then
    /// every few seconds) until it succeeds, ends for good (the broker said no, or the task was
    /// lost), or the lease is closed (closing it ends what it holds): a release or finish that
    /// failed in passing must not leave the task's locks held by a live lease.
    fn keep_trying(self, first_delay: Duration) {
        let (task_id, what) = (self.task_id.clone(), self.method());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                %task_id,
                what,
                "no runtime to retry in; the locks stay until the lease ends"
            );
            return;
        };
        let closed = self.shared.closed.clone();
        runtime.spawn(async move {
            let mut delay = first_delay;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = closed.cancelled() => break,
                }
                match self.attempt().await {
                    Ok(()) => {
                        tracing::info!(%task_id, what, "succeeded on a background retry");
                        break;
                    }
                    Err(e) if transient(&e) => {
                        delay = (delay * 2).clamp(Duration::from_secs(1), Duration::from_secs(10))
                    }
                    Err(e) => {
                        tracing::warn!(%task_id, what, error = %e, "background retry ended");
                        break;
                    }
                }
            }
        });
    }
}

/// The task is no longer being let go once its call went through, ended for good, or was given
/// up (its future dropped, the worker closed): whatever way the [`Going`] ends.
impl Drop for Going {
    fn drop(&mut self) {
        lock(&self.shared.ending).retain(|(_, h)| !Arc::ptr_eq(h, &self.held));
    }
}

/// Failures after which the call may still succeed later (the broker or its backends were
/// unreachable, or the answer was lost); not the broker's "no" (FAILED_PRECONDITION, NOT_FOUND).
/// CANCELLED too: this library never cancels a finish or release itself, and the broker answers
/// CANCELLED ("Timeout expired") when the call's deadline passed there before it answered.
fn transient(error: &WorkerError) -> bool {
    matches!(
        error.code(),
        Some(
            Code::Unavailable
                | Code::ResourceExhausted
                | Code::DeadlineExceeded
                | Code::Cancelled
                | Code::Unknown
        )
    )
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if self.is_lost() || self.held.detached.load(Ordering::SeqCst) {
            self.forget();
            return;
        }
        let task_id = self.task.task_id.clone();
        if self.held.started.load(Ordering::SeqCst) {
            tracing::warn!(%task_id, "task guard of a running task dropped without finish; failing the task in the background");
            self.let_go(LetGo::Finish {
                state: FinalState::Failed,
                error: "the worker dropped the task without finishing it".to_owned(),
            })
            .keep_trying(Duration::ZERO);
            return;
        }
        tracing::warn!(%task_id, "task guard dropped without release; releasing its locks in the background");
        self.let_go(LetGo::Release).keep_trying(Duration::ZERO);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(task_id: &str, token: u64) -> proto::HeldTask {
        proto::HeldTask {
            task_id: task_id.into(),
            fencing_token: token,
        }
    }

    #[test]
    fn a_finish_or_release_without_an_answer_is_retried_but_not_one_the_broker_refused() {
        let status = |code| WorkerError::Rpc {
            method: "FinishTask",
            status: Status::new(code, "x"),
        };
        for code in [
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
            Code::Cancelled,
            Code::Unknown,
        ] {
            assert!(transient(&status(code)), "{code:?}");
        }
        for code in [
            Code::FailedPrecondition,
            Code::NotFound,
            Code::InvalidArgument,
        ] {
            assert!(!transient(&status(code)), "{code:?}");
        }
        assert!(!transient(&WorkerError::Lost {
            task_id: "t".into()
        }));
    }

    #[test]
    fn a_grant_never_received_is_due_after_two_heartbeats_in_a_row() {
        let mut u = Undelivered::default();
        let sent = Instant::now();
        u.listed(&[held("a", 7)], 1, sent);
        assert!(u.due_now(1).is_empty(), "once is not enough");
        u.listed(&[held("a", 7)], 1, sent);
        assert_eq!(u.due_now(1), vec![held("a", 7)]);
        // Handed back: an answer bringing it after all is not run; the broker took it.
        assert!(!u.received("a", 7));
        u.reported(&[held("a", 7)]);
        assert!(u.due_now(1).is_empty());
        // Granted again (a new token), it is a grant like any other.
        assert!(u.received("a", 9));
    }

    #[test]
    fn an_answer_that_arrives_before_the_hand_back_takes_the_grant_off_the_list() {
        let mut u = Undelivered::default();
        let sent = Instant::now();
        u.listed(&[held("a", 7)], 1, sent);
        u.listed(&[held("a", 7)], 1, sent);
        assert!(u.received("a", 7), "it arrived: it runs here");
        assert!(u.due_now(1).is_empty(), "so it is not handed back");
        u.listed(&[held("a", 7)], 1, sent);
        assert!(u.due_now(1).is_empty());
    }

    #[test]
    fn a_grant_handed_back_goes_again_while_it_is_listed() {
        let mut u = Undelivered::default();
        let sent = Instant::now();
        u.listed(&[held("a", 7)], 1, sent);
        u.listed(&[held("a", 7)], 1, sent);
        let back = u.due_now(1);
        u.reported(&back);
        // The broker did not act on it (a replica killed after answering): still listed.
        u.listed(&[held("a", 7)], 1, sent);
        assert_eq!(u.due_now(1), vec![held("a", 7)]);
        // Acted on: no longer listed, nothing more to hand back.
        u.reported(&[held("a", 7)]);
        u.listed(&[], 1, sent);
        assert!(u.due_now(1).is_empty());
    }

    #[test]
    fn a_task_adopted_after_a_rebuild_is_due_unless_the_worker_still_has_it() {
        let mut u = Undelivered::default();
        assert!(u.received("a", 7));
        assert!(u.received("b", 8));
        // The reopen: "a" is still held (or being let go), so it is received under its new
        // token; "b" was received before but the worker no longer has it (its guard lost).
        assert!(u.received("a", 12));
        let sent = Instant::now();
        u.listed(&[held("a", 12), held("b", 13)], 2, sent);
        u.listed(&[held("a", 12), held("b", 13)], 2, sent);
        assert_eq!(
            u.due_now(2),
            vec![held("b", 13)],
            "only the one never received"
        );
    }

    #[test]
    fn received_grants_are_never_due() {
        let mut u = Undelivered::default();
        assert!(u.received("a", 7));
        let sent = Instant::now();
        for _ in 0..3 {
            u.listed(&[held("a", 7)], 1, sent);
        }
        assert!(u.due_now(1).is_empty());
        // Let go (not listed by a heartbeat sent after it arrived), then listed again under
        // another token that never arrived: that one is due.
        u.listed(&[], 1, Instant::now());
        assert!(u.received.is_empty(), "a grant let go is forgotten");
        u.listed(&[held("a", 8)], 1, sent);
        u.listed(&[held("a", 8)], 1, sent);
        assert_eq!(u.due_now(1), vec![held("a", 8)]);
    }

    #[test]
    fn a_new_token_or_lease_starts_the_count_again() {
        let mut u = Undelivered::default();
        let sent = Instant::now();
        u.listed(&[held("a", 7)], 1, sent);
        u.listed(&[held("a", 8)], 1, sent);
        assert!(u.due_now(1).is_empty(), "another grant of the task");
        u.listed(&[held("a", 8)], 2, sent);
        assert!(u.due_now(2).is_empty(), "another lease");
        u.listed(&[held("a", 8)], 2, sent);
        assert!(
            u.due_now(3).is_empty(),
            "due under a lease that was replaced since"
        );
    }
}
