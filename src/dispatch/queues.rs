//! The resource queues one replica keeps (`ready::ResourceQueues`), and where a pass without a
//! scan hint starts.
//!
//! Without a hint a pass would read the queue from its head, through every task blocked behind
//! a blocked resource (100,000 on the incident's repository: 30-70 ms). The resource queues know
//! which tasks are lanes, so the pass starts just before the first lane that waits, once the
//! tasks that make the others wait (the holders) are checked to be still incomplete
//! (task_seen.sql, a primary-key probe each). Tasks the queues have not read yet are newer than
//! where they stop, so the pass reads those itself.
//!
//! They are loaded off the fetch path (queue_page.sql from the head, once at start and again
//! every minute or thirty loads' time, whichever is longer: that bounds how long a task a read
//! missed stays unknown) and kept up with arrivals (the tasks after their last position, every
//! second). Tasks that end are removed when a start finds them gone, and those this replica
//! finishes (FinishTask) at once. Memory: one entry per incomplete task (about 200 bytes).
//!
//! Never grants, locks or claims, and never decides readiness: a failure here, or queues not yet
//! loaded, only costs a pass from the head.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::ids::TaskId;

use crate::ready::{BlockedResource, Key, ResourceQueues, Seen, Start, SHARED_PREFIX};
use crate::shutdown::Shutdown;
use crate::tasks::{self, Tasks, QUEUE_PAGE_ROWS};

/// How often the background catches up with arrivals.
const CATCH_UP_EVERY: Duration = Duration::from_secs(1);
/// Loads from the head are at least this far apart, and thirty loads' time.
const RELOAD_AFTER: Duration = Duration::from_secs(60);
/// After a load that could not tell up to where it saw every task, the next is at least this far
/// away (and ten loads' time).
const RELOAD_SOON: Duration = Duration::from_secs(10);
/// How often a load asks where the queues' knowledge ends before it gives up on knowing.
const KNOWN_TRIES: usize = 3;
/// A pass with a scan hint asks for a start only when at least half of this many tasks after the
/// hint are blocked (tasks that arrived after the hint was taken, e.g. a burst for a blocked
/// repository): otherwise a start's check costs more than reading them.
const SKIP_AT_LEAST: usize = 256;
/// How many tasks the queue's head holds, for the exact look-up (see [`Queues::head_end`]).
pub const HEAD_TASKS: usize = 256;
/// Tasks inserted per hold of the queues' lock while catching up (and between yields while
/// loading).
const INSERT_CHUNK: usize = 128;
/// How many holders and lanes a start checks, round by round, while the position it finds stops
/// at one it did not check.
const CHECK_ROUNDS: [usize; 3] = [16, 128, 1024];

/// Where the queues' removals stood at some moment (see [`Queues::removals`]): which load's
/// queues, and how many tasks they had removed (None: not loaded yet).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Removals(Option<(u64, u64)>);

/// The queues and who may change them.
pub struct Queues {
    /// The request path's task store (the checks of a start).
    tasks: Tasks,
    /// The background's (loads and catch-ups), once [`Queues::run`] started.
    background: OnceLock<Tasks>,
    /// None until the first load is done.
    state: Mutex<Option<ResourceQueues>>,
    /// Counts loads: a catch-up read for older queues is not applied to newer ones.
    generation: AtomicU64,
    /// The last task a catch-up read (None: none since the last load). While an open writer
    /// keeps the queues' known position from moving, catch-ups read on from here rather than
    /// again from that position every second; once it moves, they read from the known position
    /// once more (a writer that closed may have committed tasks before what was read).
    last_read: Mutex<Option<Key>>,
    /// One load or catch-up at a time (a test's or a bench's `settle` waits for the running one
    /// instead of reading the same tasks beside it).
    reading: tokio::sync::Mutex<()>,
    /// When the background last read the task table into them (a load or a catch-up).
    read_at: Mutex<Option<Instant>>,
}

impl Queues {
    pub(super) fn new(tasks: Tasks) -> Self {
        Queues {
            tasks,
            background: OnceLock::new(),
            state: Mutex::new(None),
            generation: AtomicU64::new(0),
            last_read: Mutex::new(None),
            reading: tokio::sync::Mutex::new(()),
            read_at: Mutex::new(None),
        }
    }

