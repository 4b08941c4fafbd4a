//! MIG placement quality on seeded request traces, against a free-repacking reference.
//!
//! Each trace (a profile mix, an offered load, a duration law and a seed; 8 H100s by
//! default) is replayed under the reference (accept whenever all live instances plus
//! the new one could be laid out again from scratch), first fit, best fit, a static
//! layout made for the mix, and best fit that moves idle leases when a request would
//! be refused ("moves": the planner's `plan_with_moves`, what the daemon does by
//! default). Every policy but the reference runs the daemon's own planner
//! (`tesserad::partition`). See `tessera_bench::trace` for the model.
//!
//! Also measured, not the daemon's default: "housekeeping" (moves, and the daemon's
//! `[partition] compact_idle` after each grant and end), and an admission queue
//! ("queue": a refused request waits up to `--queue-wait` mean durations; "queue-reserve":
//! a waiting 3g/4g/7g also holds the region it will get). A queued policy is measured
//! against "reference-queue", the reference with the same queue (its own row is against
//! the plain reference), and its waits per profile are printed.
//!
//! `--ttl` says what the planner is told of when leases end (none, exact, or an upper
//! bound: TTL = duration / u, u uniform in [0.5, 1]); the daemon's default placement
//! uses it (temporal packing, `[partition] expiry_weight`), and `moves-ttl-tie`,
//! `moves-ttl-wN`, `moves-ttl-gN` are the variants measured against it.
//!
//! Printed per trace: each policy's accepted slice-time over the reference's (the
//! ratio), the share of requests it accepted, and the share accepted per profile.
//! The summary gives each policy's lowest and mean ratio over all traces and its
//! least-served profile relative to the reference; `--results FILE` appends those as
//! `key value` lines for `tessera-bench report`.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Parser;
use tessera_bench::trace::{self, Durations, Outcome, Policy, TraceSpec, TtlModel};
use tesserad::gpu::profiles::GpuModel;
use tesserad::partition::{PlanOptions, RESERVE_DEFAULTS_MS, ReserveOptions, Strategy, Temporal};

/// The mean lease duration the daemon's default times are read against (ms).
const MEAN_LEASE_MS: f64 = 3_600_000.0;

/// The daemon's reservation grace and longest hold, in mean durations of an hour.
fn default_reserve() -> (f64, f64) {
    #[allow(clippy::cast_precision_loss)]
    let f = |ms: u64| ms as f64 / MEAN_LEASE_MS;
    (
        f(RESERVE_DEFAULTS_MS.grace),
        f(RESERVE_DEFAULTS_MS.max_hold),
    )
}

/// The reservation options of `--reserve-*`, times in [`trace::RESERVE_UNIT`]ths of
/// the mean duration.
fn reserve_options(args: &Args) -> ReserveOptions {
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let units = |md: f64| (md.max(0.0) * trace::RESERVE_UNIT as f64).round() as u64;
    ReserveOptions {
        min_slices: args.reserve_min_slices,
        grace: units(args.reserve_grace),
        max_hold: units(args.reserve_max_hold),
        aging: args.reserve_aging,
        max_per_profile: args.reserve_max,
    }
}

