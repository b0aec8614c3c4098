use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use uuid::Uuid;

use super::*;

fn g(n: u128) -> Group {
    Uuid::from_u128(n)
}

fn rules(weights: &[(u128, f64)], caps: &[(u128, u32)], reserve: u32) -> Rules {
    let mut by_group: HashMap<Group, Rule> = HashMap::new();
    for (n, w) in weights {
        by_group.entry(g(*n)).or_default().weight = Some(*w);
    }
    for (n, c) in caps {
        by_group.entry(g(*n)).or_default().cap = Some(*c);
    }
    Rules {
        default_weight: 1.0,
        reserve,
        by_group,
    }
}

fn standing(running: &[(u128, u32)], deferred: u32, live_leases: u32) -> Standing {
    Standing {
        running: running.iter().map(|(n, r)| (g(*n), *r)).collect(),
        deferred,
        live_leases,
    }
}

#[test]
fn reads_a_policy_file() {
    let text = "# kept for immediate tasks\nreserve = 2\ndefault_weight = 1.5\n\n\
                [groups.default]\nweight = 2\ncap = 3\n\n\
                [groups.\"00000000-0000-0000-0000-0000000000aa\"]\ncap = 0\n";
    let policy = Policy::parse(text).unwrap();
    assert_eq!(policy.reserve, 2);
    assert_eq!(policy.default_weight, 1.5);
    assert_eq!(
        policy.groups["default"],
        Rule {
            weight: Some(2.0),
            cap: Some(3)
        }
    );
    let names = HashMap::from([(g(7), "default".to_owned())]);
    let rules = policy.resolve(&names);
    assert_eq!(rules.weight(&g(7)), 2.0);
    assert_eq!(rules.cap(&g(7)), Some(3));
    assert_eq!(rules.cap(&g(0xaa)), Some(0));
    assert_eq!(rules.weight(&g(0xaa)), 1.5);
    assert_eq!(rules.weight(&g(8)), 1.5);
    assert_eq!(Policy::parse("").unwrap(), Policy::default());
}

#[test]
fn refuses_bad_policy_naming_the_line() {
    let cases: &[(&str, usize, &str)] = &[
        (
            "reserve = 1\n[groups.a]\nweight = 0\n",
            3,
            "weight must be a number above 0",
        ),
        (
            "[groups.a]\nweight = -2.5\n",
            2,
            "weight must be a number above 0",
        ),
        ("[groups.a]\n\ncap = -1\n", 3, "cap must be a whole number"),
        ("reserve = 1.5\n", 1, "reserve must be a whole number"),
        ("[groups.a]\nwieght = 2\n", 2, "unknown field `wieght`"),
        ("reserve = 1\ncaps = 2\n", 2, "unknown field `caps`"),
        ("reserve = 1\n[groups.a\n", 2, ""),
        (
            "default_weight = \"x\"\n",
            1,
            "default_weight must be a number above 0",
        ),
    ];
    for (text, line, says) in cases {
        let e = Policy::parse(text).unwrap_err();
        assert_eq!(e.line, Some(*line), "{text:?}: {e}");
        assert!(e.message.starts_with(&format!("line {line}: ")), "{e}");
        assert!(e.message.contains(says), "{text:?}: {e}");
    }
}

#[test]
fn serves_the_lowest_usage_first_then_the_oldest() {
    let r = rules(&[(2, 2.0)], &[], 0);
    // Group 1 runs 2 (usage 2), group 2 runs 2 at weight 2 (usage 1), group 3 runs none.
    let s = standing(&[(1, 2), (2, 2)], 4, 10);
    assert_eq!(
        r.order(&s, &[(g(1), 10), (g(2), 30), (g(3), 50)]),
        vec![g(3), g(2), g(1)]
    );
    // A tie goes to the group whose oldest waiting task is older.
    let s = standing(&[], 0, 10);
    assert_eq!(r.order(&s, &[(g(1), 40), (g(3), 20)]), vec![g(3), g(1)]);
}

