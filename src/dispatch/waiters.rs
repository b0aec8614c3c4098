//! Long-poll without a herd: waiting fetches queue up in arrival order, and a wake-up (a task
//! inserted, a lock released, a task ended, the slow safety tick) gives *the longest waiter* one
//! turn: one pass over the queue. That pass serves more than its own caller: every ready task it
//! meets goes to the longest waiter that can take it (the others are *recruited*: their offers,
//! lease and skips, travel with the pass, and what it grants them is *delivered* to their place),
//! so one scan hands a burst of ready tasks to a whole queue of waiters, oldest task to the
//! longest waiter, each under its own lease. A waiter whose pass got a task leaves and hands the
//! turn to the next (more may be ready); a pass that finds nothing ends the chain, so an idle
//! fleet costs one pass per wake-up, not one per worker. A waiter that passed over a ready task
//! nobody in the pass could take (versions, `skip_task_ids`) hands the turn on as well.
//!
//! A waiter is in one state at a time: open (waiting, may be recruited), on its own pass,
//! recruited by another's pass, delivered (a grant or an error is in its place), or gone. A turn
//! that arrives while it is recruited is kept until the pass lets it go. A turn given to a waiter
//! that leaves before taking it moves on to the new longest waiter, so no wake-up is lost; a
//! delivery that finds the waiter gone is handed back to the pass, and one that arrived but was
//! never taken goes to the queue's `abandoned` hook: nothing granted is ever dropped.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// What becomes of a delivery whose waiter left before taking it.
pub type Abandoned<D> = Box<dyn Fn(D) + Send + Sync>;

/// The queue of waiting fetches of one replica. `O` is what a pass needs to serve a waiter (its
/// offer), `D` what it delivers.
pub struct Waiters<O, D> {
    queue: Mutex<Queue<O, D>>,
    /// Bumped by every wake-up: a fetch that joins after a wake-up it did not see takes a turn
    /// at once.
    generation: AtomicU64,
    /// The generation at which a pass last found nothing ready for anyone (no task it could
    /// take, none it passed over); `u64::MAX` when unknown.
    empty_at: AtomicU64,
    /// Passes held up past their stall and still running (see [`Waiters::held_up`]).
    held_up: AtomicUsize,
    max: usize,
    abandoned: Abandoned<D>,
}

/// A pass held up past its stall, counted in [`Waiters`] until dropped.
pub struct HeldUp<O, D> {
    waiters: Arc<Waiters<O, D>>,
}

