//! The publisher's [`NodeState`] read from the lease core.

use std::collections::BTreeSet;

use crate::lease::LeaseManager;
use crate::model::{HealthMark, PartKind, Partition};
use crate::partition::{MpsLoad, MpsShare};

use super::{GpuState, NodeState};
use crate::dra::LABEL_CLAIM_UID;

/// The node as the publisher sees it: the GPUs in `gpus` (all when None), what DRA
/// leases (those labelled [`LABEL_CLAIM_UID`]) hold on them, and their health.
pub fn node_state(mgr: &LeaseManager, gpus: Option<&BTreeSet<u32>>) -> NodeState {
    let (views, dra) = mgr.views_and_labelled(LABEL_CLAIM_UID);
    let marks = mgr.health_marks();
    let driver_version = mgr.backend().driver_version().unwrap_or_default();
    from_parts(views, &dra, &marks, gpus, driver_version)
}

/// [`node_state`] from what it reads (for tests).
pub fn from_parts(
    views: Vec<crate::partition::GpuView>,
    dra: &[Partition],
    marks: &[HealthMark],
    gpus: Option<&BTreeSet<u32>>,
    driver_version: String,
) -> NodeState {
    let states = views
        .into_iter()
        .filter(|v| gpus.is_none_or(|s| s.contains(&v.info.index)))
        .map(|view| {
            let idx = view.info.index;
            let mut dra_mig = Vec::new();
            let mut dra_mps = MpsLoad::default();
            let mut dra_whole = false;
            for p in dra.iter().filter(|p| p.gpu == idx) {
                match &p.kind {
                    PartKind::Mig(m) => dra_mig.push(m.placement),
                    // MPS inside a MIG instance is not a DRA device.
                    PartKind::Mps(m) if m.host.is_none() => dra_mps.push(MpsShare {
                        sm_percent: m.sm_percent,
                        memory_bytes: m.memory_bytes,
                        mode: m.mode,
                    }),
                    PartKind::Mps(_) => {}
                    PartKind::WholeGpu => dra_whole = true,
                }
            }
            let unhealthy = marks
                .iter()
                .find(|m| m.gpu == idx && m.gi_id.is_none())
                .map(|m| m.cause.to_string())
                .or_else(|| view.info.fault.as_ref().map(ToString::to_string));
            // Instances out of service: DRA's by their partitions (others' are not
            // published anyway).
            let unhealthy_instances = marks
                .iter()
                .filter(|m| m.gpu == idx)
                .filter_map(|m| {
                    let gi = m.gi_id?;
                    let part = dra
                        .iter()
                        .find(|p| p.gpu == idx && p.mig().is_some_and(|mp| mp.gi_id == Some(gi)))?;
                    Some((part.mig()?.placement, m.cause.to_string()))
                })
                .collect();
            GpuState {
                view,
                dra_mig,
                dra_mps,
                dra_whole,
                unhealthy,
                unhealthy_instances,
            }
        })
        .collect();
    NodeState {
        gpus: states,
        driver_version,
    }
}
