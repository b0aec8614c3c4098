use super::*;
use proptest::prelude::*;
use uuid::Uuid;

/// The rule, pairwise: a task is a lane when no older task conflicts with it.
fn reference(queue: &[(Key, Vec<String>)]) -> u64 {
    let resources: Vec<Resources> = queue
        .iter()
        .map(|(_, r)| Resources::from_record(r))
        .collect();
    (0..resources.len())
        .filter(|&i| {
            !resources[..i]
                .iter()
                .any(|older| older.conflicts_with(&resources[i]))
        })
        .count() as u64
}

/// A class that follows from the task's id (so a repair and a fresh count agree on it).
fn class_of(id: TaskId) -> Class {
    let n = id.0.as_u128();
    Class {
        domain: Uuid::from_u128(n % 3),
        immediate: n.is_multiple_of(5),
        task_group: n.is_multiple_of(7).then(|| Uuid::from_u128(n % 2)),
    }
}

fn counted(queue: &[(Key, Vec<String>)]) -> LaneCounter {
    let mut counter = LaneCounter::default();
    for (key, record) in queue {
        counter.push_classed(*key, record, class_of(key.1));
    }
    counter
}

/// The lanes by class, sorted.
fn by_class(counter: &LaneCounter) -> Vec<(Class, u64)> {
    let mut lanes: Vec<(Class, u64)> = counter.lanes_by_class().collect();
    lanes.sort_by_key(|(c, _)| (c.domain, c.immediate, c.task_group));
    lanes
}

/// Feeds `repair` the tasks after `after` up to `watermark`: all of them, or only those that
/// need one of its resources after the oldest place it repairs (as a look-up by name returns
/// them).
fn feed(
    repair: &mut Repair,
    queue: &[(Key, Vec<String>)],
    after: Option<Key>,
    watermark: Option<Key>,
    by_name: bool,
) {
    let names: Vec<String> = repair.resources().map(|(n, _)| n.to_owned()).collect();
    let entries = Repair::entries(names.iter().map(String::as_str));
    let from = repair.from();
    for (key, record) in queue {
        if watermark.is_some_and(|w| *key > w) {
            break;
        }
        if after.is_some_and(|a| *key <= a) {
            continue;
        }
        if by_name
            && (from.is_none_or(|f| *key <= f) || !record.iter().any(|e| entries.contains(e)))
        {
            continue;
        }
        repair.feed_classed(*key, record, class_of(key.1));
    }
}

/// How a test feeds a repair.
#[derive(Debug, Clone, Copy)]
enum Reader {
    /// Every task up to the watermark.
    Walk,
    /// Only the users of the repaired resources.
    ByName,
    /// Every task up to the middle of the queue, then the users of the resources still
    /// unsettled (the gauge: a short walk, then a look-up by name).
    Both,
}

/// Brings `counter` up to date with `queue` (the incomplete tasks now, in order) the way the
/// gauge does: tracked tasks that left, a repair fed the tasks up to the watermark, then the
/// tasks newer than the watermark.
fn maintain(counter: &mut LaneCounter, queue: &[(Key, Vec<String>)], reader: Reader) {
    let present: std::collections::HashSet<TaskId> = queue.iter().map(|(k, _)| k.1).collect();
    let gone: Vec<TaskId> = counter
        .tracked_ids()
        .filter(|id| !present.contains(id))
        .collect();
    let mut repair = counter.gone(&gone);
    let watermark = counter.watermark();
    match reader {
        Reader::Walk => feed(&mut repair, queue, None, watermark, false),
        Reader::ByName => feed(&mut repair, queue, None, watermark, true),
        Reader::Both => {
            let middle = queue.get(queue.len() / 2).map(|(k, _)| *k);
            let walked = middle.min(watermark);
            feed(&mut repair, queue, None, walked, false);
            let unsettled: Vec<String> = repair.unsettled().map(|(n, _)| n.to_owned()).collect();
            let mut rest = repair.take(unsettled.iter().map(String::as_str));
            feed(&mut rest, queue, walked, watermark, true);
            repair.merge(rest);
        }
    }
    counter.repair(repair);
    for (key, record) in queue {
        if watermark.is_none_or(|w| *key > w) {
            counter.push_classed(*key, record, class_of(key.1));
        }
    }
}

fn arb_record() -> impl Strategy<Value = Vec<String>> {
    let entry = (0..5u8, any::<bool>())
        .prop_map(|(r, shared)| format!("{}r{r}", if shared { "shared:" } else { "" }));
    prop::collection::vec(entry, 0..4)
}

/// A queue with equal timestamps (three tasks per microsecond), ordered like Postgres orders it.
fn keyed(records: Vec<Vec<String>>, first_created: i64) -> Vec<(Key, Vec<String>)> {
    let mut queue: Vec<(Key, Vec<String>)> = records
        .into_iter()
        .enumerate()
        .map(|(i, r)| ((first_created + i as i64 / 3, TaskId(Uuid::new_v4())), r))
        .collect();
    queue.sort_by_key(|(k, _)| *k);
    queue
}

/// One round of changes: which tasks end (any task: lanes, heads, tasks deep in the queue) and
/// which arrive.
type Round = (Vec<bool>, Vec<Vec<String>>);

