//! Operators' reads and bulk changes: jobs listed and counted on every
//! partition's leader and merged here, and retries or cancels over a filter.

use super::*;
use courier_proto::domain::{JobFilter, JobView, TypeStats};
use std::collections::BTreeMap;

/// A page when the caller names no limit.
const DEFAULT_PAGE: u32 = 100;
/// Most jobs in one page or one bulk call.
const MAX_PAGE: u32 = 1000;
/// Bulk changes in flight at once.
const BULK_CONCURRENCY: usize = 16;

/// A change made to every job a filter matches.
#[derive(Clone, Copy, Debug)]
pub enum Bulk {
    UpdateRetries(i32),
    Cancel,
}

/// What a bulk call changed, what it could not, and where to go on.
#[derive(Debug, Default)]
pub struct BulkOutcome {
    pub changed: Vec<JobKey>,
    pub failed: Vec<(JobKey, String)>,
    pub cursor: Option<JobKey>,
}

/// The page size asked for, within bounds.
pub fn page_limit(asked: i32) -> u32 {
    match u32::try_from(asked) {
        Ok(0) | Err(_) => DEFAULT_PAGE,
        Ok(n) => n.min(MAX_PAGE),
    }
}

impl Shared {
    /// Up to `limit` jobs matching `filter` after `cursor`, partition by partition
    /// in key order, and the cursor of the next page (`None`: no more).
    pub async fn list_jobs(
        &self,
        caller: Option<&Caller>,
        filter: &JobFilter,
        cursor: Option<JobKey>,
        limit: u32,
        deadline: Instant,
    ) -> Result<(Vec<JobView>, Option<JobKey>), GatewayError> {
        let count = self.topology.wait_for_partitions(deadline).await;
        let tenants = caller.map(|c| c.tenants.as_slice());
        let start = cursor.and_then(JobKey::partition).map_or(1, |p| p.0);
        let mut jobs = Vec::new();
        for p in start..=count {
            let partition = PartitionId(p);
            let want = limit.saturating_sub(u32::try_from(jobs.len()).unwrap_or(u32::MAX));
            let request = Request::ListJobs {
                filter: filter.clone(),
                after: if p == start { cursor } else { None },
                limit: want,
            };
            match self
                .router
                .execute_in(partition, &request, tenants, deadline)
                .await?
            {
                Reply::Jobs { jobs: page, resume } => {
                    jobs.extend(page);
                    if resume.is_some() {
                        return Ok((jobs, resume));
                    }
                }
                other => return Err(unexpected(&other)),
            }
            if jobs.len() >= limit as usize {
                let next = (p < count).then(|| JobKey::new(PartitionId(p + 1), 0));
                return Ok((jobs, next));
            }
        }
        Ok((jobs, None))
    }

    /// Counts of the jobs matching `filter` by type and tenant, over every
    /// partition, with the polls parked here for each.
    pub async fn job_stats(
        &self,
        caller: Option<&Caller>,
        filter: &JobFilter,
        deadline: Instant,
    ) -> Result<Vec<v1::TypeStats>, GatewayError> {
        let count = self.topology.wait_for_partitions(deadline).await;
        let tenants = caller.map(|c| c.tenants.as_slice());
        let request = Request::JobStats {
            filter: filter.clone(),
        };
        let answers = futures::future::join_all((1..=count).map(|p| {
            self.router
                .execute_in(PartitionId(p), &request, tenants, deadline)
        }))
        .await;
        let mut merged: BTreeMap<(String, String), TypeStats> = BTreeMap::new();
        for answer in answers {
            match answer? {
                Reply::Stats(rows) => {
                    for row in rows {
                        merged
                            .entry((row.job_type.clone(), row.tenant_id.clone()))
                            .and_modify(|m| m.merge(&row))
                            .or_insert(row);
                    }
                }
                other => return Err(unexpected(&other)),
            }
        }
        Ok(merged
            .into_values()
            .map(|s| {
                let parked = self.queue.parked_for(&s.job_type, &s.tenant_id);
                v1::TypeStats {
                    parked_polls: i32::try_from(parked).unwrap_or(i32::MAX),
                    ..v1::TypeStats::from(s)
                }
            })
            .collect())
    }

