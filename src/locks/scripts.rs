//! The Lua scripts, compiled into the binary and loaded once at start-up.
//!
//! Each script is `lua/lib.lua` followed by the script itself, so the shared helpers (the key
//! format, server time, releasing one task) exist once.

use deadpool_redis::redis::Script;

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(
            include_str!("../../lua/lib.lua"),
            "\n",
            include_str!(concat!("../../lua/", $file))
        ))
    };
}

/// Every script the broker runs.
pub(super) struct Scripts {
    pub open_lease: Script,
    pub heartbeat: Script,
    pub lease_info: Script,
    pub acquire: Script,
    pub release: Script,
    pub force_release: Script,
    pub close_lease: Script,
    pub holder: Script,
    pub expired: Script,
    pub expire_now: Script,
    pub abort: Script,
    pub lanes_cache: Script,
    pub store_lanes: Script,
    pub rebuild_begin: Script,
    pub rebuild_end: Script,
    pub note_changes: Script,
    pub blocked_survey: Script,
    pub lock_table: Script,
    pub lease_table: Script,
    pub release_orphan: Script,
    pub standing: Script,
    pub recount: Script,
    pub fair_override: Script,
}

impl Scripts {
    pub fn new() -> Self {
        Scripts {
            open_lease: script!("open_lease.lua"),
            heartbeat: script!("heartbeat.lua"),
            lease_info: script!("lease_info.lua"),
            acquire: script!("acquire.lua"),
            release: script!("release.lua"),
            force_release: script!("force_release.lua"),
            close_lease: script!("close_lease.lua"),
            holder: script!("holder.lua"),
            expired: script!("expired.lua"),
            expire_now: script!("expire_now.lua"),
            abort: script!("abort.lua"),
            lanes_cache: script!("lanes_cache.lua"),
            store_lanes: script!("store_lanes.lua"),
            rebuild_begin: script!("rebuild_begin.lua"),
            rebuild_end: script!("rebuild_end.lua"),
            note_changes: script!("note_changes.lua"),
            blocked_survey: script!("blocked_survey.lua"),
            lock_table: script!("lock_table.lua"),
            lease_table: script!("lease_table.lua"),
            release_orphan: script!("release_orphan.lua"),
            standing: script!("standing.lua"),
            recount: script!("recount.lua"),
            fair_override: script!("fair_override.lua"),
        }
    }

    pub fn all(&self) -> [&Script; 23] {
        [
            &self.open_lease,
            &self.heartbeat,
            &self.lease_info,
            &self.acquire,
            &self.release,
            &self.force_release,
            &self.close_lease,
            &self.holder,
            &self.expired,
            &self.expire_now,
            &self.abort,
            &self.lanes_cache,
            &self.store_lanes,
            &self.rebuild_begin,
            &self.rebuild_end,
            &self.note_changes,
            &self.blocked_survey,
            &self.lock_table,
            &self.lease_table,
            &self.release_orphan,
            &self.standing,
            &self.recount,
            &self.fair_override,
        ]
    }
}
