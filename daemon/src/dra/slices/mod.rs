//! The ResourceSlices of this node's pool (`resource.k8s.io/v1`), built from the lease
//! core's view of the node. Pure: [`build`] turns a [`NodeState`] into the slices to
//! publish; `dra::kube` writes them to the API server.
//!
//! What is published, per GPU given to DRA:
//!
//! * A counter set `gpu-<i>` (in the pool's counter slices: a slice carries either
//!   counter sets or devices, at most [`MAX_COUNTER_SETS`] sets each):
//!   `memory-slice-<k>` = 1 for each MIG memory slice (MIG mode only),
//!   `compute-slices` = the GPU's compute slices (MIG mode only),
//!   `profile-<profile>` = its `max_count` for a profile that allows fewer instances
//!   than it has disjoint placements (`1g.10gb+me`), `sm-percent` = 100
//!   and `memory` = the GPU's memory in bytes, less what MPS shares of non-DRA leases
//!   hold.
//! * MIG mode: every placement of every GI profile (`gpu-<i>-mig-<start>-<profile>`)
//!   consuming the memory slices it covers (1 each), its compute slices (and 1 of
//!   its profile's counter where it has one). Two
//!   placements that overlap consume the same memory slice, so the scheduler never
//!   allocates both: the hardware rule "MIG instances never overlap" in counters.
//! * MIG off: the whole GPU (`gpu-<i>`) consuming every counter, and the MPS slots of
//!   each `[[kubernetes.mps_classes]]` class (`gpu-<i>-mps-<class>-<slot>`)
//!   consuming the class's SM percent and memory. A GPU is in one mode at a time;
//!   a mode change republishes.
//! * Hardware a non-DRA lease holds (gRPC API, device plugin), a free static-pool
//!   instance, or a MIG instance Tessera did not create is not the scheduler's: no
//!   device using it is published. Hardware a DRA lease holds stays published: the
//!   scheduler accounts for it through the claim it allocated.
//! * Devices of a GPU or MIG instance out of service carry the taint
//!   [`TAINT_KEY`] (`NoSchedule`, or `NoExecute` when the health policy revokes); a
//!   republish after recovery drops it.
//!
//! Order: the scheduler's allocator takes the first device of a slice that fits, in
//! the slice's order. Free MIG placements come in the order Tessera's best-fit
//! planner prefers them (least loss of [`capacity_value`], then the fuller GPU, then
//! start), so first fit lands where Tessera's planner would have put the instance;
//! placements that cannot be created now follow. GPUs are packed into slices fullest
//! first, and a GPU's devices are never split across slices (the order in which the
//! allocator visits slices is its own).

pub mod sched;
pub mod state;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
    DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use sha2::{Digest, Sha256};

use crate::config::OnUnhealthy;
use crate::gpu::{GiProfile, Placement};
use crate::partition::GpuView;
use crate::partition::fragmentation::{capacity_value, placement_is_free, total_memory_slices};
use crate::partition::{MpsLoad, OccupiedMig};

use super::DRIVER_NAME;
use super::device::DeviceName;

/// Most devices in one slice when any consumes counters or has taints (all of ours).
pub const MAX_DEVICES: usize = 64;
/// Most counter sets in one slice.
pub const MAX_COUNTER_SETS: usize = 8;
/// Most counters in one counter set.
pub const MAX_COUNTERS: usize = 32;
/// Most MPS slots of one class on one GPU (the `slots` of a class is capped to it).
pub const MAX_MPS_SLOTS: u32 = 16;
/// The taint key of devices out of service.
pub const TAINT_KEY: &str = "gpu.tessera.io/unhealthy";
/// The label every slice of this driver carries (value: the driver name), so that
/// an operator can list them with a label selector as well.
pub const SLICE_LABEL: &str = "gpu.tessera.io/driver";
/// Most characters of an object name (a DNS subdomain).
const MAX_OBJECT_NAME: usize = 253;

