//! The lane gauge's shared state: the lane count every replica serves, and the lock that lets
//! one replica at a time compute it.

use super::*;

impl Locks {
    /// The shared lane count: `(value, computed-at ms, now ms, surveyed-at ms)`, value `None`
    /// when none is cached, surveyed-at 0 before the first full pass.
    pub async fn lanes_cache(&self) -> Result<(Option<u64>, i64, i64, i64), Error> {
        let (value, at, now, surveyed): (i64, i64, i64, i64) = self
            .run_reading(&self.scripts.lanes_cache.key(self.keys.lanes()))
            .await?;
        Ok((u64::try_from(value).ok(), at, now, surveyed))
    }

    /// The waiting tasks by domain the last full lane pass stored (JSON), if any.
    pub async fn lanes_waiting(&self) -> Result<Option<String>, Error> {
        self.command(redis::cmd("HGET").arg(self.keys.lanes()).arg("waiting"))
            .await
    }

    /// Takes the lane-computation lock for `owner` for `ttl`; false when another replica has it.
    pub async fn try_lanes_lock(&self, owner: &str, ttl: Duration) -> Result<bool, Error> {
        let set: Option<String> = self
            .command(
                redis::cmd("SET")
                    .arg(self.keys.lanes_lock())
                    .arg(owner)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl.as_millis().max(1) as u64),
            )
            .await?;
        Ok(set.is_some())
    }

    /// Publishes a lane count and, when the pass took them, the survey of blocked resources and
    /// the waiting tasks by domain (both JSON); returns its stamp (ms, server time).
    pub async fn store_lanes(
        &self,
        lanes: u64,
        survey: Option<(&str, &str)>,
    ) -> Result<i64, Error> {
        let (blocked, waiting) = survey.unwrap_or_default();
        self.run_reading(
            self.scripts
                .store_lanes
                .key(self.keys.lanes())
                .arg(lanes)
                .arg(blocked)
                .arg(waiting),
        )
        .await
    }
}
