//! Read-only questions: a node's GPUs and free capacity, one lease, a listing.

use std::collections::HashMap;

use crate::gpu::{GiProfile, GpuInfo};
use crate::model::{Lease, LeaseState, Partition};
use crate::names::truncate;
use crate::partition::{self};
use crate::store::{LeaseQuery, ListKey};

use super::error::LeaseError;
use super::manager::LeaseManager;

/// A GPU with its partitions and free capacity (GetNode).
#[derive(Debug, Clone)]
pub struct GpuReport {
    pub info: GpuInfo,
    pub profiles: Vec<(GiProfile, u32)>,
    pub partitions: Vec<Partition>,
    pub mps_sm_percent_used: u32,
    pub mps_memory_used: u64,
    pub whole_leased: bool,
    pub free_slices: u32,
    /// Why the GPU is out of service; None while it is in service.
    pub health: Option<crate::model::HealthMark>,
    /// Its MIG instances out of service (contained errors).
    pub unhealthy_instances: Vec<crate::model::HealthMark>,
    /// The MPS mode of its MPS leases (None while it has none).
    pub mps_mode: Option<crate::gpu::MpsMode>,
    /// MPS control daemons running on the GPU itself, as the backend reports them,
    /// and the share of the GPU's time each gets (they time-slice).
    pub mps_servers: u32,
    pub mps_time_slice_percent: u32,
    /// How it connects to each other GPU: (index, link).
    pub links: Vec<(u32, crate::gpu::GpuLink)>,
}

/// One page of a listing ([`LeaseManager::list_page`]).
#[derive(Debug)]
pub struct Page {
    pub leases: Vec<(Lease, Option<Partition>)>,
    /// More leases follow the last of this page.
    pub more: bool,
    /// The revision of lease events the page reflects.
    pub revision: u64,
}

