//! Command line and environment: every option is a flag, most also a `DISPATCH_*` variable
//! (docs/configuration.md lists which, and a test keeps it true), checked up front so bad
//! configuration stops the process with one line before anything starts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// dispatch-broker: hands out Pulp tasks to workers over gRPC, owning all lock state.
#[derive(Debug, Parser)]
#[command(name = "dispatch-broker", version, about)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the gRPC API (Broker, grpc.health.v1, reflection).
    Serve(Box<ServeArgs>),
    /// Create the broker's subset of Pulp's schema on an empty database, or report whether an
    /// existing Pulp database has everything the broker needs. Changes nothing on a Pulp database.
    Migrate(MigrateArgs),
    /// Check a running broker's gRPC health (exit 0 when serving): for container health checks.
    Health(HealthArgs),
    /// Why is this task not running? Its state and, when it waits, every reason: older tasks
    /// in its way, held locks, workers' versions. (Admin API; needs the admin token.)
    Explain(ExplainArgs),
    /// Leases (one per worker incarnation) with their versions, expiry, tasks and locks.
    Leases(LeasesArgs),
    /// Held locks by resource, with mode and holders, oldest grant first.
    Locks(LocksArgs),
    /// The resources with the most tasks waiting behind them, and what holds up each head.
    Blocked(BlockedArgs),
    /// Fair dispatch as the broker applies it: the policy in force and each domain's weight,
    /// cap, running tasks and share; `fairness set` and `fairness reset` override the policy at
    /// run time (audited).
    Fairness(Box<FairnessArgs>),
    /// Revoke a lease as the sweeper would: release its locks, requeue its claimed tasks, fail
    /// its running tasks with the reason. Audited.
    Revoke(RevokeArgs),
    /// Release the locks on a resource whose holder cannot be reached: only when the holding
    /// lease is expired or gone. Audited.
    ForceRelease(ForceReleaseArgs),
}

/// How a command reaches a running broker: the same options and variables for `health` and the
/// admin commands (older names are read too: [`ENV_ALIASES`]).
#[derive(Debug, Clone, Args)]
pub struct BrokerAddrArgs {
    /// The broker's gRPC address (https://... with --tls-ca).
    #[arg(long, env = "DISPATCH_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// PEM CA bundle to verify a TLS broker with (implies TLS).
    #[arg(long, env = "DISPATCH_CLIENT_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// The name the broker's certificate is checked against.
    #[arg(long, env = "DISPATCH_CLIENT_TLS_DOMAIN", default_value = "localhost")]
    pub tls_domain: String,
    /// Client certificate (PEM) for a broker that requires one, with --tls-key.
    #[arg(long, env = "DISPATCH_CLIENT_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "DISPATCH_CLIENT_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

/// A pooled connection (Postgres or Redis) unused for this long is checked before reuse (an
/// empty query; UNWATCH and PING), so a busy broker pays no extra round trip per call.
pub const VERIFY_IDLE_AFTER: Duration = Duration::from_secs(1);

/// How long that check may take before the connection is dropped and another one taken.
pub const VERIFY_IDLE_WITHIN: Duration = Duration::from_secs(2);

/// Variables still read under an older name, as (old, current): where the current one is unset,
/// the old one's value stands in for it (after the command line and the current variable, before
/// the default). `health` read these before it shared the admin commands' names.
pub const ENV_ALIASES: &[(&str, &str)] = &[
    ("DISPATCH_HEALTH_ADDR", "DISPATCH_ADDR"),
    ("DISPATCH_HEALTH_TLS_CA", "DISPATCH_CLIENT_TLS_CA"),
    ("DISPATCH_HEALTH_TLS_DOMAIN", "DISPATCH_CLIENT_TLS_DOMAIN"),
    ("DISPATCH_HEALTH_TLS_CERT", "DISPATCH_CLIENT_TLS_CERT"),
    ("DISPATCH_HEALTH_TLS_KEY", "DISPATCH_CLIENT_TLS_KEY"),
];

/// The command line parser, reading [`ENV_ALIASES`] from the process environment.
pub fn command() -> clap::Command {
    command_with(|name| std::env::var_os(name))
}

/// The command line parser with [`ENV_ALIASES`] read through `env`: every argument of every
/// subcommand that reads a current name whose variable is unset gets the old variable's value as
/// its default.
pub fn command_with(env: impl Fn(&str) -> Option<std::ffi::OsString>) -> clap::Command {
    use clap::CommandFactory;
    let mut cli = Cli::command();
    for (old, current) in ENV_ALIASES {
        let Some(value) = env(old).filter(|_| env(current).is_none()) else {
            continue;
        };
        let subcommands: Vec<String> = cli
            .get_subcommands()
            .map(|s| s.get_name().to_owned())
            .collect();
        for name in subcommands {
            cli = cli.mut_subcommand(name, |mut sub| {
                let ids: Vec<clap::Id> = sub
                    .get_arguments()
                    .filter(|a| a.get_env() == Some(std::ffi::OsStr::new(current)))
                    .map(|a| a.get_id().clone())
                    .collect();
                for id in ids {
                    sub = sub.mut_arg(id, |a| a.default_value(value.clone()));
                }
                sub
            });
        }
    }
    cli
}

/// How the admin commands reach a broker.
#[derive(Debug, Clone, Args)]
pub struct AdminClientArgs {
    /// Address and TLS.
    #[command(flatten)]
    pub broker: BrokerAddrArgs,
    /// File holding the admin token (the broker's --admin-token-file).
    #[arg(long, env = "DISPATCH_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// The admin token itself (prefer the environment variable).
    #[arg(
        long,
        env = "DISPATCH_ADMIN_TOKEN",
        hide_env_values = true,
        conflicts_with = "admin_token_file"
    )]
    pub admin_token: Option<String>,
    /// How long to wait for the broker.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Print JSON (one document) instead of tables, for scripts.
    #[arg(long)]
    pub json: bool,
}

