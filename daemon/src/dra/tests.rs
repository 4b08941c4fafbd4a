//! The plugin's core on a lease core over the simulator, without kubelet: a claim
//! is all or nothing, a prepare cut off by a crash is finished (not doubled) by the
//! retry or released by an unprepare, a claim the plugin cannot serve is refused
//! with why, and health follows the lease core's marks.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::claims::{AllocatedDevice, ClaimAllocation, ClaimRef, ClaimSource, ClaimSourceError};
use super::plugin::{DeviceHealth, DraPlugin};
use super::*;
use crate::config::Config;
use crate::lease::LeaseManager;
use crate::lease::{CreateRequest, ExactPlacement, HealthSource};
use crate::model::LeaseState;
use crate::partition::Shape;
use crate::store::Store;
use crate::store::{DraClaim, DraDevice};

/// The API server's claims as the test sets them; while `.2` is set, every read
/// fails as an unreachable API server's does.
#[derive(Default)]
struct Claims(
    Mutex<HashMap<String, ClaimAllocation>>,
    Hang,
    std::sync::atomic::AtomicBool,
);

/// A claim whose read hangs (a slow API server) until `go`.
#[derive(Default)]
struct Hang {
    uid: Mutex<Option<String>>,
    entered: tokio::sync::Notify,
    go: tokio::sync::Notify,
}

#[tonic::async_trait]
impl ClaimSource for Claims {
    async fn allocation(&self, claim: &ClaimRef) -> Result<ClaimAllocation, ClaimSourceError> {
        if self.2.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(ClaimSourceError::Api {
                claim: claim.to_string(),
                message: "connection refused".into(),
            });
        }
        let hangs = self.1.uid.lock().unwrap().as_deref() == Some(claim.uid.as_str());
        if hangs {
            self.1.entered.notify_one();
            self.1.go.notified().await;
        }
        self.0
            .lock()
            .unwrap()
            .get(&claim.uid)
            .cloned()
            .ok_or_else(|| ClaimSourceError::NotAllocated(claim.to_string()))
    }
}

impl Claims {
    fn set(&self, uid: &str, devices: &[&str]) {
        let devices = devices
            .iter()
            .map(|d| AllocatedDevice {
                request: "r".into(),
                driver: DRIVER_NAME.into(),
                pool: "n1".into(),
                device: d.to_string(),
            })
            .collect();
        self.0.lock().unwrap().insert(
            uid.into(),
            ClaimAllocation {
                uid: uid.into(),
                devices,
            },
        );
    }
}

fn claim(uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ns".into(),
        name: format!("c-{uid}"),
        uid: uid.into(),
    }
}

/// GPU 0: an H100 with MIG; GPU 1: an A100 without. DRA serves both unless
/// `extra` says otherwise.
fn setup(dir: &std::path::Path, extra: &str) -> (Arc<DraPlugin>, Arc<LeaseManager>, Arc<Claims>) {
    let text = format!(
        "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
         [sim]\nstate_file = {s:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n\
         [[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n\
         [kubernetes]\ndra = true\nnode_name = \"n1\"\ncdi_dir = {c:?}\n{extra}\n\
         [[kubernetes.mps_classes]]\nname = \"small\"\nsm_percent = 25\nmemory = \"4GiB\"\n",
        d = dir.display().to_string(),
        s = dir.join("sim.json").display().to_string(),
        c = dir.join("cdi").display().to_string(),
    );
    let cfg = Config::parse(std::path::Path::new("test.toml"), &text).unwrap();
    let k = cfg.kubernetes.clone();
    let sim = Arc::new(crate::gpu::open_sim(&cfg.sim).unwrap());
    let store = Arc::new(Store::open(dir).unwrap());
    let mgr = LeaseManager::start(cfg, sim, store.clone()).unwrap();
    let claims = Arc::new(Claims::default());
    let p = DraPlugin::new(mgr.clone(), store, k, claims.clone(), "n1".into()).unwrap();
    (p, mgr, claims)
}

fn live(mgr: &LeaseManager) -> usize {
    mgr.list(None, None, false).unwrap().len()
}

#[tokio::test]
async fn a_claim_is_all_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr, claims) = setup(dir.path(), "");
    // The second device overlaps the first: the first is released again.
    claims.set("u1", &["gpu-0-mig-0-1g-10gb", "gpu-0-mig-0-2g-20gb"]);
    let err = p.prepare(&claim("u1")).await.unwrap_err();
    assert!(err.to_string().contains("gpu-0-mig-0-2g-20gb"), "{err}");
    assert_eq!(live(&mgr), 0, "the first device's lease is released");
    assert!(p.store.dra_claim("u1").unwrap().is_none(), "no record kept");
    // Two devices that fit: two leases, one record.
    claims.set("u2", &["gpu-0-mig-0-1g-10gb", "gpu-0-mig-1-1g-10gb"]);
    let got = p.prepare(&claim("u2")).await.unwrap();
    assert_eq!(got.len(), 2);
    assert_ne!(got[0].lease_id, got[1].lease_id);
    assert_eq!(live(&mgr), 2);
    // One token spec for the claim, with both leases' tokens in their order.
    let spec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("cdi/tessera.io-claim-u2.json")).unwrap(),
    )
    .unwrap();
    let env = spec["devices"][0]["containerEdits"]["env"][0]
        .as_str()
        .unwrap();
    let tokens: Vec<&str> = env
        .strip_prefix("TESSERA_LEASE_TOKEN=")
        .unwrap()
        .split(',')
        .collect();
    let leases: Vec<String> = tokens
        .iter()
        .map(|t| mgr.resolve_token(t).unwrap().lease.id)
        .collect();
    assert_eq!(leases, [got[0].lease_id.clone(), got[1].lease_id.clone()]);
    // A device already prepared for another claim: refused (an MPS slot would
    // otherwise become a second share).
    claims.set("u3", &["gpu-0-mig-1-1g-10gb"]);
    let e = p.prepare(&claim("u3")).await.unwrap_err().to_string();
    assert!(e.contains("prepared for another claim"), "{e}");
    claims.set("s1", &["gpu-1-mps-small-0"]);
    claims.set("s2", &["gpu-1-mps-small-0"]);
    p.prepare(&claim("s1")).await.unwrap();
    let e = p.prepare(&claim("s2")).await.unwrap_err().to_string();
    assert!(e.contains("prepared for another claim"), "{e}");
    assert_eq!(live(&mgr), 3);
    // A UID that is not one names no file and no record.
    let e = p.prepare(&claim("../x")).await.unwrap_err().to_string();
    assert!(e.contains("is not a UID"), "{e}");
}

