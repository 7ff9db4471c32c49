//! Operators' reads of a partition: its jobs listed and counted by the leader,
//! a slice at a time under the state's read lock (so apply waits at most one
//! slice), after a read barrier that makes them linearizable.

use super::Partition;
use crate::engine::SliceEnd;
use courier_proto::domain::{BrokerError, JobFilter, JobKey, Reply, TypeStats};
use courier_proto::sync::lock;
use std::collections::BTreeMap;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

/// Jobs looked at under one hold of the state's read lock.
const SLICE: usize = 4096;
/// Jobs one listing call looks at, at most: a sparse filter over a large
/// partition answers a short page with a cursor rather than scan it all.
const LIST_BUDGET: usize = 16 * SLICE;
/// Most jobs in one page.
pub const MAX_LIST: u32 = 1000;
/// Seconds the activation rate is taken over.
const RATE_WINDOW: usize = 10;

/// Jobs activated (pushed or polled) per type and tenant in each of the last
/// [`RATE_WINDOW`] seconds, counted by this replica while it leads.
pub struct ActivationRate {
    started: Instant,
    /// Job type -> tenant -> its window.
    by: Mutex<HashMap<String, Vec<(String, Window)>>>,
}

struct Window {
    /// The second (since `started`) of `counts[second % RATE_WINDOW]`'s newest.
    second: u64,
    counts: [u32; RATE_WINDOW],
}

impl Window {
    /// Clears the seconds between the last counted and `now`.
    fn advance(&mut self, now: u64) {
        if now <= self.second {
            return;
        }
        let gone = (now - self.second).min(RATE_WINDOW as u64);
        for s in 1..=gone {
            self.counts[((self.second + s) % RATE_WINDOW as u64) as usize] = 0;
        }
        self.second = now;
    }
}

impl Default for ActivationRate {
    fn default() -> Self {
        ActivationRate {
            started: Instant::now(),
            by: Mutex::default(),
        }
    }
}

impl ActivationRate {
    /// Counts `n` jobs of `job_type` and `tenant` activated now.
    pub fn add(&self, job_type: &str, tenant: &str, n: u32) {
        let now = self.started.elapsed().as_secs();
        let mut by = lock(&self.by);
        // Strings are allocated only for a pair not seen before.
        let tenants = match by.get_mut(job_type) {
            Some(t) => t,
            None => by.entry(job_type.to_string()).or_default(),
        };
        let i = match tenants.iter().position(|(t, _)| t == tenant) {
            Some(i) => i,
            None => {
                let fresh = Window {
                    second: now,
                    counts: [0; RATE_WINDOW],
                };
                tenants.push((tenant.to_string(), fresh));
                tenants.len() - 1
            }
        };
        let w = &mut tenants[i].1;
        w.advance(now);
        let slot = &mut w.counts[(now % RATE_WINDOW as u64) as usize];
        *slot = slot.saturating_add(n);
    }

    /// Activations per second of `job_type` and `tenant` over the last
    /// [`RATE_WINDOW`] whole seconds.
    fn per_second(&self, job_type: &str, tenant: &str) -> f64 {
        let now = self.started.elapsed().as_secs();
        let mut by = lock(&self.by);
        let Some((_, w)) = by
            .get_mut(job_type)
            .and_then(|t| t.iter_mut().find(|(t, _)| t == tenant))
        else {
            return 0.0;
        };
        w.advance(now);
        let current = (now % RATE_WINDOW as u64) as usize;
        let done: u64 = (0..RATE_WINDOW)
            .filter(|&i| i != current)
            .map(|i| u64::from(w.counts[i]))
            .sum();
        done as f64 / (RATE_WINDOW - 1) as f64
    }
}

impl ActivationRate {
    /// The job types and tenants activated within the window.
    fn recent(&self) -> Vec<(String, String)> {
        let now = self.started.elapsed().as_secs();
        let mut by = lock(&self.by);
        let mut out = Vec::new();
        for (job_type, tenants) in by.iter_mut() {
            for (tenant, w) in tenants.iter_mut() {
                w.advance(now);
                if w.counts.iter().any(|&c| c > 0) {
                    out.push((job_type.clone(), tenant.clone()));
                }
            }
        }
        out
    }
}

