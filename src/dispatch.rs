//! The fetch pipeline: hands a lease the oldest ready task it is compatible with, locked in Redis
//! and claimed in Postgres, plus the other task RPCs (claim, start, finish, release, cancel).
//!
//! Order of every grant: check the lease, walk candidates in queue order (`tasks::candidates`
//! skips resources whose queues are known to be blocked, so a blocked head costs no reads per
//! task), judge each by the readiness rule (`ready::obstacles`), lock all resources in one Lua
//! script, claim in Postgres. Whatever fails after the locks were taken releases them before the
//! call returns. The pipeline runs in its own tokio task, so a client that hangs up mid-way cannot
//! leave it half-done.
//!
//! A pass also serves the other waiting FetchTask calls of this replica (shared scans,
//! `waiters`): each ready task goes to the longest waiter whose lease may take it (versions and
//! skips per lease, `ready::runs_on`), under that waiter's own lease, locks and fencing token, and
//! a grant no caller can take any more is requeued (`Requeue`), never dropped.

mod carried;
mod claimants;
mod claiming;
pub mod fairness;
mod hint;
pub mod queues;
mod refresh;
mod requeue;
mod waiters;
pub mod wakeups;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::batch::Batcher;
use crate::error::{Error, Result};
use crate::ids::{FencingToken, LeaseId, TaskId};
use crate::locks::{Acquire, Change, LeaseRecord, Locks, Release};
use crate::metrics::Stats;
use crate::ready::{self, Reservations, Resources, Verdict, SHARED_PREFIX};
use crate::shutdown::Shutdown;
use crate::states::TaskState;
use crate::tasks::{TaskRow, Tasks};
use carried::Carried;
use claimants::{Claimants, Pick, Turn};
use claiming::{Tried, Try};
pub use fairness::{FairSettings, Fairness};
use hint::{
    position_key, released_names, split_by_known, trusted_until, HintBook, ReadAgainst, ScanHint,
    Settle, MAX_RETURNED,
};
use requeue::Requeue;
pub use waiters::Waiters;
use waiters::{Full, Place, Woken};

/// A task handed to a lease.
#[derive(Debug, Clone)]
pub struct Grant {
    /// `pulp_id`.
    pub task_id: TaskId,
    /// `name`.
    pub name: String,
    /// The task's resources.
    pub resources: Resources,
    /// The token the holder presents to start, finish or release the task.
    pub fencing_token: FencingToken,
    /// `immediate`.
    pub immediate: bool,
    /// `pulp_created`.
    pub created_at: DateTime<Utc>,
    /// When the grant started the task (the request asked it to), `None` when it is claimed
    /// and waiting for StartTask.
    pub started_at: Option<DateTime<Utc>>,
    /// The lease it was granted to (not sent to the worker).
    pub lease_id: LeaseId,
    /// The lease's worker row that claimed it (not sent to the worker).
    pub app_status_id: Uuid,
}

/// A validated FinishTask request.
#[derive(Debug, Clone)]
pub struct Finish {
    /// A final state ([`TaskState::FINAL`]).
    pub state: TaskState,
    /// Stored as `{"reason": ...}` in `core_task.error`.
    pub error: Option<String>,
}

/// Tuning of the fetch pipeline.
#[derive(Debug, Clone, Copy)]
pub struct FetchPolicy {
    /// Rows in the first candidate page; later pages of one fetch double, up to `max_page`.
    pub first_page: i64,
    /// The largest candidate page.
    pub max_page: i64,
    /// How often each replica reads Redis's change counter to wake its waiters for changes
    /// made through other replicas (or by the sweeper).
    pub wake_poll: Duration,
    /// Waiting FetchTask calls allowed at once on this replica.
    pub max_waiters: usize,
    /// The longest `wait` honoured.
    pub max_wait: Duration,
    /// How long a scan hint may be trusted without being re-checked from the start of the queue
    /// (zero: never use hints).
    pub hint_max_age: Duration,
    /// Whether a pass without a scan hint starts where the resource queues say (`queues`).
    pub resource_queues: bool,
    /// How many other waiting calls one pass may serve besides its own (0: no sharing).
    pub share: usize,
    /// Fetch passes this replica runs at once. A call that arrives, or whose turn comes, while
    /// that many run waits for them instead: they may serve it, and the next turn comes when
    /// one ends (0: no limit).
    pub passes: usize,
    /// How long a running pass holds up the calls waiting for it: after this it no longer
    /// counts as running (a claim waiting on a row lock must not stall every waiter), and a
    /// call with less time left than this never waits for a running pass.
    pub pass_stall: Duration,
}

/// What a pass needs to serve a waiting call: its lease, what it asked to skip, and whether
/// its grant starts the task.
#[derive(Debug, Clone)]
pub struct Offer {
    lease_id: LeaseId,
    lease: Arc<LeaseRecord>,
    skip: Arc<HashSet<TaskId>>,
    start: bool,
}

impl Offer {
    /// True when this lease may be given `row` (its versions, its skips), if it is ready.
    fn takes(&self, row: &TaskRow) -> bool {
        !self.skip.contains(&row.id) && ready::runs_on(&row.candidate, &self.lease.versions)
    }
}

/// A FetchTask call as its own pass serves it: the lease, what it skips, whether its grant
/// starts the task.
#[derive(Debug, Clone)]
struct Call {
    lease_id: LeaseId,
    skip: Arc<HashSet<TaskId>>,
    start: bool,
    /// The caller asked for an answer now (`wait` 0): a pass it makes serves it alone, so that
    /// its answer does not wait for a round of other waiters' grants.
    now: bool,
}

impl Call {
    /// What a pass needs to serve this call, under `lease` (the call's lease as last read).
    fn offer(&self, lease: Arc<LeaseRecord>) -> Offer {
        Offer {
            lease_id: self.lease_id,
            lease,
            skip: Arc::clone(&self.skip),
            start: self.start,
        }
    }
}

/// What a shared pass delivers to a waiting call: its grant, or why it has none.
pub type Delivery = Result<Grant>;
/// This replica's queue of waiting FetchTask calls.
pub type Queue = Waiters<Offer, Delivery>;

/// A lease this replica met, and when Redis last said it was alive.
type KnownLease = (Arc<LeaseRecord>, Instant);

/// The leases a replica knows, with when Redis last said each was alive (a call joining the
/// waiters takes its lease from here for a short while: `Dispatch::joining_lease`): a lease
/// ended through this replica (CloseLease, RevokeLease) is forgotten at once, so a call under it
/// is told `NOT_FOUND` rather than joining the waiters.
#[derive(Clone)]
pub struct KnownLeases(Arc<Mutex<HashMap<LeaseId, KnownLease>>>);

impl KnownLeases {
    /// Forgets a lease that ended.
    pub fn forget(&self, lease_id: LeaseId) {
        if let Ok(mut known) = self.0.lock() {
            known.remove(&lease_id);
        }
    }
}

/// Leases a replica keeps in memory (see `Dispatch::leases`); past this it forgets them all.
const MAX_KNOWN_LEASES: usize = 65_536;

enum Attempt {
    Granted(Grant),
    /// Its resources are held by locks; not ready, and it still reserves its resources.
    Blocked,
    /// Not granted (already locked, or cannot be locked); it still reserves its resources.
    NotGranted,
    /// Ready, but fairness held it back (its group's cap, the reserve); it still reserves its
    /// resources.
    HeldBack(crate::fair::HeldBack),
    /// The claim found the task no longer waiting and unclaimed (canceled, finished or claimed
    /// meanwhile). Whether it still reserves anything is for the next look-up to say; the exact
    /// count of older conflicts keeps newer tasks from being judged ready meanwhile.
    Lost,
    LeaseGone,
}

/// What fair dispatch made of a fetch before the pass in queue order.
enum Fair {
    /// A directed pass granted this.
    Granted(Grant),
    /// Go on with the pass in queue order.
    QueueOrder,
    /// Nothing the pass in queue order meets could be granted now: wait for a change.
    Wait,
}

/// How long one replica holds the hand-back of an undelivered grant (`Dispatch::return_one`);
/// it retries the requeue for half of it.
const RETURN_HOLD: Duration = Duration::from_secs(60);

/// The task RPCs.
#[derive(Clone)]
pub struct Dispatch {
    locks: Locks,
    tasks: Tasks,
    stats: Arc<Stats>,
    policy: FetchPolicy,
    shutdown: Shutdown,
    hint: Arc<Mutex<Option<ScanHint>>>,
    waiters: Arc<Queue>,
    requeue: Requeue,
    passes: Arc<Passes>,
    /// Tasks a pass of this replica is locking and claiming right now: concurrent passes leave
    /// them to it (as if held) instead of all racing for the same head of the queue.
    in_flight: Arc<Mutex<HashSet<TaskId>>>,
    /// Tasks this replica granted in the last [`RECENT`], with when: a pass whose page was read
    /// before such a grant committed leaves them alone instead of locking and claiming them
    /// again (with short tasks they are often finished by then, and the claim would find them
    /// gone). A page read after the grant that still shows the task waiting and unclaimed shows
    /// it put back in the queue (by whatever path), and it is tried as usual.
    recent: Arc<Mutex<Recent>>,
    /// Fair dispatch: directed passes, caps and the reserve (`fairness`).
    fairness: Fairness,
    /// The leases this replica's fetches met (what a lease is never changes while it lives; a
    /// lease id is never reused), with when Redis last said each was alive: a pass that trusts
    /// its hint takes the lease from here and leaves the check that it is alive to the acquire
    /// script, or, when it hands its caller nothing, to one look-up at its end; a call joining
    /// the waiters takes it from here when Redis said it was alive lately
    /// ([`Dispatch::lease_alive_lately`]).
    leases: Arc<Mutex<HashMap<LeaseId, KnownLease>>>,
    /// The fetch passes running (see [`FetchPolicy::passes`]).
    slots: Arc<PassSlots>,
    /// Background walks that renew an old scan hint (`refresh`).
    refreshes: Arc<refresh::Refreshes>,
    /// Where a pass without a scan hint starts (`queues`).
    queues: Arc<queues::Queues>,
    /// FinishTask's round trips, batched with those of the calls that arrive together.
    finishes: Finishes,
    /// Ends a lease whose claim found its `core_appstatus` row gone.
    lease_ends: crate::leases::Leases,
}

/// A lease, a task it holds and the fencing token it holds it under.
type Held = (LeaseId, TaskId, FencingToken);

/// FinishTask's three round trips (the holder check, the final state, the release), each
/// shared by the FinishTask calls that arrive together (`crate::batch`): one call of
/// `lua/holder.lua`, one finish.sql, one call of `lua/release.lua` for all of them.
/// A batched call's answer, or the failure its whole batch shares.
type Shared<T, E> = std::result::Result<T, Arc<E>>;

#[derive(Clone)]
struct Finishes {
    holders: Batcher<Held, Shared<std::result::Result<String, Release>, crate::locks::Error>>,
    finishes: Batcher<crate::tasks::Finishing, Shared<crate::tasks::Ended, crate::tasks::Error>>,
    releases: Batcher<Held, Shared<(Release, String), crate::locks::Error>>,
}

impl Finishes {
    fn new(locks: &Locks, tasks: &Tasks) -> Self {
        fn each<T, A>(n: usize, outcome: std::result::Result<Vec<T>, A>) -> Vec<Shared<T, A>> {
            match outcome {
                Ok(answers) => answers.into_iter().map(Ok).collect(),
                Err(e) => {
                    let e = Arc::new(e);
                    (0..n).map(|_| Err(Arc::clone(&e))).collect()
                }
            }
        }
        let holder_locks = locks.clone();
        let release_locks = locks.clone();
        let tasks = tasks.clone();
        Finishes {
            holders: Batcher::new(
                FINISH_BATCH,
                FINISH_BATCHES_IN_FLIGHT,
                move |held: Vec<Held>| {
                    let locks = holder_locks.clone();
                    async move { each(held.len(), locks.holders(&held).await) }
                },
            ),
            finishes: Batcher::new(
                FINISH_BATCH,
                FINISH_BATCHES_IN_FLIGHT,
                move |finishing: Vec<crate::tasks::Finishing>| {
                    let tasks = tasks.clone();
                    async move {
                        match tasks.finish_all(&finishing, false).await {
                            Err(e) if finishing.len() > 1 && e.is_refused() => {
                                // Postgres refused the batch's statement: each call is tried on
                                // its own, so one call's trouble fails only that call.
                                futures::future::join_all(finishing.iter().map(|f| {
                                    let tasks = tasks.clone();
                                    async move {
                                        let mut ended = tasks
                                            .finish_all(std::slice::from_ref(f), false)
                                            .await
                                            .map_err(Arc::new)?;
                                        Ok(ended.pop().unwrap_or(crate::tasks::Ended::NotFinished))
                                    }
                                }))
                                .await
                            }
                            outcome => each(finishing.len(), outcome),
                        }
                    }
                },
            ),
            releases: Batcher::new(
                FINISH_BATCH,
                FINISH_BATCHES_IN_FLIGHT,
                move |held: Vec<Held>| {
                    let locks = release_locks.clone();
                    async move { each(held.len(), locks.release_all(&held, true).await) }
                },
            ),
        }
    }
}

