//! Jobs handed out whose payload is stored apart (past the partition's payload
//! budget): the leader reads each payload in before it answers or pushes them.

use super::*;
use crate::engine::{filter_variables, Applied, Payload};

/// The variables a command's activation asks for (all when empty); `None` for a
/// command that activates nothing.
pub(super) fn fetch_of(cmd: &LogCommand) -> Option<Vec<String>> {
    let (LogCommand::Client { cmd, .. } | LogCommand::ClientIn { cmd, .. }) = cmd else {
        return None;
    };
    let cmd = match cmd {
        Command::Once { command, .. } => command,
        cmd => cmd,
    };
    cmd.activation()
        .map(|(props, _, _)| props.fetch_variables.clone())
}

/// Puts their payloads into the jobs of `applied` handed out without them
/// (`fetch[i]` is what the i-th command's activation asks for). A job whose payload
/// is gone (it ended since) or cannot be read is left out: it is not handed out,
/// and runs again after its timeout.
pub(super) fn fill_stored(p: &Partition, applied: &mut Applied, fetch: &[Option<Vec<String>>]) {
    if applied.stored.is_empty() {
        return;
    }
    let stored = std::mem::take(&mut applied.stored);
    let read = |key: JobKey| -> Option<Payload> {
        match p.shared.payloads.get(key) {
            Ok(Some(payload)) => Some(payload),
            Ok(None) => {
                tracing::debug!(job = %key, "a job handed out ended before its payload was read");
                None
            }
            Err(e) => {
                tracing::error!(job = %key, error = %e, "cannot read a stored payload");
                None
            }
        }
    };
    for (i, reply) in applied.replies.iter_mut().enumerate() {
        let Ok(Reply::Activated(jobs)) = reply else {
            continue;
        };
        let wanted = fetch.get(i).cloned().flatten().unwrap_or_default();
        jobs.retain_mut(|job| {
            if !stored.contains(&job.key) {
                return true;
            }
            let Some(payload) = read(job.key) else {
                return false;
            };
            job.variables = filter_variables(&payload.variables, &wanted);
            job.custom_headers = payload.custom_headers;
            true
        });
    }
    applied.effects.retain_mut(|e| {
        let Effect::Push(push) = e else {
            return true;
        };
        if !stored.contains(&push.job.key) {
            return true;
        }
        let Some(payload) = read(push.job.key) else {
            return false;
        };
        push.job.variables =
            filter_variables(&payload.variables, &push.target.props.fetch_variables);
        push.job.custom_headers = payload.custom_headers;
        true
    });
    metrics::STORED_PAYLOADS_READ.inc_by(stored.len() as u64);
}
