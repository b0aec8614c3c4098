//! The lock state's identity (its epoch) and its rebuild after Redis lost its data: the locks a
//! rebuild writes, the leases it makes for workers' rows, and the lock that lets one replica at a
//! time rebuild.

use super::*;

impl Locks {
    /// The epoch this replica works in.
    pub fn epoch(&self) -> String {
        self.known
            .epoch
            .read()
            .map(|e| e.clone())
            .unwrap_or_default()
    }

    /// Adopts `epoch` as the lock state this replica works in.
    pub fn set_epoch(&self, epoch: &str) {
        if let Ok(mut known) = self.known.epoch.write() {
            *known = epoch.to_owned();
        }
    }

    /// Reports lost lock state: wakes the background loop and returns the error to answer with.
    pub(super) fn state_lost(&self) -> Error {
        self.known.lost.notify_one();
        Error::StateLost
    }

    /// Completes when a script has reported lost lock state since the last call.
    pub async fn lost(&self) {
        self.known.lost.notified().await
    }

    /// The epoch key's value in Redis, if any.
    pub async fn current_epoch(&self) -> Result<Option<String>, Error> {
        self.command(redis::cmd("GET").arg(self.keys.epoch())).await
    }

    /// Marks the epoch as being rebuilt by `owner` (who must hold the rebuild lock) and raises
    /// the fencing counter above every token handed out before; false without the lock.
    pub async fn rebuild_begin(&self, owner: &str, building: &str) -> Result<bool, Error> {
        let ok: i64 = self
            .run(
                self.scripts
                    .rebuild_begin
                    .key(self.keys.recovery())
                    .key(self.keys.epoch())
                    .key(self.keys.fence())
                    .key(self.keys.running())
                    .key(self.keys.deferred())
                    .arg(owner)
                    .arg(building)
                    .arg(self.known.max_token.load(Ordering::Relaxed)),
            )
            .await?;
        Ok(ok == 1)
    }

    /// Publishes the rebuilt state's epoch and frees the rebuild lock, only if the epoch is still
    /// `building`; false when a newer rebuild took over.
    pub async fn rebuild_end(
        &self,
        owner: &str,
        building: &str,
        epoch: &str,
    ) -> Result<bool, Error> {
        let ok: i64 = self
            .run(
                self.scripts
                    .rebuild_end
                    .key(self.keys.recovery())
                    .key(self.keys.epoch())
                    .arg(owner)
                    .arg(building)
                    .arg(epoch),
            )
            .await?;
        Ok(ok == 1)
    }

    /// Whether some replica holds the rebuild lock.
    pub async fn rebuild_locked(&self) -> Result<bool, Error> {
        let exists: i64 = self
            .command(redis::cmd("EXISTS").arg(self.keys.recovery()))
            .await?;
        Ok(exists == 1)
    }

    /// Takes the rebuild lock for `owner` (true) unless another replica holds it.
    pub async fn try_recovery_lock(&self, owner: &str, ttl: Duration) -> Result<bool, Error> {
        let set: Option<String> = self
            .command(
                redis::cmd("SET")
                    .arg(self.keys.recovery())
                    .arg(owner)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl.as_millis() as u64),
            )
            .await?;
        Ok(set.is_some())
    }

    /// Deletes every key of this prefix except the rebuild lock, the epoch, the fencing
    /// counter and the fairness overrides (only a rebuild does this, after marking the epoch,
    /// so no replica grants meanwhile; it is the one path that scans the keyspace).
    pub async fn wipe(&self) -> Result<u64, Error> {
        let mut conn = self.conn().await?;
        // The change counter is kept too, so scan-hint sequences never go backwards; and the
        // operators' overrides, which are not lock state and cannot be rebuilt from Postgres.
        let keep = [
            self.keys.recovery(),
            self.keys.epoch(),
            self.keys.fence(),
            self.keys.change_seq(),
            self.keys.fair_overrides(),
        ];
        let mut cursor: u64 = 0;
        let mut deleted = 0;
        loop {
            self.stats.redis_call();
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(self.keys.all_pattern())
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut *conn)
                .await?;
            let batch: Vec<String> = batch.into_iter().filter(|k| !keep.contains(k)).collect();
            if !batch.is_empty() {
                self.stats.redis_call();
                deleted += redis::cmd("DEL")
                    .arg(&batch)
                    .query_async::<u64>(&mut *conn)
                    .await?;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }

    /// Marks a rebuilt lease as the one to hand to the worker that reopens with `app_status_id`.
    pub async fn mark_recovered(
        &self,
        app_status_id: &str,
        lease_id: LeaseId,
    ) -> Result<(), Error> {
        self.command::<()>(
            redis::cmd("SET")
                .arg(self.keys.recovered(app_status_id))
                .arg(lease_id),
        )
        .await
    }
}