    /// Reads the queues (None before the first load).
    fn read<R>(&self, f: impl FnOnce(&ResourceQueues) -> R) -> Option<R> {
        Some(f(self.state.lock().ok()?.as_ref()?))
    }

    /// Changes the queues, unless a load replaced them since `generation` (None then, or before
    /// the first load).
    fn change<R>(&self, generation: u64, f: impl FnOnce(&mut ResourceQueues) -> R) -> Option<R> {
        let mut state = self.state.lock().ok()?;
        let queues = state.as_mut()?;
        (self.generation.load(Ordering::SeqCst) == generation).then(|| f(queues))
    }

    /// The `n` resources with the most tasks behind the head of their queue (see
    /// [`ResourceQueues::most_blocked`]), and how long ago the background last read the task
    /// table into the queues. None before the first load, or when the queues are not kept.
    pub fn most_blocked(&self, n: usize) -> Option<(Vec<BlockedResource>, Duration)> {
        let age = (*self.read_at.lock().ok()?)?.elapsed();
        Some((self.read(|q| q.most_blocked(n))?, age))
    }

    fn note_read(&self) {
        if let Ok(mut at) = self.read_at.lock() {
            *at = Some(Instant::now());
        }
    }

    /// How many tasks the queues hold (None before the first load).
    pub fn task_count(&self) -> Option<usize> {
        self.read(ResourceQueues::len)
    }

    /// Says the queues are kept, loaded and caught up through `tasks` (the background's task
    /// store) by [`Queues::run`].
    pub fn keep(&self, tasks: Tasks) {
        let _ = self.background.set(tasks);
    }