/// An MPS class published as slots: `[[kubernetes.mps_classes]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsClass {
    /// A DNS label (classes whose name has a `.` cannot be device names and are not
    /// published).
    pub name: String,
    pub sm_percent: u32,
    pub memory_bytes: u64,
    /// Slots per GPU; None: as many as fit the GPU (by SM percent and by memory),
    /// at most [`MAX_MPS_SLOTS`].
    pub slots: Option<u32>,
}

/// What the publisher is told besides the node's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceConfig {
    /// The node's name: the pool's name and every slice's `nodeName`.
    pub node_name: String,
    pub mps_classes: Vec<MpsClass>,
    /// How the health policy treats leases on hardware out of service: `Revoke`
    /// taints `NoExecute` (pods go), `Keep` `NoSchedule`.
    pub on_unhealthy: OnUnhealthy,
}

/// One GPU as the publisher sees it: the planner's view (every MIG instance, MPS
/// share and whole-GPU hold, whoever holds it) and which of those DRA leases hold.
#[derive(Debug, Clone)]
pub struct GpuState {
    pub view: GpuView,
    /// MIG placements held by DRA leases (a subset of `view.mig`'s).
    pub dra_mig: Vec<Placement>,
    /// MPS shares of DRA leases (a part of `view.mps`).
    pub dra_mps: MpsLoad,
    /// A DRA lease holds the GPU whole.
    pub dra_whole: bool,
    /// Why the GPU is out of service (None in service).
    pub unhealthy: Option<String>,
    /// MIG instances out of service: their placements and why.
    pub unhealthy_instances: Vec<(Placement, String)>,
}

/// The node as the publisher sees it.
#[derive(Debug, Clone, Default)]
pub struct NodeState {
    /// The GPUs given to DRA (the device plugin's are left out by the caller).
    pub gpus: Vec<GpuState>,
    /// The NVIDIA driver's version (an attribute of every device).
    pub driver_version: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SliceError {
    #[error("node name {0:?} is not a DNS subdomain")]
    NodeName(String),
    #[error("GPU {gpu} has {n} devices, more than a slice may hold ({MAX_DEVICES})")]
    TooManyDevices { gpu: u32, n: usize },
}

/// A device to publish, before it becomes a `Device`.
#[derive(Debug, Clone)]
struct Planned {
    name: DeviceName,
    /// The sort key within its GPU.
    key: (u8, u64, u32),
    consumes: BTreeMap<String, u64>,
    attributes: BTreeMap<String, DeviceAttribute>,
    capacity: BTreeMap<String, u64>,
    taint: Option<String>,
}

/// Whole GPUs' devices packed into device slices, in order; within a slice, the
/// devices of its GPUs in one order (best fit's across GPUs: least loss first, then
/// the fuller GPU).
fn pack(per_gpu: Vec<Vec<(OrderKey, Device)>>) -> Vec<Vec<Device>> {
    let mut packed: Vec<Vec<(OrderKey, Device)>> = Vec::new();
    for devices in per_gpu {
        match packed.last_mut() {
            Some(last) if last.len() + devices.len() <= MAX_DEVICES => last.extend(devices),
            _ => packed.push(devices),
        }
    }
    packed
        .into_iter()
        .map(|mut v| {
            v.sort_by_key(|(k, _)| *k);
            v.into_iter().map(|(_, d)| d).collect()
        })
        .collect()
}

/// One slice of this node's pool.
fn one_slice(
    cfg: &SliceConfig,
    pool: &ResourcePool,
    name: String,
    devices: Option<Vec<Device>>,
    shared: Option<Vec<CounterSet>>,
) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name),
            labels: Some(BTreeMap::from([(
                SLICE_LABEL.to_string(),
                DRIVER_NAME.to_string(),
            )])),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER_NAME.to_string(),
            node_name: Some(cfg.node_name.clone()),
            pool: pool.clone(),
            devices,
            shared_counters: shared,
            ..ResourceSliceSpec::default()
        },
    }
}