/// Options of `explain`.
#[derive(Debug, Clone, Args)]
pub struct ExplainArgs {
    /// The task's pulp_id.
    pub task_id: String,
    /// How many older conflicting tasks to list (the total is always shown).
    #[arg(long, default_value_t = 10)]
    pub max_conflicts: u32,
    #[command(flatten)]
    pub client: AdminClientArgs,
}

/// Options of `leases`.
#[derive(Debug, Clone, Args)]
pub struct LeasesArgs {
    /// Only workers whose name contains this.
    #[arg(long, default_value = "")]
    pub worker: String,
    /// Also leases that expired and are not swept yet.
    #[arg(long)]
    pub include_expired: bool,
    /// Leases per page.
    #[arg(long, default_value_t = 50)]
    pub page_size: u32,
    /// Where to start: the token the previous page printed.
    #[arg(long, default_value = "")]
    pub page_token: String,
    #[command(flatten)]
    pub client: AdminClientArgs,
}

/// Options of `locks`.
#[derive(Debug, Clone, Args)]
pub struct LocksArgs {
    /// Only resources whose name starts with this.
    #[arg(default_value = "")]
    pub prefix: String,
    /// Resources per page.
    #[arg(long, default_value_t = 50)]
    pub page_size: u32,
    /// Where to start: the token the previous page printed.
    #[arg(long, default_value = "")]
    pub page_token: String,
    #[command(flatten)]
    pub client: AdminClientArgs,
}

/// Options of `blocked`.
#[derive(Debug, Clone, Args)]
pub struct BlockedArgs {
    /// How many resources to show.
    #[arg(long, default_value_t = 10)]
    pub limit: u32,
    #[command(flatten)]
    pub client: AdminClientArgs,
}

/// Options of `fairness`.
#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct FairnessArgs {
    /// Override the policy at run time instead of showing it.
    #[command(subcommand)]
    pub action: Option<FairnessAction>,
    #[command(flatten)]
    pub client: AdminClientArgs,
}

/// What `fairness` changes.
#[derive(Debug, Clone, Subcommand)]
pub enum FairnessAction {
    /// Override one domain's weight or cap, or the reserve, on every replica (within
    /// --fair-refresh). Audited. Not written to the policy file: it holds until the policy
    /// file changes (or Redis loses its data); write it into the file to keep it.
    Set(SetFairnessArgs),
    /// Drop every override made at run time: the policy file (or the defaults) alone is in
    /// force again. Audited.
    Reset(ResetFairnessArgs),
}

/// Options of `fairness set`.
#[derive(Debug, Clone, Args)]
pub struct SetFairnessArgs {
    /// The domain, by name or pulp_id (with --weight, --cap or --no-cap).
    #[arg(long)]
    pub domain: Option<String>,
    /// Its new weight (more than 0).
    #[arg(long, requires = "domain")]
    pub weight: Option<f64>,
    /// Its new cap: at most this many of its tasks hold locks at once.
    #[arg(long, requires = "domain", conflicts_with = "no_cap")]
    pub cap: Option<i64>,
    /// Remove its cap (even one the policy file sets).
    #[arg(long, requires = "domain")]
    pub no_cap: bool,
    /// The new reserve: leases' worth of capacity kept for immediate tasks.
    #[arg(long)]
    pub reserve: Option<i64>,
    /// Why: logged and counted.
    #[arg(long)]
    pub reason: String,
    #[command(flatten)]
    pub client: AdminClientArgs,
}

/// Options of `fairness reset`.
#[derive(Debug, Clone, Args)]
pub struct ResetFairnessArgs {
    /// Why: logged and counted.
    #[arg(long)]
    pub reason: String,
    #[command(flatten)]
    pub client: AdminClientArgs,
}

/// Options of `revoke`.
#[derive(Debug, Clone, Args)]
pub struct RevokeArgs {
    /// The lease to revoke (`dispatch-broker leases` lists them).
    pub lease_id: String,
    /// Why: logged, counted, and stored as the failure reason of its running tasks.
    #[arg(long)]
    pub reason: String,
    #[command(flatten)]
    pub client: AdminClientArgs,
}

/// Options of `force-release`.
#[derive(Debug, Clone, Args)]
pub struct ForceReleaseArgs {
    /// The resource whose locks to release (`dispatch-broker locks` lists them).
    pub resource: String,
    /// Why: logged, counted, and stored as the failure reason of tasks that were running.
    #[arg(long)]
    pub reason: String,
    #[command(flatten)]
    pub client: AdminClientArgs,
}

