//! `dispatch_testkit`: throwaway PostgreSQL and Redis servers on free ports, for the test suite,
//! the benchmarks, the demo (`dispatch-demo`) and the sandbox (`dispatch-sandbox`). Not part of
//! the broker's server binary.
//!
//! Each server runs from a temporary directory that is removed with it, as a child process that a
//! test may kill and restart. When the process that started a server dies without cleaning up,
//! a small watchdog stops the server too. PostgreSQL refuses to run as root, so when we are root
//! the cluster runs as the `postgres` user.

#![forbid(unsafe_code)]

pub mod demo;
pub mod reference;
pub mod sandbox;

use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Pulp's `count_waiting_tasks_for_metric`, the straightforward way: every waiting or running
/// task (older than the cut-off) loaded at once, in `(pulp_created, pulp_id)` order, and counted
/// when no earlier task has taken its resources (two sets, as Pulp does). The oracle the lane
/// gauge is tested and benchmarked against; deliberately not the broker's `ready` code.
pub async fn reference_lanes(db: &tokio_postgres::Client) -> Result<u64, tokio_postgres::Error> {
    use std::collections::HashSet;
    let rows = db
        .query(
            "SELECT coalesce(reserved_resources_record, '{}') FROM core_task \
             WHERE state IN ('waiting', 'running') AND pulp_created < now() \
             ORDER BY pulp_created, pulp_id",
            &[],
        )
        .await?;
    let records: Vec<Vec<String>> = rows.iter().map(|r| r.get(0)).collect();
    drop(rows);
    let mut taken_exclusive: HashSet<&str> = HashSet::new();
    let mut taken_shared: HashSet<&str> = HashSet::new();
    let mut lanes = 0;
    for record in &records {
        let exclusive: Vec<&str> = record
            .iter()
            .filter(|r| !r.starts_with("shared:"))
            .map(String::as_str)
            .collect();
        let shared: Vec<&str> = record
            .iter()
            .filter_map(|r| r.strip_prefix("shared:"))
            .collect();
        let blocked = exclusive
            .iter()
            .any(|r| taken_exclusive.contains(r) || taken_shared.contains(r))
            || shared.iter().any(|r| taken_exclusive.contains(r));
        if !blocked {
            lanes += 1;
        }
        taken_exclusive.extend(exclusive);
        taken_shared.extend(shared);
    }
    Ok(lanes)
}

/// What to install when a server binary is missing.
const INSTALL_HINT: &str =
    "install PostgreSQL and Redis servers: `apt-get install -y postgresql redis-server`";

/// Finds a server binary on PATH or under /usr/lib/postgresql/*/bin.
pub fn find_binary(name: &str) -> Result<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<PathBuf> = entries.flatten().map(|e| e.path().join("bin")).collect();
        versions.sort();
        versions.reverse();
        dirs.extend(versions);
    }
    dirs.into_iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "`{name}` was not found on PATH or in /usr/lib/postgresql/*/bin; {INSTALL_HINT}"
            )
        })
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if ready() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    bail!("{what} did not come up within {timeout:?}")
}

/// Stops `pid` with `signal` once the current process has gone.
fn watchdog(pid: u32, signal: &str) {
    let me = std::process::id();
    let script = format!(
        "while kill -0 {me} 2>/dev/null; do sleep 1; done; kill -{signal} {pid} 2>/dev/null"
    );
    let _ = Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
}

fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status();
}

/// The uid and gid to run PostgreSQL as: `postgres` when we are root, else ourselves.
fn postgres_identity() -> Result<Option<(u32, u32)>> {
    let uid = String::from_utf8(Command::new("id").arg("-u").output()?.stdout)?;
    if uid.trim() != "0" {
        return Ok(None);
    }
    let id = |flag: &str| -> Result<u32> {
        let out = Command::new("id").arg(flag).arg("postgres").output()?;
        if !out.status.success() {
            bail!("running as root, and there is no `postgres` user to run PostgreSQL as; {INSTALL_HINT}");
        }
        Ok(String::from_utf8(out.stdout)?.trim().parse()?)
    };
    Ok(Some((id("-u")?, id("-g")?)))
}

