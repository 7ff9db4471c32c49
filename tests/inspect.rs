//! Seeing inside a running cluster: jobs listed and counted across partitions,
//! incidents found and retried or cancelled, from the client, the CLI and the
//! status page (loaded in headless Chromium, and driven by Playwright for a retry).

use crate::common;

use common::{serial, Cluster, ClusterOpts};
use courier_client::{ActivateJobs, Client, JobFilter, JobState, NewJob};
use std::collections::BTreeSet;
use std::time::Duration;

/// Every job matching `filter`, page by page of `limit`; each page's cursor must
/// move on.
async fn list_all(c: &Client, filter: &JobFilter, limit: i32) -> Vec<courier_client::Job> {
    let mut all = Vec::new();
    let mut cursor = String::new();
    for _ in 0..1000 {
        let page = c
            .list_jobs(filter.clone(), &cursor, limit)
            .await
            .expect("list");
        assert!(page.jobs.len() <= limit as usize, "a page within its limit");
        all.extend(page.jobs);
        if page.cursor.is_empty() {
            return all;
        }
        assert_ne!(page.cursor, cursor, "the cursor moves on");
        cursor = page.cursor;
    }
    panic!("no end of the listing after 1000 pages");
}

fn of_type(t: &str) -> JobFilter {
    JobFilter {
        r#type: t.into(),
        ..JobFilter::default()
    }
}

