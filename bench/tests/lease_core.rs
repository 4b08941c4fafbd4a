//! `placement-bench`'s figures are the planner's, run by the trace model's own picture
//! of a node. These tests check that model against the daemon's real lease core.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::path::Path;
use std::sync::Arc;

use tessera_bench::trace::{self, Durations, Policy, TraceSpec, TtlModel};
use tesserad::config::{Config, PartitionConfig};
use tesserad::gpu::profiles::GpuModel;
use tesserad::lease::{CreateRequest, Created, EventKind, LeaseError, LeaseEvent, LeaseManager};
use tesserad::model::LeaseState;
use tesserad::partition::Shape;
use tesserad::store::Store;

/// A lease core on eight simulated H100s with MIG, as `placement-bench` models them:
/// best fit, moves of idle leases at refusal, no temporal term, no reservations (those
/// are `partition::reservation`, the same code in the model and the lease core, tested
/// there).
fn eight_h100_for_a_trace(dir: &Path) -> Arc<LeaseManager> {
    let text = format!(
        "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
         [partition]\nmove_idle = true\ncompact_idle = false\nexpiry_weight = 0\n\
         reserve_min_slices = 0\n\
         [sim]\nstate_file = {s:?}\n{gpus}",
        d = dir.display().to_string(),
        s = dir.join("sim.json").display().to_string(),
        gpus = "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n".repeat(8),
    );
    let config = Config::parse(Path::new("test.toml"), &text).unwrap();
    let sim = Arc::new(tesserad::gpu::open_sim(&config.sim).unwrap());
    let store = Arc::new(Store::open(dir).unwrap());
    LeaseManager::start(config, sim, store).unwrap()
}

fn mig_request(request_id: &str, profile: &str) -> CreateRequest {
    CreateRequest {
        tenant: "team-a".into(),
        shape: Some(Shape::Mig {
            profile: profile.into(),
            compute_profile: None,
        }),
        ttl: None,
        request_id: Some(request_id.into()),
        labels: BTreeMap::new(),
        priority_class: None,
        gpu_index: None,
        need: None,
        count: 0,
        topology: Default::default(),
        exact: None,
    }
}

/// `placement-bench`'s figures are the planner's, run by the bench's own model of a
/// node. This replays traces through the real lease core (CreateLease; the container
/// binding, as a token resolve once the lease's idle start-up is over; ReleaseLease;
/// moves of idle leases done on the simulated hardware) and checks that it accepts
/// the same requests as the model and moves as many leases: what the bench measures
/// is what the daemon does. One trace with few idle leases, one where leases stay idle
/// about as long as they run (dozens of moves).
#[tokio::test]
async fn a_trace_replayed_through_the_lease_core_accepts_what_the_model_accepts() {
    for (seed, startup) in [(2, 0.05), (1, 1.0)] {
        let dir = tempfile::tempdir().unwrap();
        let mgr = eight_h100_for_a_trace(dir.path());
        let partition = mgr.config().partition.clone();
        replay_against_the_model(&mgr, &partition, seed, startup).await;
    }
}

async fn replay_against_the_model(
    mgr: &LeaseManager,
    partition: &PartitionConfig,
    seed: u64,
    startup: f64,
) {
    let names = [
        "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
    ];
    let spec = TraceSpec {
        model: GpuModel::H100Hbm3_80Gb,
        gpus: 8,
        mix: names
            .iter()
            .zip([20.0, 10.0, 20.0, 20.0, 15.0, 15.0])
            .map(|(n, w)| ((*n).to_string(), w))
            .collect(),
        load: 1.2,
        durations: Durations::Exponential,
        requests: 600,
        seed,
        startup,
        ttl: TtlModel::None,
    };
    let requests = trace::generate(&spec).unwrap();
    let model = trace::run(
        &spec,
        &requests,
        &Policy::PlannerWithMoves(partition.plan_options(None)),
    )
    .unwrap();

    let mut events = mgr.subscribe();
    let mut moves = 0u64;
    let mut count_moves = |rx: &mut tokio::sync::broadcast::Receiver<Arc<LeaseEvent>>| {
        while let Ok(e) = rx.try_recv() {
            moves += u64::from(e.kind == EventKind::Moved);
        }
    };
    // (end time, request) of the granted leases; (bind time, request) of the idle ones.
    let mut ends: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut binds: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut granted: Vec<Option<Created>> = vec![None; requests.len()];
    let ns = |t: f64| (t * 1e9) as u64;
    for (n, r) in requests.iter().enumerate() {
        let now = ns(r.at);
        while let Some(&Reverse((t, g))) = ends.peek() {
            if t > now {
                break;
            }
            ends.pop();
            let id = granted[g].as_ref().unwrap().lease.id.clone();
            mgr.end(&id, LeaseState::Released, "trace").await.unwrap();
        }
        while let Some(&Reverse((t, g))) = binds.peek() {
            if t > now {
                break;
            }
            binds.pop();
            // A runtime asks for the lease's devices: it never moves again.
            if ns(requests[g].at + requests[g].duration) > now {
                let token = granted[g].as_ref().unwrap().token.as_ref().unwrap();
                mgr.resolve_token(token).unwrap();
            }
        }
        count_moves(&mut events);
        match mgr
            .create(mig_request(&format!("t{n}"), names[r.profile]))
            .await
        {
            Ok(c) => {
                ends.push(Reverse((ns(r.at + r.duration), n)));
                binds.push(Reverse((ns(r.at + r.idle_for), n)));
                granted[n] = Some(c);
            }
            Err(LeaseError::ResourceExhausted(_)) => {}
            Err(e) => panic!("request {n} ({}): {e}", names[r.profile]),
        }
        count_moves(&mut events);
    }
    let warmup = requests.len() / 10;
    let mut accepted = vec![0u64; names.len()];
    for (n, r) in requests.iter().enumerate().skip(warmup) {
        if granted[n].is_some() {
            accepted[r.profile] += 1;
        }
    }
    let modelled: Vec<u64> = model.profiles.iter().map(|p| p.accepted).collect();
    let what = format!("seed {seed}, start-up {startup}");
    assert_eq!(
        accepted, modelled,
        "{what}: accepted per profile {names:?}, the lease core vs the model"
    );
    assert_eq!(
        moves, model.moves,
        "{what}: moves, the lease core vs the model"
    );
    assert!(moves > 0, "{what}: the trace needs moves");
    assert!(
        modelled[5] < model.profiles[5].offered,
        "{what}: the trace refuses some 7g requests"
    );
}