/// A throwaway PostgreSQL cluster.
pub struct Postgres {
    dir: tempfile::TempDir,
    port: u16,
    identity: Option<(u32, u32)>,
    child: Option<Child>,
}

impl Postgres {
    /// initdb into a temporary directory and start the server on a free port.
    pub fn start() -> Result<Self> {
        let initdb = find_binary("initdb")?;
        find_binary("postgres")?;
        remove_stale_clusters();
        let identity = postgres_identity()?;
        let dir = tempfile::Builder::new().prefix("dispatch-pg-").tempdir()?;
        if let Some((uid, gid)) = identity {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
        }
        let data = dir.path().join("data");
        let mut cmd = Command::new(&initdb);
        cmd.arg("-D")
            .arg(&data)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some((uid, gid)) = identity {
            cmd.uid(uid).gid(gid);
        }
        let out = cmd.output().context("running initdb")?;
        if !out.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        // fsync=off: fast, and still survives the server being killed (WAL reaches the OS at
        // every commit); only an OS crash would lose data, which tests never cause. In the
        // cluster's configuration file rather than on the command line, so that a benchmark can
        // make the cluster durable as a deployment's is (`ALTER SYSTEM SET fsync = on`, then a
        // restart).
        {
            use std::io::Write as _;
            let mut conf = std::fs::OpenOptions::new()
                .append(true)
                .open(data.join("postgresql.conf"))
                .context("opening postgresql.conf")?;
            conf.write_all(b"\nfsync = off\nfull_page_writes = off\n")?;
        }
        let mut pg = Postgres {
            dir,
            port: free_port()?,
            identity,
            child: None,
        };
        pg.boot()?;
        Ok(pg)
    }

    fn boot(&mut self) -> Result<()> {
        let postgres = find_binary("postgres")?;
        let data = self.dir.path().join("data");
        let log = std::fs::File::create(self.dir.path().join("postgres.log"))?;
        if let Some((uid, gid)) = self.identity {
            std::os::unix::fs::chown(self.dir.path().join("postgres.log"), Some(uid), Some(gid))?;
        }
        let mut cmd = Command::new(postgres);
        cmd.arg("-D")
            .arg(&data)
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(self.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=300",
                "-c",
                "shared_buffers=64MB",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        if let Some((uid, gid)) = self.identity {
            cmd.uid(uid).gid(gid);
        }
        let child = cmd.spawn().context("starting postgres")?;
        watchdog(child.id(), "QUIT");
        self.child = Some(child);
        let port = self.port;
        let dir = self.dir.path().to_owned();
        wait_for("postgres", Duration::from_secs(30), || {
            self.psql_raw("postgres", "SELECT 1").is_ok()
        })
        .with_context(|| format!("see {}", dir.join("postgres.log").display()))?;
        tracing::debug!(port, "throwaway postgres up");
        Ok(())
    }

    fn psql_raw(&self, db: &str, sql: &str) -> Result<String> {
        let out = Command::new(find_binary("psql")?)
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                db,
            ])
            .args(["-v", "ON_ERROR_STOP=1", "-X", "-q", "-t", "-A", "-c", sql])
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            bail!("psql: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// Runs SQL through psql on database `db`.
    pub fn psql(&self, db: &str, sql: &str) -> Result<String> {
        self.psql_raw(db, sql)
    }

    /// Creates a database and returns its URL.
    pub fn create_database(&self, name: &str) -> Result<String> {
        self.psql_raw("postgres", &format!("CREATE DATABASE \"{name}\""))?;
        Ok(self.url(name))
    }

    /// The connection URL of database `db`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Stops the server at once (SIGQUIT: immediate shutdown, like a crash).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "QUIT");
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and data.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.boot()
    }
}

