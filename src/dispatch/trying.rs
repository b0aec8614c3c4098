//! The tasks this replica's passes are trying to grant, and how a page read without them takes
//! them back in ([`take_in`]).

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use crate::ids::TaskId;
use crate::tasks::{Page, TaskRow};

/// Takes into `page`, read without `trying` (the tasks other passes are trying, each as its pass
/// read it and when; left out by their conflict keys), those it would have held: past the
/// page's start (`trying` holds only those), and up to its last row when it is full (past it the
/// next page reads on). Each taken in is noted in `taken_in` with when it was read; the page
/// stays in queue order.
pub(super) fn take_in(
    page: &mut Page,
    trying: Vec<(TaskRow, Instant)>,
    taken_in: &mut HashMap<TaskId, Instant>,
) {
    let last = page
        .full
        .then(|| page.tasks.last().map(|r| (r.created, r.id)))
        .flatten();
    let read: HashSet<TaskId> = page.tasks.iter().map(|r| r.id).collect();
    for (row, at) in trying {
        if read.contains(&row.id) || last.is_some_and(|l| (row.created, row.id) > l) {
            continue;
        }
        taken_in.insert(row.id, at);
        page.tasks.push(row);
    }
    page.tasks.sort_by_key(|r| (r.created, r.id));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ready::{Candidate, Resources};
    use chrono::{DateTime, Duration, Utc};
    use uuid::Uuid;

    fn row(at: DateTime<Utc>, record: &[&str]) -> TaskRow {
        TaskRow {
            id: TaskId(Uuid::new_v4()),
            created: at,
            name: "t".to_owned(),
            immediate: false,
            domain: Uuid::nil(),
            task_group: None,
            candidate: Candidate {
                resources: Resources::from_record(record),
                older_conflicts: 0,
                versions: Some(Default::default()),
            },
        }
    }

    fn page(tasks: Vec<TaskRow>, full: bool) -> Page {
        Page {
            tasks,
            full,
            held: Vec::new(),
            tail: None,
            whole: false,
        }
    }

    fn ids(page: &Page) -> Vec<TaskId> {
        page.tasks.iter().map(|r| r.id).collect()
    }

    #[test]
    fn a_full_page_takes_in_what_lies_up_to_its_last_row_in_queue_order() {
        let t0 = Utc::now();
        let at = |s: i64| t0 + Duration::seconds(s);
        let (a, b, c, d) = (
            row(at(1), &["a"]),
            row(at(3), &["b"]),
            row(at(2), &["c"]),
            row(at(9), &["d"]),
        );
        let read_at = Instant::now();
        let mut p = page(vec![a.clone(), b.clone()], true);
        let mut taken = HashMap::new();
        take_in(
            &mut p,
            vec![(d.clone(), read_at), (c.clone(), read_at)],
            &mut taken,
        );
        // c (between a and b) is taken in in its place; d lies past the last row: the next
        // page reads on to it.
        assert_eq!(ids(&p), vec![a.id, c.id, b.id]);
        assert_eq!(taken.keys().copied().collect::<Vec<_>>(), vec![c.id]);
    }

    #[test]
    fn a_page_that_reached_the_queues_end_takes_in_everything_past_its_start() {
        let t0 = Utc::now();
        let at = |s: i64| t0 + Duration::seconds(s);
        let (a, c, d) = (row(at(1), &["a"]), row(at(2), &["c"]), row(at(9), &["d"]));
        let read_at = Instant::now();
        let mut p = page(vec![a.clone()], false);
        let mut taken = HashMap::new();
        take_in(
            &mut p,
            vec![(d.clone(), read_at), (c.clone(), read_at)],
            &mut taken,
        );
        assert_eq!(ids(&p), vec![a.id, c.id, d.id]);
        assert_eq!(taken.len(), 2);
        // An empty page that reached the end takes in all of them too.
        let mut empty = page(Vec::new(), false);
        take_in(&mut empty, vec![(d.clone(), read_at)], &mut HashMap::new());
        assert_eq!(ids(&empty), vec![d.id]);
    }

    #[test]
    fn a_task_the_page_read_anyway_is_not_taken_in_twice() {
        let t0 = Utc::now();
        let a = row(t0, &["a"]);
        let earlier = Instant::now();
        let mut p = page(vec![a.clone()], false);
        let mut taken = HashMap::new();
        take_in(&mut p, vec![(a.clone(), earlier)], &mut taken);
        assert_eq!(ids(&p), vec![a.id]);
        assert!(taken.is_empty(), "judged as of the page's read");
    }
}
