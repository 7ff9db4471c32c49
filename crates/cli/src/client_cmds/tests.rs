use super::*;
use clap::Parser;
use courier_proto::gateway_protocol::{BrokerInfo, Partition};

#[derive(Parser, Debug)]
struct TestCli {
    #[command(flatten)]
    opts: ClientOpts,
    #[command(subcommand)]
    cmd: JobCmd,
}

fn parse(args: &[&str]) -> Result<TestCli, clap::Error> {
    TestCli::try_parse_from(std::iter::once("courier-job").chain(args.iter().copied()))
}

#[test]
fn durations_take_units_or_bare_milliseconds() {
    let ms = |s| parse_duration(s).map(|d| d.as_millis());
    assert_eq!(ms("500ms"), Ok(500));
    assert_eq!(ms("10s"), Ok(10_000));
    assert_eq!(ms("5m"), Ok(300_000));
    assert_eq!(ms("1h"), Ok(3_600_000));
    assert_eq!(ms("250"), Ok(250));
    assert_eq!(ms("0"), Ok(0));
    assert_eq!(ms("1.5s"), Ok(1_500));
    assert_eq!(ms("0.25s"), Ok(250));
    assert_eq!(ms("1.5m"), Ok(90_000));
    assert_eq!(ms("2.0ms"), Ok(2));
    let e = parse_duration("1.5ms").unwrap_err();
    assert!(e.contains("whole milliseconds"), "{e}");
    for bad in [
        "",
        "s",
        ".5s",
        "1.s5",
        "1..5s",
        "1.2.3s",
        "0.0001s",
        "-1",
        "10 s",
        "3d",
        "1sm",
        "99999999999999999999h",
    ] {
        assert!(parse_duration(bad).is_err(), "{bad:?} was accepted");
    }
}

#[test]
fn create_defaults_and_options() {
    let cli = parse(&["create", "payment"]).unwrap();
    assert!(!cli.opts.json);
    assert_eq!(
        cli.cmd,
        JobCmd::Create {
            job_type: "payment".into(),
            variables: None,
            headers: None,
            retries: None,
            tenant: None,
            count: 1,
        }
    );
    let cli = parse(&[
        "create",
        "payment",
        "--variables",
        r#"{"amount":42}"#,
        "--headers",
        r#"{"k":"v"}"#,
        "--retries",
        "5",
        "--tenant",
        "acme",
        "--count",
        "1000",
        "--json",
        "--address",
        "gw:1",
        "--retry-budget",
        "2s",
    ])
    .unwrap();
    assert!(cli.opts.json);
    assert_eq!(cli.opts.address, "gw:1");
    assert_eq!(cli.opts.retry_budget, Duration::from_secs(2));
    assert_eq!(
        cli.cmd,
        JobCmd::Create {
            job_type: "payment".into(),
            variables: Some(json!({"amount": 42})),
            headers: Some(json!({"k": "v"})),
            retries: Some(5),
            tenant: Some("acme".into()),
            count: 1000,
        }
    );
}

#[test]
fn bad_arguments_are_refused_before_any_request() {
    for args in [
        &["create"][..],
        &["create", "t", "--count", "0"],
        &["create", "t", "--variables", "[1]"],
        &["create", "t", "--variables", "{"],
        &["activate", "t", "--max", "0"],
        &["activate", "t", "--timeout", "soon"],
        &["complete", "abc"],
        &["throw-error", "1"],
        &["update-retries", "1"],
        &["update-timeout", "1"],
    ] {
        assert!(parse(args).is_err(), "{args:?} was accepted");
    }
}

#[test]
fn activate_defaults_and_options() {
    let cli = parse(&["activate", "payment"]).unwrap();
    assert_eq!(
        cli.cmd,
        JobCmd::Activate {
            job_type: "payment".into(),
            max: 1,
            timeout: Duration::from_secs(300),
            worker: "courier-cli".into(),
            request_timeout: Duration::ZERO,
            tenants: vec![],
            fetch_variables: vec![],
        }
    );
    let cli = parse(&[
        "activate",
        "payment",
        "--max",
        "32",
        "--timeout",
        "10s",
        "--worker",
        "w",
        "--request-timeout",
        "500ms",
        "--tenant",
        "a",
        "--tenant",
        "b",
        "--fetch-variable",
        "amount",
    ])
    .unwrap();
    assert_eq!(
        cli.cmd,
        JobCmd::Activate {
            job_type: "payment".into(),
            max: 32,
            timeout: Duration::from_secs(10),
            worker: "w".into(),
            request_timeout: Duration::from_millis(500),
            tenants: vec!["a".into(), "b".into()],
            fetch_variables: vec!["amount".into()],
        }
    );
}

