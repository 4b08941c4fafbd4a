//! Placement planner: decides which GPU (and which MIG placement) a [`Shape`] goes to.
//!
//! [`plan`] is pure: it reads [`GpuView`]s and returns a [`PlanDecision`]; the lease
//! manager performs the change. GPUs are always considered in ascending `info.index`
//! order, whatever order the slice has. `opts.gpu_index` restricts the search to one GPU.
//!
//! # MIG
//!
//! * Only GPUs with `info.mig_current` and no whole-GPU lease are considered. The GI
//!   profile is matched by name, case-insensitively, per GPU (a node may mix GPU models
//!   whose profile ids differ). A name no considered GPU offers is
//!   [`PlanError::UnknownProfile`], listing the names the considered GPUs offer. A
//!   `compute_profile` must name one of the GI profile's CI profiles
//!   (case-insensitive), else [`PlanError::InvalidShape`].
//! * A free static-pool instance of the profile is taken before any new instance is
//!   created ([`PlanDecision::Static`], lowest GPU then lowest start) — only when no CI
//!   profile is asked for, since static partitions are whole GIs. A CI request on a node
//!   without dynamic MIG is [`PlanError::InvalidShape`]: no static partition can serve it.
//! * A new instance (only with `opts.dynamic_mig`) goes at one of the profile's possible
//!   placements that overlaps no present instance (leased, pending or free static), and
//!   only while fewer than `max_count` instances of that profile id exist on the GPU.
//!
//! ## First fit
//!
//! Lowest GPU index, then lowest placement start.
//!
//! ## Best fit (the default): least capacity destroyed
//!
//! The free space of a GPU is worth [`capacity_value`]: for every GI profile `q` of the
//! GPU, `size(q)^2 * n(q)`, where `size` is the profile's memory slices and `n(q)` the
//! number of `q` instances that could still be created *together* (non-overlapping,
//! within `max_count`). Each profile's term is the free memory it could still use,
//! weighted once more by its size, so a hole that can still take a 3g or 4g counts for
//! more than the same slices usable only by 1g instances.
//!
//! For every feasible (GPU, placement) the planner computes the *loss*: the GPU's value
//! before minus its value with the new instance in place, and picks the smallest loss.
//! Ties go to the GPU with fewer free memory slices (pack partly used GPUs before
//! touching empty ones), then the lower GPU index, then the lower start.
//!
//! The loss is comparable across GPUs and naturally prefers partly used GPUs: on an
//! empty H100 any placement destroys the 7g (weight 64), on a GPU where the 7g is
//! already impossible it does not. Within a GPU it keeps holes aligned: a lone 1g.10gb
//! goes to slice 6 (it costs the 7g, one 3g and one 1g.20gb) rather than slice 0 (which
//! would also cost the 4g, the other 3g, a 2g), so a later 4g.40gb still fits.
//!
//! `partition::planner_props` replays a seeded random workload on two H100s (10,000
//! requests of mixed profiles with random lifetimes, the same for both strategies):
//! best fit refuses 1299 requests against first fit's 1489, and only 323 of its
//! refusals happen while some GPU still had as many free memory slices as asked,
//! against 594 for first fit. Weighting by `size` instead of `size^2` gives the same
//! choices on the H100 table; an unweighted count of creatable instances refused
//! slightly more requests (1311) and more memory (7764 slices against 7514), because it
//! gives up places for large instances to keep places for small ones.
//!
//! ## Temporal packing: when leases end
//!
//! A 7g.80gb needs a whole GPU to empty, and best fit alone scatters leases whose ends
//! are unrelated, so GPUs rarely empty. When `opts.expiry` says when the new lease
//! expires and, per GPU, when the last lease on it expires, best fit's loss gets a
//! temporal term ([`Temporal`], `opts.temporal`; the daemon's default is
//! `Weighted(`[`EXPIRY_WEIGHT`]`)`, `[partition] expiry_weight`): the new lease's
//! expiry past the GPU's latest, as a fraction of its TTL (0 when it ends first: it
//! does not delay the GPU's emptying; a full TTL on an empty GPU, so one is opened
//! last), times the weight, in loss units (a 7g.80gb's loss is 64). Variants measured
//! on the trace benchmark: the term as a tie-break only, grouping leases of similar
//! ends (`Group`: the distance either way), and how soon the GPU empties (`Empties`);
//! none did better than `Weighted`. The term only orders feasible
//! placements: it never makes a request infeasible (property-tested). Leases that are
//! moved to make room are placed without it.
//!
//! # MPS
//!
//! `sm_percent` must be 1..=100 and `memory_bytes` > 0. Only GPUs with MIG disabled and
//! no whole-GPU lease take MPS shares. Admission on a GPU: the SM percentages of its
//! shares plus the new one stay <= 100 (unless `opts.mps_oversubscribe`), and their
//! memory limits plus the new one stay <= the GPU's memory (always). Best fit packs:
//! the fitting GPU with the least SM percentage left (then least memory left, then lowest
//! index); first fit takes the lowest fitting index.
//!
//! # Whole GPU
//!
//! A GPU with MIG disabled, no MIG instances, no MPS shares and no whole-GPU lease;
//! lowest index for both strategies.
//!
//! Every [`PlanError::NoCapacity`] names, per GPU considered, what ran out. A request
//! that no GPU could take in its current mode (a MIG shape on a node without MIG, an
//! MPS share or a whole GPU where every GPU is in MIG mode) is told so before planning
//! ([`mode_unavailable`]): waiting for capacity would not help it.

use serde::{Deserialize, Serialize};

use super::fragmentation::{
    below_max_count, capacity_value, free_placements, instance_count, total_memory_slices,
    used_memory_slices,
};
use super::view::{GpuView, OccupiedMig, Shape};
use crate::gpu::MpsMode;
use crate::gpu::{GiProfile, Placement};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    #[default]
    BestFit,
    FirstFit,
}

#[derive(Debug, Clone)]
pub struct PlanOptions {
    pub strategy: Strategy,
    /// Allow the sum of MPS SM percentages on a GPU to exceed 100.
    pub mps_oversubscribe: bool,
    /// Create MIG instances on demand (else only the static pool is used).
    pub dynamic_mig: bool,
    /// Only consider this GPU.
    pub gpu_index: Option<u32>,
    /// How best fit uses when leases expire (temporal packing); needs `expiry`.
    pub temporal: Temporal,
    /// When the new lease and the leases present expire; None = unknown.
    pub expiry: Option<Expiry>,
}

/// The default weight of [`Temporal::Weighted`] (`[partition] expiry_weight`): half a
/// 7g.80gb's loss (64) per full extension. 8 to 256 were measured on the trace
/// benchmark (docs/performance.md); 32 had the best lowest ratio.
pub const EXPIRY_WEIGHT: u32 = 32;

/// How best fit uses lease expiries (see the module doc, "Temporal packing").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Temporal {
    /// Expiries are ignored.
    #[default]
    Off,
    /// Among placements of equal best-fit loss, the GPU whose latest expiry the new
    /// lease extends least.
    TieBreak,
    /// Best-fit loss plus `weight` loss units per full extension (the new lease's TTL
    /// past the GPU's latest expiry).
    Weighted(u32),
    /// Best-fit loss plus `weight` units per TTL between the new lease's expiry and
    /// the GPU's latest (either way): leases of similar ends grouped.
    Group(u32),
    /// Best-fit loss plus `weight` units times how soon the GPU empties, counted up to
    /// two TTLs ahead: like `Weighted` for a GPU whose leases end first, and among GPUs
    /// whose leases all outlast the new one it picks the one that empties last, keeping
    /// new leases off GPUs about to empty.
    Empties(u32),
}

/// When leases expire, on one clock (any unit, e.g. Unix milliseconds).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expiry {
    pub now: u64,
    /// When the lease being placed expires.
    pub new_lease: u64,
    /// Per GPU index, the latest expiry among the leases on it. A GPU with instances
    /// but no entry is taken to stay busy (no extension costs anything there).
    pub latest: Vec<(u32, u64)>,
}

impl Expiry {
    /// How much placing the new lease on `view` costs toward emptying it, in
    /// thousandths of the new lease's TTL (0..=1000): for `group`, the distance between
    /// its expiry and the GPU's latest, else how far it extends the latest. An empty
    /// GPU costs 1000 (taken last).
    fn cost(&self, view: &GpuView, group: bool) -> u64 {
        self.cost_of(view, group, false)
    }

    /// How soon `view` empties, in thousandths (1000 = empty now, 0 = busy two TTLs
    /// or more from now, or busy with no known end).
    fn empties(&self, view: &GpuView) -> u64 {
        self.cost_of(view, false, true)
    }

    fn cost_of(&self, view: &GpuView, group: bool, empties: bool) -> u64 {
        let ttl = self.new_lease.saturating_sub(self.now);
        if ttl == 0 {
            return 0;
        }
        let latest = self
            .latest
            .iter()
            .find(|(g, _)| *g == view.info.index)
            .map(|(_, t)| (*t).max(self.now));
        let gap = match latest {
            None if view.mig.is_empty() => return 1000,
            None => 0,
            Some(l) if empties => {
                let busy = u128::from(l.saturating_sub(self.now));
                let r = (busy * 500 / u128::from(ttl)).min(1000);
                return u64::try_from(1000 - r).unwrap_or(0);
            }
            Some(l) if group => l.abs_diff(self.new_lease),
            Some(l) => self.new_lease.saturating_sub(l),
        };
        let r = u128::from(gap) * 1000 / u128::from(ttl);
        u64::try_from(r.min(1000)).unwrap_or(1000)
    }
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            strategy: Strategy::BestFit,
            mps_oversubscribe: false,
            dynamic_mig: true,
            gpu_index: None,
            temporal: Temporal::Weighted(EXPIRY_WEIGHT),
            expiry: None,
        }
    }
}

