//! What wakes waiting fetches (see `waiters`): Postgres notifications of new tasks, changes of
//! lock state made through any replica, and a slow safety tick.
//!
//! - `LISTEN` on [`INSERT_CHANNEL`] (the insert trigger of `migrate`, or `migrate
//!   --notify-trigger` on Pulp's database) and on Pulp's own [`PULP_CHANNEL`], which pulpcore's
//!   `dispatch()` notifies for every deferred task and its `cancel_task()` for waiting ones.
//! - Redis's change counter (bumped by every release, cancel and requeue, whichever replica made
//!   it), read once per `poll` by each replica: one GET, whatever the number of waiters.
//! - Every `recheck`, a wake-up regardless, so a lost notification never strands a waiter.
//!
//! The broker's own ReleaseLocks, FinishTask, CancelTask and CloseLease wake this replica's
//! waiters directly, without waiting for the poll.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use super::Queue as Waiters;
use crate::locks::Locks;
use crate::shutdown::Shutdown;

/// The channel the insert trigger notifies.
pub const INSERT_CHANNEL: &str = "dispatch_task_inserted";
/// The channel pulpcore's dispatch() and cancel_task() notify.
pub const PULP_CHANNEL: &str = "pulp_worker_wakeup";

/// Wakes `waiters` on every notification on the two channels until shutdown, and signals
/// `inserted` (the lane gauge's cue to check whether the queue became active); does both once
/// whenever it starts listening (again), since what came before was not heard; reconnects when
/// the connection drops. `listening` is sent once, the first time `LISTEN` succeeds, so the
/// server can start answering calls after it (a waiter that came before would see a pass of
/// its own and then a second one for the start of listening).
pub async fn listen(
    postgres_url: String,
    waiters: Arc<Waiters>,
    inserted: Vec<Arc<tokio::sync::Notify>>,
    listening: tokio::sync::oneshot::Sender<()>,
    shutdown: Shutdown,
) {
    let mut backoff = Duration::from_millis(200);
    let mut listening = Some(listening);
    loop {
        match listen_once(
            &postgres_url,
            &waiters,
            &inserted,
            &mut listening,
            &shutdown,
        )
        .await
        {
            Ok(Ended::Shutdown) => return,
            Ok(Ended::Closed) => {
                tracing::warn!("the task notification connection closed; reconnecting");
            }
            Err(e) => {
                tracing::warn!(error = %e, "listening for task notifications failed; retrying (waiting fetches fall back to the safety re-check)");
            }
        }
        waiters.wake();
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.fired() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

enum Ended {
    Shutdown,
    Closed,
}

async fn listen_once(
    postgres_url: &str,
    waiters: &Waiters,
    inserted: &[Arc<tokio::sync::Notify>],
    first_listen: &mut Option<tokio::sync::oneshot::Sender<()>>,
    shutdown: &Shutdown,
) -> Result<Ended, tokio_postgres::Error> {
    let (client, mut connection) =
        tokio_postgres::connect(postgres_url, tokio_postgres::NoTls).await?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let driver = tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            let notified = match message {
                Ok(tokio_postgres::AsyncMessage::Notification(_)) => Ok(()),
                Ok(_) => continue,
                Err(e) => Err(e),
            };
            let failed = notified.is_err();
            if tx.send(notified).is_err() || failed {
                return;
            }
        }
    });
    let listening = client
        .batch_execute(&format!("LISTEN {INSERT_CHANNEL}; LISTEN {PULP_CHANNEL}"))
        .await;
    let outcome = match listening {
        Err(e) => Err(e),
        Ok(()) => {
            // Listening (again): whatever was inserted before this moment was not heard.
            waiters.wake();
            inserted.iter().for_each(|n| n.notify_one());
            if let Some(first) = first_listen.take() {
                // The receiver may have stopped waiting (start-up went on without it).
                let _ = first.send(());
            }
            loop {
                tokio::select! {
                    message = rx.recv() => match message {
                        Some(Ok(())) => {
                            waiters.wake();
                            inserted.iter().for_each(|n| n.notify_one());
                        }
                        Some(Err(e)) => break Err(e),
                        None => break Ok(Ended::Closed),
                    },
                    _ = shutdown.fired() => break Ok(Ended::Shutdown),
                }
            }
        }
    };
    driver.abort();
    outcome
}

/// Wakes `waiters` when Redis's change counter moves (every `poll`), and regardless every
/// `recheck`, until shutdown.
pub async fn tick(
    locks: Locks,
    waiters: Arc<Waiters>,
    poll: Duration,
    recheck: Duration,
    shutdown: Shutdown,
) {
    let mut seen = None;
    let mut since_recheck = Duration::ZERO;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = shutdown.fired() => return,
        }
        since_recheck += poll;
        // A moved counter wakes the longest waiter; with nobody waiting it still ends "known
        // empty", so a long poll arriving next makes a pass of its own.
        if let Ok(now) = locks.change_seq().await {
            if seen.is_some_and(|s| s != now) {
                waiters.wake();
                since_recheck = Duration::ZERO;
            }
            seen = Some(now);
        }
        if waiters.is_empty() {
            since_recheck = Duration::ZERO;
        } else if since_recheck >= recheck {
            since_recheck = Duration::ZERO;
            waiters.wake();
        }
    }
}
