//! Activations a leader has proposed and not yet finished: how many jobs of each
//! (type, tenant) they may take. Leader-local bookkeeping, never in the log.
//!
//! Pollers that ask while a job's activation is still committing would each propose
//! an Activate of their own, and all but one would commit an entry to find nothing.
//! With the claims in flight counted, the leader answers such a poll empty at once
//! when the activatable jobs it could take are all wanted by activations in flight.
//! What those leave behind is announced when they finish (see [`Claims::release`]),
//! so a poll answered that way and parked is woken if the jobs turn out to be free.
//!
//! The claims also know the request ids of the once-only activations in flight: a
//! gateway's repeat of one (its first attempt's answer lost on the way) is proposed
//! whatever the outlook, and answered with the jobs the first attempt takes, rather
//! than answered empty because those are the jobs its own first attempt claimed.

use courier_proto::domain::RequestId;
use std::collections::HashMap;

/// Jobs wanted by activations in flight, per (type, tenant).
#[derive(Debug, Default)]
pub struct Claims {
    /// type -> tenant -> jobs wanted.
    wanted: HashMap<String, HashMap<String, u64>>,
    /// Request ids of the once-only activations in flight, with how many attempts
    /// of each are.
    requests: HashMap<RequestId, u32>,
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

    /// An activation of up to `max` jobs of `job_type` for `tenants` is in flight,
    /// once-only under `request` if it has one.
    pub fn add(
        &mut self,
        job_type: &str,
        tenants: &[String],
        max: u32,
        request: Option<RequestId>,
    ) {
        let of_type = self.wanted.entry(job_type.to_string()).or_default();
        for t in tenants {
            *of_type.entry(t.clone()).or_default() += u64::from(max);
        }
        if let Some(r) = request {
            *self.requests.entry(r).or_default() += 1;
        }
    }

    /// Whether an attempt of the once-only activation `request` is in flight.
    pub fn carries(&self, request: RequestId) -> bool {
        self.requests.contains_key(&request)
    }

    /// That activation is applied (or failed, or its caller went away). The caller
    /// then announces the jobs of these tenants still activatable: the activation may
    /// have taken fewer than it claimed (older jobs of another tenant, a job a
    /// timer took first), and a poll it kept from proposing may be parked on them.
    pub fn release(
        &mut self,
        job_type: &str,
        tenants: &[String],
        max: u32,
        request: Option<RequestId>,
    ) {
        if let Some(r) = request {
            if let Some(n) = self.requests.get_mut(&r) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.requests.remove(&r);
                }
            }
        }
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
        self.wanted.is_empty() && self.requests.is_empty()
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
        c.add("a", &t(&["x"]), 1, None);
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
        c.add("a", &t(&["x"]), 1, None);
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
        c.add("a", &t(&["x"]), 32, None);
        let both = t(&["x", "y"]);
        assert_eq!(c.outlook("a", &both, queued(&[("x", 3)])), Outlook::Claimed);
        assert_eq!(
            c.outlook("a", &both, queued(&[("x", 3), ("y", 1)])),
            Outlook::Jobs
        );
        // A claim of several tenants counts fully against each: it may take all its
        // jobs from any one of them.
        let mut c = Claims::default();
        c.add("a", &both, 2, None);
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
        c.add("a", &t(&["x", "y"]), 4, None);
        c.add("a", &t(&["x"]), 1, None);
        c.release("a", &t(&["x", "y"]), 4, None);
        assert_eq!(
            c.outlook("a", &t(&["x"]), queued(&[("x", 1)])),
            Outlook::Claimed
        );
        assert_eq!(
            c.outlook("a", &t(&["y"]), queued(&[("y", 1)])),
            Outlook::Jobs
        );
        c.release("a", &t(&["x"]), 1, None);
        assert!(c.is_empty());
        // A release without its claim (never happens) does not wrap around.
        c.release("a", &t(&["x"]), 1, None);
        assert!(c.is_empty());
        assert_eq!(
            c.outlook("a", &t(&["x"]), queued(&[("x", 1)])),
            Outlook::Jobs
        );
    }

    #[test]
    fn once_only_activations_in_flight_are_known_by_request_until_all_attempts_end() {
        let mut c = Claims::default();
        let (r, other) = (RequestId(7), RequestId(8));
        assert!(!c.carries(r));
        c.add("a", &t(&["x"]), 2, Some(r));
        c.add("a", &t(&["x"]), 2, Some(r));
        c.add("a", &t(&["x"]), 1, None);
        assert!(c.carries(r));
        assert!(!c.carries(other));
        c.release("a", &t(&["x"]), 2, Some(r));
        assert!(c.carries(r), "one attempt is still in flight");
        c.release("a", &t(&["x"]), 2, Some(r));
        assert!(!c.carries(r));
        c.release("a", &t(&["x"]), 1, None);
        assert!(c.is_empty());
    }
}