/// Logging options.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, env = "DISPATCH_LOG_JSON", global = true)]
    pub log_json: bool,
    /// Log filter in tracing's EnvFilter syntax (e.g. "info", "dispatch_broker=debug").
    #[arg(long, env = "DISPATCH_LOG", default_value = "info", global = true)]
    pub log: String,
}

impl LogArgs {
    /// Sends the log to stderr, filtered by `--log` (or by `quiet` when given), in colour only
    /// when stderr is a terminal.
    pub fn install(&self, quiet: Option<&str>) {
        let wanted = quiet.unwrap_or(self.log.as_str());
        let filter = tracing_subscriber::EnvFilter::try_new(wanted)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        // Colours only on a terminal: a log sent to a file or a collector stays plain text.
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr);
        if self.log_json {
            builder.json().init();
        } else {
            builder.init();
        }
    }
}

/// Where the task table lives.
#[derive(Debug, Clone, Args)]
pub struct PostgresArgs {
    /// PostgreSQL connection URL of the Pulp database (or one made by `migrate`).
    #[arg(
        id = "postgres_url",
        long = "postgres-url",
        env = "DISPATCH_POSTGRES_URL"
    )]
    pub url: String,
    /// Connections in the Postgres pool.
    #[arg(
        id = "postgres_pool_size",
        long = "postgres-pool-size",
        env = "DISPATCH_POSTGRES_POOL_SIZE",
        default_value_t = 16
    )]
    pub pool_size: usize,
}

/// Where lock state lives.
#[derive(Debug, Clone, Args)]
pub struct RedisArgs {
    /// Redis connection URL.
    #[arg(id = "redis_url", long = "redis-url", env = "DISPATCH_REDIS_URL")]
    pub url: String,
    /// Connections in the Redis pool.
    #[arg(
        id = "redis_pool_size",
        long = "redis-pool-size",
        env = "DISPATCH_REDIS_POOL_SIZE",
        default_value_t = 16
    )]
    pub pool_size: usize,
    /// Prefix of every Redis key; it becomes the hash tag `{prefix}`, so all keys live in one
    /// Redis Cluster slot. Brokers sharing a prefix share lock state.
    #[arg(
        long = "redis-key-prefix",
        env = "DISPATCH_REDIS_KEY_PREFIX",
        default_value = "dispatch"
    )]
    pub key_prefix: String,
}

/// Options of `serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Task store.
    #[command(flatten)]
    pub postgres: PostgresArgs,
    /// Authentication and TLS.
    #[command(flatten)]
    pub security: SecurityArgs,
    /// Lock store.
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Address the gRPC server listens on.
    #[arg(long, env = "DISPATCH_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Address of the Prometheus endpoint (`GET /metrics`).
    #[arg(
        long,
        env = "DISPATCH_METRICS_LISTEN",
        default_value = "127.0.0.1:9464"
    )]
    pub metrics_listen: SocketAddr,
    /// Calls one client connection may have in flight (waiting fetches included); calls over it
    /// are shed at once (RESOURCE_EXHAUSTED) instead of queueing.
    #[arg(
        long,
        env = "DISPATCH_MAX_REQUESTS_PER_CONNECTION",
        default_value_t = 10_000
    )]
    pub max_requests_per_connection: usize,
    /// Lease tuning.
    #[command(flatten)]
    pub lease: LeaseArgs,
    /// Lane gauge tuning.
    #[command(flatten)]
    pub lanes: LaneArgs,
    /// Fetch tuning.
    #[command(flatten)]
    pub fetch: FetchArgs,
    /// Fair dispatch.
    #[command(flatten)]
    pub fair: FairArgs,

    #[command(flatten)]
    pub limits: LimitArgs,
    /// How often the sweeper looks for expired leases and finished tasks' locks (one replica at a
    /// time sweeps). A lease's locks are gone at most TTL + this after its last heartbeat.
    #[arg(long, env = "DISPATCH_SWEEP_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    pub sweep_interval: Duration,
    /// How often the pending list of the GIN index on reserved resources is merged into the
    /// index (Pulp's index has one unless `migrate --gin-fastupdate-off` was run). Every
    /// readiness look-up reads that list in full, so under live traffic a fetch slows with it.
    /// 0 turns this off. Needs the role that owns the index. While merges find nothing (no
    /// task written), they space out to eight times this, until a task notification.
    #[arg(long, env = "DISPATCH_GIN_CLEAN_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub gin_clean_interval: Duration,
    /// On SIGTERM, how long in-flight calls may take before the server stops anyway.
    #[arg(long, env = "DISPATCH_SHUTDOWN_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// How long a Redis or Postgres call may take before the RPC fails UNAVAILABLE.
    #[arg(long, env = "DISPATCH_BACKEND_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub backend_timeout: Duration,
}