/// At most this many FinishTask calls share a round trip.
const FINISH_BATCH: usize = 64;
/// Batches of one of FinishTask's round trips that run at once: two, so Postgres's two cores (or
/// Redis and the network) both have work while calls gather for the next. No batch waits on a
/// row another transaction holds: finish.sql skips those rows, and their calls finish them on
/// their own. (`cargo bench --bench load -- throughput` measured one, two and four at 32 and
/// 256 workers; two was within the runs' spread of the best at both.)
const FINISH_BATCHES_IN_FLIGHT: usize = 2;

/// The answer of a batched call: what no batch answered is a bug.
fn batched<T, E>(
    answer: Option<Shared<T, E>>,
    shared: impl FnOnce(Arc<E>) -> E,
) -> std::result::Result<T, Error>
where
    Error: From<E>,
{
    match answer {
        Some(Ok(answer)) => Ok(answer),
        Some(Err(e)) => Err(shared(e).into()),
        None => Err(Error::Internal("a batched call got no answer".into())),
    }
}

/// Fetch passes running now, and whether a call waits for them: it joined the waiters, or
/// gave up its turn, because as many passes ran as may (combining: under load one pass serves
/// every waiter, instead of each call's pass racing the others for the same rows). The pass
/// that ends next gives the longest waiter a turn.
#[derive(Debug, Default)]
struct PassSlots {
    running: std::sync::atomic::AtomicUsize,
    owed: AtomicBool,
}

/// A running fetch pass, from before its first read until every grant it made is settled or
/// [`FetchPolicy::pass_stall`] has passed; dropping it counts it out and gives the longest
/// waiter a turn if one is owed.
struct PassSlot {
    slots: Arc<PassSlots>,
    waiters: Arc<Queue>,
    counted: bool,
}

impl Drop for PassSlot {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        self.slots.running.fetch_sub(1, Ordering::SeqCst);
        if self.slots.owed.swap(false, Ordering::SeqCst) {
            self.waiters.wake();
        }
    }
}

/// How long a grant is remembered by [`Dispatch::recent`]: far longer than a pass.
const RECENT: Duration = Duration::from_secs(1);

/// Task ids granted recently (noted once the claim committed), forgotten after [`RECENT`].
#[derive(Debug, Default)]
struct Recent {
    granted: HashMap<TaskId, Instant>,
    pruned: Option<Instant>,
}

impl Recent {
    fn note(&mut self, id: TaskId) {
        let now = Instant::now();
        if self.pruned.is_none_or(|p| now.duration_since(p) >= RECENT) {
            self.granted
                .retain(|_, at| now.duration_since(*at) < RECENT);
            self.pruned = Some(now);
        }
        self.granted.insert(id, now);
    }

    /// True when `id` was granted after `read_at` (when a page showing it waiting was read).
    fn granted_after(&self, id: &TaskId, read_at: Instant) -> bool {
        self.granted.get(id).is_some_and(|at| *at > read_at)
    }
}

/// What a pass knows before it reads a task ([`Dispatch::open_pass`]).
struct Opening {
    lease: Arc<LeaseRecord>,
    /// The changes since the hint (none while it is trusted).
    changes: crate::locks::Changes,
    /// When the change log was read (or last known clean, while the hint is trusted).
    checked_at: Instant,
    /// Whether the lease was read now (not taken from memory).
    lease_checked: bool,
    /// Whether the hint is trusted without reading the change log.
    trusting: bool,
    /// [`Locks::changes_made`] before the change log was read.
    made: u64,
    /// Where the resource queues' removals stood before anything the hint relies on was read.
    removals: queues::Removals,
    /// The lock state.
    epoch: String,
    /// Claims put back since the hint.
    requeued: Vec<TaskId>,
}

/// A scan hint's position and the held names known to hide tasks before it.
type KnownHiding = ((DateTime<Utc>, TaskId), HashSet<String>);

/// Where a pass starts and what it knows there ([`Dispatch::plan_pass`]).
struct Plan {
    /// The position the pass reads on from (`None`: the head of the queue).
    after: Option<(DateTime<Utc>, TaskId)>,
    /// What the tasks before `after` that were left waiting (or held locks) reserve.
    reserved: Reservations,
    /// Their conflict keys: the page skips tasks with these.
    excluded: Vec<String>,
    /// When the hint the pass started from was taken (now, without one).
    hint_taken: Instant,
    /// The used hint's position and the names it knew to hide tasks before it.
    hiding: Option<KnownHiding>,
    /// Claims put back that the pass checks first.
    returned: Vec<TaskId>,
    /// The tasks the hint carries, when the pass may judge them instead of reading a page.
    carried: Option<Arc<Carried>>,
    /// With carried tasks after reading the changes: the names whose locks those released.
    released: HashSet<String>,
    /// The names a dropped hint knew to hide.
    known_before: HashSet<String>,
    /// The held entries of the heads a queue start reserved (held entries the pass skipped by).
    skipped_held: HashSet<String>,
}

/// What a pass judges first ([`Dispatch::first_reads`]).
struct FirstReads {
    /// The claims put back before the hint's position, still waiting, oldest first.
    extra: Vec<TaskRow>,
    /// The first page (`None`: read it when the pass gets there).
    first_page: Option<crate::tasks::Page>,
    /// Every claim put back the pass judges (before the hint's position or in the page).
    returned_ids: HashSet<TaskId>,
    /// When the first page was read.
    first_read_at: Instant,
    /// When the claims put back were read.
    extra_read_at: Instant,
    /// With a carried page: where the resource queues' removals stood before its held entries
    /// were read.
    carried_removals: Option<queues::Removals>,
}

/// One candidate row as a pass saw it.
struct Step {
    row: TaskRow,
    seen: Seen,
}

enum Seen {
    /// Not ready by the rule.
    NotReady,
    /// Ready, but nobody in the pass could take it, or another pass of this replica is
    /// granting it.
    PassedOver,
    /// Granted by this replica since its page was read.
    Left,
    /// Ready, and tried for the claimant `who` ([`Claimants::get_mut`]).
    Attempt { who: usize, _mine: InFlight },
}

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    Granted,
    Blocked,
    NotGranted,
    Lost,
}

/// What fairness held back so far in one directed pass (one group's page, or the immediate
/// tasks'). A later task of a group held at its cap is not tried in the same page (the cap's
/// count may drop meanwhile, and that task would overtake the one held back), nor, once the
/// reserve held a deferred task back, any deferred task. Either would most likely be held back
/// too: not trying them also saves an acquire each. (The pass in queue order tries on: it
/// serves every waiting fetch, and a place freed while it walks is granted by it.)
#[derive(Debug, Default)]
struct HeldInPass {
    groups: HashSet<Uuid>,
    deferred: bool,
}

impl HeldInPass {
    /// Notes that a task of `group` was held back, and why.
    fn note(&mut self, group: Uuid, why: crate::fair::HeldBack) {
        match why {
            crate::fair::HeldBack::Cap { .. } => {
                self.groups.insert(group);
            }
            crate::fair::HeldBack::Reserve { .. } => self.deferred = true,
        }
    }

    /// Whether a task of `group` must not be tried in this pass.
    fn holds(&self, group: Uuid, immediate: bool) -> bool {
        self.groups.contains(&group) || (self.deferred && !immediate)
    }
}

/// What a round's attempts came to ([`Dispatch::grant_round`]).
#[derive(Default)]
struct Round {
    /// Per step, how its attempt ended (`None`: no attempt).
    settled: Vec<Option<Settled>>,
    /// The pass's own caller got a grant.
    own_served: bool,
    /// Why the caller's own attempt failed (its lease gone, backend trouble).
    failure: Option<Error>,
    /// The pass must end after this round.
    stop: bool,
}

/// How the book settles a row of a page ([`HintBook::settle`]).
fn settled_as(seen: &Seen, settled: Option<Settled>) -> Settle {
    match (seen, settled) {
        (Seen::NotReady, _) | (_, Some(Settled::Blocked)) => Settle::Waiting,
        (Seen::Left, _) | (_, Some(Settled::Lost)) => Settle::Gone,
        (_, Some(Settled::Granted)) => Settle::Granted,
        _ => Settle::Unsure,
    }
}

/// How the book settles a claim put back ([`HintBook::settle_returned`]).
fn settled_as_returned(settled: Option<Settled>) -> Settle {
    match settled {
        Some(Settled::Granted) => Settle::Granted,
        Some(Settled::Lost) => Settle::Gone,
        _ => Settle::Waiting,
    }
}

/// A pass's answer to its own caller, sent once: as soon as the caller's grant is made, or
/// when the pass ends. A grant the caller is no longer there to take is requeued.
struct Answer {
    deliver: Option<tokio::sync::oneshot::Sender<Result<Option<Grant>>>>,
    requeue: Requeue,
}

impl Answer {
    async fn send(&mut self, outcome: Result<Option<Grant>>) {
        if let Some(deliver) = self.deliver.take() {
            if let Err(Ok(Some(grant))) = deliver.send(outcome) {
                self.requeue.undelivered(&grant).await;
            }
        }
    }
}

/// The caller's side of an [`Answer`]: a grant sent but never read is requeued.
struct Awaiting {
    receive: tokio::sync::oneshot::Receiver<Result<Option<Grant>>>,
    requeue: Requeue,
    passes: Arc<Passes>,
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        self.receive.close();
        if let Ok(Ok(Some(grant))) = self.receive.try_recv() {
            self.requeue.spawn_requeue(grant, &self.passes);
        }
    }
}

/// Passes, granting steps and FinishTask calls running in their own tasks, so shutdown can wait
/// for them (a grant they make for a caller that is gone is requeued, and a finished task's locks
/// are released, before the process ends).
#[derive(Debug, Default)]
pub struct Passes {
    running: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

/// One running pass; dropping it counts it out.
struct Running(Arc<Passes>);

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Passes {
    fn enter(self: &Arc<Self>) -> Running {
        self.running.fetch_add(1, Ordering::SeqCst);
        Running(Arc::clone(self))
    }

    /// Returns once no pass is running.
    pub async fn idle(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.running.load(Ordering::SeqCst) == 0 {
                return;
            }
            idle.await;
        }
    }
}

/// A task this replica is trying to grant; dropping it lets other passes try the task again.
struct InFlight {
    set: Arc<Mutex<HashSet<TaskId>>>,
    id: TaskId,
}

impl InFlight {
    /// Marks `id` in flight, or `None` when another pass has it.
    fn take(set: &Arc<Mutex<HashSet<TaskId>>>, id: TaskId) -> Option<InFlight> {
        let mut tasks = set.lock().ok()?;
        tasks.insert(id).then(|| InFlight {
            set: Arc::clone(set),
            id,
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut tasks) = self.set.lock() {
            tasks.remove(&self.id);
        }
    }
}

impl Dispatch {
    /// Builds the dispatcher.
    pub fn new(
        locks: Locks,
        tasks: Tasks,
        stats: Arc<Stats>,
        policy: FetchPolicy,
        fairness: Fairness,
        lease_ends: crate::leases::Leases,
        shutdown: Shutdown,
    ) -> Self {
        let requeue = Requeue {
            locks: locks.clone(),
            tasks: tasks.clone(),
            stats: Arc::clone(&stats),
        };
        let requeue_on_drop = requeue.clone();
        let passes = Arc::new(Passes::default());
        let passes_on_drop = Arc::clone(&passes);
        // A grant delivered to a waiting call that left before taking it goes back.
        let abandoned = Box::new(move |delivery: Delivery| {
            if let Ok(grant) = delivery {
                requeue_on_drop.spawn_requeue(grant, &passes_on_drop);
            }
        });
        Dispatch {
            locks: locks.clone(),
            tasks: tasks.clone(),
            stats,
            shutdown,
            hint: Arc::new(Mutex::new(None)),
            waiters: Arc::new(Waiters::new(policy.max_waiters, abandoned)),
            requeue,
            passes,
            in_flight: Arc::new(Mutex::new(HashSet::new())),
            recent: Arc::new(Mutex::new(Recent::default())),
            leases: Arc::new(Mutex::new(HashMap::new())),
            slots: Arc::new(PassSlots::default()),
            refreshes: Arc::new(refresh::Refreshes::default()),
            queues: Arc::new(queues::Queues::new(tasks.clone())),
            finishes: Finishes::new(&locks, &tasks),
            fairness,
            lease_ends,
            policy,
        }
    }

