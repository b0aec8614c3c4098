//! Assembles the broker: connects the stores, checks the schema, and serves Broker, health and
//! reflection on one port until shutdown.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::task::JoinHandle;

use crate::config::ServeArgs;
use crate::dispatch::{Dispatch, FairSettings, Fairness, FetchPolicy};
use crate::externalscaler::external_scaler_server::ExternalScalerServer;
use crate::grpc::{AdminService, BrokerService};
use crate::keda::Scaler;
use crate::lanes::{LaneConfig, Lanes};
use crate::leases::recovery::Recovery;
use crate::leases::sweeper::Sweeper;
use crate::leases::{Leases, TtlPolicy};
use crate::locks::Locks;
use crate::metrics::Stats;
use crate::proto::admin_server::AdminServer;
use crate::proto::broker_server::BrokerServer;
use crate::shutdown::{self, Shutdown, Trigger};
use crate::tasks::Tasks;

/// A running broker.
pub struct Running {
    /// The address it listens on (useful with port 0).
    pub addr: SocketAddr,
    /// The address of its Prometheus endpoint.
    pub metrics_addr: SocketAddr,
    /// Its lane gauge.
    pub lanes: Arc<Lanes>,
    /// Its counters of request-path work.
    pub stats: Arc<Stats>,
    /// Its counters of background work (sweeper, reconciler, rebuilds).
    pub background_stats: Arc<Stats>,
    /// Its lock store handle (tests inspect Redis through it).
    pub locks: Locks,
    /// Its task store handle.
    pub tasks: Tasks,
    /// Its fair dispatch (the policy in force, the directory).
    pub fairness: Fairness,
    /// The background loop (sweeper, reconciler, lock-state checks).
    pub sweeper: Arc<Sweeper>,
    /// This replica's waiting FetchTask calls.
    pub waiters: Arc<crate::dispatch::Queue>,
    /// This replica's fetch passes and FinishTask calls running in their own tasks (a pass
    /// answers its caller before it has settled everything; tests wait for them before reading
    /// counters, and shutdown waits for them within its grace).
    pub passes: Arc<crate::dispatch::Passes>,
    /// This replica's resource queues (tests wait for them to catch up).
    pub resource_queues: Arc<crate::dispatch::queues::Queues>,
    trigger: Trigger,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    background: JoinHandle<()>,
    grace: std::time::Duration,
}

impl Running {
    /// Signals shutdown: stops accepting calls, lets in-flight calls finish within the grace
    /// period, stops the background loop. Leases are left alone: another replica or the restarted
    /// broker serves them.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.trigger.fire();
        let deadline = tokio::time::Instant::now() + self.grace;
        let mut server = self.server;
        match tokio::time::timeout_at(deadline, &mut server).await {
            Ok(joined) => joined.context("server task")??,
            Err(_) => {
                tracing::warn!(grace = ?self.grace, "in-flight calls outlived the grace period; stopping anyway");
                server.abort();
            }
        }
        // Passes run in their own tasks: let them settle within the same grace, so a grant made
        // for a caller that is gone is undone before the process ends (they start no new
        // attempts after the signal).
        if tokio::time::timeout_at(deadline, self.passes.idle())
            .await
            .is_err()
        {
            tracing::warn!(grace = ?self.grace, "fetch passes outlived the grace period; stopping anyway");
        }
        let _ = self.background.await;
        Ok(())
    }

    /// Stops at once, as a crash would (tests): no grace, nothing awaited.
    pub fn abort(self) {
        self.server.abort();
        self.background.abort();
    }

    /// Serves until `signal` completes, then shuts down.
    pub async fn serve_until(
        self,
        signal: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        signal.await;
        tracing::info!("shutting down");
        self.shutdown().await
    }
}

