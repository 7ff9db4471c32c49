//! Full-jitter exponential back-off, shared by request retries and link reconnects.
//!
//! Full jitter (a uniform pick in `[0, ceiling]`) rather than a fixed step, so that
//! gateways that lost a broker at the same moment do not come back in lockstep.

use rand::Rng;
use std::time::Duration;

/// Back-off state for one retry loop: the ceiling doubles per attempt up to `cap`.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    /// A back-off whose first ceiling is `base`, never above `cap`.
    pub fn new(base: Duration, cap: Duration) -> Self {
        Backoff {
            base,
            cap,
            attempt: 0,
        }
    }

    /// The ceiling of the next delay: `base * 2^attempt`, at most `cap`.
    pub fn ceiling(&self) -> Duration {
        // Past 2^20 the product exceeds any sane cap; stop doubling there.
        let factor = 1u32 << self.attempt.min(20);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The next delay, uniformly in `[0, ceiling]`; advances the ceiling.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rand::rng().random_range(0..=nanos))
    }

    /// Starts again from `base` (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_under_a_doubling_ceiling_up_to_the_cap() {
        let base = Duration::from_millis(10);
        let cap = Duration::from_millis(500);
        let mut b = Backoff::new(base, cap);
        let expected = [10u64, 20, 40, 80, 160, 320, 500, 500, 500];
        for ms in expected {
            assert_eq!(b.ceiling(), Duration::from_millis(ms));
            let d = b.next_delay();
            assert!(d <= Duration::from_millis(ms), "{d:?} > {ms} ms");
        }
        for _ in 0..100 {
            assert!(b.next_delay() <= cap);
        }
        b.reset();
        assert_eq!(b.ceiling(), base);
    }

    #[test]
    fn delays_are_jittered_not_fixed() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let first = b.next_delay();
        assert!((0..50).any(|_| b.next_delay() != first));
    }

    #[test]
    fn many_attempts_do_not_overflow() {
        let mut b = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
        for _ in 0..1000 {
            assert!(b.next_delay() <= Duration::from_secs(2));
        }
    }
}