/// Fair dispatch options (docs/design.md, "Fair dispatch").
#[derive(Debug, Clone, Args)]
pub struct FairArgs {
    /// What ready tasks are shared out by: `domain` (Pulp's `pulp_domain_id`: the domain
    /// furthest below its weighted share of what runs goes first) or `none` (plain FIFO: no
    /// shares, no express lane for immediate tasks; the reserve still holds).
    #[arg(long = "fair-by", env = "DISPATCH_FAIR_BY", value_enum, default_value_t = crate::fair::FairBy::Domain)]
    pub by: crate::fair::FairBy,
    /// The fairness policy file (TOML: weights, caps, the reserve; see docs/configuration.md),
    /// read at start (a bad file stops the start) and again whenever it changes (a bad change is
    /// refused, naming the line, and the policy in force stays). None: equal weights, no caps,
    /// no reserve.
    #[arg(long = "fair-policy", env = "DISPATCH_FAIR_POLICY")]
    pub policy: Option<std::path::PathBuf>,
    /// How often each replica reads which domains have waiting tasks (one index descent per
    /// domain) and checks the policy file for changes. While fair dispatch is not engaged (one
    /// domain or none waits, no immediate task), the domains are read every eighth time, and at
    /// once on every task notification.
    #[arg(long = "fair-refresh", env = "DISPATCH_FAIR_REFRESH", default_value = "500ms", value_parser = parse_duration)]
    pub refresh: Duration,
    /// Domains that get a label of their own in the metrics by domain (task wait and run time,
    /// running, waiting; the first seen); the rest are counted as `other`.
    #[arg(
        long = "fair-metric-groups",
        env = "DISPATCH_FAIR_METRIC_GROUPS",
        default_value_t = 20
    )]
    pub metric_groups: usize,
}

/// Lease options.
#[derive(Debug, Clone, Args)]
pub struct LeaseArgs {
    /// Lease TTL when OpenLease names none (Pulp's WORKER_TTL). Workers heartbeat every TTL/3.
    #[arg(id = "lease_ttl", long = "lease-ttl", env = "DISPATCH_LEASE_TTL", default_value = "30s", value_parser = parse_duration)]
    pub ttl: Duration,
    /// Shortest TTL a worker may ask for.
    #[arg(id = "lease_min_ttl", long = "lease-min-ttl", env = "DISPATCH_LEASE_MIN_TTL", default_value = "500ms", value_parser = parse_duration)]
    pub min_ttl: Duration,
    /// Longest TTL a worker may ask for.
    #[arg(id = "lease_max_ttl", long = "lease-max-ttl", env = "DISPATCH_LEASE_MAX_TTL", default_value = "1h", value_parser = parse_duration)]
    pub max_ttl: Duration,
}

/// Lane gauge options.
#[derive(Debug, Clone, Args)]
pub struct LaneArgs {
    /// How often the lane count is recomputed (by one replica for all; the others serve the
    /// shared value).
    #[arg(id = "lane_interval", long = "lane-interval", env = "DISPATCH_LANE_INTERVAL", default_value = "15s", value_parser = parse_duration)]
    pub interval: Duration,
    /// Tasks younger than this are not counted as lanes yet (Pulp uses 5 s).
    #[arg(id = "lane_cutoff", long = "lane-cutoff", env = "DISPATCH_LANE_CUTOFF", default_value = "5s", value_parser = parse_duration)]
    pub cutoff: Duration,
    /// How often the lane count is computed by reading the whole queue (and the survey of
    /// blocked resources taken). In between, a computation reads only what changed since the
    /// last one (tasks that ended and held a resource's first place or were lanes, their
    /// successors, new tasks), falling back to the whole queue when that would read as much,
    /// or when a transaction writing to core_task has been open for most of --lane-cutoff
    /// (it may commit a task behind what was counted).
    #[arg(id = "lane_full_interval", long = "lane-full-interval", env = "DISPATCH_LANE_FULL_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub full_interval: Duration,
    /// How often each replica refreshes what it serves (live leases, the shared lane count; and
    /// activity for KEDA's StreamIsActive push after a task notification).
    #[arg(id = "lane_refresh", long = "lane-refresh", env = "DISPATCH_LANE_REFRESH", default_value = "500ms", value_parser = parse_duration)]
    pub refresh: Duration,
    /// How often each replica asks Postgres whether any task is incomplete (for KEDA's
    /// StreamIsActive push; IsActive asks Postgres on every call) when no task notification
    /// arrives. A task-insert notification (the insert trigger, or
    /// Pulp's own wake-up channel) makes an inactive replica ask at its next refresh, so
    /// scaling from zero stays prompt while an idle broker does not poll the task table.
    #[arg(id = "lane_activity_check", long = "lane-activity-check", env = "DISPATCH_LANE_ACTIVITY_CHECK", default_value = "5s", value_parser = parse_duration)]
    pub activity_check: Duration,
}

