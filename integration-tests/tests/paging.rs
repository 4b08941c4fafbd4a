//! Listing and watching leases at scale, against the real daemon on simulated GPUs:
//! 20,000 leases listed completely by the CLI and by a grpcio client with default
//! options (4 MiB receive limit); a paged listing during creates and releases
//! neither repeats nor skips a lease; a list, then a watch from its revision, adds
//! up to the truth; a watcher that reconnects with its last revision sees every
//! event once; a watcher that stops reading is cut off and the daemon's memory
//! stays bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tessera_integration_tests::python::{generate_stubs, pytest, python_or_skip, say};
use tessera_integration_tests::{TestDaemon, connect, rt};
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;
use tonic::Code;
use tonic::transport::Channel;

/// 64 simulated A100s without MIG: room for tens of thousands of small MPS shares.
fn many_gpus() -> String {
    "[[sim.gpus]]\nmodel = \"a100-80gb\"\nmig = false\n".repeat(64)
}

const OVERSUBSCRIBE: &str = "[partition]\nmps_oversubscribe = true\n";

/// A 1 % MPS share on its tenant's shared server of the GPU: no control daemon
/// and directories of its own (20,000 of those take long to make and remove).
fn tiny_mps() -> pb::Shape {
    pb::Shape {
        kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
            sm_percent: 1,
            memory_bytes: 64 << 20,
            mode: pb::MpsMode::Shared as i32,
            ..Default::default()
        })),
    }
}

fn create_req(tenant: &str) -> pb::CreateLeaseRequest {
    pb::CreateLeaseRequest {
        tenant: tenant.into(),
        shape: Some(tiny_mps()),
        labels: [("paging".to_owned(), "test".to_owned())].into(),
        ..Default::default()
    }
}

/// Create `n` live leases with 48 clients on their own connections (the
/// benchmark's prefill does it with 16); their ids.
async fn fill(socket: &std::path::Path, n: usize) -> Vec<String> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    // More than the benchmark's 16: bigger group commits, fewer fsyncs.
    for _ in 0..48 {
        let mut c = connect(socket).await.unwrap();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return ids;
                }
                let r = c
                    .create_lease(create_req(&format!("fill-{}", i % 4)))
                    .await
                    .unwrap_or_else(|e| panic!("creating lease {i}: {e}"));
                ids.push(r.into_inner().lease.unwrap().id);
            }
        }));
    }
    let mut ids = Vec::new();
    for t in tasks {
        ids.extend(t.await.unwrap());
    }
    ids
}

/// Every page of a listing of live leases, `size` at a time: the ids in the order
/// listed and the first page's revision.
async fn list_all(c: &mut TesseraClient<Channel>, size: i32) -> (Vec<String>, u64) {
    let mut req = pb::ListLeasesRequest {
        page_size: size,
        ..Default::default()
    };
    let mut ids = Vec::new();
    let mut revision = None;
    loop {
        let r = c.list_leases(req.clone()).await.unwrap().into_inner();
        assert!(r.leases.len() <= usize::try_from(size.max(500)).unwrap());
        let rev = *revision.get_or_insert(r.revision);
        assert_eq!(
            r.revision, rev,
            "every page answers the first page's revision"
        );
        ids.extend(r.leases.into_iter().map(|l| l.id));
        if r.next_page_token.is_empty() {
            return (ids, rev);
        }
        req.page_token = r.next_page_token;
    }
}

fn counts(ids: &[String]) -> BTreeMap<&str, usize> {
    let mut m = BTreeMap::new();
    for id in ids {
        *m.entry(id.as_str()).or_insert(0) += 1;
    }
    m
}