/// Starts a broker: refuses (with a one-line reason) when Postgres or Redis is unreachable or the
/// schema lacks something.
pub async fn start(args: &ServeArgs) -> anyhow::Result<Running> {
    args.validate().map_err(anyhow::Error::msg)?;
    let serving = Serving {
        max_per_connection: args.max_requests_per_connection,
        max_message_bytes: args.limits.message_bytes,
        tls: crate::security::server_tls(&args.security)?,
        auth: crate::security::BearerAuth::from_args(&args.security)?,
        admin_auth: crate::security::AdminAuth::from_args(&args.security)?,
    };
    let prometheus = crate::metrics::recorder();
    let stats = Arc::new(Stats::default());
    let tasks = Tasks::connect(
        &args.postgres.url,
        args.postgres.pool_size,
        args.backend_timeout,
        Arc::clone(&stats),
    )
    .await
    .context("cannot reach PostgreSQL at --postgres-url")?;
    tasks
        .prepare()
        .await
        .context("PostgreSQL is not ready for the broker")?;
    let locks = Locks::connect(
        &args.redis.url,
        args.redis.pool_size,
        &args.redis.key_prefix,
        args.backend_timeout,
        Arc::clone(&stats),
    )
    .await
    .context("cannot reach Redis at --redis-url")?;

    let replica = uuid::Uuid::new_v4().to_string();
    let background_stats = Arc::new(Stats::default());
    let bg_locks = locks.with_stats(Arc::clone(&background_stats));
    let bg_tasks = tasks.with_stats(Arc::clone(&background_stats));
    let recovery = Recovery::new(
        bg_locks.clone(),
        bg_tasks.clone(),
        Arc::clone(&background_stats),
        replica.clone(),
        args.fair.by,
    );
    // Know the lock state (rebuilding it if Redis lost it) before serving anything.
    if let Err(e) = recovery.check().await {
        tracing::warn!(error = %e, "lock state not ready at start-up; calls answer UNAVAILABLE until it is");
    }

    let (trigger, shutdown) = shutdown::channel();
    let leases = Leases::new(
        locks.clone(),
        tasks.clone(),
        TtlPolicy {
            default: args.lease.ttl,
            min: args.lease.min_ttl,
            max: args.lease.max_ttl,
        },
        Arc::clone(&stats),
    );
    let beats = leases.beats();
    let fairness = fairness(&args.fair, &tasks).await?;
    let dispatch = Dispatch::new(
        locks.clone(),
        tasks.clone(),
        Arc::clone(&stats),
        FetchPolicy {
            first_page: args.fetch.page,
            max_page: 1024.max(args.fetch.page),
            wake_poll: args.fetch.wake_poll,
            max_waiters: args.fetch.max_waiters,
            max_wait: args.fetch.max_wait,
            hint_max_age: args.fetch.hint_max_age,
            resource_queues: args.fetch.resource_queues,
            share: args.fetch.share as usize,
            passes: args.fetch.passes as usize,
            pass_stall: args.fetch.pass_stall,
        },
        fairness.clone(),
        leases.clone(),
        shutdown.clone(),
    );
    let sweeper = Arc::new(Sweeper {
        leases: Leases::new(
            bg_locks.clone(),
            bg_tasks.clone(),
            TtlPolicy {
                default: args.lease.ttl,
                min: args.lease.min_ttl,
                max: args.lease.max_ttl,
            },
            Arc::clone(&background_stats),
        ),
        locks: bg_locks,
        tasks: bg_tasks,
        recovery,
        stats: Arc::clone(&background_stats),
        interval: args.sweep_interval,
        replica,
        claim_grace: args.sweep_interval * 2 + args.backend_timeout * 2,
        unclaimed_last_turn: Default::default(),
    });
    let lanes = Arc::new(Lanes::new(
        sweeper.tasks.clone(),
        sweeper.locks.clone(),
        fairness.clone(),
        LaneConfig {
            interval: args.lanes.interval,
            cutoff: args.lanes.cutoff,
            full_interval: args.lanes.full_interval,
            refresh: args.lanes.refresh,
            activity_check: args.lanes.activity_check,
        },
        sweeper.replica.clone(),
    ));
    let scaler = Scaler::new(Arc::clone(&lanes), tasks.clone(), shutdown.clone());
    let waiters = dispatch.waiters();
    let passes = dispatch.passes();
    let resource_queues = dispatch.resource_queues();
    let admin = AdminService::new(
        crate::admin::Admin::new(
            tasks.clone(),
            locks.clone(),
            leases.clone(),
            Arc::clone(&lanes),
            Arc::clone(&stats),
            &dispatch,
        ),
        args.limits,
    );
    let service = BrokerService::new(leases, dispatch, args.limits);

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<BrokerServer<BrokerService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building the reflection service")?;

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let metrics_listener = tokio::net::TcpListener::bind(args.metrics_listen)
        .await
        .with_context(|| format!("cannot listen on --metrics-listen {}", args.metrics_listen))?;
    let metrics_addr = metrics_listener.local_addr()?;
    if let Some(handle) = prometheus {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            if let Err(e) =
                crate::metrics::serve(
                    metrics_listener,
                    handle,
                    async move { shutdown.fired().await },
                )
                .await
            {
                tracing::error!(error = %e, "the metrics endpoint stopped");
            }
        });
    }
    tokio::spawn({
        let lanes = Arc::clone(&lanes);
        let shutdown = shutdown.clone();
        async move { lanes.run(shutdown).await }
    });
    if args.fetch.resource_queues {
        tokio::spawn({
            // Kept from here on (before the loop's task runs: `settle` relies on it).
            resource_queues.keep(sweeper.tasks.clone());
            let queues = Arc::clone(&resource_queues);
            let shutdown = shutdown.clone();
            async move { queues.run(shutdown).await }
        });
    }
    tokio::spawn(fairness.clone().run(
        sweeper.tasks.clone(),
        FairSettings {
            by: args.fair.by,
            policy_file: args.fair.policy.clone(),
            refresh: args.fair.refresh,
            metric_groups: args.fair.metric_groups,
        },
        Arc::clone(&background_stats),
        Arc::clone(&waiters),
        sweeper.locks.clone(),
        shutdown.clone(),
    ));
    // The workers' last_heartbeat, written for all leases that beat in one statement.
    tokio::spawn(beats.run(sweeper.leases.clone(), shutdown.clone()));
    let gin_inserted = Arc::new(tokio::sync::Notify::new());
    tokio::spawn(crate::tasks::gin::keep_pending_lists_short(
        sweeper.tasks.clone(),
        args.gin_clean_interval,
        Arc::clone(&gin_inserted),
        shutdown.clone(),
    ));
    let (listening, listening_started) = tokio::sync::oneshot::channel();
    tokio::spawn(crate::dispatch::wakeups::listen(
        args.postgres.url.clone(),
        Arc::clone(&waiters),
        vec![
            lanes.insert_signal(),
            fairness.insert_signal(),
            gin_inserted,
        ],
        listening,
        shutdown.clone(),
    ));
    // Serve once notifications are heard, so a fetch waiting from the first call on is woken by
    // every insert; if listening takes too long, serve anyway (waiters fall back to the safety
    // re-check and the listener keeps trying).
    if tokio::time::timeout(args.backend_timeout, listening_started)
        .await
        .is_err()
    {
        tracing::warn!(
            "not yet listening for task notifications; serving anyway (waiting fetches rely on the safety re-check until it is)"
        );
    }
    tokio::spawn(crate::dispatch::wakeups::tick(
        // The background pool: its calls are counted with the background work, not with RPCs.
        sweeper.locks.clone(),
        Arc::clone(&waiters),
        args.fetch.wake_poll,
        args.fetch.recheck,
        shutdown.clone(),
    ));
    let background = tokio::spawn({
        let sweeper = Arc::clone(&sweeper);
        let shutdown = shutdown.clone();
        let health = health_reporter.clone();
        async move { run_background(sweeper, health, shutdown).await }
    });
    let server = tokio::spawn(serve(
        serving,
        listener,
        Services {
            broker: service,
            admin,
            scaler,
        },
        health_service,
        reflection,
        shutdown,
    ));
    tracing::info!(%addr, %metrics_addr, "dispatch-broker serving");
    Ok(Running {
        fairness,
        addr,
        metrics_addr,
        lanes,
        stats,
        background_stats,
        locks,
        tasks,
        sweeper,
        waiters,
        passes,
        resource_queues,
        trigger,
        server,
        background,
        grace: args.shutdown_grace,
    })
}

