//! Redis key names: the only place in Rust that builds them (lua/lib.lua mirrors the format).
//!
//! Every key starts with the configured prefix wrapped in braces, `{prefix}`, so all of them hash
//! to one Redis Cluster slot and every multi-key script runs unchanged on a cluster.

use crate::ids::{LeaseId, TaskId};

/// Builds the broker's Redis keys for one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    /// `{prefix}`: the hash tag every key starts with.
    tag: String,
}

impl Keys {
    /// `prefix` must be non-empty and free of braces (checked by `config`).
    pub fn new(prefix: &str) -> Self {
        Keys {
            tag: format!("{{{prefix}}}"),
        }
    }

    /// The hash-tagged prefix that scripts use to build per-resource keys.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Sorted set lease_id -> expiry (Redis server time, ms).
    pub fn leases(&self) -> String {
        format!("{}:leases", self.tag)
    }

    /// Hash describing one lease.
    pub fn lease(&self, lease_id: LeaseId) -> String {
        format!("{}:lease:{lease_id}", self.tag)
    }

    /// Set of task ids whose locks a lease holds: the per-lease registry.
    pub fn lease_tasks(&self, lease_id: LeaseId) -> String {
        format!("{}:lease:{lease_id}:tasks", self.tag)
    }

    /// Hash {lease, token, x, s}: the lock of one task.
    pub fn task(&self, task_id: TaskId) -> String {
        format!("{}:task:{task_id}", self.tag)
    }

    /// String naming the task that holds `resource` exclusively.
    pub fn exclusive(&self, resource: &str) -> String {
        format!("{}:x:{resource}", self.tag)
    }

    /// Set of the tasks that hold `resource` shared.
    pub fn shared(&self, resource: &str) -> String {
        format!("{}:s:{resource}", self.tag)
    }

    /// The fencing counter: one number, strictly increasing across all grants.
    pub fn fence(&self) -> String {
        format!("{}:fence", self.tag)
    }

    /// Every task id that holds a lock: the reconciler's list.
    pub fn locked(&self) -> String {
        format!("{}:locked", self.tag)
    }

    /// The identity of the current lock state; gone when Redis lost its data.
    pub fn epoch(&self) -> String {
        format!("{}:epoch", self.tag)
    }

    /// The sweeper lock: the id of the replica sweeping now.
    pub fn sweeper(&self) -> String {
        format!("{}:sweeper", self.tag)
    }

    /// The rebuild lock: the id of the replica rebuilding lost lock state.
    pub fn recovery(&self) -> String {
        format!("{}:recovery", self.tag)
    }

    /// The lease a rebuild made for a worker row, until the worker reopens and adopts it.
    pub fn recovered(&self, app_status_id: &str) -> String {
        format!("{}:recovered:{app_status_id}", self.tag)
    }

    /// The lease an OpenLease with this open id opened (expires with the lease's TTL).
    pub fn open(&self, open_id: &str) -> String {
        format!("{}:open:{open_id}", self.tag)
    }

    /// The shared lane count: hash {value, at}.
    pub fn lanes(&self) -> String {
        format!("{}:lanes", self.tag)
    }

    /// The lock that lets one replica at a time compute the lane count.
    pub fn lanes_lock(&self) -> String {
        format!("{}:lanes:lock", self.tag)
    }

    /// Resource name -> sequence of its last change (release, cancel, requeue): what scan hints
    /// check before they are trusted.
    pub fn changes(&self) -> String {
        format!("{}:changes", self.tag)
    }

    /// The sequence counter of [`Keys::changes`].
    pub fn change_seq(&self) -> String {
        format!("{}:changeseq", self.tag)
    }

    /// Changes at or below this sequence were trimmed from [`Keys::changes`].
    pub fn change_floor(&self) -> String {
        format!("{}:changefloor", self.tag)
    }

    /// Set while a replica hands an undelivered grant (task, fencing token) back to the queue,
    /// with a TTL: one replica at a time does it.
    pub fn returning(&self, task_id: TaskId, token: u64) -> String {
        format!("{}:returning:{task_id}:{token}", self.tag)
    }

    /// Hash group -> the number of that group's tasks holding locks (fairness: caps, shares).
    pub fn running(&self) -> String {
        format!("{}:running", self.tag)
    }

    /// The number of deferred (not immediate) tasks holding locks (fairness: the reserve).
    pub fn deferred(&self) -> String {
        format!("{}:deferred", self.tag)
    }

    /// Hash of the fairness policy's overrides made at run time (`fair::Overrides`; not lock
    /// state).
    pub fn fair_overrides(&self) -> String {
        format!("{}:fair:overrides", self.tag)
    }

    /// A pattern matching every key of this prefix (for tests and diagnostics only; the broker
    /// itself never scans the keyspace).
    pub fn all_pattern(&self) -> String {
        format!("{}:*", self.tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_carries_the_hash_tag() {
        let k = Keys::new("dispatch");
        let l = LeaseId(uuid::Uuid::nil());
        let keys = [
            k.leases(),
            k.lease(l),
            k.lease_tasks(l),
            k.task(TaskId(uuid::Uuid::nil())),
            k.exclusive("prn:core.domain:1"),
            k.shared("r"),
            k.fence(),
            k.locked(),
            k.epoch(),
            k.sweeper(),
            k.recovery(),
            k.recovered("a"),
            k.open("a"),
            k.lanes(),
            k.lanes_lock(),
            k.changes(),
            k.change_seq(),
            k.change_floor(),
            k.returning(TaskId(uuid::Uuid::nil()), 1),
            k.running(),
            k.deferred(),
            k.fair_overrides(),
            k.all_pattern(),
        ];
        // Every builder of this file is in the list (all but `new` and `tag`), so a new one
        // cannot be left out.
        let builders = include_str!("keys.rs")
            .lines()
            .filter(|l| l.trim_start().starts_with("pub fn "))
            .count();
        assert_eq!(keys.len(), builders - 2, "a key builder is missing here");
        for key in keys {
            assert!(key.starts_with("{dispatch}:"), "{key}");
        }
        assert_eq!(k.exclusive("a"), "{dispatch}:x:a");
        assert_eq!(k.shared("a"), "{dispatch}:s:a");
        assert_eq!(
            k.task(TaskId(uuid::Uuid::nil())),
            "{dispatch}:task:00000000-0000-0000-0000-000000000000"
        );
        assert_eq!(
            k.lease_tasks(l),
            "{dispatch}:lease:00000000-0000-0000-0000-000000000000:tasks"
        );
    }
}
