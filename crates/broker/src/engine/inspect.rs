//! Reads of a partition's jobs for operators: listing and counting, a bounded
//! slice at a time, so that the caller can release the state between slices and
//! a large partition never holds up apply for long.

use super::{state_of, view_of, State};
use courier_proto::domain::{JobFilter, JobKey, JobStateKind, JobView, TypeStats};
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;

/// Where a slice ended.
#[derive(Debug, PartialEq, Eq)]
pub enum SliceEnd {
    /// The partition's last job was looked at.
    End,
    /// Go on after this key (from the first job when `None`).
    After(Option<JobKey>),
}

impl State {
    /// The jobs after `after` (key order) matching `filter` and of `tenants` (all
    /// when `None`), appended to `out` without their variables and headers,
    /// looking at no more than `budget` jobs and stopping once `out` holds `limit`.
    pub fn list_slice(
        &self,
        filter: &JobFilter,
        tenants: Option<&[String]>,
        after: Option<JobKey>,
        budget: usize,
        limit: usize,
        out: &mut Vec<JobView>,
    ) -> SliceEnd {
        let mut last = after;
        for (n, (key, j)) in self.jobs_after(after).enumerate() {
            if out.len() >= limit || n >= budget {
                return SliceEnd::After(last);
            }
            last = Some(*key);
            if tenants.is_none_or(|t| t.contains(&j.tenant_id))
                && filter.matches(&j.job_type, &j.tenant_id, state_of(j), j.created_at)
            {
                out.push(view_of(j, false));
            }
        }
        SliceEnd::End
    }

    /// Counts the jobs after `after` matching `filter` and of `tenants` into
    /// `stats`, by type and tenant, looking at no more than `budget` jobs.
    pub fn stats_slice(
        &self,
        filter: &JobFilter,
        tenants: Option<&[String]>,
        after: Option<JobKey>,
        budget: usize,
        stats: &mut BTreeMap<(String, String), TypeStats>,
    ) -> SliceEnd {
        // Counted under keys borrowed from the jobs, and added to `stats` once per
        // type and tenant at the end: no allocation per job looked at.
        let mut here: HashMap<(&str, &str), TypeStats> = HashMap::new();
        let mut last = after;
        let mut end = SliceEnd::End;
        for (n, (key, j)) in self.jobs_after(after).enumerate() {
            if n >= budget {
                end = SliceEnd::After(last);
                break;
            }
            last = Some(*key);
            if !tenants.is_none_or(|t| t.contains(&j.tenant_id)) {
                continue;
            }
            let state = state_of(j);
            if !filter.matches(&j.job_type, &j.tenant_id, state, j.created_at) {
                continue;
            }
            let s = here
                .entry((j.job_type.as_str(), j.tenant_id.as_str()))
                .or_default();
            s.count(state);
            if state == JobStateKind::Activatable {
                s.oldest_waiting = Some(
                    s.oldest_waiting
                        .map_or(j.created_at, |o| o.min(j.created_at)),
                );
            }
        }
        for ((job_type, tenant_id), counted) in here {
            let (job_type, tenant_id) = (job_type.to_owned(), tenant_id.to_owned());
            stats
                .entry((job_type.clone(), tenant_id.clone()))
                .or_insert_with(|| TypeStats::new(job_type, tenant_id))
                .merge(&counted);
        }
        end
    }

    fn jobs_after(&self, after: Option<JobKey>) -> impl Iterator<Item = (&JobKey, &super::Job)> {
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.jobs.range((from, Bound::Unbounded))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Batch, Changes, LogCommand};
    use courier_proto::domain::{Command, NewJob, PartitionId, ProcessContext, DEFAULT_TENANT};

    fn state_with(types: &[&str]) -> State {
        let mut state = State::new(PartitionId(1));
        let jobs = types
            .iter()
            .map(|t| NewJob {
                job_type: (*t).into(),
                variables: "{\"v\":1}".into(),
                custom_headers: "{}".into(),
                retries: 3,
                tenant_id: DEFAULT_TENANT.into(),
                process: ProcessContext::default(),
            })
            .collect();
        let batch = Batch {
            ts: 1_000,
            commands: vec![LogCommand::client(Command::Create(jobs))],
            on_flushed: Default::default(),
        };
        state.apply_batch(1, &batch, &mut Changes::new());
        state
    }

    /// A listing goes on where its slice stopped (by budget or by limit), leaves
    /// payloads out, and ends with `End`; a tenant the caller lacks hides jobs.
    #[test]
    fn list_slices_resume_where_they_stopped() {
        let state = state_with(&["a", "b", "a", "a", "b"]);
        let filter = JobFilter {
            job_type: Some("a".into()),
            ..JobFilter::default()
        };
        let k = |n| JobKey::new(PartitionId(1), n);
        let mut out = Vec::new();
        assert_eq!(
            state.list_slice(&filter, None, None, 2, 10, &mut out),
            SliceEnd::After(Some(k(2)))
        );
        assert_eq!(out.iter().map(|v| v.key).collect::<Vec<_>>(), [k(1)]);
        assert!(out[0].variables.is_empty());
        assert_eq!(
            state.list_slice(&filter, None, Some(k(2)), 10, 2, &mut out),
            SliceEnd::After(Some(k(3)))
        );
        assert_eq!(
            state.list_slice(&filter, None, Some(k(3)), 10, 10, &mut out),
            SliceEnd::End
        );
        assert_eq!(
            out.iter().map(|v| v.key).collect::<Vec<_>>(),
            [k(1), k(3), k(4)]
        );
        let mut none = Vec::new();
        let other = ["t2".to_string()];
        assert_eq!(
            state.list_slice(&filter, Some(&other), None, 10, 10, &mut none),
            SliceEnd::End
        );
        assert!(none.is_empty());
    }

    /// Statistics count each type's jobs with the oldest waiting one, over slices.
    #[test]
    fn stats_slices_count_by_type_and_tenant() {
        let state = state_with(&["a", "b", "a"]);
        let mut stats = BTreeMap::new();
        let mut from = None;
        while let SliceEnd::After(k) =
            state.stats_slice(&JobFilter::default(), None, from, 1, &mut stats)
        {
            from = k;
        }
        let a = &stats[&("a".to_string(), DEFAULT_TENANT.to_string())];
        assert_eq!(
            (a.activatable, a.activated, a.oldest_waiting),
            (2, 0, Some(1_000))
        );
        assert_eq!(
            stats[&("b".to_string(), DEFAULT_TENANT.to_string())].activatable,
            1
        );
    }
}