/// The background loop. It also keeps gRPC health current: the overall status ("", what a
/// readiness probe asks) is NOT_SERVING while the lock state is lost or being rebuilt or a backend
/// fails the turn; `dispatch.v1.Broker` (for liveness probes) stays SERVING while the process runs.
async fn run_background(
    sweeper: Arc<Sweeper>,
    health: tonic_health::server::HealthReporter,
    shutdown: Shutdown,
) {
    use tonic_health::ServingStatus;
    let mut tick = tokio::time::interval(sweeper.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut serving = true;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = sweeper.locks.lost() => sweeper.recovery.suspect(),
            _ = shutdown.fired() => {
                health.set_service_status("", ServingStatus::NotServing).await;
                return;
            }
        }
        let healthy = match sweeper.turn().await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "background turn failed; retrying next interval");
                false
            }
        };
        if healthy != serving {
            let status = if healthy {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            tracing::info!(?status, "readiness changed");
            health.set_service_status("", status).await;
            serving = healthy;
        }
    }
}

/// The broker's own gRPC services.
struct Services {
    broker: BrokerService,
    admin: AdminService,
    scaler: Scaler,
}

/// How the gRPC port is served: limits, TLS, authentication.
struct Serving {
    max_per_connection: usize,
    max_message_bytes: usize,
    tls: Option<tonic::transport::ServerTlsConfig>,
    auth: crate::security::BearerAuth,
    admin_auth: crate::security::AdminAuth,
}

