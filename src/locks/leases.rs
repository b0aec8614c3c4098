//! Leases: opening one (or adopting a rebuilt one's tasks), heartbeats, ending one (closed,
//! expired or revoked) and the sweeper's list of expired ones.

use super::*;
use uuid::Uuid;

/// A lease as the lock store keeps it.
#[derive(Debug, Clone)]
pub struct LeaseRecord {
    /// Expiry in ms since the epoch, by Redis server time.
    pub expires_at_ms: i64,
    /// The `core_appstatus` row the lease claims tasks for.
    pub app_status_id: String,
    /// The worker's component versions.
    pub versions: BTreeMap<String, String>,
    /// The worker's name.
    pub worker_name: String,
}

/// A lease a heartbeat extended.
#[derive(Debug, Clone)]
pub struct Beaten {
    /// Its new expiry (Redis server time, ms).
    pub expires_ms: i64,
    /// The core_appstatus row it claims tasks for.
    pub app_status: String,
    /// Its TTL.
    pub ttl: std::time::Duration,
    /// Every task it holds locks for, with the fencing token.
    pub held: Vec<(TaskId, FencingToken)>,
}

/// What a lease is opened with.
#[derive(Debug, Clone)]
pub struct NewLease<'a> {
    /// The new lease's id.
    pub lease_id: LeaseId,
    /// Time to live.
    pub ttl: Duration,
    /// The worker's name.
    pub worker_name: &'a str,
    /// The `core_appstatus` row it claims tasks for.
    pub app_status_id: &'a str,
    /// Whether the broker created that row (and so removes it when the lease ends).
    pub owns_app_status: bool,
    /// The worker's component versions.
    pub versions: &'a BTreeMap<String, String>,
    /// Whether it takes over the locks a rebuild of lost lock state made for its row.
    pub adopt: bool,
    /// The client's id for this open, the same in its retries: a retry answers the lease the
    /// first call opened, while it lives.
    pub open_id: Option<Uuid>,
}

/// What opening a lease came to.
#[derive(Debug, Clone)]
pub enum Opening {
    /// A lease, new or (for a retry of the same open) the one opened before.
    Opened(Opened),
    /// The open id opened a lease for another `core_appstatus` row (this one's).
    OtherRow(String),
}

/// An open lease, as [`Locks::open_lease`] answers it.
#[derive(Debug, Clone)]
pub struct Opened {
    /// Its id: the new one, or the one an earlier call with the same open id opened.
    pub lease_id: LeaseId,
    /// True when it is the lease an earlier call with the same open id opened.
    pub again: bool,
    /// Its expiry in ms since the epoch, by Redis server time.
    pub expires_at_ms: i64,
    /// The `core_appstatus` row it claims tasks for.
    pub app_status_id: String,
    /// Its TTL.
    pub ttl: Duration,
    /// (task, fencing token): the locks it took over from a rebuild; for a retry, every lock it
    /// holds (it has been used by no one else).
    pub tasks: Vec<(String, u64)>,
}

/// A lease whose life was just ended, and what must be cleaned up after it.
#[derive(Debug, Clone)]
pub struct Ending {
    /// Its `core_appstatus` row.
    pub app_status_id: String,
    /// Whether the broker created that row.
    pub owns_app_status: bool,
    /// The tasks it holds locks for.
    pub task_ids: Vec<String>,
}

