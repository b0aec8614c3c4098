use super::*;
use proptest::prelude::*;
use uuid::Uuid;

fn key(n: u8) -> Key {
    (i64::from(n), TaskId(Uuid::from_u128(u128::from(n) + 1)))
}

fn record(entries: &[&str]) -> Vec<String> {
    entries.iter().map(|e| (*e).to_owned()).collect()
}

/// The rule, pairwise, over the tasks present: no older task conflicts.
fn reference_lanes(present: &BTreeMap<Key, Vec<String>>) -> Vec<Key> {
    let all: Vec<(Key, Resources)> = present
        .iter()
        .map(|(k, r)| (*k, Resources::from_record(r)))
        .collect();
    (0..all.len())
        .filter(|&i| {
            !all[..i]
                .iter()
                .any(|(_, older)| older.conflicts_with(&all[i].1))
        })
        .map(|i| all[i].0)
        .collect()
}

/// R0's head (task 1) and 48 tasks behind it, then a task on O1; all share D.
fn blocked_r0() -> ResourceQueues {
    let mut q = ResourceQueues::default();
    for n in 1..50 {
        q.insert(key(n), &record(&["R0", "shared:D"]));
    }
    q.insert(key(60), &record(&["O1", "shared:D"]));
    q
}

#[test]
fn a_blocked_queue_has_one_lane_at_its_head_and_the_next_resource_after_it() {
    let mut q = blocked_r0();
    assert_eq!(q.lanes().collect::<Vec<_>>(), vec![key(1), key(60)]);
    // The head finishes: the next R0 task takes its place.
    q.remove(&key(1).1);
    assert_eq!(q.lanes().collect::<Vec<_>>(), vec![key(2), key(60)]);
    assert_eq!(q.holders().collect::<Vec<_>>(), vec![key(2), key(60)]);
}

#[test]
fn a_position_before_many_blocked_tasks_is_worth_a_start() {
    let mut q = ResourceQueues::default();
    for n in 1..50 {
        q.insert(key(n), &record(&["R0"]));
    }
    q.insert(key(60), &record(&["O1"]));
    q.know_up_to(key(70));
    assert!(q.blocked_after(key(1), 40));
    // Fewer tasks than asked: reading them costs no more than a start.
    assert!(!q.blocked_after(key(1), 60));
    // Past the blocked tasks: nothing to skip.
    assert!(!q.blocked_after(key(49), 1));
    // Just before a lane (the head): a scan reads it first, a start would not move.
    assert!(!q.blocked_after(before(key(1)), 40));
    assert!(!ResourceQueues::default().blocked_after(key(1), 1));
}

#[test]
fn a_late_task_takes_the_places_of_newer_ones() {
    let mut q = ResourceQueues::default();
    q.insert(key(5), &record(&["A"]));
    q.insert(key(6), &record(&["shared:B"]));
    q.insert(key(7), &record(&["shared:B"]));
    assert_eq!(q.lanes().count(), 3);
    // Committed late, older than all: B exclusively.
    q.insert(key(1), &record(&["B", "A"]));
    assert_eq!(q.lanes().collect::<Vec<_>>(), vec![key(1)]);
    q.remove(&key(1).1);
    assert_eq!(q.lanes().count(), 3);
}

#[test]
fn the_start_is_just_before_the_first_waiting_lane_once_the_holders_are_checked() {
    let mut q = blocked_r0();
    q.know_up_to(key(70));
    let mut seen: HashMap<TaskId, Seen> = HashMap::new();
    // Nothing checked: the first holder (the running head) stops the start.
    let start = q.start(&seen, None).unwrap();
    assert_eq!((start.after, start.unchecked), (before(key(1)), true));
    assert_eq!(q.to_check(&seen, 8, None), vec![key(1).1, key(60).1]);
    for id in q.to_check(&seen, 8, None) {
        seen.insert(id, Seen::Waiting);
    }
    seen.insert(key(1).1, Seen::Held);
    let start = q.start(&seen, None).unwrap();
    assert_eq!((start.after, start.unchecked), (before(key(60)), false));
    assert!(start.waiting.is_empty());
    // The running head's locks make the tasks up to the start wait: its record comes back.
    assert_eq!(start.held, vec![record(&["R0", "shared:D"])]);
    // The first lane is claimed too: the start is where the queues end.
    seen.insert(key(60).1, Seen::Held);
    assert_eq!(q.start(&seen, None).unwrap().after, key(70));
    // Nothing known: no start.
    assert_eq!(ResourceQueues::default().start(&HashMap::new(), None), None);
}