async fn serve(
    serving: Serving,
    listener: tokio::net::TcpListener,
    services: Services,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    reflection: tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
    shutdown: Shutdown,
) -> Result<(), tonic::transport::Error> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = serving.tls {
        builder = builder.tls_config(tls)?;
    }
    builder
        // tower's concurrency limit per connection, shedding (RESOURCE_EXHAUSTED at once) instead of
        // queueing what is over it.
        .concurrency_limit_per_connection(serving.max_per_connection)
        .load_shed(true)
        .layer(crate::metrics::RpcMetricsLayer)
        .layer(crate::grpc::TooLargeLayer {
            limit: serving.max_message_bytes,
        })
        .add_service(health)
        .add_service(reflection)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            BrokerServer::new(services.broker).max_decoding_message_size(serving.max_message_bytes),
            serving.auth,
        ))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            AdminServer::new(services.admin).max_decoding_message_size(serving.max_message_bytes),
            serving.admin_auth,
        ))
        .add_service(ExternalScalerServer::new(services.scaler))
        // TCP_NODELAY on every accepted connection: without it, a reply written in more than
        // one piece (headers, data, trailers) waits for the client's delayed ACK (~40 ms).
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            async move { shutdown.fired().await },
        )
        .await
}

/// `dispatch-broker health`: asks a broker's `grpc.health.v1` service whether it serves.
pub async fn probe(args: &crate::config::HealthArgs) -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let check = async {
        let mut endpoint = tonic::transport::Endpoint::from_shared(args.broker.addr.clone())?;
        if let Some(tls) = crate::security::broker_tls(&args.broker)? {
            endpoint = endpoint.tls_config(tls)?;
        }
        let channel = endpoint.connect().await?;
        let reply = tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest {
                service: args.service.clone(),
            })
            .await?
            .into_inner();
        anyhow::Ok(reply.status)
    };
    let status = tokio::time::timeout(args.timeout, check)
        .await
        .with_context(|| {
            format!(
                "no answer from {} within {:?}",
                args.broker.addr, args.timeout
            )
        })?
        .with_context(|| format!("health check of {} failed", args.broker.addr))?;
    if status == ServingStatus::Serving as i32 {
        println!("serving");
        Ok(())
    } else {
        anyhow::bail!("{} is not serving (status {status})", args.broker.addr)
    }
}

/// Fair dispatch as `args` ask: the policy file read (a bad one stops the start), directed passes
/// on when the fair indexes exist (a warning names the command that adds them otherwise).
async fn fairness(
    args: &crate::config::FairArgs,
    tasks: &crate::tasks::Tasks,
) -> anyhow::Result<Fairness> {
    use crate::dispatch::fairness::Source;
    let (policy, source, base) = match &args.policy {
        None => (crate::fair::Policy::default(), Source::Default, 0),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read --fair-policy {}", path.display()))?;
            let policy = crate::fair::Policy::parse(&text)
                .with_context(|| format!("--fair-policy {} refused", path.display()))?;
            (policy, Source::File, crate::dispatch::fairness::hash(&text))
        }
    };
    let directed = tasks
        .has_fair_indexes()
        .await
        .context("cannot read the schema")?;
    if !directed && (args.by != crate::fair::FairBy::None) {
        tracing::warn!(
            "fair dispatch's indexes are missing: tasks go out in queue order, without shares among groups or an express lane (caps and the reserve still hold); add them with `dispatch-broker migrate --fair-indexes`"
        );
    }
    let fairness = Fairness::new(args.by, policy, source, base, directed)
        .with_metric_groups(args.metric_groups);
    fairness
        .refresh(tasks)
        .await
        .context("cannot read which domains have waiting tasks")?;
    Ok(fairness)
}
