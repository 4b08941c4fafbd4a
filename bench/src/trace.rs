//! Trace-driven comparison of MIG placement strategies against a free-repacking
//! reference (the `placement-bench` binary prints it; `make bench` checks the goal).
//!
//! A [`TraceSpec`] describes a seeded workload on a node of identical MIG GPUs: Poisson
//! arrivals, exponential or heavy-tailed (Pareto) durations, and a weighted mix of GI
//! profiles. [`generate`] turns it into requests; [`run`] replays them under one
//! [`Policy`] and tallies, per profile, what was offered and accepted.
//!
//! The measure is *slice-time*: memory slices of the instance (its placement size, 8 on
//! a whole A100/H100/H200) times its duration. A policy's score is its accepted
//! slice-time divided by the reference's on the same requests.
//!
//! * [`Policy::Reference`]: free repacking. At each arrival the request is accepted when
//!   *some* assignment of every live instance plus the new one to the GPUs, with valid,
//!   non-overlapping placements within each profile's `max_count`, exists: an exact
//!   search (bin packing over the per-GPU layouts that exist, see [`Repacker`]). No real
//!   node can do this, since it would move instances that run work.
//! * [`Policy::Planner`]: the real [`plan`] with the given options; instances stay where
//!   they were created.
//! * [`Policy::PlannerWithMoves`]: the same, and when [`plan`] refuses, the real
//!   [`plan_with_moves`] may move *idle* instances (leases whose container has not bound
//!   yet: each lease is idle for a random start-up period, [`TraceSpec::startup`]).
//! * [`Policy::Static`]: a static layout made for the mix (profiles in proportion to
//!   the slice-time the mix asks for, laid out by the planner), then the planner with
//!   dynamic MIG off: a request takes a free static instance of its profile.
//!
//! * [`Policy::Housekeeping`]: moves, and the daemon's housekeeping [`compact`] after
//!   each grant and each end.
//! * [`Policy::Queued`] and [`Policy::ReferenceQueued`]: the planner (or the reference)
//!   with an admission queue. A refused request waits up to `max_wait` mean durations;
//!   at each end the waiting requests are tried oldest first (a request never overtakes
//!   an older one of its own profile), and one granted holds its instance for its whole
//!   duration from the grant (its wait is tallied per profile). A request still
//!   waiting at its deadline is refused.
//!
//! Each request carries a TTL per [`TtlModel`] (none, exact, or an upper bound of its
//! duration); planner policies tell the planner each live lease's expiry and the new
//! one's ([`Expiry`], temporal packing), as the daemon does. Leases still end at
//! their duration; the reference ignores TTLs.
//!
//! The first tenth of the requests warms the node up and is not tallied.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::reserve::{Reservation, hold, reserve};
use tesserad::gpu::profiles::GpuModel;
use tesserad::gpu::{GiProfile, GpuInfo, Placement};
use tesserad::partition::{
    COMPACT_MOVES_PER_PASS, Expiry, GpuView, Movable, Move, OccupiedMig, PlanDecision, PlanError,
    PlanOptions, Reservations, ReserveOptions, Shape, compact, plan, plan_with_moves,
};

/// Durations, each with mean 1 (the time unit of a trace).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Durations {
    Exponential,
    /// Pareto with this shape (> 1): most leases short, a few very long.
    Pareto {
        alpha: f64,
    },
}

/// A seeded workload.
#[derive(Debug, Clone)]
pub struct TraceSpec {
    pub model: GpuModel,
    pub gpus: u32,
    /// (GI profile name, weight): the chance that a request asks for that profile.
    pub mix: Vec<(String, f64)>,
    /// Offered load: the memory slices asked for at once on average, over the node's
    /// memory slices (1.0 = the node would be exactly full with perfect packing).
    pub load: f64,
    pub durations: Durations,
    pub requests: usize,
    pub seed: u64,
    /// Mean idle period at the start of a lease (before its container binds), as a
    /// fraction of the mean duration; exponential, never longer than the lease.
    pub startup: f64,
    /// What the planner is told of when each lease ends.
    pub ttl: TtlModel,
}

/// What a lease's TTL says of its duration. The lease still ends at its duration; the
/// TTL is what the planner is told ([`Expiry`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TtlModel {
    /// No TTL information (the planner as before).
    #[default]
    None,
    /// TTL = duration: every tenant releases exactly at expiry (optimistic bound).
    Exact,
    /// TTL = duration / u, u uniform in [0.5, 1] per request: an upper bound, tenants
    /// release early.
    Upper,
    /// TTL = duration / u, u uniform in [0.1, 1]: a loose bound (tenants ask for up to
    /// ten times what they use), to see how the gain fades.
    Loose,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TraceError {
    #[error("the {model} has no MIG profile {profile:?}")]
    UnknownProfile { model: String, profile: String },
    #[error("invalid trace: {0}")]
    Invalid(String),
    #[error("planner: {0}")]
    Planner(#[from] PlanError),
}

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    pub at: f64,
    pub duration: f64,
    /// Index into the spec's mix.
    pub profile: usize,
    /// How long the lease stays idle (movable) after it is granted.
    pub idle_for: f64,
    /// The lease's TTL (when it expires after the grant), per [`TtlModel`].
    pub ttl: Option<f64>,
}

/// How a trace is served.
#[derive(Debug, Clone)]
pub enum Policy {
    Reference,
    /// The reference with the same admission queue as [`Policy::Queued`]: what a
    /// queued policy is measured against (waiting lets any policy serve more).
    ReferenceQueued {
        max_wait: f64,
    },
    Planner(PlanOptions),
    PlannerWithMoves(PlanOptions),
    Static(PlanOptions),
    /// [`Policy::PlannerWithMoves`], and housekeeping: after each grant and each end,
    /// up to [`HOUSEKEEPING_MOVES`] idle instances move where the planner would put them
    /// now when that raises the node's free-space value (the best-fit measure summed
    /// over the GPUs), best gain first.
    Housekeeping(PlanOptions),
    /// The planner (moving idle leases when `moves`), and an admission queue: a
    /// request it refuses waits up to `max_wait` (in mean durations) for room, in
    /// arrival order per profile, then holds its instance for its whole duration from
    /// the grant. With `reserve`, each waiting request of 4 memory slices or more
    /// holds a region that no newer request may take ([`super::reserve`]).
    Queued {
        opts: PlanOptions,
        moves: bool,
        max_wait: f64,
        reserve: bool,
        /// The daemon's reservations for refused large requests (in mean durations).
        holds: Option<ReserveOptions>,
    },
    /// The planner (moving idle leases when `moves`) with the daemon's reservations
    /// for large requests refused for lack of room ([`Reservations`]); times in
    /// mean durations.
    Reserving {
        opts: PlanOptions,
        moves: bool,
        reserve: ReserveOptions,
    },
}