#[test]
fn a_held_entry_hides_older_users_in_a_conflicting_mode() {
    let mut q = ResourceQueues::default();
    q.insert(key(1), &record(&["R0", "shared:D"]));
    q.insert(key(2), &record(&["R0", "shared:D"]));
    let since = Some(q.removals());
    assert_eq!(q.hides("R0", key(3), since), Some(true));
    assert_eq!(q.hides("R0", key(1), since), Some(false));
    // One user before: the lock's holder (the first user of the name), hiding no one.
    assert_eq!(q.hides("R0", key(2), since), Some(false));
    // D is only shared: a shared lock on it hides no one; an exclusive one would.
    assert_eq!(q.hides("shared:D", key(3), since), Some(false));
    assert_eq!(q.hides("D", key(3), since), Some(true));
    assert_eq!(q.hides("X", key(3), since), Some(false));
    // The holder ended and left the queues after the locks were read: the one user left may be a
    // task it hid, which the queues cannot tell.
    assert!(q.remove(&key(1).1));
    assert_eq!(q.hides("R0", key(3), since), None);
    assert_eq!(q.hides("R0", key(3), Some(q.removals())), Some(false));
    // Queues loaded after the locks were read cannot tell either.
    assert_eq!(q.hides("R0", key(3), None), None);
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u8, Vec<(u8, bool)>),
    Remove(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..40, proptest::collection::vec((0u8..5, any::<bool>()), 0..3))
            .prop_map(|(n, uses)| Op::Insert(n, uses)),
        1 => (0u8..40).prop_map(Op::Remove),
    ]
}

fn entries(uses: &[(u8, bool)]) -> Vec<String> {
    uses.iter()
        .map(|(r, exclusive)| {
            if *exclusive {
                format!("r{r}")
            } else {
                format!("shared:r{r}")
            }
        })
        .collect()
}

/// Applies `op` to the queues and to `present`, the tasks a reference keeps; returns what the
/// queues and the reference each said the op did (inserted, or removed).
fn apply(q: &mut ResourceQueues, present: &mut BTreeMap<Key, Vec<String>>, op: Op) -> (bool, bool) {
    match op {
        Op::Insert(n, uses) => {
            let record = entries(&uses);
            let inserted = q.insert(key(n), &record);
            let new = !present.contains_key(&key(n));
            present.entry(key(n)).or_insert(record);
            (inserted, new)
        }
        Op::Remove(n) => (q.remove(&key(n).1), present.remove(&key(n)).is_some()),
    }
}

