//! Operations: usage accounting across restarts, the Prometheus endpoint, and the
//! `tessera usage --csv` export, against the real binaries on simulated GPUs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Write};
use std::time::Duration;

use tessera_integration_tests::{TestDaemon, bin_path, create_req, shape, strip_ansi};
use tessera_proto::v1 as pb;

use tessera_integration_tests::rt;

async fn usage(
    c: &mut pb::tessera_client::TesseraClient<tonic::transport::Channel>,
    tenant: &str,
    from_ms: i64,
    to_ms: i64,
) -> BTreeMap<String, pb::TenantUsage> {
    c.get_usage(pb::GetUsageRequest {
        tenant: tenant.into(),
        from_ms,
        to_ms,
    })
    .await
    .unwrap()
    .into_inner()
    .usage
    .into_iter()
    .map(|u| (u.tenant.clone(), u))
    .collect()
}

use tessera_common::clock::now_ms;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6 * b.abs().max(1.0)
}

#[test]
fn usage_is_weighted_clipped_exported_and_counted_once_across_restarts() {
    let mut d = TestDaemon::start("").unwrap();
    let rt = rt();
    let (a_lease, b_lease) = rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let a = c
            .create_lease(create_req("team-a", shape::mig("3g.40gb")))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let mut req = create_req("team-b", shape::mps(50, 8));
        req.gpu_index = Some(2);
        let b = c
            .create_lease(req)
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let a = c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: a.id.clone(),
                reason: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert!(a.ended_at_ms > a.created_at_ms);
        (a, b)
    });
    let a_secs = (a_lease.ended_at_ms - a_lease.created_at_ms) as f64 / 1000.0;

    let before_restart = rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let t0 = now_ms();
        let all = usage(&mut c, "", 0, 0).await;
        let a = &all["team-a"];
        assert_eq!(a.leases, 1);
        assert!(
            close(a.mig_slice_seconds, 3.0 * a_secs),
            "{a:?} vs {a_secs}s"
        );
        // 3g.40gb holds about 40 GiB (39.5 GiB on an H100-80GB as NVML reports it).
        let gib = a.memory_gib_seconds / a_secs;
        assert!((39.0..=40.0).contains(&gib), "{a:?}: {gib} GiB");
        assert_eq!(a.mps_sm_percent_seconds, 0.0);
        assert_eq!(a.whole_gpu_seconds, 0.0);
        // The live MPS lease counts up to the query.
        let b = &all["team-b"];
        let b_min = (t0 - b_lease.created_at_ms) as f64 / 1000.0;
        assert!(b.mps_sm_percent_seconds >= 50.0 * b_min, "{b:?}");
        assert!(
            close(b.memory_gib_seconds * 50.0, b.mps_sm_percent_seconds * 8.0),
            "{b:?}"
        );
        assert_eq!(b.mig_slice_seconds, 0.0);

        // A window inside team-a's lease counts exactly the window.
        let from = a_lease.created_at_ms + 100;
        let to = a_lease.ended_at_ms - 100;
        let w = usage(&mut c, "team-a", from, to).await;
        assert_eq!(w.len(), 1, "tenant filter: {w:?}");
        assert!(close(
            w["team-a"].mig_slice_seconds,
            3.0 * (to - from) as f64 / 1000.0
        ));
        // A window before everything is empty.
        assert!(
            usage(&mut c, "", 1, a_lease.created_at_ms - 1)
                .await
                .is_empty()
        );
        // from after to is refused.
        let e = c
            .get_usage(pb::GetUsageRequest {
                tenant: String::new(),
                from_ms: 2000,
                to_ms: 1000,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        a.clone()
    });

    // The CLI's CSV export reports the same numbers.
    let out = std::process::Command::new(bin_path("tessera").unwrap())
        .args(["--socket"])
        .arg(&d.socket)
        .args(["usage", "--csv", "--tenant", "team-a"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let csv = String::from_utf8(out.stdout).unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next().unwrap(),
        "tenant,leases,mig_slice_seconds,mps_sm_percent_seconds,memory_gib_seconds,whole_gpu_seconds"
    );
    let row: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(row[0], "team-a");
    assert_eq!(row[1], "1");
    assert!(
        close(row[2].parse().unwrap(), before_restart.mig_slice_seconds),
        "{csv}"
    );

    // A clean restart, then a crash: the ended lease is counted once, the MPS lease
    // that spans both restarts keeps counting from its creation.
    assert_eq!(d.stop().unwrap(), Some(0));
    d.spawn().unwrap();
    d.kill().unwrap();
    d.spawn().unwrap();
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        let all = usage(&mut c, "", 0, 0).await;
        assert_eq!(
            all["team-a"], before_restart,
            "ended lease changed over restarts"
        );
        let b = c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: b_lease.id.clone(),
                reason: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let b_secs = (b.ended_at_ms - b.created_at_ms) as f64 / 1000.0;
        let all = usage(&mut c, "", 0, 0).await;
        let u = &all["team-b"];
        assert_eq!(u.leases, 1);
        assert!(
            close(u.mps_sm_percent_seconds, 50.0 * b_secs),
            "{u:?} vs {b_secs}s"
        );
        assert!(close(u.memory_gib_seconds, 8.0 * b_secs), "{u:?}");
    });
}

/// A minimal HTTP/1.0 GET (the test must not trust the server it checks).
fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}