/// Where a shape goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanDecision {
    /// Create a new GI (+CI) at this placement.
    NewMig {
        gpu: u32,
        gi_profile_id: u32,
        placement: Placement,
        ci_profile_id: Option<u32>,
    },
    /// Take this free static-pool partition.
    Static {
        gpu: u32,
        partition_id: String,
    },
    Mps {
        gpu: u32,
    },
    WholeGpu {
        gpu: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("invalid shape: {0}")]
    InvalidShape(String),
    #[error("unknown MIG profile {profile:?}; this node offers: {known}")]
    UnknownProfile { profile: String, known: String },
    #[error("no capacity: {0}")]
    NoCapacity(String),
    /// Enough room, but not within the topology the request demands (multi-GPU
    /// leases, `partition/topology.rs`).
    #[error("topology constraint not met: {0}")]
    TopologyUnmet(String),
}

/// Decide where `shape` goes among `gpus`. See the module doc for the rules.
pub fn plan(
    shape: &Shape,
    gpus: &[GpuView],
    opts: &PlanOptions,
) -> Result<PlanDecision, PlanError> {
    let considered = considered_gpus(gpus, opts.gpu_index)?;
    match shape {
        Shape::Mig {
            profile,
            compute_profile,
        } => plan_mig(profile, compute_profile.as_deref(), &considered, opts, true),
        Shape::Mps {
            sm_percent,
            memory_bytes,
            mode,
        } => plan_mps(*sm_percent, *memory_bytes, *mode, &considered, opts),
        Shape::WholeGpu => plan_whole(&considered),
        Shape::MigMps { .. } => Err(PlanError::InvalidShape(
            "an MPS share inside MIG is planned with its host instances (plan_mig_mps)".into(),
        )),
    }
}

/// Why no GPU of the node could ever take `shape` in its current mode, or None.
///
/// `gpus` is every GPU of the node, healthy or not; `only` the one a request names.
/// A MIG shape (or an MPS share inside MIG) needs a GPU with MIG enabled; an MPS share
/// or a whole GPU needs one with MIG disabled. When every GPU considered is in the
/// other mode, the request cannot succeed until an operator changes a GPU's mode (a
/// GPU reset), so it is refused as a failed precondition, not as capacity that may
/// free up (which would have clients wait and retry for nothing). An index that is
/// not on the node, or a node without GPUs, is left to the planner's own answer.
pub fn mode_unavailable(
    shape: &Shape,
    gpus: &[&crate::gpu::GpuInfo],
    only: Option<u32>,
) -> Option<String> {
    let mut considered: Vec<&crate::gpu::GpuInfo> = gpus
        .iter()
        .copied()
        .filter(|g| only.is_none_or(|i| g.index == i))
        .collect();
    if considered.is_empty() {
        return None;
    }
    considered.sort_by_key(|g| g.index);
    let needs_mig = matches!(shape, Shape::Mig { .. } | Shape::MigMps { .. });
    if considered.iter().any(|g| g.mig_current == needs_mig) {
        return None;
    }
    let names = join(considered.iter().map(|g| format!("gpu{}", g.index)));
    let which = match (only, considered.len()) {
        (Some(_), _) | (None, 1) => format!("{names} is"),
        (None, _) => format!("every GPU of this node ({names}) is"),
    };
    // A mode change an operator made that takes effect at the GPU's next reset.
    let pending: Vec<String> = considered
        .iter()
        .filter(|g| g.mig_pending == needs_mig)
        .map(|g| format!("gpu{}", g.index))
        .collect();
    let pending = if pending.is_empty() {
        String::new()
    } else {
        format!(
            " ({} {} MIG {} pending a GPU reset)",
            pending.join(", "),
            if pending.len() == 1 { "has" } else { "have" },
            if needs_mig { "enabled" } else { "disabled" }
        )
    };
    Some(if needs_mig {
        format!(
            "{which} not in MIG mode{pending}: a MIG instance needs a GPU with MIG enabled; \
             ask for an MPS share or a whole GPU, or have the operator enable MIG"
        )
    } else {
        let asked = if matches!(shape, Shape::WholeGpu) {
            "a whole GPU"
        } else {
            "an MPS share"
        };
        format!(
            "{which} in MIG mode{pending}: {asked} needs a GPU with MIG disabled; \
             ask for a MIG instance (or an MPS share inside one, mig_mps), or have the \
             operator disable MIG"
        )
    })
}

/// The GPUs to look at, sorted by index.
fn considered_gpus(gpus: &[GpuView], only: Option<u32>) -> Result<Vec<&GpuView>, PlanError> {
    let mut all: Vec<&GpuView> = gpus.iter().collect();
    all.sort_by_key(|g| g.info.index);
    match only {
        None => Ok(all),
        Some(i) => match all.iter().find(|g| g.info.index == i) {
            Some(g) => Ok(vec![*g]),
            None => Err(PlanError::InvalidShape(format!(
                "no GPU with index {i} on this node (GPUs: {})",
                if all.is_empty() {
                    "none".to_string()
                } else {
                    join(all.iter().map(|g| g.info.index.to_string()))
                }
            ))),
        },
    }
}

fn join(items: impl Iterator<Item = String>) -> String {
    items.collect::<Vec<_>>().join(", ")
}

fn gpu_name(g: &GpuView) -> String {
    format!("gpu{}", g.info.index)
}

// ---------------------------------------------------------------------------------------
// MIG

/// A considered MIG GPU with the GI profile (and CI profile) the request maps to on it.
struct MigTarget<'a> {
    view: &'a GpuView,
    profile: &'a GiProfile,
    ci_profile_id: Option<u32>,
}

fn plan_mig(
    profile_name: &str,
    compute_profile: Option<&str>,
    gpus: &[&GpuView],
    opts: &PlanOptions,
    allow_static: bool,
) -> Result<PlanDecision, PlanError> {
    // Why each considered GPU cannot take the instance, for the NoCapacity message.
    let mut reasons: Vec<String> = Vec::new();
    let mig_gpus = mig_enabled(gpus, profile_name, &mut reasons)?;
    let offering = offering(&mig_gpus, profile_name, &mut reasons)?;
    let targets = mig_targets(&offering, profile_name, compute_profile, &mut reasons)?;

    // The static pool first (whole-GI requests only).
    if compute_profile.is_none()
        && allow_static
        && let Some(decision) = free_static(&targets)
    {
        return Ok(decision);
    }
    if !opts.dynamic_mig {
        return Err(static_pool_refusal(
            profile_name,
            compute_profile,
            &targets,
            reasons,
        ));
    }

    // Every feasible placement for a new instance, by GPU.
    let mut blocked: Vec<String> = Vec::new();
    let feasible = feasible_placements(&targets, &mut blocked);
    blocked.extend(reasons);
    match choose_placement(feasible, opts) {
        Some((t, placement)) => Ok(PlanDecision::NewMig {
            gpu: t.view.info.index,
            gi_profile_id: t.profile.id,
            placement,
            ci_profile_id: t.ci_profile_id,
        }),
        None => Err(PlanError::NoCapacity(format!(
            "no free placement for {profile_name} on any MIG-enabled GPU ({})",
            blocked.join("; ")
        ))),
    }
}

/// The considered GPUs with MIG on and not held whole; why each other one is not.
fn mig_enabled<'a>(
    gpus: &[&'a GpuView],
    profile_name: &str,
    reasons: &mut Vec<String>,
) -> Result<Vec<&'a GpuView>, PlanError> {
    let mut mig_gpus: Vec<&GpuView> = Vec::new();
    for g in gpus {
        if !g.info.mig_current {
            reasons.push(format!("{}: MIG disabled", gpu_name(g)));
        } else if g.whole_leased {
            reasons.push(format!("{}: held by a whole-GPU lease", gpu_name(g)));
        } else {
            mig_gpus.push(g);
        }
    }
    if mig_gpus.is_empty() {
        return Err(PlanError::NoCapacity(format!(
            "no MIG-enabled GPU to place {profile_name} on ({})",
            reasons.join("; ")
        )));
    }
    Ok(mig_gpus)
}

/// The MIG GPUs that offer the GI profile, with it; UnknownProfile when none does.
fn offering<'a>(
    mig_gpus: &[&'a GpuView],
    profile_name: &str,
    reasons: &mut Vec<String>,
) -> Result<Vec<(&'a GpuView, &'a GiProfile)>, PlanError> {
    let offering: Vec<(&GpuView, &GiProfile)> = mig_gpus
        .iter()
        .filter_map(|g| g.gi_profile(profile_name).map(|p| (*g, p)))
        .collect();
    if offering.is_empty() {
        let mut known: Vec<&str> = mig_gpus
            .iter()
            .flat_map(|g| g.profiles.iter().map(|p| p.name.as_str()))
            .collect();
        known.sort_unstable();
        known.dedup();
        return Err(PlanError::UnknownProfile {
            profile: profile_name.to_string(),
            known: if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            },
        });
    }
    for g in mig_gpus {
        if !offering.iter().any(|(o, _)| o.info.index == g.info.index) {
            reasons.push(format!("{}: does not offer {profile_name}", gpu_name(g)));
        }
    }
    Ok(offering)
}