/// Fetch options.
#[derive(Debug, Clone, Args)]
pub struct FetchArgs {
    /// Longest `wait` a FetchTask is held for; longer requests are cut to this.
    #[arg(long = "fetch-max-wait", env = "DISPATCH_FETCH_MAX_WAIT", default_value = "60s", value_parser = parse_duration)]
    pub max_wait: Duration,
    /// Safety re-check: how often the longest waiting FetchTask looks at the queue again without
    /// a wake-up (waiters wake on task notifications and lock changes; this only bounds how late
    /// a lost notification or a change made outside the broker is seen).
    #[arg(long = "fetch-recheck", env = "DISPATCH_FETCH_RECHECK", default_value = "2s", value_parser = parse_duration)]
    pub recheck: Duration,
    /// How often each replica reads Redis's change counter to wake its waiting fetches for
    /// releases made through other replicas or by the sweeper (one GET, whatever the waiters).
    /// Also bounds how long a fetch pass uses a scan hint without reading the change log first:
    /// two intervals since the log or the counter last showed nothing that drops it (a change
    /// made through this replica ends that at once).
    #[arg(long = "fetch-wake-poll", env = "DISPATCH_FETCH_WAKE_POLL", default_value = "100ms", value_parser = parse_duration)]
    pub wake_poll: Duration,
    /// Waiting FetchTask calls allowed at once on one replica; more get RESOURCE_EXHAUSTED.
    #[arg(
        long = "fetch-max-waiters",
        env = "DISPATCH_FETCH_MAX_WAITERS",
        default_value_t = 10_000
    )]
    pub max_waiters: usize,
    /// How long a scan hint (where the last pass stopped meeting only blocked tasks) is trusted
    /// before a background walk re-reads the queue from its head and renews it (walks are
    /// spaced by at least ten times the last walk's duration; no fetch waits for one); it is
    /// dropped at once when a resource it relies on changes through the broker. Bounds how late
    /// a change made outside the broker is seen. Also how long fair dispatch's carried tasks
    /// (the rest of a directed page, and pages read ahead) are used. 0 disables hints, carried
    /// tasks and reading ahead.
    #[arg(long = "fetch-hint-max-age", env = "DISPATCH_FETCH_HINT_MAX_AGE", default_value = "1s", value_parser = parse_duration)]
    pub hint_max_age: Duration,
    /// Keep every incomplete task in memory, per resource in queue order (about 200 bytes a
    /// task), so that a fetch without a scan hint starts at the first task that can be ready
    /// instead of reading the queue from its head through every blocked task. `false` reads from
    /// the head (and saves the memory).
    #[arg(
        long = "fetch-resource-queues",
        env = "DISPATCH_FETCH_RESOURCE_QUEUES",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub resource_queues: bool,
    /// Candidate rows read in the first page of a fetch; later pages double.
    #[arg(long = "fetch-page", env = "DISPATCH_FETCH_PAGE", default_value_t = 8)]
    pub page: i64,
    /// Shared scans: how many other waiting FetchTask calls one pass over the queue may serve
    /// besides its own (each under its own lease, oldest task to the longest waiter). 0 turns
    /// sharing off: every waiter then makes its own pass when its turn comes.
    #[arg(
        long = "fetch-share",
        env = "DISPATCH_FETCH_SHARE",
        default_value_t = 64,
        value_parser = clap::value_parser!(u64).range(0..=1000)
    )]
    pub share: u64,
    /// Passes over the queue one replica runs at once. A FetchTask with a `wait` that arrives,
    /// or whose turn comes, while that many run waits for them instead: a running pass may
    /// serve it, and the next turn comes when one ends. Under load calls combine (one scan, many
    /// grants) instead of each reading the queue and racing the others for its head. A call
    /// with no `wait` always makes its own pass. 0: no limit. Needs `--fetch-share` above 0.
    #[arg(
        long = "fetch-passes",
        env = "DISPATCH_FETCH_PASSES",
        default_value_t = 1,
        value_parser = clap::value_parser!(u64).range(0..=1000)
    )]
    pub passes: u64,
    /// How long a running pass holds up the calls that wait for it (see `--fetch-passes`). A
    /// pass still running after this (a claim waiting on a row lock, a slow backend) no longer
    /// counts: the next waiter makes a pass of its own. A call whose `wait` is shorter never
    /// waits for a running pass.
    #[arg(long = "fetch-pass-stall", env = "DISPATCH_FETCH_PASS_STALL", default_value = "100ms", value_parser = parse_duration)]
    pub pass_stall: Duration,
}

/// Options of `migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// Task store.
    #[command(flatten)]
    pub postgres: PostgresArgs,
    /// On an existing database (e.g. Pulp's), also build the lane gauge's index
    /// `dispatch_lanes_idx` (CREATE INDEX CONCURRENTLY: writers are not blocked). A fresh database
    /// gets it anyway.
    #[arg(long)]
    pub lanes_index: bool,
    /// On an existing database (e.g. Pulp's), also build fair dispatch's indexes
    /// `dispatch_groups_idx` and `dispatch_immediate_idx` (CREATE INDEX CONCURRENTLY). Without
    /// them tasks are handed out in queue order: no shares among domains and no express lane
    /// (caps and the reserve still hold). A fresh database gets them anyway.
    #[arg(long)]
    pub fair_indexes: bool,
    /// On an existing database (e.g. Pulp's), also install the trigger that notifies waiting
    /// fetches of inserted tasks (`dispatch_task_notify`). Pulp's own dispatch() already
    /// notifies `pulp_worker_wakeup`, which the broker also listens on. A fresh database gets it.
    #[arg(long)]
    pub notify_trigger: bool,
    /// On an existing database (e.g. Pulp's), turn off the pending list of the GIN index on
    /// reserved resources (`ALTER INDEX ... SET (fastupdate = off)`, a storage parameter: the
    /// index's definition is unchanged). A fresh database gets it.
    #[arg(long)]
    pub gin_fastupdate_off: bool,
}