impl<O, D> Drop for HeldUp<O, D> {
    fn drop(&mut self) {
        self.waiters.held_up.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<O, D> std::fmt::Debug for Waiters<O, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiters")
            .field("len", &self.len())
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

struct Queue<O, D> {
    next_id: u64,
    slots: VecDeque<Arc<Slot<O, D>>>,
}

struct Slot<O, D> {
    id: u64,
    offer: O,
    notify: Notify,
    /// A turn was given and not yet taken.
    turn: AtomicBool,
    /// A pass is under way whose outcome may concern the waiters behind (it could pass over a
    /// task that is theirs): if the waiter leaves now, its turn moves on.
    owes_turn: AtomicBool,
    state: Mutex<State<D>>,
}

enum State<D> {
    Open,
    OwnPass,
    Recruited,
    Delivered(D),
    Gone,
}

/// The queue is full (`--fetch-max-waiters`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full(pub usize);

/// What a waiting place was woken for.
#[derive(Debug)]
pub enum Woken<D> {
    /// Its turn: run a pass (the place is now on its own pass until [`Place::pass_on`],
    /// [`Place::found_nothing`] or leaving).
    Turn,
    /// Another waiter's pass served it.
    Delivered(D),
}

impl<O, D> Waiters<O, D> {
    /// An empty queue holding at most `max` waiters; `abandoned` receives deliveries whose
    /// waiter left before taking them.
    pub fn new(max: usize, abandoned: Abandoned<D>) -> Self {
        Waiters {
            queue: Mutex::new(Queue {
                next_id: 0,
                slots: VecDeque::new(),
            }),
            generation: AtomicU64::new(0),
            empty_at: AtomicU64::new(u64::MAX),
            held_up: AtomicUsize::new(0),
            max,
            abandoned,
        }
    }

    /// The wake-up count, read before a pass so a wake-up during the pass is not missed.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Records that a pass that began at generation `seen` found nothing ready for anyone.
    pub fn note_empty(&self, seen: u64) {
        self.empty_at.store(seen, Ordering::SeqCst);
    }

    /// True when a pass that began at generation `seen` (read by the caller first) or earlier
    /// found nothing ready for anyone and nothing woke the queue since: a new waiting fetch can
    /// join without a pass of its own (what it would find is what the next wake-up finds).
    pub fn known_empty(&self, seen: u64) -> bool {
        let empty = self.empty_at.load(Ordering::SeqCst);
        empty != u64::MAX && empty == seen
    }

    /// Waiting fetches now.
    pub fn len(&self) -> usize {
        self.queue.lock().map(|q| q.slots.len()).unwrap_or(0)
    }

    /// True when nobody waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Something may have become ready: the longest waiter takes a turn. While a pass is held
    /// up past its stall, a waiter recruited into a pass is passed over (it would keep the turn
    /// until that pass lets it go, which a pass waiting on a claim may not do for a while)
    /// unless every waiter is; otherwise it keeps the turn and takes it when the pass ends.
    pub fn wake(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        let held_up = self.held_up.load(Ordering::SeqCst) > 0;
        if let Ok(queue) = self.queue.lock() {
            let free = held_up
                .then(|| {
                    queue.slots.iter().find(|slot| {
                        slot.state
                            .lock()
                            .is_ok_and(|state| !matches!(*state, State::Recruited))
                    })
                })
                .flatten();
            if let Some(slot) = free.or(queue.slots.front()) {
                give_turn(slot);
            }
        }
    }

    /// Counts a pass held up past its stall until the guard is dropped.
    pub fn held_up(self: &Arc<Self>) -> HeldUp<O, D> {
        self.held_up.fetch_add(1, Ordering::SeqCst);
        HeldUp {
            waiters: Arc::clone(self),
        }
    }

    /// Joins the back of the queue with what a pass needs to serve this waiter. `seen` is
    /// [`Waiters::generation`] from before the pass that found nothing: if a wake-up came since,
    /// the new waiter takes a turn at once.
    pub fn join(self: &Arc<Self>, seen: u64, offer: O) -> Result<Place<O, D>, Full> {
        let slot = {
            let mut queue = self.queue.lock().map_err(|_| Full(self.max))?;
            if queue.slots.len() >= self.max {
                return Err(Full(self.max));
            }
            queue.next_id += 1;
            let slot = Arc::new(Slot {
                id: queue.next_id,
                offer,
                notify: Notify::new(),
                turn: AtomicBool::new(false),
                owes_turn: AtomicBool::new(false),
                state: Mutex::new(State::Open),
            });
            queue.slots.push_back(Arc::clone(&slot));
            slot
        };
        if self.generation() != seen {
            give_turn(&slot);
        }
        Ok(Place {
            waiters: Arc::clone(self),
            slot,
            left: false,
        })
    }

    /// Recruits open waiters into a pass, longest waiter first, up to `max` of them: each one
    /// that joined before `before` (a place id; `u64::MAX` for all), except `except`, until
    /// `wanted` accepts one. Returns everyone recruited (the accepted one last, if any); each
    /// stays recruited until it is served or dropped.
    pub fn recruit(
        self: &Arc<Self>,
        before: u64,
        except: Option<u64>,
        max: usize,
        mut wanted: impl FnMut(&O) -> bool,
    ) -> (Vec<Recruit<O, D>>, bool) {
        let mut recruited = Vec::new();
        let Ok(queue) = self.queue.lock() else {
            return (recruited, false);
        };
        for slot in queue.slots.iter() {
            if recruited.len() >= max || slot.id >= before {
                break;
            }
            if Some(slot.id) == except {
                continue;
            }
            let Ok(mut state) = slot.state.lock() else {
                continue;
            };
            if !matches!(*state, State::Open) {
                continue;
            }
            *state = State::Recruited;
            drop(state);
            let accepted = wanted(&slot.offer);
            recruited.push(Recruit {
                slot: Arc::clone(slot),
                served: false,
            });
            if accepted {
                return (recruited, true);
            }
        }
        (recruited, false)
    }

    /// Gives a turn to the waiter right behind `id` (or the front one if `id` has left).
    fn pass_after(&self, id: u64) {
        if let Ok(queue) = self.queue.lock() {
            let next = match queue.slots.iter().position(|s| s.id == id) {
                Some(i) => queue.slots.get(i + 1),
                None => queue.slots.front(),
            };
            if let Some(next) = next {
                give_turn(next);
            }
        }
    }
}

fn give_turn<O, D>(slot: &Slot<O, D>) {
    slot.turn.store(true, Ordering::SeqCst);
    slot.notify.notify_one();
}

/// A waiter taken into another's pass. Dropping it unserved lets the waiter go back to waiting
/// (and take a turn that came meanwhile).
pub struct Recruit<O, D> {
    slot: Arc<Slot<O, D>>,
    served: bool,
}

impl<O, D> Recruit<O, D> {
    /// The place's id: its position in the queue (lower waited longer).
    pub fn id(&self) -> u64 {
        self.slot.id
    }

    /// What the pass needs to serve this waiter.
    pub fn offer(&self) -> &O {
        &self.slot.offer
    }

    /// Delivers to the waiter; `Err` gives the delivery back when the waiter has left (the
    /// caller must then undo what it holds).
    pub fn deliver(mut self, delivery: D) -> Result<(), D> {
        self.served = true;
        let Ok(mut state) = self.slot.state.lock() else {
            return Err(delivery);
        };
        if !matches!(*state, State::Recruited) {
            return Err(delivery);
        }
        *state = State::Delivered(delivery);
        drop(state);
        self.slot.notify.notify_one();
        Ok(())
    }
}

impl<O, D> Drop for Recruit<O, D> {
    fn drop(&mut self) {
        if self.served {
            return;
        }
        if let Ok(mut state) = self.slot.state.lock() {
            if matches!(*state, State::Recruited) {
                *state = State::Open;
            }
        }
        self.slot.notify.notify_one();
    }
}

/// A waiting fetch's place in the queue; leaving the queue is dropping it.
pub struct Place<O, D> {
    waiters: Arc<Waiters<O, D>>,
    slot: Arc<Slot<O, D>>,
    left: bool,
}

impl<O, D> std::fmt::Debug for Place<O, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Place").field("id", &self.slot.id).finish()
    }
}

