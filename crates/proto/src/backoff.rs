//! Full-jitter exponential back-off, the one implementation every retry loop uses:
//! gateways' request retries and link reconnects, clients' call retries and
//! workers' pacing.
//!
//! Full jitter (a uniform pick in `[0, ceiling]`) rather than a fixed step, so that
//! processes that lost a peer at the same moment do not come back in lockstep.

use rand::Rng;
use std::time::Duration;

/// The shape of a back-off: the ceiling of the first delay, doubled per attempt up
/// to `cap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Ceiling of the first delay.
    pub base: Duration,
    /// No delay is ever longer than this.
    pub cap: Duration,
}

impl Backoff {
    /// A back-off whose first ceiling is `base`, never above `cap`.
    pub const fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff { base, cap }
    }

    /// The longest delay before retry number `attempt` (0-based): `base * 2^attempt`,
    /// at most `cap`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        self.base
            .saturating_mul(2u32.saturating_pow(attempt))
            .min(self.cap)
    }

    /// A delay drawn uniformly from `[0, ceiling(attempt)]`.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = u64::try_from(self.ceiling(attempt).as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.random_range(0..=ceiling))
    }

    /// A retry loop's state, starting at attempt 0.
    pub fn attempts(self) -> Attempts {
        Attempts {
            backoff: self,
            attempt: 0,
        }
    }
}

/// One retry loop's place in its [`Backoff`].
#[derive(Clone, Debug)]
pub struct Attempts {
    backoff: Backoff,
    attempt: u32,
}

impl Attempts {
    /// The ceiling of the next delay.
    pub fn ceiling(&self) -> Duration {
        self.backoff.ceiling(self.attempt)
    }

    /// The next delay, uniformly in `[0, ceiling]`; advances the ceiling.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.backoff.delay(self.attempt, &mut rand::rng());
        self.attempt = self.attempt.saturating_add(1);
        d
    }

    /// Starts again from `base` (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn ceilings_double_up_to_the_cap_and_never_overflow() {
        let b = Backoff::new(Duration::from_millis(25), Duration::from_secs(2));
        let ms: Vec<u128> = (0..10).map(|a| b.ceiling(a).as_millis()).collect();
        assert_eq!(ms, [25, 50, 100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        assert_eq!(b.ceiling(200), Duration::from_secs(2));
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(2));
    }

    #[test]
    fn delays_spread_over_the_whole_range() {
        let b = Backoff::new(Duration::from_millis(25), Duration::from_secs(2));
        let mut rng = StdRng::seed_from_u64(7);
        for attempt in [0, 3, 20] {
            let ceiling = b.ceiling(attempt);
            let delays: Vec<Duration> = (0..2000).map(|_| b.delay(attempt, &mut rng)).collect();
            assert!(delays.iter().all(|d| *d <= ceiling));
            // Full jitter: both ends of [0, ceiling] are visited, not just its middle.
            assert!(delays.iter().any(|d| *d < ceiling / 10));
            assert!(delays.iter().any(|d| *d > ceiling * 9 / 10));
        }
    }

    #[test]
    fn a_retry_loop_climbs_its_ceilings_and_starts_again_after_a_reset() {
        let base = Duration::from_millis(10);
        let cap = Duration::from_millis(500);
        let mut a = Backoff::new(base, cap).attempts();
        for ms in [10u64, 20, 40, 80, 160, 320, 500, 500, 500] {
            assert_eq!(a.ceiling(), Duration::from_millis(ms));
            assert!(a.next_delay() <= Duration::from_millis(ms));
        }
        for _ in 0..1000 {
            assert!(a.next_delay() <= cap);
        }
        a.reset();
        assert_eq!(a.ceiling(), base);
    }
}