/// 20,000 live leases: one unpaged answer would be about 12 MB, three times what
/// any gRPC client takes by default. The CLI and a grpcio client with default
/// channel options list them all, each once.
#[test]
fn twenty_thousand_leases_are_listed_completely_by_the_cli_and_by_grpcio() {
    const N: usize = 20_000;
    let daemon = TestDaemon::start_with(
        &many_gpus(),
        &format!("{OVERSUBSCRIBE}[api]\nwatch_bookmark_interval = \"1s\"\n"),
    )
    .unwrap();
    let rt = rt();
    let t = std::time::Instant::now();
    let created: BTreeSet<String> = rt.block_on(fill(&daemon.socket, N)).into_iter().collect();
    say(&format!("{N} leases created in {:?}", t.elapsed()));
    assert_eq!(created.len(), N);

    let t = std::time::Instant::now();
    // GetNode lists every partition: how large it is here (not paged).
    let node_bytes = rt.block_on(async {
        let mut c = connect(&daemon.socket)
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20);
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        prost::Message::encoded_len(&node)
    });
    say(&format!(
        "GetNode with {N} leases: {} KiB",
        node_bytes >> 10
    ));

    // The CLI, as JSON (one array, written page by page).
    let out = std::process::Command::new(tessera_integration_tests::bin_path("tessera").unwrap())
        .args(["--json", "--socket"])
        .arg(&daemon.socket)
        .args(["lease", "list"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tessera --json lease list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed: Vec<String> = json
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(listed.len(), N, "each lease once");
    assert_eq!(listed.iter().cloned().collect::<BTreeSet<_>>(), created);
    // The table: a header and a row per lease; --limit stops early.
    let (ok, text) = daemon.cli(&["lease", "list"]);
    assert!(ok, "{}", &text[text.len().saturating_sub(2000)..]);
    assert_eq!(text.lines().count(), N + 1);
    let (ok, text) = daemon.cli(&["lease", "list", "--limit", "1234"]);
    assert!(ok);
    assert_eq!(text.lines().count(), 1234 + 1);

    say(&format!("the CLI's listings took {:?}", t.elapsed()));
    // grpcio with default options (4 MiB receive limit): every page fits.
    let Some(py) = python_or_skip().unwrap() else {
        return;
    };
    let gen_dir = tempfile::tempdir().unwrap();
    generate_stubs(&py, gen_dir.path(), &["tessera/v1/tessera.proto"]).unwrap();
    let ids_file = gen_dir.path().join("created.txt");
    std::fs::write(
        &ids_file,
        created.iter().cloned().collect::<Vec<_>>().join("\n"),
    )
    .unwrap();
    let run = pytest(
        &py,
        "integration-tests/python/test_paging.py",
        gen_dir.path(),
        &[
            ("TESSERA_SOCKET", daemon.socket.as_os_str()),
            ("TESSERA_CREATED", ids_file.as_os_str()),
        ],
        Duration::from_secs(300),
    )
    .unwrap();
    let output = &run.output;
    let status = run.status.expect("pytest ran past 300 s");
    assert!(status.success(), "the grpcio client failed:\n{output}");
    say(&format!(
        "python grpcio paging ({}): {}",
        py.display(),
        run.summary()
    ));
    assert!(
        !output.contains("SKIPPED"),
        "no Python test may skip:\n{output}"
    );
}

/// While pages are read, other clients create leases and release some of those
/// listed before and after the cursor: every lease alive throughout is listed
/// exactly once, and no lease twice. Then a list, and a watch from the list's
/// revision, add up to what a fresh list shows once the churn has stopped.
#[test]
fn creates_and_releases_during_a_paged_listing_lose_and_repeat_nothing() {
    let daemon = TestDaemon::start_with(
        &many_gpus(),
        &format!("{OVERSUBSCRIBE}[api]\nwatch_history = 65536\nwatch_queue = 65536\n"),
    )
    .unwrap();
    let rt = rt();
    rt.block_on(async {
        let initial = fill(&daemon.socket, 3000).await;
        let stop = Arc::new(AtomicBool::new(false));
        // Leases the churn ended (they need not be listed).
        let ended = Arc::new(std::sync::Mutex::new(HashSet::new()));
        let mut churn = Vec::new();
        for w in 0..4usize {
            let mut c = connect(&daemon.socket).await.unwrap();
            let stop = stop.clone();
            let ended = ended.clone();
            // Each worker releases every 4th initial lease from its own offset,
            // in a shuffled order (front, back, middle), and creates new ones.
            let mut mine: Vec<String> = initial.iter().skip(w).step_by(4).cloned().collect();
            mine.sort_by_key(|id| {
                let h: u64 = id
                    .bytes()
                    .fold(7, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(b)));
                h
            });
            churn.push(tokio::spawn(async move {
                let mut created = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) && n < 1000 {
                    n += 1;
                    let r = c.create_lease(create_req("churn")).await.unwrap();
                    created.push(r.into_inner().lease.unwrap().id);
                    if let Some(id) = mine.pop() {
                        ended.lock().unwrap().insert(id.clone());
                        c.release_lease(pb::ReleaseLeaseRequest {
                            lease_id: id,
                            reason: "churn".into(),
                        })
                        .await
                        .unwrap();
                    }
                    if n % 3 == 0
                        && let Some(id) = created.first().cloned()
                    {
                        created.remove(0);
                        ended.lock().unwrap().insert(id.clone());
                        c.release_lease(pb::ReleaseLeaseRequest {
                            lease_id: id,
                            reason: "churn".into(),
                        })
                        .await
                        .unwrap();
                    }
                }
            }));
        }
        let mut c = connect(&daemon.socket).await.unwrap();
        // Small pages: the listing spans the churn.
        let ended_before = ended.lock().unwrap().len();
        let (listed, revision) = list_all(&mut c, 20).await;
        let ended_during = ended.lock().unwrap().len() - ended_before;
        // A watch from the listing's revision, opened while the churn still runs.
        let mut watch = c
            .watch_leases(pb::WatchLeasesRequest {
                since_revision: revision,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        stop.store(true, Ordering::Relaxed);
        for t in churn {
            t.await.unwrap();
        }
        let counted = counts(&listed);
        let twice: Vec<_> = counted.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "listed more than once: {twice:?}");
        let ended = ended.lock().unwrap().clone();
        let skipped: Vec<_> = initial
            .iter()
            .filter(|id| !ended.contains(*id) && !counted.contains_key(id.as_str()))
            .collect();
        assert!(
            skipped.is_empty(),
            "{} leases alive throughout were not listed: {:?}",
            skipped.len(),
            &skipped[..skipped.len().min(5)]
        );
        assert!(ended_during > 0, "the churn ran during the listing");
        say(&format!(
            "paged listing of {} leases (pages of 20) while {ended_during} leases were released",
            counted.len()
        ));

        // Informer: the listing plus the events after its revision is the truth.
        let (truth, now) = list_all(&mut c, 1000).await;
        let mut known: BTreeSet<String> = listed.into_iter().collect();
        let mut last = revision;
        while last < now {
            let ev = tokio::time::timeout(Duration::from_secs(30), watch.message())
                .await
                .expect("the watch delivers every event up to the second listing")
                .unwrap()
                .unwrap();
            assert_eq!(ev.revision, last + 1, "every event once, in order");
            last = ev.revision;
            let id = ev.lease.as_ref().unwrap().id.clone();
            match pb::LeaseEventKind::try_from(ev.kind).unwrap() {
                pb::LeaseEventKind::Created => {
                    known.insert(id);
                }
                pb::LeaseEventKind::Released | pb::LeaseEventKind::Revoked => {
                    known.remove(&id);
                }
                _ => {}
            }
        }
        let truth: BTreeSet<String> = truth.into_iter().collect();
        assert_eq!(known.len(), truth.len());
        assert!(known == truth, "list + watch differs from a fresh list");
    });
}