/// The CI profile resolved on each GPU offering the GI profile; InvalidShape when no
/// GPU offers the compute profile inside it.
fn mig_targets<'a>(
    offering: &[(&'a GpuView, &'a GiProfile)],
    profile_name: &str,
    compute_profile: Option<&str>,
    reasons: &mut Vec<String>,
) -> Result<Vec<MigTarget<'a>>, PlanError> {
    let mut targets: Vec<MigTarget> = Vec::new();
    let mut allowed_ci: Vec<&str> = Vec::new();
    for (view, gp) in offering {
        let ci_profile_id = match compute_profile {
            None => None,
            Some(c) => match gp.ci_profile(c) {
                Some(ci) => Some(ci.id),
                None => {
                    allowed_ci.extend(gp.ci_profiles.iter().map(|ci| ci.name.as_str()));
                    reasons.push(format!(
                        "{}: {} has no compute profile {c}",
                        gpu_name(view),
                        gp.name
                    ));
                    continue;
                }
            },
        };
        targets.push(MigTarget {
            view,
            profile: gp,
            ci_profile_id,
        });
    }
    if let (true, Some(c)) = (targets.is_empty(), compute_profile) {
        allowed_ci.sort_unstable();
        allowed_ci.dedup();
        return Err(PlanError::InvalidShape(format!(
            "compute profile {c:?} is not offered inside {profile_name}; allowed: {}",
            if allowed_ci.is_empty() {
                "none".to_string()
            } else {
                allowed_ci.join(", ")
            }
        )));
    }
    Ok(targets)
}

/// The free static-pool instance of the profile on the lowest GPU and start.
fn free_static(targets: &[MigTarget]) -> Option<PlanDecision> {
    let (gpu, _, id) = targets
        .iter()
        .flat_map(|t| {
            t.view.mig.iter().filter_map(move |m| match &m.free_static {
                Some(id) if m.gi_profile_id == t.profile.id => {
                    Some((t.view.info.index, m.placement.start, id))
                }
                _ => None,
            })
        })
        .min()?;
    Some(PlanDecision::Static {
        gpu,
        partition_id: id.clone(),
    })
}

/// The refusal when dynamic MIG is off and the static pool has no free instance.
fn static_pool_refusal(
    profile_name: &str,
    compute_profile: Option<&str>,
    targets: &[MigTarget],
    reasons: Vec<String>,
) -> PlanError {
    if let Some(c) = compute_profile {
        return PlanError::InvalidShape(format!(
            "compute profile {c:?} needs a new MIG instance, but dynamic MIG is disabled \
             on this node and static-pool partitions are whole GPU instances"
        ));
    }
    PlanError::NoCapacity(format!(
        "no free static-pool {profile_name} partition, and dynamic MIG is disabled on this \
         node ({})",
        join(
            targets
                .iter()
                .map(|t| {
                    let n = instance_count(&t.view.mig, t.profile.id);
                    format!(
                        "{}: {n} static-pool or leased {} instance{}, none free",
                        gpu_name(t.view),
                        t.profile.name,
                        if n == 1 { "" } else { "s" }
                    )
                })
                .chain(reasons)
        )
    ))
}

/// Every free placement of a new instance on each target below its `max_count`; why
/// each other target has none goes to `blocked`.
fn feasible_placements<'t, 'a>(
    targets: &'t [MigTarget<'a>],
    blocked: &mut Vec<String>,
) -> Vec<(&'t MigTarget<'a>, Vec<Placement>)> {
    let mut feasible = Vec::new();
    for t in targets {
        if !below_max_count(&t.view.mig, t.profile) {
            blocked.push(format!(
                "{}: already {} {} instances (max {})",
                gpu_name(t.view),
                instance_count(&t.view.mig, t.profile.id),
                t.profile.name,
                t.profile.max_count
            ));
            continue;
        }
        let free = free_placements(t.profile, &t.view.mig);
        if free.is_empty() {
            blocked.push(format!(
                "{}: {} of {} memory slices used, no free {}-slice placement at start {}",
                gpu_name(t.view),
                used_memory_slices(t.view),
                total_memory_slices(t.view),
                t.profile.memory_slices,
                describe_starts(&t.profile.placements)
            ));
            continue;
        }
        feasible.push((t, free));
    }
    feasible
}

/// The placement the strategy picks among the feasible ones.
fn choose_placement<'t, 'a>(
    feasible: Vec<(&'t MigTarget<'a>, Vec<Placement>)>,
    opts: &PlanOptions,
) -> Option<(&'t MigTarget<'a>, Placement)> {
    match opts.strategy {
        Strategy::FirstFit => feasible
            .into_iter()
            .flat_map(|(t, free)| free.into_iter().map(move |p| (t, p)))
            .min_by_key(|(t, p)| (t.view.info.index, p.start)),
        Strategy::BestFit => feasible
            .into_iter()
            .flat_map(|(t, free)| {
                // What depends on the GPU alone, once per GPU.
                let gpu = GpuFit::of(t, opts);
                free.into_iter().map(move |p| (gpu.key(t, p), t, p))
            })
            .min_by_key(|(k, _, _)| *k)
            .map(|(_, t, p)| (t, p)),
    }
}

/// The parts of best fit's sort key that depend on the GPU alone: its capacity value
/// now, its free slices and the temporal term (computed once per GPU, not once per
/// placement).
struct GpuFit {
    before: u64,
    free_slices: u32,
    temporal: u64,
    tie: u64,
}

impl GpuFit {
    fn of(t: &MigTarget, opts: &PlanOptions) -> GpuFit {
        let (temporal, tie) = match (&opts.expiry, opts.temporal) {
            (None, _) | (_, Temporal::Off) => (0, 0),
            (Some(e), Temporal::TieBreak) => (0, e.cost(t.view, false)),
            (Some(e), Temporal::Weighted(w)) => (u64::from(w) * e.cost(t.view, false), 0),
            (Some(e), Temporal::Group(w)) => (u64::from(w) * e.cost(t.view, true), 0),
            (Some(e), Temporal::Empties(w)) => (u64::from(w) * e.empties(t.view), 0),
        };
        GpuFit {
            before: capacity_value(&t.view.profiles, &t.view.mig),
            free_slices: total_memory_slices(t.view).saturating_sub(used_memory_slices(t.view)),
            temporal,
            tie,
        }
    }

    /// Sort key for best fit: (capacity lost with the temporal term, the expiry cost
    /// for a tie-break, free slices on the GPU, GPU index, start).
    fn key(&self, t: &MigTarget, placement: Placement) -> (u64, u64, u32, u32, u32) {
        let mut after: Vec<OccupiedMig> = t.view.mig.clone();
        after.push(OccupiedMig {
            gi_profile_id: t.profile.id,
            placement,
            free_static: None,
        });
        let loss = self
            .before
            .saturating_sub(capacity_value(&t.view.profiles, &after));
        (
            loss * 1000 + self.temporal,
            self.tie,
            self.free_slices,
            t.view.info.index,
            placement.start,
        )
    }
}

fn describe_starts(placements: &[Placement]) -> String {
    let starts: Vec<String> = placements.iter().map(|p| p.start.to_string()).collect();
    match starts.len() {
        0 => "(none)".to_string(),
        1 => starts.join(""),
        n => format!("{} or {}", starts[..n - 1].join(", "), starts[n - 1]),
    }
}

// ---------------------------------------------------------------------------------------
// Moves of idle instances

/// A MIG instance the planner may move: one whose lease has no container bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Movable {
    pub gpu: u32,
    pub placement: Placement,
}

/// Move one instance: destroy it at `from` on `from_gpu`, create it again (same GI
/// profile, same CI profile) at `to` on `to_gpu`. `to` overlaps no instance present
/// before the plan (the old places of the other moved instances included), so the
/// moves of a plan can be done one after the other, each destroy-then-create, in any
/// order; the new instance comes last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    pub from_gpu: u32,
    pub from: Placement,
    pub gi_profile_id: u32,
    pub to_gpu: u32,
    pub to: Placement,
}

/// Where a shape goes once the moves are done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovePlan {
    pub moves: Vec<Move>,
    pub decision: PlanDecision,
}

/// Like [`plan`]; when that refuses a MIG shape for lack of room (and dynamic MIG is on),
/// looks for a placement whose overlapping instances are all `movable` and can all be
/// created again elsewhere (on any considered GPU, at a placement free of every present
/// instance and of the new one). Among those, the fewest moves win, then the fewest
/// memory slices moved, then the placement [`plan`]'s strategy would prefer (its best-fit
/// loss), then the lower GPU and start. Each moved instance is placed by the node's
/// strategy. Free static-pool instances never move. Errors are [`plan`]'s.
pub fn plan_with_moves(
    shape: &Shape,
    gpus: &[GpuView],
    opts: &PlanOptions,
    movable: &[Movable],
) -> Result<MovePlan, PlanError> {
    let refusal = match plan(shape, gpus, opts) {
        Ok(decision) => {
            return Ok(MovePlan {
                moves: Vec::new(),
                decision,
            });
        }
        Err(e @ PlanError::NoCapacity(_)) => e,
        Err(e) => return Err(e),
    };
    let Shape::Mig {
        profile,
        compute_profile,
    } = shape
    else {
        return Err(refusal);
    };
    if !opts.dynamic_mig || movable.is_empty() {
        return Err(refusal);
    }
    let considered = considered_gpus(gpus, opts.gpu_index)?;
    // (moves, slices moved, loss, gpu, start) and the plan.
    let mut best: Option<(MoveKey, MovePlan)> = None;
    for g in &considered {
        if !g.info.mig_current || g.whole_leased {
            continue;
        }
        let Some(gp) = g.gi_profile(profile) else {
            continue;
        };
        let ci_profile_id = match compute_profile {
            None => None,
            Some(c) => match gp.ci_profile(c) {
                Some(ci) => Some(ci.id),
                None => continue,
            },
        };
        for placement in &gp.placements {
            let blockers: Vec<&OccupiedMig> = g
                .mig
                .iter()
                .filter(|m| m.placement.overlaps(placement))
                .collect();
            if blockers.is_empty() {
                continue; // plan() saw this one: max_count stops it.
            }
            let all_movable = blockers.iter().all(|b| {
                b.free_static.is_none()
                    && movable
                        .iter()
                        .any(|m| m.gpu == g.info.index && m.placement == b.placement)
            });
            if !all_movable {
                continue;
            }
            let staying = instance_count(&g.mig, gp.id)
                - u32::try_from(blockers.iter().filter(|b| b.gi_profile_id == gp.id).count())
                    .unwrap_or(0);
            if staying >= gp.max_count {
                continue;
            }
            if let Some((key, plan)) =
                relocate(g, gp, *placement, ci_profile_id, &blockers, gpus, opts)
                && best.as_ref().is_none_or(|(k, _)| key < *k)
            {
                best = Some((key, plan));
            }
        }
    }
    best.map(|(_, p)| p).ok_or(refusal)
}