/// `r`, whose times count [`RESERVE_UNIT`]ths of the mean duration, in trace ticks.
fn reserve_in_ticks(r: &ReserveOptions) -> ReserveOptions {
    ReserveOptions {
        grace: r.grace.saturating_mul(TICKS_PER_UNIT / RESERVE_UNIT),
        max_hold: r.max_hold.saturating_mul(TICKS_PER_UNIT / RESERVE_UNIT),
        ..*r
    }
}

/// Trace ticks per mean duration.
pub const TICKS_PER_UNIT: u64 = 1_000_000_000;
/// The times of a [`ReserveOptions`] given to [`Policy::Reserving`] count
/// thousandths of the mean duration.
pub const RESERVE_UNIT: u64 = 1000;

/// What one profile of the mix was offered and got (warm-up excluded).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProfileTally {
    pub name: String,
    pub offered: u64,
    pub accepted: u64,
    pub offered_slice_time: f64,
    pub accepted_slice_time: f64,
    /// Requests accepted after waiting in the queue.
    pub waited: u64,
    /// The wait of every accepted request (0 when granted at once), in mean durations.
    pub waits: Vec<f64>,
}

impl ProfileTally {
    /// Mean wait of the accepted requests, in mean durations.
    pub fn mean_wait(&self) -> f64 {
        if self.waits.is_empty() {
            return 0.0;
        }
        #[allow(clippy::cast_precision_loss)]
        let n = self.waits.len() as f64;
        self.waits.iter().sum::<f64>() / n
    }

    /// The 99th percentile wait of the accepted requests (nearest rank).
    pub fn p99_wait(&self) -> f64 {
        percentile(&self.waits, 0.99)
    }
}

/// Nearest-rank percentile `q` (0..=1) of `values`; 0 when empty.
pub fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// The result of one policy on one trace.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub profiles: Vec<ProfileTally>,
    /// Instances moved (PlannerWithMoves only).
    pub moves: u64,
}

impl Outcome {
    pub fn accepted_slice_time(&self) -> f64 {
        self.profiles.iter().map(|p| p.accepted_slice_time).sum()
    }
    pub fn offered_slice_time(&self) -> f64 {
        self.profiles.iter().map(|p| p.offered_slice_time).sum()
    }
}

/// The GI profiles of the mix, in mix order.
fn mix_profiles(spec: &TraceSpec) -> Result<Vec<GiProfile>, TraceError> {
    let all = spec.model.gi_profiles();
    spec.mix
        .iter()
        .map(|(name, _)| {
            all.iter()
                .find(|p| p.name.eq_ignore_ascii_case(name))
                .cloned()
                .ok_or_else(|| TraceError::UnknownProfile {
                    model: spec.model.to_string(),
                    profile: name.clone(),
                })
        })
        .collect()
}

fn validate(spec: &TraceSpec) -> Result<(), TraceError> {
    let bad = |m: &str| Err(TraceError::Invalid(m.to_string()));
    if spec.gpus == 0 || spec.gpus > 64 {
        return bad("gpus must be 1..=64");
    }
    if spec.mix.is_empty() || spec.mix.iter().any(|(_, w)| !(*w >= 0.0 && w.is_finite())) {
        return bad("the mix needs at least one profile and finite weights >= 0");
    }
    let mut names: Vec<String> = spec
        .mix
        .iter()
        .map(|(n, _)| n.to_ascii_lowercase())
        .collect();
    names.sort();
    names.dedup();
    if names.len() != spec.mix.len() {
        return bad("a profile appears twice in the mix");
    }
    if spec.mix.iter().map(|(_, w)| w).sum::<f64>() <= 0.0 {
        return bad("the mix's weights sum to 0");
    }
    if !(spec.load > 0.0 && spec.load.is_finite()) {
        return bad("load must be > 0");
    }
    if let Durations::Pareto { alpha } = spec.durations
        && !(alpha > 1.0 && alpha.is_finite())
    {
        return bad("a Pareto shape must be > 1 (else the mean is infinite)");
    }
    if !(spec.startup >= 0.0 && spec.startup.is_finite()) {
        return bad("startup must be >= 0");
    }
    Ok(())
}

/// The requests of a trace: the same spec (seed included) gives the same requests.
pub fn generate(spec: &TraceSpec) -> Result<Vec<Request>, TraceError> {
    validate(spec)?;
    let profiles = mix_profiles(spec)?;
    let total_w: f64 = spec.mix.iter().map(|(_, w)| w).sum();
    let mean_slices: f64 = spec
        .mix
        .iter()
        .zip(&profiles)
        .map(|((_, w), p)| w / total_w * f64::from(p.memory_slices))
        .sum();
    let node_slices = f64::from(spec.gpus) * f64::from(slices_per_gpu(&profiles));
    // Little's law: slices in use = rate * mean duration (1) * mean slices.
    let rate = spec.load * node_slices / mean_slices;
    let mut rng = StdRng::seed_from_u64(spec.seed);
    // Uniform in (0, 1]: never 0, so logarithms and powers stay finite.
    let mut unit = move || 1.0 - rng.r#gen::<f64>();
    let mut at = 0.0;
    let mut out = Vec::with_capacity(spec.requests);
    for _ in 0..spec.requests {
        at += -unit().ln() / rate;
        let mut x = (1.0 - unit()) * total_w;
        let profile = spec
            .mix
            .iter()
            .position(|(_, w)| {
                if x < *w {
                    true
                } else {
                    x -= w;
                    false
                }
            })
            .unwrap_or(spec.mix.len() - 1);
        let duration = match spec.durations {
            Durations::Exponential => -unit().ln(),
            Durations::Pareto { alpha } => (alpha - 1.0) / alpha / unit().powf(1.0 / alpha),
        };
        let idle_for = (-unit().ln() * spec.startup).min(duration);
        out.push(Request {
            at,
            duration,
            profile,
            idle_for,
            ttl: None,
        });
    }
    // From a stream of its own, so the requests are the same under every TTL model.
    let mut ttl_rng = StdRng::seed_from_u64(spec.seed ^ 0x7474_6c5f_7365_6564);
    for r in &mut out {
        // One draw per request whatever the model, so each model sees the same stream.
        let x: f64 = ttl_rng.gen_range(0.0..=1.0);
        r.ttl = match spec.ttl {
            TtlModel::None => None,
            TtlModel::Exact => Some(r.duration),
            TtlModel::Upper => Some(r.duration / (0.5 + 0.5 * x)),
            TtlModel::Loose => Some(r.duration / (0.1 + 0.9 * x)),
        };
    }
    Ok(out)
}

fn slices_per_gpu(profiles: &[GiProfile]) -> u32 {
    profiles
        .iter()
        .flat_map(|p| p.placements.iter().map(Placement::end))
        .max()
        .unwrap_or(8)
        .max(1)
}

/// Trace time in integer ticks (1e-9 of the mean duration), so events order exactly.
fn ticks(t: f64) -> u64 {
    // Times are finite and >= 0 by construction; saturating float-to-int is fine.
    #[allow(clippy::cast_precision_loss)]
    let per_unit = TICKS_PER_UNIT as f64;
    (t * per_unit) as u64
}

