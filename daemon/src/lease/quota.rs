//! Quotas, priorities and the choice of preemption victims. Pure logic.
//!
//! Each tenant has a *guaranteed* and a *burst* amount, counted in MIG compute
//! slices, MPS SM percent, MPS memory, and whole GPUs. A request is admitted while
//! the tenant's live leases plus the request stay within burst (plus any temporary
//! grant). Leases beyond the guarantee are *burst* leases: they may be preempted when
//! another tenant's request within its own guarantee cannot be placed. Leases within
//! a guarantee are never preempted.

use std::collections::BTreeMap;

use crate::config::{Amounts, TenancyConfig};
use crate::partition::Shape;

use crate::model::Lease;

/// Quota amounts `n` partitions of one shape use (a multi-partition lease counts
/// every partition).
pub fn amounts_of_n(shape: &Shape, n: u32) -> Amounts {
    let a = amounts_of(shape);
    Amounts {
        mig_slices: a.mig_slices.saturating_mul(n),
        mps_sm_percent: a.mps_sm_percent.saturating_mul(n),
        memory_bytes: a.memory_bytes.saturating_mul(u64::from(n)),
        whole_gpus: a.whole_gpus.saturating_mul(n),
    }
}

/// Quota amounts a lease uses: every partition it holds.
pub fn amounts_of_lease(l: &Lease) -> Amounts {
    amounts_of_n(&l.shape, l.partition_count())
}

/// Quota amounts a shape uses.
pub fn amounts_of(shape: &Shape) -> Amounts {
    match shape {
        Shape::Mig { profile, .. } => Amounts {
            mig_slices: mig_slices(profile),
            ..Default::default()
        },
        Shape::Mps {
            sm_percent,
            memory_bytes,
            ..
        } => Amounts {
            mps_sm_percent: *sm_percent,
            memory_bytes: *memory_bytes,
            ..Default::default()
        },
        Shape::WholeGpu => Amounts {
            whole_gpus: 1,
            ..Default::default()
        },
        // Its share of the whole GPU's SMs: the instance's compute slices (of 7)
        // times its percentage, rounded up.
        Shape::MigMps {
            profile,
            sm_percent,
            memory_bytes,
        } => Amounts {
            mps_sm_percent: (sm_percent.saturating_mul(mig_slices(profile))).div_ceil(7),
            memory_bytes: *memory_bytes,
            ..Default::default()
        },
    }
}

/// Compute slices of a GI profile name ("3g.40gb" -> 3). Unparseable names count 7
/// (the most any profile uses), so a typo can never slip under a quota.
pub fn mig_slices(profile: &str) -> u32 {
    profile
        .split_once('g')
        .and_then(|(n, _)| n.parse::<u32>().ok())
        .filter(|n| (1..=7).contains(n))
        .unwrap_or(7)
}

pub fn add(a: Amounts, b: Amounts) -> Amounts {
    Amounts {
        mig_slices: a.mig_slices.saturating_add(b.mig_slices),
        mps_sm_percent: a.mps_sm_percent.saturating_add(b.mps_sm_percent),
        memory_bytes: a.memory_bytes.saturating_add(b.memory_bytes),
        whole_gpus: a.whole_gpus.saturating_add(b.whole_gpus),
    }
}

pub fn fits(a: Amounts, limit: Amounts) -> bool {
    a.mig_slices <= limit.mig_slices
        && a.mps_sm_percent <= limit.mps_sm_percent
        && a.memory_bytes <= limit.memory_bytes
        && a.whole_gpus <= limit.whole_gpus
}

/// The dimensions in which `a` exceeds `limit`, for messages.
pub fn excess(a: Amounts, limit: Amounts) -> Vec<String> {
    let mut out = Vec::new();
    if a.mig_slices > limit.mig_slices {
        out.push(format!(
            "MIG slices {} > {}",
            a.mig_slices, limit.mig_slices
        ));
    }
    if a.mps_sm_percent > limit.mps_sm_percent {
        out.push(format!(
            "MPS SM percent {} > {}",
            a.mps_sm_percent, limit.mps_sm_percent
        ));
    }
    if a.memory_bytes > limit.memory_bytes {
        out.push(format!(
            "MPS memory {:.2} GiB > {:.2} GiB",
            a.memory_bytes as f64 / (1u64 << 30) as f64,
            limit.memory_bytes as f64 / (1u64 << 30) as f64
        ));
    }
    if a.whole_gpus > limit.whole_gpus {
        out.push(format!(
            "whole GPUs {} > {}",
            a.whole_gpus, limit.whole_gpus
        ));
    }
    out
}