/// Housekeeping (`[partition] compact_idle`) calls [`compact`] at most this many times
/// per pass: each call moves one idle instance.
pub const COMPACT_MOVES_PER_PASS: usize = 2;

/// Housekeeping (`[partition] compact_idle`): the one move of an idle instance that
/// most raises the node's free-space value (best fit's [`capacity_value`] summed over
/// the GPUs), to any free placement of its profile on a considered GPU of the same
/// model (free of every
/// instance present, its own old place included; within `max_count`). Ties go to the
/// lower source GPU and start, then the lower target GPU and start. None when no move
/// raises the value, or dynamic MIG is off.
pub fn compact(gpus: &[GpuView], opts: &PlanOptions, movable: &[Movable]) -> Option<Move> {
    if !opts.dynamic_mig {
        return None;
    }
    let considered: Vec<&GpuView> = considered_gpus(gpus, opts.gpu_index)
        .ok()?
        .into_iter()
        .filter(|g| g.info.mig_current && !g.whole_leased)
        .collect();
    let mut order: Vec<&Movable> = movable.iter().collect();
    order.sort_by_key(|m| (m.gpu, m.placement.start));
    let mut best: Option<(u64, Move)> = None;
    for m in order {
        let Some(g) = considered.iter().find(|g| g.info.index == m.gpu) else {
            continue;
        };
        for (gain, mv) in compaction_moves(g, m, &considered) {
            if gain > 0 && best.as_ref().is_none_or(|(b, _)| gain > *b) {
                best = Some((gain, mv));
            }
        }
    }
    best.map(|(_, mv)| mv)
}

/// Every move of the idle instance `m` on `g` to a free placement of its profile on a
/// considered GPU of the same model, with what it gains in free-space value (in the
/// order [`compact`] weighs them). None when `m` is no leased instance of a known
/// profile.
fn compaction_moves(g: &GpuView, m: &Movable, considered: &[&GpuView]) -> Vec<(u64, Move)> {
    let Some(inst) = g
        .mig
        .iter()
        .find(|i| i.placement == m.placement && i.free_static.is_none())
    else {
        return Vec::new();
    };
    let Some(name) = g
        .profiles
        .iter()
        .find(|p| p.id == inst.gi_profile_id)
        .map(|p| p.name.as_str())
    else {
        return Vec::new();
    };
    let from_before = capacity_value(&g.profiles, &g.mig);
    let without: Vec<OccupiedMig> = g
        .mig
        .iter()
        .filter(|i| i.placement != m.placement)
        .cloned()
        .collect();
    let mut out = Vec::new();
    // Only to a GPU of the same model: the lease keeps its GI and CI profiles.
    for t in considered.iter().filter(|t| t.info.name == g.info.name) {
        let Some(tp) = t
            .profiles
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(name) && p.id == inst.gi_profile_id)
        else {
            continue;
        };
        let same = t.info.index == g.info.index;
        // The target's instances once the move is done, but for the new one.
        let base: &[OccupiedMig] = if same { &without } else { &t.mig };
        if !below_max_count(base, tp) {
            continue;
        }
        for to in free_placements(tp, &t.mig) {
            let mut after = base.to_vec();
            after.push(OccupiedMig {
                gi_profile_id: tp.id,
                placement: to,
                free_static: None,
            });
            let (before, after) = if same {
                (from_before, capacity_value(&t.profiles, &after))
            } else {
                (
                    from_before + capacity_value(&t.profiles, &t.mig),
                    capacity_value(&g.profiles, &without) + capacity_value(&t.profiles, &after),
                )
            };
            out.push((
                after.saturating_sub(before),
                Move {
                    from_gpu: m.gpu,
                    from: m.placement,
                    gi_profile_id: tp.id,
                    to_gpu: t.info.index,
                    to,
                },
            ));
        }
    }
    out
}

/// How a move plan ranks: (moves, memory slices moved, best-fit loss, GPU, start).
type MoveKey = (usize, u32, u64, u32, u32);

/// The new instance at `placement` on `g`, and each blocker placed again by the
/// strategy, largest first, with every present instance (the blockers' old places
/// included) and the new one held. None when a blocker fits nowhere.
fn relocate(
    g: &GpuView,
    gp: &GiProfile,
    placement: Placement,
    ci_profile_id: Option<u32>,
    blockers: &[&OccupiedMig],
    gpus: &[GpuView],
    opts: &PlanOptions,
) -> Option<(MoveKey, MovePlan)> {
    let mut views: Vec<GpuView> = gpus.to_vec();
    let target = views.iter_mut().find(|v| v.info.index == g.info.index)?;
    let before = capacity_value(&target.profiles, &target.mig);
    let mut without: Vec<OccupiedMig> = target
        .mig
        .iter()
        .filter(|m| !blockers.iter().any(|b| b.placement == m.placement))
        .cloned()
        .collect();
    without.push(OccupiedMig {
        gi_profile_id: gp.id,
        placement,
        free_static: None,
    });
    let loss = before.saturating_sub(capacity_value(&target.profiles, &without));
    target.mig.push(OccupiedMig {
        gi_profile_id: gp.id,
        placement,
        free_static: None,
    });
    let (moves, moved_slices) = place_blockers(g, blockers, &mut views, opts)?;
    let key = (
        moves.len(),
        moved_slices,
        loss,
        g.info.index,
        placement.start,
    );
    Some((
        key,
        MovePlan {
            moves,
            decision: PlanDecision::NewMig {
                gpu: g.info.index,
                gi_profile_id: gp.id,
                placement,
                ci_profile_id,
            },
        },
    ))
}

/// Each blocker on `g` placed again by the strategy, largest first, on `views` (which
/// gain each placed one): the moves and the memory slices moved. None when a blocker
/// fits nowhere.
fn place_blockers(
    g: &GpuView,
    blockers: &[&OccupiedMig],
    views: &mut [GpuView],
    opts: &PlanOptions,
) -> Option<(Vec<Move>, u32)> {
    let mut order: Vec<&OccupiedMig> = blockers.to_vec();
    order.sort_by_key(|b| (std::cmp::Reverse(b.placement.size), b.placement.start));
    let relocate_opts = PlanOptions {
        gpu_index: None,
        // The expiry given is the new lease's, not a moved one's.
        expiry: None,
        ..opts.clone()
    };
    let mut moves = Vec::with_capacity(order.len());
    let mut moved_slices = 0u32;
    for b in order {
        let name = g
            .profiles
            .iter()
            .find(|p| p.id == b.gi_profile_id)?
            .name
            .clone();
        let considered = considered_gpus(views, None).ok()?;
        let d = plan_mig(&name, None, &considered, &relocate_opts, false).ok()?;
        let PlanDecision::NewMig {
            gpu,
            gi_profile_id,
            placement: to,
            ..
        } = d
        else {
            return None;
        };
        views
            .iter_mut()
            .find(|v| v.info.index == gpu)?
            .mig
            .push(OccupiedMig {
                gi_profile_id,
                placement: to,
                free_static: None,
            });
        moved_slices += b.placement.size;
        moves.push(Move {
            from_gpu: g.info.index,
            from: b.placement,
            gi_profile_id: b.gi_profile_id,
            to_gpu: gpu,
            to,
        });
    }
    Some((moves, moved_slices))
}

// ---------------------------------------------------------------------------------------
// MPS

fn plan_mps(
    sm_percent: u32,
    memory_bytes: u64,
    mode: MpsMode,
    gpus: &[&GpuView],
    opts: &PlanOptions,
) -> Result<PlanDecision, PlanError> {
    check_mps_share(sm_percent, memory_bytes)?;
    let asked_mem = u128::from(memory_bytes);

    let mut reasons: Vec<String> = Vec::new();
    // (SM percent left, memory left, index) of every GPU that admits the share.
    let fitting: Vec<(i64, u128, u32)> = gpus
        .iter()
        .filter_map(|g| mps_room(g, sm_percent, memory_bytes, mode, opts, &mut reasons))
        .collect();
    let chosen = match opts.strategy {
        Strategy::FirstFit => fitting.iter().min_by_key(|(_, _, i)| *i),
        Strategy::BestFit => fitting.iter().min(),
    };
    match chosen {
        Some((_, _, gpu)) => Ok(PlanDecision::Mps { gpu: *gpu }),
        None => Err(PlanError::NoCapacity(format!(
            "no GPU can admit an MPS share of {sm_percent}% SMs and {} in {mode} mode ({})",
            fmt_bytes(asked_mem),
            if reasons.is_empty() {
                "no GPUs".to_string()
            } else {
                reasons.join("; ")
            }
        ))),
    }
}