#[derive(Parser, Debug)]
#[command(about = "MIG placement strategies against a free-repacking reference")]
struct Args {
    /// Seeds of the traces (each mix x load x duration law runs once per seed).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    seeds: Vec<u64>,
    /// Offered loads: slices asked for at once over the node's slices.
    #[arg(long, value_delimiter = ',', default_value = "0.8,1.0,1.3")]
    loads: Vec<f64>,
    /// Profile mixes: balanced, small, large (or all).
    #[arg(long, value_delimiter = ',', default_value = "all")]
    mixes: Vec<String>,
    /// Duration laws: exp (exponential), pareto (shape 1.5, heavy-tailed).
    #[arg(long, value_delimiter = ',', default_value = "exp,pareto")]
    durations: Vec<String>,
    /// Requests per trace (the first tenth warms the node up).
    #[arg(long, default_value_t = 4000)]
    requests: usize,
    /// GPUs on the node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// GPU model: a100-40gb, a100-80gb, h100-80gb, h200-141gb.
    #[arg(long, default_value = "h100-80gb")]
    model: String,
    /// Mean idle period at the start of a lease (before a container binds), as a
    /// fraction of the mean lease duration: only idle leases may be moved. 0 (the
    /// measure): a container on every lease from its grant, so none ever moves.
    #[arg(long, default_value_t = 0.0)]
    startup: f64,
    /// Reservations for refused large requests: how long a held region that came
    /// free waits for its profile, in mean durations (the daemon's
    /// `partition.reserve_grace` over a mean lease of an hour by default).
    #[arg(long, default_value_t = default_reserve().0)]
    reserve_grace: f64,
    /// The longest a reservation lasts, in mean durations (`partition.reserve_max_hold`
    /// over an hour by default).
    #[arg(long, default_value_t = default_reserve().1)]
    reserve_max_hold: f64,
    /// Refusals per extra region a starved profile may hold (`partition.reserve_aging`).
    #[arg(long, default_value_t = RESERVE_DEFAULTS_MS.aging)]
    reserve_aging: u32,
    /// The most regions one profile may hold (`partition.reserve_max_per_profile`).
    #[arg(long, default_value_t = RESERVE_DEFAULTS_MS.max_per_profile)]
    reserve_max: u32,
    /// Profiles of at least this many memory slices get reservations
    /// (`partition.reserve_min_slices`).
    #[arg(long, default_value_t = RESERVE_DEFAULTS_MS.min_slices)]
    reserve_min_slices: u32,
    /// How long a refused request may wait in the admission queue, in mean durations
    /// (the "queue" policies; the default is `lease.max_queue_wait` over a mean lease
    /// of an hour).
    #[arg(long, default_value_t = 10.0 / 60.0)]
    queue_wait: f64,
    /// Policies to run besides the reference (all by default): first-fit, best-fit,
    /// static, moves, reserve, housekeeping, queue, queue-bench-reserve.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    policies: Vec<String>,
    /// What the planner is told of when leases end: none (no TTL), exact (TTL = the
    /// lease's duration), upper (TTL = duration / u, u uniform in [0.5, 1] per request:
    /// tenants release early), loose (u uniform in [0.1, 1]).
    #[arg(long, default_value = "upper")]
    ttl: String,
    /// Print only the summary, not every trace.
    #[arg(long)]
    quiet: bool,
    /// Append the summary figures to FILE as `key value` lines.
    #[arg(long)]
    results: Option<PathBuf>,
}

/// The profile mixes, by name: (profile, weight). The 1g and 2g profiles are asked for
/// most often in "small", the 3g to 7g ones in "large".
fn mix(model: GpuModel, name: &str) -> anyhow::Result<Vec<(String, f64)>> {
    // Profile names by size on this model: 1g, 1g with 2 memory slices, 2g, 3g, 4g, 7g.
    let profiles = model.gi_profiles();
    let by = |slices: u32, memory: u32| -> anyhow::Result<String> {
        profiles
            .iter()
            .find(|p| p.slices == slices && p.memory_slices == memory && !p.media_extensions)
            .map(|p| p.name.clone())
            .with_context(|| format!("{model} has no {slices}g profile of {memory} slices"))
    };
    let weights: [f64; 6] = match name {
        "balanced" => [20.0, 10.0, 20.0, 20.0, 15.0, 15.0],
        "small" => [45.0, 15.0, 20.0, 10.0, 5.0, 5.0],
        "large" => [10.0, 5.0, 10.0, 30.0, 20.0, 25.0],
        other => bail!("unknown mix {other:?}: balanced, small, large or all"),
    };
    let names = [
        by(1, 1)?,
        by(1, 2)?,
        by(2, 2)?,
        by(3, 4)?,
        by(4, 4)?,
        by(7, 8)?,
    ];
    Ok(names.into_iter().zip(weights).collect())
}

/// A temporal-packing variant named in `--policies`: `moves-ttl-tie` (expiry as a
/// tie-break), `moves-ttl-wN` (N loss units per full extension of a GPU's latest
/// expiry), `moves-ttl-gN` (N units per TTL between the new lease's expiry and the
/// GPU's latest), `moves-ttl-eN` (N units times how soon the GPU empties, up to two
/// TTLs ahead); `best-fit-ttl-...` the same without moves.
fn temporal_policy(name: &str) -> Option<Policy> {
    let (moves, rest) = if let Some(r) = name.strip_prefix("moves-ttl-") {
        (true, r)
    } else {
        (false, name.strip_prefix("best-fit-ttl-")?)
    };
    let temporal = if rest == "tie" {
        Temporal::TieBreak
    } else if let Some(w) = rest.strip_prefix('w') {
        Temporal::Weighted(w.parse().ok()?)
    } else if let Some(w) = rest.strip_prefix('g') {
        Temporal::Group(w.parse().ok()?)
    } else if let Some(w) = rest.strip_prefix('e') {
        Temporal::Empties(w.parse().ok()?)
    } else {
        return None;
    };
    let opts = PlanOptions {
        temporal,
        ..PlanOptions::default()
    };
    Some(if moves {
        Policy::PlannerWithMoves(opts)
    } else {
        Policy::Planner(opts)
    })
}