/// The slices of the pool at `generation`: counter slices first, then device slices.
/// Every slice names the same pool, generation and slice count.
pub fn build(
    cfg: &SliceConfig,
    node: &NodeState,
    generation: i64,
) -> Result<Vec<ResourceSlice>, SliceError> {
    if !is_dns_subdomain(&cfg.node_name) {
        return Err(SliceError::NodeName(cfg.node_name.clone()));
    }
    // GPUs fullest first (as best fit prefers them), then by index.
    let mut gpus: Vec<&GpuState> = node.gpus.iter().collect();
    gpus.sort_by_key(|g| (free_share(g), g.view.info.index));

    let mut counter_sets = Vec::new();
    let mut per_gpu: Vec<Vec<(OrderKey, Device)>> = Vec::new();
    for g in &gpus {
        counter_sets.push(counter_set(g));
        let devices = devices_of(cfg, node, g);
        if devices.len() > MAX_DEVICES {
            return Err(SliceError::TooManyDevices {
                gpu: g.view.info.index,
                n: devices.len(),
            });
        }
        if !devices.is_empty() {
            per_gpu.push(devices);
        }
    }
    let device_slices = pack(per_gpu);
    let counter_slices: Vec<Vec<CounterSet>> = counter_sets
        .chunks(MAX_COUNTER_SETS)
        .map(<[CounterSet]>::to_vec)
        .collect();
    // An empty pool is still one slice, so that the pool says "no devices".
    let count = i64::try_from(counter_slices.len() + device_slices.len())
        .unwrap_or(i64::MAX)
        .max(1);
    let pool = ResourcePool {
        name: cfg.node_name.clone(),
        generation,
        resource_slice_count: count,
    };
    let slice = |name: String, devices, shared| one_slice(cfg, &pool, name, devices, shared);
    let mut out = Vec::new();
    for (i, sets) in counter_slices.into_iter().enumerate() {
        out.push(slice(
            slice_name(&cfg.node_name, &format!("counters-{i}")),
            None,
            Some(sets),
        ));
    }
    for (i, devices) in device_slices.into_iter().enumerate() {
        out.push(slice(
            slice_name(&cfg.node_name, &format!("devices-{i}")),
            Some(devices),
            None,
        ));
    }
    if out.is_empty() {
        out.push(slice(
            slice_name(&cfg.node_name, "devices-0"),
            Some(Vec::new()),
            None,
        ));
    }
    Ok(out)
}

/// `<node>-gpu.tessera.io-<what>`, or a digest of the node name where that would be
/// longer than an object name may be.
pub fn slice_name(node: &str, what: &str) -> String {
    let name = format!("{node}-{DRIVER_NAME}-{what}");
    if name.len() <= MAX_OBJECT_NAME {
        return name;
    }
    let digest = hex::encode(Sha256::digest(node.as_bytes()));
    format!("node-{}-{DRIVER_NAME}-{what}", &digest[..32])
}

/// The counter set of a GPU.
pub fn counter_set_name(gpu: u32) -> String {
    format!("gpu-{gpu}")
}

/// A profile whose `max_count` is below the number of its placements that fit
/// together (`1g.10gb+me`: 7 placements, 1 instance) gets a counter of its own, of
/// `max_count`, each of its placements consuming 1.
fn max_count_binds(p: &GiProfile) -> bool {
    let disjoint = crate::partition::fragmentation::creatable_count(
        &GiProfile {
            max_count: u32::MAX,
            ..p.clone()
        },
        &[],
    );
    p.max_count < disjoint
}

fn profile_counter(p: &GiProfile) -> String {
    format!("profile-{}", super::device::slug(&p.name))
}

fn memory_slice_counter(k: u32) -> String {
    format!("memory-slice-{k}")
}

const COMPUTE: &str = "compute-slices";
const SM: &str = "sm-percent";
const MEMORY: &str = "memory";

fn mig_mode(g: &GpuState) -> bool {
    g.view.info.mig_current && !g.view.profiles.is_empty()
}

