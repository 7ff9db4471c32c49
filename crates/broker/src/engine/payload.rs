//! Where a job's payload (its variables and custom headers) lives: in memory, or,
//! once the partition's jobs weigh more than its payload budget, in the store only.
//! A stored payload is read by the storage layer: when a command merges variables
//! into it ([`State::payloads_wanted`], then [`State::hydrate`]), and by the leader
//! when it hands the job out or shows it ([`Applied::stored`]). The placement is a
//! replica's own (its budget is its configuration): every replica hands out the
//! same jobs with the same payloads wherever they live.

use super::*;

/// A job's payload as stored apart from its record.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payload {
    pub variables: String,
    pub custom_headers: String,
}

impl State {
    /// Sets what the jobs may weigh in memory before new payloads are stored only.
    pub fn set_payload_budget(&mut self, bytes: u64) {
        self.payload_budget = bytes;
    }

    /// What the jobs may weigh in memory before new payloads are stored only.
    pub fn payload_budget(&self) -> u64 {
        self.payload_budget
    }

    /// The size of job `key`'s payload if it is stored only, not in memory.
    pub fn stored_payload(&self, key: JobKey) -> Option<u64> {
        self.stored.get(&key).copied()
    }

    /// How many jobs have their payload in the store only.
    pub fn stored_count(&self) -> usize {
        self.stored.len()
    }

    /// Keeps job `key`'s payload in the store only when holding it would take the
    /// jobs' weight past the budget; `changes` then carries it to be written.
    pub(super) fn place(&mut self, key: JobKey, changes: &mut Changes) {
        if self.stored.contains_key(&key) {
            return;
        }
        let Some(job) = self.jobs.get(&key) else {
            return;
        };
        let size = payload_bytes(job);
        if size == 0 || self.held_bytes <= self.payload_budget {
            return;
        }
        let before = self.weight(key);
        let Some(job) = self.jobs.get_mut(&key) else {
            return;
        };
        let payload = Payload {
            variables: std::mem::take(&mut job.variables),
            custom_headers: std::mem::take(&mut job.custom_headers),
        };
        self.stored.insert(key, size);
        self.reweigh(key, before);
        changes.jobs.insert(key);
        changes.payloads.insert(key, Some(payload));
    }

    /// Jobs whose stored payload `batch` needs in memory to apply: those it merges
    /// variables into.
    pub fn payloads_wanted(&self, batch: &Batch) -> Vec<JobKey> {
        batch
            .commands
            .iter()
            .filter_map(|c| match c {
                LogCommand::Client { cmd, .. } | LogCommand::ClientIn { cmd, .. } => Some(cmd),
                _ => None,
            })
            .filter_map(|cmd| match cmd {
                Command::Once { command, .. } => merges_into(command),
                cmd => merges_into(cmd),
            })
            .filter(|key| self.stored.contains_key(key))
            .collect()
    }

    /// Takes job `key`'s stored payload back into memory (the store's copy is
    /// dropped with the next write; [`State::place`] may store it again).
    pub fn hydrate(&mut self, key: JobKey, payload: Payload, changes: &mut Changes) {
        if self.stored.remove(&key).is_none() {
            return;
        }
        let before = self.weight(key);
        if let Some(job) = self.jobs.get_mut(&key) {
            job.variables = payload.variables;
            job.custom_headers = payload.custom_headers;
        }
        self.reweigh(key, before);
        changes.jobs.insert(key);
        changes.payloads.insert(key, None);
    }

    /// Forgets job `key`'s stored payload, as the job ends.
    pub(super) fn drop_stored(&mut self, key: JobKey, changes: &mut Changes) {
        if self.stored.remove(&key).is_some() {
            changes.payloads.insert(key, None);
        }
    }

    /// Stores payloads, newest job first, until the jobs' weight is within the
    /// budget (a state rebuilt whole from a snapshot); `changes` carries them.
    pub fn place_all(&mut self, changes: &mut Changes) {
        let keys: Vec<JobKey> = self.jobs.keys().rev().copied().collect();
        for key in keys {
            if self.held_bytes <= self.payload_budget {
                break;
            }
            self.place(key, changes);
        }
    }

    /// Job `job`'s text as a create states it, wherever its payload lives.
    pub(super) fn full_text_bytes(&self, job: &Job) -> usize {
        let stored = self.stored.get(&job.key).copied().unwrap_or(0);
        text_bytes(job).saturating_add(usize::try_from(stored).unwrap_or(usize::MAX))
    }

    /// The jobs among `applied`'s replies and pushes whose payload is stored only.
    pub(super) fn stored_among(&self, applied: &Applied) -> BTreeSet<JobKey> {
        let replied = applied
            .replies
            .iter()
            .filter_map(|r| match r {
                Ok(Reply::Activated(jobs)) => Some(jobs),
                _ => None,
            })
            .flatten();
        let pushed = applied.effects.iter().filter_map(|e| match e {
            Effect::Push(p) => Some(&p.job),
            _ => None,
        });
        replied
            .chain(pushed)
            .map(|j| j.key)
            .filter(|k| self.stored.contains_key(k))
            .collect()
    }
}

/// The job whose variables `cmd` merges into its own.
fn merges_into(cmd: &Command) -> Option<JobKey> {
    match cmd {
        Command::Fail {
            key,
            variables: Some(_),
            ..
        }
        | Command::ThrowError {
            key,
            variables: Some(_),
            ..
        } => Some(*key),
        _ => None,
    }
}

/// The size of job `job`'s payload in memory.
pub fn payload_bytes(job: &Job) -> u64 {
    u64::try_from(job.variables.len() + job.custom_headers.len()).unwrap_or(u64::MAX)
}

#[cfg(test)]
#[path = "payload_tests.rs"]
mod tests;
