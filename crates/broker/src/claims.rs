//! Activations a leader has proposed and not yet finished: how many jobs of each
//! (type, tenant) they may take. Leader-local bookkeeping, never in the log.
//!
//! Pollers that ask while a job's activation is still committing would each propose
//! an Activate of their own, and all but one would commit an entry to find nothing.
//! With the claims in flight counted, the leader answers such a poll empty at once
//! when the activatable jobs it could take are all wanted by activations in flight.
//! What those leave behind is announced when they finish (see [`Claims::release`]),
//! so a poll answered that way and parked is woken if the jobs turn out to be free.

use std::collections::HashMap;

/// Jobs wanted by activations in flight, per (type, tenant).
#[derive(Debug, Default)]
pub struct Claims {
    /// type -> tenant -> jobs wanted.
    wanted: HashMap<String, HashMap<String, u64>>,
}

/// What an Activate would find, read from the leader's applied state and the claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outlook {
    /// No activatable job of the type for these tenants.
    Nothing,
    /// Jobs there are, but activations in flight want at least as many.
    Claimed,
    /// Jobs no activation in flight wants: propose.
    Jobs,
}

impl Claims {
    /// What an Activate of `job_type` for `tenants` would find, where `queued` gives
    /// the activatable jobs of a tenant. A tenant counts as claimed when activations
    /// in flight that may take its jobs want at least as many as it has.
    pub fn outlook(
        &self,
        job_type: &str,
        tenants: &[String],
        queued: impl Fn(&str) -> usize,
    ) -> Outlook {
        let mut any = false;
        for t in tenants {
            let n = queued(t) as u64;
            if n == 0 {
                continue;
            }
            any = true;
            if n > self.wanted(job_type, t) {
                return Outlook::Jobs;
            }
        }
        if any {
            Outlook::Claimed
        } else {
            Outlook::Nothing
        }
    }

    /// An activation of up to `max` jobs of `job_type` for `tenants` is in flight.
    pub fn add(&mut self, job_type: &str, tenants: &[String], max: u32) {
        let of_type = self.wanted.entry(job_type.to_string()).or_default();
        for t in tenants {
            *of_type.entry(t.clone()).or_default() += u64::from(max);
        }
    }

    /// That activation is applied (or failed, or its caller went away). The caller
    /// then announces the jobs of these tenants still activatable: the activation may
    /// have taken fewer than it claimed (older jobs of another tenant, a job a
    /// timer took first), and a poll it kept from proposing may be parked on them.
    pub fn release(&mut self, job_type: &str, tenants: &[String], max: u32) {
        let Some(of_type) = self.wanted.get_mut(job_type) else {
            return;
        };
        for t in tenants {
            if let Some(n) = of_type.get_mut(t) {
                *n = n.saturating_sub(u64::from(max));
                if *n == 0 {
                    of_type.remove(t);
                }
            }
        }
        if of_type.is_empty() {
            self.wanted.remove(job_type);
        }
    }

    fn wanted(&self, job_type: &str, tenant: &str) -> u64 {
        self.wanted
            .get(job_type)
            .and_then(|of_type| of_type.get(tenant))
            .copied()
            .unwrap_or(0)
    }

    /// Whether no activation is in flight.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.wanted.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn queued<'a>(q: &'a [(&'a str, usize)]) -> impl Fn(&str) -> usize + 'a {
        move |tenant| q.iter().find(|(t, _)| *t == tenant).map_or(0, |(_, n)| *n)
    }

    #[test]
    fn with_no_activation_in_flight_jobs_are_proposed_for() {
        let c = Claims::default();
        assert_eq!(c.outlook("a", &t(&["x"]), queued(&[])), Outlook::Nothing);
        assert_eq!(
            c.outlook("a", &t(&["x"]), queued(&[("x", 1)])),
            Outlook::Jobs
        );
        assert_eq!(
            c.outlook("a", &t(&["x"]), queued(&[("y", 5)])),
            Outlook::Nothing,
            "another tenant's jobs are not this poll's"
        );
    }

    #[test]
    fn jobs_all_claimed_by_activations_in_flight_are_left_to_them() {
        let mut c = Claims::default();
        c.add("a", &t(&["x"]), 1);
        assert_eq!(
            c.outlook("a", &t(&["x"]), queued(&[("x", 1)])),
            Outlook::Claimed
        );
        // One more job than claimed: propose.
        assert_eq!(
            c.outlook("a", &t(&["x"]), queued(&[("x", 2)])),
            Outlook::Jobs
        );
        // Claims add up.
        c.add("a", &t(&["x"]), 1);
        assert_eq!(
            c.outlook("a", &t(&["x"]), queued(&[("x", 2)])),
            Outlook::Claimed
        );
        // Another type, or another tenant, is not claimed.
        assert_eq!(
            c.outlook("b", &t(&["x"]), queued(&[("x", 1)])),
            Outlook::Jobs
        );
        assert_eq!(
            c.outlook("a", &t(&["y"]), queued(&[("y", 1)])),
            Outlook::Jobs
        );
    }

    #[test]
    fn a_poll_of_several_tenants_proposes_when_any_tenant_has_unclaimed_jobs() {
        let mut c = Claims::default();
        c.add("a", &t(&["x"]), 32);
        let both = t(&["x", "y"]);
        assert_eq!(c.outlook("a", &both, queued(&[("x", 3)])), Outlook::Claimed);
        assert_eq!(
            c.outlook("a", &both, queued(&[("x", 3), ("y", 1)])),
            Outlook::Jobs
        );
        // A claim of several tenants counts fully against each: it may take all its
        // jobs from any one of them.
        let mut c = Claims::default();
        c.add("a", &both, 2);
        assert_eq!(
            c.outlook("a", &t(&["y"]), queued(&[("y", 2)])),
            Outlook::Claimed
        );
        assert_eq!(
            c.outlook("a", &t(&["x"]), queued(&[("x", 2)])),
            Outlook::Claimed
        );
    }

    #[test]
    fn released_claims_leave_nothing_behind() {
        let mut c = Claims::default();
        c.add("a", &t(&["x", "y"]), 4);
        c.add("a", &t(&["x"]), 1);
        c.release("a", &t(&["x", "y"]), 4);
        assert_eq!(
            c.outlook("a", &t(&["x"]), queued(&[("x", 1)])),
            Outlook::Claimed
        );
        assert_eq!(
            c.outlook("a", &t(&["y"]), queued(&[("y", 1)])),
            Outlook::Jobs
        );
        c.release("a", &t(&["x"]), 1);
        assert!(c.is_empty());
        // A release without its claim (never happens) does not wrap around.
        c.release("a", &t(&["x"]), 1);
        assert!(c.is_empty());
        assert_eq!(
            c.outlook("a", &t(&["x"]), queued(&[("x", 1)])),
            Outlook::Jobs
        );
    }
}
