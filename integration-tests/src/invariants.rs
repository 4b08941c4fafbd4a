//! What must hold of a daemon and its simulated hardware at any quiet moment: the
//! structural checks the crash harness and the fault suite share.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet};

use std::path::PathBuf;
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;

use tesserad::gpu::sim::CreateStage;
use tesserad::gpu::{GpuBackend, NvmlBackend, NvmlConfig, SimBackend, SimConfig};
use tesserad::mps::MpsConfig;
use tonic::transport::Channel;

use crate::TestDaemon;

type Client = TesseraClient<Channel>;

/// The hardware of `d` (configured with `gpus`, TOML `[[sim.gpus]]` entries), opened
/// from this process: the simulator on its state file, or the NVML backend over the
/// daemon's copy of the fake libnvidia-ml (see [`crate::backend`]).
pub fn sim_of(d: &TestDaemon, gpus: &str) -> Hardware {
    if crate::backend() == crate::Backend::Nvml {
        let dir = d.dir.path();
        let config = NvmlConfig {
            library_path: Some(dir.join("libnvidia-ml.so.1")),
            mig_minors_path: dir.join("mig-minors"),
            mps: MpsConfig {
                binary: Some(dir.join("nvidia-cuda-mps-control")),
                // The daemon's: `<run_dir>/mps-daemons`.
                state_dir: dir.join("run").join("mps-daemons"),
                ..MpsConfig::default()
            },
        };
        let backend =
            NvmlBackend::new(&config).unwrap_or_else(|e| panic!("open the fake NVML: {e}"));
        return Hardware::Nvml {
            backend: Box::new(backend),
            dir: dir.to_path_buf(),
        };
    }
    #[derive(serde::Deserialize)]
    struct Gpus {
        sim: SimConfig,
    }
    let text = format!("[sim]\n{gpus}");
    let parsed: Gpus = toml::from_str(&text).unwrap_or_else(|e| panic!("sim GPUs: {e}"));
    Hardware::Sim(Box::new(
        SimBackend::open(&parsed.sim, d.sim_state())
            .unwrap_or_else(|e| panic!("open the sim: {e}")),
    ))
}

/// A test's view of the daemon's hardware, and its misfortune: the simulator's
/// own controls, or the same played through `nvml-fake-ctl`.
pub enum Hardware {
    Sim(Box<SimBackend>),
    Nvml {
        backend: Box<NvmlBackend>,
        dir: PathBuf,
    },
}

impl std::ops::Deref for Hardware {
    type Target = dyn GpuBackend;
    fn deref(&self) -> &Self::Target {
        match self {
            Hardware::Sim(s) => s.as_ref(),
            Hardware::Nvml { backend, .. } => backend.as_ref(),
        }
    }
}

impl Hardware {
    fn ctl(&self, args: &[&str]) -> anyhow::Result<()> {
        match self {
            Hardware::Nvml { dir, .. } => crate::fake_nvml_ctl(dir, args).map(|_| ()),
            Hardware::Sim(_) => anyhow::bail!("not the fake NVML"),
        }
    }

    /// The next create on `gpu` fails at `stage` (the CI stage: the daemon rolls
    /// the GI back).
    pub fn fail_next_create(&self, gpu: u32, stage: CreateStage) -> anyhow::Result<()> {
        let g = gpu.to_string();
        match (self, stage) {
            (Hardware::Sim(s), _) => Ok(s.fail_next_create(gpu, stage)?),
            (_, CreateStage::Gi) => self.ctl(&[
                "fail",
                "nvmlDeviceCreateGpuInstanceWithPlacement",
                "999",
                &g,
                "1",
            ]),
            (_, CreateStage::Ci) => self.ctl(&[
                "fail",
                "nvmlGpuInstanceCreateComputeInstance",
                "999",
                &g,
                "1",
            ]),
        }
    }

    /// The next create on `gpu` leaves its GI without a CI (what a crash between the
    /// two steps leaves): over NVML, the CI create fails and so does the rollback.
    pub fn crash_next_create_after_gi(&self, gpu: u32) -> anyhow::Result<()> {
        if let Hardware::Sim(s) = self {
            return Ok(s.crash_next_create_after_gi(gpu)?);
        }
        let g = gpu.to_string();
        self.ctl(&[
            "fail",
            "nvmlGpuInstanceCreateComputeInstance",
            "999",
            &g,
            "1",
        ])?;
        self.ctl(&["fail", "nvmlGpuInstanceDestroy", "999", &g, "1"])
    }