impl<O, D> Place<O, D> {
    /// The place's id: its position in the queue (lower waited longer).
    pub fn id(&self) -> u64 {
        self.slot.id
    }

    /// Waits for a turn or a delivery. A turn puts the place on its own pass: nobody can
    /// recruit it until it settles the pass.
    pub async fn woken(&mut self) -> Woken<D> {
        loop {
            if let Ok(mut state) = self.slot.state.lock() {
                if matches!(*state, State::Delivered(_)) {
                    if let State::Delivered(d) = std::mem::replace(&mut *state, State::Gone) {
                        drop(state);
                        self.leave_queue();
                        return Woken::Delivered(d);
                    }
                }
                if matches!(*state, State::Open) && self.slot.turn.swap(false, Ordering::SeqCst) {
                    *state = State::OwnPass;
                    self.slot.owes_turn.store(true, Ordering::SeqCst);
                    return Woken::Turn;
                }
            }
            self.slot.notify.notified().await;
        }
    }

    /// The place's own pass found nothing for anyone: nobody behind needs the turn.
    pub fn found_nothing(&self) {
        self.slot.owes_turn.store(false, Ordering::SeqCst);
        self.reopen();
    }

    /// Gives up a turn because a pass is already running (it may serve this place): the place
    /// goes back to waiting. The caller sees to it that a turn comes once that pass ends.
    pub fn defer(&self) {
        self.found_nothing();
    }

    /// Hands a turn to the waiter behind this one (this one keeps its place).
    pub fn pass_on(&self) {
        self.slot.owes_turn.store(false, Ordering::SeqCst);
        self.reopen();
        self.waiters.pass_after(self.slot.id);
    }

    /// Leaves the queue after a pass that got a task, handing the turn to the next waiter:
    /// more may be ready.
    pub fn leave_after_grant(mut self) {
        self.slot.owes_turn.store(false, Ordering::SeqCst);
        let id = self.slot.id;
        self.waiters.pass_after(id);
        self.leave();
    }

    fn reopen(&self) {
        if let Ok(mut state) = self.slot.state.lock() {
            if matches!(*state, State::OwnPass) {
                *state = State::Open;
            }
        }
    }

    fn leave_queue(&self) {
        if let Ok(mut queue) = self.waiters.queue.lock() {
            queue.slots.retain(|s| s.id != self.slot.id);
        }
    }

    /// Leaves the queue: a delivery that arrived and was not taken goes to the `abandoned`
    /// hook, and a turn given and never taken moves on, as does one whose pass was not settled
    /// (the caller went away mid-pass), so a wake-up is never lost.
    fn leave(&mut self) {
        if self.left {
            return;
        }
        self.left = true;
        let untaken = self.slot.state.lock().ok().and_then(|mut state| {
            match std::mem::replace(&mut *state, State::Gone) {
                State::Delivered(d) => Some(d),
                _ => None,
            }
        });
        self.leave_queue();
        if let Some(d) = untaken {
            (self.waiters.abandoned)(d);
        }
        if self.slot.turn.load(Ordering::SeqCst) || self.slot.owes_turn.load(Ordering::SeqCst) {
            let front = self
                .waiters
                .queue
                .lock()
                .ok()
                .and_then(|q| q.slots.front().cloned());
            if let Some(front) = front {
                give_turn(&front);
            }
        }
    }
}