#[test]
fn a_capped_group_waits_and_the_others_do_not() {
    let r = rules(&[], &[(1, 3)], 0);
    let s = standing(&[(1, 3)], 3, 10);
    assert_eq!(r.order(&s, &[(g(1), 1), (g(2), 2)]), vec![g(2)]);
    assert_eq!(
        r.holds_back(&s, &g(1), false),
        Some(HeldBack::Cap { cap: 3 })
    );
    assert_eq!(r.holds_back(&s, &g(2), false), None);
    assert_eq!(
        HeldBack::Cap { cap: 3 }.to_string(),
        "its group is at its cap of 3 running"
    );
}

#[test]
fn the_reserve_keeps_leases_for_immediate_tasks() {
    let r = rules(&[], &[], 2);
    // 10 leases, 8 deferred tasks hold locks: the last 2 are kept.
    let s = standing(&[(1, 8)], 8, 10);
    assert_eq!(
        r.holds_back(&s, &g(1), false),
        Some(HeldBack::Reserve { reserve: 2 })
    );
    assert_eq!(r.holds_back(&s, &g(1), true), None);
    let s = standing(&[(1, 7)], 7, 10);
    assert_eq!(r.holds_back(&s, &g(1), false), None);
    // Fewer leases than the reserve: deferred tasks wait for more workers.
    let s = standing(&[], 0, 2);
    assert_eq!(
        r.holds_back(&s, &g(1), false),
        Some(HeldBack::Reserve { reserve: 2 })
    );
}

#[test]
fn run_time_overrides_are_read_from_their_fields_and_made_over_the_rules() {
    let fields: Vec<(String, String)> = [
        ("base".to_owned(), "42".to_owned()),
        override_fields::reserve(2),
        override_fields::weight(g(1), 3.0),
        override_fields::cap(g(1), Some(4)),
        override_fields::cap(g(2), None),
        // Unreadable fields are left out.
        ("weight:not-a-uuid".to_owned(), "1".to_owned()),
        override_fields::weight(g(3), -1.0),
        ("colour".to_owned(), "blue".to_owned()),
    ]
    .into_iter()
    .collect();
    let overrides = Overrides::from_fields(&fields);
    assert_eq!(overrides.base, 42);
    assert_eq!(overrides.reserve, Some(2));
    assert_eq!(overrides.weights.len(), 1);
    let mut r = rules(&[(2, 5.0)], &[(2, 1)], 0);
    overrides.apply(&mut r);
    assert_eq!(r.reserve, 2);
    assert_eq!((r.weight(&g(1)), r.cap(&g(1))), (3.0, Some(4)));
    // D2 keeps its weight and loses its cap.
    assert_eq!((r.weight(&g(2)), r.cap(&g(2))), (5.0, None));
    assert_eq!(
        overrides.describe(|g| format!("D{}", g.as_u128())),
        [
            "reserve: 2",
            "weight of D1: 3",
            "cap of D1: 4",
            "cap of D2: none"
        ]
    );
    assert!(Overrides::from_fields(&[]).is_empty());
}

#[test]
fn the_gauge_counts_lanes_under_caps_and_the_reserve() {
    let none = Standing::default();
    // D1: 17 deferred lanes, capped at 3; D2: 2 deferred; D3: 1 immediate.
    let lanes = [(g(1), false, 17), (g(2), false, 2), (g(3), true, 1)];
    assert_eq!(rules(&[], &[], 0).lanes(lanes, &none), 20);
    assert_eq!(rules(&[], &[(1, 3)], 0).lanes(lanes, &none), 6);
    // A reserve of 2: the deferred 5 need 2 leases more than themselves.
    assert_eq!(rules(&[], &[(1, 3)], 2).lanes(lanes, &none), 7);
    // Immediate lanes beyond the reserve are counted as they are.
    assert_eq!(
        rules(&[], &[(1, 3)], 2).lanes([(g(3), true, 4), (g(2), false, 1)], &none),
        5
    );
    // No deferred lane: nothing to keep the reserve from.
    assert_eq!(rules(&[], &[], 2).lanes([(g(3), true, 1)], &none), 1);
    assert_eq!(rules(&[], &[], 2).lanes([], &none), 0);
    // A cap counts immediate lanes first.
    assert_eq!(
        rules(&[], &[(1, 3)], 0).lanes([(g(1), true, 2), (g(1), false, 5)], &none),
        3
    );
    // A cap lowered to 2 while 5 of D1's tasks hold locks: their 5 leases are busy.
    let five = standing(&[(1, 5)], 5, 5);
    assert_eq!(rules(&[], &[(1, 2)], 0).lanes([(g(1), false, 9)], &five), 5);
    // 3 deferred tasks hold D1's 3 places; its immediate task waits for one: 3 + the reserve.
    let three = standing(&[(1, 3)], 3, 3);
    assert_eq!(
        rules(&[], &[(1, 3)], 2).lanes([(g(1), false, 3), (g(1), true, 1)], &three),
        5
    );
}

