//! Keeps the pending list of the GIN index on reserved resources short.
//!
//! Every readiness look-up is a search of Pulp's partial GIN index `pulp_task_resources_index`,
//! and every GIN search reads the index's whole pending list (`fastupdate`, on by default, up to
//! `gin_pending_list_limit`, 4 MB, until a vacuum merges it). Under Pulp's live traffic (tasks
//! inserted, claimed, started and finished all the time) that list is never short, and one page
//! of candidates costs tens of milliseconds. This loop merges it every `--gin-clean-interval`
//! (`gin_clean.sql`), so no schema change is needed for a flat fetch. `migrate
//! --gin-fastupdate-off` removes the pending list instead (then this loop finds nothing to do).
//!
//! Never changes an index's definition or settings. Stops, with one warning, when the broker's
//! role may not merge (only the index's owner may, as for VACUUM).

use std::time::Duration;

use crate::shutdown::Shutdown;
use crate::tasks::{Error, Tasks};

/// Merges the pending lists every `interval` until shutdown (never when `interval` is zero).
pub async fn keep_pending_lists_short(tasks: Tasks, interval: Duration, shutdown: Shutdown) {
    if interval.is_zero() {
        return;
    }
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.fired() => return,
        }
        match tasks.clean_gin_pending_lists().await {
            Ok(merged) => {
                for (index, pages) in merged {
                    if pages > 0 {
                        tracing::debug!(%index, pages, "merged the GIN pending list");
                        crate::metrics::gin_pending_merged(pages as u64);
                    }
                }
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
                tracing::debug!(error = %e, "merging the GIN pending list failed; retrying next interval")
            }
        }
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
        | Error::Unexpected(_) => false,
    }
}
