//! The lane gauge's reads: a full count of the queue's lanes (with the survey of blocked
//! resources), and the maintained count that reads only what changed since the last one.

use super::*;

/// What one pass of the lane gauge found.
#[derive(Debug, Clone, Default)]
pub struct Survey {
    /// The lane count.
    pub lanes: u64,
    /// The resources with the most tasks waiting behind the head of their queue, most first.
    pub blocked: Vec<crate::ready::BlockedResource>,
}

/// How much a maintained lane pass may read before a full pass is the better deal.
#[derive(Debug, Clone, Copy)]
pub struct LaneReads {
    /// A repair walks at most this many pages of `lanes_page.sql` from the oldest place (the
    /// successors of most places are near), or as many as hold a 32nd of the queue the counter
    /// has seen, if more ...
    pub walk_pages: usize,
    /// ... and then looks up the users of the resources still unsettled by name (which reads
    /// every one of them): at most this many (or a quarter of the queue the counter has seen,
    /// if more), else a full pass is the better deal.
    pub lookup_users: u64,
}

impl Default for LaneReads {
    fn default() -> Self {
        LaneReads {
            walk_pages: 8,
            lookup_users: 20_000,
        }
    }
}

impl Tasks {
    /// Counts lanes: streams the records of incomplete tasks older than `cutoff` in queue order
    /// through `ready::LaneCounter`, so memory stays flat whatever the number of tasks. The same
    /// pass surveys the queues: the `keep` resources with the most tasks waiting behind them.
    pub async fn lanes(&self, cutoff: Duration, keep: usize) -> Result<Survey, Error> {
        // Tracks nothing (this counter is not maintained).
        let counter = self.count_lanes(cutoff, 0).await?;
        Ok(Survey {
            lanes: counter.lanes(),
            blocked: counter.most_blocked(keep),
        })
    }

    /// A full pass of the lane gauge: every incomplete task older than `cutoff`, in queue order,
    /// through a fresh counter that tracks at most `track_limit` tasks (what
    /// [`Tasks::maintain_lanes`] needs to bring it up to date later).
    pub async fn count_lanes(
        &self,
        cutoff: Duration,
        track_limit: usize,
    ) -> Result<LaneCounter, Error> {
        let mut client = self.client().await?;
        let tx = self.timed(client.transaction()).await?;
        // The sort of the queue happens in Postgres (without dispatch_lanes_idx); give it room to
        // stay in memory.
        // A background pass, not an RPC's statement: the backend timeout, meant for calls a
        // client waits on, would stop it on a large queue (about 1.3 s for 1,000,000 tasks on
        // Pulp's database, past the default 1.6 s at the next burst), and the gauge would then
        // never be counted again.
        self.timed(tx.batch_execute(&format!(
            "SET LOCAL work_mem = '64MB'; SET LOCAL enable_seqscan = on; \
             SET LOCAL statement_timeout = {}; {}",
            FULL_PASS_LIMIT.as_millis(),
            sql::ORDERED_SCANS
        )))
        .await?;
        let mut counter = LaneCounter::with_track_limit(track_limit);
        // Before the queue is read: a writer that starts later stamps its tasks after the cut-off.
        self.check_late(&tx, &mut counter, cutoff).await?;
        self.feed_newer(&tx, &mut counter, cutoff, None).await?;
        self.timed(tx.commit()).await?;
        Ok(counter)
    }

    /// Brings a counter from an earlier pass up to date without reading the whole queue (see
    /// `ready::counter`): which tracked tasks ended, the tasks that take over their places (a
    /// short walk of the queue from the oldest place, then a look-up by name for the resources
    /// whose successor is further), and the tasks newer than the counter's last one, all in one
    /// snapshot. `None` when that would read about as much as a full pass (too many places to
    /// repair), or the counter cannot be maintained (tracking overflowed, a late writer, no
    /// `dispatch_lanes_idx`): count afresh with [`Tasks::count_lanes`]. On an error the counter
    /// is lost too.
    pub async fn maintain_lanes(
        &self,
        mut counter: LaneCounter,
        cutoff: Duration,
        reads: LaneReads,
    ) -> Result<Option<LaneCounter>, Error> {
        if !counter.maintainable() {
            return Ok(None);
        }
        // A counter that has seen no task yet takes every task as an arrival.
        let watermark = counter.watermark().unwrap_or((0, TaskId::NIL));
        let upto = key_bound(watermark);
        let mut client = self.client().await?;
        let gone_statement = client.prepare_cached(sql::LANES_GONE).await?;
        // Before the snapshot is taken: a writer that starts later stamps its tasks after the
        // cut-off.
        self.check_late(&client, &mut counter, cutoff).await?;
        let tx = self
            .timed(
                client
                    .build_transaction()
                    .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                    .read_only(true)
                    .start(),
            )
            .await?;
        self.timed(tx.batch_execute(sql::ORDERED_SCANS)).await?;
        let tracked: Vec<TaskId> = counter.tracked_ids().collect();
        let gone: Vec<TaskId> = self
            .timed(tx.query(&gone_statement, &[&tracked]))
            .await?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()?;
        let mut repair = counter.gone(&gone);
        if !self
            .feed_repair(&tx, &mut repair, counter.seen(), watermark, reads)
            .await?
        {
            return Ok(None);
        }
        counter.repair(repair);
        self.feed_newer(&tx, &mut counter, cutoff, Some(upto))
            .await?;
        self.timed(tx.commit()).await?;
        Ok(Some(counter))
    }

