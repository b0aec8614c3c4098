use super::*;
use proptest::prelude::*;
use std::cmp::Ordering;
use uuid::Uuid;

fn res(record: &[&str]) -> Resources {
    Resources::from_record(record)
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn parses_modes_and_collapses_duplicates() {
    let r = res(&["b", "shared:a", "b", "shared:b", "shared:a"]);
    assert_eq!(r.exclusive, vec!["b"]);
    assert_eq!(r.shared, vec!["a"]);
}

#[test]
fn shared_users_coexist_and_exclusive_conflicts_with_any_mode() {
    assert!(!res(&["shared:a"]).conflicts_with(&res(&["shared:a"])));
    assert!(res(&["a"]).conflicts_with(&res(&["shared:a"])));
    assert!(res(&["shared:a"]).conflicts_with(&res(&["a"])));
    assert!(res(&["a"]).conflicts_with(&res(&["a"])));
    assert!(!res(&["a"]).conflicts_with(&res(&["b"])));
    assert!(!res(&[]).conflicts_with(&res(&["a"])));
}

#[test]
fn conflict_keys_are_what_a_conflicting_record_contains() {
    let keys = res(&["a", "shared:d"]).conflict_keys();
    assert_eq!(keys, vec!["a", "shared:a", "d"]);
}

#[test]
fn hidden_older_task_still_reserves_its_other_resources() {
    // DESIGN.md's pitfall: T1 needs A and B, A is held; T2 (newer) needs only B.
    let mut reserved = Reservations::default();
    reserved.reserve(&res(&["A"]));
    let t1 = res(&["A", "B"]);
    assert!(reserved.conflicts_with(&t1));
    reserved.reserve(&t1);
    assert!(reserved.conflicts_with(&res(&["B"])));
}

#[test]
fn judge_orders_its_reasons() {
    let lease = map(&[("core", "3.123.1")]);
    let mut c = Candidate {
        resources: res(&["a"]),
        older_conflicts: 0,
        versions: Some(map(&[("core", "3.123.0")])),
    };
    let none = Reservations::default();
    assert_eq!(judge(&c, &none, &lease), Verdict::Ready);
    c.versions = Some(map(&[("core", "3.124")]));
    assert_eq!(judge(&c, &none, &lease), Verdict::Incompatible);
    c.versions = None;
    assert_eq!(
        judge(&c, &none, &lease),
        Verdict::Incompatible,
        "unreadable versions fail closed"
    );
    c.versions = Some(map(&[("core", "3.124")]));
    let mut held = Reservations::default();
    held.reserve(&res(&["shared:a"]));
    assert_eq!(judge(&c, &held, &lease), Verdict::BlockedByReserved);
    c.older_conflicts = 3;
    assert_eq!(judge(&c, &none, &lease), Verdict::BlockedByOlder);
}

#[test]
fn compatibility_is_pulps_rule() {
    let worker = map(&[("core", "3.123.1"), ("file", "3.123.1")]);
    assert!(is_compatible(&map(&[]), &worker));
    assert!(is_compatible(&map(&[("core", "3.123.1")]), &worker));
    assert!(is_compatible(&map(&[("core", "3.9")]), &worker));
    assert!(!is_compatible(&map(&[("core", "3.124.0")]), &worker));
    assert!(!is_compatible(&map(&[("rpm", "1.0")]), &worker));
    assert!(!is_compatible(&map(&[("core", "1")]), &map(&[])));
}

#[test]
fn a_task_runs_on_a_lease_whose_versions_satisfy_it_and_nowhere_if_unreadable() {
    let lease = map(&[("core", "3.123.1")]);
    let mut c = Candidate {
        resources: Resources::default(),
        older_conflicts: 0,
        versions: Some(map(&[("core", "3.100")])),
    };
    assert!(runs_on(&c, &lease));
    c.versions = Some(map(&[("core", "3.200")]));
    assert!(!runs_on(&c, &lease));
    c.versions = None;
    assert!(!runs_on(&c, &lease), "fail closed");
    assert!(obstacles(&c, &Reservations::default(), &lease).incompatible);
}

#[test]
fn releases_compare_numerically() {
    assert_eq!(compare_releases("3.123.1", "3.9.10"), Ordering::Greater);
    assert_eq!(compare_releases("3.1", "3.1.0"), Ordering::Equal);
    assert_eq!(compare_releases("3.1.0.dev0", "3.1"), Ordering::Less);
    assert_eq!(compare_releases("3.124.0rc1", "3.124.0"), Ordering::Less);
    assert_eq!(compare_releases("3.124.0rc1", "3.123.9"), Ordering::Greater);
    assert_eq!(compare_releases("3.1.post1", "3.1"), Ordering::Greater);
    assert_eq!(compare_releases("10", "9.99"), Ordering::Greater);
    assert!(is_valid_release("3.123.1"));
    assert!(is_valid_release("3.1.0rc1"));
    assert!(is_valid_release("3.124.0.dev0"));
    assert!(!is_valid_release(""));
    assert!(!is_valid_release("abc"));
    assert!(!is_valid_release("3..1"));
}

/// The straightforward reference: for every task, look at every older task.
fn lanes_reference(queue: &[Resources]) -> u64 {
    (0..queue.len())
        .filter(|&i| {
            !queue[..i]
                .iter()
                .any(|older| older.conflicts_with(&queue[i]))
        })
        .count() as u64
}

/// The `reserved_resources_record` of a task with these resources.
fn record_of(t: &Resources) -> Vec<String> {
    t.exclusive
        .iter()
        .cloned()
        .chain(t.shared.iter().map(|s| format!("{SHARED_PREFIX}{s}")))
        .collect()
}

fn arb_queue() -> impl Strategy<Value = Vec<Resources>> {
    let entry = (0..6u8, any::<bool>())
        .prop_map(|(r, shared)| format!("{}r{r}", if shared { "shared:" } else { "" }));
    prop::collection::vec(prop::collection::vec(entry, 0..4), 0..200).prop_map(|q| {
        q.iter()
            .map(|record| Resources::from_record(record))
            .collect()
    })
}

fn arb_records() -> impl Strategy<Value = Vec<Vec<String>>> {
    let entry = (0..6u8, any::<bool>())
        .prop_map(|(r, shared)| format!("{}r{r}", if shared { "shared:" } else { "" }));
    prop::collection::vec(prop::collection::vec(entry, 0..4), 0..200)
}

proptest! {
    #[test]
    fn lane_counter_matches_the_pairwise_reference(queue in arb_queue()) {
        let mut counter = LaneCounter::default();
        for (i, task) in queue.iter().enumerate() {
            counter.push_task((i as i64, TaskId(Uuid::new_v4())), &record_of(task));
        }
        prop_assert_eq!(counter.lanes(), lanes_reference(&queue));
    }

    #[test]
    fn records_with_repeated_names_count_like_their_resources(queue in arb_records()) {
        let mut by_resources = LaneCounter::default();
        let mut by_record = LaneCounter::default();
        for (i, record) in queue.iter().enumerate() {
            by_resources.push_task((i as i64, TaskId(Uuid::new_v4())), &record_of(&Resources::from_record(record)));
            by_record.push_task((i as i64, TaskId(Uuid::new_v4())), record);
        }
        prop_assert_eq!(by_record.lanes(), by_resources.lanes());
    }

    #[test]
    fn conflict_keys_overlap_exactly_when_tasks_conflict(a in arb_queue(), b in arb_queue()) {
        for (x, y) in a.iter().zip(b.iter()) {
            let keys: std::collections::HashSet<String> = x.conflict_keys().into_iter().collect();
            let record: Vec<String> = y.exclusive.iter().cloned()
                .chain(y.shared.iter().map(|s| format!("{SHARED_PREFIX}{s}")))
                .collect();
            let overlaps = record.iter().any(|e| keys.contains(e));
            prop_assert_eq!(overlaps, x.conflicts_with(y));
        }
    }

    #[test]
    fn conflict_is_symmetric(a in arb_queue(), b in arb_queue()) {
        for (x, y) in a.iter().zip(b.iter()) {
            prop_assert_eq!(x.conflicts_with(y), y.conflicts_with(x));
        }
    }
}

#[test]
fn conflicts_name_the_resource_and_both_modes() {
    let t = res(&["a", "shared:b", "shared:c", "d"]);
    let other = res(&["shared:a", "b", "shared:c"]);
    let found: Vec<(String, Mode, Mode)> = t
        .conflicts(&other)
        .map(|c| (c.resource.to_owned(), c.mine, c.theirs))
        .collect();
    assert_eq!(
        found,
        vec![
            ("a".into(), Mode::Exclusive, Mode::Shared),
            ("b".into(), Mode::Shared, Mode::Exclusive),
        ]
    );
    assert_eq!(t.conflicts(&res(&["shared:c", "e"])).count(), 0);
}

#[test]
fn obstacles_report_every_reason_and_the_verdict_takes_the_first() {
    let lease = map(&[("core", "3.0")]);
    let c = Candidate {
        resources: res(&["a"]),
        older_conflicts: 2,
        versions: Some(map(&[("core", "3.123")])),
    };
    let mut held = Reservations::default();
    held.reserve_lock("a", Mode::Shared);
    let o = obstacles(&c, &held, &lease);
    assert_eq!(
        o,
        Obstacles {
            older: true,
            reserved: true,
            incompatible: true
        }
    );
    assert_eq!(o.verdict(), Verdict::BlockedByOlder);
    assert!(!o.ready_by_rule());
    // A shared lock does not block a shared request.
    let shared = Candidate {
        resources: res(&["shared:a"]),
        older_conflicts: 0,
        versions: Some(BTreeMap::new()),
    };
    assert_eq!(judge(&shared, &held, &lease), Verdict::Ready);
}

#[test]
fn the_survey_finds_the_head_of_line_blocking_resource() {
    // The incident: R0's head runs, many tasks wait behind it; another domain flows freely.
    let ids: Vec<TaskId> = (0..8).map(|_| TaskId(Uuid::new_v4())).collect();
    let mut counter = LaneCounter::default();
    for (i, id) in ids[..5].iter().enumerate() {
        counter.push_task((i as i64, *id), &["R0", "shared:dom-a"]);
    }
    counter.push_task((5, ids[5]), &["R1", "shared:dom-b"]);
    counter.push_task((6, ids[6]), &["R2", "shared:dom-b"]);
    counter.push_task((7, ids[7]), &["R1"]);
    let top = counter.most_blocked(10);
    assert_eq!(
        top,
        vec![
            BlockedResource {
                resource: "R0".into(),
                behind: 4,
                head: ids[0]
            },
            BlockedResource {
                resource: "R1".into(),
                behind: 1,
                head: ids[5]
            },
        ]
    );
    assert_eq!(counter.most_blocked(1).len(), 1);
    assert_eq!(counter.lanes(), 3);
}

/// The survey's reference: per resource, its users in queue order; the head is the first, and a
/// later user waits behind it when it or some earlier user needs the resource exclusively.
fn survey_reference(queue: &[Resources]) -> BTreeMap<String, (u32, usize)> {
    let mut out: BTreeMap<String, (u32, usize)> = BTreeMap::new();
    let mut exclusive_seen: std::collections::HashSet<String> = Default::default();
    for (i, t) in queue.iter().enumerate() {
        let uses = t
            .exclusive
            .iter()
            .map(|r| (r, true))
            .chain(t.shared.iter().map(|r| (r, false)));
        for (r, excl) in uses {
            match out.get_mut(r) {
                None => {
                    out.insert(r.clone(), (0, i));
                }
                Some((waiting, _)) => {
                    if excl || exclusive_seen.contains(r) {
                        *waiting += 1;
                    }
                }
            }
            if excl {
                exclusive_seen.insert(r.clone());
            }
        }
    }
    out
}

proptest! {
    #[test]
    fn the_survey_matches_its_reference(queue in arb_queue()) {
        let ids: Vec<TaskId> = queue.iter().map(|_| TaskId(Uuid::new_v4())).collect();
        let mut counter = LaneCounter::default();
        for (i, (id, t)) in ids.iter().zip(&queue).enumerate() {
            counter.push_task((i as i64, *id), &record_of(t));
        }
        let expected: Vec<BlockedResource> = {
            let mut v: Vec<BlockedResource> = survey_reference(&queue)
                .into_iter()
                .filter(|(_, (waiting, _))| *waiting > 0)
                .map(|(resource, (waiting, head))| BlockedResource { resource, behind: waiting, head: ids[head] })
                .collect();
            v.sort_by(|a, b| b.behind.cmp(&a.behind).then_with(|| a.resource.cmp(&b.resource)));
            v
        };
        prop_assert_eq!(counter.most_blocked(usize::MAX), expected);
        prop_assert_eq!(counter.lanes(), lanes_reference(&queue));
    }

    #[test]
    fn conflicts_with_is_exactly_some_conflict(a in arb_queue(), b in arb_queue()) {
        for (x, y) in a.iter().zip(b.iter()) {
            let named: Vec<_> = x.conflicts(y).collect();
            prop_assert_eq!(!named.is_empty(), x.conflicts_with(y));
            for c in named {
                prop_assert!(c.mine == Mode::Exclusive || c.theirs == Mode::Exclusive);
            }
        }
    }
}
