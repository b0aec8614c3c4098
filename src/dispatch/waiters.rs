//! Long-poll without a herd: waiting fetches queue up in arrival order, and a wake-up (a task
//! inserted, a lock released, a task ended, the slow safety tick) gives *the longest waiter* one
//! turn: one pass over the queue. A waiter whose pass got a task leaves and hands the turn to the
//! next, so a burst of ready tasks is handed out oldest task to longest waiter, one pass each; a
//! pass that finds nothing ends the chain, so an idle fleet costs one pass per wake-up, not one
//! per worker. A waiter that passed over a ready task it could not take (incompatible versions,
//! `skip_task_ids`) hands the turn on as well, since the task may be the next waiter's.
//!
//! A turn given to a waiter that leaves before taking it (deadline, disconnect) moves on to the
//! new longest waiter, so no wake-up is lost.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// The queue of waiting fetches of one replica.
#[derive(Debug)]
pub struct Waiters {
    queue: Mutex<Queue>,
    /// Bumped by every wake-up: a fetch that joins after a wake-up it did not see takes a turn
    /// at once.
    generation: AtomicU64,
    /// The generation at which a pass last found nothing ready for anyone (no task it could
    /// take, none it passed over for its own reasons); `u64::MAX` when unknown.
    empty_at: AtomicU64,
    max: usize,
}

#[derive(Debug, Default)]
struct Queue {
    next_id: u64,
    slots: VecDeque<Arc<Slot>>,
}

#[derive(Debug)]
struct Slot {
    id: u64,
    notify: Notify,
    /// A turn was given and not yet taken.
    turn: AtomicBool,
    /// A pass is under way whose outcome may concern the waiters behind (it could pass over a
    /// task that is theirs): if the waiter leaves now, its turn moves on.
    owes_turn: AtomicBool,
}

/// The queue is full (`--fetch-max-waiters`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full(pub usize);

