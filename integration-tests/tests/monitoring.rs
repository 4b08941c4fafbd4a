//! The monitoring files (deploy/monitoring) against a real tesserad: every metric the
//! alert rules and the Grafana dashboard name is exported, with the values a user
//! would read off them, and the rules pass their promtool unit tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tessera_integration_tests::{TestDaemon, create_req, rt, shape};

fn monitoring_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/monitoring")
}

fn scrape(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    assert!(head.contains(" 200"), "{head}");
    body.to_string()
}

/// Sample -> value, for every sample line of the exposition.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The metric names of the samples (`name` of `name{labels} value`).
fn sample_names(samples: &BTreeMap<String, f64>) -> BTreeSet<String> {
    samples
        .keys()
        .map(|k| k.split('{').next().unwrap_or(k).to_string())
        .collect()
}

/// The metric families the exposition declares (`# TYPE name type`), with the
/// sample names each can have: a family with no sample yet (a counter nothing has
/// counted) is still exported.
fn family_sample_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix("# TYPE ") else {
            continue;
        };
        let Some((name, ty)) = rest.split_once(' ') else {
            continue;
        };
        match ty {
            "counter" => {
                out.insert(format!("{name}_total"));
            }
            "histogram" => {
                for s in ["_bucket", "_count", "_sum"] {
                    out.insert(format!("{name}{s}"));
                }
            }
            _ => {
                out.insert(name.to_string());
            }
        }
    }
    out
}

/// Every `tessera_*` name a file mentions.
fn names_in(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("tessera_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

fn get(samples: &BTreeMap<String, f64>, key: &str) -> f64 {
    *samples
        .get(key)
        .unwrap_or_else(|| panic!("{key} missing from {:#?}", samples.keys()))
}

const TENANTS: &str = r#"
[metrics]
listen = "127.0.0.1:0"

[tenants.team-a.guaranteed]
mig_slices = 2

[tenants.team-a.burst]
mig_slices = 8
mps_sm_percent = 50
memory = "16GiB"
"#;

#[test]
fn every_metric_the_alert_rules_and_the_dashboard_use_is_exported() {
    let d = TestDaemon::start(TENANTS).unwrap();
    let addr = d.metrics_addr().unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        c.create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap();
        let mut req = create_req("team-a", shape::mps(30, 4));
        req.gpu_index = Some(2);
        c.create_lease(req).await.unwrap();
    });
    // Usage counts seconds held: let some pass.
    std::thread::sleep(Duration::from_millis(1200));
    let text = scrape(&addr);
    let s = samples(&text);
    let exported: BTreeSet<String> = sample_names(&s)
        .into_iter()
        .chain(family_sample_names(&text))
        .collect();

    let rules =
        std::fs::read_to_string(monitoring_dir().join("prometheus/tessera-alerts.yaml")).unwrap();
    let dashboard =
        std::fs::read_to_string(monitoring_dir().join("grafana/tessera-dashboard.json")).unwrap();
    let wanted: BTreeSet<String> = names_in(&rules)
        .into_iter()
        .chain(names_in(&dashboard))
        .collect();
    assert!(
        wanted.len() >= 15,
        "the files name too few metrics: {wanted:?}"
    );
    let missing: Vec<_> = wanted.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "named by deploy/monitoring but not exported: {missing:?}\nexported: {exported:?}"
    );

    // The values behind the quota alert and the dashboard's quota panel.
    let q = |resource: &str| {
        format!("tessera_tenant_quota_used{{tenant=\"team-a\",resource=\"{resource}\"}}")
    };
    let l = |resource: &str, kind: &str| {
        format!(
            "tessera_tenant_quota_limit{{tenant=\"team-a\",resource=\"{resource}\",kind=\"{kind}\"}}"
        )
    };
    assert_eq!(get(&s, &q("mig_slices")), 1.0);
    assert_eq!(get(&s, &q("mps_sm_percent")), 30.0);
    assert_eq!(get(&s, &q("memory_bytes")), (4u64 << 30) as f64);
    assert_eq!(get(&s, &l("mig_slices", "burst")), 8.0);
    assert_eq!(get(&s, &l("mig_slices", "guaranteed")), 2.0);
    assert_eq!(get(&s, &l("memory_bytes", "burst")), (16u64 << 30) as f64);
    // GPU-seconds: a 1g slice (1/7 GPU) and 30 % of an A100's SMs, held a second or more.
    let gpu_s = get(&s, "tessera_usage_gpu_seconds_total{tenant=\"team-a\"}");
    assert!(gpu_s > 0.44 * 1.0 && gpu_s < 0.44 * 60.0, "{gpu_s}");
    // Both CreateLease calls were timed.
    assert!(
        get(
            &s,
            "tessera_api_call_duration_seconds_count{rpc=\"CreateLease\"}"
        ) >= 2.0
    );
    let size = get(&s, "tessera_state_filesystem_size_bytes");
    let avail = get(&s, "tessera_state_filesystem_avail_bytes");
    assert!(size > 0.0 && avail <= size, "{avail} of {size}");
}

#[test]
fn the_alert_rules_pass_their_promtool_unit_tests() {
    let Ok(promtool) = which("promtool") else {
        println!(
            "SKIPPED: promtool is not installed (`make deps` installs Debian's prometheus package for it)"
        );
        return;
    };
    let dir = monitoring_dir().join("prometheus");
    let check = std::process::Command::new(&promtool)
        .args(["check", "rules", "tessera-alerts.yaml"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "promtool check rules:\n{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let test = std::process::Command::new(&promtool)
        .args(["test", "rules", "tests/tessera-alerts.test.yaml"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&test.stdout),
        String::from_utf8_lossy(&test.stderr)
    );
    assert!(test.status.success() && out.contains("SUCCESS"), "{out}");
}

fn which(name: &str) -> Result<PathBuf, ()> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or(())
}
