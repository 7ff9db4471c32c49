//! Wire <-> domain conversions for the client-facing APIs. Converting a request
//! validates it: the error is the INVALID_ARGUMENT message.

use crate::courier_v1 as v1;
use crate::domain::*;
use crate::gateway_protocol as gw;
use crate::validate;

/// The activation properties of a long-poll request, validated, with its batch size.
pub fn activate_request(r: &gw::ActivateJobsRequest) -> Result<(ActivationProps, u32), String> {
    if r.max_jobs_to_activate < 1 {
        return Err(format!(
            "maxJobsToActivate must be at least 1, got {}",
            r.max_jobs_to_activate
        ));
    }
    validate::non_blank("type", &r.r#type)?;
    validate::non_blank("worker", &r.worker)?;
    let props = activation_props(
        &r.r#type,
        &r.worker,
        r.timeout,
        &r.fetch_variable,
        &r.tenant_ids,
    )?;
    Ok((props, r.max_jobs_to_activate as u32))
}

/// The activation properties of a job stream, validated. Zeebe lets a stream omit
/// its worker name and hands its jobs out with the name as sent, empty too.
pub fn stream_request(r: &gw::StreamActivatedJobsRequest) -> Result<ActivationProps, String> {
    activation_props(
        &r.r#type,
        &r.worker,
        r.timeout,
        &r.fetch_variable,
        &r.tenant_ids,
    )
}

fn activation_props(
    job_type: &str,
    worker: &str,
    timeout: i64,
    fetch: &[String],
    tenants: &[String],
) -> Result<ActivationProps, String> {
    validate::non_blank("type", job_type)?;
    validate::at_most("worker", worker, MAX_WORKER_BYTES)?;
    let timeout_ms = validate::positive_ms("timeout", timeout)?;
    let mut fetch_variables = fetch.to_vec();
    fetch_variables.sort();
    fetch_variables.dedup();
    Ok(ActivationProps {
        job_type: job_type.to_string(),
        worker: worker.to_string(),
        timeout_ms,
        fetch_variables,
        tenant_ids: validate::tenant_ids(tenants)?,
    })
}

pub fn complete_request(r: &gw::CompleteJobRequest) -> Result<Command, String> {
    Ok(Command::Complete {
        key: JobKey(r.job_key),
        variables: validate::optional_json_object("variables", &r.variables)?,
    })
}

pub fn fail_request(r: &gw::FailJobRequest) -> Result<Command, String> {
    Ok(Command::Fail {
        key: JobKey(r.job_key),
        retries: r.retries,
        error_message: validate::error_message(&r.error_message),
        // As in Zeebe, a back-off that is not positive is none: the job is runnable
        // again at once.
        retry_backoff_ms: r.retry_back_off.max(0),
        variables: validate::optional_json_object("variables", &r.variables)?,
    })
}

/// As in Zeebe, any error code is taken, an empty one too, up to
/// [`MAX_ERROR_CODE_BYTES`].
pub fn throw_error_request(r: &gw::ThrowErrorRequest) -> Result<Command, String> {
    validate::at_most("errorCode", &r.error_code, MAX_ERROR_CODE_BYTES)?;
    Ok(Command::ThrowError {
        key: JobKey(r.job_key),
        error_code: r.error_code.clone(),
        error_message: validate::error_message(&r.error_message),
        variables: validate::optional_json_object("variables", &r.variables)?,
    })
}

pub fn update_retries_request(r: &gw::UpdateJobRetriesRequest) -> Result<Command, String> {
    if r.retries < 1 {
        return Err(format!("retries must be at least 1, got {}", r.retries));
    }
    Ok(Command::UpdateRetries {
        key: JobKey(r.job_key),
        retries: r.retries,
    })
}

pub fn update_timeout_request(r: &gw::UpdateJobTimeoutRequest) -> Result<Command, String> {
    Ok(Command::UpdateTimeout {
        key: JobKey(r.job_key),
        timeout_ms: validate::positive_ms("timeout", r.timeout)?,
    })
}

pub fn create_request(r: &v1::CreateJobRequest) -> Result<NewJob, String> {
    validate::non_blank("type", &r.r#type)?;
    let retries = r.retries.unwrap_or(DEFAULT_RETRIES);
    if retries < 1 {
        return Err(format!("retries must be at least 1, got {retries}"));
    }
    let job = NewJob {
        job_type: r.r#type.clone(),
        variables: validate::json_object("variables", &r.variables)?,
        custom_headers: validate::custom_headers(&r.custom_headers)?,
        retries,
        tenant_id: validate::tenant_id(&r.tenant_id)?,
        process: ProcessContext {
            process_instance_key: r.process_instance_key,
            bpmn_process_id: r.bpmn_process_id.clone(),
            process_definition_version: r.process_definition_version,
            process_definition_key: r.process_definition_key,
            element_id: r.element_id.clone(),
            element_instance_key: r.element_instance_key,
        },
    };
    let bytes = job_text_bytes(
        &job.job_type,
        &job.tenant_id,
        &job.variables,
        &job.custom_headers,
        &job.process,
    );
    if bytes > MAX_JOB_BYTES {
        return Err(job_too_large(bytes));
    }
    Ok(job)
}

impl From<ActivatedJob> for gw::ActivatedJob {
    fn from(j: ActivatedJob) -> Self {
        gw::ActivatedJob {
            key: j.key.0,
            r#type: j.job_type,
            process_instance_key: j.process.process_instance_key,
            bpmn_process_id: j.process.bpmn_process_id,
            process_definition_version: j.process.process_definition_version,
            process_definition_key: j.process.process_definition_key,
            element_id: j.process.element_id,
            element_instance_key: j.process.element_instance_key,
            custom_headers: j.custom_headers,
            worker: j.worker,
            retries: j.retries,
            deadline: j.deadline,
            variables: j.variables,
            tenant_id: j.tenant_id,
        }
    }
}

impl From<JobStateKind> for v1::JobState {
    fn from(s: JobStateKind) -> Self {
        match s {
            JobStateKind::Activatable => v1::JobState::Activatable,
            JobStateKind::Activated => v1::JobState::Activated,
            JobStateKind::FailedBackOff => v1::JobState::FailedBackOff,
            JobStateKind::Incident => v1::JobState::Incident,
            JobStateKind::ErrorThrown => v1::JobState::ErrorThrown,
        }
    }
}

impl From<JobView> for v1::Job {
    fn from(j: JobView) -> Self {
        v1::Job {
            key: j.key.0,
            r#type: j.job_type,
            state: v1::JobState::from(j.state) as i32,
            retries: j.retries,
            worker: j.worker,
            deadline: j.deadline,
            error_message: j.error_message,
            error_code: j.error_code,
            variables: j.variables,
            custom_headers: j.custom_headers,
            tenant_id: j.tenant_id,
            created_at: j.created_at,
            retry_at: j.retry_at,
        }
    }
}

/// The filter of a listing, statistics or bulk request.
pub fn job_filter(f: Option<&v1::JobFilter>) -> Result<JobFilter, String> {
    let Some(f) = f else {
        return Ok(JobFilter::default());
    };
    let states = f
        .states
        .iter()
        .map(|&s| match v1::JobState::try_from(s) {
            Ok(v1::JobState::Activatable) => Ok(JobStateKind::Activatable),
            Ok(v1::JobState::Activated) => Ok(JobStateKind::Activated),
            Ok(v1::JobState::FailedBackOff) => Ok(JobStateKind::FailedBackOff),
            Ok(v1::JobState::Incident) => Ok(JobStateKind::Incident),
            Ok(v1::JobState::ErrorThrown) => Ok(JobStateKind::ErrorThrown),
            Ok(v1::JobState::Unspecified) | Err(_) => Err(format!(
                "filter.states holds {s}, which names no job state (1 to 5)"
            )),
        })
        .collect::<Result<_, _>>()?;
    if f.created_after != 0 && f.created_before != 0 && f.created_after >= f.created_before {
        return Err(format!(
            "filter.createdAfter ({}) must be before filter.createdBefore ({})",
            f.created_after, f.created_before
        ));
    }
    Ok(JobFilter {
        job_type: (!f.r#type.is_empty()).then(|| f.r#type.clone()),
        states,
        tenants: f.tenant_ids.clone(),
        created_after: (f.created_after != 0).then_some(f.created_after),
        created_before: (f.created_before != 0).then_some(f.created_before),
    })
}

/// A page cursor: the key of the last job looked at ("" for the first page).
pub fn cursor(c: &str) -> Result<Option<JobKey>, String> {
    if c.is_empty() {
        return Ok(None);
    }
    c.parse::<i64>()
        .ok()
        .filter(|k| *k >= 0)
        .map(|k| Some(JobKey(k)))
        .ok_or_else(|| format!("cursor '{c}' is not one this API returned"))
}

impl From<TypeStats> for v1::TypeStats {
    fn from(s: TypeStats) -> Self {
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        v1::TypeStats {
            r#type: s.job_type,
            tenant_id: s.tenant_id,
            activatable: n(s.activatable),
            activated: n(s.activated),
            failed_back_off: n(s.failed_back_off),
            incident: n(s.incident),
            error_thrown: n(s.error_thrown),
            oldest_waiting_created_at: s.oldest_waiting.unwrap_or(0),
            activations_per_second: s.activations_per_second,
            streams_by_gateway: s
                .streams
                .into_iter()
                .map(|(g, c)| (g, i32::try_from(c).unwrap_or(i32::MAX)))
                .collect(),
            parked_polls: 0,
        }
    }
}

impl From<&ActivationProps> for crate::cluster::StreamProps {
    fn from(p: &ActivationProps) -> Self {
        crate::cluster::StreamProps {
            r#type: p.job_type.clone(),
            worker: p.worker.clone(),
            timeout: p.timeout_ms,
            fetch_variable: p.fetch_variables.clone(),
            tenant_ids: p.tenant_ids.clone(),
        }
    }
}

/// Stream properties a gateway registered, checked like a worker's request: a peer's
/// malformed registration is refused, never trusted.
pub fn stream_props(p: &crate::cluster::StreamProps) -> Result<ActivationProps, String> {
    activation_props(
        &p.r#type,
        &p.worker,
        p.timeout,
        &p.fetch_variable,
        &p.tenant_ids,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_names_error_codes_and_error_messages_are_bounded() {
        let long_worker = "w".repeat(MAX_WORKER_BYTES + 1);
        let e = activate_request(&activate("t", &long_worker, 1000, 1)).unwrap_err();
        assert!(e.starts_with("worker is 8193 bytes"), "{e}");
        let stream = gw::StreamActivatedJobsRequest {
            r#type: "t".into(),
            worker: long_worker,
            timeout: 1000,
            ..Default::default()
        };
        assert!(stream_request(&stream)
            .unwrap_err()
            .starts_with("worker is"));
        let fits = "w".repeat(MAX_WORKER_BYTES);
        assert!(activate_request(&activate("t", &fits, 1000, 1)).is_ok());

        let throw = |code: String| gw::ThrowErrorRequest {
            job_key: 1,
            error_code: code,
            error_message: "m".repeat(MAX_ERROR_MESSAGE_BYTES * 3),
            ..Default::default()
        };
        let e = throw_error_request(&throw("c".repeat(MAX_ERROR_CODE_BYTES + 1))).unwrap_err();
        assert!(e.starts_with("errorCode is"), "{e}");
        match throw_error_request(&throw("c".repeat(MAX_ERROR_CODE_BYTES))) {
            Ok(Command::ThrowError { error_message, .. }) => {
                assert!(error_message.len() <= MAX_ERROR_MESSAGE_BYTES);
                assert!(error_message.ends_with("bytes]"));
            }
            other => panic!("{other:?}"),
        }
        let fail = gw::FailJobRequest {
            job_key: 1,
            retries: 1,
            error_message: "m".repeat(MAX_ERROR_MESSAGE_BYTES + 1),
            ..Default::default()
        };
        match fail_request(&fail) {
            Ok(Command::Fail { error_message, .. }) => {
                assert!(error_message.len() <= MAX_ERROR_MESSAGE_BYTES);
                assert!(error_message.contains("cut: the message was 32769 bytes"));
            }
            other => panic!("{other:?}"),
        }
    }

    fn activate(t: &str, w: &str, timeout: i64, max: i32) -> gw::ActivateJobsRequest {
        gw::ActivateJobsRequest {
            r#type: t.into(),
            worker: w.into(),
            timeout,
            max_jobs_to_activate: max,
            ..Default::default()
        }
    }

    #[test]
    fn activate_requests_are_checked_field_by_field() {
        assert!(activate_request(&activate("", "w", 1, 1))
            .unwrap_err()
            .contains("type"));
        assert!(activate_request(&activate("t", " ", 1, 1))
            .unwrap_err()
            .contains("worker"));
        assert!(activate_request(&activate("t", "w", 0, 1))
            .unwrap_err()
            .contains("timeout"));
        assert!(activate_request(&activate("t", "w", 1, 0))
            .unwrap_err()
            .contains("maxJobsToActivate"));
        let (props, max) = activate_request(&activate("t", "w", 1000, 32)).unwrap();
        assert_eq!(max, 32);
        assert_eq!(props.tenant_ids, vec![DEFAULT_TENANT.to_string()]);
    }

    #[test]
    fn key_commands_reject_bad_input() {
        let k = JobKey::new(PartitionId(1), 1).0;
        let r = gw::CompleteJobRequest {
            job_key: k,
            variables: "[]".into(),
        };
        assert!(complete_request(&r).unwrap_err().contains("JSON object"));
        let r = gw::UpdateJobRetriesRequest {
            job_key: k,
            retries: 0,
            operation_reference: None,
        };
        assert!(update_retries_request(&r).unwrap_err().contains("retries"));
        let r = gw::ThrowErrorRequest {
            job_key: k,
            error_code: "".into(),
            variables: "null".into(),
            ..Default::default()
        };
        match throw_error_request(&r) {
            Ok(Command::ThrowError {
                error_code,
                variables: None,
                ..
            }) => assert_eq!(error_code, ""),
            other => panic!("an empty error code and null variables are taken: {other:?}"),
        }
    }

    #[test]
    fn a_back_off_that_is_not_positive_is_none() {
        for (given, kept) in [(-1000, 0), (0, 0), (250, 250)] {
            let r = gw::FailJobRequest {
                job_key: JobKey::new(PartitionId(1), 1).0,
                retries: 2,
                retry_back_off: given,
                ..Default::default()
            };
            match fail_request(&r) {
                Ok(Command::Fail {
                    retry_backoff_ms, ..
                }) => assert_eq!(retry_backoff_ms, kept, "retryBackOff {given}"),
                other => panic!("retryBackOff {given}: {other:?}"),
            }
        }
    }

    #[test]
    fn stream_props_round_trip_and_are_checked() {
        let r = gw::StreamActivatedJobsRequest {
            r#type: "t".into(),
            worker: "".into(),
            timeout: 1000,
            fetch_variable: vec!["b".into(), "a".into(), "b".into()],
            tenant_ids: vec![],
        };
        let props = stream_request(&r).unwrap();
        assert_eq!(props.worker, "");
        assert_eq!(
            props.fetch_variables,
            vec!["a".to_string(), "b".to_string()]
        );
        let wire = crate::cluster::StreamProps::from(&props);
        assert_eq!(stream_props(&wire).unwrap(), props);
        let bad = crate::cluster::StreamProps { timeout: 0, ..wire };
        assert!(stream_props(&bad).unwrap_err().contains("timeout"));
    }

    #[test]
    fn create_defaults() {
        let r = v1::CreateJobRequest {
            r#type: "t".into(),
            ..Default::default()
        };
        let j = create_request(&r).unwrap();
        assert_eq!(j.retries, DEFAULT_RETRIES);
        assert_eq!(j.variables, "{}");
        assert_eq!(j.custom_headers, "{}");
        assert_eq!(j.tenant_id, DEFAULT_TENANT);
    }

    #[test]
    fn a_job_must_fit_in_the_message_a_client_receives() {
        let doc = |n: usize| format!("{{\"a\":\"{}\"}}", "x".repeat(n));
        let r = |vars: usize, headers: usize| v1::CreateJobRequest {
            r#type: "t".into(),
            variables: doc(vars),
            custom_headers: doc(headers),
            ..Default::default()
        };
        // Each document under its own limit, both together over the job's.
        let half = MAX_JOB_BYTES / 2;
        let e = create_request(&r(half, half)).unwrap_err();
        assert!(e.contains(&MAX_JOB_BYTES.to_string()), "{e}");
        let fits = MAX_JOB_BYTES - 100;
        create_request(&r(fits / 2, fits / 2 - 100)).expect("under the limit");
    }
}