    /// Feeds a repair the tasks that take over the places it repairs, up to the counter's
    /// `watermark`: a walk of the queue from the oldest place
    /// (`lanes_page.sql`; successors are usually near), then a look-up by name
    /// (`lanes_users.sql`) for the resources still unsettled, from where the walk stopped.
    /// False when the look-up would read more than `reads` allows (a full pass is the better
    /// deal). `seen`: the tasks the counter has seen (the queue's size, roughly).
    pub(super) async fn feed_repair(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        repair: &mut Repair,
        seen: u64,
        watermark: Key,
        reads: LaneReads,
    ) -> Result<bool, Error> {
        use futures::TryStreamExt;
        let upto = key_bound(watermark);
        let page_statement = tx.prepare_cached(sql::LANES_PAGE).await?;
        let users_statement = tx.prepare_cached(&sql::LANES_USERS).await?;
        if let Some(mut at) = repair.from() {
            // Walk the queue from the oldest place: the successors of most places are near.
            let mut pages = 0;
            let most = if reads.walk_pages == 0 {
                0
            } else {
                reads.walk_pages.max((seen / 32) as usize / LANE_PAGE_ROWS)
            };
            while repair.unsettled().next().is_some() && pages < most {
                pages += 1;
                let (at_created, at_id) = key_bound(at);
                let rows = self
                    .timed(tx.query(&page_statement, &[&at_created, &at_id, &upto.0, &upto.1]))
                    .await?;
                for row in &rows {
                    let (key, record, class) = classed_lane_row(row)?;
                    repair.feed_classed(key, &record, class);
                    at = key;
                }
                if rows.len() < LANE_PAGE_ROWS {
                    at = watermark;
                    break;
                }
            }
            // The rest by name, from where the walk stopped.
            let unsettled: Vec<(String, u32)> = repair
                .unsettled()
                .map(|(n, users)| (n.to_owned(), users))
                .collect();
            if !unsettled.is_empty() && at < watermark {
                let users: u64 = unsettled.iter().map(|(_, u)| u64::from(*u)).sum();
                if users > reads.lookup_users.max(seen / 4) {
                    return Ok(false);
                }
                let names = || unsettled.iter().map(|(n, _)| n.as_str());
                let mut rest = repair.take(names());
                let entries = Repair::entries(names());
                self.timed(tx.batch_execute(sql::LOOKUP_BY_NAME)).await?;
                let rows = self
                    .timed(tx.query_raw(&users_statement, [&entries as &(dyn ToSql + Sync)]))
                    .await?;
                let mut rows = std::pin::pin!(rows);
                while let Some(row) = rows.try_next().await? {
                    let (key, record, class) = classed_lane_row(&row)?;
                    if key > at && key <= watermark {
                        rest.feed_classed(key, &record, class);
                    }
                }
                repair.merge(rest);
                self.timed(tx.batch_execute(sql::ORDERED_SCANS)).await?;
            }
        }
        Ok(true)
    }

    /// Invalidates `counter` when a task could still appear behind its watermark
    /// (`lanes_late.sql`): a maintained pass would never see it, so the next one is full.
    pub(super) async fn check_late(
        &self,
        tx: &impl deadpool_postgres::GenericClient,
        counter: &mut LaneCounter,
        cutoff: Duration,
    ) -> Result<(), Error> {
        let statement = tx.prepare_cached(sql::LANES_LATE).await?;
        let secs = cutoff.as_secs_f64();
        let late: bool = self
            .timed(tx.query_one(&statement, &[&secs]))
            .await?
            .try_get(0)?;
        if late {
            counter.invalidate();
        }
        Ok(())
    }

    /// Feeds `counter` the incomplete tasks older than `cutoff`, all of them or (`after`) those
    /// newer than a position.
    pub(super) async fn feed_newer(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        counter: &mut LaneCounter,
        cutoff: Duration,
        after: Option<(DateTime<Utc>, TaskId)>,
    ) -> Result<(), Error> {
        use futures::TryStreamExt;
        let secs = cutoff.as_secs_f64();
        let rows = match after {
            None => {
                let statement = tx.prepare_cached(sql::LANES).await?;
                self.timed_within(
                    FULL_PASS_LIMIT,
                    tx.query_raw(&statement, [&secs as &(dyn ToSql + Sync)]),
                )
                .await?
            }
            Some((created, id)) => {
                let statement = tx.prepare_cached(sql::LANES_NEWER).await?;
                self.timed(tx.query_raw(&statement, [&secs as &(dyn ToSql + Sync), &created, &id]))
                    .await?
            }
        };
        let full = after.is_none();
        let mut rows = std::pin::pin!(rows);
        while let Some(row) = rows.try_next().await? {
            let (key, record, class) = classed_lane_row(&row)?;
            counter.push_classed(key, &record, class);
            // lanes.sql (a full pass) also says which are waiting.
            if full && row.try_get::<_, bool>(6)? {
                counter.note_waiting(class);
            }
        }
        Ok(())
    }
}