/// How much of the GPU is free, for ordering GPUs (lower is fuller).
fn free_share(g: &GpuState) -> u64 {
    if mig_mode(g) {
        let total = u64::from(total_memory_slices(&g.view));
        let used: u64 = g.view.mig.iter().map(|m| u64::from(m.placement.size)).sum();
        total.saturating_sub(used) * 100 / total.max(1)
    } else if g.view.whole_leased {
        0
    } else {
        100u64.saturating_sub(g.view.mps.sm_percent)
    }
}

/// MPS shares held by non-DRA leases.
fn foreign_mps(g: &GpuState) -> (u64, u64) {
    let sm = g.view.mps.sm_percent.saturating_sub(g.dra_mps.sm_percent);
    let mem = g
        .view
        .mps
        .memory_bytes
        .saturating_sub(g.dra_mps.memory_bytes);
    (sm, u64::try_from(mem).unwrap_or(u64::MAX))
}

fn counters(values: impl IntoIterator<Item = (String, u64)>) -> BTreeMap<String, Counter> {
    values
        .into_iter()
        .map(|(k, v)| {
            (
                k,
                Counter {
                    value: Quantity(v.to_string()),
                },
            )
        })
        .collect()
}

/// What the GPU offers: its counters.
fn offered(g: &GpuState) -> BTreeMap<String, u64> {
    let mut c = BTreeMap::new();
    if mig_mode(g) {
        for k in 0..total_memory_slices(&g.view) {
            c.insert(memory_slice_counter(k), 1);
        }
        let compute = g.view.profiles.iter().map(|p| p.slices).max().unwrap_or(0);
        c.insert(COMPUTE.to_string(), u64::from(compute));
        for p in g.view.profiles.iter().filter(|p| max_count_binds(p)) {
            c.insert(profile_counter(p), u64::from(p.max_count));
        }
    }
    let (sm, mem) = foreign_mps(g);
    c.insert(SM.to_string(), 100u64.saturating_sub(sm));
    c.insert(
        MEMORY.to_string(),
        g.view.info.memory_bytes.saturating_sub(mem),
    );
    c
}

fn counter_set(g: &GpuState) -> CounterSet {
    CounterSet {
        name: counter_set_name(g.view.info.index),
        counters: counters(offered(g)),
    }
}

/// Where a device goes in its slice: (taken or blocked, best fit's loss, how free
/// its GPU is, GPU index, start or slot).
type OrderKey = (u8, u64, u64, u32, u32);

/// The devices of one GPU, each with its place in the order first fit should meet
/// them.
fn devices_of(cfg: &SliceConfig, node: &NodeState, g: &GpuState) -> Vec<(OrderKey, Device)> {
    let mut planned = if mig_mode(g) {
        mig_devices(g)
    } else {
        let mut v = whole_device(g).into_iter().collect::<Vec<_>>();
        v.extend(mps_devices(cfg, g));
        v
    };
    planned.sort_by_key(|p| p.key);
    let effect = match cfg.on_unhealthy {
        OnUnhealthy::Revoke => "NoExecute",
        OnUnhealthy::Keep => "NoSchedule",
    };
    let free = free_share(g);
    let index = g.view.info.index;
    planned
        .into_iter()
        .map(|p| {
            let (taken, loss, at) = p.key;
            ((taken, loss, free, index, at), finish(p, g, node, effect))
        })
        .collect()
}

fn finish(mut p: Planned, g: &GpuState, node: &NodeState, effect: &str) -> Device {
    let info = &g.view.info;
    let attrs = &mut p.attributes;
    attrs.insert("model".into(), string(&info.name));
    attrs.insert("uuid".into(), string(&info.uuid));
    attrs.insert("index".into(), int(u64::from(info.index)));
    attrs.insert(
        "migCapable".into(),
        DeviceAttribute {
            bool: Some(info.mig_current || info.mig_pending || !g.view.profiles.is_empty()),
            ..DeviceAttribute::default()
        },
    );
    if !node.driver_version.is_empty() {
        attrs.insert("driverVersion".into(), string(&node.driver_version));
    }
    let taint = p.taint.or_else(|| g.unhealthy.clone());
    Device {
        name: p.name.to_string(),
        attributes: Some(p.attributes),
        capacity: (!p.capacity.is_empty()).then(|| {
            p.capacity
                .into_iter()
                .map(|(k, v)| {
                    (
                        k,
                        DeviceCapacity {
                            value: Quantity(v.to_string()),
                            ..DeviceCapacity::default()
                        },
                    )
                })
                .collect()
        }),
        consumes_counters: Some(vec![DeviceCounterConsumption {
            counter_set: counter_set_name(info.index),
            counters: counters(p.consumes),
        }]),
        taints: taint.map(|why| {
            vec![DeviceTaint {
                key: TAINT_KEY.to_string(),
                value: Some(label_value(&why)),
                effect: effect.to_string(),
                time_added: None,
            }]
        }),
        ..Device::default()
    }
}