impl<O, D> Drop for Place<O, D> {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    type Q = Waiters<&'static str, u32>;

    fn queue(max: usize) -> Arc<Q> {
        Arc::new(Waiters::new(max, Box::new(|_| {})))
    }

    /// The queue and the deliveries its `abandoned` hook received.
    fn queue_keeping_abandoned() -> (Arc<Q>, Arc<Mutex<Vec<u32>>>) {
        let abandoned = Arc::new(Mutex::new(Vec::new()));
        let into = Arc::clone(&abandoned);
        let q = Waiters::new(
            10,
            Box::new(move |d| into.lock().unwrap().push(d)) as Abandoned<u32>,
        );
        (Arc::new(q), abandoned)
    }

    async fn woken(place: &mut Place<&'static str, u32>) -> Option<Woken<u32>> {
        tokio::time::timeout(Duration::from_millis(20), place.woken())
            .await
            .ok()
    }

    async fn has_turn(place: &mut Place<&'static str, u32>) -> bool {
        matches!(woken(place).await, Some(Woken::Turn))
    }

    #[tokio::test]
    async fn a_wake_up_gives_one_turn_to_the_longest_waiter() {
        let w = queue(10);
        let mut a = w.join(w.generation(), "a").unwrap();
        let mut b = w.join(w.generation(), "b").unwrap();
        assert!(!has_turn(&mut a).await && !has_turn(&mut b).await);
        w.wake();
        assert!(has_turn(&mut a).await);
        assert!(!has_turn(&mut b).await, "only the longest waiter looks");
        a.found_nothing();
        assert!(!has_turn(&mut a).await, "one turn per wake-up");
    }

    #[tokio::test]
    async fn a_grant_hands_the_turn_on_and_passing_over_does_too() {
        let w = queue(10);
        let mut a = w.join(w.generation(), "a").unwrap();
        let mut b = w.join(w.generation(), "b").unwrap();
        let mut c = w.join(w.generation(), "c").unwrap();
        w.wake();
        assert!(has_turn(&mut a).await);
        a.leave_after_grant();
        assert!(has_turn(&mut b).await);
        b.pass_on();
        assert!(has_turn(&mut c).await);
        assert_eq!(w.len(), 2);
    }

    #[tokio::test]
    async fn a_turn_left_untaken_moves_to_the_next_waiter() {
        let w = queue(10);
        let a = w.join(w.generation(), "a").unwrap();
        let mut b = w.join(w.generation(), "b").unwrap();
        w.wake();
        drop(a); // went away (deadline, disconnect) before taking its turn
        assert!(has_turn(&mut b).await);
    }

    #[tokio::test]
    async fn joining_after_an_unseen_wake_up_takes_a_turn_at_once() {
        let w = queue(10);
        let seen = w.generation();
        w.wake(); // during the joining fetch's pass
        let mut a = w.join(seen, "a").unwrap();
        assert!(has_turn(&mut a).await);
    }

    #[test]
    fn known_empty_holds_until_the_next_wake_up() {
        let w = queue(10);
        assert!(!w.known_empty(w.generation()), "unknown at first");
        w.note_empty(w.generation());
        assert!(w.known_empty(w.generation()));
        w.wake();
        assert!(!w.known_empty(w.generation()), "something may be ready now");
        let seen = w.generation();
        w.wake(); // during the pass
        w.note_empty(seen);
        assert!(
            !w.known_empty(w.generation()),
            "a pass that began before a wake-up proves nothing after it"
        );
    }

    #[tokio::test]
    async fn leaving_mid_pass_hands_the_turn_on() {
        let w = queue(10);
        let mut a = w.join(w.generation(), "a").unwrap();
        let mut b = w.join(w.generation(), "b").unwrap();
        w.wake();
        assert!(has_turn(&mut a).await);
        drop(a); // the caller went away before its pass was settled
        assert!(has_turn(&mut b).await);
        b.found_nothing();
        let mut c = w.join(w.generation(), "c").unwrap();
        drop(b);
        assert!(
            !has_turn(&mut c).await,
            "a settled empty pass owes nobody a turn"
        );
    }

    #[test]
    fn the_queue_has_a_limit() {
        let w = queue(1);
        let _a = w.join(0, "a").unwrap();
        assert_eq!(w.join(0, "b").unwrap_err(), Full(1));
    }