#[test]
fn key_commands() {
    let key = "2251799813685249";
    let cases = [
        (
            vec!["complete", key, "--variables", r#"{"ok":true}"#],
            JobCmd::Complete {
                key: 2251799813685249,
                variables: Some(json!({"ok": true})),
            },
        ),
        (
            vec!["fail", key],
            JobCmd::Fail {
                key: 2251799813685249,
                retries: 0,
                message: String::new(),
                backoff: Duration::ZERO,
            },
        ),
        (
            vec![
                "fail",
                key,
                "--retries",
                "2",
                "--message",
                "boom",
                "--backoff",
                "1m",
            ],
            JobCmd::Fail {
                key: 2251799813685249,
                retries: 2,
                message: "boom".into(),
                backoff: Duration::from_secs(60),
            },
        ),
        (
            vec!["throw-error", key, "--code", "NO_FUNDS"],
            JobCmd::ThrowError {
                key: 2251799813685249,
                code: "NO_FUNDS".into(),
                message: String::new(),
            },
        ),
        (
            vec!["update-retries", key, "--retries", "3"],
            JobCmd::UpdateRetries {
                key: 2251799813685249,
                retries: 3,
            },
        ),
        (
            vec!["update-timeout", key, "--timeout", "1h"],
            JobCmd::UpdateTimeout {
                key: 2251799813685249,
                timeout: Duration::from_secs(3600),
            },
        ),
        (
            vec!["cancel", key],
            JobCmd::Cancel {
                key: 2251799813685249,
            },
        ),
        (
            vec!["get", key],
            JobCmd::Get {
                key: 2251799813685249,
            },
        ),
    ];
    for (args, expected) in cases {
        assert_eq!(parse(&args).unwrap().cmd, expected, "{args:?}");
    }
}

#[test]
fn epoch_ms_format_as_utc() {
    assert_eq!(fmt_epoch_ms(0), "-");
    assert_eq!(fmt_epoch_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
    assert_eq!(fmt_epoch_ms(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
    assert_eq!(fmt_epoch_ms(-1), "1969-12-31T23:59:59.999Z");
}

fn partition(id: i32, role: PartitionBrokerRole) -> Partition {
    Partition {
        partition_id: id,
        role: role as i32,
        health: PartitionBrokerHealth::Healthy as i32,
    }
}

#[test]
fn topology_report_names_each_partitions_leader() {
    use PartitionBrokerRole::{Follower, Leader};
    let t = TopologyResponse {
        brokers: vec![
            BrokerInfo {
                node_id: 1,
                host: "10.0.0.2".into(),
                port: 26501,
                partitions: vec![partition(2, Follower), partition(1, Follower)],
                version: "0.1.0".into(),
            },
            BrokerInfo {
                node_id: 0,
                host: "10.0.0.1".into(),
                port: 26501,
                partitions: vec![partition(1, Leader), partition(2, Follower)],
                version: "0.1.0".into(),
            },
            // Has never answered the gateway.
            BrokerInfo {
                node_id: 2,
                host: "10.0.0.3".into(),
                port: 26501,
                partitions: vec![],
                version: String::new(),
            },
        ],
        cluster_size: 3,
        partitions_count: 3,
        replication_factor: 2,
        gateway_version: "0.1.0".into(),
    };
    let text = render_topology(&t);
    let expected = "\
cluster size        3
partitions          3
replication factor  2
gateway version     0.1.0

BROKER  ADDRESS         VERSION  PARTITIONS
0       10.0.0.1:26501  0.1.0    1 leader healthy, 2 follower healthy
1       10.0.0.2:26501  0.1.0    1 follower healthy, 2 follower healthy
2       10.0.0.3:26501  -        no answer: down or unreachable (replicas of 2, 3)

PARTITION  LEADER
1          broker 0 (10.0.0.1:26501)
2          no leader
3          no leader
";
    assert_eq!(text, expected);

    let v = topology_json(&t);
    assert_eq!(v["partitionsCount"], 3);
    assert_eq!(v["brokers"][1]["partitions"][0]["role"], "LEADER");
    assert_eq!(v["brokers"][1]["partitions"][0]["health"], "HEALTHY");
}

#[test]
fn a_silent_broker_is_told_apart_from_one_without_replicas() {
    let broker = |node_id: i32, partitions| BrokerInfo {
        node_id,
        host: "127.0.0.1".into(),
        port: 26600 + node_id,
        partitions,
        version: "0.1.0".into(),
    };
    // Four brokers, two partitions, one replica each: brokers 3 and 4 hold none.
    let t = TopologyResponse {
        brokers: vec![
            broker(1, vec![partition(1, PartitionBrokerRole::Leader)]),
            broker(2, vec![]),
            broker(3, vec![]),
            broker(4, vec![]),
        ],
        cluster_size: 4,
        partitions_count: 2,
        replication_factor: 1,
        gateway_version: "0.1.0".into(),
    };
    let text = render_topology(&t);
    assert!(
        text.contains(
            "2       127.0.0.1:26602  0.1.0    no answer: down or unreachable (replicas of 2)\n"
        ),
        "{text}"
    );
    for node in [3, 4] {
        assert!(
            text.contains(&format!(
                "{node}       127.0.0.1:2660{node}  0.1.0    none (holds no replica)\n"
            )),
            "{text}"
        );
    }
}

#[test]
fn job_json_embeds_documents_and_keeps_keys_numeric() {
    let j = Job {
        key: 2251799813685249,
        r#type: "payment".into(),
        state: JobState::Activated as i32,
        variables: r#"{"a":1}"#.into(),
        custom_headers: r#"{"h":"x"}"#.into(),
        ..Default::default()
    };
    let v = job_json(&j);
    assert_eq!(v["key"], json!(2251799813685249i64));
    assert_eq!(v["state"], "ACTIVATED");
    assert_eq!(v["variables"], json!({"a": 1}));
    assert_eq!(v["customHeaders"], json!({"h": "x"}));
    let text = render_job(&j);
    assert!(text.contains("state      ACTIVATED\n"), "{text}");
    assert!(text.contains("headers    {\"h\":\"x\"}\n"), "{text}");
    assert!(text.contains("last error -\n"), "{text}");
}
