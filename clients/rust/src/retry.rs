//! When and how long the worker waits before trying a call again: pure decisions.

use std::time::Duration;

use tonic::Code;

/// Jittered exponential backoff for `UNAVAILABLE` and `RESOURCE_EXHAUSTED` (`retryable`): the n-th
/// retry waits between half and all of `initial * 2^n` (at most `max`), until `max_elapsed` has
/// passed since the first try: the tries count, not only the waits (a try that waits for its
/// deadline takes `call_timeout`), so a call gives up within `max_elapsed` and one try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The first wait (before jitter).
    pub initial: Duration,
    /// The longest single wait.
    pub max: Duration,
    /// Give up once this much has passed since the first try.
    pub max_elapsed: Duration,
}

impl Default for RetryPolicy {
    /// 100 ms doubling to 5 s, for up to a minute: a broker restart or a rolling deploy.
    fn default() -> Self {
        RetryPolicy {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(5),
            max_elapsed: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// No retries at all.
    pub fn none() -> Self {
        RetryPolicy {
            max_elapsed: Duration::ZERO,
            ..RetryPolicy::default()
        }
    }

    /// The same policy, giving up after at most `limit` of waiting.
    pub fn within(self, limit: Duration) -> Self {
        RetryPolicy {
            max_elapsed: self.max_elapsed.min(limit),
            ..self
        }
    }

    /// The wait before retry number `attempt` (0-based), `elapsed` after the first try began,
    /// with `jitter` in [0, 1) picking a point in the upper half; `None` when the budget is spent.
    pub fn delay(&self, attempt: u32, elapsed: Duration, jitter: f64) -> Option<Duration> {
        let full = self
            .initial
            .saturating_mul(2u32.saturating_pow(attempt.min(20)))
            .min(self.max);
        let delay = full / 2 + full.mul_f64(jitter.clamp(0.0, 1.0) / 2.0);
        let left = self.max_elapsed.checked_sub(elapsed)?;
        if left.is_zero() {
            return None;
        }
        Some(delay.min(left))
    }
}

/// Retried: `UNAVAILABLE` (the broker or its backends could not be reached, and the call changed
/// nothing) and `RESOURCE_EXHAUSTED` (a limit of the broker was reached: too many waiting fetches,
/// or the call was shed; it did nothing, and backing off is what the broker asks for). Every other
/// status is the broker's answer (`FAILED_PRECONDITION`: this worker no longer holds the task;
/// `NOT_FOUND`: reopen the lease; ...) and repeating it cannot help.
pub fn retryable(code: Code) -> bool {
    matches!(code, Code::Unavailable | Code::ResourceExhausted)
}

/// Retried for a call that may be made again when its answer was lost (OpenLease, which carries
/// an open id; StartTask, which the broker answers alike when the start was made): what
/// [`retryable`] names, and `DEADLINE_EXCEEDED` and `CANCELLED` (no answer in
/// time; the broker answers `CANCELLED`, "Timeout expired", when the deadline passed there).
pub fn repeatable(code: Code) -> bool {
    retryable(code) || matches!(code, Code::DeadlineExceeded | Code::Cancelled)
}

/// `period` moved by up to ±10% (`jitter` in [0, 1)), so a fleet's heartbeats spread out.
pub fn jitter(period: Duration, jitter: f64) -> Duration {
    period.mul_f64(0.9 + 0.2 * jitter.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn only_unavailable_and_resource_exhausted_are_retried() {
        assert!(retryable(Code::Unavailable));
        assert!(retryable(Code::ResourceExhausted));
        for code in [
            Code::FailedPrecondition,
            Code::NotFound,
            Code::InvalidArgument,
            Code::DeadlineExceeded,
            Code::Unauthenticated,
            Code::Internal,
        ] {
            assert!(!retryable(code), "{code:?}");
        }
    }

    #[test]
    fn a_repeatable_call_is_also_retried_when_no_answer_came() {
        for code in [
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
            Code::Cancelled,
        ] {
            assert!(repeatable(code), "{code:?}");
        }
        for code in [
            Code::FailedPrecondition,
            Code::NotFound,
            Code::InvalidArgument,
            Code::Unknown,
            Code::Internal,
        ] {
            assert!(!repeatable(code), "{code:?}");
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_stops_at_the_budget() {
        let p = RetryPolicy {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(1000),
            max_elapsed: Duration::from_millis(2500),
        };
        let full = |a| p.delay(a, Duration::ZERO, 0.999_999).unwrap();
        assert!(full(0) <= Duration::from_millis(100));
        assert!(full(1) > Duration::from_millis(190) && full(1) <= Duration::from_millis(200));
        assert!(full(5) <= Duration::from_millis(1000));
        assert_eq!(
            p.delay(0, Duration::ZERO, 0.0),
            Some(Duration::from_millis(50))
        );
        // The last wait is cut to what is left of the budget; then none.
        assert_eq!(
            p.delay(9, Duration::from_millis(2400), 0.999),
            Some(Duration::from_millis(100))
        );
        assert_eq!(p.delay(9, Duration::from_millis(2500), 0.5), None);
        assert_eq!(RetryPolicy::none().delay(0, Duration::ZERO, 0.5), None);
    }

    proptest! {
        #[test]
        fn waits_stay_within_half_and_all_of_the_step(attempt in 0u32..64, jitter in 0.0f64..1.0) {
            let p = RetryPolicy::default();
            let d = p.delay(attempt, Duration::ZERO, jitter).unwrap();
            let step = p.initial.saturating_mul(2u32.saturating_pow(attempt.min(20))).min(p.max);
            prop_assert!(d >= step / 2 && d <= step);
        }

        #[test]
        fn heartbeat_jitter_stays_within_ten_percent(j in 0.0f64..1.0) {
            let d = jitter(Duration::from_secs(10), j);
            prop_assert!(d >= Duration::from_secs(9) && d <= Duration::from_secs(11));
        }
    }
}