fn arb_rounds() -> impl Strategy<Value = Vec<Round>> {
    prop::collection::vec(
        (
            prop::collection::vec(prop::bool::weighted(0.3), 0..150),
            prop::collection::vec(arb_record(), 0..20),
        ),
        1..5,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_maintained_count_equals_a_fresh_count_after_any_changes(
        initial in prop::collection::vec(arb_record(), 0..120),
        rounds in arb_rounds(),
        reader in prop_oneof![Just(Reader::Walk), Just(Reader::ByName), Just(Reader::Both)],
    ) {
        let mut queue = keyed(initial, 0);
        let mut counter = counted(&queue);
        prop_assert_eq!(counter.lanes(), reference(&queue));
        let mut next = 1_000;
        for (ends, arrivals) in rounds {
            let mut i = 0;
            queue.retain(|_| {
                i += 1;
                !ends.get(i - 1).copied().unwrap_or(false)
            });
            queue.extend(keyed(arrivals, next));
            next += 1_000;
            maintain(&mut counter, &queue, reader);
            prop_assert_eq!(counter.lanes(), reference(&queue));
            prop_assert!(counter.maintainable());
            // Only places and lanes are remembered, never the tasks behind them.
            let fresh = counted(&queue);
            prop_assert_eq!(counter.tracked(), fresh.tracked());
            // The lanes by class (the caps and the reserve count them) add up and agree too.
            prop_assert_eq!(by_class(&counter), by_class(&fresh));
            prop_assert_eq!(by_class(&counter).iter().map(|(_, n)| n).sum::<u64>(), counter.lanes());
        }
    }
}

fn k(created: i64) -> Key {
    (created, TaskId(Uuid::from_u128(created as u128 + 1)))
}

fn rec(entries: &[&str]) -> Vec<String> {
    entries.iter().map(|e| e.to_string()).collect()
}

#[test]
fn shared_users_behind_an_exclusive_task_become_lanes_when_it_ends() {
    let queue = vec![
        (k(1), rec(&["d"])),
        (k(2), rec(&["shared:d", "a"])),
        (k(3), rec(&["shared:d"])),
        (k(4), rec(&["d"])),
        (k(5), rec(&["shared:d"])),
    ];
    let mut counter = counted(&queue);
    assert_eq!(counter.lanes(), 1);
    // Tracked: the head (a lane, both places of d), task 2 (first of a). Not the rest.
    assert_eq!(counter.tracked(), 2);
    let rest = queue[1..].to_vec();
    maintain(&mut counter, &rest, Reader::ByName);
    // Tasks 2 and 3 share d ahead of its next exclusive user (task 4); task 5 waits behind it.
    assert_eq!(counter.lanes(), 2);
    assert_eq!(counter.lanes(), reference(&rest));
}

#[test]
fn a_task_that_holds_no_place_ends_without_changing_anything() {
    let queue = vec![
        (k(1), rec(&["r"])),
        (k(2), rec(&["r"])),
        (k(3), rec(&["r", "x"])),
        (k(4), rec(&["x"])),
    ];
    let mut counter = counted(&queue);
    assert_eq!(counter.lanes(), 1);
    // Task 2 is neither a lane nor first anywhere: it is not tracked, and its end needs no repair.
    assert!(!counter.tracked_ids().any(|id| id == k(2).1));
    let repair = counter.gone(&[k(2).1]);
    assert!(repair.is_empty());
    // Task 3 is first of x (and waits behind task 1 on r): when it ends, task 4 takes x's
    // places and, with nothing older on x, is a lane.
    let rest = vec![queue[0].clone(), queue[1].clone(), queue[3].clone()];
    maintain(&mut counter, &rest, Reader::ByName);
    assert_eq!(counter.lanes(), 2);
    assert_eq!(counter.lanes(), reference(&rest));
}

#[test]
fn tracking_stops_at_its_limit_and_the_count_stays_exact() {
    let queue: Vec<(Key, Vec<String>)> = (0..10).map(|i| (k(i), vec![format!("r{i}")])).collect();
    let mut counter = LaneCounter::with_track_limit(4);
    for (key, record) in &queue {
        counter.push_task(*key, record);
    }
    assert_eq!(counter.lanes(), 10);
    assert!(!counter.maintainable());
    assert_eq!(counter.tracked(), 4);
}

#[test]
fn a_repair_that_reaches_the_track_limit_counts_every_lane_once() {
    // F and L share s; F is first of s, a and b. When F ends, L (a lane already) takes s's first
    // place and A and B become lanes; tracking overflows on the way, in whatever order the
    // candidates come (hash order differs between counters, so try many).
    for _ in 0..64 {
        let queue = vec![
            (k(1), rec(&["shared:s", "a", "b"])),
            (k(2), rec(&["shared:s"])),
            (k(3), rec(&["a"])),
            (k(4), rec(&["b"])),
        ];
        let mut counter = LaneCounter::with_track_limit(2);
        for (key, record) in &queue {
            counter.push_task(*key, record);
        }
        assert_eq!(counter.lanes(), 2);
        assert!(counter.maintainable());
        let rest = queue[1..].to_vec();
        maintain(&mut counter, &rest, Reader::Walk);
        assert_eq!(counter.lanes(), 3);
        assert!(!counter.maintainable());
    }
}

#[test]
fn an_invalidated_counter_cannot_be_maintained() {
    let mut counter = counted(&[(k(1), rec(&["a"]))]);
    assert!(counter.maintainable());
    counter.invalidate();
    assert!(!counter.maintainable());
    assert_eq!(counter.lanes(), 1);
}
