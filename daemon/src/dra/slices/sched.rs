//! What kube-scheduler's DRA allocator does with a pool, in small: first fit over the
//! published devices in slice order, under the counters rule (a device is allocated
//! only while every counter it consumes has that much left; allocating it takes it).
//! Tainted devices are skipped (claims here tolerate no taint). Used by the tests to
//! check that what the scheduler may allocate from the slices is always hardware
//! that exists at once, and to measure how first fit over Tessera's order packs.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use super::DRIVER_NAME;

/// A claim's request: which devices it accepts (the DeviceClass and selectors).
pub type Selector<'a> = &'a dyn Fn(&Device) -> bool;

/// The pool's counters and which devices are allocated.
#[derive(Debug, Clone, Default)]
pub struct Allocator {
    /// Devices in the order the allocator meets them.
    devices: Vec<Device>,
    /// counter set -> counter -> what is left.
    left: BTreeMap<String, BTreeMap<String, u64>>,
    allocated: BTreeSet<String>,
}

/// A quantity as the slices write them (plain decimal integers).
pub fn quantity(q: &str) -> Option<u64> {
    q.parse().ok()
}

impl Allocator {
    /// The pool of `slices` (the highest generation only, as consumers must).
    pub fn new(slices: &[ResourceSlice]) -> Allocator {
        let generation = slices
            .iter()
            .filter(|s| s.spec.driver == DRIVER_NAME)
            .map(|s| s.spec.pool.generation)
            .max()
            .unwrap_or(0);
        let mut a = Allocator::default();
        for s in slices
            .iter()
            .filter(|s| s.spec.driver == DRIVER_NAME && s.spec.pool.generation == generation)
        {
            for set in s.spec.shared_counters.iter().flatten() {
                let counters = set
                    .counters
                    .iter()
                    .map(|(k, c)| (k.clone(), quantity(&c.value.0).unwrap_or(0)))
                    .collect();
                a.left.insert(set.name.clone(), counters);
            }
            a.devices.extend(s.spec.devices.iter().flatten().cloned());
        }
        a
    }

    /// Allocates the first device `accepts` takes that fits; its name.
    pub fn allocate(&mut self, accepts: Selector<'_>) -> Option<String> {
        let idx = self.devices.iter().position(|d| {
            !self.allocated.contains(&d.name)
                && d.taints.as_ref().is_none_or(Vec::is_empty)
                && accepts(d)
                && self.fits(d)
        })?;
        let d = self.devices[idx].clone();
        self.take(&d);
        self.allocated.insert(d.name.clone());
        Some(d.name)
    }

    /// Gives a device back.
    pub fn free(&mut self, name: &str) {
        if !self.allocated.remove(name) {
            return;
        }
        let Some(d) = self.devices.iter().find(|d| d.name == name).cloned() else {
            return;
        };
        for c in d.consumes_counters.iter().flatten() {
            if let Some(set) = self.left.get_mut(&c.counter_set) {
                for (k, q) in &c.counters {
                    if let Some(v) = set.get_mut(k) {
                        *v += quantity(&q.value.0).unwrap_or(0);
                    }
                }
            }
        }
    }

    /// Marks devices as allocated already (claims the scheduler allocated before).
    pub fn allocated_before(&mut self, name: &str) -> bool {
        let Some(d) = self.devices.iter().find(|d| d.name == name).cloned() else {
            return false;
        };
        if self.allocated.contains(name) || !self.fits(&d) {
            return false;
        }
        self.take(&d);
        self.allocated.insert(d.name);
        true
    }

    fn fits(&self, d: &Device) -> bool {
        d.consumes_counters.iter().flatten().all(|c| {
            let Some(set) = self.left.get(&c.counter_set) else {
                return false;
            };
            c.counters.iter().all(|(k, q)| {
                let need = quantity(&q.value.0).unwrap_or(u64::MAX);
                set.get(k).is_some_and(|left| *left >= need)
            })
        })
    }

    fn take(&mut self, d: &Device) {
        for c in d.consumes_counters.iter().flatten() {
            if let Some(set) = self.left.get_mut(&c.counter_set) {
                for (k, q) in &c.counters {
                    if let Some(v) = set.get_mut(k) {
                        *v = v.saturating_sub(quantity(&q.value.0).unwrap_or(0));
                    }
                }
            }
        }
    }

    pub fn allocated(&self) -> &BTreeSet<String> {
        &self.allocated
    }

    pub fn devices(&self) -> &[Device] {
        &self.devices
    }
}

/// The string attribute `name` of a device (ours are unqualified: in the driver's
/// domain).
pub fn attr<'d>(d: &'d Device, name: &str) -> Option<&'d str> {
    d.attributes.as_ref()?.get(name)?.string.as_deref()
}
