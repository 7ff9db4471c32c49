//! What the workload saw, and the checker that judges it.
//!
//! Every event is stamped with the wall clock in epoch milliseconds. The brokers run
//! on the same machine and stamp each activation with their own wall clock (a job's
//! deadline is that stamp plus its timeout), so an activation can be placed before
//! or after a completion the workload saw acknowledged.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// The wall clock in epoch milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// One job handed to a worker.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub worker: String,
    /// When the leader activated it: the job's deadline less its timeout.
    pub activated_ms: i64,
    /// When the worker's handler got it.
    pub received_ms: i64,
}

#[derive(Default, Debug)]
struct JobHistory {
    /// When its create was acknowledged, if it was.
    created_ms: Option<i64>,
    deliveries: Vec<Delivery>,
    /// Acknowledged completions: (worker, when).
    completions: Vec<(String, i64)>,
    /// A completion was sent whose outcome is unknown (the answer was lost).
    completion_unknown: bool,
    /// The cluster answered NOT_FOUND for it at the end: with `completion_unknown`,
    /// that completion was applied.
    gone: bool,
    /// Outcomes the cluster refused: (worker, what it said).
    refusals: Vec<(String, String)>,
    /// How the cluster held it when the drain gave up on it.
    end_state: Option<String>,
}

impl JobHistory {
    /// What happened to the job, as far as the workload saw it, for a violation.
    fn account(&self) -> String {
        let mut parts = vec![format!("{} deliveries", self.deliveries.len())];
        for (worker, why) in &self.refusals {
            parts.push(format!("{worker}'s outcome refused: {why}"));
        }
        if self.completion_unknown {
            parts.push("a completion of unknown outcome".into());
        }
        parts.push(format!(
            "at the end: {}",
            self.end_state.as_deref().unwrap_or("not looked up")
        ));
        parts.join("; ")
    }

    /// Completed by a completion whose answer was lost: sent, and the job is gone.
    fn done(&self) -> bool {
        self.completion_unknown && self.gone
    }
}

#[derive(Default)]
struct Inner {
    jobs: BTreeMap<i64, JobHistory>,
    creates_unknown: u64,
    creates_refused: u64,
    outcomes_refused: u64,
}

/// Everything the workload saw, shared by its tasks.
#[derive(Default)]
pub struct History(Mutex<Inner>);

impl History {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        // A panic elsewhere cannot leave a history half-written: each update is one
        // push or one assignment.
        let mut inner = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut inner)
    }

    pub fn created(&self, key: i64, at_ms: i64) {
        self.with(|h| h.jobs.entry(key).or_default().created_ms = Some(at_ms));
    }

    /// A create that failed: `unknown` when it may have been applied all the same.
    pub fn create_failed(&self, unknown: bool) {
        self.with(|h| {
            if unknown {
                h.creates_unknown += 1;
            } else {
                h.creates_refused += 1;
            }
        });
    }

    pub fn delivered(&self, key: i64, delivery: Delivery) {
        self.with(|h| h.jobs.entry(key).or_default().deliveries.push(delivery));
    }

    pub fn completed(&self, key: i64, worker: &str, at_ms: i64) {
        self.with(|h| {
            h.jobs
                .entry(key)
                .or_default()
                .completions
                .push((worker.to_string(), at_ms));
        });
    }

    pub fn completion_unknown(&self, key: i64) {
        self.with(|h| h.jobs.entry(key).or_default().completion_unknown = true);
    }

    /// The cluster no longer knows job `key` (NOT_FOUND).
    pub fn gone(&self, key: i64) {
        self.with(|h| h.jobs.entry(key).or_default().gone = true);
    }

    pub fn outcome_refused(&self, key: i64, worker: &str, why: String) {
        self.with(|h| {
            h.outcomes_refused += 1;
            let job = h.jobs.entry(key).or_default();
            job.refusals.push((worker.to_string(), why));
        });
    }

    /// How the cluster holds job `key` after the drain gave up on it, for the report.
    pub fn end_state(&self, key: i64, state: String) {
        self.with(|h| h.jobs.entry(key).or_default().end_state = Some(state));
    }

    /// Acknowledged creates with no acknowledged completion, each with whether a
    /// completion of unknown outcome was sent for it and is not yet known applied.
    pub fn open_jobs(&self) -> Vec<(i64, bool)> {
        self.with(|h| {
            h.jobs
                .iter()
                .filter(|(_, j)| j.created_ms.is_some() && j.completions.is_empty() && !j.done())
                .map(|(&k, j)| (k, j.completion_unknown))
                .collect()
        })
    }

    /// (acknowledged creates, acknowledged completions) so far.
    pub fn progress(&self) -> (usize, usize) {
        self.with(|h| {
            let created = h.jobs.values().filter(|j| j.created_ms.is_some()).count();
            let completed = h
                .jobs
                .values()
                .filter(|j| !j.completions.is_empty())
                .count();
            (created, completed)
        })
    }

    /// Judges the whole history.
    pub fn check(&self) -> Verdict {
        self.with(|h| {
            let mut v = Verdict {
                creates_unknown: h.creates_unknown,
                creates_refused: h.creates_refused,
                outcomes_refused: h.outcomes_refused,
                ..Verdict::default()
            };
            for (&key, job) in &h.jobs {
                check_job(key, job, &mut v);
            }
            v
        })
    }
}

