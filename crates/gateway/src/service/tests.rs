use super::zeebe::split_host_port;
use super::*;

use crate::topology::{Leader, PartitionReport};

/// Create ids differ between calls and between gateways (and a gateway's
/// restart), so no two creates are taken for one.
#[test]
fn create_ids_are_never_drawn_twice() {
    let (a, b) = (RequestIds::new(), RequestIds::new());
    let ids: std::collections::BTreeSet<RequestId> =
        (0..1000).flat_map(|_| [a.next(), b.next()]).collect();
    assert_eq!(ids.len(), 2000);
    assert_ne!(a.prefix, b.prefix);
}

#[test]
fn the_size_bound_of_a_job_is_never_below_its_encoded_size() {
    use prost::Message;
    let long = |n: usize| "v".repeat(n);
    let jobs = [
        gw::ActivatedJob::default(),
        gw::ActivatedJob {
            key: i64::MIN,
            r#type: long(300),
            process_instance_key: -1,
            bpmn_process_id: long(200),
            process_definition_version: i32::MIN,
            process_definition_key: -1,
            element_id: long(130),
            element_instance_key: i64::MIN,
            custom_headers: long(70_000),
            worker: long(20),
            retries: -1,
            deadline: i64::MAX,
            variables: long(4 * 1024 * 1024),
            tenant_id: long(31),
        },
    ];
    for job in jobs {
        let answer = gw::ActivateJobsResponse {
            jobs: vec![job.clone()],
        };
        assert!(encoded_size_bound(&job) >= answer.encoded_len());
    }
}

fn visit(rr: &RoundRobin, count: u32) -> Vec<u32> {
    rr.order(count).map(|p| p.0).collect()
}

#[test]
fn each_visit_starts_one_partition_further() {
    let rr = RoundRobin::default();
    assert_eq!(visit(&rr, 3), vec![1, 2, 3]);
    assert_eq!(visit(&rr, 3), vec![2, 3, 1]);
    assert_eq!(visit(&rr, 3), vec![3, 1, 2]);
    assert_eq!(visit(&rr, 3), vec![1, 2, 3]);
    assert_eq!(visit(&rr, 0), Vec::<u32>::new());
    assert_eq!(visit(&rr, 1), vec![1]);
}

#[test]
fn a_wrapping_counter_still_visits_every_partition_once() {
    let rr = RoundRobin(AtomicU32::new(u32::MAX - 1));
    for _ in 0..4 {
        let mut v = visit(&rr, 3);
        v.sort();
        assert_eq!(v, vec![1, 2, 3]);
    }
}

#[test]
fn the_partition_a_notice_came_from_is_visited_first() {
    let rr = RoundRobin::default();
    let from = |p: Option<u32>, count| -> Vec<u32> {
        rr.order_from(p.map(PartitionId), count)
            .map(|p| p.0)
            .collect()
    };
    assert_eq!(from(Some(2), 3), vec![2, 1, 3]);
    assert_eq!(from(Some(2), 3), vec![2, 3, 1]);
    assert_eq!(from(Some(3), 3), vec![3, 1, 2]);
    // One the cluster does not have (a stale notice) is no hint.
    assert_eq!(from(Some(4), 3), vec![1, 2, 3]);
    assert_eq!(from(Some(0), 3), vec![2, 3, 1]);
    assert_eq!(from(None, 3), vec![3, 1, 2]);
    assert_eq!(from(Some(1), 0), Vec::<u32>::new());
}

#[test]
fn batches_are_bounded_and_errors_name_the_entry() {
    let ok = v1::CreateJobRequest {
        r#type: "t".into(),
        ..Default::default()
    };
    let e = create_batch(&[]).unwrap_err().to_string();
    assert!(e.contains("jobs must not be empty"), "{e}");
    let e = create_batch(&vec![ok.clone(); MAX_BATCH + 1])
        .unwrap_err()
        .to_string();
    assert!(e.contains("10000"), "{e}");
    assert_eq!(
        create_batch(&vec![ok.clone(); MAX_BATCH]).unwrap().len(),
        MAX_BATCH
    );
    let bad = v1::CreateJobRequest {
        r#type: "t".into(),
        variables: "[]".into(),
        ..Default::default()
    };
    let e = create_batch(&[ok, bad]).unwrap_err();
    assert!(matches!(e, GatewayError::InvalidArgument(_)));
    assert!(e.to_string().starts_with("jobs[1]: variables"), "{e}");
}

#[test]
fn a_long_poll_without_a_grpc_timeout_runs_its_request_timeout() {
    let (s, ms) = (Duration::from_secs(1), Duration::from_millis(1));
    let (request, poll) = (15 * s, 10 * s);
    // A stated deadline bounds it whatever the request timeout.
    assert_eq!(activate_timeout(Some(3 * s), 60_000, request, poll), 3 * s);
    // Without one: the long poll's own length, with room to answer.
    assert_eq!(
        activate_timeout(None, 60_000, request, poll),
        60 * s + 200 * ms
    );
    assert_eq!(
        activate_timeout(None, 0, request, 20 * s),
        20 * s + 200 * ms
    );
    // Never less than any request gets.
    assert_eq!(activate_timeout(None, 0, request, poll), request);
    assert_eq!(activate_timeout(None, -1, request, poll), request);
    assert_eq!(activate_timeout(None, 500, request, poll), request);
}