impl Locks {
    /// Registers a new lease (taking over the locks a rebuild made for its row when
    /// `lease.adopt`), or answers a retry of the same open (`lease.open_id`) with the live lease it
    /// opened. `epoch` is the lock state to open it in (the known one, or a rebuild's).
    pub async fn open_lease_in(&self, epoch: &str, lease: &NewLease<'_>) -> Result<Opening, Error> {
        let versions = serde_json::to_string(lease.versions).unwrap_or_else(|_| "{}".into());
        let ttl_ms = lease.ttl.as_millis().clamp(1, i64::MAX as u128) as i64;
        let open_id = lease.open_id.map(|id| id.to_string());
        let mut invocation = self.scripts.open_lease.key(self.keys.epoch());
        invocation
            .key(self.keys.leases())
            .key(self.keys.lease(lease.lease_id))
            .key(self.keys.lease_tasks(lease.lease_id))
            .key(self.keys.recovered(lease.app_status_id))
            .key(self.keys.open(open_id.as_deref().unwrap_or("-")))
            .arg(epoch)
            .arg(lease.lease_id)
            .arg(ttl_ms)
            .arg(lease.worker_name)
            .arg(lease.app_status_id)
            .arg(if lease.owns_app_status { "1" } else { "0" })
            .arg(versions)
            .arg(self.keys.tag())
            .arg(if lease.adopt { "1" } else { "0" })
            .arg(if open_id.is_some() { "1" } else { "0" });
        // Taking over rebuilt locks changes lock state: counted as such (see `Locks::run`).
        let reply: Vec<Value> = if lease.adopt {
            self.run(&invocation).await?
        } else {
            self.run_reading(&invocation).await?
        };
        let bad = || protocol("open_lease", &reply);
        match reply.first() {
            Some(Value::Int(-1)) => Err(Error::Protocol {
                script: "open_lease",
                reply: format!("lease id {} already exists", lease.lease_id),
            }),
            Some(Value::Int(-2)) => Err(self.state_lost()),
            Some(Value::Int(-3)) => Ok(Opening::OtherRow(text(reply.get(1)).unwrap_or_default())),
            Some(_) => {
                let expires_at_ms = int(reply.first()).ok_or_else(bad)?;
                let lease_id = text(reply.get(1))
                    .and_then(|id| id.parse().ok())
                    .map(LeaseId)
                    .ok_or_else(bad)?;
                let app_status_id = text(reply.get(2)).ok_or_else(bad)?;
                let ttl_ms = int(reply.get(3)).ok_or_else(bad)?;
                let tasks = reply[4.min(reply.len())..]
                    .chunks(2)
                    .map(|pair| {
                        let task = text(pair.first())?;
                        let token = int(pair.get(1)).and_then(|t| u64::try_from(t).ok())?;
                        Some((task, token))
                    })
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(bad)?;
                Ok(Opening::Opened(Opened {
                    again: lease_id != lease.lease_id,
                    lease_id,
                    expires_at_ms,
                    app_status_id,
                    ttl: Duration::from_millis(u64::try_from(ttl_ms).unwrap_or(0)),
                    tasks,
                }))
            }
            None => Err(bad()),
        }
    }

    /// [`Locks::open_lease_in`] in the known lock state.
    pub async fn open_lease(&self, lease: &NewLease<'_>) -> Result<Opening, Error> {
        self.open_lease_in(&self.epoch(), lease).await
    }