    /// FetchTask: the oldest ready task this lease is compatible with, or `None` once `wait` has
    /// run out with nothing ready. Counted once by its outcome.
    pub async fn fetch(
        &self,
        lease_id: LeaseId,
        wait: Duration,
        skip: HashSet<TaskId>,
        start: bool,
    ) -> Result<Option<Grant>> {
        let fetched = self.fetch_until(lease_id, wait, skip, start).await;
        if fetched.is_err() {
            self.stats.fetch("error");
        }
        fetched
    }

    /// [`Dispatch::fetch`], counted when it hands out a task or finds none in time (an error is
    /// counted by the caller).
    async fn fetch_until(
        &self,
        lease_id: LeaseId,
        wait: Duration,
        skip: HashSet<TaskId>,
        start: bool,
    ) -> Result<Option<Grant>> {
        let wait = wait.min(self.policy.max_wait);
        let deadline = tokio::time::Instant::now() + wait;
        let call = Call {
            lease_id,
            skip: Arc::new(skip),
            start,
            now: wait.is_zero(),
        };
        // Joined after the first pass found nothing (and `wait` is not over).
        let mut place: Option<Place<Offer, Delivery>> = None;
        // A waiting call that arrives while a pass found nothing for anyone and nothing woke the
        // queue since joins it without a pass of its own: an idle fleet re-issuing its long
        // polls costs no queries.
        let seen = self.waiters.generation();
        if !wait.is_zero() && call.skip.is_empty() && self.waiters.known_empty(seen) {
            // The lease is still checked (one Redis call, unless Redis said it was alive
            // lately): an unknown lease gets NOT_FOUND now.
            let lease = self.joining_lease(lease_id).await?;
            place = Some(self.join_waiters(seen, call.offer(lease))?);
        } else if wait > self.policy.pass_stall && self.congested() {
            // Enough passes run already: one of them, or the next, serves this call with the
            // others waiting then (one scan for all) instead of this call reading the queue too.
            // With the waiter queue full it makes its own pass instead.
            let lease = self.joining_lease(lease_id).await?;
            if let Ok(joined) = self.waiters.join(seen, call.offer(lease)) {
                place = Some(joined);
                self.defer_to_running();
            }
        }
        loop {
            if let Some(waiter) = place.as_mut() {
                match self.woken(waiter, deadline).await {
                    None => {
                        self.stats.fetch("none_ready");
                        return Ok(None);
                    }
                    Some(Woken::Delivered(delivery)) => {
                        // Another waiter's pass served this call.
                        if delivery.is_ok() {
                            self.stats.fetch("claimed");
                        }
                        return delivery.map(Some);
                    }
                    Some(Woken::Turn)
                        if self.congested()
                            && deadline.saturating_duration_since(tokio::time::Instant::now())
                                > self.policy.pass_stall =>
                    {
                        // A pass runs already: it may serve this call, and the turn comes back
                        // when it ends (one pass at a time serves every waiter, instead of
                        // each waiter's pass racing the others for the same rows).
                        waiter.defer();
                        self.defer_to_running();
                        continue;
                    }
                    Some(Woken::Turn) => {}
                }
            }
            // Read first: a release that wakes the queue while the directed passes run is not
            // missed by a call that then waits.
            let seen_before = self.waiters.generation();
            match self.directed_passes(&call).await {
                Err(e) => return self.fetch_ended(place, Err(e)),
                Ok(Fair::Granted(grant)) => return self.fetch_ended(place, Ok(grant)),
                Ok(Fair::Wait) => {
                    // Nothing the pass in queue order meets could be granted (the reserve,
                    // caps): wait for a change.
                    if self.out_of_time(deadline) {
                        return Ok(None);
                    }
                    match place.as_ref() {
                        Some(place) => place.found_nothing(),
                        None => {
                            let lease = self.live_lease(lease_id).await?;
                            place = Some(self.join_waiters(seen_before, call.offer(lease))?);
                        }
                    }
                    continue;
                }
                Ok(Fair::QueueOrder) => {}
            }
            let seen = self.waiters.generation();
            let passed_over = Arc::new(AtomicBool::new(false));
            let lease_seen: Arc<Mutex<Option<Arc<LeaseRecord>>>> = Arc::new(Mutex::new(None));
            let slot = self.pass_slot(!call.now);
            let outcome = self
                .run_pass(
                    call.clone(),
                    place.as_ref().map(|p| p.id()),
                    Arc::clone(&passed_over),
                    Arc::clone(&lease_seen),
                    slot,
                )
                .await;
            self.stats.fetch_pass();
            if call.now
                && !self.waiters.is_empty()
                && (!matches!(outcome, Ok(None)) || passed_over.load(Ordering::SeqCst))
            {
                // A call that will not wait served no waiter: whatever its pass got, failed at
                // or passed over, the waiters get a turn for what it left, as after a waiter's
                // own pass.
                self.waiters.wake();
            }
            match outcome {
                Err(e) => return self.fetch_ended(place, Err(e)),
                Ok(Some(grant)) => return self.fetch_ended(place, Ok(grant)),
                Ok(None) => {}
            }
            let passed = passed_over.load(Ordering::SeqCst);
            if !passed {
                self.waiters.note_empty(seen);
            }
            match &place {
                Some(place) if passed => place.pass_on(),
                Some(place) => place.found_nothing(),
                None => {}
            }
            if self.out_of_time(deadline) {
                return Ok(None);
            }
            if place.is_none() {
                let lease = lease_seen.lock().ok().and_then(|l| l.clone());
                let lease = match lease {
                    Some(lease) => lease,
                    None => self.live_lease(lease_id).await?,
                };
                place = Some(self.join_waiters(seen, call.offer(lease))?);
            }
        }
    }

    /// Ends a fetch with what its own pass or the directed passes got (a grant counted). Its
    /// place in the waiters' queue, if it has one, is left with the turn handed on: after a
    /// grant more may be ready, and after an error the next waiter looks instead.
    fn fetch_ended(
        &self,
        place: Option<Place<Offer, Delivery>>,
        got: Result<Grant>,
    ) -> Result<Option<Grant>> {
        if got.is_ok() {
            self.stats.fetch("claimed");
        }
        if let Some(place) = place {
            place.leave_after_grant();
        }
        got.map(Some)
    }

    /// True, counted as a fetch that found nothing, when a fetch that found nothing is out of
    /// time: its `wait` is over or the broker stops.
    fn out_of_time(&self, deadline: tokio::time::Instant) -> bool {
        let over = tokio::time::Instant::now() >= deadline || self.shutdown.is_fired();
        if over {
            self.stats.fetch("none_ready");
        }
        over
    }

    /// True when as many fetch passes run as may (never without sharing: a waiter then is
    /// served only by its own pass).
    fn congested(&self) -> bool {
        self.policy.share > 0
            && self.policy.passes > 0
            && self.slots.running.load(Ordering::SeqCst) >= self.policy.passes
    }

    /// Has the running passes give the longest waiter a turn when the next of them ends (at
    /// once if they all ended meanwhile, perhaps before they could see the request).
    fn defer_to_running(&self) {
        self.slots.owed.store(true, Ordering::SeqCst);
        if !self.congested() && self.slots.owed.swap(false, Ordering::SeqCst) {
            self.waiters.wake();
        }
    }

    /// Counts a fetch pass in until the slot is dropped; not the pass of a call that will not
    /// wait (`counted` false): it serves no waiter, so no waiter waits for it to end.
    fn pass_slot(&self, counted: bool) -> PassSlot {
        if counted {
            self.slots.running.fetch_add(1, Ordering::SeqCst);
        }
        PassSlot {
            slots: Arc::clone(&self.slots),
            waiters: Arc::clone(&self.waiters),
            counted,
        }
    }

    fn join_waiters(&self, seen: u64, offer: Offer) -> Result<Place<Offer, Delivery>> {
        self.waiters.join(seen, offer).map_err(|Full(max)| {
            Error::ResourceExhausted(format!(
                "{max} FetchTask calls are already waiting on this broker \
                 (--fetch-max-waiters); retry with backoff, or wait for less"
            ))
        })
    }

    /// Waits for `place`'s turn or for a delivery; `None` when the deadline passed or the
    /// broker shuts down first.
    async fn woken(
        &self,
        place: &mut Place<Offer, Delivery>,
        deadline: tokio::time::Instant,
    ) -> Option<Woken<Delivery>> {
        tokio::select! {
            woken = place.woken() => Some(woken),
            _ = tokio::time::sleep_until(deadline) => None,
            _ = self.shutdown.fired() => None,
        }
    }

    fn granted_after(&self, id: &TaskId, read_at: Instant) -> bool {
        self.recent
            .lock()
            .is_ok_and(|r| r.granted_after(id, read_at))
    }

    /// Wakes this replica's longest waiting fetch: something may have become ready.
    pub fn wake(&self) {
        self.waiters.wake();
    }

    /// Heartbeat's `undelivered`: grants a live lease holds that never reached its worker (the
    /// answer was lost with a replica or a connection). Each still held by `lease_id` under the
    /// given token goes back to the queue, started or not, then has its locks released; any
    /// other is left alone. One replica at a time hands a grant back (`Locks::take_return`), so a
    /// repeated hand-back (a retried heartbeat, the next heartbeat) does nothing more. The task
    /// stays locked until it is back in the queue: no grant can take it meanwhile, so retrying
    /// the requeue is safe, and a replica dying half-way leaves it locked and still listed, to be
    /// handed back again. Runs in a task of its own (shutdown waits for it), so the heartbeat
    /// answers without Postgres.
    pub fn return_undelivered(
        &self,
        lease_id: LeaseId,
        app_status: Uuid,
        undelivered: Vec<(TaskId, FencingToken)>,
    ) {
        if undelivered.is_empty() {
            return;
        }
        let dispatch = self.clone();
        self.spawn_counted(async move {
            for (task_id, token) in undelivered {
                if let Err(e) = dispatch
                    .return_one(lease_id, app_status, task_id, token)
                    .await
                {
                    tracing::warn!(%task_id, %lease_id, error = %e, "could not hand back an undelivered grant; the worker hands it back again");
                }
            }
            dispatch.wake();
        });
    }

    /// Runs `work` in its own tokio task (in the caller's span), counted with the passes, so
    /// that a caller that goes away cannot interrupt it and shutdown waits for it within its
    /// grace.
    fn spawn_counted<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        let running = self.passes.enter();
        tokio::spawn(tracing::Instrument::in_current_span(async move {
            let _running = running;
            work.await
        }))
    }