/// Replay `requests` of `spec` under `policy`.
pub fn run(spec: &TraceSpec, requests: &[Request], policy: &Policy) -> Result<Outcome, TraceError> {
    validate(spec)?;
    let profiles = mix_profiles(spec)?;
    let mut server = server_for(spec, &profiles, policy)?;
    let max_wait = match policy {
        Policy::Queued { max_wait, .. } | Policy::ReferenceQueued { max_wait } => Some(*max_wait),
        _ => None,
    };
    let granted_at = replay(server.as_mut(), requests, &profiles, max_wait)?;
    let mut out = tally(spec, requests, &profiles, &granted_at);
    out.moves = server.moves();
    Ok(out)
}

/// The node under `policy`.
fn server_for(
    spec: &TraceSpec,
    profiles: &[GiProfile],
    policy: &Policy,
) -> Result<Box<dyn Server>, TraceError> {
    Ok(match policy {
        Policy::Reference => Box::new(Repacker::new(profiles, spec.gpus)),
        Policy::ReferenceQueued { .. } => {
            let mut r = Repacker::new(profiles, spec.gpus);
            r.queue = Some(VecDeque::new());
            Box::new(r)
        }
        Policy::Planner(o) => Box::new(PlannerServer::new(spec, o.clone(), false)),
        Policy::PlannerWithMoves(o) => Box::new(PlannerServer::new(spec, o.clone(), true)),
        Policy::Housekeeping(o) => {
            let mut s = PlannerServer::new(spec, o.clone(), true);
            s.housekeeping = true;
            Box::new(s)
        }
        Policy::Static(o) => Box::new(PlannerServer::with_static_layout(spec, profiles, o)?),
        Policy::Reserving {
            opts,
            moves,
            reserve,
        } => {
            let mut s = PlannerServer::new(spec, opts.clone(), *moves);
            s.reservations = Some(Reservations::new(reserve_in_ticks(reserve)));
            Box::new(s)
        }
        Policy::Queued {
            opts,
            moves,
            reserve,
            holds,
            ..
        } => {
            let mut s = PlannerServer::new(spec, opts.clone(), *moves);
            s.reservations = holds
                .as_ref()
                .map(|h| Reservations::new(reserve_in_ticks(h)));
            s.queue = Some(Queue {
                waiting: VecDeque::new(),
                reserve: *reserve,
            });
            Box::new(s)
        }
    })
}

/// Replay the requests through `server`: when each was granted (tick), if it was.
fn replay(
    server: &mut dyn Server,
    requests: &[Request],
    profiles: &[GiProfile],
    max_wait: Option<f64>,
) -> Result<Vec<Option<u64>>, TraceError> {
    let mut granted_at: Vec<Option<u64>> = vec![None; requests.len()];
    // (tick, kind, request): kind 0 = its lease ends, 1 = its wait times out.
    let mut events: BinaryHeap<Reverse<(u64, u8, usize)>> = BinaryHeap::new();
    for (n, r) in requests.iter().enumerate() {
        let now = ticks(r.at);
        while let Some(Reverse((t, kind, id))) = events.peek().copied() {
            if t > now {
                break;
            }
            events.pop();
            if kind == 0 {
                server.release(id);
            }
            for (g, at) in server.drain(t)? {
                granted_at[g] = Some(at);
                let d = requests.get(g).map_or(0.0, |q| q.duration);
                events.push(Reverse((at + ticks(d), 0, g)));
            }
        }
        let p = &profiles[r.profile];
        let expires_at = r.ttl.map(|t| ticks(r.at + t));
        let accepted = !server.waits_for(p.id, now)
            && server.offer(n, p, now, ticks(r.at + r.idle_for), expires_at)?;
        if accepted {
            granted_at[n] = Some(now);
            events.push(Reverse((ticks(r.at + r.duration), 0, n)));
        } else if let Some(w) = max_wait {
            let deadline = ticks(r.at + w);
            if server.wait(n, p, deadline, ticks(r.idle_for), r.ttl.map(ticks)) {
                events.push(Reverse((deadline, 1, n)));
            }
        }
    }
    Ok(granted_at)
}

/// What was offered and accepted per profile, past the warm-up tenth.
fn tally(
    spec: &TraceSpec,
    requests: &[Request],
    profiles: &[GiProfile],
    granted_at: &[Option<u64>],
) -> Outcome {
    let mut out = Outcome {
        profiles: spec
            .mix
            .iter()
            .map(|(name, _)| ProfileTally {
                name: name.clone(),
                ..ProfileTally::default()
            })
            .collect(),
        moves: 0,
    };
    let warmup = requests.len() / 10;
    for (n, r) in requests.iter().enumerate().skip(warmup) {
        let p = &profiles[r.profile];
        let slice_time = f64::from(p.memory_slices) * r.duration;
        let t = &mut out.profiles[r.profile];
        t.offered += 1;
        t.offered_slice_time += slice_time;
        if let Some(at) = granted_at[n] {
            let now = ticks(r.at);
            t.accepted += 1;
            t.accepted_slice_time += slice_time;
            #[allow(clippy::cast_precision_loss)]
            t.waits.push(at.saturating_sub(now) as f64 / 1e9);
            if at > now {
                t.waited += 1;
            }
        }
    }
    out
}

trait Server {
    /// Try to grant lease `id` of `profile` at tick `now`; idle (movable) until
    /// `idle_until`; expiring at `expires_at` when its TTL is known.
    fn offer(
        &mut self,
        id: usize,
        profile: &GiProfile,
        now: u64,
        idle_until: u64,
        expires_at: Option<u64>,
    ) -> Result<bool, TraceError>;
    fn release(&mut self, id: usize);
    fn moves(&self) -> u64 {
        0
    }
    /// Queue refused request `id` until tick `deadline`; false when there is no queue.
    fn wait(
        &mut self,
        _id: usize,
        _profile: &GiProfile,
        _deadline: u64,
        _idle_for: u64,
        _ttl: Option<u64>,
    ) -> bool {
        false
    }
    /// Whether a request of GI profile `profile_id` still waits at tick `now` (a newer
    /// one queues behind it).
    fn waits_for(&self, _profile_id: u32, _now: u64) -> bool {
        false
    }
    /// Drop the waits that timed out by tick `now`, then grant the waiting requests that
    /// fit now, oldest first: (request, tick granted).
    fn drain(&mut self, _now: u64) -> Result<Vec<(usize, u64)>, TraceError> {
        Ok(Vec::new())
    }
}

// ---------------------------------------------------------------------------------------
// The planner, with or without moves, dynamic or static

struct Live {
    gpu: u32,
    placement: Placement,
    idle_until: u64,
    expires_at: Option<u64>,
}

struct PlannerServer {
    gpus: Vec<GpuView>,
    opts: PlanOptions,
    with_moves: bool,
    live: HashMap<usize, Live>,
    moves: u64,
    queue: Option<Queue>,
    housekeeping: bool,
    /// The daemon's reservations for refused large requests.
    reservations: Option<Reservations>,
}