/// What one request may carry. A request over a limit is refused with a status naming the option
/// and changes nothing.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct LimitArgs {
    /// Largest request message, in bytes. A larger one is refused (RESOURCE_EXHAUSTED) before
    /// it is read.
    #[arg(long = "max-message-bytes", env = "DISPATCH_MAX_MESSAGE_BYTES", default_value_t = 1 << 20)]
    pub message_bytes: usize,
    /// Most `skip_task_ids` in one FetchTask, and most `undelivered` grants in one Heartbeat.
    #[arg(
        long = "max-skip-ids",
        env = "DISPATCH_MAX_SKIP_IDS",
        default_value_t = 1000
    )]
    pub skip_ids: usize,
    /// Longest worker name, versions component or version, in bytes.
    #[arg(
        long = "max-name-bytes",
        env = "DISPATCH_MAX_NAME_BYTES",
        default_value_t = 256
    )]
    pub name_bytes: usize,
    /// Most components in an OpenLease's `versions`.
    #[arg(
        long = "max-versions",
        env = "DISPATCH_MAX_VERSIONS",
        default_value_t = 64
    )]
    pub versions: usize,
    /// Longest FinishTask `error` text, in bytes.
    #[arg(long = "max-error-bytes", env = "DISPATCH_MAX_ERROR_BYTES", default_value_t = 64 * 1024)]
    pub error_bytes: usize,
}

impl Default for LimitArgs {
    fn default() -> Self {
        LimitArgs {
            message_bytes: 1 << 20,
            skip_ids: 1000,
            name_bytes: 256,
            versions: 64,
            error_bytes: 64 * 1024,
        }
    }
}

/// Who may call the broker, and TLS on its gRPC port.
#[derive(Debug, Clone, Args, Default)]
pub struct SecurityArgs {
    /// File holding the bearer token every worker call must carry (`authorization: Bearer
    /// <token>`); a missing or wrong token gets UNAUTHENTICATED and does nothing. gRPC health and
    /// KEDA's scaler stay open (protect those with TLS client certificates or the network).
    /// Unset: no authentication.
    #[arg(long, env = "DISPATCH_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,
    /// The bearer token itself, instead of --auth-token-file (prefer the environment variable:
    /// a command-line value shows in the process list).
    #[arg(
        long,
        env = "DISPATCH_AUTH_TOKEN",
        hide_env_values = true,
        conflicts_with = "auth_token_file"
    )]
    pub auth_token: Option<String>,
    /// File holding the admin token: the credential of the operator's API (`dispatch.v1.Admin`:
    /// explain, leases, locks, blocked, revoke, force-release). A worker's token gets
    /// PERMISSION_DENIED there. Unset while --auth-token-file or --tls-client-ca is set: the
    /// admin API is off. Unset with no authentication at all: the admin API is open, like the
    /// rest (a development set-up).
    #[arg(long, env = "DISPATCH_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// The admin token itself, instead of --admin-token-file.
    #[arg(
        long,
        env = "DISPATCH_ADMIN_TOKEN",
        hide_env_values = true,
        conflicts_with = "admin_token_file"
    )]
    pub admin_token: Option<String>,
    /// Client-certificate names (subject CN or DNS SAN) that are admins, with mutual TLS
    /// (--tls-client-ca): such a certificate opens the admin API like the admin token; any
    /// other client certificate gets PERMISSION_DENIED there. Comma-separated in the variable.
    #[arg(
        long = "admin-client-name",
        env = "DISPATCH_ADMIN_CLIENT_NAMES",
        value_delimiter = ',',
        requires = "tls_client_ca"
    )]
    pub admin_client_names: Vec<String>,
    /// PEM certificate chain for TLS on the gRPC port (with --tls-key).
    #[arg(long, env = "DISPATCH_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, env = "DISPATCH_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle: clients must present a certificate it signed (mutual TLS).
    #[arg(long, env = "DISPATCH_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve a non-loopback --listen with no authentication at all (no worker token, no client
    /// certificates, no admin credential): every RPC and the admin API (revoke, force-release)
    /// are then open to whoever reaches the port. Without it such a broker refuses to start (as
    /// Redis' protected mode does). Only where the network lets trusted clients alone reach it.
    #[arg(long, env = "DISPATCH_ALLOW_UNAUTHENTICATED")]
    pub allow_unauthenticated: bool,
}

impl SecurityArgs {
    /// Whether any caller must show a credential: a worker token, a client certificate (mutual
    /// TLS) or an admin credential.
    pub fn authenticates(&self) -> bool {
        self.auth_token_file.is_some()
            || self.auth_token.is_some()
            || self.tls_client_ca.is_some()
            || self.admin_token_file.is_some()
            || self.admin_token.is_some()
    }
}

/// Whether a broker listening on `listen` with `security` is open to other hosts with nothing to
/// stop them: a non-loopback address, no credential required, and no --allow-unauthenticated.
pub fn exposed_without_authentication(listen: SocketAddr, security: &SecurityArgs) -> bool {
    !listen.ip().to_canonical().is_loopback()
        && !security.authenticates()
        && !security.allow_unauthenticated
}

/// Options of `health`.
#[derive(Debug, Clone, Args)]
pub struct HealthArgs {
    /// Address and TLS.
    #[command(flatten)]
    pub broker: BrokerAddrArgs,
    /// How long to wait for an answer.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// The health service to ask: "" (the default) is readiness (lock state known, backends
    /// answering); "dispatch.v1.Broker" is liveness (the process serves).
    #[arg(long, default_value = "")]
    pub service: String,
}

