//! Keeps the pending list of the GIN index on reserved resources short.
//!
//! Every readiness look-up is a search of Pulp's partial GIN index `pulp_task_resources_index`,
//! and every GIN search reads the index's whole pending list (`fastupdate`, on by default, up to
//! `gin_pending_list_limit`, 4 MB, until a vacuum merges it). Under Pulp's live traffic (tasks
//! inserted, claimed, started and finished all the time) that list is never short, and one page
//! of candidates costs tens of milliseconds. This loop merges it every `--gin-clean-interval`
//! (`gin_clean.sql`), so no schema change is needed for a flat fetch; at idle (cleans that merge
//! nothing) it spaces out to eight intervals, until a task notification. `migrate
//! --gin-fastupdate-off` removes the pending list instead (then this loop finds nothing to do).
//!
//! Never changes an index's definition or settings. Stops, with one warning, when the broker's
//! role may not merge (only the index's owner may, as for VACUUM).

use std::time::Duration;

use crate::shutdown::Shutdown;
use crate::tasks::{Error, Tasks};

/// How many times `interval` a clean that merged nothing may wait at most for the next: 2, 4,
/// then 8 times after one, two, three or more such cleans in a row.
pub const MAX_BACKOFF: u32 = 8;

/// How long to wait before the next clean, after `quiet` cleans in a row merged nothing: the
/// interval while there is something to merge, and up to [`MAX_BACKOFF`] times it at idle.
pub fn next_wait(interval: Duration, quiet: u32) -> Duration {
    interval * 2u32.saturating_pow(quiet).min(MAX_BACKOFF)
}

/// Merges the pending lists every `interval` until shutdown (never when `interval` is zero).
/// While cleans merge nothing (no task written since), they space out up to [`MAX_BACKOFF`]
/// times the interval; a task notification (`inserted`) brings the interval back.
pub async fn keep_pending_lists_short(
    tasks: Tasks,
    interval: Duration,
    inserted: std::sync::Arc<tokio::sync::Notify>,
    shutdown: Shutdown,
) {
    if interval.is_zero() {
        return;
    }
    let mut quiet = 0u32;
    let mut next = tokio::time::Instant::now() + interval;
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            () = inserted.notified() => {
                quiet = 0;
                next = next.min(tokio::time::Instant::now() + interval);
                continue;
            }
            () = shutdown.fired() => return,
        }
        match tasks.clean_gin_pending_lists().await {
            Ok(merged) => {
                let mut any = false;
                for (index, pages) in merged {
                    if pages > 0 {
                        any = true;
                        tracing::debug!(%index, pages, "merged the GIN pending list");
                        crate::metrics::gin_pending_merged(pages as u64);
                    }
                }
                quiet = if any { 0 } else { quiet.saturating_add(1) };
            }
            Err(e) if not_permitted(&e) => {
                tracing::warn!(
                    error = %e,
                    "cannot merge the pending list of the GIN index on core_task (the broker's role does not own it); \
                     readiness look-ups read that list in full: run `dispatch-broker migrate --gin-fastupdate-off` \
                     as the owner, or give the broker the owner's role"
                );
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, "merging the GIN pending list failed; retrying next interval");
                quiet = 0;
            }
        }
        next = tokio::time::Instant::now() + next_wait(interval, quiet);
    }
}

/// True for Postgres's "must be owner" refusal.
fn not_permitted(e: &Error) -> bool {
    match e {
        Error::Db(db) => {
            db.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE)
        }
        Error::Pool(_)
        | Error::Timeout(_)
        | Error::Schema(_)
        | Error::Config(_)
        | Error::Unexpected(_)
        | Error::UnexpectedWrite(_) => false,
        Error::Batch(e) => not_permitted(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cleans_space_out_while_they_merge_nothing_up_to_eight_intervals() {
        let second = Duration::from_secs(1);
        let waits: Vec<u64> = (0..6).map(|q| next_wait(second, q).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 8, 8]);
        assert_eq!(next_wait(second, u32::MAX), second * MAX_BACKOFF);
    }
}
