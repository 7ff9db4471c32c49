//! When the worker tries again: after an error, after an empty poll, before
//! reopening its stream. Every delay is jittered, so workers refused or restarted
//! together do not come back together.

use crate::retry::Backoff;
use rand::Rng;
use std::time::Duration;

/// The least and the most a worker waits between tries.
pub(crate) const PACE: Backoff = Backoff {
    base: Duration::from_millis(50),
    cap: Duration::from_secs(5),
};

/// An exponential ramp of delay ceilings, from 50 ms doubling to 5 s: it climbs
/// while tries keep failing (or polls keep coming back empty) and drops back to the
/// bottom when one succeeds.
#[derive(Debug, Default)]
pub(crate) struct Ramp {
    attempt: u32,
}

impl Ramp {
    /// The current ceiling.
    pub(crate) fn ceiling(&self) -> Duration {
        PACE.ceiling(self.attempt)
    }

    /// A delay in `[0, ceiling]` (full jitter): for retries after errors, where the
    /// point is to spread clients out.
    pub(crate) fn full_jitter(&self, rng: &mut impl Rng) -> Duration {
        PACE.delay(self.attempt, rng)
    }

    /// A delay in `[ceiling / 2, ceiling]` (equal jitter): for the poll beside a
    /// healthy stream, whose wait is also the time push gets to fill freed room
    /// first. Full jitter would sometimes poll at once and race the push for it.
    pub(crate) fn equal_jitter(&self, rng: &mut impl Rng) -> Duration {
        let half = self.ceiling() / 2;
        half + Backoff {
            base: half,
            cap: half,
        }
        .delay(0, rng)
    }

    /// One more failure (or empty poll): the next ceiling doubles, up to the cap.
    pub(crate) fn grow(&mut self) {
        // Past 2^7 the ceiling is the cap anyway; stopping there keeps `attempt` small.
        if self.ceiling() < PACE.cap {
            self.attempt += 1;
        }
    }

    /// A success: back to the bottom.
    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn ceilings_climb_from_50ms_to_5s_and_reset() {
        let mut r = Ramp::default();
        let mut ceilings = Vec::new();
        for _ in 0..12 {
            ceilings.push(r.ceiling().as_millis());
            r.grow();
        }
        assert_eq!(
            ceilings,
            [50, 100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000, 5000]
        );
        r.reset();
        assert_eq!(r.ceiling(), Duration::from_millis(50));
    }

    #[test]
    fn delays_stay_in_their_ranges_and_spread() {
        let mut rng = StdRng::seed_from_u64(4);
        let mut r = Ramp::default();
        for _ in 0..9 {
            let c = r.ceiling();
            let full: Vec<Duration> = (0..1000).map(|_| r.full_jitter(&mut rng)).collect();
            let equal: Vec<Duration> = (0..1000).map(|_| r.equal_jitter(&mut rng)).collect();
            assert!(full.iter().all(|d| *d <= c));
            assert!(full.iter().any(|d| *d < c / 10));
            assert!(equal.iter().all(|d| *d >= c / 2 && *d <= c));
            assert!(equal.iter().any(|d| *d < c * 6 / 10));
            assert!(equal.iter().any(|d| *d > c * 9 / 10));
            r.grow();
        }
    }
}