/// Parses "30s", "500ms", "2m", "1h".
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 30s or 500ms: {e}"))
}

impl ServeArgs {
    /// Checks what clap cannot; the error is one line naming the option.
    pub fn validate(&self) -> Result<(), String> {
        let l = &self.limits;
        if [
            l.message_bytes,
            l.skip_ids,
            l.name_bytes,
            l.versions,
            l.error_bytes,
        ]
        .contains(&0)
        {
            return Err(
                "--max-message-bytes, --max-skip-ids, --max-name-bytes, --max-versions and \
                 --max-error-bytes must be at least 1"
                    .into(),
            );
        }
        if l.error_bytes >= l.message_bytes {
            return Err(format!(
                "--max-error-bytes {} must be less than --max-message-bytes {}",
                l.error_bytes, l.message_bytes
            ));
        }
        let prefix = &self.redis.key_prefix;
        if prefix.is_empty() || prefix.contains(['{', '}']) || prefix.contains(char::is_whitespace)
        {
            return Err(format!(
                "--redis-key-prefix {prefix:?} must be non-empty, without braces or spaces"
            ));
        }
        if self.lease.min_ttl.is_zero()
            || self.lease.min_ttl > self.lease.ttl
            || self.lease.ttl > self.lease.max_ttl
        {
            return Err(format!(
                "lease TTLs must satisfy 0 < --lease-min-ttl ({:?}) <= --lease-ttl ({:?}) <= --lease-max-ttl ({:?})",
                self.lease.min_ttl, self.lease.ttl, self.lease.max_ttl
            ));
        }
        if self.fetch.page < 1 || self.fetch.page > 10_000 {
            return Err(format!(
                "--fetch-page {} must be between 1 and 10000",
                self.fetch.page
            ));
        }
        if self.fetch.recheck.is_zero()
            || self.fetch.wake_poll.is_zero()
            || self.fetch.pass_stall.is_zero()
        {
            return Err(
                "--fetch-recheck, --fetch-wake-poll and --fetch-pass-stall must be positive"
                    .to_owned(),
            );
        }
        if self.fetch.wake_poll > self.fetch.recheck {
            return Err(format!(
                "--fetch-wake-poll ({:?}) must not be longer than --fetch-recheck ({:?}): the safety \
                 tick is checked at each poll",
                self.fetch.wake_poll, self.fetch.recheck
            ));
        }
        if self.fetch.max_waiters == 0 || self.max_requests_per_connection == 0 {
            return Err(
                "--fetch-max-waiters and --max-requests-per-connection must be at least 1"
                    .to_owned(),
            );
        }
        if self.postgres.pool_size == 0 || self.redis.pool_size == 0 {
            return Err("pool sizes must be at least 1".to_owned());
        }
        if self.lanes.interval.is_zero() || self.lanes.refresh.is_zero() {
            return Err("--lane-interval and --lane-refresh must be positive".to_owned());
        }
        if self.sweep_interval.is_zero() {
            return Err("--sweep-interval must be positive".to_owned());
        }
        if self.backend_timeout.is_zero() {
            return Err("--backend-timeout must be positive".to_owned());
        }
        if exposed_without_authentication(self.listen, &self.security) {
            return Err(format!(
                "--listen {} is reachable from other hosts but no authentication is configured: \
                 anyone who reaches it could take, cancel and force-release tasks; set \
                 --auth-token-file (DISPATCH_AUTH_TOKEN_FILE), --tls-client-ca or \
                 --admin-token-file, or pass --allow-unauthenticated \
                 (DISPATCH_ALLOW_UNAUTHENTICATED=true) if only trusted clients can reach it",
                self.listen
            ));
        }
        Ok(())
    }

    /// Options for a broker on the given URLs with every default (tests, demo).
    pub fn with_urls(postgres_url: &str, redis_url: &str) -> Self {
        let cli = Cli::parse_from(
            std::iter::once("dispatch-broker".to_owned()).chain(Self::command_line(
                postgres_url,
                redis_url,
                "127.0.0.1:0",
            )),
        );
        match cli.command {
            Command::Serve(args) => *args,
            _ => unreachable!("parsed a serve command line"),
        }
    }