impl Waiters {
    /// An empty queue holding at most `max` waiters.
    pub fn new(max: usize) -> Self {
        Waiters {
            queue: Mutex::new(Queue::default()),
            generation: AtomicU64::new(0),
            empty_at: AtomicU64::new(u64::MAX),
            max,
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

    /// Something may have become ready: the longest waiter takes a turn.
    pub fn wake(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        if let Ok(queue) = self.queue.lock() {
            if let Some(front) = queue.slots.front() {
                give_turn(front);
            }
        }
    }

    /// Joins the back of the queue. `seen` is [`Waiters::generation`] from before the pass
    /// that found nothing: if a wake-up came since, the new waiter takes a turn at once.
    pub fn join(self: &Arc<Self>, seen: u64) -> Result<Place, Full> {
        let slot = {
            let mut queue = self.queue.lock().map_err(|_| Full(self.max))?;
            if queue.slots.len() >= self.max {
                return Err(Full(self.max));
            }
            queue.next_id += 1;
            let slot = Arc::new(Slot {
                id: queue.next_id,
                notify: Notify::new(),
                turn: AtomicBool::new(false),
                owes_turn: AtomicBool::new(false),
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
        })
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

fn give_turn(slot: &Slot) {
    slot.turn.store(true, Ordering::SeqCst);
    slot.notify.notify_one();
}

/// A waiting fetch's place in the queue; leaving the queue is dropping it.
#[derive(Debug)]
pub struct Place {
    waiters: Arc<Waiters>,
    slot: Arc<Slot>,
}

impl Place {
    /// Waits for a turn.
    pub async fn turn(&self) {
        loop {
            if self.slot.turn.swap(false, Ordering::SeqCst) {
                return;
            }
            self.slot.notify.notified().await;
        }
    }

    /// A pass begins: until it is settled, leaving hands the turn on.
    pub fn begin_pass(&self) {
        self.slot.owes_turn.store(true, Ordering::SeqCst);
    }

    /// The pass found nothing for anyone: nobody behind needs the turn.
    pub fn found_nothing(&self) {
        self.slot.owes_turn.store(false, Ordering::SeqCst);
    }

    /// Hands a turn to the waiter behind this one (this one keeps its place).
    pub fn pass_on(&self) {
        self.slot.owes_turn.store(false, Ordering::SeqCst);
        self.waiters.pass_after(self.slot.id);
    }

    /// Leaves the queue after a pass that got a task, handing the turn to the next waiter:
    /// more may be ready.
    pub fn leave_after_grant(self) {
        self.slot.owes_turn.store(false, Ordering::SeqCst);
        let id = self.slot.id;
        self.waiters.pass_after(id);
        // Drop removes the slot; its own turn is not pending.
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let front_now = {
            let Ok(mut queue) = self.waiters.queue.lock() else {
                return;
            };
            queue.slots.retain(|s| s.id != self.slot.id);
            queue.slots.front().cloned()
        };
        // A turn given and never taken moves on, and so does one whose pass was not settled
        // (the caller went away mid-pass, or its deadline came after passing over a task), so
        // a wake-up is never lost.
        if self.slot.turn.load(Ordering::SeqCst) || self.slot.owes_turn.load(Ordering::SeqCst) {
            if let Some(front) = front_now {
                give_turn(&front);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn has_turn(place: &Place) -> bool {
        tokio::time::timeout(Duration::from_millis(20), place.turn())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_wake_up_gives_one_turn_to_the_longest_waiter() {
        let w = Arc::new(Waiters::new(10));
        let a = w.join(w.generation()).unwrap();
        let b = w.join(w.generation()).unwrap();
        assert!(!has_turn(&a).await && !has_turn(&b).await);
        w.wake();
        assert!(has_turn(&a).await);
        assert!(!has_turn(&b).await, "only the longest waiter looks");
        assert!(!has_turn(&a).await, "one turn per wake-up");
    }

    #[tokio::test]
    async fn a_grant_hands_the_turn_on_and_passing_over_does_too() {
        let w = Arc::new(Waiters::new(10));
        let a = w.join(w.generation()).unwrap();
        let b = w.join(w.generation()).unwrap();
        let c = w.join(w.generation()).unwrap();
        w.wake();
        assert!(has_turn(&a).await);
        a.leave_after_grant();
        assert!(has_turn(&b).await);
        b.pass_on();
        assert!(has_turn(&c).await);
        assert_eq!(w.len(), 2);
    }

    #[tokio::test]
    async fn a_turn_left_untaken_moves_to_the_next_waiter() {
        let w = Arc::new(Waiters::new(10));
        let a = w.join(w.generation()).unwrap();
        let b = w.join(w.generation()).unwrap();
        w.wake();
        drop(a); // went away (deadline, disconnect) before taking its turn
        assert!(has_turn(&b).await);
    }

    #[tokio::test]
    async fn joining_after_an_unseen_wake_up_takes_a_turn_at_once() {
        let w = Arc::new(Waiters::new(10));
        let seen = w.generation();
        w.wake(); // during the joining fetch's pass
        let a = w.join(seen).unwrap();
        assert!(has_turn(&a).await);
    }

    #[test]
    fn known_empty_holds_until_the_next_wake_up() {
        let w = Waiters::new(10);
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
        let w = Arc::new(Waiters::new(10));
        let a = w.join(w.generation()).unwrap();
        let b = w.join(w.generation()).unwrap();
        w.wake();
        assert!(has_turn(&a).await);
        a.begin_pass();
        drop(a); // the caller went away before its pass was settled
        assert!(has_turn(&b).await);
        b.begin_pass();
        b.found_nothing();
        let c = w.join(w.generation()).unwrap();
        drop(b);
        assert!(
            !has_turn(&c).await,
            "a settled empty pass owes nobody a turn"
        );
    }

    #[test]
    fn the_queue_has_a_limit() {
        let w = Arc::new(Waiters::new(1));
        let _a = w.join(0).unwrap();
        assert_eq!(w.join(0).unwrap_err(), Full(1));
    }
}