fn check_job(key: i64, job: &JobHistory, v: &mut Verdict) {
    if job.created_ms.is_some() {
        v.creates_acknowledged += 1;
    }
    v.deliveries += job.deliveries.len() as u64;
    let activations: BTreeSet<i64> = job.deliveries.iter().map(|d| d.activated_ms).collect();
    if job.deliveries.len() > 1 {
        v.jobs_delivered_again += 1;
    }
    match job.completions.as_slice() {
        [] if job.done() => v.completed_unknown_outcome += 1,
        [] if job.created_ms.is_some() => v.violations.push(format!(
            "job {key}: its create was acknowledged but it never completed ({})",
            job.account()
        )),
        [] => {}
        [(_, done_ms), rest @ ..] => {
            v.completed += 1;
            if job.created_ms.is_none() {
                v.completed_unacknowledged_creates += 1;
            }
            if !rest.is_empty() {
                let who: Vec<&str> = job.completions.iter().map(|(w, _)| w.as_str()).collect();
                v.violations.push(format!(
                    "job {key}: its completion was acknowledged {} times (to {})",
                    job.completions.len(),
                    who.join(", ")
                ));
            }
            for d in &job.deliveries {
                if d.activated_ms > *done_ms {
                    v.violations.push(format!(
                        "job {key}: activated for {} at {} ms, after its completion was \
                         acknowledged at {done_ms} ms",
                        d.worker, d.activated_ms
                    ));
                } else if d.received_ms > *done_ms {
                    // An activation from before the completion, delivered late (a
                    // frozen process let it go): the worker's outcome is refused.
                    v.late_deliveries += 1;
                }
            }
        }
    }
    v.activations += activations.len() as u64;
}

/// The checker's findings: counts, and every violation found.
#[derive(Default, Debug)]
pub struct Verdict {
    pub creates_acknowledged: u64,
    pub creates_unknown: u64,
    pub creates_refused: u64,
    pub completed: u64,
    /// Jobs completed by a completion whose answer was lost: it was sent, and the
    /// cluster no longer knows the job.
    pub completed_unknown_outcome: u64,
    /// Jobs completed whose create was not acknowledged (it failed with an unknown
    /// outcome and was applied all the same).
    pub completed_unacknowledged_creates: u64,
    pub activations: u64,
    pub deliveries: u64,
    pub jobs_delivered_again: u64,
    /// Deliveries of an activation made before the job's completion was
    /// acknowledged, received after it.
    pub late_deliveries: u64,
    pub outcomes_refused: u64,
    pub violations: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(worker: &str, activated_ms: i64, received_ms: i64) -> Delivery {
        Delivery {
            worker: worker.into(),
            activated_ms,
            received_ms,
        }
    }

