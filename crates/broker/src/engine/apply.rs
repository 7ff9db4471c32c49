//! Applying an entry: each command's transition, the push targets it uses, and
//! the answers and effects it gives.

use super::*;

impl State {
    /// Applies one log entry of `term`: one reply per command, in order, and the
    /// entry's effects (de-duplicated, in order of first occurrence).
    pub fn apply_batch(&mut self, term: u64, batch: &Batch, changes: &mut Changes) -> Applied {
        self.forget_onces(batch.ts.saturating_sub(ONCE_WINDOW_MS), changes);
        let mut effects = Vec::new();
        let mut repeated = 0;
        let replies = batch
            .commands
            .iter()
            .map(|c| match self.repeat(c) {
                Some(answer) => {
                    repeated += 1;
                    Ok(answer)
                }
                None => self.apply(batch.ts, term, c, &mut effects, changes),
            })
            .collect();
        let mut seen = BTreeSet::new();
        effects.retain(|e| match e {
            Effect::JobsAvailable {
                job_type,
                tenant_id,
            } => seen.insert((job_type.clone(), tenant_id.clone())),
            Effect::Push(_) | Effect::Finished { .. } => true,
        });
        let mut applied = Applied {
            replies,
            effects,
            repeated,
            stored: BTreeSet::new(),
        };
        applied.stored = self.stored_among(&applied);
        applied
    }

    /// The answer to `cmd` if it repeats a [`Command::Once`] applied before (an
    /// earlier attempt's answer, as far as its jobs are still where it left them):
    /// a repeat changes nothing.
    pub(super) fn repeat(&self, cmd: &LogCommand) -> Option<Reply> {
        let (LogCommand::Client {
            cmd: Command::Once { request, command },
            ..
        }
        | LogCommand::ClientIn {
            cmd: Command::Once { request, command },
            ..
        }) = cmd
        else {
            return None;
        };
        let done = self.onces.get(request)?;
        Some(self.answer_again(&done.outcome, command))
    }

    /// Applies one command at time `ts`, of an entry of `term`; a repeat of a
    /// [`Command::Once`] is answered by [`State::repeat`] before.
    pub(super) fn apply(
        &mut self,
        ts: i64,
        term: u64,
        cmd: &LogCommand,
        effects: &mut Vec<Effect>,
        changes: &mut Changes,
    ) -> Result<Reply, BrokerError> {
        match cmd {
            LogCommand::Client { cmd, push, via } => {
                let mut budget = Budget::new(push, term);
                let via = via.as_ref().map(|gateway| Via {
                    gateway: gateway.clone(),
                    term,
                    pushed: false,
                });
                self.apply_client(ts, cmd, &mut budget, via, effects, changes)
            }
            LogCommand::TimeOut { keys, push } => {
                let mut budget = Budget::new(push, term);
                for key in keys {
                    let due = matches!(
                        self.jobs.get(key).map(|j| &j.status),
                        Some(JobStatus::Activated { deadline, .. }) if *deadline <= ts
                    );
                    if due {
                        self.end_activation(*key, effects);
                        self.runnable(ts, *key, &mut budget, false, effects, changes);
                    }
                }
                Ok(Reply::Done)
            }
            LogCommand::Recur { keys, push } => {
                let mut budget = Budget::new(push, term);
                for key in keys {
                    let due = matches!(
                        self.jobs.get(key).map(|j| &j.status),
                        Some(JobStatus::BackOff { retry_at }) if *retry_at <= ts
                    );
                    if due {
                        self.runnable(ts, *key, &mut budget, false, effects, changes);
                    }
                }
                Ok(Reply::Done)
            }
            LogCommand::Yield { key, lease } => {
                let current = matches!(
                    self.jobs.get(key).map(|j| &j.status),
                    Some(JobStatus::Activated { lease: l, .. }) if l == lease
                );
                if current {
                    // Not pushed again at once: it waits for a poll or a stream with room.
                    self.end_activation(*key, effects);
                    self.runnable(ts, *key, &mut Budget::default(), false, effects, changes);
                }
                Ok(Reply::Done)
            }
            LogCommand::ClientIn { cmd, push, tenants } => {
                if let Some((key, action)) = about_job(cmd.inner()) {
                    if self
                        .jobs
                        .get(&key)
                        .is_some_and(|j| !tenants.contains(&j.tenant_id))
                    {
                        return Err(not_found(key, action));
                    }
                }
                let mut budget = Budget::new(push, term);
                self.apply_client(ts, cmd, &mut budget, None, effects, changes)
            }
            LogCommand::Backfill { target } => {
                let via = target.via(term);
                // Each pushed job goes in a message of its own: no bound in bytes.
                let jobs =
                    self.activate(ts, &target.props, target.max, u64::MAX, Some(via), changes);
                for job in jobs {
                    let Some(lease) = self.lease_of(job.key) else {
                        continue;
                    };
                    effects.push(Effect::Push(Box::new(Push {
                        target: target.clone(),
                        lease,
                        job,
                        origin: PushOrigin::Backfill,
                    })));
                }
                Ok(Reply::Done)
            }
        }
    }