    /// Applies `change` to up to `limit` jobs matching `filter` (incidents when it
    /// names no state) after `cursor`.
    pub async fn bulk(
        &self,
        caller: Option<&Caller>,
        mut filter: JobFilter,
        cursor: Option<JobKey>,
        limit: u32,
        change: Bulk,
        deadline: Instant,
    ) -> Result<BulkOutcome, GatewayError> {
        if let Bulk::UpdateRetries(r) = change {
            if r < 1 {
                return Err(invalid(format!("retries must be at least 1, got {r}")));
            }
        }
        if filter.states.is_empty() {
            filter.states = vec![JobStateKind::Incident];
        }
        let (jobs, cursor) = self
            .list_jobs(caller, &filter, cursor, limit, deadline)
            .await?;
        let results: Vec<(JobKey, Result<(), GatewayError>)> =
            futures::stream::iter(jobs.into_iter().map(|j| async move {
                let command = match change {
                    Bulk::UpdateRetries(retries) => Command::UpdateRetries {
                        key: j.key,
                        retries,
                    },
                    Bulk::Cancel => Command::Cancel { key: j.key },
                };
                let r = self
                    .job_command(caller, j.key.0, Ok(command), deadline)
                    .await;
                (j.key, r)
            }))
            .buffer_unordered(BULK_CONCURRENCY)
            .collect()
            .await;
        let mut out = BulkOutcome {
            cursor,
            ..BulkOutcome::default()
        };
        for (key, r) in results {
            match r {
                Ok(()) => out.changed.push(key),
                Err(e) => out
                    .failed
                    .push((key, Status::from(e).message().to_string())),
            }
        }
        out.changed.sort();
        out.failed.sort();
        Ok(out)
    }
}

/// What a status page reads of a running gateway, in process: the same answers
/// its clients get, without going through its port (and its authentication).
#[derive(Clone)]
pub struct Inspector(pub(crate) Arc<Shared>);

impl std::fmt::Debug for Inspector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Inspector")
    }
}

/// Where a gateway puts its [`Inspector`] once it serves.
pub type InspectorSlot = Arc<std::sync::OnceLock<Inspector>>;

impl Inspector {
    /// The cluster as GetTopology answers it.
    pub fn topology(&self) -> gw::TopologyResponse {
        super::zeebe::zeebe_topology(&self.0.topology.snapshot())
    }

    /// Every job type's counts, as JobStats answers them.
    pub async fn job_stats(&self, timeout: Duration) -> Result<Vec<v1::TypeStats>, GatewayError> {
        let deadline = instant_after(timeout);
        self.0
            .job_stats(None, &JobFilter::default(), deadline)
            .await
    }

    /// The first `limit` incidents, as ListJobs answers them.
    pub async fn incidents(
        &self,
        limit: u32,
        timeout: Duration,
    ) -> Result<Vec<v1::Job>, GatewayError> {
        let filter = JobFilter {
            states: vec![JobStateKind::Incident],
            ..JobFilter::default()
        };
        let deadline = instant_after(timeout);
        let (jobs, _) = self
            .0
            .list_jobs(None, &filter, None, limit, deadline)
            .await?;
        Ok(jobs.into_iter().map(v1::Job::from).collect())
    }

    /// Gives job `key` `retries` retries, as UpdateJobRetries does: an incident
    /// runs again.
    pub async fn update_retries(
        &self,
        key: i64,
        retries: i32,
        timeout: Duration,
    ) -> Result<(), GatewayError> {
        let command = convert::update_retries_request(&gw::UpdateJobRetriesRequest {
            job_key: key,
            retries,
            ..Default::default()
        });
        self.0
            .job_command(None, key, command, instant_after(timeout))
            .await
    }

    /// This gateway's job streams per type: aggregated streams and their clients.
    pub fn streams(&self) -> BTreeMap<String, (usize, usize)> {
        self.0.streams.by_type()
    }

    /// Polls parked on this gateway now.
    pub fn parked_polls(&self) -> i64 {
        self.0.queue.parked()
    }
}
