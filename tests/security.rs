//! Security on real processes: brokers that speak mutual TLS among themselves and
//! with the gateway, a gateway that speaks TLS to clients and takes static tokens
//! and OAuth JWTs (from the tests' own provider, see `common::secure`), and tenants
//! kept apart on every command.

use crate::common;

use common::secure::{Secure, ADMIN_TOKEN, AUDIENCE};
use common::{serial, wait_until, Cluster, ClusterOpts};
use courier_client::{
    ActivateJobs, Client, ClientError, Credentials, NewJob, OAuthCredentials, Security, StreamJobs,
};
use courier_proto::cluster::{broker_client::BrokerClient, BrokerTopologyRequest};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

/// Static tokens of the tenant tests: `a` sees tenant "a" only; `b` sees "b" and
/// `<default>`.
const TOKEN_A: &str = "token-of-tenant-a-0123";
const TOKEN_B: &str = "token-of-tenant-b-0123";

async fn secure() -> Arc<Secure> {
    Secure::new(
        &[("a", TOKEN_A, &["a"]), ("b", TOKEN_B, &["b", "<default>"])],
        &[("billing-worker", "billing-secret", &["<default>"])],
    )
    .await
}

fn client(cluster: &Cluster, security: &Security) -> Client {
    Client::connect_with(&cluster.gateway_addr, security)
        .expect("client")
        .with_retry_budget(Duration::from_secs(10))
}

fn code(e: ClientError) -> Option<Code> {
    e.code()
}