fn policies(args: &Args) -> anyhow::Result<Vec<(String, Policy)>> {
    let with = |strategy| PlanOptions {
        strategy,
        ..PlanOptions::default()
    };
    let holds = reserve_options(args);
    let queued = |reserve, holds| Policy::Queued {
        opts: with(Strategy::BestFit),
        moves: true,
        max_wait: args.queue_wait,
        reserve,
        holds,
    };
    let all = vec![
        ("reference", Policy::Reference),
        ("first-fit", Policy::Planner(with(Strategy::FirstFit))),
        ("best-fit", Policy::Planner(with(Strategy::BestFit))),
        ("static", Policy::Static(with(Strategy::BestFit))),
        ("moves", Policy::PlannerWithMoves(with(Strategy::BestFit))),
        (
            "reserve",
            Policy::Reserving {
                opts: with(Strategy::BestFit),
                moves: true,
                reserve: holds,
            },
        ),
        (
            "housekeeping",
            Policy::Housekeeping(with(Strategy::BestFit)),
        ),
        (
            "reference-queue",
            Policy::ReferenceQueued {
                max_wait: args.queue_wait,
            },
        ),
        ("queue", queued(false, Some(holds))),
        ("queue-bench-reserve", queued(true, None)),
    ];
    let every = args.policies.iter().any(|p| p == "all");
    let mut out: Vec<(String, Policy)> = all
        .into_iter()
        .filter(|(n, _)| {
            n.starts_with("reference") || every || args.policies.iter().any(|p| p == n)
        })
        .map(|(n, p)| (n.to_string(), p))
        .collect();
    for name in &args.policies {
        if name.contains("-ttl-") {
            let p = temporal_policy(name).with_context(|| {
                format!(
                    "unknown policy {name:?}: moves-ttl-tie, moves-ttl-wN, moves-ttl-gN, \
                     moves-ttl-eN"
                )
            })?;
            out.push((name.clone(), p));
        }
    }
    Ok(out)
}

/// Per policy: the ratios of every trace and the lowest per-profile acceptance
/// relative to the reference's.
#[derive(Default)]
struct Summary {
    ratios: Vec<f64>,
    /// Accepted slice-time over canonical first fit's, per trace.
    ff_ratios: Vec<f64>,
    /// Per profile of the mixes (by name): requests accepted and offered, all traces.
    per_profile: std::collections::BTreeMap<String, (u64, u64)>,
    /// Per offered load and profile: the wait of every accepted request.
    waits: std::collections::BTreeMap<(String, String), Vec<f64>>,
    least_profile: Option<(f64, String)>,
    moves: u64,
}

impl Summary {
    /// One policy's outcome `o` on one trace (`label`), against `reference`.
    fn record(
        &mut self,
        o: &Outcome,
        [reference, first_fit]: [&Outcome; 2],
        label: &str,
        load: f64,
    ) -> f64 {
        let ratio = o.accepted_slice_time() / reference.accepted_slice_time();
        self.ratios.push(ratio);
        self.ff_ratios
            .push(o.accepted_slice_time() / first_fit.accepted_slice_time());
        self.moves += o.moves;
        for p in &o.profiles {
            let e = self.per_profile.entry(p.name.clone()).or_default();
            e.0 += p.accepted;
            e.1 += p.offered;
            self.waits
                .entry((format!("{load}"), p.name.clone()))
                .or_default()
                .extend_from_slice(&p.waits);
        }
        for (p, r) in o.profiles.iter().zip(&reference.profiles) {
            if r.accepted == 0 {
                continue;
            }
            // Accepted share relative to the reference's for this profile.
            #[allow(clippy::cast_precision_loss)]
            let rel = p.accepted as f64 / r.accepted as f64;
            if self.least_profile.as_ref().is_none_or(|(v, _)| rel < *v) {
                self.least_profile = Some((rel, format!("{} ({label})", p.name)));
            }
        }
        ratio
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let model = GpuModel::from_name(&args.model)
        .with_context(|| format!("unknown GPU model {:?}", args.model))?;
    let mixes: Vec<String> = if args.mixes.iter().any(|m| m == "all") {
        vec!["balanced".into(), "small".into(), "large".into()]
    } else {
        args.mixes.clone()
    };
    let laws = duration_laws(&args.durations)?;
    let policies = policies(&args)?;
    let ttl = ttl_model(&args.ttl)?;
    let mut summary: Vec<Summary> = policies.iter().map(|_| Summary::default()).collect();
    println!(
        "placement-bench: {} {model}, {} requests per trace, idle start-up {} of the mean \
         duration, TTL {}; ratio = accepted slice-time / the free-repacking reference's",
        args.gpus, args.requests, args.startup, args.ttl
    );
    for mix_name in &mixes {
        let mix = mix(model, mix_name)?;
        for &load in &args.loads {
            for (law_name, law) in &laws {
                for &seed in &args.seeds {
                    let spec = TraceSpec {
                        model,
                        gpus: args.gpus,
                        mix: mix.clone(),
                        load,
                        durations: *law,
                        requests: args.requests,
                        seed,
                        startup: args.startup,
                        ttl,
                    };
                    let label = format!("{mix_name}, load {load}, {law_name}, seed {seed}");
                    let header =
                        format!("mix {mix_name}, load {load}, {law_name} durations, seed {seed}");
                    run_trace(&args, &policies, &spec, [&header, &label], &mut summary)?;
                }
            }
        }
    }
    let mut results = match &args.results {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("{}", p.display()))?,
        ),
        None => None,
    };
    print_shares(&args, &policies, &summary, &mut results)?;
    print_summary(&policies, &summary, &mut results)
}