impl LeaseManager {
    pub fn node(&self) -> Vec<GpuReport> {
        // Asked before the lock: the real backend reads pid files.
        let daemons = match self.backend.mps_daemons() {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "GetNode: the MPS control daemons cannot be listed; reporting none");
                Vec::new()
            }
        };
        let st = self.read();
        let views = Self::views(&st);
        let mut by_gpu: HashMap<u32, Vec<Partition>> = HashMap::new();
        for p in st.partitions.values() {
            by_gpu.entry(p.gpu).or_default().push(p.clone());
        }
        views
            .iter()
            .map(|v| {
                let free = partition::free_capacity(v);
                let profiles = v
                    .profiles
                    .iter()
                    .map(|p| {
                        let n = free
                            .iter()
                            .find(|(id, _)| *id == p.id)
                            .map(|(_, n)| *n)
                            .unwrap_or(0);
                        (p.clone(), n)
                    })
                    .collect();
                let mut partitions = by_gpu.remove(&v.info.index).unwrap_or_default();
                partitions.sort_by(|a, b| a.id.cmp(&b.id));
                let used = partition::used_memory_slices(v);
                let on_gpu: Vec<_> = daemons
                    .iter()
                    .filter(|d| d.running && d.spec.gpu_uuid == v.info.uuid)
                    .collect();
                GpuReport {
                    info: v.info.clone(),
                    profiles,
                    partitions,
                    mps_sm_percent_used: u32::try_from(v.mps.sm_percent).unwrap_or(u32::MAX),
                    mps_memory_used: u64::try_from(v.mps.memory_bytes).unwrap_or(u64::MAX),
                    whole_leased: v.whole_leased,
                    // Only what the driver's profiles cover: a GPU whose profiles
                    // could not be read has no slices to give.
                    free_slices: if v.info.mig_current && !v.profiles.is_empty() {
                        partition::fragmentation::total_memory_slices(v).saturating_sub(used)
                    } else {
                        0
                    },
                    health: st.health.get(&(v.info.index, None)).cloned(),
                    unhealthy_instances: st
                        .health
                        .iter()
                        .filter(|((g, gi), _)| *g == v.info.index && gi.is_some())
                        .map(|(_, m)| m.clone())
                        .collect(),
                    mps_mode: v.mps.mode(),
                    mps_servers: u32::try_from(on_gpu.len()).unwrap_or(u32::MAX),
                    mps_time_slice_percent: on_gpu.first().map_or(0, |d| d.time_slice_percent),
                    links: st
                        .gpus
                        .iter()
                        .find(|g| g.info.index == v.info.index)
                        .map(|g| g.links.clone())
                        .unwrap_or_default(),
                }
            })
            .collect()
    }

    /// A lease (live from memory, ended from the store) with its partition.
    pub fn get(&self, id: &str) -> Result<(Lease, Option<Partition>), LeaseError> {
        {
            let st = self.read();
            if let Some(l) = st.leases.get(id) {
                let p = st.partitions.get(&l.partition_id).cloned();
                return Ok((l.clone(), p));
            }
        }
        match self.store.get_lease(id)? {
            Some(l) => Ok((l, None)),
            None => Err(LeaseError::NotFound(format!(
                "no lease {:?}",
                truncate(id, 80)
            ))),
        }
    }

    pub fn list(
        &self,
        tenant: Option<&str>,
        state: Option<LeaseState>,
        include_ended: bool,
    ) -> Result<Vec<(Lease, Option<Partition>)>, LeaseError> {
        let live_only = state.is_none_or(LeaseState::is_live) && !include_ended;
        if live_only {
            let st = self.read();
            let mut out: Vec<_> = st
                .leases
                .values()
                .filter(|l| tenant.is_none_or(|t| l.tenant == t))
                .filter(|l| state.is_none_or(|s| l.state() == s))
                .map(|l| (l.clone(), st.partitions.get(&l.partition_id).cloned()))
                .collect();
            out.sort_by_key(|(l, _)| l.created_at_ms);
            return Ok(out);
        }
        let rows = self.store.list_leases(&LeaseQuery {
            tenant: tenant.map(String::from),
            state,
            limit: 1000,
        })?;
        let st = self.read();
        Ok(rows
            .into_iter()
            .map(|l| {
                // Prefer the in-memory copy of live leases (it is newer).
                let l = st.leases.get(&l.id).cloned().unwrap_or(l);
                let p = st.partitions.get(&l.partition_id).cloned();
                (l, p)
            })
            .collect())
    }

    /// One page of a listing: up to `limit` leases after `after` in (creation time,
    /// id) order, whether more follow, and the revision the page reflects (every
    /// event up to it is in the page's view; later ones are not counted in it).
    /// A lease that lives throughout a listing is on exactly one of its pages,
    /// whatever is created or ended meanwhile: the order never changes.
    pub fn list_page(
        &self,
        tenant: Option<&str>,
        state: Option<LeaseState>,
        include_ended: bool,
        after: Option<&ListKey>,
        limit: usize,
    ) -> Result<Page, LeaseError> {
        let limit = limit.max(1);
        let is_after = |l: &Lease| {
            after.is_none_or(|(ms, id)| (l.created_at_ms, l.id.as_str()) > (*ms, id.as_str()))
        };
        let live_only = state.is_none_or(LeaseState::is_live) && !include_ended;
        if live_only {
            let st = self.read();
            // Read under the state lock: a change is in the state before its
            // event is published, so every event up to here is in this view.
            let revision = self.revision();
            let mut found: Vec<&Lease> = st
                .leases
                .values()
                .filter(|l| tenant.is_none_or(|t| l.tenant == t))
                .filter(|l| state.is_none_or(|s| l.state() == s))
                .filter(|l| is_after(l))
                .collect();
            let order = |a: &&Lease, b: &&Lease| {
                (a.created_at_ms, a.id.as_str()).cmp(&(b.created_at_ms, b.id.as_str()))
            };
            let more = found.len() > limit;
            if more {
                found.select_nth_unstable_by(limit, order);
                found.truncate(limit);
            }
            found.sort_unstable_by(order);
            let leases = found
                .into_iter()
                .map(|l| (l.clone(), st.partitions.get(&l.partition_id).cloned()))
                .collect();
            return Ok(Page {
                leases,
                more,
                revision,
            });
        }
        // Before the store is read: a change is written before its event.
        let revision = self.revision();
        let mut rows = self
            .store
            .list_leases_page(tenant, state, after, limit + 1)?;
        let more = rows.len() > limit;
        rows.truncate(limit);
        let st = self.read();
        let leases = rows
            .into_iter()
            .map(|l| {
                // Prefer the in-memory copy of live leases (it is newer).
                let l = st.leases.get(&l.id).cloned().unwrap_or(l);
                let p = st.partitions.get(&l.partition_id).cloned();
                (l, p)
            })
            .collect::<Vec<_>>();
        debug_assert!(leases.iter().all(|(l, _)| is_after(l)));
        Ok(Page {
            leases,
            more,
            revision,
        })
    }

    /// Shared read of state for tests and metrics: (live leases, partitions).
    pub fn counts(&self) -> (usize, usize) {
        let st = self.read();
        (st.leases.len(), st.partitions.len())
    }

    /// The MIG profiles and GPU memory usage weights are computed from.
    pub fn usage_catalog(&self) -> crate::usage::Catalog {
        let mut c = crate::usage::Catalog::default();
        for g in &self.read().gpus {
            c.gpu_memory.insert(g.info.index, g.info.memory_bytes);
            for p in &g.profiles {
                c.mig_profiles
                    .insert((g.info.index, p.name.clone()), (p.slices, p.memory_bytes));
            }
        }
        c
    }

    /// Usage per tenant over `[from_ms, to_ms)` (`to_ms` 0 = now; `tenant` None = all).
    pub fn usage(
        &self,
        tenant: Option<&str>,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<Vec<crate::usage::TenantUsage>, crate::usage::UsageError> {
        crate::usage::query(&self.store, tenant, from_ms, to_ms, &self.usage_catalog())
    }
}