/// A request with `security` that must fail UNAUTHENTICATED and say `says`.
async fn unauthenticated(cluster: &Cluster, security: Security, says: &str) {
    let c = client(cluster, &security).with_retry_budget(Duration::ZERO);
    let e = c.topology().await.expect_err("refused");
    let text = e.to_string();
    assert_eq!(e.code(), Some(Code::Unauthenticated), "{text}");
    assert!(text.contains(says), "expected '{says}' in: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_cluster_serves_authenticated_clients_over_tls_and_refuses_the_rest() {
    let _g = serial().await;
    let s = secure().await;
    let cluster = Cluster::start(ClusterOpts {
        secure: Some(s.clone()),
        ..ClusterOpts::default()
    })
    .await;

    // A static token: create, stream (pushed over TLS through mTLS links), complete.
    let admin = cluster.client();
    let mut stream = admin
        .stream_activated_jobs(StreamJobs::new("secure-push").worker("w"))
        .await
        .expect("stream");
    // One registration per broker.
    common::wait_registered(&cluster, 3.0).await;
    let created = admin
        .create_job(NewJob::new("secure-push"))
        .await
        .expect("create");
    let job = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("a pushed job in time")
        .expect("stream open")
        .expect("a job");
    assert_eq!(job.key, created.key);
    admin.complete_job(job.key, "{}").await.expect("complete");

    // OAuth client credentials: one token fetched, then cached for every call.
    let oauth = Security {
        tls_ca: Some(s.ca()),
        credentials: Credentials::OAuth(OAuthCredentials {
            client_id: "billing-worker".into(),
            client_secret: "billing-secret".into(),
            token_url: s.oauth.token_url(),
            audience: AUDIENCE.into(),
            scope: String::new(),
        }),
    };
    let worker = client(&cluster, &oauth);
    let key = worker
        .create_job(NewJob::new("secure-poll"))
        .await
        .expect("create")
        .key;
    let jobs = worker
        .activate_jobs(ActivateJobs::new("secure-poll").worker("w").max_jobs(1))
        .await
        .expect("activate");
    assert_eq!(jobs.iter().map(|j| j.key).collect::<Vec<_>>(), vec![key]);
    worker.complete_job(key, "{}").await.expect("complete");
    assert_eq!(s.oauth.issued.load(std::sync::atomic::Ordering::SeqCst), 1);

    // Every way to be refused.
    let plaintext = cluster.gateway_addr.clone();
    let plain = Client::connect(&plaintext)
        .unwrap()
        .with_retry_budget(Duration::ZERO);
    let e = plain
        .topology()
        .await
        .expect_err("a plaintext client is refused");
    // What the client reads depends on when the gateway drops the connection (its
    // TLS alert read as an HTTP/2 frame, or a broken pipe); refused it is either way.
    assert_ne!(e.code(), Some(Code::Ok), "{e}");
    // Every way to be refused UNAUTHENTICATED, and what the answer says.
    let with = |credentials| Security {
        tls_ca: Some(s.ca()),
        credentials,
    };
    let jwt = |claims| with(Credentials::Token(s.oauth.sign(claims)));
    let past = courier_proto::domain::epoch_ms() / 1000 - 3600;
    for (security, says) in [
        (with(Credentials::None), "no credentials"),
        (
            with(Credentials::Token("not-a-known-token-0123".into())),
            "unknown token",
        ),
        (jwt(serde_json::json!({"exp": past})), "expired"),
        (
            jwt(serde_json::json!({"aud": "someone-else"})),
            "wrong audience",
        ),
        (
            jwt(serde_json::json!({"iss": "https://evil.test/"})),
            "wrong issuer",
        ),
    ] {
        unauthenticated(&cluster, security, says).await;
    }
    let wrong_ca = Security {
        tls_ca: Some(s.path("ca-key.pem").into()),
        credentials: Credentials::Token(ADMIN_TOKEN.into()),
    };
    let c = client(&cluster, &wrong_ca).with_retry_budget(Duration::ZERO);
    assert!(
        c.topology().await.is_err(),
        "a client that cannot check the gateway's certificate gets nowhere"
    );
    assert!(
        cluster
            .gateway_metric(0, "courier_gateway_auth_refused_total")
            .await
            >= 5.0
    );
    assert!(
        cluster
            .gateway_metric(0, "courier_gateway_tls_refused_total")
            .await
            >= 1.0
    );
    // A JWT of the provider with the right audience and issuer passes as is.
    let ok = client(&cluster, &jwt(serde_json::json!({})));
    ok.topology().await.expect("a valid JWT");

    // The health service stays open for load balancers: TLS, no credentials.
    let channel =
        tonic::transport::Endpoint::from_shared(format!("https://{}", cluster.gateway_addr))
            .unwrap()
            .tls_config(tonic::transport::ClientTlsConfig::new().ca_certificate(
                tonic::transport::Certificate::from_pem(std::fs::read(s.ca()).unwrap()),
            ))
            .unwrap()
            .connect()
            .await
            .expect("TLS to the gateway");
    let health = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health without credentials");
    assert_eq!(
        health.into_inner().status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    // `courier worker` with Zeebe's OAuth variables and the CA in COURIER_TLS_CA.
    let mut env = s.zeebe_env("billing-worker", "billing-secret", cluster.dir.path());
    env.push(("COURIER_TLS_CA", s.path("ca.pem")));
    env.push(("COURIER_ADDRESS", cluster.gateway_addr.clone()));
    let cli = common::ClientProc::spawn_with_env(
        std::path::Path::new(common::courier_bin()),
        &["worker", "secure-cli", "--handler", "cat"],
        &env,
        cluster.dir.path().join("cli-worker.out"),
    );
    let keys = common::create_in_batches(&admin, "secure-cli", 1, 5).await;
    common::assert_all_completed(&admin, &keys).await;
    wait_until(
        Duration::from_secs(10),
        "the CLI worker reports 5 jobs",
        || {
            let n = cli.output().matches("completed job").count();
            async move { n == 5 }
        },
    )
    .await;

    // After all that, the cluster still serves everyone else.
    let k = admin
        .create_job(NewJob::new("after"))
        .await
        .expect("create")
        .key;
    admin.cancel_job(k).await.expect("cancel");
}

/// A connection to a broker's port with `tls` (none: plaintext) that must be refused.
async fn broker_refuses(addr: &str, tls: Option<tonic::transport::ClientTlsConfig>) {
    let uri = courier_proto::tls::peer_uri(addr, tls.is_some());
    let mut endpoint = tonic::transport::Endpoint::from_shared(uri)
        .unwrap()
        .connect_timeout(Duration::from_secs(2));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).unwrap();
    }
    let answer = async {
        let channel = endpoint.connect().await.map_err(|e| e.to_string())?;
        let mut broker = BrokerClient::new(channel.clone());
        broker
            .topology(BrokerTopologyRequest {})
            .await
            .map_err(|e| e.to_string())?;
        // Nor Raft traffic: an election request on the peer stream.
        let mut raft = courier_proto::cluster::raft_client::RaftClient::new(channel);
        raft.stream(futures::stream::empty())
            .await
            .map_err(|e| e.to_string())?;
        Ok::<(), String>(())
    };
    let r = tokio::time::timeout(Duration::from_secs(5), answer).await;
    assert!(
        !matches!(r, Ok(Ok(()))),
        "{addr} served a peer without the cluster's certificate"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokers_take_no_connection_without_a_certificate_of_the_cluster() {
    let _g = serial().await;
    let s = secure().await;
    let cluster = Cluster::start(ClusterOpts {
        secure: Some(s.clone()),
        ..ClusterOpts::one_broker(1)
    })
    .await;
    let addr = cluster.broker_addrs[&1].clone();
    let ca_only = || {
        tonic::transport::ClientTlsConfig::new().ca_certificate(
            tonic::transport::Certificate::from_pem(std::fs::read(s.ca()).unwrap()),
        )
    };
    // Plaintext; TLS without a client certificate; a certificate of another CA.
    broker_refuses(&addr, None).await;
    broker_refuses(&addr, Some(ca_only())).await;
    let other = tempfile::tempdir().unwrap();
    let dir = other.path().display().to_string();
    common::secure::run_courier(&["cert", "ca", "--out", &dir]);
    common::secure::run_courier(&["cert", "issue", "forger", "--ca", &dir, "--out", &dir]);
    let forged = tonic::transport::Identity::from_pem(
        std::fs::read(other.path().join("forger.pem")).unwrap(),
        std::fs::read(other.path().join("forger-key.pem")).unwrap(),
    );
    broker_refuses(&addr, Some(ca_only().identity(forged))).await;
    let refused = common::metric(
        &cluster.broker_metrics[&1],
        "courier_broker_tls_refused_total",
    )
    .await;
    assert!(refused >= 3.0, "refused handshakes counted: {refused}");
    // With the cluster's certificate it answers.
    assert!(cluster.broker_topology(1).await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_kept_apart_on_every_command() {
    let _g = serial().await;
    let s = secure().await;
    let cluster = Cluster::start(ClusterOpts {
        secure: Some(s.clone()),
        ..ClusterOpts::one_broker(2)
    })
    .await;
    let a = client(&cluster, &s.with_token("a"));
    let b = client(&cluster, &s.with_token("b"));

    // A create without a tenant is the caller's default tenant; another's is denied.
    let ka = a
        .create_job(NewJob::new("iso").tenant_id("a"))
        .await
        .expect("create")
        .key;
    let kd = a.create_job(NewJob::new("iso")).await.expect("create").key;
    assert_eq!(a.get_job(kd).await.expect("get").tenant_id, "a");
    let e = b
        .create_job(NewJob::new("iso").tenant_id("a"))
        .await
        .expect_err("denied");
    assert_eq!(code(e), Some(Code::PermissionDenied));
    let kb = b.create_job(NewJob::new("iso")).await.expect("create").key;
    assert_eq!(b.get_job(kb).await.expect("get").tenant_id, "<default>");

    // Every command of b on a's job: NOT_FOUND, as for a job that does not exist.
    let not_found = |r: Result<(), ClientError>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.code(), Some(Code::NotFound), "{what}: {e}");
    };
    not_found(b.get_job(ka).await.map(|_| ()), "get");
    not_found(b.complete_job(ka, "{}").await, "complete");
    not_found(b.fail_job(ka, 1, "no", Duration::ZERO).await, "fail");
    not_found(b.throw_error(ka, "E", "no").await, "throw error");
    not_found(b.update_job_retries(ka, 5).await, "update retries");
    not_found(
        b.update_job_timeout(ka, Duration::from_secs(5)).await,
        "update timeout",
    );
    not_found(b.cancel_job(ka).await, "cancel");

    // Polls and streams: another's tenant is denied; none asked is the default.
    let e = b
        .activate_jobs(ActivateJobs::new("iso").worker("w").tenant_ids(["a"]))
        .await
        .expect_err("denied");
    assert_eq!(code(e), Some(Code::PermissionDenied));
    let e = b
        .stream_activated_jobs(StreamJobs::new("iso").worker("w").tenant_ids(["a"]))
        .await
        .expect_err("denied");
    assert_eq!(code(e), Some(Code::PermissionDenied));
    let got = b
        .activate_jobs(
            ActivateJobs::new("iso")
                .worker("w")
                .max_jobs(10)
                .request_timeout(Duration::ZERO),
        )
        .await
        .expect("activate");
    assert_eq!(
        got.iter().map(|j| j.key).collect::<Vec<_>>(),
        vec![kb],
        "b's default tenant only"
    );
    let got = a
        .activate_jobs(
            ActivateJobs::new("iso")
                .worker("w")
                .max_jobs(10)
                .request_timeout(Duration::ZERO),
        )
        .await
        .expect("activate");
    let mut keys: Vec<i64> = got.iter().map(|j| j.key).collect();
    keys.sort();
    let mut expected = vec![ka, kd];
    expected.sort();
    assert_eq!(keys, expected, "a's jobs, untouched by b");
    for j in &got {
        assert_eq!(j.tenant_id, "a");
        a.complete_job(j.key, "{}")
            .await
            .expect("a completes its own");
    }
    b.complete_job(kb, "{}").await.expect("b completes its own");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_port_certificate_is_reloaded_when_its_files_change() {
    let _g = serial().await;
    let s = secure().await;
    let cluster = Cluster::start(ClusterOpts {
        secure: Some(s.clone()),
        ..ClusterOpts::one_broker(1)
    })
    .await;
    cluster
        .client()
        .topology()
        .await
        .expect("served with the first certificate");
    // A new CA and a gateway certificate of it, written over the files in use.
    let next = tempfile::tempdir().unwrap();
    let dir = next.path().display().to_string();
    common::secure::run_courier(&["cert", "ca", "--out", &dir]);
    common::secure::run_courier(&["cert", "issue", "gateway", "--ca", &dir, "--out", &dir]);
    for f in ["gateway-key.pem", "gateway.pem"] {
        std::fs::copy(next.path().join(f), s.dir.join(f)).unwrap();
    }
    let rotated = Security {
        tls_ca: Some(next.path().join("ca.pem")),
        credentials: Credentials::Token(ADMIN_TOKEN.into()),
    };
    wait_until(
        Duration::from_secs(15),
        "the gateway presents the new certificate",
        || {
            let c = client(&cluster, &rotated).with_retry_budget(Duration::ZERO);
            async move { c.topology().await.is_ok() }
        },
    )
    .await;
    let old = client(&cluster, &s.with_token("admin")).with_retry_budget(Duration::ZERO);
    assert!(
        old.topology().await.is_err(),
        "a new connection no longer gets the old certificate"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn courier_dev_brokers_are_never_open_even_on_loopback() {
    let _g = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let gateway = format!("127.0.0.1:{}", common::free_port());
    let log = dir.path().join("dev.log");
    let _dev = common::Proc::spawn(
        &[
            "dev".into(),
            "--data-dir".into(),
            dir.path().join("data").display().to_string(),
            "--gateway-addr".into(),
            gateway.clone(),
            "--metrics-addr".into(),
            "off".into(),
        ],
        log.clone(),
    );
    let c = Client::connect(&gateway)
        .unwrap()
        .with_retry_budget(Duration::from_secs(20));
    let key = c
        .create_job(NewJob::new("dev"))
        .await
        .expect("dev serves through its gateway")
        .key;
    c.cancel_job(key).await.expect("cancel");
    // The broker's address, as the gateway logs it: brokers=["127.0.0.1:PORT"].
    let text = std::fs::read_to_string(&log).unwrap();
    let broker = text
        .split("brokers=[\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .expect("the gateway names its broker")
        .to_string();
    broker_refuses(&broker, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_without_cluster_tls_beyond_loopback_warns_at_start() {
    let _g = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("broker.log");
    // Listening on every interface; nothing is sent anywhere.
    let _broker = common::Proc::spawn(
        &[
            "broker".into(),
            "--node-id".into(),
            "1".into(),
            "--addr".into(),
            "0.0.0.0:0".into(),
            "--peers".into(),
            "1=0.0.0.0:0".into(),
            "--partitions".into(),
            "1".into(),
            "--data-dir".into(),
            dir.path().join("data").display().to_string(),
        ],
        log.clone(),
    );
    wait_until(Duration::from_secs(20), "the broker warns that its port is open", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        async move { text.contains("THIS BROKER'S PORT IS OPEN") && text.contains("--cluster-ca") }
    })
    .await;
}
