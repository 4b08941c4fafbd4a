//! The plugin's core on a lease manager over the simulator, without kubelet: the
//! reservation holds every advertised device, Allocate is idempotent, a smaller mix
//! re-carves only free capacity, a held device follows its pod's tenant (or is
//! revoked over quota), and a device no pod holds is released after the grace.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::config::Config;
use crate::lease::LeaseManager;
use crate::store::Store;

fn config(dir: &std::path::Path, extra: &str) -> Config {
    let text = format!(
        "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
         [sim]\nstate_file = {s:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n\
         [[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n\
         [kubernetes]\ndevice_plugin = true\ncdi_dir = {c:?}\nrelease_grace = \"0s\"\n\
         device_plugin_dir = {d:?}\npod_resources_socket = {pr:?}\n\
         default_tenant = \"k8s\"\n[kubernetes.namespaces]\nteam-a = \"acme\"\n{extra}",
        d = dir.display().to_string(),
        s = dir.join("sim.json").display().to_string(),
        c = dir.join("cdi").display().to_string(),
        pr = dir.join("no-kubelet.sock").display().to_string(),
    );
    Config::parse(std::path::Path::new("test.toml"), &text).unwrap()
}

async fn plugin(dir: &std::path::Path, extra: &str) -> (Arc<DevicePlugin>, Arc<LeaseManager>) {
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let cfg = config(dir, extra);
    let sim = Arc::new(crate::gpu::open_sim(&cfg.sim).unwrap());
    let store = Arc::new(Store::open(dir).unwrap());
    let k = cfg.kubernetes.clone();
    let mgr = LeaseManager::start(cfg, sim, store.clone()).unwrap();
    let p = DevicePlugin::start(mgr.clone(), store, k).await.unwrap();
    (p, mgr)
}

fn advertised(p: &DevicePlugin, class: &str) -> Vec<Advertised> {
    p.watch(class).borrow().clone()
}

fn holder(ns: &str, pod: &str, class: &str) -> Holder {
    Holder {
        resource: resource_name(class),
        namespace: ns.into(),
        pod: pod.into(),
    }
}

const MIX: &str = "[kubernetes.mix]\n\"mig-1g.10gb\" = 3\ngpu = 1\n";

#[tokio::test]
async fn every_advertised_device_is_a_live_lease_and_allocates_idempotently() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr) = plugin(dir.path(), MIX).await;
    let mig = advertised(&p, "mig-1g.10gb");
    assert_eq!(mig.len(), 3);
    assert!(mig.iter().all(|d| d.healthy));
    // The store holds the tokens: the state directory is the owner's only.
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
    }
    assert_eq!(advertised(&p, "gpu").len(), 1);
    for d in &mig {
        let (l, _) = mgr.get(&d.id).unwrap();
        assert_eq!(l.tenant, "k8s");
        assert_eq!(l.labels[LABEL_CLASS], "mig-1g.10gb");
    }
    let ids: Vec<Vec<String>> = mig.iter().map(|d| vec![d.id.clone()]).collect();
    let first = p.allocate("mig-1g.10gb", &ids).await.unwrap();
    let again = p.allocate("mig-1g.10gb", &ids).await.unwrap();
    assert_eq!(first, again);
    assert!(matches!(
        p.allocate("gpu", &ids[..1]).await,
        Err(K8sError::UnknownDevice { .. })
    ));
}

#[tokio::test]
async fn a_container_asking_for_every_device_gets_every_lease_in_one_answer() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr) = plugin(dir.path(), MIX).await;
    let ids: Vec<String> = advertised(&p, "mig-1g.10gb")
        .into_iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(ids.len(), 3);
    let first = p
        .allocate("mig-1g.10gb", std::slice::from_ref(&ids))
        .await
        .unwrap();
    assert_eq!(first.len(), 1, "one answer for the one container");
    let granted = &first[0];
    assert_eq!(
        granted.iter().map(|a| &a.lease_id).collect::<Vec<_>>(),
        ids.iter().collect::<Vec<_>>(),
        "the leases in the order asked"
    );
    assert_eq!(lease_id_env(granted), ids.join(","));
    let ann = token_annotation(granted);
    let tokens: Vec<&str> = ann.split(',').collect();
    assert_eq!(tokens.len(), 3);
    for (t, a) in tokens.iter().zip(granted) {
        assert_eq!(*t, a.token);
        assert!(t.starts_with("tsr1_") && !t.contains(','), "{t}");
        let (l, _) = mgr.get(&a.lease_id).unwrap();
        assert_eq!(l.state(), LeaseState::Active);
        assert_eq!(
            a.cdi_device.as_deref(),
            Some(format!("{CDI_KIND}={}", a.lease_id).as_str())
        );
    }
    // kubelet retries: the same answer.
    assert_eq!(
        p.allocate("mig-1g.10gb", std::slice::from_ref(&ids))
            .await
            .unwrap(),
        first
    );
    // Two containers of a pod, two devices and one.
    let split = p
        .allocate("mig-1g.10gb", &[ids[..2].to_vec(), ids[2..].to_vec()])
        .await
        .unwrap();
    assert_eq!(split[0], first[0][..2]);
    assert_eq!(split[1], first[0][2..]);
}