/// An MPS share asks for 1 to 100 % of the SMs and some memory.
pub(super) fn check_mps_share(sm_percent: u32, memory_bytes: u64) -> Result<(), PlanError> {
    if !(1..=100).contains(&sm_percent) {
        return Err(PlanError::InvalidShape(format!(
            "MPS sm_percent must be 1..=100, got {sm_percent}"
        )));
    }
    if memory_bytes == 0 {
        return Err(PlanError::InvalidShape(
            "MPS memory_bytes must be greater than 0".to_string(),
        ));
    }
    Ok(())
}

/// (SM percent left, memory left, index) of `g` when it admits the share; else why
/// not, in `reasons`.
fn mps_room(
    g: &GpuView,
    sm_percent: u32,
    memory_bytes: u64,
    mode: MpsMode,
    opts: &PlanOptions,
    reasons: &mut Vec<String>,
) -> Option<(i64, u128, u32)> {
    let asked_sm = u64::from(sm_percent);
    let asked_mem = u128::from(memory_bytes);
    let name = gpu_name(g);
    if g.info.mig_current {
        reasons.push(format!("{name}: MIG enabled"));
        return None;
    }
    if g.whole_leased {
        reasons.push(format!("{name}: held by a whole-GPU lease"));
        return None;
    }
    // One mode per GPU at a time: an isolated lease's guarantee (its own
    // server, limits it cannot loosen) holds next to other isolated servers,
    // but a shared server beside them would time-slice against them too and
    // the shared leases would lose the concurrency they asked for.
    if let Some(other) = g.mps.other_mode(mode) {
        reasons.push(format!(
            "MPS on {name}: serves {other} shares, {mode} asked"
        ));
        return None;
    }
    let used_sm = g.mps.sm_percent;
    let used_mem = g.mps.memory_bytes;
    let total_mem = u128::from(g.info.memory_bytes);
    let sm_ok = opts.mps_oversubscribe || used_sm + asked_sm <= 100;
    let mem_ok = used_mem + asked_mem <= total_mem;
    if !sm_ok {
        reasons.push(format!(
            "MPS on {name}: {used_sm}% of SMs already admitted, {sm_percent}% asked"
        ));
    }
    if !mem_ok {
        reasons.push(format!(
            "MPS on {name}: {} of {} memory already admitted, {} asked",
            fmt_bytes(used_mem),
            fmt_bytes(total_mem),
            fmt_bytes(asked_mem)
        ));
    }
    if !(sm_ok && mem_ok) {
        return None;
    }
    let sm_left = 100i64.saturating_sub(i64::try_from(used_sm).unwrap_or(i64::MAX));
    Some((sm_left, total_mem - used_mem, g.info.index))
}

fn fmt_bytes(b: u128) -> String {
    // Display only: the float conversion's precision loss does not matter here.
    let gib = b as f64 / f64::from(1u32 << 30);
    format!("{gib:.2} GiB")
}

// ---------------------------------------------------------------------------------------
// Whole GPU