/// Outcome of admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Within the tenant's guarantee (or quotas are off): never preempted.
    Guaranteed,
    /// Beyond the guarantee, within burst: preemptible.
    Burst,
}

/// Check a request against the tenant's quota. `used` is what the tenant's live
/// leases use; `extra` the sum of its active temporary grants.
pub fn admit(
    cfg: &TenancyConfig,
    tenant: &str,
    used: Amounts,
    request: Amounts,
    extra: Amounts,
) -> Result<Admission, String> {
    if cfg.tenants.is_empty() {
        return Ok(Admission::Guaranteed);
    }
    let Some(q) = cfg.tenants.get(tenant) else {
        return Err(format!(
            "tenant {tenant:?} has no quota on this node (configured tenants: {})",
            cfg.tenants.keys().cloned().collect::<Vec<_>>().join(", ")
        ));
    };
    let total = add(used, request);
    let limit = add(q.burst, extra);
    if !fits(total, limit) {
        return Err(format!(
            "quota of tenant {tenant:?} exceeded: {} (burst quota{})",
            excess(total, limit).join(", "),
            if extra == Amounts::default() {
                String::new()
            } else {
                " plus temporary grants".into()
            }
        ));
    }
    Ok(if fits(total, q.guaranteed) {
        Admission::Guaranteed
    } else {
        Admission::Burst
    })
}

/// Priority of a class (unknown classes rank lowest).
pub fn priority(cfg: &TenancyConfig, class: &str) -> i32 {
    cfg.priority_classes.get(class).copied().unwrap_or(i32::MIN)
}

/// Which live leases are beyond their tenant's guarantee: per tenant, leases are
/// counted oldest first; a lease that takes the running total past the guarantee is
/// a burst lease. With quotas off, nothing is burst.
pub fn burst_leases<'a>(cfg: &TenancyConfig, leases: &[&'a Lease]) -> Vec<&'a Lease> {
    if cfg.tenants.is_empty() {
        return Vec::new();
    }
    let mut by_tenant: BTreeMap<&str, Vec<&'a Lease>> = BTreeMap::new();
    for l in leases {
        by_tenant.entry(l.tenant.as_str()).or_default().push(l);
    }
    let mut out = Vec::new();
    for (tenant, mut ls) in by_tenant {
        let guaranteed = cfg
            .tenants
            .get(tenant)
            .map(|q| q.guaranteed)
            .unwrap_or_default();
        ls.sort_by(|a, b| {
            a.created_at_ms
                .cmp(&b.created_at_ms)
                .then_with(|| a.id.cmp(&b.id))
        });
        let mut total = Amounts::default();
        for l in ls {
            total = add(total, amounts_of_lease(l));
            if !fits(total, guaranteed) {
                out.push(l);
            }
        }
    }
    out
}