fn duration_laws(names: &[String]) -> anyhow::Result<Vec<(String, Durations)>> {
    names
        .iter()
        .map(|d| match d.as_str() {
            "exp" => Ok((d.clone(), Durations::Exponential)),
            "pareto" => Ok((d.clone(), Durations::Pareto { alpha: 1.5 })),
            other => bail!("unknown duration law {other:?}: exp or pareto"),
        })
        .collect()
}

fn ttl_model(name: &str) -> anyhow::Result<TtlModel> {
    Ok(match name {
        "none" => TtlModel::None,
        "exact" => TtlModel::Exact,
        "upper" => TtlModel::Upper,
        "loose" => TtlModel::Loose,
        other => bail!("unknown TTL model {other:?}: none, exact, upper or loose"),
    })
}

/// Every policy on one trace: its rows under `header` (unless `--quiet`) and its part
/// of the summary (`label` names the trace there).
fn run_trace(
    args: &Args,
    policies: &[(String, Policy)],
    spec: &TraceSpec,
    [header, label]: [&str; 2],
    summary: &mut [Summary],
) -> anyhow::Result<()> {
    let requests = trace::generate(spec)?;
    let outcomes: Vec<Outcome> = policies
        .iter()
        .map(|(_, p)| trace::run(spec, &requests, p))
        .collect::<Result<_, _>>()?;
    let reference = &outcomes[0];
    if !args.quiet {
        println!();
        println!("{header}");
        print!("  {:<14} {:>6} {:>9}", "policy", "ratio", "accepted");
        for p in &reference.profiles {
            print!(" {:>10}", p.name);
        }
        println!(" {:>6}", "moves");
    }
    // A queued policy is measured against the reference with the same queue; every
    // other policy (that reference too) against the plain one.
    let queued_reference = policies
        .iter()
        .position(|(_, p)| matches!(p, Policy::ReferenceQueued { .. }));
    let first_fit = policies
        .iter()
        .position(|(n, _)| n == "first-fit")
        .map_or(reference, |i| &outcomes[i]);
    for (i, o) in outcomes.iter().enumerate() {
        let reference = match (&policies[i].1, queued_reference) {
            (Policy::Queued { .. }, Some(q)) => &outcomes[q],
            _ => reference,
        };
        let ratio = summary[i].record(o, [reference, first_fit], label, spec.load);
        if !args.quiet {
            print!(
                "  {:<14} {:>6.3} {:>9.3}",
                policies[i].0,
                ratio,
                share(
                    o.profiles.iter().map(|p| p.accepted).sum(),
                    o.profiles.iter().map(|p| p.offered).sum()
                )
            );
            for p in &o.profiles {
                print!(" {:>10.3}", share(p.accepted, p.offered));
            }
            println!(" {:>6}", o.moves);
        }
    }
    Ok(())
}

