//! Whom a fetch pass serves: its own caller, and the waiting calls of this replica it recruits
//! (longest waiter first) while its sharing budget lasts.

use std::sync::Arc;

use super::{Delivery, Offer, Queue};
use crate::tasks::TaskRow;

type Recruit = super::waiters::Recruit<Offer, Delivery>;

/// One call a pass serves.
pub(super) struct Claimant {
    /// Place in the queue (lower waited longer; a call not waiting yet comes last).
    key: u64,
    pub(super) offer: Offer,
    /// `None` for the pass's own caller.
    pub(super) recruit: Option<Recruit>,
    pub(super) state: Turn,
}

/// Where a claimant is in its pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Turn {
    /// May be given a ready task.
    Free,
    /// Trying a task of this round.
    Trying,
    /// Served, or done with (lease gone, backend trouble).
    Done,
}

/// Whom a ready row goes to.
pub(super) enum Pick {
    /// The claimant at this index.
    Free(usize),
    /// Only a claimant trying another task of this round could take it.
    Busy,
    /// Nobody in the pass can take it.
    Nobody,
}

/// The calls a pass serves: its own caller first in the list, recruits appended as needed.
pub(super) struct Claimants {
    list: Vec<Claimant>,
    /// How many more waiters the pass may recruit.
    may_recruit: usize,
    /// The own caller's place among the waiters (`None`: it is not waiting).
    own_place: Option<u64>,
}

impl Claimants {
    /// A pass for its own caller's `offer`, which may recruit up to `may_recruit` waiters.
    pub(super) fn new(offer: Offer, own_place: Option<u64>, may_recruit: usize) -> Claimants {
        Claimants {
            list: vec![Claimant {
                key: own_place.unwrap_or(u64::MAX),
                offer,
                recruit: None,
                state: Turn::Free,
            }],
            may_recruit,
            own_place,
        }
    }

    /// The claimant at `who` (an index [`Claimants::pick`] gave).
    pub(super) fn get_mut(&mut self, who: usize) -> &mut Claimant {
        &mut self.list[who]
    }

    /// The offer of the claimant at `who`.
    pub(super) fn offer(&self, who: usize) -> &Offer {
        &self.list[who].offer
    }

    /// A stalled pass recruits no more, and lets go of the recruits it is not trying a task for
    /// (dropping a recruit reopens its place, with any turn it was given meanwhile).
    pub(super) fn let_go(&mut self) {
        self.may_recruit = 0;
        for claimant in &mut self.list {
            if claimant.state == Turn::Free && claimant.recruit.is_some() {
                claimant.recruit = None;
                claimant.state = Turn::Done;
            }
        }
    }

    /// True when a round can give no more rows: every claimant is trying one or done, and
    /// nobody else may be recruited.
    pub(super) fn nobody_left(&self) -> bool {
        self.may_recruit == 0 && self.list.iter().all(|c| c.state != Turn::Free)
    }

    /// Whom a ready row goes to: the longest waiter among the free claimants that can take it,
    /// recruiting open waiters of `waiters` (longest first) while the sharing budget lasts.
    pub(super) fn pick(&mut self, row: &TaskRow, waiters: &Arc<Queue>) -> Pick {
        let mut best = self
            .list
            .iter()
            .enumerate()
            .filter(|(_, c)| c.state == Turn::Free && c.offer.takes(row))
            .min_by_key(|(_, c)| c.key)
            .map(|(i, c)| (i, c.key));
        if self.may_recruit > 0 {
            let before = best.map_or(u64::MAX, |(_, key)| key);
            let (recruits, found) =
                waiters.recruit(before, self.own_place, self.may_recruit, |offer| {
                    offer.takes(row)
                });
            if recruits.is_empty() && before == u64::MAX {
                // Nobody else is waiting to be served.
                self.may_recruit = 0;
            }
            self.may_recruit = self.may_recruit.saturating_sub(recruits.len());
            for recruit in recruits {
                self.list.push(Claimant {
                    key: recruit.id(),
                    offer: recruit.offer().clone(),
                    recruit: Some(recruit),
                    state: Turn::Free,
                });
            }
            if found {
                best = Some((self.list.len() - 1, 0));
            }
        }
        match best {
            Some((who, _)) => Pick::Free(who),
            None if self
                .list
                .iter()
                .any(|c| c.state == Turn::Trying && c.offer.takes(row)) =>
            {
                Pick::Busy
            }
            None => Pick::Nobody,
        }
    }
}