/// Preemption candidates for a request of `tenant`: burst leases of other tenants,
/// lowest priority first, youngest first.
pub fn victims_in_order<'a>(
    cfg: &TenancyConfig,
    tenant: &str,
    leases: &[&'a Lease],
) -> Vec<&'a Lease> {
    let mut v: Vec<&Lease> = burst_leases(cfg, leases)
        .into_iter()
        .filter(|l| l.tenant != tenant)
        .collect();
    v.sort_by(|a, b| {
        priority(cfg, &a.priority_class)
            .cmp(&priority(cfg, &b.priority_class))
            .then_with(|| b.created_at_ms.cmp(&a.created_at_ms))
            .then_with(|| b.id.cmp(&a.id))
    });
    v
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::config::TenantQuota;

    fn cfg() -> TenancyConfig {
        let mut tenants = BTreeMap::new();
        for (name, g, b, class) in [("a", 2, 4, "production"), ("b", 2, 4, "batch")] {
            tenants.insert(
                name.to_string(),
                TenantQuota {
                    guaranteed: Amounts {
                        mig_slices: g,
                        ..Default::default()
                    },
                    burst: Amounts {
                        mig_slices: b,
                        ..Default::default()
                    },
                    priority_class: class.into(),
                },
            );
        }
        TenancyConfig {
            tenants,
            priority_classes: [("production".to_string(), 100), ("batch".to_string(), 10)]
                .into_iter()
                .collect(),
            default_priority_class: "batch".into(),
            preemption: true,
        }
    }

    fn lease(id: &str, tenant: &str, created: i64, class: &str) -> Lease {
        Lease::reserved(
            crate::model::NewLease {
                id: id.into(),
                tenant: tenant.into(),
                shape: Shape::Mig {
                    profile: "1g.10gb".into(),
                    compute_profile: None,
                },
                partition_id: String::new(),
                gpu: 0,
                more_partitions: vec![],
                created_at_ms: created,
                ttl_secs: 0,
                request_id: None,
                labels: Default::default(),
                priority_class: class.into(),
                burst: false,
            },
            false,
        )
    }

    fn slices(n: u32) -> Amounts {
        Amounts {
            mig_slices: n,
            ..Default::default()
        }
    }

    #[test]
    fn an_mps_share_inside_mig_counts_its_part_of_the_whole_gpu() {
        let a = amounts_of(&Shape::MigMps {
            profile: "3g.40gb".into(),
            sm_percent: 50,
            memory_bytes: 4 << 30,
        });
        // 50 % of 3 of 7 compute slices, rounded up, like usage.
        assert_eq!(
            (a.mps_sm_percent, a.memory_bytes, a.mig_slices),
            (22, 4 << 30, 0)
        );
    }

    #[test]
    fn admission_follows_guarantee_then_burst_then_refusal() {
        let c = cfg();
        let z = Amounts::default();
        assert_eq!(
            admit(&c, "a", slices(0), slices(2), z),
            Ok(Admission::Guaranteed)
        );
        assert_eq!(
            admit(&c, "a", slices(2), slices(1), z),
            Ok(Admission::Burst)
        );
        let e = admit(&c, "a", slices(4), slices(1), z).unwrap_err();
        assert!(e.contains("MIG slices 5 > 4"), "{e}");
        // A temporary grant raises burst.
        assert_eq!(
            admit(&c, "a", slices(4), slices(1), slices(1)),
            Ok(Admission::Burst)
        );
        let e = admit(&c, "zed", z, slices(1), z).unwrap_err();
        assert!(e.contains("no quota"), "{e}");
    }

    #[test]
    fn quotas_off_admits_everything_as_guaranteed() {
        let mut c = cfg();
        c.tenants.clear();
        assert_eq!(
            admit(&c, "anyone", slices(100), slices(7), Amounts::default()),
            Ok(Admission::Guaranteed)
        );
    }

    #[test]
    fn only_leases_beyond_the_guarantee_are_victims_lowest_priority_youngest_first() {
        let c = cfg();
        let ls = [
            lease("a1", "a", 1, "production"),
            lease("a2", "a", 2, "production"),
            lease("a3", "a", 3, "production"),
            lease("b1", "b", 4, "batch"),
            lease("b2", "b", 5, "batch"),
            lease("b3", "b", 6, "batch"),
            lease("b4", "b", 7, "batch"),
        ];
        let refs: Vec<&Lease> = ls.iter().collect();
        let burst: Vec<&str> = burst_leases(&c, &refs)
            .iter()
            .map(|l| l.id.as_str())
            .collect();
        assert_eq!(burst, vec!["a3", "b3", "b4"]);
        // Tenant "c" asking: batch first (youngest first), then production.
        let v: Vec<&str> = victims_in_order(&c, "c", &refs)
            .iter()
            .map(|l| l.id.as_str())
            .collect();
        assert_eq!(v, vec!["b4", "b3", "a3"]);
        // A tenant never preempts itself.
        let v: Vec<&str> = victims_in_order(&c, "b", &refs)
            .iter()
            .map(|l| l.id.as_str())
            .collect();
        assert_eq!(v, vec!["a3"]);
    }

    #[test]
    fn slices_come_from_the_profile_name() {
        assert_eq!(mig_slices("1g.10gb"), 1);
        assert_eq!(mig_slices("3g.40gb"), 3);
        assert_eq!(mig_slices("1g.10gb+me"), 1);
        assert_eq!(mig_slices("nonsense"), 7);
    }
}