    pub(super) fn apply_client(
        &mut self,
        ts: i64,
        cmd: &Command,
        budget: &mut Budget,
        polled_via: Option<Via>,
        effects: &mut Vec<Effect>,
        changes: &mut Changes,
    ) -> Result<Reply, BrokerError> {
        match cmd {
            Command::Create(jobs) => Ok(Reply::Created(
                jobs.iter()
                    .map(|j| self.create(ts, j, budget, effects, changes))
                    .collect(),
            )),
            Command::Once { request, command } => {
                if !matches!(
                    **command,
                    Command::Create(_)
                        | Command::Activate { .. }
                        | Command::ActivateWithin { .. }
                        | Command::Fail { .. }
                        | Command::ThrowError { .. }
                ) {
                    return Err(BrokerError::InvalidArgument(
                        "only a create, an activation, a fail or a thrown error is carried \
                         out once"
                            .into(),
                    ));
                }
                let first = self.counters.last_key + 1;
                let reply = self.apply_client(ts, command, budget, polled_via, effects, changes)?;
                let outcome = match &reply {
                    Reply::Created(keys) => Outcome::Created {
                        first,
                        count: u32::try_from(keys.len()).unwrap_or(u32::MAX),
                    },
                    Reply::Activated(jobs) => Outcome::Activated {
                        jobs: jobs
                            .iter()
                            .filter_map(|j| Some((j.key, self.lease_of(j.key)?)))
                            .collect(),
                    },
                    _ => Outcome::Done,
                };
                self.onces.insert(*request, OnceRecord { ts, outcome });
                self.once_times.insert((ts, *request));
                changes.requests.insert(*request);
                Ok(reply)
            }
            Command::Activate { .. } | Command::ActivateWithin { .. } => {
                let Some((props, max_jobs, max_bytes)) = cmd.activation() else {
                    return Ok(Reply::Activated(Vec::new()));
                };
                Ok(Reply::Activated(self.activate(
                    ts, props, max_jobs, max_bytes, polled_via, changes,
                )))
            }
            Command::Complete { key, .. } => {
                self.expect_activated(*key, "complete")?;
                self.end_activation(*key, effects);
                self.remove(*key, changes);
                Ok(Reply::Done)
            }
            Command::Fail {
                key,
                retries,
                error_message,
                retry_backoff_ms,
                variables,
            } => {
                self.expect_activated(*key, "fail")?;
                // The job runs again with the variables merged in: it must still fit
                // in the message that hands it out.
                let merged = self.merged_variables(*key, variables.as_deref(), "fail")?;
                let before = self.weight(*key);
                self.end_activation(*key, effects);
                self.unindex(*key);
                let job = self.job_mut(*key, "fail")?;
                job.retries = (*retries).max(0);
                job.error_message = error_message.clone();
                if let Some(merged) = merged {
                    job.variables = merged;
                }
                changes.jobs.insert(*key);
                if *retries <= 0 {
                    job.status = JobStatus::Incident;
                } else if *retry_backoff_ms > 0 {
                    job.status = JobStatus::BackOff {
                        retry_at: ts.saturating_add(*retry_backoff_ms),
                    };
                    self.reindex(*key);
                } else {
                    self.runnable(ts, *key, budget, false, effects, changes);
                }
                self.reweigh(*key, before);
                self.place(*key, changes);
                Ok(Reply::Done)
            }
            Command::ThrowError {
                key,
                error_code,
                error_message,
                variables,
            } => {
                self.expect_activated(*key, "throw an error for")?;
                // Kept with the variables merged in, as a failed job is: they must
                // fit the same bound, so the job can still be read (GetJob).
                let merged =
                    self.merged_variables(*key, variables.as_deref(), "throw an error for")?;
                let before = self.weight(*key);
                self.end_activation(*key, effects);
                self.unindex(*key);
                let job = self.job_mut(*key, "throw an error for")?;
                job.error_code = error_code.clone();
                job.error_message = error_message.clone();
                if let Some(merged) = merged {
                    job.variables = merged;
                }
                job.status = JobStatus::ErrorThrown;
                changes.jobs.insert(*key);
                self.reweigh(*key, before);
                self.place(*key, changes);
                Ok(Reply::Done)
            }
            Command::UpdateRetries { key, retries } => {
                if *retries < 1 {
                    return Err(BrokerError::InvalidArgument(format!(
                        "retries must be at least 1, got {retries}"
                    )));
                }
                let job = self.job_mut(*key, "update retries of")?;
                if job.status == JobStatus::ErrorThrown {
                    return Err(precondition(*key, "update retries of", &job.status));
                }
                job.retries = *retries;
                let incident = job.status == JobStatus::Incident;
                changes.jobs.insert(*key);
                if incident {
                    self.runnable(ts, *key, budget, false, effects, changes);
                }
                Ok(Reply::Done)
            }
            Command::UpdateTimeout { key, timeout_ms } => {
                self.expect_activated(*key, "update the timeout of")?;
                self.unindex(*key);
                let job = self.job_mut(*key, "update the timeout of")?;
                if let JobStatus::Activated { deadline, .. } = &mut job.status {
                    *deadline = ts.saturating_add(*timeout_ms);
                }
                self.reindex(*key);
                changes.jobs.insert(*key);
                Ok(Reply::Done)
            }
            Command::Cancel { key } => {
                if !self.jobs.contains_key(key) {
                    return Err(not_found(*key, "cancel"));
                }
                self.end_activation(*key, effects);
                self.remove(*key, changes);
                Ok(Reply::Done)
            }
        }
    }