#[test]
fn choose_takes_immediate_tasks_first_then_the_fair_group() {
    let r = rules(&[], &[], 0);
    let s = standing(&[(1, 5)], 5, 10);
    let ready = [
        (g(1), false, 1),
        (g(1), false, 2),
        (g(2), false, 3),
        (g(1), true, 4),
    ];
    assert_eq!(r.choose(&s, &ready), Some(3));
    assert_eq!(r.choose(&s, &ready[..3]), Some(2));
    // With no contention: plain FIFO.
    assert_eq!(r.choose(&s, &ready[..2]), Some(0));
}

/// A model of the queue for the properties: tasks with a group, immediate or not, and resources
/// (exclusive only, from a few names, so conflicts are common).
#[derive(Debug, Clone)]
struct Task {
    group: u128,
    immediate: bool,
    resources: Vec<u8>,
}

fn task() -> impl Strategy<Value = Task> {
    (
        0u128..4,
        prop::bool::weighted(0.2),
        prop::collection::vec(0u8..6, 1..3),
    )
        .prop_map(|(group, immediate, resources)| Task {
            group,
            immediate,
            resources,
        })
}

/// The tasks ready by the readiness rule: waiting, no older incomplete task shares a resource
/// (every resource is exclusive here, so any shared name conflicts).
fn ready_now(tasks: &[Task], state: &[u8]) -> Vec<usize> {
    (0..tasks.len())
        .filter(|i| state[*i] == 0)
        .filter(|i| {
            !(0..*i).any(|o| {
                state[o] < 2
                    && tasks[o]
                        .resources
                        .iter()
                        .any(|r| tasks[*i].resources.contains(r))
            })
        })
        .collect()
}

/// Waiting groups as a property test draws them, each group once (its first key).
fn distinct(waiting: Vec<(u128, u32)>) -> Vec<(Group, u32)> {
    let mut seen = std::collections::HashSet::new();
    waiting
        .into_iter()
        .filter(|(n, _)| seen.insert(*n))
        .map(|(n, k)| (g(n), k))
        .collect()
}

