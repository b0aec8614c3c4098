//! Assembles the broker: connects the stores, checks the schema, and serves Broker, health and
//! reflection on one port until shutdown.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;

use crate::config::ServeArgs;
use crate::dispatch::{Dispatch, FetchPolicy};
use crate::grpc::BrokerService;
use crate::leases::{Leases, TtlPolicy};
use crate::locks::Locks;
use crate::metrics::Stats;
use crate::proto::broker_server::BrokerServer;
use crate::shutdown::{self, Shutdown, Trigger};
use crate::tasks::Tasks;

/// A running broker.
pub struct Running {
    /// The address it listens on (useful with port 0).
    pub addr: SocketAddr,
    /// Its counters.
    pub stats: Arc<Stats>,
    /// Its lock store handle (tests inspect Redis through it).
    pub locks: Locks,
    /// Its task store handle.
    pub tasks: Tasks,
    trigger: Trigger,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Running {
    /// Signals shutdown and waits for the server to finish in-flight calls.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.trigger.fire();
        self.server.await.context("server task")??;
        Ok(())
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
    crate::metrics::describe();
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
    let dispatch = Dispatch::new(
        locks.clone(),
        tasks.clone(),
        Arc::clone(&stats),
        FetchPolicy {
            first_page: args.fetch.page,
            max_page: 1024.max(args.fetch.page),
            recheck: args.fetch.recheck,
            max_wait: args.fetch.max_wait,
        },
        shutdown.clone(),
    );
    let service = BrokerService::new(leases, dispatch);

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
    let server = tokio::spawn(serve(
        listener,
        service,
        health_service,
        reflection,
        shutdown,
    ));
    tracing::info!(%addr, "dispatch-broker serving");
    Ok(Running {
        addr,
        stats,
        locks,
        tasks,
        trigger,
        server,
    })
}

async fn serve(
    listener: tokio::net::TcpListener,
    service: BrokerService,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    reflection: tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
    shutdown: Shutdown,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(reflection)
        .add_service(BrokerServer::new(service))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
            shutdown.fired().await
        })
        .await
}