    pub(super) fn create(
        &mut self,
        ts: i64,
        new: &NewJob,
        budget: &mut Budget,
        effects: &mut Vec<Effect>,
        changes: &mut Changes,
    ) -> JobKey {
        self.counters.last_key += 1;
        let key = JobKey::new(self.partition, self.counters.last_key);
        self.jobs.insert(
            key,
            Job {
                key,
                job_type: new.job_type.clone(),
                tenant_id: new.tenant_id.clone(),
                variables: new.variables.clone(),
                custom_headers: new.custom_headers.clone(),
                retries: new.retries,
                process: new.process.clone(),
                created_at: ts,
                status: JobStatus::Activatable { seq: 0 },
                error_message: String::new(),
                error_code: String::new(),
            },
        );
        self.reweigh(key, 0);
        // Pushed at once, it goes out with its payload; stored after, if need be.
        self.runnable(ts, key, budget, true, effects, changes);
        self.place(key, changes);
        key
    }

    /// The answer to a repeat of a [`Command::Once`] (`command`, the one it
    /// wraps) that went as `outcome` said. Activated jobs are given again while
    /// that activation holds them (not completed, failed or timed out since), as
    /// the first answer gave them.
    pub(super) fn answer_again(&self, outcome: &Outcome, command: &Command) -> Reply {
        match outcome {
            Outcome::Created { first, count } => Reply::Created(
                (0..u64::from(*count))
                    .map(|i| JobKey::new(self.partition, first + i))
                    .collect(),
            ),
            Outcome::Done => Reply::Done,
            Outcome::Activated { jobs } => {
                let Some((props, _, _)) = command.activation() else {
                    return Reply::Activated(Vec::new());
                };
                Reply::Activated(
                    jobs.iter()
                        .filter_map(|(key, lease)| self.still_activated(*key, *lease, props))
                        .collect(),
                )
            }
        }
    }

    /// Job `key` as activated for `props`, if activation `lease` still holds it.
    pub(super) fn still_activated(
        &self,
        key: JobKey,
        lease: Lease,
        props: &ActivationProps,
    ) -> Option<ActivatedJob> {
        let job = self.jobs.get(&key)?;
        let JobStatus::Activated {
            worker,
            deadline,
            lease: current,
            ..
        } = &job.status
        else {
            return None;
        };
        (*current == lease).then(|| handed_out(job, worker, *deadline, props))
    }

    /// Forgets the [`Command::Once`]s applied before `cutoff` (epoch ms of the
    /// entry being applied, less the window): the same on every replica, as it goes
    /// by entries' timestamps only.
    pub(super) fn forget_onces(&mut self, cutoff: i64, changes: &mut Changes) {
        while let Some(&(ts, id)) = self.once_times.first() {
            if ts >= cutoff {
                break;
            }
            self.once_times.pop_first();
            self.onces.remove(&id);
            changes.requests.insert(id);
        }
    }