    /// Loads the queues, then keeps them up with arrivals and loads them again now and then,
    /// until shutdown (nothing unless [`Queues::keep`] was called).
    pub async fn run(&self, shutdown: Shutdown) {
        if self.background.get().is_none() {
            return;
        }
        let mut next_load = Instant::now();
        let mut tick = tokio::time::interval(CATCH_UP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.fired() => return,
            }
            if Instant::now() >= next_load {
                let started = Instant::now();
                match self.load(&shutdown).await {
                    Ok(n) => {
                        self.note_read();
                        let took = started.elapsed();
                        tracing::debug!(tasks = n, ?took, "resource queues loaded");
                        next_load = Instant::now() + RELOAD_AFTER.max(took * 30);
                        if self.read(ResourceQueues::known).flatten().is_none() {
                            // Nothing known: catch-ups cannot go on from it, and passes read
                            // from the head. Sooner than usual, but not back to back.
                            let again = (took * 10).clamp(RELOAD_SOON, RELOAD_AFTER);
                            tracing::warn!(?again, "the resource queues' load cannot tell up to where it saw every task: a writer of core_task has a start this role may not read (a prepared transaction, another role's session without pg_read_all_stats, or track_activities off); loading again");
                            next_load = Instant::now() + again;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "loading the resource queues failed; passes without a scan hint read from the head until a load succeeds");
                        next_load = Instant::now() + RELOAD_AFTER;
                    }
                }
            } else {
                match self.catch_up(usize::MAX).await {
                    // (A catch-up reads nothing while nothing is known: see above.)
                    Ok(()) if self.read(ResourceQueues::known).flatten().is_some() => {
                        self.note_read()
                    }
                    Ok(()) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "catching up with arrivals failed; retrying")
                    }
                }
            }
        }
    }

    /// Waits for the first load, then reads every task that arrived since (tests use it to know
    /// what the queues hold). Returns at once when the queues are not kept ([`Queues::keep`]).
    /// A writer of core_task open at a catch-up (the sweeper's statements, a claim) holds their
    /// known position back: they catch up again until it reaches the moment of the call, for at
    /// most five seconds.
    pub async fn settle(&self) -> Result<(), tasks::Error> {
        if self.background.get().is_none() {
            return Ok(());
        }
        let asked = chrono::Utc::now().timestamp_micros();
        while self.task_count().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let give_up = Instant::now() + Duration::from_secs(5);
        loop {
            self.catch_up(usize::MAX).await?;
            let known = self.read(ResourceQueues::known).flatten();
            if known.is_some_and(|k| k.0 >= asked) || Instant::now() >= give_up {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Reads every incomplete task from the head into new queues and puts them in place.
    async fn load(&self, shutdown: &Shutdown) -> Result<usize, tasks::Error> {
        let Some(tasks) = self.background.get() else {
            return Ok(0);
        };
        let _reading = self.reading.lock().await;
        // A writer whose start cannot be read is usually gone a moment later: asked again
        // rather than loading queues that know nothing.
        let mut known = None;
        for attempt in 0..KNOWN_TRIES {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            known = tasks.queue_known().await?;
            if known.is_some() {
                break;
            }
        }
        let mut queues = ResourceQueues::default();
        let mut after: Option<Key> = None;
        loop {
            if shutdown.is_fired() {
                return Ok(0);
            }
            let rows = tasks.queue_page(after).await?;
            let full = rows.len() >= QUEUE_PAGE_ROWS;
            for chunk in rows.chunks(INSERT_CHUNK) {
                for (key, record) in chunk {
                    after = Some(*key);
                    queues.insert(*key, record);
                }
                // A million tasks take seconds of CPU: the passes on this runtime's threads go on
                // meanwhile.
                tokio::task::yield_now().await;
            }
            if !full {
                break;
            }
        }
        // Every task up to `known` had committed before the first page was read.
        if let Some(known) = known {
            queues.know_up_to(known);
        }
        let n = queues.len();
        let old = match self.state.lock() {
            Ok(mut state) => {
                self.generation.fetch_add(1, Ordering::SeqCst);
                state.replace(queues)
            }
            Err(_) => None,
        };
        // (Freed without the lock held and off the runtime's threads: a million tasks take a
        // few hundred milliseconds, which stalled the fetches on the thread that freed them.)
        if let Some(old) = old {
            tokio::task::spawn_blocking(move || drop(old));
        }
        if let Ok(mut last) = self.last_read.lock() {
            *last = None;
        }
        Ok(n)
    }

    /// Reads the tasks after the queues' last position, at most `pages` pages.
    async fn catch_up(&self, pages: usize) -> Result<(), tasks::Error> {
        let Some(tasks) = self.background.get() else {
            return Ok(());
        };
        let _reading = self.reading.lock().await;
        let generation = self.generation.load(Ordering::SeqCst);
        let Some(from) = self.read(ResourceQueues::known).flatten() else {
            return Ok(());
        };
        let known = tasks.queue_known().await?;
        let last_read = self.last_read.lock().ok().and_then(|l| *l);
        let mut after = match (known, last_read) {
            // The known position moves: read from it (see `last_read`).
            (Some(known), _) if known > from => from,
            (_, Some(last)) => last.max(from),
            _ => from,
        };
        for _ in 0..pages {
            let rows = tasks.queue_page(Some(after)).await?;
            let full = rows.len() >= QUEUE_PAGE_ROWS;
            // In chunks, so that a burst does not hold up the passes that ask the queues (they
            // wait for the lock on the runtime's threads), and yielding between them.
            for chunk in rows.chunks(INSERT_CHUNK) {
                let inserted = self.change(generation, |queues| {
                    for (key, record) in chunk {
                        queues.insert(*key, record);
                    }
                });
                if inserted.is_none() {
                    return Ok(());
                }
                tokio::task::yield_now().await;
            }
            if let Some((key, _)) = rows.last() {
                after = *key;
            }
            if let Ok(mut last) = self.last_read.lock() {
                if self.generation.load(Ordering::SeqCst) == generation {
                    *last = Some(after);
                }
            }
            let Some(known) = known else {
                return Ok(());
            };
            let up_to = if full { after.min(known) } else { known };
            if self
                .change(generation, |queues| queues.know_up_to(up_to))
                .is_none()
                || !full
            {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Where a pass without a scan hint may start, or a pass that has judged the tasks up to
    /// `from` may go on (see `ResourceQueues::start`): None before the first load, or when
    /// nothing is known.
    pub(super) async fn start(&self, from: Option<Key>) -> Result<Option<Start>, tasks::Error> {
        if self.task_count().is_none() {
            return Ok(None);
        }
        let mut seen: HashMap<TaskId, Seen> = HashMap::new();
        let mut start = None;
        for limit in CHECK_ROUNDS {
            let Some(ids) = self.read(|queues| queues.to_check(&seen, limit, from)) else {
                return Ok(None);
            };
            let found = if ids.is_empty() {
                HashMap::new()
            } else {
                self.tasks.seen(&ids).await?
            };
            // (What a check found holds for whichever queues are in place now.)
            let generation = self.generation.load(Ordering::SeqCst);
            let Some(found_start) = self.change(generation, |queues| {
                for (id, now) in found {
                    if now == Seen::Gone {
                        queues.remove(&id);
                    } else {
                        seen.insert(id, now);
                    }
                }
                queues.start(&seen, from)
            }) else {
                return Ok(None);
            };
            start = found_start;
            if !start.as_ref().is_some_and(|s| s.unchecked) {
                break;
            }
        }
        Ok(start)
    }

    /// Removes a task this replica has just made final (FinishTask), as a start's check would
    /// once it found the task gone: the checks of the next starts need not read it.
    /// (Whichever queues are in place: a load that read it before it ended puts it back, and a
    /// start's check removes it then.)
    pub(super) fn ended(&self, id: TaskId) {
        if let Some(queues) = self
            .state
            .lock()
            .ok()
            .as_deref_mut()
            .and_then(Option::as_mut)
        {
            queues.remove(&id);
        }
    }

    /// Where the queues' removals stand, for [`Queues::split_hiding`]: taken before a pass or a
    /// walk reads which locks are held.
    pub(super) fn removals(&self) -> Removals {
        // (Read under the queues' lock: a load replaces them and counts a generation.)
        Removals(self.read(|queues| (self.generation.load(Ordering::SeqCst), queues.removals())))
    }

    /// Whether a pass that starts at `position` (a scan hint's) would read many tasks before the
    /// first that can be ready, so that asking for a start is worth its statement.
    pub(super) fn worth_a_start(&self, position: Key) -> bool {
        self.read(|queues| queues.blocked_after(position, SKIP_AT_LEAST))
            .unwrap_or(false)
    }

    /// The end of the queue's head: the position of the [`HEAD_TASKS`]th task the queues hold
    /// (or where their knowledge ends, when they hold fewer). A task up to it has fewer
    /// incomplete tasks before it than that, so the exact look-up of one with a busy queue's
    /// entry among its conflict keys reads those rather than every user of its resources. None
    /// before the first load.
    pub(super) fn head_end(&self) -> Option<Key> {
        self.read(|queues| {
            let known = queues.known()?;
            Some(queues.nth(HEAD_TASKS).map_or(known, |k| k.min(known)))
        })
        .flatten()
    }

    /// The record entries of busy queues and how many incomplete tasks carry each (see
    /// `ResourceQueues::busy_queues`); empty before the first load.
    pub(super) fn busy_queues(&self) -> Vec<(String, usize)> {
        self.read(|queues| queues.busy_queues()).unwrap_or_default()
    }

    /// Splits held record entries by what the queues can tell at `position` (see
    /// `ResourceQueues::hides`): the names that hide a waiting task older than it go into
    /// `hiding`, and the entries they cannot tell about are returned, for hiding.sql. A name that
    /// hides a task before where the queues' knowledge ends hides it before any later position
    /// too, so "yes" holds past it (an open writer that keeps that end from moving, e.g. an idle
    /// Pulp session, must not make every pass count the blocked repository's queue); "no" only
    /// up to it. `since`: where the removals stood before the caller read anything it relies on
    /// (the holders' checks, the held locks).
    pub(super) fn split_hiding(
        &self,
        entries: Vec<String>,
        position: Key,
        since: Removals,
        hiding: &mut HashSet<String>,
    ) -> Vec<String> {
        let answers: Option<Vec<Option<bool>>> = self
            .read(|queues| {
                let known = queues.known()?;
                let generation = self.generation.load(Ordering::SeqCst);
                let since = since.0.and_then(|(g, n)| (g == generation).then_some(n));
                Some(
                    entries
                        .iter()
                        .map(
                            |entry| match queues.hides(entry, position.min(known), since) {
                                Some(true) => Some(true),
                                _ if known < position => None,
                                answer => answer,
                            },
                        )
                        .collect(),
                )
            })
            .flatten();
        let Some(answers) = answers else {
            return entries;
        };
        let mut unknown = Vec::new();
        for (entry, answer) in entries.into_iter().zip(answers) {
            match answer {
                Some(true) => {
                    let name = entry.strip_prefix(SHARED_PREFIX).unwrap_or(&entry);
                    hiding.insert(name.to_owned());
                }
                Some(false) => {}
                None => unknown.push(entry),
            }
        }
        unknown
    }
}