#[test]
fn declared_held_jobs_are_read_and_bad_entries_skipped() {
    let mut md = tonic::metadata::MetadataMap::new();
    assert!(declared_held(&md).is_empty());
    md.insert(
        JOBS_HELD_HEADER,
        " 11:1700000000000, x:1,12:1700000000001,13,14:-5,,"
            .parse()
            .unwrap(),
    );
    assert_eq!(
        declared_held(&md),
        [
            (JobKey(11), 1_700_000_000_000),
            (JobKey(12), 1_700_000_000_001),
            (JobKey(14), -5)
        ]
    );
    let many: Vec<String> = (0..MAX_CLIENT_CREDIT as i64 + 5)
        .map(|k| format!("{k}:1"))
        .collect();
    md.insert(JOBS_HELD_HEADER, many.join(",").parse().unwrap());
    assert_eq!(declared_held(&md).len(), MAX_CLIENT_CREDIT as usize);
}

#[test]
fn a_valid_max_jobs_active_header_states_the_credit() {
    let stated = |v: &str| {
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert(MAX_JOBS_ACTIVE_HEADER, v.parse().unwrap());
        stated_credit(&md)
    };
    assert_eq!(stated("5"), Some(5));
    assert_eq!(stated(" 10000 "), Some(10_000));
    assert_eq!(stated("1"), Some(1));
    for bad in ["0", "10001", "-3", "many", ""] {
        assert_eq!(stated(bad), None, "{bad:?}");
    }
    assert_eq!(stated_credit(&tonic::metadata::MetadataMap::new()), None);
}

#[test]
fn host_and_port_are_split_from_addresses() {
    assert_eq!(
        split_host_port("broker-1:26501"),
        ("broker-1".into(), 26501)
    );
    assert_eq!(split_host_port("http://10.0.0.2:9"), ("10.0.0.2".into(), 9));
    assert_eq!(split_host_port("[::1]:26501"), ("::1".into(), 26501));
    assert_eq!(split_host_port("broker-1"), ("broker-1".into(), 0));
}

#[test]
fn zeebe_topology_lists_every_member_with_roles_and_health() {
    let mut view = ClusterView {
        partitions_count: 2,
        replication_factor: 2,
        ..Default::default()
    };
    for n in 1..=3u64 {
        view.members.insert(n, format!("b{n}:2650{n}"));
    }
    let report = |p: u32, role: &str| PartitionReport {
        partition: PartitionId(p),
        role: role.into(),
        majority_lost: false,
    };
    view.reports
        .insert(1, vec![report(1, "leader"), report(2, "candidate")]);
    view.reports
        .insert(2, vec![report(1, "follower"), report(2, "shutdown")]);
    view.leaders
        .insert(PartitionId(1), Leader { node: 1, term: 3 });
    view.versions.insert(1, "0.9.0".into());
    view.versions.insert(2, VERSION.into());
    // Broker 3 did not answer.
    let t = zeebe_topology(&view);
    assert_eq!(t.cluster_size, 3);
    assert_eq!(t.partitions_count, 2);
    assert_eq!(t.replication_factor, 2);
    assert_eq!(t.gateway_version, VERSION);
    assert_eq!(t.brokers.len(), 3);
    let b1 = &t.brokers[0];
    assert_eq!((b1.node_id, b1.host.as_str(), b1.port), (1, "b1", 26501));
    use gw::partition::{PartitionBrokerHealth as H, PartitionBrokerRole as R};
    let parts: Vec<(i32, i32, i32)> = b1
        .partitions
        .iter()
        .map(|p| (p.partition_id, p.role, p.health))
        .collect();
    assert_eq!(
        parts,
        vec![
            (1, R::Leader as i32, H::Healthy as i32),
            (2, R::Follower as i32, H::Unhealthy as i32)
        ]
    );
    assert_eq!(t.brokers[1].partitions[0].role, R::Follower as i32);
    assert_eq!(t.brokers[1].partitions[1].role, R::Inactive as i32);
    assert!(t.brokers[2].partitions.is_empty());
    // Each broker's own version, as it reported it.
    let versions: Vec<&str> = t.brokers.iter().map(|b| b.version.as_str()).collect();
    assert_eq!(versions, ["0.9.0", VERSION, ""]);
    // A leader that lost its majority still leads, but its partition is unhealthy
    // on every broker that reports it.
    view.reports.get_mut(&1).unwrap()[0].majority_lost = true;
    let t = zeebe_topology(&view);
    assert_eq!(
        (
            t.brokers[0].partitions[0].role,
            t.brokers[0].partitions[0].health
        ),
        (R::Leader as i32, H::Unhealthy as i32)
    );
    assert_eq!(t.brokers[1].partitions[0].health, H::Unhealthy as i32);
    // Broker 1 handed partition 1 to broker 2, which said so before the next
    // round: broker 2 is its leader, broker 1 a follower.
    view.reports.get_mut(&1).unwrap()[0].majority_lost = false;
    view.leaders
        .insert(PartitionId(1), Leader { node: 2, term: 4 });
    let t = zeebe_topology(&view);
    let roles: Vec<i32> = t.brokers[..2]
        .iter()
        .map(|b| b.partitions[0].role)
        .collect();
    assert_eq!(roles, [R::Follower as i32, R::Leader as i32]);
    // Broker 2's storage failed: its replicas are stopped, and dead.
    view.storage_failures
        .insert(2, "flushing the log to disk (fdatasync) failed: EIO".into());
    view.reports
        .insert(2, vec![report(1, "shutdown"), report(2, "shutdown")]);
    view.leaders
        .insert(PartitionId(1), Leader { node: 1, term: 5 });
    let t = zeebe_topology(&view);
    let b2: Vec<(i32, i32)> = t.brokers[1]
        .partitions
        .iter()
        .map(|p| (p.role, p.health))
        .collect();
    assert_eq!(b2, [(R::Inactive as i32, H::Dead as i32); 2]);
    assert_eq!(t.brokers[0].partitions[0].health, H::Healthy as i32);
}
