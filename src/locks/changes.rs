//! The change log: what changed since a scan hint was taken (locks released, waiting tasks that
//! left, claims requeued), read with the lease in one call, and the counters that tell a replica
//! whether a hint read moments ago still holds.

use super::*;

/// The change recorded when a claimed task goes back to the queue is this prefix and the task's
/// id, not a resource name: a scan hint survives it and checks that task first (it may sit before
/// the hint's position). The control character keeps it apart from any resource name Pulp makes.
pub const REQUEUED_PREFIX: &str = "\u{1}requeued:";

/// The change recorded when a waiting task left the queue without a lock being released (Pulp
/// canceled it while nobody held it) is this prefix and an entry of its record (`NAME`, or
/// `shared:NAME`): it matters only to a scan hint whose passed-over tasks reserve that name, not
/// to one that relies on the name's lock still being held.
pub const LEFT_PREFIX: &str = "\u{1}left:";

/// One entry of the change log, read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change<'a> {
    /// Anything may have changed (`*`).
    All,
    /// A claimed task went back to the queue: its id, as recorded ([`REQUEUED_PREFIX`]).
    Requeued(&'a str),
    /// A waiting task that held nothing left the queue; it needed `name`, shared or not
    /// ([`LEFT_PREFIX`]).
    Left { name: &'a str, shared: bool },
    /// A lock on `name` was released, shared or exclusive.
    Released { name: &'a str, shared: bool },
}

impl<'a> Change<'a> {
    /// Reads one entry of [`Changes::changed`].
    pub fn of(entry: &'a str) -> Change<'a> {
        let split = |e: &'a str| match e.strip_prefix(crate::ready::SHARED_PREFIX) {
            Some(name) => (name, true),
            None => (e, false),
        };
        if let Some(id) = entry.strip_prefix(REQUEUED_PREFIX) {
            Change::Requeued(id)
        } else if let Some(left) = entry.strip_prefix(LEFT_PREFIX) {
            let (name, shared) = split(left);
            Change::Left { name, shared }
        } else if entry == "*" {
            Change::All
        } else {
            let (name, shared) = split(entry);
            Change::Released { name, shared }
        }
    }
}

/// What changed since a scan hint was taken.
#[derive(Debug, Clone)]
pub struct Changes {
    /// The change sequence now.
    pub seq: u64,
    /// Resource names changed since the hint (`"*"`: anything); `None` when that cannot be told
    /// (no hint, or too much changed).
    pub changed: Option<Vec<String>>,
}

impl Locks {
    /// How many calls that may have changed lock state this replica made so far. A scan hint
    /// that was checked against the change log after this last moved still holds for every
    /// change made through this replica.
    pub fn changes_made(&self) -> u64 {
        self.known.made.load(Ordering::SeqCst)
    }

    /// The change counter as last read by this replica (by [`Locks::change_seq`], which every
    /// replica polls, or with a lease), and when that read was sent.
    pub fn seq_read(&self) -> Option<(u64, std::time::Instant)> {
        self.known.seq_read.lock().ok().and_then(|r| *r)
    }

    /// Notes a read of the change counter sent at `sent`, unless a later-sent read was noted.
    pub(super) fn note_seq(&self, seq: u64, sent: std::time::Instant) {
        if let Ok(mut read) = self.known.seq_read.lock() {
            if read.is_none_or(|(_, at)| at < sent) {
                *read = Some((seq, sent));
            }
        }
    }

    /// Reads a live lease together with what changed since a scan hint's change sequence.
    pub async fn lease_and_changes(
        &self,
        lease_id: LeaseId,
        since: Option<u64>,
    ) -> Result<Option<(LeaseRecord, Changes)>, Error> {
        let sent = std::time::Instant::now();
        let reply: Vec<Value> = self
            .run_reading(
                self.scripts
                    .lease_info
                    .key(self.keys.epoch())
                    .key(self.keys.leases())
                    .key(self.keys.lease(lease_id))
                    .key(self.keys.changes())
                    .key(self.keys.change_seq())
                    .key(self.keys.change_floor())
                    .arg(self.epoch())
                    .arg(lease_id)
                    .arg(since.map(|s| s.to_string()).unwrap_or_default()),
            )
            .await?;
        match reply.first() {
            Some(Value::Int(1)) => {
                let lease = LeaseRecord {
                    expires_at_ms: int(reply.get(1))
                        .ok_or_else(|| protocol("lease_info", &reply))?,
                    app_status_id: text(reply.get(2)).unwrap_or_default(),
                    versions: text(reply.get(3))
                        .and_then(|v| serde_json::from_str(&v).ok())
                        .unwrap_or_default(),
                    worker_name: text(reply.get(4)).unwrap_or_default(),
                };
                let seq = int(reply.get(5)).unwrap_or(0).max(0) as u64;
                self.note_seq(seq, sent);
                let changed = match text(reply.get(6)).as_deref() {
                    Some("fresh") => Some(Vec::new()),
                    Some("changed") => {
                        Some(reply[7..].iter().filter_map(|v| text(Some(v))).collect())
                    }
                    _ => None,
                };
                Ok(Some((lease, Changes { seq, changed })))
            }
            Some(Value::Int(0)) => Ok(None),
            Some(Value::Int(-2)) => Err(self.state_lost()),
            _ => Err(protocol("lease_info", &reply)),
        }
    }

    /// Records that waiting tasks needing `names` may have become ready without a lock release
    /// ("*": anything may have changed).
    pub async fn note_changes(&self, names: &[&str]) -> Result<(), Error> {
        let mut invocation = self.scripts.note_changes.prepare_invoke();
        invocation.key(self.keys.changes()).arg(self.keys.tag());
        for name in names {
            invocation.arg(*name);
        }
        self.run::<i64>(&invocation).await.map(|_| ())
    }

    /// The change counter: bumped by every release, cancel and requeue, through any replica.
    pub async fn change_seq(&self) -> Result<u64, Error> {
        let sent = std::time::Instant::now();
        let seq: Option<u64> = self
            .command(redis::cmd("GET").arg(self.keys.change_seq()))
            .await?;
        let seq = seq.unwrap_or(0);
        self.note_seq(seq, sent);
        Ok(seq)
    }
}