#[tokio::test]
async fn a_multi_device_request_that_repeats_names_nothing_or_exceeds_the_bound_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (p, _mgr) = plugin(dir.path(), MIX).await;
    let ids: Vec<String> = advertised(&p, "mig-1g.10gb")
        .into_iter()
        .map(|d| d.id)
        .collect();
    let e = p
        .allocate("mig-1g.10gb", &[vec![ids[0].clone(), ids[0].clone()]])
        .await
        .unwrap_err();
    assert!(matches!(e, K8sError::RepeatedDevice { .. }), "{e}");
    let e = p.allocate("mig-1g.10gb", &[vec![]]).await.unwrap_err();
    assert!(matches!(e, K8sError::NoDevice { .. }), "{e}");
    let many = vec![ids[0].clone(); MAX_DEVICES_PER_CONTAINER + 1];
    let e = p.allocate("mig-1g.10gb", &[many]).await.unwrap_err();
    assert!(matches!(e, K8sError::TooManyDevices { n: 17, .. }), "{e}");
    assert!(e.to_string().contains("at most 16"), "{e}");
    // A refused request marks nothing allocated: a later valid one still works.
    let ok = p
        .allocate("mig-1g.10gb", &[vec![ids[0].clone(), ids[1].clone()]])
        .await
        .unwrap();
    assert_eq!(ok[0].len(), 2);
}

#[tokio::test]
async fn a_smaller_mix_releases_free_reservations_only_and_a_larger_one_adds() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr) = plugin(dir.path(), MIX).await;
    let mig = advertised(&p, "mig-1g.10gb");
    p.allocate("mig-1g.10gb", &[vec![mig[1].id.clone()]])
        .await
        .unwrap();
    let mut mix = p.config().mix.clone();
    mix.get_mut("mig-1g.10gb").unwrap().count = 1;
    p.set_mix(mix.clone());
    p.reconcile().await;
    let now = advertised(&p, "mig-1g.10gb");
    assert_eq!(
        now.iter().map(|d| &d.id).collect::<Vec<_>>(),
        vec![&mig[1].id]
    );
    for gone in [&mig[0].id, &mig[2].id] {
        assert!(
            !mgr.get(gone).unwrap().0.state().is_live(),
            "{gone} still live"
        );
    }
    mix.get_mut("mig-1g.10gb").unwrap().count = 2;
    p.set_mix(mix);
    p.reconcile().await;
    let now = advertised(&p, "mig-1g.10gb");
    assert_eq!(now.len(), 2);
    assert!(now.iter().any(|d| d.id == mig[1].id));
}

#[tokio::test]
async fn a_held_device_follows_its_pod_and_is_released_when_the_pod_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr) = plugin(dir.path(), MIX).await;
    let mig = advertised(&p, "mig-1g.10gb");
    let id = mig[0].id.clone();
    p.allocate("mig-1g.10gb", &[vec![id.clone()]])
        .await
        .unwrap();
    let holders = BTreeMap::from([(id.clone(), holder("team-a", "trainer", "mig-1g.10gb"))]);
    p.follow(&holders).await;
    let (l, _) = mgr.get(&id).unwrap();
    assert_eq!(l.tenant, "acme");
    assert_eq!(l.labels[LABEL_POD], "trainer");
    assert_eq!(l.labels[LABEL_NAMESPACE], "team-a");
    // A device kubelet names under another resource is not this one's holder.
    let wrong = BTreeMap::from([(id.clone(), holder("team-a", "trainer", "gpu"))]);
    p.follow(&wrong).await;
    // Gone (grace 0): the first poll notes it, the next releases it.
    p.follow(&BTreeMap::new()).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    p.follow(&BTreeMap::new()).await;
    let (l, _) = mgr.get(&id).unwrap();
    assert_eq!(l.state(), LeaseState::Released);
    assert!(l.end_reason().unwrap_or("").contains("trainer"));
    p.reconcile().await;
    let now = advertised(&p, "mig-1g.10gb");
    assert_eq!(now.len(), 3, "a fresh reservation keeps the count");
    assert!(!now.iter().any(|d| d.id == id));
}

#[tokio::test]
async fn over_its_tenants_quota_a_held_device_is_revoked_and_advertised_unhealthy() {
    let dir = tempfile::tempdir().unwrap();
    let extra = "[tenants.k8s]\nguaranteed = { mig_slices = 7, whole_gpus = 1, memory = \"200GiB\" }\n\
                 [tenants.acme]\nguaranteed = { mig_slices = 0 }\n";
    let (p, mgr) = plugin(dir.path(), &format!("{MIX}{extra}")).await;
    let id = advertised(&p, "mig-1g.10gb")[0].id.clone();
    p.allocate("mig-1g.10gb", &[vec![id.clone()]])
        .await
        .unwrap();
    let holders = BTreeMap::from([(id.clone(), holder("team-a", "p", "mig-1g.10gb"))]);
    p.follow(&holders).await;
    let (l, _) = mgr.get(&id).unwrap();
    assert_eq!(l.state(), LeaseState::Revoked, "{l:?}");
    assert!(l.end_reason().unwrap_or("").contains("over quota"));
    p.follow(&holders).await;
    let d = advertised(&p, "mig-1g.10gb")
        .into_iter()
        .find(|d| d.id == id)
        .unwrap();
    assert!(!d.healthy);
}

