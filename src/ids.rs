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

/// An id in text that is not spelled as the broker writes ids (a UUID, hyphenated, lowercase).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotAnId(pub String);

impl fmt::Display for NotAnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} is not an id as the broker writes them", self.0)
    }
}

impl std::error::Error for NotAnId {}

/// Text for the UUID ids: `Display` writes them hyphenated and lowercase, and `FromStr` reads
/// only that spelling back. Other spellings of the same UUID are refused: keys and records built
/// from the id would not be the ones such text names (Redis compares bytes).
macro_rules! uuid_text {
    ($($id:ident),*) => {$(
        impl fmt::Display for $id {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl std::str::FromStr for $id {
            type Err = NotAnId;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match Uuid::parse_str(s) {
                    Ok(id) if id.hyphenated().to_string() == s => Ok(Self(id)),
                    _ => Err(NotAnId(s.to_owned())),
                }
            }
        }
    )*};
}

uuid_text!(LeaseId, TaskId);

/// A lease's id: a random UUID, new for every lease, so a restarted worker never inherits a dead
/// incarnation's locks. Redis keys and the proto carry it as text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseId(pub Uuid);

/// A task's id: `core_task.pulp_id`. Postgres reads and writes it as a `uuid`; Redis keys,
/// records and the proto carry it as text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskId(pub Uuid);

impl TaskId {
    /// The greatest id: with a `pulp_created`, a position after every task created then.
    pub const MAX: TaskId = TaskId(Uuid::max());
    /// The least id: with a `pulp_created`, a position before every task created then.
    pub const NIL: TaskId = TaskId(Uuid::nil());
}

impl tokio_postgres::types::ToSql for TaskId {
    fn to_sql(
        &self,
        ty: &tokio_postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        self.0.to_sql(ty, out)
    }

    fn accepts(ty: &tokio_postgres::types::Type) -> bool {
        <Uuid as tokio_postgres::types::ToSql>::accepts(ty)
    }

    tokio_postgres::types::to_sql_checked!();
}

impl<'a> tokio_postgres::types::FromSql<'a> for TaskId {
    fn from_sql(
        ty: &tokio_postgres::types::Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Uuid::from_sql(ty, raw).map(Self)
    }

    fn accepts(ty: &tokio_postgres::types::Type) -> bool {
        <Uuid as tokio_postgres::types::FromSql>::accepts(ty)
    }
}