    /// The next destroy on `gpu` fails (NVML_ERROR_UNKNOWN), destroying nothing.
    pub fn fail_next_destroy(&self, gpu: u32) -> anyhow::Result<()> {
        if let Hardware::Sim(s) = self {
            return Ok(s.fail_next_destroy(gpu)?);
        }
        self.ctl(&[
            "fail",
            "nvmlGpuInstanceDestroy",
            "999",
            &gpu.to_string(),
            "1",
        ])
    }

    pub fn clear_faults(&self, gpu: u32) -> anyhow::Result<()> {
        if let Hardware::Sim(s) = self {
            return Ok(s.clear_faults(gpu)?);
        }
        self.ctl(&["clear-faults", &gpu.to_string()])
    }

    pub fn add_process(
        &self,
        gpu: u32,
        gi_id: Option<u32>,
        ci_id: Option<u32>,
        pid: u32,
        used_memory_bytes: u64,
    ) -> anyhow::Result<()> {
        if let Hardware::Sim(s) = self {
            return Ok(s.add_process(gpu, gi_id, ci_id, pid, used_memory_bytes)?);
        }
        let (g, p, m) = (
            gpu.to_string(),
            pid.to_string(),
            used_memory_bytes.to_string(),
        );
        let (gi, ci) = (
            gi_id.map(|v| v.to_string()).unwrap_or_default(),
            ci_id.map(|v| v.to_string()).unwrap_or_default(),
        );
        let mut args = vec!["process", &g, &p, &m];
        if gi_id.is_some() {
            args.extend([gi.as_str(), ci.as_str()]);
        }
        self.ctl(&args)
    }

    pub fn remove_process(&self, gpu: u32, pid: u32) -> anyhow::Result<()> {
        if let Hardware::Sim(s) = self {
            return Ok(s.remove_process(gpu, pid)?);
        }
        self.ctl(&["remove-process", &gpu.to_string(), &pid.to_string()])
    }
}

/// Every live lease, page after page.
async fn every_lease(c: &mut Client) -> Result<Vec<pb::Lease>, tonic::Status> {
    let mut req = pb::ListLeasesRequest {
        page_size: 1000,
        ..Default::default()
    };
    let mut out = Vec::new();
    loop {
        let page = c.list_leases(req.clone()).await?.into_inner();
        out.extend(page.leases);
        if page.next_page_token.is_empty() {
            return Ok(out);
        }
        req.page_token = page.next_page_token;
    }
}