/// Removes throwaway clusters that outlived their process (a test binary's shared cluster is
/// never dropped): no live postmaster, and no log line for ten minutes, so a cluster another
/// process is restarting right now is left alone.
fn remove_stale_clusters() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_ours = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("dispatch-pg-"));
        if !is_ours {
            continue;
        }
        let live = std::fs::read_to_string(path.join("data/postmaster.pid"))
            .ok()
            .and_then(|pid| pid.lines().next()?.trim().parse::<u32>().ok())
            .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        let quiet = ["postgres.log", "data"].iter().all(|name| {
            std::fs::metadata(path.join(name))
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_none_or(|age| age > Duration::from_secs(600))
        });
        if !live && quiet {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A throwaway redis-server that keeps nothing on disk.
pub struct Redis {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
}

impl Redis {
    /// Starts redis-server on a free port.
    pub fn start() -> Result<Self> {
        let mut redis = Redis {
            dir: tempfile::Builder::new()
                .prefix("dispatch-redis-")
                .tempdir()?,
            port: free_port()?,
            child: None,
        };
        redis.boot()?;
        Ok(redis)
    }

    fn boot(&mut self) -> Result<()> {
        let server = find_binary("redis-server")?;
        let child = Command::new(server)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.dir.path().join("redis.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting redis-server")?;
        watchdog(child.id(), "KILL");
        self.child = Some(child);
        let port = self.port;
        wait_for("redis-server", Duration::from_secs(10), || ping(port))
    }

    /// The connection URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server (SIGKILL): every key is lost.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes the server (SIGSTOP): it holds its data but answers nothing until [`Redis::resume`].
    pub fn pause(&self) {
        if let Some(child) = &self.child {
            signal(child.id(), "STOP");
        }
    }

    /// Lets a paused server go on (SIGCONT).
    pub fn resume(&self) {
        if let Some(child) = &self.child {
            signal(child.id(), "CONT");
        }
    }

    /// Starts it again, empty, on the same port.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.boot()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

fn ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut reply = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}

/// A broker replica run as a process of the real binary (`binary`: the test's
/// `env!("CARGO_BIN_EXE_dispatch-broker")`), so a test can kill it with SIGKILL and start it
/// again. It serves on a free port of 127.0.0.1 with its metrics on another, and appends its
/// output to `log`; it is killed when dropped.
pub struct Replica {
    port: u16,
    binary: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

impl Replica {
    /// Starts `binary serve` on `postgres_url` and `redis_url`, with `extra` options after them.
    pub fn start(
        binary: &str,
        postgres_url: &str,
        redis_url: &str,
        extra: &[&str],
        log: PathBuf,
    ) -> Result<Replica> {
        let port = free_port()?;
        let mut args = dispatch_broker::config::ServeArgs::command_line(
            postgres_url,
            redis_url,
            &format!("127.0.0.1:{port}"),
        );
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut replica = Replica {
            port,
            binary: PathBuf::from(binary),
            args,
            log,
            child: None,
        };
        replica.boot()?;
        Ok(replica)
    }

    /// Starts the process (again, after [`Replica::kill`]) with the same options and port.
    pub fn boot(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("open {}", self.log.display()))?;
        let child = Command::new(&self.binary)
            .args(&self.args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", self.binary.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Its gRPC endpoint.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The lines of its log that contain `what`.
    pub fn logged(&self, what: &str) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .map(|log| {
                log.lines()
                    .filter(|l| l.contains(what))
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use crate::reference;
    use clap::CommandFactory;

    /// docs/configuration.md's part about the demo and the sandbox lists exactly their options.
    #[test]
    fn the_configuration_reference_lists_the_demos_and_the_sandboxs_options() {
        let mut real = std::collections::BTreeMap::new();
        for cmd in [super::demo::Cli::command(), super::sandbox::Cli::command()] {
            let mut options = reference::command_options(&cmd, false);
            options.extend(reference::command_options(&cmd, true));
            real.insert(cmd.get_name().to_string(), options);
        }
        let doc = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/configuration.md"
        ))
        .expect("docs/configuration.md");
        let (_, testkit) = reference::parts(&doc);
        assert_eq!(
            reference::documented_options(testkit),
            real,
            "docs/configuration.md (left) against dispatch-demo and dispatch-sandbox (right)"
        );
    }
}
