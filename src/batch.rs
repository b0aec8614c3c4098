//! Batches: calls of one kind that arrive together (holder checks, finishes, releases of
//! FinishTask) share one round trip to Redis or Postgres. At most `in_flight` batches of a kind
//! run at once; calls that arrive meanwhile wait and go out together in the next one. So a call
//! to an idle broker goes out alone at once, and a busy broker sends fewer, larger batches: the
//! batches grow with the load, and no call waits for a timer.
//!
//! A batch runs in its own tokio task: a caller that goes away does not interrupt it.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Semaphore};

/// One kind of call, batched: `Q` the call, `A` its answer.
pub struct Batcher<Q, A> {
    calls: mpsc::UnboundedSender<(Q, oneshot::Sender<A>)>,
}

impl<Q, A> Clone for Batcher<Q, A> {
    fn clone(&self) -> Self {
        Batcher {
            calls: self.calls.clone(),
        }
    }
}

impl<Q: Send + 'static, A: Send + 'static> Batcher<Q, A> {
    /// Batches of at most `limit` calls, at most `in_flight` of them running at once; `run`
    /// answers a batch, one answer per call in order. Must be made within a tokio runtime; it
    /// stops when the last clone is dropped.
    pub fn new<F, Fut>(limit: usize, in_flight: usize, run: F) -> Self
    where
        F: Fn(Vec<Q>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<A>> + Send + 'static,
    {
        let (calls, mut arriving) = mpsc::unbounded_channel::<(Q, oneshot::Sender<A>)>();
        let slots = Arc::new(Semaphore::new(in_flight.max(1)));
        let limit = limit.max(1);
        tokio::spawn(async move {
            loop {
                // A slot first: while every slot is taken, calls gather for the next batch.
                let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
                    break;
                };
                let Some(first) = arriving.recv().await else {
                    break;
                };
                let mut batch = vec![first];
                while batch.len() < limit {
                    match arriving.try_recv() {
                        Ok(call) => batch.push(call),
                        Err(_) => break,
                    }
                }
                let (batch, answers): (Vec<Q>, Vec<oneshot::Sender<A>>) = batch.into_iter().unzip();
                let work = run(batch);
                tokio::spawn(async move {
                    let outcomes = work.await;
                    drop(slot);
                    // A caller that went away drops its answer.
                    for (answer, outcome) in answers.into_iter().zip(outcomes) {
                        let _ = answer.send(outcome);
                    }
                });
            }
        });
        Batcher { calls }
    }

    /// Sends `call` with the next batch and waits for its answer; `None` when no batch answered
    /// it (the batcher stopped, or `run` gave fewer answers than calls).
    pub async fn call(&self, call: Q) -> Option<A> {
        let (answer, answered) = oneshot::channel();
        self.calls.send((call, answer)).ok()?;
        answered.await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The batches a batcher sent, in order.
    type Sent = Arc<Mutex<Vec<Vec<u32>>>>;

    /// A batcher that records its batches and answers each call with twice its number, each
    /// batch waiting until `gate` lets it end.
    fn doubling(
        limit: usize,
        in_flight: usize,
        gate: Arc<tokio::sync::Notify>,
    ) -> (Batcher<u32, u32>, Sent) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let batches = Arc::clone(&seen);
        let batcher = Batcher::new(limit, in_flight, move |calls: Vec<u32>| {
            batches.lock().unwrap().push(calls.clone());
            let gate = Arc::clone(&gate);
            async move {
                gate.notified().await;
                calls.iter().map(|c| c * 2).collect()
            }
        });
        (batcher, seen)
    }

    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_call_alone_goes_out_at_once_and_calls_during_a_batch_go_in_the_next() {
        let gate = Arc::new(tokio::sync::Notify::new());
        let (batcher, batches) = doubling(100, 1, Arc::clone(&gate));
        let first = tokio::spawn({
            let b = batcher.clone();
            async move { b.call(1).await }
        });
        settle().await;
        assert_eq!(
            *batches.lock().unwrap(),
            vec![vec![1]],
            "sent alone at once"
        );
        let rest: Vec<_> = (2..=5)
            .map(|n| {
                let b = batcher.clone();
                tokio::spawn(async move { b.call(n).await })
            })
            .collect();
        settle().await;
        assert_eq!(
            batches.lock().unwrap().len(),
            1,
            "they wait for the batch in flight"
        );
        gate.notify_one();
        assert_eq!(first.await.unwrap(), Some(2));
        settle().await;
        assert_eq!(
            batches.lock().unwrap()[1],
            vec![2, 3, 4, 5],
            "then go out together"
        );
        gate.notify_one();
        let answers: Vec<_> = futures::future::join_all(rest).await;
        let answers: Vec<_> = answers.into_iter().map(|a| a.unwrap()).collect();
        assert_eq!(answers, vec![Some(4), Some(6), Some(8), Some(10)]);
    }

    #[tokio::test]
    async fn batches_keep_to_their_limit_and_run_side_by_side_up_to_in_flight() {
        let gate = Arc::new(tokio::sync::Notify::new());
        let (batcher, batches) = doubling(2, 2, Arc::clone(&gate));
        let calls: Vec<_> = (1..=5)
            .map(|n| {
                let b = batcher.clone();
                tokio::spawn(async move { b.call(n).await })
            })
            .collect();
        settle().await;
        let running = batches.lock().unwrap().clone();
        assert_eq!(running.len(), 2, "two batches in flight: {running:?}");
        assert!(running.iter().all(|b| b.len() <= 2), "{running:?}");
        for _ in 0..5 {
            gate.notify_waiters();
            settle().await;
        }
        let answers: Vec<_> = futures::future::join_all(calls).await;
        let answers: Vec<_> = answers.into_iter().map(|a| a.unwrap()).collect();
        assert_eq!(answers, vec![Some(2), Some(4), Some(6), Some(8), Some(10)]);
        let all: Vec<u32> = batches.lock().unwrap().concat();
        assert_eq!(all.len(), 5, "each call in exactly one batch: {all:?}");
        assert!(batches.lock().unwrap().iter().all(|b| b.len() <= 2));
    }

    #[tokio::test]
    async fn a_batch_with_too_few_answers_leaves_the_rest_unanswered() {
        let batcher: Batcher<u32, u32> =
            Batcher::new(10, 1, |_calls: Vec<u32>| async { Vec::new() });
        assert_eq!(batcher.call(7).await, None);
    }
}