    async fn return_one(
        &self,
        lease_id: LeaseId,
        app_status: Uuid,
        task_id: TaskId,
        token: FencingToken,
    ) -> Result<()> {
        if self.locks.holder(lease_id, task_id, token).await?.is_err() {
            tracing::debug!(%task_id, %lease_id, "a grant handed back is no longer the lease's under that token; left alone");
            return Ok(());
        }
        if !self.locks.take_return(task_id, token, RETURN_HOLD).await? {
            return Ok(());
        }
        tracing::warn!(%task_id, %lease_id, "the worker never received this grant; requeueing it");
        let mut requeued = None;
        let started = Instant::now();
        while requeued.is_none() && started.elapsed() < RETURN_HOLD / 2 {
            match self.tasks.requeue(task_id, app_status, true).await {
                Ok(done) => requeued = Some(done),
                Err(e) => {
                    tracing::warn!(%task_id, error = %e, "could not requeue a grant handed back; trying again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        let Some(requeued) = requeued else {
            // Still locked and claimed: the worker hands it back again once the hold expires.
            return Ok(());
        };
        // Noted whatever the requeue found: an earlier attempt may have put it back already.
        self.requeue.note_requeue(task_id).await;
        if requeued {
            self.stats.undelivered_returned();
        }
        self.requeue
            .release_after_failure(lease_id, task_id, token)
            .await;
        Ok(())
    }

    /// The resource queues of this replica (the server runs their loading).
    pub fn resource_queues(&self) -> Arc<queues::Queues> {
        Arc::clone(&self.queues)
    }

    /// Whether passes and walks ask the resource queues (they serve scan hints: with hints off,
    /// every pass reads from the head).
    fn uses_resource_queues(&self) -> bool {
        self.policy.resource_queues && !self.policy.hint_max_age.is_zero()
    }

    /// Where the resource queues say a scan may start, or go on after `from` (see
    /// `queues::Queues::start`). A failure only costs reading from the hint or the head.
    async fn queue_start(&self, from: Option<(DateTime<Utc>, TaskId)>) -> Option<ready::Start> {
        match self.queues.start(from.map(position_key)).await {
            Ok(start) => start,
            Err(e) => {
                tracing::debug!(error = %e, "the resource queues gave no start");
                None
            }
        }
    }

    /// Where the queue's head ends and which resources have busy queues, for the exact
    /// look-ups of candidates.sql, when the resource queues are used and loaded.
    fn near(&self) -> crate::tasks::Near {
        if !self.uses_resource_queues() {
            return crate::tasks::Near::default();
        }
        crate::tasks::Near::new(
            self.queues.head_end().map(crate::tasks::key_bound),
            self.queues.busy_queues(),
        )
    }

    /// Fair dispatch on this replica.
    pub fn fairness(&self) -> Fairness {
        self.fairness.clone()
    }

    /// The passes running in their own tasks (shutdown waits for them).
    pub fn passes(&self) -> Arc<Passes> {
        Arc::clone(&self.passes)
    }

    /// The queue of waiting fetches (for the wake-up loops).
    pub fn waiters(&self) -> Arc<Queue> {
        Arc::clone(&self.waiters)
    }

    /// One pass over the queue for one lease, which also serves other waiting calls of this
    /// replica (shared scans): each ready task it meets goes to the longest waiter that can
    /// take it (this call's own place counts by its position; a call not yet waiting comes
    /// after every waiter), under that waiter's own lease, locks and fencing token. What it
    /// grants a recruited waiter is delivered to that waiter's place (or requeued if it left).
    /// The attempts of one round are judged together and mutually non-conflicting (each ready
    /// task reserves its resources for every newer one), so they run concurrently.
    /// Sets `passed_over` when it passed over a ready task nobody in the pass could take
    /// (versions, `skip_task_ids`): another waiter may take it.
    async fn fetch_once(
        &self,
        call: Call,
        stalled: &CancellationToken,
        own_place: Option<u64>,
        passed_over: &AtomicBool,
        lease_out: &Mutex<Option<Arc<LeaseRecord>>>,
        answer: &mut Answer,
    ) -> Result<Option<Grant>> {
        let lease_id = call.lease_id;
        let held = self.hint.lock().ok().and_then(|h| h.clone());
        let opening = self.open_pass(lease_id, held.as_ref()).await?;
        if let Ok(mut out) = lease_out.lock() {
            *out = Some(Arc::clone(&opening.lease));
        }
        let Opening {
            lease,
            changes,
            checked_at,
            lease_checked,
            trusting,
            made,
            removals,
            epoch,
            requeued,
        } = opening;
        let Plan {
            after,
            mut reserved,
            mut excluded,
            hint_taken,
            hiding,
            returned,
            carried,
            released,
            known_before,
            skipped_held,
        } = self
            .plan_pass(held, &changes, &epoch, &requeued, trusting)
            .await;
        let use_queues = self.uses_resource_queues();
        let near = self.near();
        // Waiters this pass could serve besides its own caller.
        let others = self
            .waiters
            .len()
            .saturating_sub(usize::from(own_place.is_some()));
        // While fair dispatch makes directed passes, a pass in queue order serves its own caller
        // only: a waiter's own fetch asks the fair order first. So does the pass of a call that
        // will not wait: its answer would otherwise wait for a round of the others' grants (its
        // lock, claim and check grow with the round), and the waiters it leaves are served by
        // their own passes (the call gives them a turn once its pass answered: `fetch`).
        let may_recruit = if others == 0 || self.fairness.engaged() || call.now {
            0
        } else {
            self.policy.share
        };
        let mut claimants = Claimants::new(call.offer(Arc::clone(&lease)), own_place, may_recruit);
        let mut page = self.policy.first_page;
        if may_recruit > 0 {
            // Room for one ready task per waiter in the first page.
            let room = (others.min(may_recruit) as i64).saturating_add(1);
            page = page.max(room.min(self.policy.max_page));
        }
        // The tasks other passes of this replica are trying sit where this pass starts reading
        // (at the same hint) and are passed over: room past them too, or a page holding only
        // them costs another round trip (a call with no `wait` beside a shared round of 64
        // grants read two or three pages).
        let trying = self.in_flight.lock().map_or(0, |t| t.len());
        page = page.max((trying as i64).saturating_add(1).min(self.policy.max_page));
        let mut held_seen = skipped_held;
        // What the last page held past the last task settled, its held entries, when it was read.
        let mut rest: Option<(Vec<TaskRow>, Vec<String>, Instant)> = None;
        let mut own_served = false;
        let mut failure: Option<Error> = None;
        let mut stop = false;
        let FirstReads {
            mut extra,
            mut first_page,
            returned_ids,
            first_read_at,
            extra_read_at,
            carried_removals,
        } = self
            .first_reads(carried.as_deref(), &returned, &excluded, after, &near, page)
            .await?;
        // The held entries of a carried page were read before this pass began: what the hint
        // this pass leaves relies on is judged against the queues' removals since then.
        let removals = carried_removals.unwrap_or(removals);
        let extra_ids: HashSet<TaskId> = extra.iter().map(|r| r.id).collect();
        // As read: what the hint this pass leaves carries of those still waiting.
        let extra_rows: Vec<TaskRow> = extra.clone();
        // What the hint this pass leaves keeps: the same, without the tasks it hands out.
        let mut book = HintBook::new(
            ReadAgainst {
                epoch,
                seq: changes.seq,
                checked_at,
                made,
            },
            hint_taken,
            after,
            reserved.clone(),
            excluded.clone(),
            extra.iter().map(|r| r.id).collect(),
        );
        'pages: loop {
            let (read_at, found) = match first_page.take() {
                Some(found) => (first_read_at, found),
                None => (
                    Instant::now(),
                    self.tasks
                        .candidates(&excluded, book.after, &near, page)
                        .await?,
                ),
            };
            let last_page = !found.full;
            let end = found.end();
            let page_held = found.held;
            held_seen.extend(page_held.iter().cloned());
            // Returned claims are older than everything past the hint: they come first.
            let rows: Vec<TaskRow> = extra.drain(..).chain(found.tasks).collect();
            let mut rows = rows.into_iter().peekable();
            // Rounds: judge rows until every claimant is trying one, try them all at once,
            // settle in queue order.
            loop {
                if self.shutdown.is_fired() {
                    // No new attempts once the broker stops: their grants could not be delivered.
                    stop = true;
                    break;
                }
                if stalled.is_cancelled() {
                    claimants.let_go();
                }
                if rows.peek().is_none() || claimants.nobody_left() {
                    break;
                }
                let (steps, passed) = self.judge_round(
                    &mut rows,
                    &mut claimants,
                    &mut reserved,
                    &lease.versions,
                    |row| {
                        if returned_ids.contains(&row.id) {
                            extra_read_at
                        } else {
                            read_at
                        }
                    },
                );
                if passed {
                    passed_over.store(true, Ordering::SeqCst);
                }
                let round = self
                    .grant_round(&steps, &mut claimants, answer, stalled)
                    .await;
                own_served |= round.own_served;
                failure = failure.or(round.failure);
                stop |= round.stop;
                let settled = round.settled;
                // Settle in queue order: the hint is bookkept row by row.
                for (step, settled) in steps.into_iter().zip(settled) {
                    let row = &step.row;
                    if !matches!(settled, Some(Settled::Granted)) {
                        // The next page skips the tasks that conflict with it. Not those that
                        // conflict with a task handed out: that one is held when the page is
                        // read (skipped by `held`, and so known to the hint's `hiding`), or
                        // finished already, and then they must be judged.
                        excluded.extend(row.candidate.resources.conflict_keys());
                    }
                    if extra_ids.contains(&row.id) {
                        book.settle_returned(row, settled_as_returned(settled));
                    } else {
                        book.settle(row, settled_as(&step.seen, settled));
                    }
                }
                if stop {
                    break;
                }
            }
            if !stop && rows.peek().is_none() && end > book.after {
                // Settled to the end of the queue: every waiting task after the last row was
                // skipped (held, or reserved by what the hint keeps), so the hint starts after
                // them. Without this, a queue whose waiting tasks are all blocked would have
                // every pass read all of them.
                book.after = end;
            }
            if stop || own_served || last_page {
                if own_served && !stop {
                    // What this page holds past the last task settled, for the next pass.
                    rest = Some((
                        rows.filter(|r| !extra_ids.contains(&r.id))
                            .collect::<Vec<_>>(),
                        page_held,
                        read_at,
                    ));
                }
                break 'pages;
            }
            // The next page reads on from `book.after`. When the resource queues say that most of
            // the tasks after it wait behind others (the queue of a resource whose task this
            // pass handed out or passed over: R0's, once its head finished), it starts just
            // before the next waiting lane instead, as a pass without a hint does, with the
            // holders up to there reserved or counted as held. Without this, reaching the other
            // domains' tasks read R0's whole queue.
            if use_queues
                && book
                    .after
                    .is_some_and(|a| self.queues.worth_a_start(position_key(a)))
            {
                if let Some(start) = self.queue_start(book.after).await {
                    let position = crate::tasks::key_bound(start.after);
                    if book.after.is_some_and(|a| a < position) {
                        tracing::debug!(after = ?position, "next page starts where the resource queues say");
                        start
                            .clone()
                            .apply(&mut book.reserved, &mut held_seen, |key| {
                                book.excluded.push(key)
                            });
                        start.apply(&mut reserved, &mut held_seen, |key| excluded.push(key));
                        book.after = Some(position);
                        self.stats.queue_start();
                    }
                }
            }
            page = (page * 2).min(self.policy.max_page);
        }
        // Recruits not served go back to waiting (dropping them reopens their places).
        drop(claimants);
        if let Some(e) = failure {
            // (Only this call's own attempts fail it: it has no grant then.)
            return Err(e);
        }
        if stop {
            // The pass ended early (backend trouble, shutdown): what it did not look at may be
            // ready, so the turn moves on and nothing is known to be empty.
            passed_over.store(true, Ordering::SeqCst);
        }
        if own_served && own_place.is_none() && !call.now && passed_over.load(Ordering::SeqCst) {
            // Its caller, not a waiter, was answered already and hands no turn on: the waiters
            // get one, for what this pass left. (After the pass of a call that will not wait,
            // the call gives them one: `fetch`.)
            self.waiters.wake();
        }
        if !lease_checked && !own_served {
            // The lease came from memory and no acquire proved it alive: an ended lease gets
            // NOT_FOUND, as with the check at the start.
            self.live_lease(lease_id).await?;
        }
        let outcome: Option<Grant> = None; // (the caller's own grant went through `answer`)
        let unbroken = book.unbroken();
        let mut hint = book.leave();
        if unbroken {
            // The hint ends at the last task settled: the page's rest follows it directly, and
            // the claims put back it checks first are those still waiting (`h.returned`).
            if let (Some(h), Some((rows, held, read_at))) = (hint.as_mut(), rest) {
                let returned: Vec<TaskRow> = extra_rows
                    .into_iter()
                    .filter(|r| h.returned.contains(&r.id))
                    .collect();
                h.carried = Carried::of(rows, (returned, extra_read_at), held, read_at, removals)
                    .map(Arc::new);
            }
        }
        if let (Some(hint), false) = (hint, self.policy.hint_max_age.is_zero()) {
            self.leave_hint(hint, hiding, known_before, held_seen, removals, &released)
                .await;
        }
        Ok(outcome)
    }

    /// The first stage of a pass: the lease and the changes since the hint `held`, read together
    /// (one Redis call), or both from memory while the hint is trusted (see [`trusted_until`]).
    async fn open_pass(&self, lease_id: LeaseId, held: Option<&ScanHint>) -> Result<Opening> {
        // Read before the change log is (or an earlier read of it is trusted): a change this
        // replica makes from here on moves it, and the hint this pass leaves is read against the
        // change log again.
        let made = self.locks.changes_made();
        let trusted = held.and_then(|h| {
            let clean_until = self.trusted(h, made)?;
            Some((clean_until, self.known_lease(lease_id)?, h.read.seq))
        });
        let trusting = trusted.is_some();
        // Not trusted only because this replica's own calls changed lock state since: when they
        // alone did and each said what it recorded, those changes are the log's.
        let own = match (trusting, held) {
            (false, Some(h)) => self.own_changes_since(h, lease_id, made),
            _ => None,
        };
        // Without a hint read against the change log just now, the lease and the changes since
        // the hint are read together (one Redis call).
        let (lease, changes, checked_at, lease_checked) = match (trusted, own) {
            (Some((clean_until, lease, seq)), _) => {
                self.stats.hint_trusted();
                let nothing = crate::locks::Changes {
                    seq,
                    changed: Some(Vec::new()),
                };
                (lease, nothing, clean_until, false)
            }
            (None, Some((lease, changes, clean_until))) => {
                self.stats.own_changes_used();
                (lease, changes, clean_until, false)
            }
            (None, None) => {
                let checked_at = Instant::now();
                let Some((lease, changes)) = self
                    .locks
                    .lease_and_changes(lease_id, held.map(|h| h.read.seq))
                    .await?
                else {
                    return Err(self.lease_gone(lease_id));
                };
                (
                    self.remember_lease(lease_id, lease),
                    changes,
                    checked_at,
                    true,
                )
            }
        };
        // Before anything the hint relies on is read (see `queues::Queues::split_hiding`).
        let removals = self.queues.removals();
        let epoch = self.locks.epoch();
        // Claims put back since the hint: checked first, not a reason to drop it.
        let requeued: Vec<TaskId> = changes
            .changed
            .iter()
            .flatten()
            .filter_map(|n| match Change::of(n) {
                Change::Requeued(id) => id.parse().ok(),
                _ => None,
            })
            .collect();
        Ok(Opening {
            lease,
            changes,
            checked_at,
            lease_checked,
            trusting,
            made,
            removals,
            epoch,
            requeued,
        })
    }

    /// The second stage of a pass: where it starts and what it knows there. The hint `held` is
    /// used unless the changes since it (`changes`; none when `trusting`) may have made a task
    /// before its position ready; its carried tasks are judged instead of a page when no change
    /// touched them (see [`Carried`]); the resource queues may put the start later.
    async fn plan_pass(
        &self,
        held: Option<ScanHint>,
        changes: &crate::locks::Changes,
        epoch: &str,
        requeued: &[TaskId],
        trusting: bool,
    ) -> Plan {
        let had_hint = held.is_some();
        let usable_hint = |h: &ScanHint| {
            !self.policy.hint_max_age.is_zero()
                && h.read.epoch == *epoch
                && h.read.seq <= changes.seq
                && h.returned.len() + requeued.len() <= MAX_RETURNED
                && changes.changed.as_ref().is_some_and(|names| {
                    !names.iter().any(|n| match Change::of(n) {
                        Change::Requeued(_) => false,
                        // A waiting task left: the held locks the hint relies on stay. In either
                        // mode, the tasks the hint skipped as conflicting with it (its conflict
                        // keys are among `excluded`) may be ready now.
                        Change::Left { name, .. } => h.reserved.touches(name),
                        // A shared lock released: only tasks that need the name exclusively may
                        // be ready now.
                        Change::Released { name, shared: true } => {
                            h.reserved.is_exclusive(name) || h.hiding.contains(name)
                        }
                        Change::Released { name, .. } => {
                            h.reserved.touches(name) || h.hiding.contains(name)
                        }
                        Change::All => true,
                    })
                })
        };
        // A dropped hint leaves the names it knew to hide: see `hiding` below.
        let (usable, known_before) = match held {
            Some(h) if usable_hint(&h) => (Some(h), HashSet::new()),
            Some(h) => (None, h.hiding),
            None => (None, HashSet::new()),
        };
        if !had_hint {
            tracing::debug!("pass without a scan hint");
        }
        if had_hint && usable.is_none() {
            tracing::debug!(changed = ?changes.changed, seq = changes.seq, "scan hint dropped");
        }
        // An old hint is still used (a stale hint only delays a task, never hands out one that is
        // not ready), and a walk from the head renews it in the background (`refresh`): no call
        // waits for that walk.
        if usable.as_ref().is_some_and(|h| {
            h.taken.elapsed() >= self.refreshes.due_after(self.policy.hint_max_age)
        }) {
            self.refresh_hint();
        }
        let mut reserved = Reservations::default();
        let mut excluded: Vec<String> = Vec::new();
        let mut after = None;
        let mut hint_taken = Instant::now();
        let mut hiding = None;
        // Claims put back behind the hint's position: judged before its page.
        let mut returned: Vec<TaskId> = Vec::new();
        // The rest of the page the hint's pass read, when this pass may judge it (see
        // `Carried`).
        let mut carried: Option<Arc<Carried>> = None;
        // With carried tasks after reading the changes: the names whose locks those released.
        let mut released: HashSet<String> = HashSet::new();
        // Where the resource queues say a pass may start (see below).
        let start = if self.uses_resource_queues()
            && usable
                .as_ref()
                .is_none_or(|h| self.queues.worth_a_start(position_key(h.after)))
        {
            self.queue_start(None).await
        } else {
            None
        };
        if let Some(h) = usable {
            returned = h.returned;
            for id in requeued {
                if !returned.contains(id) {
                    returned.push(*id);
                }
            }
            reserved = h.reserved;
            excluded = h.excluded;
            // (Only tasks still waiting: see `ScanHint::reserved`.)
            after = Some(h.after);
            hint_taken = h.taken;
            hiding = Some((h.after, h.hiding));
            let changed = changes.changed.as_deref().unwrap_or_default();
            let released_now = if trusting {
                HashSet::new()
            } else {
                released_names(changed)
            };
            carried = h.carried.filter(|c| {
                // (Within `RECENT`, so that a carried task this replica handed out since is
                // known as such: `Seen::Left`.)
                c.read_at.min(c.returned_read_at).elapsed() <= self.policy.hint_max_age.min(RECENT)
                    && (trusting || c.untouched_by(changed))
            });
            if let Some(c) = &carried {
                if !trusting && self.hid_among(c, &released_now).await {
                    carried = None;
                }
            }
            if carried.is_some() {
                // The locks released since the hint, which the carried page's held entries
                // may still name (see the end of the pass).
                released = released_now;
            }
        }
        // Without a hint, or with one that many tasks arrived behind (a burst for a busy
        // repository): start where the resource queues say the first waiting lane is, if that is
        // later, and reserve what the waiting holders before it need (a change to one of their
        // resources then drops the hint this pass leaves).
        // The held holders' entries count among the held entries the pass skipped by, so that
        // their release drops the hint it leaves, also when it comes before the page is read.
        let mut skipped_held: HashSet<String> = HashSet::new();
        if let Some(start) = start {
            let position = crate::tasks::key_bound(start.after);
            if after.is_none_or(|a| a < position) {
                tracing::debug!(after = ?position, "pass starts where the resource queues say");
                start.apply(&mut reserved, &mut skipped_held, |key| excluded.push(key));
                after = Some(position);
                // (It starts past the carried tasks.)
                carried = None;
                self.stats.queue_start();
            }
        }
        Plan {
            after,
            reserved,
            excluded,
            hint_taken,
            hiding,
            returned,
            carried,
            released,
            known_before,
            skipped_held,
        }
    }

    /// The third stage of a pass: what it judges first. The claims put back that it checks
    /// (`returned`, read by id unless carried) and its first page (the carried one, or read from
    /// `after`), read in one round trip; each with the time it was read, since a task this
    /// replica handed out after that is left alone (`Seen::Left`).
    async fn first_reads(
        &self,
        carried: Option<&Carried>,
        returned: &[TaskId],
        excluded: &[String],
        after: Option<(DateTime<Utc>, TaskId)>,
        near: &crate::tasks::Near,
        page: i64,
    ) -> Result<FirstReads> {
        // The returned claims still waiting, oldest first; what the next hint keeps of them. Read
        // beside the first page (neither depends on the other): one round trip for both. The
        // first page is the carried one when there is one (judged as of its read: a task granted
        // by this replica since is left alone).
        let page_carried = carried.filter(|c| !c.rows.is_empty());
        // Not when this replica handed one of them out since they were read: read afresh, a
        // claim handed out (and not put back) is not among them, and one put back since is
        // waiting again (its record is newer than the change log this pass read).
        let carried_returned = carried.and_then(|c| {
            c.returned_if(returned)
                .filter(|rows| {
                    !rows
                        .iter()
                        .any(|r| self.granted_after(&r.id, c.returned_read_at))
                })
                .map(|rows| (rows, c.returned_read_at))
        });
        let carried_removals = page_carried.map(|c| c.removals);
        if page_carried.is_some() {
            self.stats.page_carried();
        }
        // When what the pass judges first was read: the page, and the claims put back (a task
        // this replica handed out after that is left alone, `Seen::Left`).
        let now = Instant::now();
        let first_read_at = page_carried.map_or(now, |c| c.read_at);
        let extra_read_at = carried_returned.as_ref().map_or(now, |(_, at)| *at);
        let carried_page = page_carried.map(|c| c.page());
        let carried_returned = carried_returned.map(|(rows, _)| rows);
        // Every claim put back that the pass judges, before the hint's position or past it (in
        // the carried page): judged as of their own read.
        let mut returned_ids: HashSet<TaskId> = HashSet::new();
        let (extra, first_page) = if returned.is_empty() {
            (Vec::new(), carried_page)
        } else {
            let page_carried = carried_page.is_some();
            let (mut rows, mut found) = match (carried_returned, carried_page) {
                (Some(rows), Some(found)) => (rows, found),
                (Some(rows), None) => (
                    rows,
                    self.tasks.candidates(excluded, after, near, page).await?,
                ),
                (None, Some(found)) => (self.tasks.returned(returned, near).await?, found),
                (None, None) => tokio::try_join!(
                    self.tasks.returned(returned, near),
                    self.tasks.candidates(excluded, after, near, page),
                )?,
            };
            returned_ids.extend(rows.iter().map(|r| r.id));
            let past: Vec<TaskRow>;
            (rows, past) = rows
                .into_iter()
                .partition(|r| after.is_some_and(|a| (r.created, r.id) <= a));
            // Those past the hint's position: a page read now reaches them in order; a carried
            // one, read before they were put back, holds them in order.
            if page_carried && !past.is_empty() {
                let known: HashSet<TaskId> = found.tasks.iter().map(|r| r.id).collect();
                found
                    .tasks
                    .extend(past.into_iter().filter(|r| !known.contains(&r.id)));
                found.tasks.sort_by_key(|r| (r.created, r.id));
            }
            (rows, Some(found))
        };
        Ok(FirstReads {
            extra,
            first_page,
            returned_ids,
            first_read_at,
            extra_read_at,
            carried_removals,
        })
    }

    /// A stage of a pass's round: judges rows in queue order by the rule (against `reserved`,
    /// which every row judged then joins) until every claimant is trying one or nobody is left,
    /// picking a claimant for each ready row, one task per capped group (two could race for its
    /// last place). A row this replica granted after it was read (`read_at`) is left alone. Also
    /// says whether it passed over a ready task nobody in the pass could take.
    fn judge_round(
        &self,
        rows: &mut std::iter::Peekable<std::vec::IntoIter<TaskRow>>,
        claimants: &mut Claimants,
        reserved: &mut Reservations,
        versions: &BTreeMap<String, String>,
        read_at: impl Fn(&TaskRow) -> Instant,
    ) -> (Vec<Step>, bool) {
        let mut passed_over = false;
        let mut steps: Vec<Step> = Vec::new();
        // Groups with a cap tried in this round: one task each, so that two of a group's tasks
        // never race for its last place (the newer could win: FIFO within the group).
        let mut capped: HashSet<Uuid> = HashSet::new();
        while let Some(row) = rows.peek() {
            let ready_by_rule =
                ready::obstacles(&row.candidate, reserved, versions).ready_by_rule();
            let seen = if !ready_by_rule {
                Seen::NotReady
            } else if self.granted_after(&row.id, read_at(row)) {
                // Granted by this replica since this page was read: left alone.
                Seen::Left
            } else {
                let group = self.fairness.group_of_row(row);
                let cap = self.fairness.admission(group, row.immediate).cap.is_some();
                if cap && capped.contains(&group) {
                    // Judged again once the round is settled.
                    break;
                }
                match claimants.pick(row, &self.waiters) {
                    Pick::Free(who) => match InFlight::take(&self.in_flight, row.id) {
                        // Another pass is granting it: whether it stays ready is that
                        // pass's business.
                        None => Seen::PassedOver,
                        Some(mine) => {
                            claimants.get_mut(who).state = Turn::Trying;
                            if cap {
                                capped.insert(group);
                            }
                            Seen::Attempt { who, _mine: mine }
                        }
                    },
                    // Only a claimant trying another task of this round could take it:
                    // it is judged again once the round is settled.
                    Pick::Busy => break,
                    Pick::Nobody => {
                        passed_over = true;
                        Seen::PassedOver
                    }
                }
            };
            let Some(row) = rows.next() else { break };
            // Whatever becomes of it, it reserves its resources for every newer task
            // this pass judges (for one that is lost meanwhile, only a delay). So the
            // attempts of one round never conflict with each other.
            reserved.reserve(&row.candidate.resources);
            steps.push(Step { row, seen });
            if claimants.nobody_left() {
                break;
            }
        }
        (steps, passed_over)
    }

    /// A stage of a pass's round: tries the round's attempts at once (lock, then claim), and
    /// delivers each grant as soon as it is made: the caller's own through `answer`, a
    /// recruit's to its place.
    async fn grant_round(
        &self,
        steps: &[Step],
        claimants: &mut Claimants,
        answer: &mut Answer,
        stalled: &CancellationToken,
    ) -> Round {
        // The round's tasks are locked, claimed and checked together (three round trips for the
        // round); each grant is delivered once made (the caller's own through `answer`). A task
        // whose row another transaction holds is claimed on its own afterwards, so it holds up
        // no other grant of the round (the pass's next round waits for it; calls waiting for the
        // pass, only up to `pass_stall`).
        let offers: Vec<(usize, Offer)> = steps
            .iter()
            .enumerate()
            .filter_map(|(i, step)| match &step.seen {
                Seen::Attempt { who, .. } => Some((i, claimants.offer(*who).clone())),
                _ => None,
            })
            .collect();
        let tries: Vec<Try<'_>> = offers
            .iter()
            .map(|(i, offer)| Try {
                lease_id: offer.lease_id,
                lease: &offer.lease,
                row: &steps[*i].row,
                start: offer.start,
            })
            .collect();
        let together = futures::FutureExt::fuse(self.lock_and_claim_round(&tries));
        tokio::pin!(together);
        let mut alone = futures::stream::FuturesUnordered::new();
        let mut settled_now: std::collections::VecDeque<(usize, Result<Attempt>)> =
            std::collections::VecDeque::new();
        // Whether the recruits not trying a task were let go (the pass was held up).
        let mut let_go = stalled.is_cancelled();
        let mut settled: Vec<Option<Settled>> = steps.iter().map(|_| None).collect();
        let mut round = Round::default();
        loop {
            let (i, outcome) = match settled_now.pop_front() {
                Some(next) => next,
                None => {
                    tokio::select! {
                        out = &mut together, if !futures::future::FusedFuture::is_terminated(&together) => {
                            match out {
                                Ok(tried) => {
                                    for (k, tried) in tried.into_iter().enumerate() {
                                        let i = offers[k].0;
                                        match tried {
                                            Tried::Done(attempt) => settled_now.push_back((i, Ok(attempt))),
                                            Tried::Alone { fencing_token, app_status } => {
                                                let t = &tries[k];
                                                alone.push(async move {
                                                    (i, self.claim_alone(t, fencing_token, app_status).await)
                                                });
                                            }
                                        }
                                    }
                                }
                                Err(e) => {
                                    // Backend trouble for the whole round: the pass ends after
                                    // it. The caller hears of it; recruits go back to waiting.
                                    round.stop = true;
                                    let mut e = Some(e);
                                    for (i, _) in &offers {
                                        let Seen::Attempt { who, .. } = &steps[*i].seen else {
                                            continue;
                                        };
                                        let claimant = claimants.get_mut(*who);
                                        claimant.state = Turn::Done;
                                        if claimant.recruit.take().is_none() {
                                            round.failure = round.failure.take().or(e.take());
                                        }
                                        settled[*i] = Some(Settled::NotGranted);
                                    }
                                }
                            }
                            continue;
                        }
                        Some(next) = futures::StreamExt::next(&mut alone), if !alone.is_empty() => next,
                        () = stalled.cancelled(), if !(let_go
                            || futures::future::FusedFuture::is_terminated(&together) && alone.is_empty()) => {
                            // Held up: the recruits not trying a task wait elsewhere.
                            let_go = true;
                            claimants.let_go();
                            continue;
                        }
                        else => break,
                    }
                }
            };
            let Seen::Attempt { who, .. } = &steps[i].seen else {
                continue;
            };
            let claimant = claimants.get_mut(*who);
            claimant.state = Turn::Free;
            settled[i] = Some(match outcome {
                Ok(Attempt::Granted(grant)) => {
                    if let Ok(mut recent) = self.recent.lock() {
                        recent.note(grant.task_id);
                    }
                    claimant.state = Turn::Done;
                    match claimant.recruit.take() {
                        None => {
                            round.own_served = true;
                            answer.send(Ok(Some(grant))).await;
                        }
                        Some(recruit) => {
                            self.stats.fetch_shared();
                            if let Err(Ok(grant)) = recruit.deliver(Ok(grant)) {
                                self.requeue.undelivered(&grant).await;
                            }
                        }
                    }
                    Settled::Granted
                }
                Ok(Attempt::Blocked) => Settled::Blocked,
                Ok(Attempt::NotGranted | Attempt::HeldBack(_)) => Settled::NotGranted,
                Ok(Attempt::Lost) => Settled::Lost,
                Ok(Attempt::LeaseGone) => {
                    claimant.state = Turn::Done;
                    let gone = self.lease_gone(claimant.offer.lease_id);
                    match claimant.recruit.take() {
                        None => {
                            round.failure = round.failure.or(Some(gone));
                            round.stop = true;
                        }
                        Some(recruit) => {
                            let _ = recruit.deliver(Err(gone));
                        }
                    }
                    Settled::NotGranted
                }
                Err(e) => {
                    // Backend trouble: the pass ends after this round. The caller hears
                    // of it; a recruit goes back to waiting.
                    claimant.state = Turn::Done;
                    round.stop = true;
                    if claimant.recruit.take().is_none() {
                        round.failure = round.failure.or(Some(e));
                    }
                    Settled::NotGranted
                }
            });
        }
        round.settled = settled;
        round
    }

    /// The last stage of a pass: stores the hint it leaves, with the held names that hide tasks
    /// before its position (`hiding`: the names the hint it started from knew, at that hint's
    /// position; `known_before`: those of a hint it dropped; `held_seen`: every held entry the
    /// pass skipped tasks by). A hint that would rely on a lock released before the pass
    /// (`released`, with carried tasks) is dropped instead.
    async fn leave_hint(
        &self,
        mut hint: ScanHint,
        hiding: Option<KnownHiding>,
        known_before: HashSet<String>,
        held_seen: HashSet<String>,
        removals: queues::Removals,
        released: &HashSet<String>,
    ) {
        // What hides older tasks from the scan at the hint's position. A name that hid a
        // task older than the hint's earlier position hides it from every later position
        // too (until that task is handed out or ends: keeping the name then only drops the
        // hint more often than needed), so when the position moved forward only the other
        // held names are looked up (one statement, none when there are none); when it did not
        // move, nothing is. A blocked head of 100,000 tasks made that look-up 30 ms per fetch
        // when every name was counted again. A failed look-up only costs the hint.
        let (known, unknown): (HashSet<String>, Vec<String>) = match hiding {
            // Not moved: every task before it was seen by the pass that set it, when names
            // held since were not, so what could hide is known (or reserved).
            Some((start, known)) if start == hint.after => (known, Vec::new()),
            Some((start, known)) if start < hint.after => {
                let (_, unknown) = split_by_known(held_seen, &known);
                (known, unknown)
            }
            // No hint to start from: the names a dropped hint knew to hide are kept while
            // still held, as the background walk does (a name kept needlessly only drops
            // the hint more often); the others are looked up. After the blocked
            // repository's running task finished, counting its queue again took as long as
            // the walk from the head.
            _ => split_by_known(held_seen, &known_before),
        };
        // The resource queues answer for most names without a look-up (e.g. the blocked
        // repository's: counting its users read its whole queue).
        let mut known = known;
        let unknown =
            self.queues
                .split_hiding(unknown, position_key(hint.after), removals, &mut known);
        let now_hiding = if unknown.is_empty() {
            Ok(known)
        } else {
            tracing::debug!(names = ?unknown, after = ?hint.after, "held names counted with hiding.sql");
            self.tasks
                .hiding(hint.after, &unknown)
                .await
                .map(|names| known.into_iter().chain(names).collect())
        };
        if let Ok(names) = now_hiding {
            hint.hiding = names;
            if hint.hiding.iter().any(|n| released.contains(n)) {
                // The carried page's held entries named a lock released before this pass,
                // and it hid a task before the new position: that task may be ready, and
                // the hint must not rely on the lock. Dropped: the next pass finds it.
                tracing::debug!(after = ?hint.after, "scan hint dropped: a lock it would rely on was released");
                if let Ok(mut slot) = self.hint.lock() {
                    if slot.as_ref().is_none_or(|h| h.taken <= hint.taken) {
                        *slot = None;
                    }
                }
                return;
            }
            if let Ok(mut slot) = self.hint.lock() {
                // Not over a hint taken later (a background walk's renewal): this one
                // carries the age of the hint it started from.
                if slot.as_ref().is_none_or(|h| h.taken <= hint.taken) {
                    *slot = Some(hint);
                }
            }
        }
    }

    /// ClaimTask: locks and claims exactly this task if it is ready for this lease now.
    pub async fn claim(&self, lease_id: LeaseId, task_id: TaskId) -> Result<Option<Grant>> {
        let this = self.clone();
        self.detached(async move { this.claim_once(lease_id, task_id).await })
            .await
    }

    /// Runs one pass in its own task (see [`Dispatch::detached`]). The pass answers its caller
    /// as soon as the caller's own grant is made, and may go on settling the grants of the
    /// waiters it recruited; a grant whose caller is gone by then is requeued.
    async fn run_pass(
        &self,
        call: Call,
        own_place: Option<u64>,
        passed_over: Arc<AtomicBool>,
        lease_out: Arc<Mutex<Option<Arc<LeaseRecord>>>>,
        slot: PassSlot,
    ) -> Result<Option<Grant>> {
        let this = self.clone();
        self.answered(move |mut answer| async move {
            // Counted until the pass has settled every grant, not just its caller's, or until
            // it has run for `pass_stall` (held up: the waiters no longer wait for it, and it
            // lets go of the waiters it recruited and is not trying a task for).
            let mut slot = Some(slot);
            let stall = this.policy.pass_stall;
            let stats = Arc::clone(&this.stats);
            let stalled = CancellationToken::new();
            let waiters = Arc::clone(&this.waiters);
            let outcome = {
                let pass = crate::metrics::count_pass(
                    &stats,
                    this.fetch_once(
                        call,
                        &stalled,
                        own_place,
                        &passed_over,
                        &lease_out,
                        &mut answer,
                    ),
                );
                tokio::pin!(pass);
                tokio::select! {
                    outcome = &mut pass => outcome,
                    () = tokio::time::sleep(stall) => {
                        stats.fetch_pass_stalled();
                        let _held_up = waiters.held_up();
                        stalled.cancel();
                        drop(slot.take());
                        // A turn given meanwhile may sit with a waiter this pass is trying a
                        // task for: the longest free waiter takes one now.
                        waiters.wake();
                        pass.await
                    }
                }
            };
            // Counted out before the answer: the turn it hands on need not wait for it.
            drop(slot);
            answer.send(outcome).await;
        })
        .await
    }

    /// Runs a granting step in its own task, so a caller that goes away cannot interrupt it
    /// between lock and claim. If the caller is gone when a grant is ready, the grant is requeued
    /// (the task goes back to the queue, its locks are released) instead of being lost.
    async fn detached(
        &self,
        step: impl std::future::Future<Output = Result<Option<Grant>>> + Send + 'static,
    ) -> Result<Option<Grant>> {
        self.answered(move |mut answer| async move { answer.send(step.await).await })
            .await
    }

    /// Runs `step` in its own task, counted in [`Dispatch::passes`], with the caller's
    /// [`Answer`]; returns what the step answers.
    async fn answered<F, Fut>(&self, step: F) -> Result<Option<Grant>>
    where
        F: FnOnce(Answer) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let (deliver, receive) = tokio::sync::oneshot::channel();
        let answer = Answer {
            deliver: Some(deliver),
            requeue: self.requeue.clone(),
        };
        let running = self.passes.enter();
        // (A step of a counted pass counts its calls in it. Its share of the count goes before
        // it is counted out of the running passes: a pass's tally is complete once no pass runs.)
        let calls = crate::metrics::pass_calls();
        tokio::spawn(async move {
            let _running = running;
            crate::metrics::counted_in(calls, step(answer)).await;
        });
        // Dropped before the answer is read (the caller went away just after it was sent), the
        // guard requeues the grant in it.
        let mut awaiting = Awaiting {
            receive,
            requeue: self.requeue.clone(),
            passes: Arc::clone(&self.passes),
        };
        (&mut awaiting.receive)
            .await
            .map_err(|_| Error::Internal("a fetch step ended without an answer".into()))?
    }

    async fn claim_once(&self, lease_id: LeaseId, task_id: TaskId) -> Result<Option<Grant>> {
        let lease = self.live_lease(lease_id).await?;
        let task = self
            .tasks
            .task(task_id, &self.near())
            .await?
            .ok_or(Error::TaskNotFound(task_id))?;
        // Unclaimed, or marked with the lease's own row: Pulp's dispatch() marks an immediate
        // task with the dispatching process's row before asking whether it may run it now.
        let own_mark = task
            .app_lock_id
            .is_some_and(|a| a.to_string() == lease.app_status_id);
        if task.state != TaskState::Waiting || (task.app_lock_id.is_some() && !own_mark) {
            return Ok(None);
        }
        if ready::judge(
            &task.row.candidate,
            &Reservations::default(),
            &lease.versions,
        ) != Verdict::Ready
        {
            return Ok(None);
        }
        match self
            .lock_and_claim(lease_id, &lease, &task.row, false)
            .await?
        {
            Attempt::Granted(grant) => Ok(Some(grant)),
            Attempt::LeaseGone => Err(Error::LeaseNotFound(lease_id.to_string())),
            Attempt::NotGranted | Attempt::HeldBack(_) | Attempt::Blocked | Attempt::Lost => {
                Ok(None)
            }
        }
    }

    async fn live_lease(&self, lease_id: LeaseId) -> Result<Arc<LeaseRecord>> {
        match self.locks.lease(lease_id).await? {
            Some(lease) => Ok(self.remember_lease(lease_id, lease)),
            None => Err(self.lease_gone(lease_id)),
        }
    }

    /// Keeps a lease just read alive.
    fn remember_lease(&self, lease_id: LeaseId, lease: LeaseRecord) -> Arc<LeaseRecord> {
        let lease = Arc::new(lease);
        if let Ok(mut known) = self.leases.lock() {
            if known.len() >= MAX_KNOWN_LEASES && !known.contains_key(&lease_id) {
                // Ended leases are not told apart here: start again rather than grow.
                known.clear();
            }
            known.insert(lease_id, (Arc::clone(&lease), Instant::now()));
        }
        lease
    }

    /// Notes that Redis just said a known lease is alive (a holder check or a grant under it).
    fn lease_alive(&self, lease_id: LeaseId) {
        if let Ok(mut known) = self.leases.lock() {
            if let Some((_, alive_at)) = known.get_mut(&lease_id) {
                *alive_at = Instant::now();
            }
        }
    }

    /// Forgets a lease found ended; the error its caller gets.
    fn lease_gone(&self, lease_id: LeaseId) -> Error {
        self.forget_lease(lease_id);
        Error::LeaseNotFound(lease_id.to_string())
    }

    /// Forgets a lease that ended (CloseLease through this replica).
    pub fn forget_lease(&self, lease_id: LeaseId) {
        self.known_leases().forget(lease_id);
    }

    /// The leases this replica knows, for the admin API to forget one it revoked.
    pub fn known_leases(&self) -> KnownLeases {
        KnownLeases(Arc::clone(&self.leases))
    }

    fn known_lease(&self, lease_id: LeaseId) -> Option<Arc<LeaseRecord>> {
        Some(Arc::clone(&self.leases.lock().ok()?.get(&lease_id)?.0))
    }

    /// A known lease Redis said was alive within two `--fetch-wake-poll` intervals (the worker's
    /// FinishTask, a grant just made; the longest a pass trusts a scan hint): a call joining the
    /// waiters then takes it without a Redis call. A lease that ended meanwhile through another
    /// replica, or expired, is found by the acquire script if a pass recruits the call; until
    /// then the call waits, as an idle worker would.
    fn lease_alive_lately(&self, lease_id: LeaseId) -> Option<Arc<LeaseRecord>> {
        let known = self.leases.lock().ok()?;
        let (lease, alive_at) = known.get(&lease_id)?;
        (alive_at.elapsed() <= self.trust_window()).then(|| Arc::clone(lease))
    }

    /// The lease of a call about to join the waiters: from memory when Redis said it was alive
    /// lately, else read (an unknown lease gets NOT_FOUND).
    async fn joining_lease(&self, lease_id: LeaseId) -> Result<Arc<LeaseRecord>> {
        match self.lease_alive_lately(lease_id) {
            Some(lease) => Ok(lease),
            None => self.live_lease(lease_id).await,
        }
    }

    /// Whether a lock in `released` (names whose locks the changes a pass read released) may
    /// have hidden a waiting task among the carried tasks `c` from the page they came from (such
    /// a task may be ready now, and older than the carried ones): then the pass reads its page
    /// instead. The resource queues answer for the page's held entries on those names; what they
    /// cannot tell (they have not read that far yet, a user of the name left since, or they are
    /// off) Postgres answers in one statement (hiding.sql), which usually costs less than the
    /// page. If that statement fails, the answer is yes.
    async fn hid_among(&self, c: &Carried, released: &HashSet<String>) -> bool {
        let Some(last) = c.rows.last() else {
            return false;
        };
        let entries: Vec<String> = c
            .held
            .iter()
            .filter(|e| released.contains(e.strip_prefix(SHARED_PREFIX).unwrap_or(e)))
            .cloned()
            .collect();
        if entries.is_empty() {
            return false;
        }
        let mut hiding = HashSet::new();
        let unknown = self.queues.split_hiding(
            entries,
            position_key((last.created, last.id)),
            c.removals,
            &mut hiding,
        );
        if !hiding.is_empty() {
            return true;
        }
        if unknown.is_empty() {
            return false;
        }
        match self.tasks.hiding((last.created, last.id), &unknown).await {
            Ok(names) => {
                tracing::debug!(entries = ?unknown, hiding = ?names, "released locks the resource queues could not tell about, counted with hiding.sql");
                !names.is_empty()
            }
            Err(e) => {
                tracing::debug!(error = %e, "could not tell whether a released lock hid a task among the carried ones; the page is read");
                true
            }
        }
    }

    /// The lease as this replica last read it, and the changes since hint `h` as this replica's
    /// own calls recorded them (see [`crate::locks::Locks::own_changes`]), when those are all the
    /// changes since the hint and the result is as trusted as a read of the log (within the same
    /// window since the call that recorded the last of them was sent, see [`trusted_until`]);
    /// with until when.
    fn own_changes_since(
        &self,
        h: &ScanHint,
        lease_id: LeaseId,
        made: u64,
    ) -> Option<(Arc<LeaseRecord>, crate::locks::Changes, Instant)> {
        let epoch = self.locks.epoch();
        let h = &h.read;
        let own = self.locks.own_changes(h.made, made, h.seq, &h.epoch)?;
        // The log was at `own.seq` when the call that recorded it ran: after it was sent, and
        // after the hint's own read.
        let read = ReadAgainst {
            epoch: h.epoch.clone(),
            seq: own.seq,
            checked_at: own.sent.map_or(h.checked_at, |sent| sent.max(h.checked_at)),
            made,
        };
        let clean_until = trusted_until(
            &read,
            &epoch,
            made,
            self.locks.seq_read(),
            self.trust_window(),
            Instant::now(),
        )?;
        let lease = self.known_lease(lease_id)?;
        let changes = crate::locks::Changes {
            seq: own.seq,
            changed: Some(own.changed),
        };
        Some((lease, changes, clean_until))
    }

    /// Whether a pass may use hint `h` without reading the change log first: see
    /// [`trusted_until`].
    fn trusted(&self, h: &ScanHint, made: u64) -> Option<Instant> {
        trusted_until(
            &h.read,
            &self.locks.epoch(),
            made,
            self.locks.seq_read(),
            self.trust_window(),
            Instant::now(),
        )
    }

    /// Two `--fetch-wake-poll` intervals: the longest a pass uses a scan hint without reading the
    /// change log, and a call joining the waiters trusts that its lease is alive.
    fn trust_window(&self) -> Duration {
        self.policy.wake_poll.saturating_mul(2)
    }

    /// Fair dispatch's directed passes for one call, in the order `fairness` plans them: the
    /// first ready task of the immediate tasks or of a group goes to the caller. `None` when
    /// fairness is not engaged or no directed page held a ready task (the pass in queue order
    /// runs then).
    async fn directed_passes(&self, call: &Call) -> Result<Fair> {
        if !self.fairness.needs_standing() {
            return Ok(Fair::QueueOrder);
        }
        // One pass in the counts: the standing read and the directed passes.
        let stats = Arc::clone(&self.stats);
        let fair = crate::metrics::count_pass(&stats, self.directed_passes_counted(call)).await;
        self.stats.fetch_pass();
        fair
    }

    async fn directed_passes_counted(&self, call: &Call) -> Result<Fair> {
        let standing = self.locks.standing().await?;
        let plan = self.fairness.plan(&standing);
        tracing::debug!(?plan, ?standing, "fair dispatch's plan");
        for (i, directed) in plan.directed.iter().copied().enumerate() {
            // The groups after this one in the fair order: a page read for it reads theirs ahead.
            let ahead: Vec<Uuid> = plan.directed[i + 1..]
                .iter()
                .filter_map(|d| d.group())
                .chain(plan.ahead.iter().copied())
                .collect();
            let this = self.clone();
            let call = call.clone();
            let not_dry = Arc::new(AtomicBool::new(false));
            let not_dry_here = Arc::clone(&not_dry);
            let grant = self
                .detached(async move {
                    this.directed_pass(&call, directed, &ahead, &not_dry_here)
                        .await
                })
                .await?;
            self.stats.directed_pass(grant.is_some());
            if let Some(grant) = grant {
                return Ok(Fair::Granted(grant));
            }
            // A page whose ready task was held back (another fetch took the last place under
            // the cap or the reserve just now), or could not go to this lease (versions, skip
            // ids), is not dry: it is read again at the next turn.
            if !not_dry.load(Ordering::SeqCst) {
                self.fairness.dry(directed);
            }
        }
        Ok(if plan.skip_queue_order {
            Fair::Wait
        } else {
            Fair::QueueOrder
        })
    }

    /// One directed page (the immediate tasks, or one group's), judged in queue order by the
    /// readiness rule: the first ready task the caller's lease may take is locked and claimed.
    async fn directed_pass(
        &self,
        call: &Call,
        directed: crate::tasks::Directed,
        ahead: &[Uuid],
        not_dry: &AtomicBool,
    ) -> Result<Option<Grant>> {
        let lease = match self.known_lease(call.lease_id) {
            Some(lease) => lease,
            None => self.live_lease(call.lease_id).await?,
        };
        let offer = call.offer(Arc::clone(&lease));
        let max_age = self.policy.hint_max_age.min(RECENT);
        let mut carried = self.fairness.take_carried(directed, max_age);
        loop {
            let from_carried = carried.is_some();
            let page = match carried.take() {
                Some(carried) => {
                    self.stats.page_carried();
                    carried
                }
                None => self.read_directed(directed, ahead, max_age).await?,
            };
            if let Some(grant) = self
                .judge_directed(call, &lease, &offer, directed, page, max_age, not_dry)
                .await?
            {
                return Ok(Some(grant));
            }
            // Carried tasks that gave nothing (their heads may have become ready since, or new
            // tasks may follow them): the group's page is read before it is called dry.
            if !from_carried || not_dry.load(Ordering::SeqCst) {
                return Ok(None);
            }
        }
    }

    /// Reads a directed page, and the pages of the groups of `ahead` that have no tasks carried
    /// (read ahead, carried for their directed passes).
    async fn read_directed(
        &self,
        directed: crate::tasks::Directed,
        ahead: &[Uuid],
        max_age: Duration,
    ) -> Result<fairness::Carried> {
        let read_at = Instant::now();
        let ahead: Vec<Uuid> = if max_age.is_zero() {
            Vec::new()
        } else {
            ahead
                .iter()
                .copied()
                .filter(|g| {
                    !self
                        .fairness
                        .has_carried(self.fairness.directed_group(*g), max_age)
                })
                .take(crate::tasks::READ_AHEAD)
                .collect()
        };
        let pages = self
            .tasks
            .directed_pages(&self.near(), self.policy.first_page, directed, &ahead)
            .await?;
        for (g, page) in pages.ahead {
            if !page.tasks.is_empty() {
                let carried = fairness::Carried {
                    rows: page.tasks,
                    whole: page.whole,
                    read_at,
                };
                self.fairness
                    .carry(self.fairness.directed_group(g), carried, max_age);
            }
        }
        Ok(fairness::Carried {
            rows: pages.lead.tasks,
            whole: pages.lead.whole,
            read_at,
        })
    }

    /// Judges a directed page in queue order by the readiness rule: the first ready task the
    /// caller's lease may take is locked and claimed, and every other task of the page that was
    /// not handed out since is carried for the next directed pass.
    #[allow(clippy::too_many_arguments)]
    async fn judge_directed(
        &self,
        call: &Call,
        lease: &Arc<LeaseRecord>,
        offer: &Offer,
        directed: crate::tasks::Directed,
        page: fairness::Carried,
        max_age: Duration,
        not_dry: &AtomicBool,
    ) -> Result<Option<Grant>> {
        let fairness::Carried {
            rows,
            whole,
            read_at,
        } = page;
        let mut reserved = Reservations::default();
        let mut held = HeldInPass::default();
        // What the page holds that was not handed out, in queue order.
        let mut passed: Vec<TaskRow> = Vec::new();
        let mut rows = rows.into_iter();
        while let Some(row) = rows.next() {
            if self.granted_after(&row.id, read_at) {
                // Handed out through this replica since the page was read.
                continue;
            }
            let ready_by_rule =
                ready::obstacles(&row.candidate, &reserved, &lease.versions).ready_by_rule();
            reserved.reserve(&row.candidate.resources);
            if ready_by_rule && !offer.takes(&row) {
                // Ready, but not for this lease (versions, skip ids): another lease may take
                // it, so the page is not dry for everyone.
                not_dry.store(true, Ordering::SeqCst);
            }
            let group = self.fairness.group_of_row(&row);
            if !ready_by_rule || !offer.takes(&row) || held.holds(group, row.immediate) {
                passed.push(row);
                continue;
            }
            let Some(_mine) = InFlight::take(&self.in_flight, row.id) else {
                passed.push(row);
                continue;
            };
            match self
                .lock_and_claim(call.lease_id, lease, &row, call.start)
                .await?
            {
                Attempt::Granted(grant) => {
                    if let Ok(mut recent) = self.recent.lock() {
                        recent.note(grant.task_id);
                    }
                    // The rest goes to the next directed pass of this page.
                    passed.extend(rows);
                    self.fairness.handed_out(
                        directed,
                        (row.created, row.id),
                        passed.first().map(|r| (r.created, r.id)),
                        whole,
                        read_at,
                    );
                    if !passed.is_empty() && !max_age.is_zero() {
                        let carried = fairness::Carried {
                            rows: passed,
                            whole,
                            read_at,
                        };
                        self.fairness.carry(directed, carried, max_age);
                    }
                    return Ok(Some(grant));
                }
                Attempt::LeaseGone => return Err(self.lease_gone(call.lease_id)),
                Attempt::HeldBack(why) => {
                    // Its group is at its cap: the page's other groups' tasks are still tried,
                    // this group's are not (or, the reserve full, no deferred task is).
                    not_dry.store(true, Ordering::SeqCst);
                    held.note(group, why);
                    passed.push(row);
                }
                Attempt::Blocked | Attempt::NotGranted | Attempt::Lost => passed.push(row),
            }
        }
        Ok(None)
    }

    /// Puts a claimed task that never started back in the queue (no-op otherwise); true when
    /// the task is running (or canceling) under `app_status` instead, and so was left alone.
    async fn requeue_claim(
        &self,
        task_id: TaskId,
        app_status: Uuid,
    ) -> Result<crate::tasks::Requeued> {
        let found = self
            .tasks
            .requeue_unless_running(task_id, app_status)
            .await?;
        if found.requeued {
            self.requeue.note_requeue(task_id).await;
            tracing::info!(%task_id, "released before start; task back in the queue");
        }
        Ok(found)
    }

    /// Records how long a task that ended ran, under its group's label.
    fn task_ran(&self, ran: crate::tasks::Ran) {
        let label = self
            .fairness
            .label(self.fairness.group_of(ran.domain, ran.task_group));
        self.stats.task_ran(label, ran.seconds.max(0.0));
    }

    /// StartTask: marks a claimed task running, for its holder only. A task its holder (the
    /// lease and fencing token that hold its lock) already started is answered with the time it
    /// started, so a StartTask retried after its answer was lost succeeds.
    pub async fn start(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        fencing_token: FencingToken,
    ) -> Result<DateTime<Utc>> {
        let app_status = self.holder(lease_id, task_id, fencing_token).await?;
        self.tasks.start(task_id, app_status).await?.ok_or_else(|| {
            Error::NotHolder(format!(
                "task {task_id} is no longer a waiting or started task of lease {lease_id} (canceled before it started, or ended); do not run it"
            ))
        })
    }

    /// FinishTask: records the final state and releases the locks, for the holder only. A task
    /// that reached a final state meanwhile (canceled) keeps that state; its locks are released.
    /// A retry of a FinishTask that did finish the task and release its lock (its answer lost) is
    /// answered with the task's state, changing nothing.
    /// Runs in its own tokio task, so a caller that goes away between the final state and the
    /// release does not leave a finished task's locks behind.
    pub async fn finish(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        fencing_token: FencingToken,
        finish: Finish,
    ) -> Result<(String, bool)> {
        let this = self.clone();
        self.spawn_counted(async move {
            this.finish_once(lease_id, task_id, fencing_token, finish)
                .await
        })
        .await
        .map_err(|e| Error::Internal(format!("finish: {e}")))?
    }

    async fn finish_once(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        fencing_token: FencingToken,
        finish: Finish,
    ) -> Result<(String, bool)> {
        let held = batched(
            self.finishes
                .holders
                .call((lease_id, task_id, fencing_token))
                .await,
            crate::locks::Error::Batch,
        )?;
        let app_status = match self.holder_checked(lease_id, task_id, fencing_token, held) {
            Ok(app_status) => app_status,
            Err(Error::NotHolder(why)) => {
                // The lease is alive but holds no lock for the task under this token. When the
                // lease's last FinishTask released this very task under this token, this is a
                // retry of it (its answer lost with a replica or a connection): the task's state
                // is the answer, and nothing changes. Anyone else (a stale token, another lease)
                // is refused as before.
                let retried = self.locks.last_finished(lease_id).await?
                    == Some(format!("{task_id}:{fencing_token}"));
                let state = match retried {
                    true => self.final_state(task_id).await?,
                    false => None,
                };
                return state.map(|s| (s, false)).ok_or(Error::NotHolder(why));
            }
            Err(e) => return Err(e),
        };
        let finishing = crate::tasks::Finishing {
            task: task_id,
            app_status,
            state: finish.state,
            reason: finish.error,
        };
        let mut ended = batched(
            self.finishes.finishes.call(finishing.clone()).await,
            crate::tasks::Error::Batch,
        )?;
        if ended == crate::tasks::Ended::RowLocked {
            // Another transaction holds the row (Pulp canceling the task, say): finished on its
            // own, waiting for the row, so the batch waits for nobody.
            ended = self.tasks.finish(finishing).await?;
        }
        let finished_now = matches!(ended, crate::tasks::Ended::Finished { .. });
        let state = match ended {
            crate::tasks::Ended::Finished { state, ran } => {
                if let Some(ran) = ran {
                    self.task_ran(ran);
                }
                state
            }
            _ => self
                .tasks
                .state(task_id)
                .await?
                .map(|(state, _)| state)
                .ok_or(Error::TaskNotFound(task_id))?,
        };
        let (released, _) = batched(
            self.finishes
                .releases
                .call((lease_id, task_id, fencing_token))
                .await,
            crate::locks::Error::Batch,
        )?;
        if finished_now {
            // Out of the resource queues only once its locks are released: a pass that read the
            // lock held, and so skipped the tasks it hides, must not also find the queues saying
            // the name hides nothing (its holder gone, one user left before the position), or
            // the hint it leaves would not be dropped by the release and would hold a ready
            // task back until a walk. A pass that took the queues' removals before this one
            // sees the name lost a user and asks Postgres (hiding.sql).
            self.queues.ended(task_id);
        }
        let released = released == Release::Released;
        if !released {
            // Final now, with no lock to release (and so none recorded): tasks behind it may be
            // ready.
            self.locks.note_changes(&["*"]).await?;
        }
        if released {
            self.stats.locks_released("finish", 1);
        }
        Ok((state, released))
    }

    /// The task's state when it is final.
    async fn final_state(&self, task_id: TaskId) -> Result<Option<String>> {
        Ok(self
            .tasks
            .state(task_id)
            .await?
            .map(|(state, _)| state)
            .filter(|state| TaskState::parse(state).is_some_and(|s| s.is_final())))
    }

    async fn holder(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        fencing_token: FencingToken,
    ) -> Result<Uuid> {
        let held = self.locks.holder(lease_id, task_id, fencing_token).await?;
        self.holder_checked(lease_id, task_id, fencing_token, held)
    }

    /// What a holder check `held` means for a call of the holder: its lease's core_appstatus row,
    /// or why it may not act on the task.
    fn holder_checked(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        fencing_token: FencingToken,
        held: std::result::Result<String, Release>,
    ) -> Result<Uuid> {
        match held {
            Ok(app_status) => {
                self.lease_alive(lease_id);
                app_status
                    .parse()
                    .map_err(|_| Error::LeaseNotFound(lease_id.to_string()))
            }
            Err(Release::NotHeld) => Err(self.lease_gone(lease_id)),
            Err(Release::StaleToken) => Err(Error::NotHolder(format!(
                "fencing token {fencing_token} is stale for task {task_id}; the lock was granted again since"
            ))),
            Err(_) => Err(Error::NotHolder(format!(
                "lease {lease_id} does not hold task {task_id}"
            ))),
        }
    }

    /// ReleaseLocks: releases a task's locks for its holder. Idempotent: `false` when nothing was
    /// held (NOT_FOUND when the caller's lease is gone and nothing was released). A claimed task
    /// that never started goes back to the queue first, so a failure half-way leaves it claimed
    /// and locked, and a retry completes the release.
    pub async fn release(
        &self,
        lease_id: LeaseId,
        task_id: TaskId,
        fencing_token: FencingToken,
    ) -> Result<bool> {
        // The claim goes back first, while the locks still cover it. When the holder check
        // fails (Redis slow, or the lease expired but not yet swept), it goes back after the
        // release instead. (A failed check is not fatal: the release below retries.)
        let mut put_back = false;
        // How long the task ran, if it ended: recorded once its locks are released now.
        let mut ran = None;
        if let Ok(Ok(app_status)) = self.locks.holder(lease_id, task_id, fencing_token).await {
            if let Ok(app_status) = app_status.parse::<Uuid>() {
                // A running task keeps its locks until its final state is recorded: released
                // now, it would run unprotected (and its claim without locks would look like
                // lost Redis writes to the reconciler).
                let found = self.requeue_claim(task_id, app_status).await?;
                ran = found.ran;
                if found.running_here {
                    return Err(Error::NotHolder(format!(
                        "task {task_id} is running: record its final state first (FinishTask, \
                         or Pulp's own set_completed/set_failed), then release; nothing was \
                         released"
                    )));
                }
                put_back = true;
            }
        }
        let (outcome, app_status) = self
            .locks
            .release_retrying(lease_id, task_id, fencing_token)
            .await?;
        if app_status.is_empty() && !matches!(outcome, Release::Released) {
            // The caller's lease is gone (ended, swept, or lost with Redis's state): as for every
            // other call under it, NOT_FOUND tells the worker to open a new lease, which takes
            // over the tasks rebuilt for its row with new tokens. Nothing was released.
            return Err(self.lease_gone(lease_id));
        }
        if !put_back && matches!(outcome, Release::Released | Release::NotHeld) {
            if let Ok(app_status) = app_status.parse::<Uuid>() {
                ran = self.requeue_claim(task_id, app_status).await?.ran;
            }
        }
        match outcome {
            Release::Released => {
                self.stats.locks_released("release", 1);
                // Only the release that freed the locks says the task ran (not a retry).
                if let Some(ran) = ran {
                    self.task_ran(ran);
                }
                Ok(true)
            }
            Release::NotHeld => Ok(false),
            Release::OtherLease => Err(Error::NotHolder(format!(
                "lease {lease_id} does not hold task {task_id}; nothing was released"
            ))),
            Release::StaleToken => Err(Error::NotHolder(format!(
                "fencing token {fencing_token} is stale for task {task_id}; nothing was released"
            ))),
        }
    }

    /// CancelTask: `(state after, holder_notified)`. A waiting task becomes canceled and loses
    /// any locks held for it; a running one becomes canceling and its holder hears of it in the
    /// next heartbeat reply; a final task is unchanged (and any lock left for it is released, so
    /// a retry after a failure half-way completes the cancel).
    pub async fn cancel(&self, task_id: TaskId) -> Result<(TaskState, bool)> {
        let this = self.clone();
        tokio::spawn(async move { this.cancel_once(task_id).await })
            .await
            .map_err(|e| Error::Internal(format!("cancel: {e}")))?
    }

    async fn cancel_once(&self, task_id: TaskId) -> Result<(TaskState, bool)> {
        let cancel = self
            .tasks
            .cancel(task_id)
            .await?
            .ok_or(Error::TaskNotFound(task_id))?;
        if cancel.after.is_final() {
            match self.locks.force_release(task_id).await? {
                Some(holder) => {
                    self.stats.locks_released("cancel", 1);
                    tracing::info!(%task_id, lease_id = %holder, "locks of a canceled task released");
                }
                // A waiting task that held no lock reserved its resources all the same: tasks
                // behind it may be ready now.
                None if cancel.before == TaskState::Waiting => {
                    self.locks.note_changes(&["*"]).await?
                }
                None => {}
            }
            return Ok((cancel.after, false));
        }
        Ok((cancel.after, cancel.app_lock_id.is_some()))
    }
}