    #[test]
    fn a_clean_history_has_no_violation() {
        let h = History::default();
        h.created(1, 10);
        h.delivered(1, delivery("a", 11, 12));
        // Timed out, activated again, completed by the second holder.
        h.delivered(1, delivery("b", 40, 41));
        h.completed(1, "b", 45);
        let v = h.check();
        assert!(v.violations.is_empty(), "{:?}", v.violations);
        assert_eq!(
            (
                v.creates_acknowledged,
                v.completed,
                v.activations,
                v.jobs_delivered_again
            ),
            (1, 1, 2, 1)
        );
    }

    #[test]
    fn an_acknowledged_create_never_completed_is_a_violation() {
        let h = History::default();
        h.created(1, 10);
        h.delivered(1, delivery("a", 11, 12));
        let v = h.check();
        assert_eq!(v.violations.len(), 1, "{:?}", v.violations);
        assert!(v.violations[0].contains("never completed"));
    }

    #[test]
    fn an_activation_after_the_acknowledged_completion_is_a_violation() {
        let h = History::default();
        h.created(1, 10);
        h.delivered(1, delivery("a", 11, 12));
        h.completed(1, "a", 20);
        h.delivered(1, delivery("b", 21, 22));
        let v = h.check();
        assert_eq!(v.violations.len(), 1, "{:?}", v.violations);
        assert!(v.violations[0].contains("after its completion"));
    }

    #[test]
    fn a_completion_acknowledged_twice_is_a_violation() {
        let h = History::default();
        h.created(1, 10);
        h.completed(1, "a", 20);
        h.completed(1, "b", 21);
        let v = h.check();
        assert_eq!(v.violations.len(), 1, "{:?}", v.violations);
        assert!(v.violations[0].contains("acknowledged 2 times"));
    }

    #[test]
    fn a_late_delivery_of_an_earlier_activation_is_counted_not_condemned() {
        let h = History::default();
        h.created(1, 10);
        h.delivered(1, delivery("a", 11, 12));
        h.completed(1, "a", 20);
        h.delivered(1, delivery("b", 15, 30));
        let v = h.check();
        assert!(v.violations.is_empty(), "{:?}", v.violations);
        assert_eq!(v.late_deliveries, 1);
    }

    #[test]
    fn a_completion_whose_answer_was_lost_counts_once_the_job_is_gone() {
        let h = History::default();
        h.created(1, 10);
        h.delivered(1, delivery("a", 11, 12));
        h.completion_unknown(1);
        assert_eq!(h.open_jobs(), vec![(1, true)]);
        assert_eq!(h.check().violations.len(), 1, "not known to be applied yet");
        h.gone(1);
        assert!(h.open_jobs().is_empty());
        let v = h.check();
        assert!(v.violations.is_empty(), "{:?}", v.violations);
        assert_eq!(v.completed_unknown_outcome, 1);
    }

    #[test]
    fn a_job_gone_without_any_completion_sent_is_still_lost() {
        let h = History::default();
        h.created(1, 10);
        h.gone(1);
        assert_eq!(h.check().violations.len(), 1);
    }

    #[test]
    fn a_job_whose_create_outcome_was_unknown_may_complete() {
        let h = History::default();
        h.create_failed(true);
        h.delivered(7, delivery("a", 11, 12));
        h.completed(7, "a", 20);
        let v = h.check();
        assert!(v.violations.is_empty(), "{:?}", v.violations);
        assert_eq!((v.completed, v.completed_unacknowledged_creates), (1, 1));
    }
}