#[tokio::test]
async fn a_restart_advertises_the_same_ids_with_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (ids, alloc) = {
        let (p, mgr) = plugin(dir.path(), MIX).await;
        let ids: Vec<String> = advertised(&p, "mig-1g.10gb")
            .into_iter()
            .map(|d| d.id)
            .collect();
        let alloc = p
            .allocate("mig-1g.10gb", &[vec![ids[0].clone()]])
            .await
            .unwrap();
        mgr.begin_shutdown();
        (ids, alloc)
    };
    let (p, _mgr) = plugin(dir.path(), MIX).await;
    let again: Vec<String> = advertised(&p, "mig-1g.10gb")
        .into_iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(again, ids);
    assert_eq!(
        p.allocate("mig-1g.10gb", &[vec![ids[0].clone()]])
            .await
            .unwrap(),
        alloc
    );
}

#[tokio::test]
async fn a_device_kubelet_gives_to_a_new_pod_gets_a_fresh_lease() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mgr) = plugin(dir.path(), MIX).await;
    let id = advertised(&p, "mig-1g.10gb")[0].id.clone();
    let first = p
        .allocate("mig-1g.10gb", &[vec![id.clone()]])
        .await
        .unwrap();
    let a = BTreeMap::from([(id.clone(), holder("team-a", "a", "mig-1g.10gb"))]);
    p.follow(&a).await;
    // A retry while pod a holds it: the same lease.
    let again = p
        .allocate("mig-1g.10gb", &[vec![id.clone()]])
        .await
        .unwrap();
    assert_eq!(again, first);
    // Pod a is gone and kubelet hands the device to pod b before the grace ends
    // (PodResources is unreachable here: the last poll decides).
    p.follow(&BTreeMap::new()).await;
    let b = p
        .allocate("mig-1g.10gb", &[vec![id.clone()]])
        .await
        .unwrap();
    assert_ne!(b[0][0].token, first[0][0].token, "pod b got pod a's token");
    assert_ne!(b[0][0].lease_id, first[0][0].lease_id);
    let (old, _) = mgr.get(&first[0][0].lease_id).unwrap();
    assert_eq!(old.state(), LeaseState::Released);
    assert!(
        old.end_reason().unwrap_or("").contains("another pod"),
        "{old:?}"
    );
    let (new, _) = mgr.get(&b[0][0].lease_id).unwrap();
    assert_eq!(new.state(), LeaseState::Active);
    // The same device id, healthy, now b's.
    assert!(
        advertised(&p, "mig-1g.10gb")
            .iter()
            .any(|d| d.id == id && d.healthy)
    );
    let hb = BTreeMap::from([(id.clone(), holder("team-a", "b", "mig-1g.10gb"))]);
    p.follow(&hb).await;
    assert_eq!(mgr.get(&b[0][0].lease_id).unwrap().0.labels[LABEL_POD], "b");
    assert_eq!(
        p.allocate("mig-1g.10gb", &[vec![id.clone()]])
            .await
            .unwrap(),
        b
    );
}

/// With the DRA driver on some GPUs, the device plugin reserves only on the others.
#[tokio::test]
async fn the_device_plugin_reserves_nothing_on_the_dra_drivers_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let text = format!(
        "[daemon]\nstate_dir = {s:?}\nrun_dir = {s:?}\n[gpu]\nbackend = \"sim\"\n\
         [sim]\nstate_file = {f:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n\
         [[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n\
         [[sim.gpus]]\nmodel = \"a100-40gb\"\nmig = false\n\
         [kubernetes]\ndevice_plugin = true\ndra = true\ndra_gpus = [0, 1]\n\
         cdi_dir = {c:?}\ndevice_plugin_dir = {s:?}\n\
         [kubernetes.mix]\n\"mig-1g.10gb\" = 1\ngpu = 2\n",
        s = d.display().to_string(),
        f = d.join("sim.json").display().to_string(),
        c = d.join("cdi").display().to_string(),
    );
    let cfg = Config::parse(std::path::Path::new("test.toml"), &text).unwrap();
    let k = cfg.kubernetes.clone();
    let sim = Arc::new(crate::gpu::open_sim(&cfg.sim).unwrap());
    let store = Arc::new(Store::open(d).unwrap());
    let mgr = LeaseManager::start(cfg, sim, store.clone()).unwrap();
    let p = DevicePlugin::start(mgr.clone(), store, k).await.unwrap();
    // The only MIG GPU and one of the whole GPUs are DRA's: one whole GPU left.
    assert!(advertised(&p, "mig-1g.10gb").is_empty());
    assert_eq!(advertised(&p, "gpu").len(), 1);
    let gpus: Vec<u32> = mgr
        .list(None, None, false)
        .unwrap()
        .iter()
        .map(|(l, _)| l.gpu)
        .collect();
    assert_eq!(gpus, [2]);
}
