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

/// What one call of this replica recorded in the change log: each change's sequence number and
/// names, in the lock state (epoch) it was sent in, and when it was sent.
#[derive(Debug, Clone)]
pub(super) struct Noted {
    epoch: String,
    sent: std::time::Instant,
    changes: Vec<(u64, Vec<String>)>,
}

impl Noted {
    pub(super) fn new(
        epoch: String,
        sent: std::time::Instant,
        changes: Vec<(u64, Vec<String>)>,
    ) -> Noted {
        Noted {
            epoch,
            sent,
            changes,
        }
    }
}

/// The most recent calls of this replica that may have changed lock state, by their number in
/// [`Locks::changes_made`]: what each recorded in the change log, or `None` when the call does
/// not say (or failed before it could).
#[derive(Debug, Default)]
pub(super) struct Journal {
    calls: std::collections::BTreeMap<u64, Option<Noted>>,
}

/// How many calls the journal keeps.
const JOURNAL_KEEP: u64 = 256;

/// Beyond this many names changed since a hint, the hint is as good as dropped: read the log
/// (which answers "stale" there too, `lua/lease_info.lua`).
const JOURNAL_NAMES: usize = 1000;

impl Journal {
    pub(super) fn note(&mut self, made: u64, noted: Option<Noted>) {
        self.calls.insert(made, noted);
        while self.calls.len() as u64 > JOURNAL_KEEP {
            self.calls.pop_first();
        }
    }

    /// The changes calls `since_made + 1 ..= made` recorded after change `since_seq`, when each
    /// of them said what it recorded, all in lock state `epoch`, and their changes are exactly
    /// the ones after `since_seq` up to the last of them (no change made elsewhere in between).
    /// Then the change log was at the last of them (`seq`) when the call that recorded it ran,
    /// which was sent at `sent`; with no change recorded, nothing is known of the log since.
    pub(super) fn since(
        &self,
        since_made: u64,
        made: u64,
        since_seq: u64,
        epoch: &str,
    ) -> Option<OwnChanges> {
        if made.checked_sub(since_made)? > JOURNAL_KEEP {
            return None;
        }
        let mut changes: Vec<(u64, &Vec<String>, std::time::Instant)> = Vec::new();
        for n in since_made + 1..=made {
            let noted = self.calls.get(&n)?.as_ref()?;
            if noted.epoch != epoch {
                return None;
            }
            // (A change at or before the hint's was in the log when the hint was read.)
            changes.extend(
                noted
                    .changes
                    .iter()
                    .filter(|(seq, _)| *seq > since_seq)
                    .map(|(seq, names)| (*seq, names, noted.sent)),
            );
        }
        changes.sort_unstable_by_key(|c| c.0);
        let mut seq = since_seq;
        let mut sent = None;
        let mut changed = Vec::new();
        for (at, names, sent_at) in changes {
            if at != seq + 1 {
                return None;
            }
            seq = at;
            sent = Some(sent_at);
            changed.extend(names.iter().cloned());
            if changed.len() >= JOURNAL_NAMES {
                return None;
            }
        }
        Some(OwnChanges { seq, changed, sent })
    }
}

/// The changes this replica's own calls made since a scan hint was read, as [`Journal::since`]
/// found them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnChanges {
    /// The change sequence after them (the hint's own when they recorded none).
    pub seq: u64,
    /// Their names, as the change log records them.
    pub changed: Vec<String>,
    /// When the call that recorded the last of them was sent (`None`: none recorded).
    pub sent: Option<std::time::Instant>,
}

impl Locks {
    /// The changes this replica's calls `since_made + 1 ..= made` (see [`Locks::changes_made`])
    /// recorded after change `since_seq`, when they alone changed the log since then and each
    /// said what it recorded: a scan hint read at `since_seq` then holds as if the log had been
    /// read, without reading it (see [`Journal::since`]).
    pub fn own_changes(
        &self,
        since_made: u64,
        made: u64,
        since_seq: u64,
        epoch: &str,
    ) -> Option<OwnChanges> {
        let journal = self.known.journal.lock().unwrap_or_else(|e| e.into_inner());
        journal.since(since_made, made, since_seq, epoch)
    }

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
        self.run_noting(&invocation, |(seq, epoch): (i64, String)| {
            let noted = match u64::try_from(seq) {
                Ok(seq) if seq > 0 => vec![(seq, names.iter().map(|n| n.to_string()).collect())],
                _ => Vec::new(),
            };
            Ok(((), epoch, noted))
        })
        .await
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn noted(epoch: &str, sent: Instant, changes: &[(u64, &[&str])]) -> Option<Noted> {
        Some(Noted::new(
            epoch.to_owned(),
            sent,
            changes
                .iter()
                .map(|(seq, names)| (*seq, names.iter().map(|n| n.to_string()).collect()))
                .collect(),
        ))
    }