/// A watcher that goes away and comes back with the revision of the last event it
/// got sees each later event exactly once, in order, including those made while
/// it was away; one older than the kept history is told to list again.
#[test]
fn a_watcher_that_reconnects_with_its_last_revision_sees_every_event_once() {
    let daemon = TestDaemon::start_with(
        &many_gpus(),
        &format!(
            "{OVERSUBSCRIBE}[api]\nwatch_history = 2000\nwatch_bookmark_interval = \"200ms\"\n"
        ),
    )
    .unwrap();
    let rt = rt();
    rt.block_on(async {
        let mut c = connect(&daemon.socket).await.unwrap();
        let (_, start) = list_all(&mut c, 0).await;
        let mut seen: Vec<(u64, String)> = Vec::new();
        let mut since = start;
        let mut created = Vec::new();
        // Five rounds: connect from the last revision, read a few events, leave
        // with more coming; meanwhile create more.
        for round in 0..5 {
            let mut w = c
                .watch_leases(pb::WatchLeasesRequest {
                    since_revision: since,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            created.extend(fill(&daemon.socket, 40).await);
            for _ in 0..(25 + round * 5) {
                let ev = w.message().await.unwrap().unwrap();
                seen.push((ev.revision, ev.lease.unwrap().id));
                since = ev.revision;
            }
            drop(w);
        }
        // The rest, with bookmarks: the watcher reads up to the current revision.
        let mut w = c
            .watch_leases(pb::WatchLeasesRequest {
                since_revision: since,
                bookmarks: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        loop {
            let ev = w.message().await.unwrap().unwrap();
            if ev.kind == pb::LeaseEventKind::Bookmark as i32 {
                assert!(ev.lease.is_none());
                assert_eq!(
                    ev.revision, since,
                    "a bookmark names the last revision sent"
                );
                break;
            }
            seen.push((ev.revision, ev.lease.unwrap().id));
            since = ev.revision;
        }
        let revisions: Vec<u64> = seen.iter().map(|(r, _)| *r).collect();
        let want: Vec<u64> = (start + 1..=since).collect();
        assert_eq!(revisions, want, "every revision once, in order");
        let ids: BTreeSet<&String> = seen.iter().map(|(_, id)| id).collect();
        assert_eq!(ids.len(), created.len());
        assert!(created.iter().all(|id| ids.contains(id)));

        // 2,000 events later the first revision is no longer kept.
        fill(&daemon.socket, 2100).await;
        let err = c
            .watch_leases(pb::WatchLeasesRequest {
                since_revision: start,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
        assert!(err.message().contains("list the leases again"), "{err:?}");
    });
}

/// A watcher that stops reading while thousands of events come is dropped with
/// RESOURCE_EXHAUSTED once its queue (api.watch_queue) is full: the daemon's
/// memory does not grow with the events it would have been sent, and the daemon
/// goes on serving.
#[test]
fn a_watcher_that_stops_reading_is_cut_off_and_memory_stays_bounded() {
    let daemon = TestDaemon::start_with(
        &many_gpus(),
        &format!("{OVERSUBSCRIBE}[api]\nwatch_queue = 64\nwatch_history = 256\n"),
    )
    .unwrap();
    // Leases with 8 KiB of labels: each event of theirs is an 8 KiB message.
    let big = || {
        let mut r = create_req("cycle");
        for i in 0..8 {
            r.labels.insert(format!("pad-{i}"), "x".repeat(1000));
        }
        r
    };
    let rt = rt();
    rt.block_on(async {
        // 500 live leases; then create+release cycles keep that count, so what
        // grows is only what the daemon keeps for watchers.
        fill(&daemon.socket, 500).await;
        let cycles = |n: usize| {
            let socket = daemon.socket.clone();
            async move {
                let mut tasks = Vec::new();
                for _ in 0..8 {
                    let mut c = connect(&socket).await.unwrap();
                    tasks.push(tokio::spawn(async move {
                        for _ in 0..n / 8 {
                            let id = c
                                .create_lease(big())
                                .await
                                .unwrap()
                                .into_inner()
                                .lease
                                .unwrap()
                                .id;
                            c.release_lease(pb::ReleaseLeaseRequest {
                                lease_id: id,
                                reason: String::new(),
                            })
                            .await
                            .unwrap();
                        }
                    }));
                }
                for t in tasks {
                    t.await.unwrap();
                }
            }
        };
        // Warm up: the history fills, allocators settle.
        cycles(300).await;
        let before = daemon.rss().unwrap();
        // The stalled watcher: subscribed, never read.
        let mut stalled = connect(&daemon.socket)
            .await
            .unwrap()
            .watch_leases(pb::WatchLeasesRequest::default())
            .await
            .unwrap()
            .into_inner();
        // 1,200 cycles: 3,600 events (created, revoking, released), about 30 MB
        // of leases had they been kept for it.
        cycles(1200).await;
        let after = daemon.rss().unwrap();
        let grew = after.saturating_sub(before);
        say(&format!(
            "RSS {} MiB before the stalled watcher, {} MiB after 3,600 events of 8 KiB",
            before >> 20,
            after >> 20
        ));
        assert!(
            grew < 12 << 20,
            "the daemon grew by {} KiB with a stalled watcher",
            grew >> 10
        );
        // Reading now: what was queued and buffered, then RESOURCE_EXHAUSTED.
        let mut got = 0usize;
        let err = loop {
            match stalled.message().await {
                Ok(Some(_)) => got += 1,
                Ok(None) => panic!("the stream ended without a status after {got} events"),
                Err(e) => break e,
            }
        };
        assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
        assert!(
            err.message().contains("watch again from the last revision"),
            "{err:?}"
        );
        assert!(
            got < 3600,
            "{got} events reached a watcher that read nothing"
        );
        // The daemon still serves.
        let mut c = connect(&daemon.socket).await.unwrap();
        let (ids, _) = list_all(&mut c, 1000).await;
        assert_eq!(ids.len(), 500);
    });
}

/// Leases with 15 KiB of labels each: a page of 1,000 would be 15 MB. The page
/// stops short of 4 MiB (a default client's limit) and the next goes on from there.
#[test]
fn a_page_of_large_leases_stops_short_of_four_mib() {
    let daemon = TestDaemon::start_with(&many_gpus(), OVERSUBSCRIBE).unwrap();
    let rt = rt();
    rt.block_on(async {
        let mut c = connect(&daemon.socket).await.unwrap();
        let mut created = BTreeSet::new();
        for _ in 0..400 {
            let mut r = create_req("big");
            for i in 0..15 {
                r.labels.insert(format!("pad-{i}"), "x".repeat(1000));
            }
            let l = c.create_lease(r).await.unwrap().into_inner().lease.unwrap();
            created.insert(l.id);
        }
        // A client with tonic's default 4 MiB receive limit.
        let mut req = pb::ListLeasesRequest {
            page_size: 1000,
            ..Default::default()
        };
        let mut listed = Vec::new();
        let mut sizes = Vec::new();
        loop {
            let r = c.list_leases(req.clone()).await.unwrap().into_inner();
            sizes.push(r.leases.len());
            listed.extend(r.leases.into_iter().map(|l| l.id));
            if r.next_page_token.is_empty() {
                break;
            }
            req.page_token = r.next_page_token;
        }
        assert!(sizes.len() >= 2, "pages of {sizes:?}");
        assert!(sizes[0] < 400 && sizes[0] > 100, "pages of {sizes:?}");
        assert_eq!(listed.len(), 400, "pages of {sizes:?}");
        assert_eq!(listed.into_iter().collect::<BTreeSet<_>>(), created);
    });
}