proptest! {
    /// The first n of the order are the order's first n, whatever n.
    #[test]
    fn the_first_groups_are_the_orders_head(
        waiting in prop::collection::vec((0u128..50, 0u32..20), 0..40),
        running in prop::collection::vec((0u128..50, 0u32..5), 0..20),
        caps in prop::collection::vec((0u128..50, 0u32..3), 0..5),
        n in 0usize..45,
    ) {
        let waiting = distinct(waiting);
        let r = rules(&[(1, 2.0), (2, 0.5)], &caps, 0);
        let s = standing(&running, 0, 10);
        let all = r.order(&s, &waiting);
        let head = r.first(&s, &waiting, n);
        prop_assert_eq!(&head[..], &all[..n.min(all.len())]);
    }

    /// The walk over the groups by key gives the same head as the order, whatever the weights,
    /// caps (0 among them) and standing.
    #[test]
    fn the_walk_in_key_order_gives_the_orders_head(
        waiting in prop::collection::vec((0u128..50, 0u32..20), 0..40),
        running in prop::collection::vec((0u128..50, 0u32..5), 0..20),
        caps in prop::collection::vec((0u128..50, 0u32..3), 0..5),
        weights in prop::collection::vec((0u128..50, 1u32..8), 0..5),
        n in 0usize..45,
    ) {
        let waiting = distinct(waiting);
        let weights: Vec<(u128, f64)> =
            weights.into_iter().map(|(n, w)| (n, f64::from(w) / 4.0)).collect();
        let r = rules(&weights, &caps, 0);
        let s = standing(&running, 0, 10);
        let mut by_key: Vec<(u32, Group)> = waiting.iter().map(|(g, k)| (*k, *g)).collect();
        by_key.sort();
        let keys: std::collections::HashMap<Group, u32> = waiting.iter().copied().collect();
        let walked = r.first_in_order(&s, by_key, |g| keys.get(g).copied(), n);
        prop_assert_eq!(walked, r.first(&s, &waiting, n));
    }

    /// Driving dispatch by `choose` over the ready tasks: every task handed out is ready, FIFO
    /// holds per resource and within a group, caps are never exceeded, and a deferred task is
    /// never handed out into the reserve.
    #[test]
    fn choose_keeps_readiness_fifo_and_caps(
        tasks in prop::collection::vec(task(), 1..40),
        caps in prop::collection::vec((0u128..4, 1u32..4), 0..3),
        weights in prop::collection::vec((0u128..4, 1u32..4), 0..3),
        reserve in 0u32..3,
        leases in 1u32..6,
        finishes in prop::collection::vec(any::<prop::sample::Index>(), 1..80),
    ) {
        let weights: Vec<(u128, f64)> = weights.iter().map(|(g, w)| (*g, f64::from(*w))).collect();
        let r = rules(&weights, &caps, reserve);
        // 0 waiting, 1 running, 2 final.
        let mut state = vec![0u8; tasks.len()];
        let mut handed: Vec<usize> = Vec::new();
        for finish in finishes {
            // Fill the leases.
            loop {
                let running: Vec<usize> = (0..tasks.len()).filter(|i| state[*i] == 1).collect();
                if running.len() as u32 >= leases {
                    break;
                }
                let mut s = Standing { live_leases: leases, ..Standing::default() };
                for i in &running {
                    *s.running.entry(g(tasks[*i].group)).or_default() += 1;
                    s.deferred += u32::from(!tasks[*i].immediate);
                }
                let ready = ready_now(&tasks, &state);
                let offered: Vec<(Group, bool, usize)> =
                    ready.iter().map(|i| (g(tasks[*i].group), tasks[*i].immediate, *i)).collect();
                let Some(pick) = r.choose(&s, &offered) else { break };
                let i = offered[pick].2;
                prop_assert!(ready.contains(&i), "handed out a task that is not ready");
                prop_assert!(r.holds_back(&s, &g(tasks[i].group), tasks[i].immediate).is_none());
                // FIFO within the group among ready tasks of the same kind.
                prop_assert!(!ready.iter().any(|o| *o < i
                    && tasks[*o].group == tasks[i].group
                    && tasks[*o].immediate == tasks[i].immediate
                    && r.holds_back(&s, &g(tasks[*o].group), tasks[*o].immediate).is_none()));
                state[i] = 1;
                handed.push(i);
                let held = (0..tasks.len())
                    .filter(|o| state[*o] == 1 && tasks[*o].group == tasks[i].group)
                    .count() as u32;
                if let Some(cap) = r.cap(&g(tasks[i].group)) {
                    prop_assert!(held <= cap, "cap {cap} exceeded: {held}");
                }
                let deferred = (0..tasks.len())
                    .filter(|o| state[*o] == 1 && !tasks[*o].immediate)
                    .count() as u32;
                if !tasks[i].immediate && reserve > 0 {
                    prop_assert!(deferred + reserve <= leases);
                }
            }
            let running: Vec<usize> = (0..tasks.len()).filter(|i| state[*i] == 1).collect();
            if running.is_empty() {
                break;
            }
            state[running[finish.index(running.len())]] = 2;
        }
        // FIFO per resource: a task handed out after a conflicting newer one never happens.
        for (n, a) in handed.iter().enumerate() {
            for b in &handed[n + 1..] {
                let conflict = tasks[*a].resources.iter().any(|x| tasks[*b].resources.contains(x));
                prop_assert!(!(conflict && b < a), "task {b} overtook the older conflicting {a}");
            }
        }
    }

    /// With every group backlogged and tasks of equal length, what runs converges to the
    /// weights: each group holds its weighted share of the workers, give or take one.
    #[test]
    fn shares_converge_to_the_weights(
        weights in prop::collection::btree_map(0u128..5, 1u32..4, 2..5),
        per_weight in 1u32..4,
    ) {
        let r = rules(
            &weights.iter().map(|(g, w)| (*g, f64::from(*w))).collect::<Vec<_>>(),
            &[],
            0,
        );
        let total: u32 = weights.values().sum();
        let workers = total * per_weight;
        // Running tasks as (group, finishes at); every task takes 1 unit.
        let mut running: Vec<(u128, u32)> = Vec::new();
        let waiting: Vec<(Group, u32)> = weights.keys().map(|n| (g(*n), 0)).collect();
        let mut counts: BTreeMap<u128, u32> = BTreeMap::new();
        for now in 0..(20 * workers) {
            running.retain(|(_, until)| *until > now);
            while (running.len() as u32) < workers {
                let s = Standing {
                    running: running.iter().fold(HashMap::new(), |mut m, (n, _)| {
                        *m.entry(g(*n)).or_insert(0) += 1;
                        m
                    }),
                    deferred: running.len() as u32,
                    live_leases: workers,
                };
                let first = r.order(&s, &waiting)[0];
                let n = weights.keys().find(|n| g(**n) == first).copied().unwrap();
                running.push((n, now + 1 + (running.len() as u32 % 3)));
            }
            if now >= 10 * workers {
                for (n, _) in &running {
                    *counts.entry(*n).or_default() += 1;
                }
                for (n, w) in &weights {
                    let held = running.iter().filter(|(m, _)| m == n).count() as i64;
                    let share = i64::from(w * per_weight);
                    prop_assert!((held - share).abs() <= 1,
                        "group {n} holds {held}, its share is {share}");
                }
            }
        }
    }

    /// The gauge's count is the fewest live leases with which every lane the caps allow can
    /// hold its locks at once, granting as `holds_back` allows (immediate lanes first), what
    /// holds locks already included (even beyond a cap); and while deferred tasks hold locks,
    /// the reserve beside them.
    #[test]
    fn the_gauge_counts_the_leases_that_run_every_allowed_lane(
        waiting in proptest::collection::vec((0u128..4, any::<bool>(), 0u64..6), 0..8),
        running in proptest::collection::vec((0u128..4, 0u32..4), 0..3),
        caps in proptest::collection::vec((0u128..4, 0u32..5), 0..3),
        reserve in 0u32..4,
    ) {
        let r = rules(&[], &caps, reserve);
        let mut holding: HashMap<Group, u32> = HashMap::new();
        for (n, k) in &running {
            *holding.entry(g(*n)).or_default() += k;
        }
        let already: u32 = holding.values().sum();
        // Grants what `leases` leases allow: (tasks holding locks, deferred among them).
        let granted = |leases: u32| -> (u64, u32) {
            let mut s = Standing {
                running: holding.clone(),
                deferred: already,
                live_leases: leases,
            };
            let mut left: Vec<(Group, bool, u64)> =
                waiting.iter().map(|(n, i, c)| (g(*n), *i, *c)).collect();
            // Immediate lanes first, as dispatch hands them out.
            left.sort_by_key(|(_, immediate, _)| !*immediate);
            let mut held = u64::from(already);
            loop {
                let next = left.iter_mut().find(|(group, immediate, n)| {
                    *n > 0 && r.holds_back(&s, group, *immediate).is_none()
                });
                match next {
                    Some((group, immediate, n)) if held < u64::from(leases) => {
                        *n -= 1;
                        held += 1;
                        *s.running.entry(*group).or_default() += 1;
                        if !*immediate {
                            s.deferred += 1;
                        }
                    }
                    _ => return (held, s.deferred),
                }
            }
        };
        let (all, deferred) = granted(1_000);
        let fewest = (already..=1_000u32).find(|l| granted(*l).0 == all).unwrap();
        let expected = if deferred > 0 {
            fewest.max(deferred + reserve)
        } else {
            fewest
        };
        // What holds locks is among the lanes (as deferred lanes).
        let lanes = waiting
            .iter()
            .map(|(n, i, c)| (g(*n), *i, *c))
            .chain(running.iter().map(|(n, k)| (g(*n), false, u64::from(*k))));
        let standing = Standing {
            running: holding.clone(),
            deferred: already,
            live_leases: 0,
        };
        prop_assert_eq!(r.lanes(lanes, &standing), u64::from(expected));
    }
}