/// Housekeeping moves at most this many idle instances per grant or end, as the
/// daemon's housekeeping does per pass.
pub const HOUSEKEEPING_MOVES: usize = COMPACT_MOVES_PER_PASS;

/// Only requests of at least this many memory slices (3g.40gb, 4g.40gb and 7g.80gb on an
/// H100) hold a region while they wait: a smaller request fits again as soon as almost
/// anything ends. Reserving for every waiting request was measured too (no better).
const RESERVE_MIN_SLICES: u32 = 4;

/// The admission queue of [`Policy::Queued`].
struct Queue {
    waiting: VecDeque<Waiting>,
    reserve: bool,
}

#[derive(Clone)]
struct Waiting {
    id: usize,
    profile: GiProfile,
    deadline: u64,
    idle_for: u64,
    ttl: Option<u64>,
    held: Option<Reservation>,
}

fn node(spec: &TraceSpec) -> Vec<GpuView> {
    (0..spec.gpus)
        .map(|i| GpuView {
            info: GpuInfo {
                index: i,
                uuid: format!("GPU-trace-{i}"),
                name: spec.model.marketing_name().to_string(),
                memory_bytes: spec.model.memory_bytes(),
                minor: i,
                pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + i),
                mig_current: true,
                mig_pending: true,
                sm_count: spec.model.sm_count(),
                fault: None,
            },
            profiles: spec.model.gi_profiles(),
            mig: Vec::new(),
            mps: Default::default(),
            whole_leased: false,
        })
        .collect()
}

fn view(gpus: &mut [GpuView], gpu: u32) -> Option<&mut GpuView> {
    gpus.iter_mut().find(|g| g.info.index == gpu)
}

fn shape_of(profile: &GiProfile) -> Shape {
    shape_of_name(&profile.name)
}

fn shape_of_name(name: &str) -> Shape {
    Shape::Mig {
        profile: name.to_string(),
        compute_profile: None,
    }
}