    /// The arguments of `serve` on the given URLs, listening on `listen` (metrics on a free
    /// loopback port), every other option at its default: for [`ServeArgs::with_urls`] and for
    /// the broker run as a process by the test kit.
    pub fn command_line(postgres_url: &str, redis_url: &str, listen: &str) -> Vec<String> {
        [
            "serve",
            "--postgres-url",
            postgres_url,
            "--redis-url",
            redis_url,
            "--listen",
            listen,
            "--metrics-listen",
            "127.0.0.1:0",
        ]
        .map(String::from)
        .to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    /// docs/configuration.md lists every subcommand's options exactly, each with its environment
    /// variable (or `none`), so the reference cannot drift from the command line.
    #[test]
    fn the_configuration_reference_lists_every_option_and_variable() {
        let cli = Cli::command();
        let mut real = std::collections::BTreeMap::new();
        real.insert(
            "global".to_string(),
            dispatch_testkit::reference::command_options(&cli, true),
        );
        for sub in cli.get_subcommands() {
            real.insert(
                sub.get_name().to_string(),
                dispatch_testkit::reference::command_options(sub, false),
            );
            // `fairness set`: a section of its own.
            for nested in sub.get_subcommands().filter(|n| n.get_name() != "help") {
                real.insert(
                    format!("{} {}", sub.get_name(), nested.get_name()),
                    dispatch_testkit::reference::command_options(nested, false),
                );
            }
        }
        real.retain(|_, table| !table.is_empty());
        let doc = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/docs/configuration.md"
        ))
        .expect("docs/configuration.md");
        let (broker, _) = dispatch_testkit::reference::parts(&doc);
        assert_eq!(
            dispatch_testkit::reference::documented_options(broker),
            real,
            "docs/configuration.md (left) against the command line (right): option and variable"
        );
    }

    #[test]
    fn the_auth_token_and_its_file_exclude_each_other() {
        let both = Cli::try_parse_from([
            "dispatch-broker",
            "serve",
            "--postgres-url",
            "postgres://x",
            "--redis-url",
            "redis://x",
            "--auth-token",
            "t",
            "--auth-token-file",
            "/f",
        ]);
        assert!(both.is_err());
    }

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        let mut args = ServeArgs::with_urls("postgres://x", "redis://x");
        assert_eq!(args.lease.ttl, Duration::from_secs(30));
        assert!(args.validate().is_ok());
        args.redis.key_prefix = "{bad}".into();
        assert!(args.validate().unwrap_err().contains("--redis-key-prefix"));
        let mut args = ServeArgs::with_urls("postgres://x", "redis://x");
        args.lease.min_ttl = Duration::from_secs(60);
        assert!(args.validate().unwrap_err().contains("--lease-min-ttl"));
    }

    #[test]
    fn a_non_loopback_listen_needs_authentication_or_the_flag() {
        let refused = |listen: &str, tweak: &dyn Fn(&mut SecurityArgs)| {
            let mut args = ServeArgs::with_urls("postgres://x", "redis://x");
            args.listen = listen.parse().unwrap();
            tweak(&mut args.security);
            args.validate().err()
        };
        let e = refused("0.0.0.0:50051", &|_| {}).expect("refused on 0.0.0.0");
        assert!(e.contains("--allow-unauthenticated"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
        assert!(refused("[::]:50051", &|_| {}).is_some());
        assert!(refused("10.1.2.3:50051", &|_| {}).is_some());
        for loopback in [
            "127.0.0.1:50051",
            "127.1.2.3:1",
            "[::1]:50051",
            "[::ffff:127.0.0.1]:1",
        ] {
            assert_eq!(refused(loopback, &|_| {}), None, "{loopback}");
        }
        let path = || Some(PathBuf::from("/f"));
        let ways: [&dyn Fn(&mut SecurityArgs); 6] = [
            &|s| s.allow_unauthenticated = true,
            &|s| s.auth_token_file = path(),
            &|s| s.auth_token = Some("t".into()),
            &|s| s.admin_token_file = path(),
            &|s| s.admin_token = Some("t".into()),
            &|s| {
                s.tls_cert = path();
                s.tls_key = path();
                s.tls_client_ca = path();
            },
        ];
        for way in ways {
            assert_eq!(refused("0.0.0.0:50051", way), None);
        }
        // TLS alone authenticates nobody.
        assert!(refused("0.0.0.0:50051", &|s| {
            s.tls_cert = path();
            s.tls_key = path();
        })
        .is_some());
    }

    #[test]
    fn old_variable_names_stand_in_for_current_ones_that_are_unset() {
        let addr = |vars: &[(&str, &str)], argv: &[&str]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let lookup = move |name: &str| {
                vars.iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| std::ffi::OsString::from(v))
            };
            let matches = command_with(lookup).try_get_matches_from(argv).unwrap();
            match Cli::from_arg_matches(&matches).unwrap().command {
                Command::Health(h) => (h.broker.addr, h.broker.tls_domain),
                Command::Leases(l) => (l.client.broker.addr, l.client.broker.tls_domain),
                _ => unreachable!(),
            }
        };
        let old = [
            ("DISPATCH_HEALTH_ADDR", "http://old:1"),
            ("DISPATCH_HEALTH_TLS_DOMAIN", "old.example"),
        ];
        for argv in [
            &["dispatch-broker", "health"][..],
            &["dispatch-broker", "leases"],
        ] {
            assert_eq!(
                addr(&old, argv),
                ("http://old:1".into(), "old.example".into())
            );
            assert_eq!(
                addr(&[], argv),
                ("http://127.0.0.1:50051".into(), "localhost".into())
            );
        }
        // An old name only fills in for a current one the lookup does not have (the binary's
        // tests set both in a real environment); the command line wins over both.
        let both = [old[0], ("DISPATCH_ADDR", "http://new:1")];
        assert_eq!(
            addr(&both, &["dispatch-broker", "health"]).0,
            "http://127.0.0.1:50051",
            "DISPATCH_ADDR is set, so DISPATCH_HEALTH_ADDR is not read"
        );
        assert_eq!(
            addr(
                &old,
                &["dispatch-broker", "health", "--addr", "http://cli:1"]
            )
            .0,
            "http://cli:1"
        );
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("soon").unwrap_err().contains("soon"));
    }
}