#[tokio::test]
async fn a_prepare_cut_off_by_a_crash_is_finished_by_the_retry_or_released_by_unprepare() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr, claims) = setup(dir.path(), "");
    claims.set("u1", &["gpu-0-mig-3-1g-10gb"]);
    claims.set("u2", &["gpu-1"]);
    // As a crash leaves it: the record (not prepared), the lease made under its
    // request id, nothing recorded of the lease.
    for (uid, nonce, shape, at) in [
        (
            "u1",
            "n-one",
            Shape::Mig {
                profile: "1g.10gb".into(),
                compute_profile: None,
            },
            ExactPlacement {
                gpu: 0,
                mig_start: Some(3),
            },
        ),
        (
            "u2",
            "n-two",
            Shape::WholeGpu,
            ExactPlacement {
                gpu: 1,
                mig_start: None,
            },
        ),
    ] {
        let rec = DraClaim {
            uid: uid.into(),
            namespace: "ns".into(),
            name: format!("c-{uid}"),
            tenant: "kubernetes".into(),
            nonce: nonce.into(),
            prepared: false,
            devices: vec![DraDevice {
                requests: vec!["r".into()],
                pool: "n1".into(),
                device: String::new(),
                lease_id: String::new(),
                token: String::new(),
            }],
            created_at_ms: 0,
        };
        p.store.write(move |w| w.put_dra_claim(&rec)).await.unwrap();
        mgr.create(CreateRequest {
            tenant: "kubernetes".into(),
            shape: Some(shape),
            request_id: Some(format!("dra-{nonce}-0")),
            exact: Some(at),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    assert_eq!(live(&mgr), 2);
    // kubelet retries the prepare: the same lease, not a second.
    let got = p.prepare(&claim("u1")).await.unwrap();
    assert_eq!(got[0].device, "gpu-0-mig-3-1g-10gb");
    assert_eq!(live(&mgr), 2);
    assert!(p.store.dra_claim("u1").unwrap().unwrap().prepared);
    // kubelet gives up on the other: unprepare releases the lease made.
    p.unprepare(&claim("u2")).await.unwrap();
    assert_eq!(live(&mgr), 1);
    assert!(p.store.dra_claim("u2").unwrap().is_none());
}

#[tokio::test]
async fn claims_the_plugin_cannot_serve_are_refused_with_why() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr, claims) = setup(dir.path(), "dra_gpus = [0]");
    let why = |e: DraError| e.to_string();
    // Not allocated (yet).
    let e = why(p.prepare(&claim("none")).await.unwrap_err());
    assert!(e.contains("not allocated"), "{e}");
    // A GPU the device plugin serves.
    claims.set("u1", &["gpu-1"]);
    let e = why(p.prepare(&claim("u1")).await.unwrap_err());
    assert!(e.contains("kubernetes.dra_gpus"), "{e}");
    // An MPS class this node does not define; a name that is not ours.
    claims.set("u2", &["gpu-0-mps-huge-0"]);
    let e = why(p.prepare(&claim("u2")).await.unwrap_err());
    assert!(e.contains("\"huge\""), "{e}");
    claims.set("u3", &["nvidia-0"]);
    assert!(p.prepare(&claim("u3")).await.is_err());
    // The API server's claim has another UID (recreated under the same name).
    claims.set("u4", &["gpu-0"]);
    claims.0.lock().unwrap().get_mut("u4").unwrap().uid = "u4-new".into();
    let e = why(p.prepare(&claim("u4")).await.unwrap_err());
    assert!(e.contains("u4-new"), "{e}");
    assert_eq!(live(&mgr), 0);
}