/// Parse an OpenMetrics text exposition strictly enough to catch malformed output:
/// every sample belongs to a family with a TYPE, names and labels are well-formed,
/// values are numbers, and it ends with `# EOF`. Returns sample -> value.
fn parse_exposition(text: &str) -> BTreeMap<String, f64> {
    let mut families = HashSet::new();
    let mut samples = BTreeMap::new();
    let valid_name = |n: &str| {
        !n.is_empty()
            && n.chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let mut saw_eof = false;
    for line in text.lines() {
        assert!(!saw_eof, "content after # EOF: {line}");
        if line == "# EOF" {
            saw_eof = true;
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest.split_once(' ').unwrap();
            assert!(valid_name(name), "{line}");
            assert!(
                [
                    "counter",
                    "gauge",
                    "histogram",
                    "summary",
                    "info",
                    "unknown",
                    "stateset"
                ]
                .contains(&ty),
                "{line}"
            );
            families.insert(name.to_string());
            continue;
        }
        if line.starts_with("# HELP ") || line.starts_with("# UNIT ") {
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment: {line}");
        let (series, value) = line.rsplit_once(' ').unwrap();
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("value in {line}"));
        let name = series.split('{').next().unwrap();
        assert!(valid_name(name), "{line}");
        // Counters' samples end in _total, histograms' in _bucket, _count and _sum.
        let family = ["_total", "_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| families.contains(*f)))
            .unwrap_or(name);
        assert!(
            families.contains(family) || families.contains(name),
            "sample without TYPE: {line}"
        );
        if let Some(labels) = series.strip_prefix(name)
            && !labels.is_empty()
        {
            let inner = labels.strip_prefix('{').unwrap().strip_suffix('}').unwrap();
            // label="value" pairs; values here never contain quotes or commas.
            for pair in inner.split(',') {
                let (k, v) = pair.split_once('=').unwrap_or_else(|| panic!("{line}"));
                assert!(valid_name(k), "{line}");
                assert!(
                    v.starts_with('"') && v.ends_with('"') && v.len() >= 2,
                    "{line}"
                );
            }
        }
        assert!(
            samples.insert(series.to_string(), value).is_none(),
            "duplicate {line}"
        );
    }
    assert!(saw_eof, "no # EOF");
    samples
}

#[test]
fn metrics_endpoint_serves_a_parseable_exposition_of_the_node() {
    let d = TestDaemon::start("[metrics]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    // The endpoint starts right after the API socket: wait for its log line.
    let mut addr = None;
    for _ in 0..400 {
        addr = strip_ansi(&d.log())
            .lines()
            .find(|l| l.contains("serving Prometheus metrics"))
            .and_then(|l| l.split("addr=").nth(1))
            .and_then(|s| s.split_whitespace().next())
            .map(str::to_string);
        if addr.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let addr = addr.unwrap_or_else(|| panic!("no metrics address in the log:\n{}", d.log()));
    let rt = rt();
    rt.block_on(async {
        let mut c = d.client().await.unwrap();
        c.create_lease(create_req("team-a", shape::mig("1g.10gb")))
            .await
            .unwrap();
        let mut req = create_req("team-b", shape::mps(30, 4));
        req.gpu_index = Some(2);
        c.create_lease(req).await.unwrap();
    });
    // Counters are fed by an event task: poll until the created events are counted.
    let mut samples = BTreeMap::new();
    for _ in 0..200 {
        let (head, body) = http_get(&addr, "/metrics");
        assert!(
            head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
            "{head}"
        );
        assert!(
            head.to_ascii_lowercase()
                .contains("application/openmetrics-text"),
            "{head}"
        );
        samples = parse_exposition(&body);
        if samples.contains_key(
            "tessera_lease_events_total{event=\"created\",tenant=\"team-a\",shape=\"1g.10gb\"}",
        ) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let get = |k: &str| {
        *samples
            .get(k)
            .unwrap_or_else(|| panic!("{k} missing from {:#?}", samples.keys()))
    };
    assert_eq!(
        get("tessera_lease_events_total{event=\"created\",tenant=\"team-a\",shape=\"1g.10gb\"}"),
        1.0
    );
    assert_eq!(
        get("tessera_leases{tenant=\"team-a\",shape=\"1g.10gb\",state=\"active\"}"),
        1.0
    );
    // The A100 without MIG has one 30% share: 70% left; its memory minus 4 GiB.
    assert_eq!(get("tessera_gpu_free_sm_percent{gpu=\"2\"}"), 70.0);
    assert!(
        !samples.contains_key("tessera_gpu_free_sm_percent{gpu=\"0\"}"),
        "MIG GPUs have no MPS shares"
    );
    assert!(
        get("tessera_gpu_free_memory_bytes{gpu=\"2\"}")
            <= (40u64 << 30) as f64 - (4u64 << 30) as f64
    );
    // One 1g.10gb placed on an H100: 7 of 8 memory slices free on one of them.
    let free: f64 =
        get("tessera_gpu_free_slices{gpu=\"0\"}") + get("tessera_gpu_free_slices{gpu=\"1\"}");
    assert_eq!(free, 15.0);
    assert!(
        samples
            .keys()
            .any(|k| k.starts_with("tessera_partitions{gpu="))
    );
    assert!(
        samples
            .keys()
            .any(|k| k.starts_with("tessera_gpu_utilization_percent{gpu=\"0\"}"))
    );
    assert!(
        samples
            .keys()
            .any(|k| k.starts_with("tessera_mig_instance_memory_used_bytes{"))
    );
    assert!(
        !samples.keys().any(|k| k.contains("tsr1_")),
        "a token leaked into labels"
    );

    let (head, _) = http_get(&addr, "/nope");
    assert!(head.contains(" 404"), "{head}");
}

#[test]
fn non_loopback_metrics_address_is_refused_at_start() {
    let e = match TestDaemon::start("[metrics]\nlisten = \"0.0.0.0:9464\"\n") {
        Ok(_) => panic!("a non-loopback metrics address was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("metrics.listen") && e.contains("allow_remote"),
        "{e}"
    );
}