    /// Extends a live lease by its TTL; `None` when the lease is unknown or expired.
    pub async fn heartbeat(&self, lease_id: LeaseId) -> Result<Option<Beaten>, Error> {
        let reply: Vec<Value> = self
            .run_reading(
                self.scripts
                    .heartbeat
                    .key(self.keys.epoch())
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .key(self.keys.lease_tasks(lease_id))
                    .arg(self.epoch())
                    .arg(lease_id)
                    .arg(self.keys.tag()),
            )
            .await?;
        match reply.first() {
            Some(Value::Int(1)) => {
                let expires = int(reply.get(1)).ok_or_else(|| protocol("heartbeat", &reply))?;
                let app_status = text(reply.get(2)).unwrap_or_default();
                let ttl_ms = int(reply.get(3)).ok_or_else(|| protocol("heartbeat", &reply))?;
                let ttl = std::time::Duration::from_millis(u64::try_from(ttl_ms).unwrap_or(0));
                let held = match reply.get(4) {
                    Some(Value::Array(pairs)) => pairs
                        .chunks(2)
                        .map(|pair| {
                            let task = text(pair.first()).and_then(|t| t.parse().ok()).map(TaskId);
                            let token = int(pair.get(1))
                                .and_then(|t| u64::try_from(t).ok())
                                .map(FencingToken);
                            task.zip(token)
                        })
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| protocol("heartbeat", &reply))?,
                    _ => return Err(protocol("heartbeat", &reply)),
                };
                Ok(Some(Beaten {
                    expires_ms: expires,
                    app_status,
                    ttl,
                    held,
                }))
            }
            Some(Value::Int(0)) => Ok(None),
            Some(Value::Int(-2)) => Err(self.state_lost()),
            _ => Err(protocol("heartbeat", &reply)),
        }
    }

    /// Reads a live lease; `None` when it is unknown or expired.
    pub async fn lease(&self, lease_id: LeaseId) -> Result<Option<LeaseRecord>, Error> {
        Ok(self
            .lease_and_changes(lease_id, None)
            .await?
            .map(|(lease, _)| lease))
    }

    /// Ends a lease's life now (no more grants or heartbeats) and returns what it held; `None`
    /// when the lease is unknown. `rotate` moves an already expired lease behind the others.
    pub async fn expire_now(
        &self,
        lease_id: LeaseId,
        rotate: bool,
    ) -> Result<Option<Ending>, Error> {
        let reply: Vec<String> = self
            .run(
                self.scripts
                    .expire_now
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .key(self.keys.lease_tasks(lease_id))
                    .arg(lease_id)
                    .arg(if rotate { "rotate" } else { "" })
                    .arg(self.keys.tag()),
            )
            .await?;
        let mut items = reply.into_iter();
        let Some(app_status_id) = items.next() else {
            return Ok(None);
        };
        let owns_app_status = items.next().as_deref() == Some("1");
        Ok(Some(Ending {
            app_status_id,
            owns_app_status,
            task_ids: items.collect(),
        }))
    }

    /// Removes a lease and releases all its locks; `None` when the lease is unknown. With a
    /// `sweeper` id, only an expired lease is closed, and only while that sweeper holds the
    /// sweeper lock (`Some(None)` otherwise: nothing changed).
    pub async fn close_lease(
        &self,
        lease_id: LeaseId,
        sweeper: Option<&str>,
    ) -> Result<Option<Option<u32>>, Error> {
        let released: i64 = self
            .run(
                self.scripts
                    .close_lease
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .key(self.keys.lease_tasks(lease_id))
                    .key(self.keys.sweeper())
                    .arg(self.keys.tag())
                    .arg(lease_id)
                    .arg(sweeper.unwrap_or("")),
            )
            .await?;
        Ok(match released {
            -1 => None,
            -3 => Some(None),
            n => Some(u32::try_from(n).ok()),
        })
    }

    /// The sweeper's turn: `Some(expired lease ids)` when `sweeper` holds (or now took) the
    /// sweeper lock, `None` when another replica does.
    pub async fn expired_leases(
        &self,
        sweeper: &str,
        lock_ttl: Duration,
        limit: usize,
    ) -> Result<Option<Vec<LeaseId>>, Error> {
        let reply: Vec<Value> = self
            .run_reading(
                self.scripts
                    .expired
                    .key(self.keys.sweeper())
                    .key(self.keys.leases())
                    .arg(sweeper)
                    .arg(lock_ttl.as_millis() as u64)
                    .arg(limit),
            )
            .await?;
        match reply.first() {
            Some(Value::Int(1)) => {
                let mut expired = Vec::new();
                for id in reply[1..].iter().filter_map(|v| text(Some(v))) {
                    match id.parse::<LeaseId>() {
                        Ok(lease_id) => expired.push(lease_id),
                        Err(_) => {
                            // Not a lease id as the broker writes them: nothing of it can
                            // be held, so only its entry goes, or it would come back every sweep.
                            tracing::warn!(entry = %id, "dropping an expiry entry that is not a lease id");
                            self.command::<i64>(
                                redis::cmd("ZREM").arg(self.keys.leases()).arg(&id),
                            )
                            .await?;
                        }
                    }
                }
                Ok(Some(expired))
            }
            Some(Value::Int(0)) => Ok(None),
            _ => Err(protocol("expired", &reply)),
        }
    }

    /// Drops a lease id from the expiry set when nothing else of it exists (a leftover).
    pub async fn forget_lease(&self, lease_id: LeaseId) -> Result<(), Error> {
        self.command::<i64>(redis::cmd("ZREM").arg(self.keys.leases()).arg(lease_id))
            .await
            .map(|_| ())
    }

    /// Live leases (not yet expired by Redis server time).
    pub async fn live_lease_count(&self) -> Result<u64, Error> {
        let reply: Vec<Value> = self.command(&redis::cmd("TIME")).await?;
        let now_ms = text(reply.first())
            .and_then(|s| s.parse::<i64>().ok())
            .map(|s| s * 1000)
            .unwrap_or(0);
        self.command(
            redis::cmd("ZCOUNT")
                .arg(self.keys.leases())
                .arg(format!("({now_ms}"))
                .arg("+inf"),
        )
        .await
    }
}