    /// Activates up to `max` of the oldest activatable jobs for `props`, stopping
    /// before the first whose size ([`activated_size_bound`]) would take the total
    /// past `max_bytes`.
    pub(super) fn activate(
        &mut self,
        ts: i64,
        props: &ActivationProps,
        max: u32,
        max_bytes: u64,
        via: Option<Via>,
        changes: &mut Changes,
    ) -> Vec<ActivatedJob> {
        let mut picked: Vec<(u64, JobKey)> = Vec::new();
        for tenant in &props.tenant_ids {
            if let Some(q) = self.queues.get(&(props.job_type.clone(), tenant.clone())) {
                picked.extend(q.iter().take(max as usize).map(|(s, k)| (*s, *k)));
            }
        }
        picked.sort_unstable();
        picked.truncate(max as usize);
        let mut bytes = 0u64;
        let fitting = picked.into_iter().take_while(|(_, key)| {
            let Some(job) = self.jobs.get(key) else {
                return true;
            };
            let text = self.full_text_bytes(job);
            bytes = bytes.saturating_add(activated_size_bound(text, &props.worker) as u64);
            bytes <= max_bytes
        });
        let fitting: Vec<JobKey> = fitting.map(|(_, key)| key).collect();
        fitting
            .into_iter()
            .filter_map(|key| self.activate_one(ts, key, props, via.clone(), changes))
            .collect()
    }

    pub(super) fn activate_one(
        &mut self,
        ts: i64,
        key: JobKey,
        props: &ActivationProps,
        via: Option<Via>,
        changes: &mut Changes,
    ) -> Option<ActivatedJob> {
        self.unindex(key);
        self.counters.last_lease += 1;
        let lease = Lease(self.counters.last_lease);
        let deadline = ts.saturating_add(props.timeout_ms);
        let job = self.jobs.get_mut(&key)?;
        job.status = JobStatus::Activated {
            worker: props.worker.clone(),
            deadline,
            lease,
            via,
        };
        let activated = handed_out(job, &props.worker, deadline, props);
        self.reindex(key);
        changes.jobs.insert(key);
        Some(activated)
    }

    /// A job became runnable: activated for a push target of the command when one
    /// matches and has room, otherwise queued and announced to long polls.
    pub(super) fn runnable(
        &mut self,
        ts: i64,
        key: JobKey,
        budget: &mut Budget,
        created: bool,
        effects: &mut Vec<Effect>,
        changes: &mut Changes,
    ) {
        self.make_activatable(key, changes);
        let Some(job) = self.jobs.get(&key) else {
            return;
        };
        match budget.take(job) {
            Some(target) => {
                let via = Some(target.via(budget.term));
                let activated = self.activate_one(ts, key, &target.props, via, changes);
                if let Some((activated, lease)) = activated.zip(self.lease_of(key)) {
                    effects.push(Effect::Push(Box::new(Push {
                        target,
                        lease,
                        job: activated,
                        origin: if created {
                            PushOrigin::Created
                        } else {
                            PushOrigin::Runnable
                        },
                    })));
                }
            }
            None => effects.push(Effect::JobsAvailable {
                job_type: job.job_type.clone(),
                tenant_id: job.tenant_id.clone(),
            }),
        }
    }

    /// Puts an existing job at the back of its type's queue.
    pub(super) fn make_activatable(&mut self, key: JobKey, changes: &mut Changes) {
        self.unindex(key);
        self.counters.last_seq += 1;
        let seq = self.counters.last_seq;
        let Some(job) = self.jobs.get_mut(&key) else {
            return;
        };
        job.status = JobStatus::Activatable { seq };
        self.reindex(key);
        changes.jobs.insert(key);
    }

    /// Announces the end of the job's activation, if it is activated.
    pub(super) fn end_activation(&self, key: JobKey, effects: &mut Vec<Effect>) {
        if let Some(JobStatus::Activated { lease, .. }) = self.jobs.get(&key).map(|j| &j.status) {
            effects.push(Effect::Finished { key, lease: *lease });
        }
    }

    /// Job `key`'s variables with `variables` merged in (`None` when there are none
    /// to merge), refused when the job would then be over [`MAX_JOB_BYTES`].
    pub(super) fn merged_variables(
        &mut self,
        key: JobKey,
        variables: Option<&str>,
        action: &str,
    ) -> Result<Option<String>, BrokerError> {
        let Some(v) = variables else {
            return Ok(None);
        };
        let job = self.job_mut(key, action)?;
        let merged = merge_objects(&job.variables, v);
        let bytes = job_text_bytes(
            &job.job_type,
            &job.tenant_id,
            &merged,
            &job.custom_headers,
            &job.process,
        );
        if bytes > MAX_JOB_BYTES {
            return Err(BrokerError::InvalidArgument(job_too_large(bytes)));
        }
        Ok(Some(merged))
    }

