//! Identifiers that cross modules, as types of their own so that one cannot stand in for
//! another.

use std::fmt;

use uuid::Uuid;

/// A grant's fencing token: drawn from one Redis counter, strictly increasing across all grants.
/// Only the holder presenting the current token may start, finish or release its task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub u64);

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A lease's id: a random UUID, new for every lease, so a restarted worker never inherits a dead
/// incarnation's locks. Redis keys and the proto carry it as text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseId(pub Uuid);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for LeaseId {
    type Err = uuid::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(Self)
    }
}