    #[test]
    fn the_calls_own_changes_stand_for_the_log_when_they_are_all_of_it() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_millis(5);
        let mut j = Journal::default();
        // Two finish batches (ended in the other order) and a release that found nothing held.
        j.note(4, noted("e", t1, &[(12, &["b"])]));
        j.note(5, noted("e", t0, &[(10, &["a", "shared:d"]), (11, &["c"])]));
        j.note(6, noted("e", t1 + Duration::from_millis(5), &[]));
        let own = j.since(3, 6, 9, "e").expect("all of it");
        assert_eq!(own.seq, 12);
        assert_eq!(own.changed, vec!["a", "shared:d", "c", "b"]);
        assert_eq!(
            own.sent,
            Some(t1),
            "sent with the call that recorded the last"
        );
        // Nothing recorded: the hint's own sequence, and nothing known of the log since.
        let none = j.since(5, 6, 11, "e").expect("no change");
        assert_eq!((none.seq, none.changed.len(), none.sent), (11, 0, None));
        // No call since the hint.
        assert_eq!(j.since(6, 6, 12, "e").map(|o| o.seq), Some(12));
    }

    #[test]
    fn a_change_made_elsewhere_or_a_call_that_did_not_say_means_reading_the_log() {
        let t = Instant::now();
        let mut j = Journal::default();
        j.note(1, noted("e", t, &[(10, &["a"])]));
        j.note(2, noted("e", t, &[(12, &["b"])]));
        assert_eq!(j.since(0, 2, 9, "e"), None, "11 was made elsewhere");
        assert_eq!(j.since(0, 1, 8, "e"), None, "9 was made elsewhere");
        j.note(3, None);
        assert_eq!(j.since(2, 3, 12, "e"), None, "a call that did not say");
        let mut gone = Journal::default();
        gone.note(1, noted("e", t, &[(10, &["a"])]));
        assert_eq!(gone.since(0, 2, 9, "e"), None, "a call not in the journal");
        let many: Vec<&str> = vec!["n"; JOURNAL_NAMES];
        gone.note(2, noted("e", t, &[(11, &many)]));
        assert_eq!(
            gone.since(1, 2, 10, "e"),
            None,
            "as many names as a stale log"
        );
        assert_eq!(j.since(0, 1, 9, "other"), None, "another lock state");
        assert_eq!(j.since(2, 1, 9, "e"), None, "the count went back");
        // A call that ended after the hint was read, whose change the read already saw.
        assert_eq!(
            j.since(0, 2, 10, "e").map(|o| o.seq),
            None,
            "11 still missing"
        );
        j.note(4, noted("e", t, &[(11, &["c"])]));
        assert_eq!(
            j.since(3, 4, 10, "e").map(|o| o.changed),
            Some(vec!["c".to_owned()])
        );
        let mut k = Journal::default();
        k.note(1, noted("e", t, &[(10, &["a"])]));
        k.note(2, noted("e", t, &[(11, &["b"])]));
        assert_eq!(
            k.since(0, 2, 10, "e").map(|o| (o.seq, o.changed)),
            Some((11, vec!["b".to_owned()])),
            "10 was in the log the hint was read against"
        );
    }

    #[test]
    fn the_journal_keeps_the_latest_calls_only() {
        let t = Instant::now();
        let mut j = Journal::default();
        for n in 1..=JOURNAL_KEEP + 10 {
            j.note(n, noted("e", t, &[(n, &["x"])]));
        }
        assert_eq!(j.since(0, JOURNAL_KEEP + 10, 0, "e"), None);
        let own = j.since(10, JOURNAL_KEEP + 10, 10, "e").expect("kept");
        assert_eq!(own.seq, JOURNAL_KEEP + 10);
    }
}