/// The share of requests each policy accepted per profile, and the queued policies'
/// waits.
fn print_shares(
    args: &Args,
    policies: &[(String, Policy)],
    summary: &[Summary],
    results: &mut Option<std::fs::File>,
) -> anyhow::Result<()> {
    println!();
    println!("share of requests accepted per profile, all traces:");
    print!("  {:<14}", "policy");
    let names: Vec<String> = summary
        .first()
        .map(|s| s.per_profile.keys().cloned().collect())
        .unwrap_or_default();
    for n in &names {
        print!(" {n:>10}");
    }
    println!();
    for ((name, _), s) in policies.iter().zip(summary) {
        print!("  {name:<14}");
        for (a, o) in s.per_profile.values() {
            print!(" {:>10.3}", share(*a, *o));
        }
        println!();
    }
    if !policies
        .iter()
        .any(|(_, p)| matches!(p, Policy::Queued { .. }))
    {
        return Ok(());
    }
    println!();
    println!(
        "wait of the accepted requests per profile, mean / p99, in mean durations \
         (queue wait at most {}):",
        args.queue_wait
    );
    print!("  {:<20}", "policy, load");
    for n in &names {
        print!(" {n:>15}");
    }
    println!();
    for ((name, p), s) in policies.iter().zip(summary) {
        if !matches!(p, Policy::Queued { .. }) {
            continue;
        }
        let mut loads: Vec<&String> = s.waits.keys().map(|(l, _)| l).collect();
        loads.dedup();
        for load in loads {
            print!("  {:<20}", format!("{name}, {load}"));
            let mut worst = 0.0f64;
            for ((_, _), w) in s.waits.iter().filter(|((l, _), _)| l == load) {
                #[allow(clippy::cast_precision_loss)]
                let mean = w.iter().sum::<f64>() / w.len().max(1) as f64;
                let p99 = trace::percentile(w, 0.99);
                worst = worst.max(p99);
                print!(" {:>15}", format!("{mean:.4}/{p99:.4}"));
            }
            println!();
            if let Some(f) = results.as_mut() {
                writeln!(f, "placement.{name}.p99_wait.load{load} {worst}")
                    .context("writing --results")?;
            }
        }
    }
    Ok(())
}

/// The summary table, and its figures appended to `--results`.
fn print_summary(
    policies: &[(String, Policy)],
    summary: &[Summary],
    results: &mut Option<std::fs::File>,
) -> anyhow::Result<()> {
    println!();
    println!(
        "summary over {} traces (ratio to the reference; least-served profile: its accepted \
         requests over the reference's):",
        summary.first().map_or(0, |s| s.ratios.len())
    );
    println!(
        "  {:<20} {:>9} {:>9} {:>9} {:>9} {:>8}  least-served profile",
        "policy", "min ratio", "mean", "min vs ff", "mean v ff", "moves"
    );
    // The daemon's default: its default strategy, moving idle leases when a request
    // would be refused (`[partition] move_idle = true`) and holding regions for
    // refused large requests (`[partition] reserve_*`).
    let default = match PlanOptions::default().strategy {
        Strategy::BestFit => "reserve",
        Strategy::FirstFit => "first-fit",
    };
    for ((name, _), s) in policies.iter().zip(summary) {
        let min = s.ratios.iter().copied().fold(f64::INFINITY, f64::min);
        #[allow(clippy::cast_precision_loss)]
        let mean = s.ratios.iter().sum::<f64>() / s.ratios.len().max(1) as f64;
        let ff_min = s.ff_ratios.iter().copied().fold(f64::INFINITY, f64::min);
        #[allow(clippy::cast_precision_loss)]
        let ff_mean = s.ff_ratios.iter().sum::<f64>() / s.ff_ratios.len().max(1) as f64;
        let (least, which) = s.least_profile.clone().unwrap_or((1.0, "-".to_string()));
        println!(
            "  {name:<20} {min:>9.3} {mean:>9.3} {ff_min:>9.3} {ff_mean:>9.3} {:>8}  {least:.3} {which}",
            s.moves
        );
        if let Some(f) = results.as_mut() {
            writeln!(f, "placement.{name}.min_ratio {min}")
                .and_then(|()| writeln!(f, "placement.{name}.mean_ratio {mean}"))
                .and_then(|()| writeln!(f, "placement.{name}.ff_mean_ratio {ff_mean}"))
                .and_then(|()| writeln!(f, "placement.{name}.least_profile {least}"))
                .context("writing --results")?;
            if *name == default {
                writeln!(f, "placement.default.min_ratio {min}")
                    .and_then(|()| writeln!(f, "placement.default.mean_ratio {mean}"))
                    .and_then(|()| writeln!(f, "placement.default.ff_mean_ratio {ff_mean}"))
                    .and_then(|()| writeln!(f, "placement.default.least_profile {least}"))
                    .context("writing --results")?;
            }
        }
    }
    Ok(())
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        return 1.0;
    }
    #[allow(clippy::cast_precision_loss)]
    let r = part as f64 / whole as f64;
    r
}