impl Partition {
    /// Waits until this replica has applied everything committed when it was
    /// asked, having checked with a majority that it still leads.
    async fn read_barrier(self: &Arc<Self>) -> Result<(), BrokerError> {
        self.check_leader()?;
        self.raft.ensure_linearizable().await.map_err(|e| {
            BrokerError::Unavailable(format!(
                "partition {} cannot serve a consistent read now: {e}",
                self.id
            ))
        })?;
        Ok(())
    }

    /// A page of the jobs matching `filter` after `after` (see
    /// [`courier_proto::domain::Request::ListJobs`]).
    pub async fn list_jobs(
        self: &Arc<Self>,
        filter: &JobFilter,
        after: Option<JobKey>,
        limit: u32,
        tenants: Option<&[String]>,
    ) -> Result<Reply, BrokerError> {
        self.read_barrier().await?;
        let limit = limit.clamp(1, MAX_LIST) as usize;
        let mut jobs = Vec::new();
        let mut from = after;
        let mut looked = 0;
        loop {
            let end = self
                .shared
                .read()
                .state
                .list_slice(filter, tenants, from, SLICE, limit, &mut jobs);
            looked += SLICE;
            match end {
                SliceEnd::End => return Ok(Reply::Jobs { jobs, resume: None }),
                SliceEnd::After(k) if jobs.len() >= limit || looked >= LIST_BUDGET => {
                    return Ok(Reply::Jobs {
                        jobs,
                        resume: k.or(after).or(Some(JobKey::new(self.id, 0))),
                    });
                }
                SliceEnd::After(k) => from = k,
            }
            tokio::task::yield_now().await;
        }
    }

    /// Counts of the jobs matching `filter` by type and tenant, with the
    /// activation rate and the streams registered for each.
    pub async fn job_stats(
        self: &Arc<Self>,
        filter: &JobFilter,
        tenants: Option<&[String]>,
    ) -> Result<Reply, BrokerError> {
        self.read_barrier().await?;
        let mut stats = BTreeMap::new();
        let mut from = None;
        loop {
            let end = self
                .shared
                .read()
                .state
                .stats_slice(filter, tenants, from, SLICE, &mut stats);
            match end {
                SliceEnd::End => break,
                SliceEnd::After(k) => from = k,
            }
            tokio::task::yield_now().await;
        }
        // A type whose jobs are all taken as they come has none to count, but
        // its workers are busy: it is shown with its rate, unless the filter asks
        // for jobs in some state or created in some time.
        let about_jobs = !filter.states.is_empty()
            || filter.created_after.is_some()
            || filter.created_before.is_some();
        if !about_jobs {
            for (job_type, tenant) in self.activations.recent() {
                let wanted = filter.job_type.as_ref().is_none_or(|t| *t == job_type)
                    && (filter.tenants.is_empty() || filter.tenants.contains(&tenant))
                    && tenants.is_none_or(|t| t.contains(&tenant));
                if wanted {
                    stats
                        .entry((job_type.clone(), tenant.clone()))
                        .or_insert_with(|| TypeStats::new(job_type, tenant));
                }
            }
        }
        let mut out: Vec<TypeStats> = stats.into_values().collect();
        for s in &mut out {
            s.activations_per_second = self.activations.per_second(&s.job_type, &s.tenant_id);
            s.streams = self.registry.streams_by_gateway(&s.job_type, &s.tenant_id);
        }
        Ok(Reply::Stats(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rate counts whole past seconds, forgets those that left the window, and
    /// keeps type and tenant apart.
    #[tokio::test(start_paused = true)]
    async fn the_activation_rate_counts_the_last_seconds() {
        let rate = ActivationRate::default();
        rate.add("a", "t", 9);
        rate.add("b", "t", 100);
        assert_eq!(
            rate.per_second("a", "t"),
            0.0,
            "the current second is not whole"
        );
        tokio::time::advance(std::time::Duration::from_secs(1)).await;
        assert_eq!(rate.per_second("a", "t"), 1.0);
        assert_eq!(rate.per_second("a", "u"), 0.0);
        rate.add("a", "t", 18);
        tokio::time::advance(std::time::Duration::from_secs(1)).await;
        assert_eq!(rate.per_second("a", "t"), 3.0);
        let mut recent = rate.recent();
        recent.sort();
        assert_eq!(recent, [("a".into(), "t".into()), ("b".into(), "t".into())]);
        tokio::time::advance(std::time::Duration::from_secs(30)).await;
        assert_eq!(rate.per_second("a", "t"), 0.0);
        assert!(
            rate.recent().is_empty(),
            "nothing activated within the window"
        );
    }
}