fn string(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.chars().take(64).collect()),
        ..DeviceAttribute::default()
    }
}

fn int(v: u64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i64::try_from(v).unwrap_or(i64::MAX)),
        ..DeviceAttribute::default()
    }
}

/// A label value (the taint's value): at most 63 of `[A-Za-z0-9_.-]`, alphanumeric at
/// both ends.
pub fn label_value(s: &str) -> String {
    let mapped: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    mapped
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

/// True when a MIG placement of this GPU may be published: no hardware it needs is
/// held by anything but a DRA lease.
fn foreign_free(g: &GpuState, p: &Placement) -> bool {
    g.view
        .mig
        .iter()
        .filter(|m| !g.dra_mig.contains(&m.placement))
        .all(|m| !m.placement.overlaps(p))
}

fn mig_devices(g: &GpuState) -> Vec<Planned> {
    let before = capacity_value(&g.view.profiles, &g.view.mig);
    let mut out = Vec::new();
    for profile in &g.view.profiles {
        for placement in &profile.placements {
            if !foreign_free(g, placement) {
                continue;
            }
            out.push(mig_device(g, profile, *placement, before));
        }
    }
    out
}

fn mig_device(g: &GpuState, profile: &GiProfile, placement: Placement, before: u64) -> Planned {
    let free = placement_is_free(&g.view.mig, &placement);
    // Best fit's measure: how much of the free space's usefulness the placement
    // costs (Tessera's planner picks the least).
    let loss = if free {
        let mut after = g.view.mig.clone();
        after.push(OccupiedMig {
            gi_profile_id: profile.id,
            placement,
            free_static: None,
        });
        before.saturating_sub(capacity_value(&g.view.profiles, &after))
    } else {
        u64::MAX
    };
    let mut consumes = BTreeMap::new();
    for k in placement.start..placement.end() {
        consumes.insert(memory_slice_counter(k), 1);
    }
    consumes.insert(COMPUTE.to_string(), u64::from(profile.slices));
    if max_count_binds(profile) {
        consumes.insert(profile_counter(profile), 1);
    }
    let mut attributes = BTreeMap::new();
    attributes.insert("type".to_string(), string("mig"));
    attributes.insert("profile".to_string(), string(&profile.name));
    attributes.insert(
        "placementStart".to_string(),
        int(u64::from(placement.start)),
    );
    attributes.insert(
        "memorySlices".to_string(),
        int(u64::from(profile.memory_slices)),
    );
    attributes.insert("computeSlices".to_string(), int(u64::from(profile.slices)));
    let taint = g
        .unhealthy_instances
        .iter()
        .find(|(p, _)| p.overlaps(&placement))
        .map(|(_, why)| why.clone());
    Planned {
        name: DeviceName::Mig {
            gpu: g.view.info.index,
            profile: profile.name.clone(),
            start: placement.start,
        },
        key: (u8::from(!free), loss, placement.start),
        consumes,
        attributes,
        capacity: BTreeMap::from([
            (MEMORY.to_string(), profile.memory_bytes),
            ("multiprocessors".to_string(), u64::from(profile.sm_count)),
        ]),
        taint,
    }
}

/// The whole GPU, unless a non-DRA lease holds any of it.
fn whole_device(g: &GpuState) -> Option<Planned> {
    let (foreign_sm, foreign_mem) = foreign_mps(g);
    let foreign_whole = g.view.whole_leased && !g.dra_whole;
    let foreign_mig = g.view.mig.iter().any(|m| !g.dra_mig.contains(&m.placement));
    if foreign_whole || foreign_mig || foreign_sm > 0 || foreign_mem > 0 {
        return None;
    }
    let consumes = offered(g);
    let free = !g.view.whole_leased && g.view.mps.is_empty();
    Some(Planned {
        name: DeviceName::WholeGpu {
            gpu: g.view.info.index,
        },
        key: (u8::from(!free), 0, 0),
        consumes,
        attributes: BTreeMap::from([("type".to_string(), string("gpu"))]),
        capacity: BTreeMap::from([
            (MEMORY.to_string(), g.view.info.memory_bytes),
            (
                "multiprocessors".to_string(),
                u64::from(g.view.info.sm_count),
            ),
        ]),
        taint: None,
    })
}

/// How many slots of `class` a GPU of `memory_bytes` publishes.
pub fn mps_slots(class: &MpsClass, memory_bytes: u64) -> u32 {
    let by_sm = 100 / class.sm_percent.max(1);
    let by_mem = u32::try_from(memory_bytes / class.memory_bytes.max(1)).unwrap_or(u32::MAX);
    class.slots.unwrap_or(by_sm.min(by_mem)).min(MAX_MPS_SLOTS)
}

fn mps_devices(cfg: &SliceConfig, g: &GpuState) -> Vec<Planned> {
    // A GPU serves one MPS mode at a time: shares of non-DRA leases in the shared
    // mode leave no room for the isolated shares a class stands for.
    let foreign_shared = g.view.mps.shared.saturating_sub(g.dra_mps.shared) > 0;
    let foreign_whole = g.view.whole_leased && !g.dra_whole;
    if foreign_shared || foreign_whole {
        return Vec::new();
    }
    let mut out = Vec::new();
    for class in &cfg.mps_classes {
        if class.name.contains('.') {
            continue;
        }
        for slot in 0..mps_slots(class, g.view.info.memory_bytes) {
            let name = DeviceName::Mps {
                gpu: g.view.info.index,
                class: class.name.clone(),
                slot,
            };
            if name.to_string().len() > super::device::MAX_NAME {
                continue;
            }
            out.push(Planned {
                name,
                // After the whole GPU; smaller shares of a class in slot order.
                key: (0, 1, slot),
                consumes: BTreeMap::from([
                    (SM.to_string(), u64::from(class.sm_percent)),
                    (MEMORY.to_string(), class.memory_bytes),
                ]),
                attributes: BTreeMap::from([
                    ("type".to_string(), string("mps")),
                    ("mpsClass".to_string(), string(&class.name)),
                    ("smPercent".to_string(), int(u64::from(class.sm_percent))),
                ]),
                capacity: BTreeMap::from([(MEMORY.to_string(), class.memory_bytes)]),
                taint: None,
            });
        }
    }
    out
}

/// A DNS subdomain (RFC 1123): at most 253 characters, dot-separated labels of
/// lowercase alphanumerics and `-`, each alphanumeric at both ends.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= MAX_OBJECT_NAME && !s.is_empty() && s.split('.').all(is_dns_label)
}

/// A DNS label (RFC 1123): 1-63 lowercase alphanumerics and `-`, alphanumeric at
/// both ends.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

impl SliceConfig {
    /// The publisher's settings from the daemon's configuration: the MPS classes of
    /// `[[kubernetes.mps_classes]]` and the health policy of `[health]`.
    pub fn from_config(config: &crate::config::Config, node_name: &str) -> SliceConfig {
        SliceConfig {
            node_name: node_name.to_string(),
            mps_classes: config
                .kubernetes
                .mps_classes
                .iter()
                .map(|c| MpsClass {
                    name: c.name.clone(),
                    sm_percent: c.sm_percent,
                    memory_bytes: c.memory_bytes,
                    slots: c.slots,
                })
                .collect(),
            on_unhealthy: config.health.on_unhealthy,
        }
    }
}