    #[tokio::test]
    async fn recruits_come_longest_waiter_first_and_skip_waiters_on_their_own_pass() {
        let w = queue(10);
        let mut a = w.join(w.generation(), "a").unwrap();
        let _b = w.join(w.generation(), "b").unwrap();
        let _c = w.join(w.generation(), "c").unwrap();
        let _d = w.join(w.generation(), "d").unwrap();
        w.wake();
        assert!(has_turn(&mut a).await); // a is on its own pass now
        let (taken, found) = w.recruit(u64::MAX, None, 10, |o| *o == "c");
        assert!(found);
        let offers: Vec<_> = taken.iter().map(|r| *r.offer()).collect();
        assert_eq!(offers, ["b", "c"], "in queue order, up to the accepted one");
        let (more, found) = w.recruit(u64::MAX, None, 10, |_| false);
        assert!(!found);
        assert_eq!(
            more.iter().map(|r| *r.offer()).collect::<Vec<_>>(),
            ["d"],
            "recruited waiters are not recruited twice"
        );
        let (none, _) = w.recruit(a.id(), None, 10, |_| true);
        assert!(none.is_empty(), "nobody joined before a");
    }

    #[tokio::test]
    async fn recruitment_respects_its_bounds() {
        let w = queue(10);
        let a = w.join(w.generation(), "a").unwrap();
        let b = w.join(w.generation(), "b").unwrap();
        let _c = w.join(w.generation(), "c").unwrap();
        let (taken, _) = w.recruit(u64::MAX, Some(a.id()), 1, |_| false);
        assert_eq!(taken.len(), 1);
        assert_eq!(*taken[0].offer(), "b", "except skips a; max stops at one");
        let (before_b, _) = w.recruit(b.id(), Some(a.id()), 10, |_| true);
        assert!(before_b.is_empty(), "only waiters that joined before b");
    }

    #[tokio::test]
    async fn a_delivery_wakes_its_waiter_who_leaves_the_queue() {
        let w = queue(10);
        let mut a = w.join(w.generation(), "a").unwrap();
        let (mut taken, _) = w.recruit(u64::MAX, None, 1, |_| true);
        assert!(woken(&mut a).await.is_none(), "recruited: nothing yet");
        taken.pop().unwrap().deliver(7).unwrap();
        assert!(matches!(woken(&mut a).await, Some(Woken::Delivered(7))));
        assert_eq!(w.len(), 0);
    }

    #[tokio::test]
    async fn a_turn_that_comes_while_recruited_is_taken_once_let_go() {
        let w = queue(10);
        let mut a = w.join(w.generation(), "a").unwrap();
        let (taken, _) = w.recruit(u64::MAX, None, 1, |_| true);
        w.wake();
        assert!(woken(&mut a).await.is_none(), "no turn while recruited");
        drop(taken); // the pass could not serve it
        assert!(has_turn(&mut a).await, "the turn was kept");
    }

    #[tokio::test]
    async fn a_delivery_to_a_waiter_that_left_comes_back() {
        let w = queue(10);
        let a = w.join(w.generation(), "a").unwrap();
        let (mut taken, _) = w.recruit(u64::MAX, None, 1, |_| true);
        drop(a);
        assert_eq!(taken.pop().unwrap().deliver(7), Err(7));
    }

    #[tokio::test]
    async fn a_delivery_never_taken_goes_to_the_abandoned_hook() {
        let (w, abandoned) = queue_keeping_abandoned();
        let a = w.join(w.generation(), "a").unwrap();
        let (mut taken, _) = w.recruit(u64::MAX, None, 1, |_| true);
        taken.pop().unwrap().deliver(7).unwrap();
        drop(a); // the caller went away before it looked
        assert_eq!(*abandoned.lock().unwrap(), [7]);
    }

    #[tokio::test]
    async fn a_recruit_that_leaves_passes_its_untaken_turn_on() {
        let w = queue(10);
        let mut a = w.join(w.generation(), "a").unwrap();
        let b = w.join(w.generation(), "b").unwrap();
        w.wake();
        assert!(has_turn(&mut a).await);
        let (taken, _) = w.recruit(u64::MAX, Some(a.id()), 1, |_| true);
        assert_eq!(*taken[0].offer(), "b");
        a.pass_on(); // b's turn, while b is recruited: kept for later
        assert!(!has_turn(&mut a).await);
        drop(b); // b goes away (deadline) before the pass let it go
        drop(taken);
        assert!(has_turn(&mut a).await, "b's untaken turn moved on");
    }
}
