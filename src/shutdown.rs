//! One shutdown signal for the server, the background loops and waiting calls.

use tokio::sync::watch;

/// Fires once; every clone observes it.
#[derive(Clone, Debug)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
}

/// Triggers a [`Shutdown`].
#[derive(Debug)]
pub struct Trigger {
    tx: watch::Sender<bool>,
}

/// A new shutdown signal and its trigger.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger { tx }, Shutdown { rx })
}

impl Trigger {
    /// Signals shutdown to every observer.
    pub fn fire(&self) {
        let _ = self.tx.send(true);
    }
}

impl Shutdown {
    /// True once shutdown was signalled.
    pub fn is_fired(&self) -> bool {
        *self.rx.borrow()
    }

    /// Completes when shutdown is signalled (at once if it already was, or if the trigger is
    /// gone).
    pub async fn fired(&self) {
        let mut rx = self.rx.clone();
        let _ = rx.wait_for(|fired| *fired).await;
    }
}

/// Completes on SIGTERM or SIGINT.
pub async fn os_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
