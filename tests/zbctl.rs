//! Compatibility with a real Zeebe client: the `zbctl` binary (npm package `zbctl`,
//! installed into tests/compat by .ci/run) against a Courier cluster of real processes.

use crate::common;

use common::secure::Secure;
use common::{serial, Cluster, ClusterOpts};
use courier_client::{JobState, NewJob};
use std::path::PathBuf;
use std::process::{Command, Output};

/// The zbctl binary; a missing one fails the test, it never skips it.
fn zbctl() -> PathBuf {
    let path = std::env::var_os("ZBCTL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/compat/node_modules/zbctl/bin/zbctl-cli.linux")
        });
    assert!(
        path.exists(),
        "zbctl not found at {}: run `npm ci --prefix tests/compat` (.ci/run does) or set ZBCTL",
        path.display()
    );
    path
}

fn run(cluster: &Cluster, args: &[&str]) -> Output {
    Command::new(zbctl())
        .args(["--insecure", "--address", &cluster.gateway_addr])
        .args(args)
        .output()
        .expect("run zbctl")
}

fn ok(cluster: &Cluster, args: &[&str]) -> String {
    let out = run(cluster, args);
    assert!(
        out.status.success(),
        "zbctl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zbctl_status_activate_complete_and_fail_work_against_courier() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();

    let status = ok(&cluster, &["status"]);
    assert!(status.contains("Cluster size: 3"), "{status}");
    assert!(status.contains("Partitions count: 3"), "{status}");
    assert!(status.contains("Replication factor: 3"), "{status}");
    assert_eq!(status.matches("Leader, Healthy").count(), 3, "{status}");

    let mut keys = Vec::new();
    for i in 0..3 {
        let job = NewJob::new("zb-pay")
            .variables(format!("{{\"order\":{i},\"note\":\"x\"}}").as_str())
            .custom_headers(r#"{"priority":"high"}"#);
        keys.push(c.create_job(job).await.expect("create").key);
    }

    let out = ok(
        &cluster,
        &[
            "activate",
            "jobs",
            "zb-pay",
            "--maxJobsToActivate",
            "3",
            "--requestTimeout",
            "5s",
            "--worker",
            "zb-worker",
        ],
    );
    let parsed: serde_json::Value = serde_json::from_str(&out).expect("zbctl prints JSON");
    let jobs = parsed["jobs"].as_array().expect("jobs array");
    assert_eq!(jobs.len(), 3, "{out}");
    let mut got: Vec<i64> = jobs
        .iter()
        .map(|j| {
            j["key"]
                .as_str()
                .expect("key as string")
                .parse()
                .expect("int key")
        })
        .collect();
    got.sort();
    let mut want = keys.clone();
    want.sort();
    assert_eq!(got, want);
    for j in jobs {
        assert_eq!(j["type"], "zb-pay");
        assert_eq!(j["worker"], "zb-worker");
        assert_eq!(j["retries"], 3);
        assert_eq!(j["tenantId"], "<default>");
        let vars: serde_json::Value =
            serde_json::from_str(j["variables"].as_str().expect("variables")).expect("JSON");
        assert_eq!(vars["note"], "x");
        let headers: serde_json::Value =
            serde_json::from_str(j["customHeaders"].as_str().expect("headers")).expect("JSON");
        assert_eq!(headers["priority"], "high");
    }

    let (k1, k2, k3) = (
        keys[0].to_string(),
        keys[1].to_string(),
        keys[2].to_string(),
    );
    ok(
        &cluster,
        &["complete", "job", &k1, "--variables", r#"{"done":true}"#],
    );
    assert_eq!(
        c.get_job(keys[0]).await.expect_err("completed").code(),
        Some(tonic::Code::NotFound)
    );
    let again = run(&cluster, &["complete", "job", &k1]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("NotFound"));

    ok(
        &cluster,
        &[
            "fail",
            "job",
            &k2,
            "--retries",
            "1",
            "--errorMessage",
            "boom",
        ],
    );
    let j2 = c.get_job(keys[1]).await.expect("get");
    assert_eq!(j2.state, JobState::Activatable as i32);
    assert_eq!(j2.retries, 1);
    assert_eq!(j2.error_message, "boom");

    ok(
        &cluster,
        &[
            "fail",
            "job",
            &k3,
            "--retries",
            "0",
            "--errorMessage",
            "dead",
        ],
    );
    assert_eq!(
        c.get_job(keys[2]).await.expect("get").state,
        JobState::Incident as i32
    );
    ok(&cluster, &["update", "retries", &k3, "--retries", "2"]);
    assert_eq!(
        c.get_job(keys[2]).await.expect("get").state,
        JobState::Activatable as i32
    );

    // Both runnable again: zbctl activates them once more.
    let out = ok(
        &cluster,
        &[
            "activate",
            "jobs",
            "zb-pay",
            "--maxJobsToActivate",
            "5",
            "--requestTimeout",
            "5s",
        ],
    );
    let parsed: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(parsed["jobs"].as_array().map(Vec::len), Some(2), "{out}");

    // Process RPCs are not Courier's: UNIMPLEMENTED, not a crash.
    let out = run(&cluster, &["create", "instance", "some-process"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Unimplemented"), "{stderr}");
    assert!(
        stderr.contains("CreateProcessInstance is not served") && stderr.contains("job API"),
        "the answer says what is served instead: {stderr}"
    );
    c.topology().await.expect("gateway still serves");
}

/// Kills the child process when the test ends, however it ends.
struct KillOnDrop(std::process::Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zbctl_streaming_worker_completes_500_jobs_pushed_by_courier() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    let c = cluster.client();
    let log = std::fs::File::create(cluster.dir.path().join("zbctl-worker.log")).expect("log");
    let _worker = KillOnDrop(
        Command::new(zbctl())
            .args(["--insecure", "--address", &cluster.gateway_addr])
            .args([
                "create",
                "worker",
                "zb-stream",
                "--handler",
                "cat",
                "--streamEnabled",
            ])
            .args(["--concurrency", "8", "--name", "zbctl-streamer"])
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start zbctl worker"),
    );
    // zbctl's stream registered with every broker.
    common::wait_registered(&cluster, 3.0).await;
    let keys = common::create_in_batches(&c, "zb-stream", 10, 50).await;
    common::wait_until(
        std::time::Duration::from_secs(60),
        "zbctl completed all 500 jobs",
        || async {
            for k in keys.iter().rev() {
                if c.get_job(*k).await.map_err(|e| e.code()) != Err(Some(tonic::Code::NotFound)) {
                    return false;
                }
            }
            true
        },
    )
    .await;
    let (pushed, polled) = cluster.pushed_and_polled().await;
    eprintln!("zbctl got {pushed} jobs pushed and {polled} by polling");
    // zbctl streams and long-polls side by side; push takes as many as the stream's
    // credit (32) allows at a time, polls the rest of a burst. Each job went out once.
    assert_eq!(pushed + polled, 500.0, "{pushed} pushed + {polled} polled");
    assert!(
        pushed >= 150.0,
        "only {pushed} of 500 jobs were pushed ({polled} polled)"
    );
}

/// zbctl's security flags: TLS checked against the cluster's CA (`--certPath`) and
/// OAuth client credentials from the tests' provider, its token cache in the
/// test's own folder.
fn secure_args(cluster: &Cluster, s: &Secure, audience: &str) -> Vec<String> {
    vec![
        "--address".into(),
        cluster.gateway_addr.clone(),
        "--certPath".into(),
        s.path("ca.pem"),
        "--clientId".into(),
        "zbctl-worker".into(),
        "--clientSecret".into(),
        "zbctl-secret".into(),
        "--authzUrl".into(),
        s.oauth.token_url(),
        "--audience".into(),
        audience.into(),
        "--clientCache".into(),
        cluster
            .dir
            .path()
            .join(format!("zbctl-{audience}.yml"))
            .display()
            .to_string(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zbctl_over_tls_with_oauth_client_credentials_completes_jobs() {
    let _g = serial().await;
    let s = Secure::new(&[], &[("zbctl-worker", "zbctl-secret", &["<default>"])]).await;
    let cluster = Cluster::start(ClusterOpts {
        secure: Some(s.clone()),
        ..ClusterOpts::one_broker(2)
    })
    .await;
    let c = cluster.client();
    let zb = |extra: &[String], args: &[&str]| {
        Command::new(zbctl())
            .env("HOME", cluster.dir.path())
            .args(extra)
            .args(args)
            .output()
            .expect("run zbctl")
    };
    let good = secure_args(&cluster, &s, common::secure::AUDIENCE);
    let out = zb(&good, &["status"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("Leader, Healthy"));

    // A token for another audience, and no credentials at all: refused. (zbctl
    // fetches a new token after UNAUTHENTICATED and tries again until its deadline.)
    let out = zb(&secure_args(&cluster, &s, "someone-else"), &["status"]);
    assert!(!out.status.success());
    assert!(
        cluster
            .gateway_metric(0, "courier_gateway_auth_refused_total")
            .await
            >= 1.0
    );
    let tls_only = [
        "--address".to_string(),
        cluster.gateway_addr.clone(),
        "--certPath".into(),
        s.path("ca.pem"),
    ];
    let out = zb(&tls_only, &["status"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Unauthenticated"));

    // A streaming worker over TLS with OAuth completes every job.
    let log = std::fs::File::create(cluster.dir.path().join("zbctl-worker.log")).expect("log");
    let _worker = KillOnDrop(
        Command::new(zbctl())
            .env("HOME", cluster.dir.path())
            .args(&good)
            .args([
                "create",
                "worker",
                "zb-secure",
                "--handler",
                "cat",
                "--streamEnabled",
            ])
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start zbctl worker"),
    );
    common::wait_registered(&cluster, 1.0).await;
    let keys = common::create_in_batches(&c, "zb-secure", 2, 25).await;
    common::assert_all_completed(&c, &keys).await;
    let (pushed, _) = cluster.pushed_and_polled().await;
    assert!(pushed > 0.0, "jobs were pushed over TLS");
}