/// Structural invariants between the API's view and the simulator's state file.
/// Returns the violations and whether work is still in progress (pending or
/// revoking leases), in which case a violation may be transient.
pub async fn check_structure(c: &mut Client, sim: &dyn GpuBackend) -> (Vec<String>, bool) {
    let mut v = Vec::new();
    // GetNode and ListLeases are two snapshots: a lease that is revoking when the
    // first is taken may have ended by the second. Work in progress seen before the
    // node snapshot counts too, so the caller looks again instead of reporting it.
    let before = match every_lease(c).await {
        Ok(l) => l,
        Err(e) => return (vec![format!("ListLeases failed: {e}")], false),
    };
    let node = match c.get_node(pb::GetNodeRequest {}).await {
        Ok(n) => n.into_inner(),
        Err(e) => return (vec![format!("GetNode failed: {e}")], false),
    };
    let live = match every_lease(c).await {
        Ok(l) => l,
        Err(e) => return (vec![format!("ListLeases failed: {e}")], false),
    };
    // A partition being made or torn down (an MPS host instance reaped with its
    // last share, say) may name an instance not there yet, or no more.
    let in_progress = before.iter().chain(&live).any(|l| {
        l.state == pb::LeaseState::Pending as i32 || l.state == pb::LeaseState::Revoking as i32
    }) || node
        .gpus
        .iter()
        .flat_map(|g| &g.partitions)
        .any(|p| p.state != "ready");
    let mps = sim.mps_daemons().unwrap();

    // Leases and partitions: each lease's partitions (one, or several for a
    // multi-partition lease) are exactly those GetNode shows for it; no partition
    // is leased twice.
    let mut by_lease: HashMap<&str, Vec<&pb::Partition>> = HashMap::new();
    let mut partition_ids = HashSet::new();
    for g in &node.gpus {
        for p in &g.partitions {
            if !partition_ids.insert(p.id.clone()) {
                v.push(format!("partition {} reported twice", p.id));
            }
            // A MIG instance hosting MPS shares (MPS inside MIG) is held by its
            // shares, not by a lease of its own.
            let hosts_shares = p
                .mig
                .as_ref()
                .is_some_and(|m| !m.mps_host_tenant.is_empty());
            if p.lease_id.is_empty() {
                if p.origin == "dynamic" && !hosts_shares {
                    v.push(format!("dynamic partition {} has no lease", p.id));
                }
                continue;
            }
            by_lease.entry(&p.lease_id).or_default().push(p);
        }
    }
    let live_ids: HashSet<&str> = live.iter().map(|l| l.id.as_str()).collect();
    for (lid, ps) in &by_lease {
        if !live_ids.contains(lid) {
            v.push(format!(
                "partitions {:?} name lease {lid}, which is not live",
                ps.iter().map(|p| &p.id).collect::<Vec<_>>()
            ));
        }
    }
    let mut seen_partitions = HashSet::new();
    for l in &live {
        // `partitions` lists them all; older answers only `partition`.
        let mut held: Vec<&str> = l.partitions.iter().map(|p| p.id.as_str()).collect();
        if held.is_empty()
            && let Some(p) = &l.partition
        {
            held.push(&p.id);
        }
        if held.is_empty() {
            v.push(format!("live lease {} has no partition", l.id));
            continue;
        }
        for p in &held {
            if !seen_partitions.insert(p.to_string()) {
                v.push(format!("partition {p} is leased twice"));
            }
        }
        let mut on_node: Vec<&str> = by_lease
            .get(l.id.as_str())
            .map(|ps| ps.iter().map(|p| p.id.as_str()).collect())
            .unwrap_or_default();
        held.sort_unstable();
        on_node.sort_unstable();
        if held != on_node {
            v.push(format!(
                "lease {} holds partitions {held:?}, GetNode says {on_node:?}",
                l.id
            ));
        }
    }

    for g in &node.gpus {
        let gi = g.index;
        let mig_parts: Vec<&pb::Partition> = g
            .partitions
            .iter()
            .filter(|p| p.kind == pb::PartitionKind::Mig as i32)
            .collect();
        let mps_parts: Vec<&pb::Partition> = g
            .partitions
            .iter()
            .filter(|p| p.kind == pb::PartitionKind::Mps as i32)
            .collect();
        let whole = g
            .partitions
            .iter()
            .filter(|p| p.kind == pb::PartitionKind::WholeGpu as i32)
            .count();

        // MIG: a bijection between instances and partitions.
        let insts = sim.instances(gi).unwrap();
        for i in &insts {
            if i.ci_id.is_none() {
                v.push(format!("GPU {gi}: GI {} has no CI", i.gi_id));
            }
            let n = mig_parts
                .iter()
                .filter(|p| {
                    let m = p.mig.as_ref().unwrap();
                    m.gi_id == i.gi_id && m.mig_uuid == i.uuid
                })
                .count();
            if n != 1 {
                v.push(format!(
                    "GPU {gi}: instance GI {} {} is explained by {n} partitions",
                    i.gi_id, i.uuid
                ));
            }
        }
        for p in &mig_parts {
            let m = p.mig.as_ref().unwrap();
            let n = insts
                .iter()
                .filter(|i| i.gi_id == m.gi_id && i.uuid == m.mig_uuid)
                .count();
            if n != 1 {
                v.push(format!(
                    "GPU {gi}: partition {} (GI {} {}) matches {n} instances",
                    p.id, m.gi_id, m.mig_uuid
                ));
            }
        }
        for (k, a) in insts.iter().enumerate() {
            if a.placement.end() > 8 {
                v.push(format!("GPU {gi}: GI {} lies outside the GPU", a.gi_id));
            }
            for b in &insts[k + 1..] {
                if a.placement.overlaps(&b.placement) {
                    v.push(format!("GPU {gi}: GIs {} and {} overlap", a.gi_id, b.gi_id));
                }
            }
        }
        let sm: u32 = insts.iter().map(|i| i.sm_count).sum();
        if sm > g.sm_count {
            v.push(format!(
                "GPU {gi}: MIG instances use {sm} of {} SMs",
                g.sm_count
            ));
        }
        let mem: u64 = insts.iter().map(|i| i.memory_bytes).sum();
        if mem > g.memory_bytes {
            v.push(format!(
                "GPU {gi}: MIG instances use {mem} of {} bytes",
                g.memory_bytes
            ));
        }

        // MPS: daemons == partitions, shares within the GPU. An isolated share has
        // a daemon of its own with its limits; shared shares (whole GPU or inside a
        // MIG instance) are clients of one server, named by their pipe directory.
        let daemons: Vec<_> = mps.iter().filter(|d| d.spec.gpu == gi).collect();
        let shared_key = |p: &pb::Partition| -> Option<String> {
            let m = p.mps.as_ref()?;
            let shared = m.mode == pb::MpsMode::Shared as i32 || !m.mig_host.is_empty();
            if !shared {
                return None;
            }
            std::path::Path::new(&m.pipe_dir)
                .parent()
                .and_then(|d| d.file_name())
                .map(|n| n.to_string_lossy().into_owned())
        };
        for d in &daemons {
            let isolated = mps_parts
                .iter()
                .filter(|p| {
                    let m = p.mps.as_ref().unwrap();
                    shared_key(p).is_none()
                        && p.lease_id == d.spec.lease_id
                        && m.sm_percent == d.spec.sm_percent
                        && m.memory_bytes == d.spec.memory_bytes
                })
                .count();
            let clients = mps_parts
                .iter()
                .filter(|p| shared_key(p).as_deref() == Some(d.spec.lease_id.as_str()))
                .count();
            let explained = (isolated == 1 && clients == 0) || (isolated == 0 && clients > 0);
            if !explained || !d.running {
                v.push(format!(
                    "GPU {gi}: MPS daemon {} (running {}) matches {isolated} isolated and {clients} shared partitions",
                    d.spec.lease_id, d.running
                ));
            }
        }
        for p in &mps_parts {
            let key = shared_key(p).unwrap_or_else(|| p.lease_id.clone());
            if !daemons.iter().any(|d| d.spec.lease_id == key) {
                v.push(format!("GPU {gi}: MPS partition {} has no daemon", p.id));
            }
        }
        let isolated_daemons: Vec<_> = daemons
            .iter()
            .filter(|d| {
                !mps_parts
                    .iter()
                    .any(|p| shared_key(p).as_deref() == Some(d.spec.lease_id.as_str()))
            })
            .collect();
        let sm_pct: u32 = isolated_daemons.iter().map(|d| d.spec.sm_percent).sum();
        let mps_mem: u64 = isolated_daemons.iter().map(|d| d.spec.memory_bytes).sum();
        if sm_pct > 100 || mps_mem > g.memory_bytes {
            v.push(format!(
                "GPU {gi}: MPS uses {sm_pct}% and {mps_mem} of {} bytes",
                g.memory_bytes
            ));
        }
        let rep_pct: u32 = mps_parts
            .iter()
            .filter(|p| p.mps.as_ref().unwrap().mig_host.is_empty())
            .map(|p| p.mps.as_ref().unwrap().sm_percent)
            .sum();
        if rep_pct != g.mps_sm_percent_used {
            v.push(format!(
                "GPU {gi}: reports {}% MPS used, its partitions add up to {rep_pct}%",
                g.mps_sm_percent_used
            ));
        }

        // Whole GPUs are exclusive.
        if whole > 1 || (whole == 1 && g.partitions.len() > 1) {
            v.push(format!(
                "GPU {gi}: {whole} whole-GPU leases beside {} partitions",
                g.partitions.len()
            ));
        }
        if whole > 0 && g.mig_enabled {
            v.push(format!("GPU {gi}: whole-GPU lease on a MIG GPU"));
        }
    }
    // The simulator was read after GetNode. The daemon changes a partition in memory
    // before it touches the hardware (write-ahead), so a change made between the two
    // reads (housekeeping reaping an idle MPS host instance, say) shows in a second
    // GetNode: then what was compared may be two moments, and the caller looks again.
    let changed = match c.get_node(pb::GetNodeRequest {}).await {
        Ok(again) => partition_states(&again.into_inner()) != partition_states(&node),
        Err(e) => {
            v.push(format!("GetNode failed: {e}"));
            false
        }
    };
    (v, in_progress || changed)
}

/// Every partition of a GetNode answer: id, state, lease, GPU.
fn partition_states(node: &pb::GetNodeResponse) -> Vec<(String, String, String, u32)> {
    let mut out: Vec<_> = node
        .gpus
        .iter()
        .flat_map(|g| {
            g.partitions
                .iter()
                .map(move |p| (p.id.clone(), p.state.clone(), p.lease_id.clone(), g.index))
        })
        .collect();
    out.sort();
    out
}