fn plan_whole(gpus: &[&GpuView]) -> Result<PlanDecision, PlanError> {
    let mut reasons: Vec<String> = Vec::new();
    for g in gpus {
        let name = gpu_name(g);
        if g.info.mig_current {
            reasons.push(format!("{name}: MIG enabled"));
        } else if !g.mig.is_empty() {
            reasons.push(format!("{name}: {} MIG instances present", g.mig.len()));
        } else if g.whole_leased {
            reasons.push(format!("{name}: already leased whole"));
        } else if !g.mps.is_empty() {
            reasons.push(format!(
                "{name}: {} MPS share{} active",
                g.mps.len(),
                if g.mps.len() == 1 { "" } else { "s" }
            ));
        } else {
            return Ok(PlanDecision::WholeGpu { gpu: g.info.index });
        }
    }
    Err(PlanError::NoCapacity(format!(
        "no whole GPU free ({})",
        if reasons.is_empty() {
            "no GPUs".to_string()
        } else {
            reasons.join("; ")
        }
    )))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::partition::test_fixtures::*;
    use crate::partition::{MpsShare, free_capacity};

    fn first_fit() -> PlanOptions {
        PlanOptions {
            strategy: Strategy::FirstFit,
            ..PlanOptions::default()
        }
    }

    fn best_fit() -> PlanOptions {
        PlanOptions::default()
    }

    fn new_mig(d: &PlanDecision) -> (u32, u32, u32) {
        match d {
            PlanDecision::NewMig {
                gpu,
                gi_profile_id,
                placement,
                ..
            } => (*gpu, *gi_profile_id, placement.start),
            other => panic!("expected NewMig, got {other:?}"),
        }
    }

    fn no_capacity(r: Result<PlanDecision, PlanError>) -> String {
        match r {
            Err(PlanError::NoCapacity(m)) => m,
            other => panic!("expected NoCapacity, got {other:?}"),
        }
    }

    fn invalid(r: Result<PlanDecision, PlanError>) -> String {
        match r {
            Err(PlanError::InvalidShape(m)) => m,
            other => panic!("expected InvalidShape, got {other:?}"),
        }
    }

    fn mps(sm_percent: u32, memory_bytes: u64) -> Shape {
        Shape::Mps {
            sm_percent,
            memory_bytes,
            mode: MpsMode::Isolated,
        }
    }

    fn share(sm_percent: u32, memory_bytes: u64) -> MpsShare {
        MpsShare {
            sm_percent,
            memory_bytes,
            mode: MpsMode::Isolated,
        }
    }

    #[test]
    fn a_gpu_serves_one_mps_mode_at_a_time() {
        let shared = |sm| Shape::Mps {
            sm_percent: sm,
            memory_bytes: gib(1),
            mode: MpsMode::Shared,
        };
        let mut g1 = h100_plain(1);
        g1.mps = [share(10, gib(1))].into_iter().collect();
        let mut g2 = h100_plain(2);
        g2.mps = [MpsShare {
            mode: MpsMode::Shared,
            ..share(60, gib(1))
        }]
        .into_iter()
        .collect();
        let gpus = [g1.clone(), g2];
        // Shared goes beside shared (even where an isolated GPU has more room) ...
        assert_eq!(
            plan(&shared(30), &gpus, &best_fit()).unwrap(),
            PlanDecision::Mps { gpu: 2 }
        );
        // ... isolated beside isolated ...
        assert_eq!(
            plan(&mps(30, gib(1)), &gpus, &first_fit()).unwrap(),
            PlanDecision::Mps { gpu: 1 }
        );
        // ... and never the other way round, whatever room is left.
        let msg = no_capacity(plan(&shared(10), &[g1], &best_fit()));
        assert!(
            msg.contains("serves isolated shares, shared asked"),
            "{msg}"
        );
        assert!(msg.contains("in shared mode"), "{msg}");
    }

    // ------------------------------------------------------------------ MIG: matching

    #[test]
    fn mig_goes_only_to_mig_enabled_gpus() {
        let gpus = [h100_plain(0), h100_mig(1)];
        for opts in [first_fit(), best_fit()] {
            let d = plan(&mig_shape("1g.10gb"), &gpus, &opts).unwrap();
            assert_eq!(new_mig(&d).0, 1);
        }
        let msg = no_capacity(plan(&mig_shape("1g.10gb"), &[h100_plain(0)], &best_fit()));
        assert!(msg.contains("no MIG-enabled GPU"), "{msg}");
        assert!(msg.contains("gpu0: MIG disabled"), "{msg}");
    }

    fn info(index: u32, mig: bool) -> crate::gpu::GpuInfo {
        if mig {
            h100_mig(index)
        } else {
            h100_plain(index)
        }
        .info
    }

    #[test]
    fn a_shape_no_gpu_mode_can_take_is_told_apart_from_capacity() {
        let (p0, p1, m0, m1) = (info(0, false), info(1, false), info(0, true), info(1, true));
        let plain = [&p0, &p1];
        let mig = [&m0, &m1];
        let mixed = [&p0, &m1];
        let m = mode_unavailable(&mig_shape("1g.10gb"), &plain, None).unwrap();
        assert!(
            m.contains("every GPU of this node (gpu0, gpu1) is not in MIG mode"),
            "{m}"
        );
        assert!(m.contains("MPS share or a whole GPU"), "{m}");
        let share = Shape::MigMps {
            profile: "1g.10gb".into(),
            sm_percent: 50,
            memory_bytes: 1 << 30,
        };
        assert!(mode_unavailable(&share, &plain, None).is_some());
        let m = mode_unavailable(&mps(50, 1 << 30), &mig, None).unwrap();
        assert!(
            m.contains("in MIG mode") && m.contains("an MPS share needs"),
            "{m}"
        );
        let m = mode_unavailable(&Shape::WholeGpu, &mig, Some(1)).unwrap();
        assert!(
            m.starts_with("gpu1 is in MIG mode: a whole GPU needs"),
            "{m}"
        );
        // One GPU in the right mode is enough: the rest is the planner's (capacity).
        for s in [mig_shape("1g.10gb"), mps(50, 1 << 30), Shape::WholeGpu] {
            assert_eq!(mode_unavailable(&s, &mixed, None), None, "{s:?}");
        }
        // The GPU a request names decides alone.
        assert!(mode_unavailable(&mig_shape("1g.10gb"), &mixed, Some(0)).is_some());
        assert_eq!(
            mode_unavailable(&mig_shape("1g.10gb"), &mixed, Some(1)),
            None
        );
        // An unknown index or a node without GPUs: the planner answers.
        assert_eq!(
            mode_unavailable(&mig_shape("1g.10gb"), &plain, Some(7)),
            None
        );
        assert_eq!(mode_unavailable(&mig_shape("1g.10gb"), &[], None), None);
        // A mode change waiting for a reset is named.
        let mut pending = info(0, false);
        pending.mig_pending = true;
        let m = mode_unavailable(&mig_shape("1g.10gb"), &[&pending], None).unwrap();
        assert!(
            m.contains("(gpu0 has MIG enabled pending a GPU reset)"),
            "{m}"
        );
    }

    #[test]
    fn mig_skips_a_whole_leased_gpu() {
        let mut g0 = h100_mig(0);
        g0.whole_leased = true;
        let gpus = [g0, h100_mig(1)];
        let d = plan(&mig_shape("1g.10gb"), &gpus, &first_fit()).unwrap();
        assert_eq!(new_mig(&d).0, 1);
    }

    #[test]
    fn profile_name_is_case_insensitive() {
        let gpus = [h100_mig(0)];
        let d = plan(&mig_shape("3G.40GB"), &gpus, &first_fit()).unwrap();
        assert_eq!(new_mig(&d), (0, 2, 0));
    }

    #[test]
    fn unknown_profile_lists_what_the_node_offers() {
        let gpus = [h100_mig(0), h100_plain(1)];
        match plan(&mig_shape("3g.20gb"), &gpus, &best_fit()) {
            Err(PlanError::UnknownProfile { profile, known }) => {
                assert_eq!(profile, "3g.20gb");
                assert_eq!(
                    known,
                    "1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb"
                );
            }
            other => panic!("expected UnknownProfile, got {other:?}"),
        }
    }

    #[test]
    fn same_name_maps_to_each_gpus_own_profile_id() {
        // "1g.10gb" is id 0 on an H100 but id 9 (2 memory slices) on an A100-40GB.
        let mut h = h100_mig(0);
        h.mig.push(occ(&h, "7g.80gb", 0));
        let gpus = [h, a100_mig(1)];
        let d = plan(&mig_shape("1g.10gb"), &gpus, &first_fit()).unwrap();
        match d {
            PlanDecision::NewMig {
                gpu,
                gi_profile_id,
                placement,
                ..
            } => {
                assert_eq!((gpu, gi_profile_id), (1, 9));
                assert_eq!(placement.size, 2);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn compute_profile_resolves_to_its_ci_id() {
        let gpus = [h100_mig(0)];
        let shape = Shape::Mig {
            profile: "3g.40gb".into(),
            compute_profile: Some("2C".into()),
        };
        match plan(&shape, &gpus, &best_fit()).unwrap() {
            PlanDecision::NewMig { ci_profile_id, .. } => assert_eq!(ci_profile_id, Some(1)),
            other => panic!("{other:?}"),
        }
        let whole = plan(&mig_shape("3g.40gb"), &gpus, &best_fit()).unwrap();
        match whole {
            PlanDecision::NewMig { ci_profile_id, .. } => assert_eq!(ci_profile_id, None),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unknown_compute_profile_names_the_allowed_ones() {
        let gpus = [h100_mig(0)];
        let shape = Shape::Mig {
            profile: "3g.40gb".into(),
            compute_profile: Some("4c".into()),
        };
        let msg = invalid(plan(&shape, &gpus, &best_fit()));
        assert!(msg.contains("\"4c\""), "{msg}");
        assert!(msg.contains("allowed: 1c, 2c, 3c"), "{msg}");
    }

    // ------------------------------------------------------------------ MIG: static pool

    fn with_static(mut v: GpuView, name: &str, start: u32, id: &str) -> GpuView {
        let mut m = occ(&v, name, start);
        m.free_static = Some(id.to_string());
        v.mig.push(m);
        v
    }

    #[test]
    fn free_static_partition_is_preferred_over_a_new_instance() {
        let g0 = with_static(h100_mig(0), "1g.10gb", 3, "static-a");
        let g1 = with_static(h100_mig(1), "1g.10gb", 1, "static-b");
        let gpus = [g1, g0];
        for opts in [first_fit(), best_fit()] {
            assert_eq!(
                plan(&mig_shape("1g.10gb"), &gpus, &opts).unwrap(),
                PlanDecision::Static {
                    gpu: 0,
                    partition_id: "static-a".into()
                }
            );
        }
        // A static partition of another profile is not taken.
        let d = plan(&mig_shape("2g.20gb"), &gpus, &first_fit()).unwrap();
        assert_eq!(new_mig(&d), (0, 1, 0));
    }

    #[test]
    fn a_leased_static_partition_is_not_offered_again() {
        let mut g0 = with_static(h100_mig(0), "3g.40gb", 0, "s1");
        g0.mig[0].free_static = None;
        let gpus = [g0];
        let d = plan(&mig_shape("3g.40gb"), &gpus, &best_fit()).unwrap();
        assert_eq!(new_mig(&d), (0, 2, 4));
    }

    #[test]
    fn compute_profile_requests_never_take_static_partitions() {
        let gpus = [with_static(h100_mig(0), "3g.40gb", 0, "s1")];
        let shape = Shape::Mig {
            profile: "3g.40gb".into(),
            compute_profile: Some("1c".into()),
        };
        let d = plan(&shape, &gpus, &best_fit()).unwrap();
        assert_eq!(new_mig(&d), (0, 2, 4));
        let static_only = PlanOptions {
            dynamic_mig: false,
            ..best_fit()
        };
        let msg = invalid(plan(&shape, &gpus, &static_only));
        assert!(msg.contains("dynamic MIG is disabled"), "{msg}");
    }

    #[test]
    fn without_dynamic_mig_only_the_static_pool_is_used() {
        let opts = PlanOptions {
            dynamic_mig: false,
            ..best_fit()
        };
        let gpus = [with_static(h100_mig(0), "2g.20gb", 2, "s2")];
        assert_eq!(
            plan(&mig_shape("2g.20gb"), &gpus, &opts).unwrap(),
            PlanDecision::Static {
                gpu: 0,
                partition_id: "s2".into()
            }
        );
        let msg = no_capacity(plan(&mig_shape("1g.10gb"), &gpus, &opts));
        assert!(
            msg.contains("no free static-pool 1g.10gb partition"),
            "{msg}"
        );
        assert!(msg.contains("dynamic MIG is disabled"), "{msg}");
    }

    // ------------------------------------------------------------------ MIG: geometry

    #[test]
    fn new_instances_never_overlap_present_ones() {
        let mut g = h100_mig(0);
        g.mig.push(occ(&g, "3g.40gb", 0));
        g.mig.push(occ(&g, "1g.10gb", 5));
        let gpus = [g];
        for opts in [first_fit(), best_fit()] {
            // 2g: start 0 and 2 overlap the 3g, 4 overlaps the 1g at 5.
            let msg = no_capacity(plan(&mig_shape("2g.20gb"), &gpus, &opts));
            assert!(
                msg.contains(
                    "gpu0: 5 of 8 memory slices used, no free 2-slice placement at start 0, 2 or 4"
                ),
                "{msg}"
            );
            let d = plan(&mig_shape("1g.20gb"), &gpus, &opts).unwrap();
            assert_eq!(new_mig(&d), (0, 9, 6));
        }
    }

    #[test]
    fn media_extension_profile_shares_slices_with_1g() {
        let mut g = h100_mig(0);
        for s in 0..6 {
            g.mig.push(occ(&g, "1g.10gb", s));
        }
        let mut gpus = [g];
        let d = plan(&mig_shape("1g.10gb+me"), &gpus, &best_fit()).unwrap();
        assert_eq!(new_mig(&d), (0, 7, 6));
        apply(&mut gpus, &mig_shape("1g.10gb+me"), &d);
        // All seven 1g slots are now taken, one of them by the +me instance.
        let msg = no_capacity(plan(&mig_shape("1g.10gb"), &gpus, &best_fit()));
        assert!(msg.contains("7 of 8 memory slices used"), "{msg}");
    }

    #[test]
    fn max_count_is_enforced_even_with_free_slices() {
        let mut g = h100_mig(0);
        g.mig.push(occ(&g, "1g.10gb+me", 0));
        let gpus = [g];
        let msg = no_capacity(plan(&mig_shape("1g.10gb+me"), &gpus, &first_fit()));
        assert!(
            msg.contains("gpu0: already 1 1g.10gb+me instances (max 1)"),
            "{msg}"
        );

        // Three 2g (max 3) leave slices 6-7 free, but no fourth 2g may be created.
        let mut g = h100_mig(0);
        for s in [0, 2, 4] {
            g.mig.push(occ(&g, "2g.20gb", s));
        }
        let gpus = [g];
        let msg = no_capacity(plan(&mig_shape("2g.20gb"), &gpus, &first_fit()));
        assert!(msg.contains("already 3 2g.20gb instances (max 3)"), "{msg}");
    }

    #[test]
    fn temporal_packing_joins_the_gpu_whose_leases_outlast_the_new_one() {
        // Two GPUs alike, each with a 1g.10gb at slice 6: best fit ties, gpu0 wins.
        let mut g0 = h100_mig(0);
        g0.mig.push(occ(&g0, "1g.10gb", 6));
        let mut g1 = h100_mig(1);
        g1.mig.push(occ(&g1, "1g.10gb", 6));
        let gpus = [g0, g1];
        let shape = mig_shape("1g.10gb");
        assert_eq!(new_mig(&plan(&shape, &gpus, &best_fit()).unwrap()).0, 0);
        // gpu0's lease expires at 100, gpu1's at 1000: a new lease until 500 would keep
        // gpu0 busy 400 longer and gpu1 no longer at all.
        let expiry = Expiry {
            now: 0,
            new_lease: 500,
            latest: vec![(0, 100), (1, 1000)],
        };
        for temporal in [Temporal::Weighted(EXPIRY_WEIGHT), Temporal::TieBreak] {
            let opts = PlanOptions {
                temporal,
                expiry: Some(expiry.clone()),
                ..best_fit()
            };
            assert_eq!(new_mig(&plan(&shape, &gpus, &opts).unwrap()).0, 1);
        }
        // Grouping by similar ends: 1000 is as far from 500 as 100 is; 150 is nearer.
        let opts = PlanOptions {
            temporal: Temporal::Group(EXPIRY_WEIGHT),
            expiry: Some(Expiry {
                latest: vec![(0, 150), (1, 1000)],
                ..expiry.clone()
            }),
            ..best_fit()
        };
        assert_eq!(new_mig(&plan(&shape, &gpus, &opts).unwrap()).0, 0);
        // Off, the expiries are ignored.
        let opts = PlanOptions {
            temporal: Temporal::Off,
            expiry: Some(expiry),
            ..best_fit()
        };
        assert_eq!(new_mig(&plan(&shape, &gpus, &opts).unwrap()).0, 0);
    }

    #[test]
    fn temporal_packing_does_not_open_an_empty_gpu() {
        // gpu0 empty; gpu1 has a 1g.10gb at slice 6 whose lease ends long before the
        // new one: joining it still wins (an empty GPU costs the most, and best fit
        // would lose the 7g there).
        let g0 = h100_mig(0);
        let mut g1 = h100_mig(1);
        g1.mig.push(occ(&g1, "1g.10gb", 6));
        let gpus = [g0, g1];
        let opts = PlanOptions {
            expiry: Some(Expiry {
                now: 0,
                new_lease: 1000,
                latest: vec![(1, 10)],
            }),
            ..best_fit()
        };
        let d = plan(&mig_shape("1g.10gb"), &gpus, &opts).unwrap();
        assert_eq!(new_mig(&d).0, 1);
    }

    #[test]
    fn first_fit_takes_lowest_gpu_then_lowest_start() {
        let mut g0 = h100_mig(0);
        g0.mig.push(occ(&g0, "1g.10gb", 0));
        let gpus = [h100_mig(1), g0];
        let d = plan(&mig_shape("1g.10gb"), &gpus, &first_fit()).unwrap();
        assert_eq!(new_mig(&d), (0, 0, 1));
    }

    #[test]
    fn gpu_index_restricts_the_search() {
        let gpus = [h100_mig(0), h100_mig(1)];
        let opts = PlanOptions {
            gpu_index: Some(1),
            ..first_fit()
        };
        let d = plan(&mig_shape("7g.80gb"), &gpus, &opts).unwrap();
        assert_eq!(new_mig(&d), (1, 4, 0));
        let opts = PlanOptions {
            gpu_index: Some(7),
            ..first_fit()
        };
        let msg = invalid(plan(&mig_shape("7g.80gb"), &gpus, &opts));
        assert!(msg.contains("no GPU with index 7"), "{msg}");
        assert!(msg.contains("GPUs: 0, 1"), "{msg}");
    }

    #[test]
    fn no_capacity_names_every_gpu_and_why() {
        let mut g0 = h100_mig(0);
        g0.mig.push(occ(&g0, "3g.40gb", 0));
        g0.mig.push(occ(&g0, "2g.20gb", 4));
        let mut g1 = h100_mig(1);
        g1.mig.push(occ(&g1, "3g.40gb", 0));
        g1.mig.push(occ(&g1, "3g.40gb", 4));
        let gpus = [g0, g1, h100_plain(2)];
        let msg = no_capacity(plan(&mig_shape("3g.40gb"), &gpus, &best_fit()));
        assert!(
            msg.starts_with("no free placement for 3g.40gb on any MIG-enabled GPU ("),
            "{msg}"
        );
        assert!(
            msg.contains(
                "gpu0: 6 of 8 memory slices used, no free 4-slice placement at start 0 or 4"
            ),
            "{msg}"
        );
        assert!(
            msg.contains("gpu1: already 2 3g.40gb instances (max 2)"),
            "{msg}"
        );
        assert!(msg.contains("gpu2: MIG disabled"), "{msg}");
    }

    // ------------------------------------------------------------------ MIG: best fit

    /// Plan `shapes` one after another on `gpus`, applying each decision; returns the
    /// results.
    fn run(
        gpus: &mut [GpuView],
        shapes: &[&str],
        opts: &PlanOptions,
    ) -> Vec<Result<PlanDecision, PlanError>> {
        shapes
            .iter()
            .map(|name| {
                let shape = mig_shape(name);
                let r = plan(&shape, gpus, opts);
                if let Ok(d) = &r {
                    apply(gpus, &shape, d);
                }
                r
            })
            .collect()
    }

    #[test]
    fn best_fit_keeps_room_for_a_4g_after_a_lone_1g() {
        // First fit puts the 1g at slice 0, which is the only 4g placement.
        let mut ff = [h100_mig(0)];
        let r = run(&mut ff, &["1g.10gb", "4g.40gb"], &first_fit());
        assert_eq!(new_mig(r[0].as_ref().unwrap()), (0, 0, 0));
        assert!(matches!(r[1], Err(PlanError::NoCapacity(_))), "{:?}", r[1]);

        // Best fit puts it at slice 6 and the 4g still fits.
        let mut bf = [h100_mig(0)];
        let r = run(&mut bf, &["1g.10gb", "4g.40gb"], &best_fit());
        assert_eq!(new_mig(r[0].as_ref().unwrap()), (0, 0, 6));
        assert_eq!(new_mig(r[1].as_ref().unwrap()), (0, 3, 0));
    }

    #[test]
    fn best_fit_does_not_block_a_3g_with_a_2g() {
        // A 1g already sits at slice 6, so the 3g at 4 is gone; a 3g can only go at 0.
        let start = || {
            let mut g = h100_mig(0);
            g.mig.push(occ(&g, "1g.10gb", 6));
            [g]
        };
        // First fit puts the 2g at 0 and the 3g is refused.
        let mut ff = start();
        let r = run(&mut ff, &["2g.20gb", "3g.40gb"], &first_fit());
        assert_eq!(new_mig(r[0].as_ref().unwrap()), (0, 1, 0));
        let msg = match &r[1] {
            Err(PlanError::NoCapacity(m)) => m.clone(),
            other => panic!("{other:?}"),
        };
        assert!(msg.contains("3 of 8 memory slices used"), "{msg}");
        // Best fit puts the 2g at 4 (next to the 1g) and the 3g fits at 0.
        let mut bf = start();
        let r = run(&mut bf, &["2g.20gb", "3g.40gb"], &best_fit());
        assert_eq!(new_mig(r[0].as_ref().unwrap()), (0, 1, 4));
        assert_eq!(new_mig(r[1].as_ref().unwrap()), (0, 2, 0));
    }

    #[test]
    fn best_fit_packs_partly_used_gpus_first() {
        let empty = h100_mig(0);
        let mut used = h100_mig(1);
        used.mig.push(occ(&used, "3g.40gb", 0));
        let gpus = [empty, used];
        let d = plan(&mig_shape("2g.20gb"), &gpus, &best_fit()).unwrap();
        assert_eq!(new_mig(&d).0, 1, "best fit keeps gpu0 whole for a 7g");
        let d = plan(&mig_shape("2g.20gb"), &gpus, &first_fit()).unwrap();
        assert_eq!(new_mig(&d), (0, 1, 0));
        // And the 7g still fits after best fit's choice.
        let mut gpus = gpus;
        run(&mut gpus, &["2g.20gb"], &best_fit());
        let d = plan(&mig_shape("7g.80gb"), &gpus, &best_fit()).unwrap();
        assert_eq!(new_mig(&d), (0, 4, 0));
    }

    #[test]
    fn best_fit_fills_seven_1g_without_waste() {
        let mut gpus = [h100_mig(0)];
        let r = run(&mut gpus, &["1g.10gb"; 7], &best_fit());
        assert!(r.iter().all(Result::is_ok), "{r:?}");
        assert!(free_capacity(&gpus[0]).iter().all(|(_, n)| *n == 0));
    }

    // ------------------------------------------------------------------ MIG: moves

    #[test]
    fn compaction_empties_a_gpu_for_a_7g_and_leaves_bound_leases() {
        // gpu0: a lone 1g (left when its neighbours ended); gpu1: a 3g and a 2g.
        let mut g0 = h100_mig(0);
        let lone = occ(&g0, "1g.10gb", 6);
        g0.mig.push(lone.clone());
        let mut g1 = h100_mig(1);
        g1.mig.push(occ(&g1, "3g.40gb", 0));
        g1.mig.push(occ(&g1, "2g.20gb", 4));
        let mut gpus = [g0, g1];
        assert!(plan(&mig_shape("7g.80gb"), &gpus, &best_fit()).is_err());
        let idle = [Movable {
            gpu: 0,
            placement: lone.placement,
        }];
        // Bound (not movable): nothing moves.
        assert_eq!(compact(&gpus, &best_fit(), &[]), None);
        let m = compact(&gpus, &best_fit(), &idle).unwrap();
        assert_eq!((m.from_gpu, m.from, m.to_gpu), (0, lone.placement, 1));
        gpus[0].mig.clear();
        gpus[1].mig.push(OccupiedMig {
            gi_profile_id: m.gi_profile_id,
            placement: m.to,
            free_static: None,
        });
        assert!(plan(&mig_shape("7g.80gb"), &gpus, &best_fit()).is_ok());
        // Packed now: a second pass finds nothing better.
        let idle = [Movable {
            gpu: 1,
            placement: m.to,
        }];
        assert_eq!(compact(&gpus, &best_fit(), &idle), None);
    }

    #[test]
    fn an_idle_instance_moves_to_make_room_for_a_7g() {
        // One 1g on each GPU: no 7g fits until one of them moves next to the other.
        let mut g0 = h100_mig(0);
        g0.mig.push(occ(&g0, "1g.10gb", 6));
        let mut g1 = h100_mig(1);
        g1.mig.push(occ(&g1, "1g.10gb", 6));
        let gpus = [g0, g1];
        let seven = mig_shape("7g.80gb");
        assert!(no_capacity(plan(&seven, &gpus, &best_fit())).contains("gpu1"));
        let idle = |gpu| Movable {
            gpu,
            placement: Placement { start: 6, size: 1 },
        };
        let p = plan_with_moves(&seven, &gpus, &best_fit(), &[idle(0), idle(1)]).unwrap();
        assert_eq!(p.moves.len(), 1, "{p:?}");
        let m = p.moves[0];
        assert_eq!(m.from, Placement { start: 6, size: 1 });
        assert_ne!(m.from_gpu, m.to_gpu);
        assert_eq!(m.gi_profile_id, 0);
        // The 1g lands in a free slot of the other GPU, and the 7g where it was.
        assert_ne!(m.to, Placement { start: 6, size: 1 });
        assert_eq!(new_mig(&p.decision), (m.from_gpu, 4, 0));
        // Only gpu1's instance is idle: it is the one that moves.
        let p = plan_with_moves(&seven, &gpus, &best_fit(), &[idle(1)]).unwrap();
        assert_eq!((p.moves[0].from_gpu, p.moves[0].to_gpu), (1, 0));
        assert_eq!(new_mig(&p.decision), (1, 4, 0));
    }

    #[test]
    fn bound_instances_never_move() {
        let mut g0 = h100_mig(0);
        g0.mig.push(occ(&g0, "1g.10gb", 6));
        g0.mig.push(occ(&g0, "2g.20gb", 0));
        let mut g1 = h100_mig(1);
        g1.mig.push(occ(&g1, "1g.10gb", 6));
        let gpus = [g0, g1];
        let seven = mig_shape("7g.80gb");
        // gpu0's 1g is idle but its 2g is bound; gpu1's 1g is bound.
        let idle = [Movable {
            gpu: 0,
            placement: Placement { start: 6, size: 1 },
        }];
        let msg =
            no_capacity(plan_with_moves(&seven, &gpus, &best_fit(), &idle).map(|p| p.decision));
        assert!(msg.starts_with("no free placement for 7g.80gb"), "{msg}");
        // Nothing movable: plan()'s refusal as it is.
        assert_eq!(
            plan_with_moves(&seven, &gpus, &best_fit(), &[]).map(|p| p.decision),
            plan(&seven, &gpus, &best_fit())
        );
    }

    #[test]
    fn moves_are_only_made_when_needed_and_only_for_mig() {
        let mut g0 = h100_mig(0);
        g0.mig.push(occ(&g0, "1g.10gb", 6));
        let gpus = [g0, h100_plain(1)];
        let idle = [Movable {
            gpu: 0,
            placement: Placement { start: 6, size: 1 },
        }];
        let p = plan_with_moves(&mig_shape("3g.40gb"), &gpus, &best_fit(), &idle).unwrap();
        assert!(p.moves.is_empty());
        assert_eq!(new_mig(&p.decision), (0, 2, 0));
        let p = plan_with_moves(&Shape::WholeGpu, &gpus, &best_fit(), &idle).unwrap();
        assert_eq!(p.decision, PlanDecision::WholeGpu { gpu: 1 });
        // Without dynamic MIG nothing is created, so nothing moves.
        let static_only = PlanOptions {
            dynamic_mig: false,
            ..best_fit()
        };
        assert!(plan_with_moves(&mig_shape("7g.80gb"), &gpus, &static_only, &idle).is_err());
    }

    // ------------------------------------------------------------------ MPS

    #[test]
    fn mps_shape_is_validated() {
        let gpus = [h100_plain(0)];
        assert!(invalid(plan(&mps(0, gib(1)), &gpus, &best_fit())).contains("1..=100"));
        assert!(invalid(plan(&mps(101, gib(1)), &gpus, &best_fit())).contains("got 101"));
        assert!(invalid(plan(&mps(10, 0), &gpus, &best_fit())).contains("memory_bytes"));
    }

    #[test]
    fn mps_only_on_mig_disabled_gpus_without_whole_lease() {
        let mut leased = h100_plain(1);
        leased.whole_leased = true;
        let gpus = [h100_mig(0), leased, h100_plain(2)];
        for opts in [first_fit(), best_fit()] {
            assert_eq!(
                plan(&mps(10, gib(1)), &gpus, &opts).unwrap(),
                PlanDecision::Mps { gpu: 2 }
            );
        }
        let msg = no_capacity(plan(&mps(10, gib(1)), &gpus[..2], &best_fit()));
        assert!(msg.contains("gpu0: MIG enabled"), "{msg}");
        assert!(msg.contains("gpu1: held by a whole-GPU lease"), "{msg}");
    }

    #[test]
    fn mps_sm_admission_sums_to_at_most_100() {
        let mut g = h100_plain(2);
        g.mps = [share(50, gib(1)), share(30, gib(1))].into_iter().collect();
        let gpus = [g];
        let msg = no_capacity(plan(&mps(30, gib(1)), &gpus, &best_fit()));
        assert!(
            msg.contains("MPS on gpu2: 80% of SMs already admitted, 30% asked"),
            "{msg}"
        );
        assert_eq!(
            plan(&mps(20, gib(1)), &gpus, &best_fit()).unwrap(),
            PlanDecision::Mps { gpu: 2 }
        );
        let over = PlanOptions {
            mps_oversubscribe: true,
            ..best_fit()
        };
        assert_eq!(
            plan(&mps(30, gib(1)), &gpus, &over).unwrap(),
            PlanDecision::Mps { gpu: 2 }
        );
    }

    #[test]
    fn mps_memory_admission_holds_even_when_oversubscribing() {
        let mut g = h100_plain(0);
        g.mps = [share(10, gib(70))].into_iter().collect();
        let gpus = [g];
        let over = PlanOptions {
            mps_oversubscribe: true,
            ..best_fit()
        };
        let msg = no_capacity(plan(&mps(10, gib(11)), &gpus, &over));
        assert!(
            msg.contains(
                "MPS on gpu0: 70.00 GiB of 80.00 GiB memory already admitted, 11.00 GiB asked"
            ),
            "{msg}"
        );
        assert_eq!(
            plan(&mps(10, gib(10)), &gpus, &over).unwrap(),
            PlanDecision::Mps { gpu: 0 }
        );
        // A share larger than the GPU is refused on an empty GPU too.
        let msg = no_capacity(plan(&mps(10, gib(81)), &[h100_plain(0)], &best_fit()));
        assert!(msg.contains("0.00 GiB of 80.00 GiB"), "{msg}");
    }

    #[test]
    fn mps_best_fit_packs_first_fit_takes_lowest_index() {
        let mut g1 = h100_plain(1);
        g1.mps = [share(50, gib(10))].into_iter().collect();
        let mut g2 = h100_plain(2);
        g2.mps = [share(70, gib(10))].into_iter().collect();
        let gpus = [h100_plain(0), g1, g2];
        assert_eq!(
            plan(&mps(30, gib(1)), &gpus, &best_fit()).unwrap(),
            PlanDecision::Mps { gpu: 2 }
        );
        assert_eq!(
            plan(&mps(40, gib(1)), &gpus, &best_fit()).unwrap(),
            PlanDecision::Mps { gpu: 1 },
            "gpu2 has only 30% left"
        );
        assert_eq!(
            plan(&mps(30, gib(1)), &gpus, &first_fit()).unwrap(),
            PlanDecision::Mps { gpu: 0 }
        );
    }

    #[test]
    fn gpu_index_pins_mps_and_whole_gpu_requests() {
        let mut g1 = h100_plain(1);
        g1.mps = [share(50, gib(10))].into_iter().collect();
        let gpus = [h100_plain(0), g1];
        let on0 = PlanOptions {
            gpu_index: Some(0),
            ..best_fit()
        };
        // Best fit alone would pack onto gpu1.
        assert_eq!(
            plan(&mps(30, gib(1)), &gpus, &on0).unwrap(),
            PlanDecision::Mps { gpu: 0 }
        );
        let on1 = PlanOptions {
            gpu_index: Some(1),
            ..best_fit()
        };
        let msg = no_capacity(plan(&Shape::WholeGpu, &gpus, &on1));
        assert_eq!(msg, "no whole GPU free (gpu1: 1 MPS share active)");
    }

    // ------------------------------------------------------------------ whole GPU

    #[test]
    fn whole_gpu_needs_an_idle_mig_disabled_gpu() {
        let mut with_mps = h100_plain(1);
        with_mps.mps = [share(10, gib(1))].into_iter().collect();
        let mut leased = h100_plain(2);
        leased.whole_leased = true;
        let gpus = [h100_plain(3), leased, with_mps, h100_mig(0)];
        for opts in [first_fit(), best_fit()] {
            assert_eq!(
                plan(&Shape::WholeGpu, &gpus, &opts).unwrap(),
                PlanDecision::WholeGpu { gpu: 3 }
            );
        }
        let msg = no_capacity(plan(&Shape::WholeGpu, &gpus[1..], &best_fit()));
        assert_eq!(
            msg,
            "no whole GPU free (gpu0: MIG enabled; gpu1: 1 MPS share active; \
             gpu2: already leased whole)"
        );
    }

    #[test]
    fn a_whole_gpu_lease_excludes_mps_and_further_whole_leases() {
        let mut gpus = [h100_plain(0)];
        let d = plan(&Shape::WholeGpu, &gpus, &best_fit()).unwrap();
        apply(&mut gpus, &Shape::WholeGpu, &d);
        assert!(
            no_capacity(plan(&mps(10, gib(1)), &gpus, &best_fit()))
                .contains("gpu0: held by a whole-GPU lease")
        );
        assert!(plan(&Shape::WholeGpu, &gpus, &best_fit()).is_err());
    }
}
