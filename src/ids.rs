//! Identifiers that cross modules, as types of their own so that one cannot stand in for
//! another.

use std::fmt;

/// A grant's fencing token: drawn from one Redis counter, strictly increasing across all grants.
/// Only the holder presenting the current token may start, finish or release its task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(pub u64);

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