    /// The lease of job `key`'s current activation, if it is activated.
    pub(super) fn lease_of(&self, key: JobKey) -> Option<Lease> {
        match self.jobs.get(&key).map(|j| &j.status) {
            Some(JobStatus::Activated { lease, .. }) => Some(*lease),
            _ => None,
        }
    }
}

/// The push targets of one command and how many more jobs each may take.
#[derive(Default)]
pub(super) struct Budget {
    slots: Vec<(PushTarget, u32)>,
    /// The term of the entry being applied.
    term: u64,
}

impl Budget {
    pub(super) fn new(targets: &[PushTarget], term: u64) -> Self {
        Budget {
            slots: targets.iter().map(|t| (t.clone(), t.max)).collect(),
            term,
        }
    }

    /// The first target that takes this job and has room, using up one place.
    pub(super) fn take(&mut self, job: &Job) -> Option<PushTarget> {
        let (target, left) = self
            .slots
            .iter_mut()
            .find(|(t, left)| *left > 0 && t.takes(job))?;
        *left -= 1;
        Some(target.clone())
    }
}

/// The replies and effects of one applied entry.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    pub replies: Vec<Result<Reply, BrokerError>>,
    pub effects: Vec<Effect>,
    /// [`Command::Once`]s answered as an earlier attempt was.
    pub repeated: u32,
    /// Jobs handed out (answered or pushed) without their payload, which is in the
    /// store only: the leader reads it in before sending them.
    pub stored: BTreeSet<JobKey>,
}

/// The job a command is about, and what it does to it in the words of the
/// NOT_FOUND answer.
pub(super) fn about_job(cmd: &Command) -> Option<(JobKey, &'static str)> {
    match cmd {
        Command::Complete { key, .. } => Some((*key, "complete")),
        Command::Fail { key, .. } => Some((*key, "fail")),
        Command::ThrowError { key, .. } => Some((*key, "throw an error for")),
        Command::UpdateRetries { key, .. } => Some((*key, "update retries of")),
        Command::UpdateTimeout { key, .. } => Some((*key, "update the timeout of")),
        Command::Cancel { key } => Some((*key, "cancel")),
        Command::Create(_)
        | Command::Activate { .. }
        | Command::ActivateWithin { .. }
        | Command::Once { .. } => None,
    }
}

pub(super) fn not_found(key: JobKey, action: &str) -> BrokerError {
    BrokerError::NotFound(format!(
        "expected to {action} job with key '{key}', but no such job was found"
    ))
}

pub(super) fn precondition(key: JobKey, action: &str, status: &JobStatus) -> BrokerError {
    let what = match status {
        JobStatus::Activatable { .. } => "it is activatable, not activated",
        JobStatus::Activated { .. } => "it is activated",
        JobStatus::BackOff { .. } => "it failed and is waiting for its retry back-off",
        JobStatus::Incident => "it failed without retries left (an incident)",
        JobStatus::ErrorThrown => "an error was thrown for it",
    };
    BrokerError::FailedPrecondition(format!(
        "expected to {action} job with key '{key}', but {what}"
    ))
}

/// `job` as an activation for `props` hands it out.
pub(super) fn handed_out(
    job: &Job,
    worker: &str,
    deadline: i64,
    props: &ActivationProps,
) -> ActivatedJob {
    ActivatedJob {
        key: job.key,
        job_type: job.job_type.clone(),
        worker: worker.to_string(),
        retries: job.retries,
        deadline,
        variables: filter_variables(&job.variables, &props.fetch_variables),
        custom_headers: job.custom_headers.clone(),
        tenant_id: job.tenant_id.clone(),
        process: job.process.clone(),
    }
}

/// Keeps only the variables a worker asked for; all of them when it named none.
pub(crate) fn filter_variables(doc: &str, fetch: &[String]) -> String {
    if fetch.is_empty() {
        return doc.to_string();
    }
    match serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(doc) {
        Ok(mut map) => {
            map.retain(|k, _| fetch.iter().any(|f| f == k));
            serde_json::Value::Object(map).to_string()
        }
        Err(_) => doc.to_string(),
    }
}

/// Top-level merge of two JSON objects; keys of `update` win.
pub(super) fn merge_objects(base: &str, update: &str) -> String {
    type Map = serde_json::Map<String, serde_json::Value>;
    match (
        serde_json::from_str::<Map>(base),
        serde_json::from_str::<Map>(update),
    ) {
        (Ok(mut b), Ok(u)) => {
            b.extend(u);
            serde_json::Value::Object(b).to_string()
        }
        (Err(_), Ok(_)) => update.to_string(),
        _ => base.to_string(),
    }
}
