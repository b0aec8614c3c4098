//! The lane gauge's shared state: the lane count every replica serves, and the lock that lets
//! one replica at a time compute it.

use super::*;

impl Locks {
    /// The shared lane count: `(value, computed-at ms, now ms)`, value `None` when none is cached.
    pub async fn lanes_cache(&self) -> Result<(Option<u64>, i64, i64), Error> {
        let (value, at, now): (i64, i64, i64) = self
            .run_reading(&self.scripts.lanes_cache.key(self.keys.lanes()))
            .await?;
        Ok((u64::try_from(value).ok(), at, now))
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

    /// Publishes a lane count and, when the pass took one, the survey of blocked resources
    /// (JSON); returns its stamp (ms, server time).
    pub async fn store_lanes(&self, lanes: u64, survey: Option<&str>) -> Result<i64, Error> {
        self.run_reading(
            self.scripts
                .store_lanes
                .key(self.keys.lanes())
                .arg(lanes)
                .arg(survey.unwrap_or_default()),
        )
        .await
    }
}