#[tokio::test]
async fn health_follows_the_lease_cores_marks() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr, claims) = setup(dir.path(), "");
    claims.set("u1", &["gpu-1-mps-small-0"]);
    p.prepare(&claim("u1")).await.unwrap();
    let rx = p.watch_health();
    assert_eq!(
        *rx.borrow(),
        [DeviceHealth {
            pool: "n1".into(),
            device: "gpu-1-mps-small-0".into(),
            healthy: true,
            message: String::new(),
        }]
    );
    mgr.mark_unhealthy(
        1,
        None,
        crate::gpu::HealthCause::DoubleBitEcc,
        HealthSource::Operator,
    )
    .await
    .unwrap();
    p.refresh_health();
    let h = rx.borrow().clone();
    assert!(!h[0].healthy, "{h:?}");
    assert!(h[0].message.contains("GPU 1"), "{h:?}");
    // Ended leases are unhealthy too; unprepared claims are no longer listed.
    let id = p.prepare(&claim("u1")).await.unwrap()[0].lease_id.clone();
    mgr.end(&id, LeaseState::Revoked, "test").await.unwrap();
    p.refresh_health();
    assert!(!rx.borrow()[0].healthy);
    let e = p.prepare(&claim("u1")).await.unwrap_err().to_string();
    assert!(
        e.contains("revoked"),
        "a prepared claim whose lease ended: {e}"
    );
    p.unprepare(&claim("u1")).await.unwrap();
    assert!(rx.borrow().is_empty());
}

#[tokio::test]
async fn a_hung_claim_read_holds_up_only_its_own_claim() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr, claims) = setup(dir.path(), "");
    claims.set("slow", &["gpu-0-mig-0-1g-10gb"]);
    claims.set("u2", &["gpu-0-mig-1-1g-10gb"]);
    *claims.1.uid.lock().unwrap() = Some("slow".into());
    let slow = tokio::spawn({
        let p = p.clone();
        async move { p.prepare(&claim("slow")).await }
    });
    claims.1.entered.notified().await;
    // The API server has not answered for "slow": another claim is still prepared
    // and unprepared (the guard only turns a wedge into a failure, it times nothing).
    let other = async {
        let got = p.prepare(&claim("u2")).await.unwrap();
        assert_eq!(got.len(), 1);
        p.unprepare(&claim("u2")).await.unwrap();
    };
    tokio::time::timeout(std::time::Duration::from_secs(120), other)
        .await
        .expect("a hung claim read wedged every other prepare");
    claims.1.go.notify_one();
    let got = slow.await.unwrap().unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(live(&mgr), 1);
}

/// A claim gone from the API server that kubelet never unprepared is released once
/// it has been gone for the grace; one still there, or an API server that does not
/// answer, releases nothing.
#[tokio::test]
async fn claims_kubelet_never_unprepared_are_released_once_gone_for_the_grace() {
    use std::sync::atomic::Ordering;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr, claims) = setup(dir.path(), "");
    claims.set("kept", &["gpu-0-mig-0-1g-10gb"]);
    claims.set("gone", &["gpu-0-mig-1-1g-10gb"]);
    p.prepare(&claim("kept")).await.unwrap();
    p.prepare(&claim("gone")).await.unwrap();
    assert_eq!(live(&mgr), 2);
    claims.0.lock().unwrap().remove("gone");

    // The API server does not answer: nothing is released, however long.
    claims.2.store(true, Ordering::SeqCst);
    p.sweep_orphans(Duration::ZERO).await;
    assert_eq!(live(&mgr), 2, "an unreachable API server proves nothing");
    claims.2.store(false, Ordering::SeqCst);

    // Gone, but not for the grace yet.
    p.sweep_orphans(Duration::from_secs(3600)).await;
    assert_eq!(live(&mgr), 2, "released before its grace");
    assert!(p.store.dra_claim("gone").unwrap().is_some());

    // Gone for the grace: released, its record and token spec gone; the other kept.
    p.sweep_orphans(Duration::ZERO).await;
    assert_eq!(live(&mgr), 1);
    assert!(p.store.dra_claim("gone").unwrap().is_none());
    assert!(
        !dir.path().join("cdi/tessera.io-claim-gone.json").exists(),
        "the token spec goes with it"
    );
    assert!(p.store.dra_claim("kept").unwrap().is_some());

    // A claim recreated under the same name is another claim: the old one is gone.
    let mut swapped = claims.0.lock().unwrap().get("kept").cloned().unwrap();
    swapped.uid = "kept-again".into();
    claims.0.lock().unwrap().insert("kept".into(), swapped);
    p.sweep_orphans(Duration::ZERO).await;
    assert_eq!(live(&mgr), 0);
}