proptest! {
    /// In any order of arrivals (late ones included) and removals, the lanes are those of the
    /// rule over the tasks present, and the holders are the first and first exclusive users.
    #[test]
    fn lanes_and_holders_follow_the_rule(ops in proptest::collection::vec(op(), 1..80)) {
        let mut q = ResourceQueues::default();
        let mut present: BTreeMap<Key, Vec<String>> = BTreeMap::new();
        for op in ops {
            let (queues, reference) = apply(&mut q, &mut present, op);
            prop_assert_eq!(queues, reference);
            prop_assert_eq!(q.lanes().collect::<Vec<_>>(), reference_lanes(&present));
            let mut holders: BTreeSet<Key> = BTreeSet::new();
            let mut firsts: BTreeMap<String, (Option<Key>, Option<Key>)> = BTreeMap::new();
            for (k, record) in &present {
                let r = Resources::from_record(record);
                for name in r.exclusive.iter() {
                    let f = firsts.entry(name.clone()).or_default();
                    f.0.get_or_insert(*k);
                    f.1.get_or_insert(*k);
                }
                for name in r.shared.iter() {
                    firsts.entry(name.clone()).or_default().0.get_or_insert(*k);
                }
            }
            for (first, first_exclusive) in firsts.values() {
                holders.extend(first.iter().chain(first_exclusive.iter()));
            }
            prop_assert_eq!(q.holders().collect::<BTreeSet<_>>(), holders);
            prop_assert_eq!(q.len(), present.len());
        }
    }

    /// In any order of arrivals and removals, the blocked resources are those the lane
    /// counter's survey finds over the tasks present, with the same heads and counts.
    #[test]
    fn the_most_blocked_resources_are_the_lane_counters_over_the_tasks_present(
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let mut q = ResourceQueues::default();
        let mut present: BTreeMap<Key, Vec<String>> = BTreeMap::new();
        for op in ops {
            apply(&mut q, &mut present, op);
            let mut counter = crate::ready::LaneCounter::default();
            for (k, record) in &present {
                counter.push_task(*k, record);
            }
            prop_assert_eq!(q.most_blocked(usize::MAX), counter.most_blocked(usize::MAX));
            prop_assert_eq!(q.most_blocked(2), counter.most_blocked(2));
        }
    }

    /// Whatever was checked, no waiting task at or before the start (and after `from`, for a
    /// start after a position) is ready by the rule.
    #[test]
    fn no_ready_task_lies_before_the_start(
        ops in proptest::collection::vec(op(), 1..60),
        held in proptest::collection::vec(any::<bool>(), 40),
        holders in 0usize..8,
        lanes in 0usize..8,
        known in 0u8..45,
        from in proptest::option::of(0u8..45),
    ) {
        let from = from.map(key);
        let mut q = ResourceQueues::default();
        let mut present: BTreeMap<Key, Vec<String>> = BTreeMap::new();
        for op in ops {
            apply(&mut q, &mut present, op);
        }
        q.know_up_to(key(known));
        let state = |k: &Key| if held[k.0 as usize] { Seen::Held } else { Seen::Waiting };
        let mut seen: HashMap<TaskId, Seen> = HashMap::new();
        for limit in [holders, lanes] {
            for id in q.to_check(&seen, limit, from) {
                let k = present.keys().find(|k| k.1 == id).copied().unwrap();
                seen.insert(id, state(&k));
            }
        }
        let start = q.start(&seen, from).unwrap();
        prop_assert!(start.after <= key(known));
        // The waiting holders it reserves are those up to it.
        let waiting = present
            .keys()
            .filter(|k| **k <= start.after && seen.get(&k.1) == Some(&Seen::Waiting))
            .filter(|k| q.holders().any(|h| h == **k))
            .count();
        prop_assert_eq!(start.waiting.len(), waiting);
        let start = start.after;
        let ready = reference_lanes(&present);
        for k in ready {
            if state(&k) == Seen::Waiting && from.is_none_or(|f| k > f) {
                prop_assert!(k > start, "ready task {:?} lies before the start {:?}", k, start);
            }
        }
    }
}

#[test]
fn a_resource_with_a_busy_queue_is_named_by_mode_with_its_users_until_it_is_not_busy_again() {
    let mut q = ResourceQueues::default();
    let wide = |n: usize| (n as i64, TaskId(Uuid::from_u128(n as u128 + 1)));
    for n in 0..BUSY_QUEUE - 1 {
        q.insert(wide(n), &record(&["R0", "shared:D"]));
    }
    assert!(q.busy_queues().is_empty());
    q.insert(wide(BUSY_QUEUE), &record(&["R0", "shared:D"]));
    let mut busy = q.busy_queues();
    busy.sort();
    // R0 by its exclusive users, D by its shared ones: the entries the tasks carry.
    assert_eq!(
        busy,
        vec![
            ("R0".to_owned(), BUSY_QUEUE),
            ("shared:D".to_owned(), BUSY_QUEUE)
        ]
    );
    // One exclusive user of D is not a busy queue of D's exclusive users.
    q.insert(wide(BUSY_QUEUE + 1), &record(&["D"]));
    assert_eq!(q.busy_queues().len(), 2);
    // A task inserted again is left as it is; one that leaves makes both queues not busy again.
    q.insert(wide(0), &record(&["R0", "shared:D"]));
    assert_eq!(q.busy_queues().len(), 2);
    q.remove(&wide(0).1);
    assert!(q.busy_queues().is_empty());
    // A long queue is a busy one, named with its users.
    for n in 0..LONG_QUEUE {
        q.insert(wide(1_000 + n), &record(&["R1"]));
    }
    assert_eq!(q.busy_queues(), vec![("R1".to_owned(), LONG_QUEUE)]);
}