/// One more instance of the static layout: of the profile furthest below its share of
/// the laid-out slices (`target`) that the planner can still place. False when none
/// fits.
fn lay_out_one(
    gpus: &mut [GpuView],
    profiles: &[GiProfile],
    target: &[f64],
    laid: &mut [u32],
    layout_opts: &PlanOptions,
) -> Result<bool, TraceError> {
    let total: u32 = laid.iter().sum();
    let mut order: Vec<usize> = (0..profiles.len()).filter(|&i| target[i] > 0.0).collect();
    let lag = |i: usize| {
        let have = if total == 0 {
            0.0
        } else {
            f64::from(laid[i]) / f64::from(total)
        };
        target[i] - have
    };
    order.sort_by(|&a, &b| lag(b).total_cmp(&lag(a)));
    for i in order {
        match plan(&shape_of(&profiles[i]), gpus, layout_opts) {
            Ok(PlanDecision::NewMig {
                gpu,
                gi_profile_id,
                placement,
                ..
            }) => {
                // Held as leased while laying out (else the planner would offer it
                // as a static instance); freed by the caller.
                if let Some(v) = view(gpus, gpu) {
                    v.mig.push(OccupiedMig {
                        gi_profile_id,
                        placement,
                        free_static: None,
                    });
                }
                laid[i] += profiles[i].memory_slices;
                return Ok(true);
            }
            Ok(_) | Err(PlanError::NoCapacity(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(false)
}

impl PlannerServer {
    fn new(spec: &TraceSpec, opts: PlanOptions, with_moves: bool) -> PlannerServer {
        PlannerServer {
            gpus: node(spec),
            opts: PlanOptions {
                dynamic_mig: true,
                ..opts
            },
            with_moves,
            live: HashMap::new(),
            moves: 0,
            queue: None,
            housekeeping: false,
            reservations: None,
        }
    }

    /// A node whose every GPU is laid out once, for the mix: the profile whose share of
    /// the laid-out slices lags its share of the mix's slice-time most goes next, where
    /// the planner puts it, until no profile fits anywhere.
    fn with_static_layout(
        spec: &TraceSpec,
        profiles: &[GiProfile],
        opts: &PlanOptions,
    ) -> Result<PlannerServer, TraceError> {
        let mut gpus = node(spec);
        let total_w: f64 = spec
            .mix
            .iter()
            .zip(profiles)
            .map(|((_, w), p)| w * f64::from(p.memory_slices))
            .sum();
        let target: Vec<f64> = spec
            .mix
            .iter()
            .zip(profiles)
            .map(|((_, w), p)| w * f64::from(p.memory_slices) / total_w)
            .collect();
        let mut laid = vec![0u32; profiles.len()];
        let layout_opts = PlanOptions {
            dynamic_mig: true,
            gpu_index: None,
            ..opts.clone()
        };
        let mut next_id = 0usize;
        while lay_out_one(&mut gpus, profiles, &target, &mut laid, &layout_opts)? {
            next_id += 1;
        }
        for m in gpus.iter_mut().flat_map(|g| g.mig.iter_mut()) {
            m.free_static = Some(format!("static-{next_id}"));
            next_id += 1;
        }
        Ok(PlannerServer {
            gpus,
            opts: PlanOptions {
                dynamic_mig: false,
                ..opts.clone()
            },
            with_moves: false,
            live: HashMap::new(),
            moves: 0,
            queue: None,
            housekeeping: false,
            reservations: None,
        })
    }

    fn grant(&mut self, id: usize, d: &PlanDecision, idle_until: u64, expires_at: Option<u64>) {
        match d {
            PlanDecision::NewMig {
                gpu,
                gi_profile_id,
                placement,
                ..
            } => {
                if let Some(v) = view(&mut self.gpus, *gpu) {
                    v.mig.push(OccupiedMig {
                        gi_profile_id: *gi_profile_id,
                        placement: *placement,
                        free_static: None,
                    });
                }
                self.live.insert(
                    id,
                    Live {
                        gpu: *gpu,
                        placement: *placement,
                        idle_until,
                        expires_at,
                    },
                );
            }
            PlanDecision::Static { gpu, partition_id } => {
                if let Some(v) = view(&mut self.gpus, *gpu)
                    && let Some(m) = v
                        .mig
                        .iter_mut()
                        .find(|m| m.free_static.as_deref() == Some(partition_id.as_str()))
                {
                    m.free_static = None;
                    let placement = m.placement;
                    self.live.insert(
                        id,
                        Live {
                            gpu: *gpu,
                            placement,
                            idle_until,
                            expires_at,
                        },
                    );
                }
            }
            PlanDecision::Mps { .. } | PlanDecision::WholeGpu { .. } => {}
        }
    }
}

impl PlannerServer {
    /// The instances idle at tick `now`.
    fn movable(&self, now: u64) -> Vec<Movable> {
        self.live
            .values()
            .filter(|l| l.idle_until > now)
            .map(|l| Movable {
                gpu: l.gpu,
                placement: l.placement,
            })
            .collect()
    }

    /// The regions held for the first `upto` waiting requests. A request keeps the
    /// region it was given while no older request's region overlaps it.
    fn reservations(&mut self, now: u64, upto: usize) -> Vec<Reservation> {
        let movable = self.movable(now);
        let Some(q) = self.queue.as_mut() else {
            return Vec::new();
        };
        if !q.reserve {
            return Vec::new();
        }
        let mut held: Vec<Reservation> = Vec::new();
        for w in q.waiting.iter_mut().take(upto) {
            if w.profile.memory_slices < RESERVE_MIN_SLICES || w.deadline <= now {
                continue;
            }
            let keep = w.held.filter(|r| {
                !held
                    .iter()
                    .any(|h| h.gpu == r.gpu && h.placement.overlaps(&r.placement))
            });
            w.held = keep.or_else(|| reserve(&w.profile.name, &self.gpus, &movable, &held));
            held.extend(w.held);
        }
        held
    }

    /// Housekeeping (see [`Policy::Housekeeping`]) at tick `now`: the daemon's own
    /// [`compact`], up to [`HOUSEKEEPING_MOVES`] times.
    fn compact(&mut self, now: u64) {
        for _ in 0..HOUSEKEEPING_MOVES {
            let Some(m) = compact(&self.gpus, &self.opts, &self.movable(now)) else {
                return;
            };
            self.apply_move(&m);
        }
    }

    fn apply_move(&mut self, m: &Move) {
        if let Some(v) = view(&mut self.gpus, m.from_gpu) {
            v.mig.retain(|i| i.placement != m.from);
        }
        if let Some(v) = view(&mut self.gpus, m.to_gpu) {
            v.mig.push(OccupiedMig {
                gi_profile_id: m.gi_profile_id,
                placement: m.to,
                free_static: None,
            });
        }
        if let Some(l) = self
            .live
            .values_mut()
            .find(|l| l.gpu == m.from_gpu && l.placement == m.from)
        {
            l.gpu = m.to_gpu;
            l.placement = m.to;
        }
        self.moves += 1;
    }

    /// Where `profile` goes now, `held` regions left alone; the moves it needs are done.
    fn place(
        &mut self,
        profile: &GiProfile,
        now: u64,
        expires_at: Option<u64>,
        held: &[Reservation],
    ) -> Result<Option<PlanDecision>, TraceError> {
        let shape = shape_of(profile);
        // What the daemon tells the planner: the new lease's expiry and, per GPU, the
        // latest expiry of the leases on it.
        self.opts.expiry = expires_at.map(|new_lease| {
            let mut latest: Vec<(u32, u64)> = Vec::new();
            for l in self.live.values() {
                let Some(e) = l.expires_at else { continue };
                match latest.iter_mut().find(|(g, _)| *g == l.gpu) {
                    Some((_, t)) => *t = (*t).max(e),
                    None => latest.push((l.gpu, e)),
                }
            }
            Expiry {
                now,
                new_lease,
                latest,
            }
        });
        if let Some(r) = self.reservations.as_mut() {
            r.refresh(&self.gpus, now);
        }
        let held_view;
        let mut gpus = if held.is_empty() {
            &self.gpus
        } else {
            held_view = hold(&self.gpus, held);
            &held_view
        };
        let reserved_view;
        if let Some(r) = &self.reservations
            && r.holds_against(&profile.name, expires_at)
        {
            reserved_view = r.view(gpus, &profile.name, expires_at);
            gpus = &reserved_view;
        }
        let decision = if self.with_moves {
            let movable = self.movable(now);
            match plan_with_moves(&shape, gpus, &self.opts, &movable) {
                Ok(p) => {
                    for m in &p.moves {
                        self.apply_move(m);
                    }
                    Ok(p.decision)
                }
                Err(e) => Err(e),
            }
        } else {
            plan(&shape, gpus, &self.opts)
        };
        match decision {
            Ok(d) => {
                if let (Some(r), PlanDecision::NewMig { gpu, placement, .. }) =
                    (self.reservations.as_mut(), &d)
                {
                    r.granted(&profile.name, *gpu, *placement);
                }
                Ok(Some(d))
            }
            Err(PlanError::NoCapacity(_)) => {
                if let Some(r) = self.reservations.as_mut() {
                    let ends: Vec<_> = self
                        .live
                        .values()
                        .filter_map(|l| Some((l.gpu, l.placement, l.expires_at?)))
                        .collect();
                    r.refused(&profile.name, &self.gpus, &ends, now);
                }
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }
}

impl Server for PlannerServer {
    fn offer(
        &mut self,
        id: usize,
        profile: &GiProfile,
        now: u64,
        idle_until: u64,
        expires_at: Option<u64>,
    ) -> Result<bool, TraceError> {
        let held = self.reservations(now, usize::MAX);
        match self.place(profile, now, expires_at, &held)? {
            Some(d) => {
                self.grant(id, &d, idle_until, expires_at);
                if self.housekeeping {
                    self.compact(now);
                }
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn wait(
        &mut self,
        id: usize,
        profile: &GiProfile,
        deadline: u64,
        idle_for: u64,
        ttl: Option<u64>,
    ) -> bool {
        let Some(q) = self.queue.as_mut() else {
            return false;
        };
        q.waiting.push_back(Waiting {
            id,
            profile: profile.clone(),
            deadline,
            idle_for,
            ttl,
            held: None,
        });
        true
    }

    fn waits_for(&self, profile_id: u32, now: u64) -> bool {
        self.queue.as_ref().is_some_and(|q| {
            q.waiting
                .iter()
                .any(|w| w.profile.id == profile_id && w.deadline > now)
        })
    }

    fn drain(&mut self, now: u64) -> Result<Vec<(usize, u64)>, TraceError> {
        if self.housekeeping {
            self.compact(now);
        }
        let Some(q) = self.queue.as_mut() else {
            return Ok(Vec::new());
        };
        q.waiting.retain(|w| w.deadline > now);
        let mut granted = Vec::new();
        let mut i = 0;
        while let Some(w) = self.queue.as_ref().and_then(|q| q.waiting.get(i)).cloned() {
            // First come, first served within a profile.
            let behind = self.queue.as_ref().is_some_and(|q| {
                q.waiting
                    .iter()
                    .take(i)
                    .any(|e| e.profile.id == w.profile.id)
            });
            if behind {
                i += 1;
                continue;
            }
            let held = self.reservations(now, i);
            let expires_at = w.ttl.map(|t| now.saturating_add(t));
            match self.place(&w.profile, now, expires_at, &held)? {
                Some(d) => {
                    self.grant(w.id, &d, now.saturating_add(w.idle_for), expires_at);
                    if let Some(q) = self.queue.as_mut() {
                        q.waiting.remove(i);
                    }
                    granted.push((w.id, now));
                }
                None => i += 1,
            }
        }
        Ok(granted)
    }

    fn release(&mut self, id: usize) {
        let Some(l) = self.live.remove(&id) else {
            return;
        };
        if let Some(v) = view(&mut self.gpus, l.gpu)
            && let Some(i) = v.mig.iter().position(|m| m.placement == l.placement)
        {
            if self.opts.dynamic_mig {
                v.mig.remove(i);
            } else {
                v.mig[i].free_static = Some(format!("static-back-{id}"));
            }
        }
    }

    fn moves(&self) -> u64 {
        self.moves
    }
}

// ---------------------------------------------------------------------------------------
// The free-repacking reference

/// Exact feasibility of a multiset of instances on `gpus` identical GPUs, each instance
/// free to go anywhere.
///
/// The per-GPU layouts are enumerated once: every set of non-overlapping placements of
/// the mix's profiles within their `max_count`, kept as a count vector (how many of each
/// profile). A multiset fits on `k` GPUs when it is empty, or when some layout that
/// holds one of its largest instances, takes as much of the multiset as a layout can
/// (a maximal one: moving instances onto a GPU that can still hold them never hurts),
/// and leaves a rest that fits on `k - 1` GPUs. Answers are memoised.
pub struct Repacker {
    /// GI profile id of each index.
    ids: Vec<u32>,
    sizes: Vec<u32>,
    /// Profile indices, largest first.
    order: Vec<usize>,
    layouts: Vec<Vec<u8>>,
    feasible: HashSet<Vec<u8>>,
    memo: HashMap<(Vec<u8>, u32), bool>,
    gpus: u32,
    slices_per_gpu: u32,
    counts: Vec<u8>,
    live: HashMap<usize, usize>,
    /// Waiting requests (request, profile index, deadline tick), when queued.
    queue: Option<VecDeque<(usize, usize, u64)>>,
}

impl Repacker {
    pub fn new(profiles: &[GiProfile], gpus: u32) -> Repacker {
        // Every (profile, placement) pair, then every non-overlapping subset.
        let pairs: Vec<(usize, u32)> = profiles
            .iter()
            .enumerate()
            .flat_map(|(i, p)| {
                p.placements
                    .iter()
                    .map(move |pl| (i, ((1u32 << pl.size) - 1) << pl.start))
            })
            .collect();
        let mut feasible = HashSet::new();
        let mut counts = vec![0u8; profiles.len()];
        enumerate(&pairs, profiles, 0, 0, &mut counts, &mut feasible);
        let mut layouts: Vec<Vec<u8>> = feasible.iter().cloned().collect();
        let sizes: Vec<u32> = profiles.iter().map(|p| p.memory_slices).collect();
        let used =
            |c: &Vec<u8>| -> u32 { c.iter().zip(&sizes).map(|(n, s)| u32::from(*n) * s).sum() };
        // Fullest first: a fitting packing is found sooner.
        layouts.sort_by_key(|c| (Reverse(used(c)), c.clone()));
        let mut order: Vec<usize> = (0..profiles.len()).collect();
        order.sort_by_key(|&i| Reverse(sizes[i]));
        Repacker {
            ids: profiles.iter().map(|p| p.id).collect(),
            sizes,
            order,
            layouts,
            feasible,
            memo: HashMap::new(),
            gpus,
            slices_per_gpu: slices_per_gpu(profiles),
            counts: vec![0; profiles.len()],
            live: HashMap::new(),
            queue: None,
        }
    }

    /// Whether `counts` instances fit on `k` GPUs.
    pub fn fits(&mut self, counts: &[u8], k: u32) -> bool {
        let Some(&first) = self.order.iter().find(|&&i| counts[i] > 0) else {
            return true;
        };
        if k == 0 {
            return false;
        }
        let need: u32 = counts
            .iter()
            .zip(&self.sizes)
            .map(|(n, s)| u32::from(*n) * s)
            .sum();
        if need > k * self.slices_per_gpu {
            return false;
        }
        let key = (counts.to_vec(), k);
        if let Some(&r) = self.memo.get(&key) {
            return r;
        }
        let candidates: Vec<Vec<u8>> = self
            .layouts
            .iter()
            .filter(|c| c[first] > 0 && c.iter().zip(counts).all(|(a, b)| a <= b))
            .filter(|c| self.maximal(c, counts))
            .cloned()
            .collect();
        let mut ok = false;
        for c in candidates {
            let rest: Vec<u8> = counts.iter().zip(&c).map(|(a, b)| a - b).collect();
            if self.fits(&rest, k - 1) {
                ok = true;
                break;
            }
        }
        if self.memo.len() > 4_000_000 {
            self.memo.clear();
        }
        self.memo.insert(key, ok);
        ok
    }

    /// No instance of `counts` left over could join layout `c` on the same GPU.
    fn maximal(&self, c: &[u8], counts: &[u8]) -> bool {
        let mut more = c.to_vec();
        for j in 0..c.len() {
            if c[j] < counts[j] {
                more[j] += 1;
                let grows = self.feasible.contains(&more);
                more[j] -= 1;
                if grows {
                    return false;
                }
            }
        }
        true
    }
}

fn enumerate(
    pairs: &[(usize, u32)],
    profiles: &[GiProfile],
    from: usize,
    mask: u32,
    counts: &mut Vec<u8>,
    out: &mut HashSet<Vec<u8>>,
) {
    out.insert(counts.clone());
    for (k, &(i, bits)) in pairs.iter().enumerate().skip(from) {
        if mask & bits == 0 && u32::from(counts[i]) < profiles[i].max_count {
            counts[i] += 1;
            enumerate(pairs, profiles, k + 1, mask | bits, counts, out);
            counts[i] -= 1;
        }
    }
}

impl Server for Repacker {
    fn offer(
        &mut self,
        id: usize,
        profile: &GiProfile,
        _now: u64,
        _idle_until: u64,
        _expires_at: Option<u64>,
    ) -> Result<bool, TraceError> {
        // The mix's profiles are distinct (validated), so the id names one index.
        let Some(i) = self.ids.iter().position(|&p| p == profile.id) else {
            return Ok(false);
        };
        let mut next = self.counts.clone();
        next[i] = next[i].saturating_add(1);
        if self.fits(&next, self.gpus) {
            self.counts = next;
            self.live.insert(id, i);
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn release(&mut self, id: usize) {
        if let Some(i) = self.live.remove(&id) {
            self.counts[i] = self.counts[i].saturating_sub(1);
        }
    }

    fn wait(
        &mut self,
        id: usize,
        profile: &GiProfile,
        deadline: u64,
        _idle_for: u64,
        _ttl: Option<u64>,
    ) -> bool {
        let Some(i) = self.ids.iter().position(|&p| p == profile.id) else {
            return false;
        };
        let Some(q) = self.queue.as_mut() else {
            return false;
        };
        q.push_back((id, i, deadline));
        true
    }

    fn waits_for(&self, profile_id: u32, now: u64) -> bool {
        let Some(i) = self.ids.iter().position(|&p| p == profile_id) else {
            return false;
        };
        self.queue
            .as_ref()
            .is_some_and(|q| q.iter().any(|(_, p, d)| *p == i && *d > now))
    }

    fn drain(&mut self, now: u64) -> Result<Vec<(usize, u64)>, TraceError> {
        let Some(mut q) = self.queue.take() else {
            return Ok(Vec::new());
        };
        q.retain(|(_, _, deadline)| *deadline > now);
        let mut granted = Vec::new();
        let mut blocked: Vec<usize> = Vec::new();
        q.retain(|&(id, i, _)| {
            // First come, first served within a profile.
            if blocked.contains(&i) {
                return true;
            }
            let mut next = self.counts.clone();
            next[i] = next[i].saturating_add(1);
            if self.fits(&next, self.gpus) {
                self.counts = next;
                self.live.insert(id, i);
                granted.push((id, now));
                false
            } else {
                blocked.push(i);
                true
            }
        });
        self.queue = Some(q);
        Ok(granted)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use tesserad::partition::Strategy;

    fn spec(mix: &[(&str, f64)], load: f64, seed: u64) -> TraceSpec {
        TraceSpec {
            model: GpuModel::H100Hbm3_80Gb,
            gpus: 4,
            mix: mix.iter().map(|(n, w)| ((*n).to_string(), *w)).collect(),
            load,
            durations: Durations::Exponential,
            requests: 1500,
            seed,
            startup: 0.05,
            ttl: TtlModel::None,
        }
    }

    const SMALL: &[(&str, f64)] = &[
        ("1g.10gb", 45.0),
        ("1g.20gb", 15.0),
        ("2g.20gb", 20.0),
        ("3g.40gb", 10.0),
        ("4g.40gb", 5.0),
        ("7g.80gb", 5.0),
    ];

    fn index(name: &str) -> usize {
        SMALL.iter().position(|(n, _)| *n == name).unwrap()
    }

    #[test]
    fn a_trace_is_its_seed() {
        let a = generate(&spec(SMALL, 1.0, 7)).unwrap();
        assert_eq!(a, generate(&spec(SMALL, 1.0, 7)).unwrap());
        assert_ne!(a, generate(&spec(SMALL, 1.0, 8)).unwrap());
        assert_eq!(a.len(), 1500);
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(
            a.iter()
                .all(|r| r.duration > 0.0 && r.idle_for <= r.duration)
        );
        // Every profile of the mix is asked for.
        for (i, (name, _)) in SMALL.iter().enumerate() {
            assert!(a.iter().any(|r| r.profile == i), "{name}");
        }
    }

    #[test]
    fn bad_specs_are_refused() {
        let mut s = spec(SMALL, 1.0, 1);
        s.mix.push(("1G.10GB".into(), 1.0));
        assert!(matches!(generate(&s), Err(TraceError::Invalid(_))));
        let s = spec(&[("5g.50gb", 1.0)], 1.0, 1);
        assert!(matches!(
            generate(&s),
            Err(TraceError::UnknownProfile { .. })
        ));
        let mut s = spec(SMALL, 1.0, 1);
        s.durations = Durations::Pareto { alpha: 1.0 };
        assert!(matches!(generate(&s), Err(TraceError::Invalid(_))));
        assert!(generate(&spec(SMALL, 0.0, 1)).is_err());
    }

    #[test]
    fn the_reference_packs_exactly() {
        let profiles = mix_profiles(&spec(SMALL, 1.0, 1)).unwrap();
        let mut r = Repacker::new(&profiles, 2);
        let mut c = vec![0u8; SMALL.len()];
        // A 7g and seven 1g fill two GPUs.
        c[index("7g.80gb")] = 1;
        c[index("1g.10gb")] = 7;
        assert!(r.fits(&c, 2));
        c[index("1g.10gb")] = 8;
        assert!(
            !r.fits(&c, 2),
            "an eighth 1g.10gb: at most 7 per GPU besides a 7g"
        );
        // One 4g per GPU (max_count 1), though three would fit in 16 slices.
        let mut c = vec![0u8; SMALL.len()];
        c[index("4g.40gb")] = 2;
        assert!(r.fits(&c, 2));
        c[index("4g.40gb")] = 3;
        assert!(!r.fits(&c, 2));
        // A 3g and a 4g share a GPU (4g at 0, 3g at 4); three 2g (their max_count)
        // fill the other, and a fourth fits nowhere although two slices stay free.
        let mut c = vec![0u8; SMALL.len()];
        c[index("3g.40gb")] = 1;
        c[index("4g.40gb")] = 1;
        assert!(r.fits(&c, 1));
        c[index("2g.20gb")] = 3;
        assert!(r.fits(&c, 2));
        c[index("2g.20gb")] = 4;
        assert!(!r.fits(&c, 2));
    }

    #[test]
    fn placement_strands_capacity_that_repacking_or_moves_recover() {
        let s = spec(SMALL, 1.2, 3);
        let reqs = generate(&s).unwrap();
        let reference = run(&s, &reqs, &Policy::Reference).unwrap();
        let best = PlanOptions {
            strategy: Strategy::BestFit,
            ..PlanOptions::default()
        };
        let best_fit = run(&s, &reqs, &Policy::Planner(best.clone())).unwrap();
        let r_best = best_fit.accepted_slice_time() / reference.accepted_slice_time();
        assert!(r_best < 0.99, "best fit {r_best}");
        assert_eq!(best_fit.moves, 0);
        // 7g requests suffer most: they need a whole GPU.
        let seven = index("7g.80gb");
        assert!(best_fit.profiles[seven].accepted < reference.profiles[seven].accepted);
        // When every lease stays idle (movable), moves get most of it back.
        let all_idle = TraceSpec {
            startup: 1e9,
            ..s.clone()
        };
        let reqs_idle = generate(&all_idle).unwrap();
        let moved = run(&all_idle, &reqs_idle, &Policy::PlannerWithMoves(best)).unwrap();
        let reference_idle = run(&all_idle, &reqs_idle, &Policy::Reference).unwrap();
        let r_moved = moved.accepted_slice_time() / reference_idle.accepted_slice_time();
        assert!(moved.moves > 0);
        assert!(r_moved > r_best, "moves {r_moved} vs best fit {r_best}");
    }

    fn queued(max_wait: f64, reserve: bool) -> Policy {
        Policy::Queued {
            opts: PlanOptions::default(),
            moves: true,
            max_wait,
            reserve,
            holds: None,
        }
    }

    #[test]
    fn a_queue_without_wait_is_the_planner_with_moves() {
        let s = spec(SMALL, 1.2, 2);
        let reqs = generate(&s).unwrap();
        let moves = run(&s, &reqs, &Policy::PlannerWithMoves(PlanOptions::default())).unwrap();
        for reserve in [false, true] {
            assert_eq!(run(&s, &reqs, &queued(0.0, reserve)).unwrap(), moves);
        }
        let reference = run(&s, &reqs, &Policy::Reference).unwrap();
        let queued_reference = run(&s, &reqs, &Policy::ReferenceQueued { max_wait: 0.0 }).unwrap();
        assert_eq!(queued_reference, reference);
    }

    #[test]
    fn queued_requests_wait_at_most_max_wait_and_are_then_served() {
        let s = spec(SMALL, 1.2, 2);
        let reqs = generate(&s).unwrap();
        let moves = run(&s, &reqs, &Policy::PlannerWithMoves(PlanOptions::default())).unwrap();
        let reference = run(&s, &reqs, &Policy::Reference).unwrap();
        for policy in [
            queued(0.2, false),
            queued(0.2, true),
            Policy::ReferenceQueued { max_wait: 0.2 },
        ] {
            let o = run(&s, &reqs, &policy).unwrap();
            let waited: u64 = o.profiles.iter().map(|p| p.waited).sum();
            assert!(waited > 0, "{policy:?}: nobody waited");
            for p in &o.profiles {
                assert_eq!(p.waits.len() as u64, p.accepted, "{}", p.name);
                assert!(
                    p.waits.iter().all(|w| (0.0..=0.2).contains(w)),
                    "{}",
                    p.name
                );
                assert!(p.p99_wait() <= 0.2 && p.mean_wait() <= p.p99_wait() + 1e-12);
            }
            // Waiting serves more requests than refusing them at once.
            let accepted = |o: &Outcome| o.profiles.iter().map(|p| p.accepted).sum::<u64>();
            let without = if matches!(policy, Policy::ReferenceQueued { .. }) {
                &reference
            } else {
                &moves
            };
            assert!(accepted(&o) > accepted(without), "{policy:?}");
        }
    }

    #[test]
    fn ttl_models_tell_the_planner_more_or_less_of_the_same_requests() {
        let mut s = spec(SMALL, 1.0, 4);
        let none = generate(&s).unwrap();
        s.ttl = TtlModel::Exact;
        let exact = generate(&s).unwrap();
        s.ttl = TtlModel::Upper;
        let upper = generate(&s).unwrap();
        let strip = |v: &[Request]| -> Vec<Request> {
            v.iter().map(|r| Request { ttl: None, ..*r }).collect()
        };
        assert_eq!(strip(&exact), none);
        assert_eq!(strip(&upper), none);
        assert!(none.iter().all(|r| r.ttl.is_none()));
        assert!(exact.iter().all(|r| r.ttl == Some(r.duration)));
        // An upper bound: between the duration and twice it, and mostly above it.
        assert!(upper.iter().all(|r| {
            let t = r.ttl.unwrap();
            t >= r.duration && t <= 2.0 * r.duration + 1e-12
        }));
        assert!(
            upper
                .iter()
                .filter(|r| r.ttl.unwrap() > r.duration * 1.1)
                .count()
                > 1000
        );
        s.ttl = TtlModel::Loose;
        let loose = generate(&s).unwrap();
        assert_eq!(strip(&loose), none);
        assert!(loose.iter().all(|r| {
            let t = r.ttl.unwrap();
            t >= r.duration && t <= 10.0 * r.duration + 1e-9
        }));
        assert!(
            loose
                .iter()
                .filter(|r| r.ttl.unwrap() > r.duration * 2.5)
                .count()
                > 300
        );
    }

    #[test]
    fn knowing_when_leases_end_serves_more_7g() {
        // The daemon's default (best fit with temporal packing, moves of idle leases),
        // told each lease's TTL or not, on the same requests.
        let mut served = Vec::new();
        for ttl in [TtlModel::None, TtlModel::Upper] {
            let (mut sevens, mut slice_time) = (0, 0.0);
            for seed in 1..=3 {
                let s = TraceSpec {
                    ttl,
                    ..spec(SMALL, 1.2, seed)
                };
                let reqs = generate(&s).unwrap();
                let o = run(&s, &reqs, &Policy::PlannerWithMoves(PlanOptions::default())).unwrap();
                sevens += o.profiles[index("7g.80gb")].accepted;
                slice_time += o.accepted_slice_time();
            }
            served.push((sevens, slice_time));
        }
        let (without, with) = (served[0], served[1]);
        assert!(with.0 > without.0, "7g accepted: {with:?} vs {without:?}");
        assert!(with.1 > without.1, "slice-time: {with:?} vs {without:?}");
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!((percentile(&v, 0.99) - 99.0).abs() < 1e-12);
        assert!((percentile(&v, 0.5) - 50.0).abs() < 1e-12);
        assert!((percentile(&[3.0], 0.99) - 3.0).abs() < 1e-12);
        assert!(percentile(&[], 0.99).abs() < 1e-12);
    }

    #[test]
    fn a_static_layout_serves_only_its_own_instances() {
        let s = spec(&[("3g.40gb", 1.0), ("4g.40gb", 1.0)], 1.0, 1);
        let reqs = generate(&s).unwrap();
        let profiles = mix_profiles(&s).unwrap();
        let server =
            PlannerServer::with_static_layout(&s, &profiles, &PlanOptions::default()).unwrap();
        // Each GPU gets one 4g (max 1) and one 3g: the mix in equal slice shares.
        for g in &server.gpus {
            let mut ids: Vec<u32> = g.mig.iter().map(|m| m.gi_profile_id).collect();
            ids.sort_unstable();
            assert_eq!(ids, [2, 3], "gpu{}: {:?}", g.info.index, g.mig);
            assert!(g.mig.iter().all(|m| m.free_static.is_some()));
        }
        let o = run(&s, &reqs, &Policy::Static(PlanOptions::default())).unwrap();
        assert!(
            o.profiles
                .iter()
                .all(|p| p.accepted > 0 && p.accepted < p.offered)
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// The reference accepts every set of instances the planner could lay out (it
        /// is a true upper bound), on 1 to 3 GPUs.
        #[test]
        fn the_repacking_reference_fits_whatever_the_planner_placed(
            names in proptest::collection::vec(0usize..7, 1..40),
            best_fit in proptest::prelude::any::<bool>(),
            n_gpus in 1u32..=3,
        ) {
            const NAMES: [&str; 7] =
                ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"];
            let s = TraceSpec { gpus: n_gpus, ..spec(SMALL, 1.0, 1) };
            let mut gpus = node(&s);
            let profiles = s.model.gi_profiles();
            let mut counts = vec![0u8; profiles.len()];
            let mut repacker = Repacker::new(&profiles, n_gpus);
            let opts = PlanOptions {
                strategy: if best_fit { Strategy::BestFit } else { Strategy::FirstFit },
                ..PlanOptions::default()
            };
            for n in names {
                let shape = shape_of_name(NAMES[n]);
                let Ok(PlanDecision::NewMig { gpu, gi_profile_id, placement, .. }) =
                    plan(&shape, &gpus, &opts)
                else {
                    continue;
                };
                let g = view(&mut gpus, gpu).unwrap();
                g.mig.push(OccupiedMig { gi_profile_id, placement, free_static: None });
                let i = profiles.iter().position(|p| p.name == NAMES[n]).unwrap();
                counts[i] += 1;
                proptest::prop_assert!(repacker.fits(&counts, n_gpus), "{counts:?} on {n_gpus} GPUs");
            }
        }
    }
}