/// Runs the `courier` CLI against `addr` with `args` and `--json`: its output.
fn cli_json(addr: &str, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(common::courier_bin())
        .args(args)
        .args(["--json", "--address", addr])
        .output()
        .expect("run courier");
    assert!(
        out.status.success(),
        "courier {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

/// Jobs on every partition are listed once each, in key order, through pages
/// smaller than the result; filters by type, state and creation time hold;
/// statistics count each state; incidents are found with their error, retried
/// through the bulk call and the CLI, and cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_listed_counted_and_incidents_retried_across_partitions() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    cluster.wait_for_leaders(Duration::from_secs(30)).await;
    let c = cluster.client();
    let addr = cluster.gateway_addrs[0].clone();

    let mut created = BTreeSet::new();
    for _ in 0..25 {
        created.insert(
            c.create_job(NewJob::new("listed"))
                .await
                .expect("create")
                .key,
        );
    }
    c.create_job(NewJob::new("other")).await.expect("create");
    let partitions: BTreeSet<i64> = created.iter().map(|k| k >> 51).collect();
    assert!(
        partitions.len() > 1,
        "jobs on several partitions: {partitions:?}"
    );

    let listed = list_all(&c, &of_type("listed"), 4).await;
    let keys: Vec<i64> = listed.iter().map(|j| j.key).collect();
    assert_eq!(
        keys,
        created.iter().copied().collect::<Vec<_>>(),
        "each once, in key order"
    );
    assert!(listed
        .iter()
        .all(|j| j.state == JobState::Activatable as i32));
    assert!(
        listed.iter().all(|j| j.variables.is_empty()),
        "no payload in a listing"
    );
    let later = JobFilter {
        created_after: listed[0].created_at + 1_000_000,
        ..of_type("listed")
    };
    assert!(list_all(&c, &later, 10).await.is_empty());

    // Three become incidents, two are activated and stay so.
    let got = c
        .activate_jobs(
            ActivateJobs::new("listed")
                .max_jobs(5)
                .timeout(Duration::from_secs(300)),
        )
        .await
        .expect("activate");
    assert_eq!(got.len(), 5);
    for j in &got[..3] {
        c.fail_job(j.key, 0, "disk on fire", Duration::ZERO)
            .await
            .expect("fail");
    }
    let incidents = JobFilter {
        states: vec![JobState::Incident as i32],
        ..of_type("listed")
    };
    let found = list_all(&c, &incidents, 2).await;
    let want: BTreeSet<i64> = got[..3].iter().map(|j| j.key).collect();
    assert_eq!(found.iter().map(|j| j.key).collect::<BTreeSet<_>>(), want);
    assert!(found.iter().all(|j| j.error_message == "disk on fire"));

    let stats = c.job_stats(of_type("listed")).await.expect("stats");
    assert_eq!(stats.types.len(), 1);
    let s = &stats.types[0];
    assert_eq!(
        (s.activatable, s.activated, s.incident, s.failed_back_off),
        (20, 2, 3, 0),
        "{s:?}"
    );
    assert!(s.oldest_waiting_created_at > 0 && s.oldest_waiting_created_at <= stats.now);
    assert!(s.activations_per_second >= 0.0);

    // The CLI sees the same, and retries one incident's type filter at a time.
    let cli = cli_json(&addr, &["stats", "--type", "listed"]);
    assert_eq!(cli["types"][0]["incident"], 3, "{cli}");
    let cli = cli_json(
        &addr,
        &["job", "list", "--type", "listed", "--state", "incident"],
    );
    assert_eq!(cli.as_array().map(Vec::len), Some(3), "{cli}");

    // Bulk retry of one page, then the rest through the CLI.
    let first = c
        .update_jobs_retries(incidents.clone(), 2, "", 1)
        .await
        .expect("bulk retry");
    assert_eq!(first.keys.len(), 1);
    assert!(first.failures.is_empty(), "{:?}", first.failures);
    let cli = cli_json(&addr, &["incidents", "--type", "listed", "--retry", "2"]);
    assert_eq!(cli["retried"].as_array().map(Vec::len), Some(2), "{cli}");
    for k in &want {
        let j = c.get_job(*k).await.expect("get");
        assert_eq!(
            (j.state, j.retries),
            (JobState::Activatable as i32, 2),
            "job {k}"
        );
    }
    assert!(list_all(&c, &incidents, 10).await.is_empty());

    // An incident cancelled is gone; bulk calls refuse a bad retry count.
    let j = c
        .activate_jobs(ActivateJobs::new("other").max_jobs(1))
        .await
        .expect("activate")
        .remove(0);
    c.fail_job(j.key, 0, "no", Duration::ZERO)
        .await
        .expect("fail");
    let cancelled = c
        .cancel_jobs(of_type("other"), "", 10)
        .await
        .expect("cancel");
    assert_eq!(cancelled.keys, vec![j.key]);
    assert!(c.get_job(j.key).await.is_err());
    let refused = c
        .update_jobs_retries(incidents, 0, "", 10)
        .await
        .expect_err("retries 0");
    assert!(
        refused.to_string().contains("INVALID_ARGUMENT"),
        "{refused}"
    );
    let refused = c
        .list_jobs(JobFilter::default(), "not-a-cursor", 1)
        .await
        .expect_err("cursor");
    assert!(refused.to_string().contains("cursor"), "{refused}");
}

/// The page's rendered DOM, after its script ran.
/// A browser that dies of a signal (it segfaults now and then in this sandbox, with
/// no D-Bus) is started again, at most three times; any other failure fails the test.
fn page_dom(metrics_addr: &str) -> String {
    use std::os::unix::process::ExitStatusExt;
    let run = || {
        std::process::Command::new("chromium-headless-shell")
            .args([
                "--no-sandbox",
                "--disable-gpu",
                "--virtual-time-budget=3000",
                "--dump-dom",
                &format!("http://{metrics_addr}/"),
            ])
            .output()
            .expect("chromium-headless-shell is required for the status page test (scripts/test.sh installs it)")
    };
    let mut out = run();
    for _ in 0..3 {
        if out.status.signal().is_none() {
            break;
        }
        out = run();
    }
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The waiting count in the page's row of `job_type`, if it has one.
fn waiting_in_page(dom: &str, job_type: &str) -> Option<u64> {
    let row = dom
        .split(&format!("<tr data-type=\"{job_type}\">"))
        .nth(1)?;
    let cell = row.split("<td class=\"n count\">").nth(1)?;
    cell.split('<').next()?.trim().parse().ok()
}

/// The status page, loaded in headless Chromium from a gateway's metrics address,
/// shows a created job's type with its count, and updates once the job is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_a_jobs_type_and_updates_when_it_completes() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    cluster.wait_for_leaders(Duration::from_secs(30)).await;
    let c = cluster.client();
    let page = cluster.gateway_metrics[0].clone();
    let key = c
        .create_job(NewJob::new("page-type"))
        .await
        .expect("create")
        .key;

    let mut dom = String::new();
    common::wait_until(Duration::from_secs(30), "the page shows the job", || {
        dom = page_dom(&page);
        std::future::ready(waiting_in_page(&dom, "page-type") == Some(1))
    })
    .await;
    assert!(
        dom.contains("LEADER") || dom.contains("class=\"leader\""),
        "brokers shown"
    );

    let got = c
        .activate_jobs(ActivateJobs::new("page-type").max_jobs(1))
        .await
        .expect("activate");
    assert_eq!(got[0].key, key);
    c.complete_job(key, "").await.expect("complete");
    common::wait_until(
        Duration::from_secs(30),
        "the page drops the done job",
        || {
            dom = page_dom(&page);
            std::future::ready(!dom.contains("data-type=\"page-type\"") && dom.contains("no jobs"))
        },
    )
    .await;
}

/// A stuck job found, understood and retried from the status page, as an operator
/// would: Playwright drives headless Chromium to the job's incident row, checks it
/// shows the worker's error, and clicks Retry; the job is then activatable again
/// with the page's retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_job_is_found_and_retried_from_the_status_page() {
    let _g = serial().await;
    let cluster = Cluster::start(ClusterOpts::default()).await;
    cluster.wait_for_leaders(Duration::from_secs(30)).await;
    let c = cluster.client();
    let key = c
        .create_job(NewJob::new("page-incident"))
        .await
        .expect("create")
        .key;
    let got = c
        .activate_jobs(ActivateJobs::new("page-incident").max_jobs(1))
        .await
        .expect("activate");
    assert_eq!(got[0].key, key);
    c.fail_job(key, 0, "printer out of paper", Duration::ZERO)
        .await
        .expect("fail");

    let compat = common::compat_dir();
    assert!(
        compat.join("node_modules/playwright-core").exists(),
        "playwright-core not found: run `npm ci --prefix tests/compat` (scripts/test.sh does)"
    );
    let out = tokio::process::Command::new("node")
        .arg(compat.join("page-retry.mjs"))
        .args([
            &format!("http://{}/", cluster.gateway_metrics[0]),
            &key.to_string(),
            "printer out of paper",
        ])
        .output()
        .await
        .expect("`node` is required for the status page test");
    assert!(
        out.status.success(),
        "the page's retry: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let j = c.get_job(key).await.expect("get");
    assert_eq!((j.state, j.retries), (JobState::Activatable as i32, 3));
    let again = c
        .activate_jobs(ActivateJobs::new("page-incident").max_jobs(1))
        .await
        .expect("activate");
    assert_eq!(again.iter().map(|j| j.key).collect::<Vec<_>>(), vec![key]);
}
