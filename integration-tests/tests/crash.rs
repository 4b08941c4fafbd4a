//! Crash harness: concurrent CreateLease/ReleaseLease load on the simulator while
//! `tesserad` is killed with SIGKILL at random moments, restarted, and checked.
//!
//! After every restart the harness checks, through the API and by reading the
//! simulator's state file directly:
//! * every acknowledged lease that was not released is active and its token resolves;
//! * every acknowledged release ended its lease, and its token no longer resolves;
//! * a retry with a request id returns the lease it named, never a second one;
//! * no partition is leased twice, every live lease has its partitions (several for a
//!   multi-partition lease: N MIG instances or N whole GPUs) and vice versa;
//! * every MIG instance on the sim is explained by exactly one partition (gi id and
//!   MIG UUID) and every MIG partition by exactly one instance; no GI without a CI;
//! * MPS daemons on the sim are exactly the MPS partitions: one of its own for each
//!   isolated share, one server named by their pipe directory for shared shares (on a
//!   whole GPU or inside a MIG instance, whose host instance no lease holds);
//! * SM and memory accounting per GPU stays within the GPU.
//!
//! Partitions being made or torn down (`Partition.state`), like pending and revoking
//! leases, are work in progress: the check looks again before it reports.
//!
//! The load asks for every kind of lease: MIG profiles, isolated and shared MPS, MPS
//! inside MIG, whole GPUs, and several MIG instances or whole GPUs in one lease. The
//! seed is printed; `TESSERA_CRASH_SEED=<n>` replays the requests (not the timing of the
//! kills against them), `TESSERA_CRASH_CYCLES` changes the number of kill cycles
//! (default 60).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_integration_tests::invariants::{self, check_structure};
use tessera_integration_tests::{TestDaemon, create_req, shape};
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;
use tesserad::gpu::sim::CreateStage;
use tonic::Code;
use tonic::transport::Channel;

type Client = TesseraClient<Channel>;

/// Two H100s with MIG, an A100-40GB without MIG (MPS shares), an A100-80GB without
/// MIG (whole GPUs or MPS).
const GPUS: &str = r#"
[[sim.gpus]]
model = "h100-80gb"
mig = true

[[sim.gpus]]
model = "h100-80gb"
mig = true

[[sim.gpus]]
model = "a100-40gb"
mig = false

[[sim.gpus]]
model = "a100-80gb"
mig = false
"#;

const TASKS: usize = 4;
const TENANTS: [&str; 3] = ["team-a", "team-b", "team-c"];

use tessera_integration_tests::{lease_of, rt};

/// The simulator as the daemon sees it, opened from this process.
fn sim_of(d: &TestDaemon) -> invariants::Hardware {
    invariants::sim_of(d, GPUS)
}

fn random_shape(rng: &mut StdRng) -> pb::Shape {
    match rng.gen_range(0..17) {
        // MPS inside a MIG instance (one shared server per instance), and a
        // shared MPS server on a whole GPU.
        15 => pb::Shape {
            kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent: [25, 50][rng.gen_range(0..2)],
                memory_bytes: 4 << 30,
                mode: pb::MpsMode::Shared as i32,
                mig_profile: "3g.40gb".into(),
            })),
        },
        16 => pb::Shape {
            kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent: 20,
                memory_bytes: 4 << 30,
                mode: pb::MpsMode::Shared as i32,
                mig_profile: String::new(),
            })),
        },
        // Several partitions in one lease: created all or none, ended together.
        12 => shape::migs("1g.10gb", 3),
        13 => shape::migs("2g.20gb", 2),
        14 => shape::wholes(2),
        0..=2 => shape::mig("1g.10gb"),
        3 => shape::mig("1g.20gb"),
        4 => shape::mig("2g.20gb"),
        5 => shape::mig("3g.40gb"),
        6 => shape::mig("4g.40gb"),
        7 => shape::mig("7g.80gb"),
        8..=9 => shape::mps(
            [10, 20, 25][rng.gen_range(0..3)],
            [2, 4, 8][rng.gen_range(0..3)],
        ),
        _ => shape::whole(),
    }
}

/// A shape of several partitions (N MIG instances or N whole GPUs).
fn is_several(s: &pb::Shape) -> bool {
    match &s.kind {
        Some(pb::shape::Kind::Mig(m)) => m.count > 1,
        Some(pb::shape::Kind::WholeGpu(w)) => w.count > 1,
        _ => false,
    }
}

/// A share of a shared MPS server (on a whole GPU or inside a MIG instance).
fn is_shared_mps(s: &pb::Shape) -> bool {
    matches!(&s.kind, Some(pb::shape::Kind::Mps(m)) if m.mode == pb::MpsMode::Shared as i32)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rel {
    /// No release sent.
    No,
    /// A release was sent; its answer never came.
    InDoubt,
    /// The daemon acknowledged the release.
    Acked,
}

#[derive(Debug, Clone)]
struct Tracked {
    owner: usize,
    tenant: String,
    request_id: String,
    shape: pb::Shape,
    token: String,
    rel: Rel,
    /// Ended and verified as ended once; afterwards only sampled.
    retired: bool,
}

#[derive(Debug, Clone)]
struct InDoubtCreate {
    owner: usize,
    tenant: String,
    request_id: String,
    shape: pb::Shape,
}

#[derive(Debug, Default)]
struct Model {
    /// Acknowledged creates by lease id.
    leases: BTreeMap<String, Tracked>,
    /// Creates sent whose answer never came (keyed by request id).
    in_doubt: HashMap<String, InDoubtCreate>,
    /// (tenant, request id) of creates the daemon refused: no live lease may carry them.
    refused: HashSet<(String, String)>,
    violations: Vec<String>,
    ops: u64,
}

impl Model {
    fn violation(&mut self, v: String) {
        eprintln!("VIOLATION: {v}");
        self.violations.push(v);
    }
}

/// Codes after which the daemon certainly did not create (or release) anything.
fn definitive(code: Code) -> bool {
    matches!(
        code,
        Code::InvalidArgument
            | Code::ResourceExhausted
            | Code::FailedPrecondition
            | Code::NotFound
            | Code::PermissionDenied
    )
}

fn rid_of(owner: usize, cycle: usize, n: u64) -> String {
    format!("t{owner}-c{cycle}-{n}")
}

/// One client task: creates, releases and idempotent retries until `stop`, or until
/// the daemon stops answering.
async fn load(
    owner: usize,
    cycle: usize,
    seed: u64,
    mut c: Client,
    model: Arc<Mutex<Model>>,
    stop: Arc<AtomicBool>,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let tenant = TENANTS[owner % TENANTS.len()].to_string();
    let mut n = 0u64;
    let mut full = false;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let mine: Vec<(String, Tracked)> = {
            let m = model.lock().unwrap();
            m.leases
                .iter()
                .filter(|(_, t)| t.owner == owner && t.rel == Rel::No)
                .map(|(id, t)| (id.clone(), t.clone()))
                .collect()
        };
        let roll: f64 = rng.r#gen();
        if !mine.is_empty() && (full || roll < 0.4) {
            // Release one of this task's leases.
            let (id, _) = mine[rng.gen_range(0..mine.len())].clone();
            model.lock().unwrap().leases.get_mut(&id).unwrap().rel = Rel::InDoubt;
            let r = c
                .release_lease(pb::ReleaseLeaseRequest {
                    lease_id: id.clone(),
                    reason: "crash harness".into(),
                })
                .await;
            let mut m = model.lock().unwrap();
            m.ops += 1;
            match r {
                Ok(resp) => {
                    let l = resp.into_inner().lease.unwrap();
                    let ok = [pb::LeaseState::Released, pb::LeaseState::Revoking]
                        .map(|s| s as i32)
                        .contains(&l.state);
                    if !ok {
                        m.violation(format!(
                            "release of {id} answered state {} (want released or revoking)",
                            l.state
                        ));
                    }
                    m.leases.get_mut(&id).unwrap().rel = Rel::Acked;
                    full = false;
                }
                Err(e) if e.code() == Code::NotFound => {
                    m.violation(format!("release of acknowledged lease {id}: NotFound: {e}"));
                }
                Err(e) if definitive(e.code()) => {
                    m.violation(format!("release of acknowledged lease {id} refused: {e}"));
                }
                Err(_) => return,
            }
        } else if !mine.is_empty() && roll < 0.5 {
            // An idempotent retry of an acknowledged create returns the same lease.
            let (id, t) = mine[rng.gen_range(0..mine.len())].clone();
            let mut req = create_req(&t.tenant, t.shape.clone());
            req.request_id = t.request_id.clone();
            let r = c.create_lease(req).await;
            let mut m = model.lock().unwrap();
            m.ops += 1;
            match r {
                Ok(resp) => {
                    let resp = resp.into_inner();
                    let got = resp.lease.unwrap().id;
                    if got != id || !resp.replayed {
                        m.violation(format!(
                            "retry of request {} gave lease {got} (replayed {}), want {id}",
                            t.request_id, resp.replayed
                        ));
                    }
                }
                Err(e) if definitive(e.code()) => {
                    m.violation(format!("retry of request {} refused: {e}", t.request_id));
                }
                Err(_) => return,
            }
        } else {
            let shape = random_shape(&mut rng);
            let rid = rid_of(owner, cycle, n);
            let mut req = create_req(&tenant, shape.clone());
            req.request_id = rid.clone();
            model.lock().unwrap().in_doubt.insert(
                rid.clone(),
                InDoubtCreate {
                    owner,
                    tenant: tenant.clone(),
                    request_id: rid.clone(),
                    shape: shape.clone(),
                },
            );
            let r = c.create_lease(req).await;
            let mut m = model.lock().unwrap();
            m.ops += 1;
            match r {
                Ok(resp) => {
                    m.in_doubt.remove(&rid);
                    let resp = resp.into_inner();
                    let l = resp.lease.unwrap();
                    if resp.replayed || l.state != pb::LeaseState::Active as i32 {
                        m.violation(format!(
                            "fresh request {rid} gave lease {} replayed {} state {}",
                            l.id, resp.replayed, l.state
                        ));
                    }
                    m.leases.insert(
                        l.id,
                        Tracked {
                            owner,
                            tenant: tenant.clone(),
                            request_id: rid,
                            shape,
                            token: resp.token,
                            rel: Rel::No,
                            retired: false,
                        },
                    );
                }
                Err(e) if definitive(e.code()) => {
                    m.in_doubt.remove(&rid);
                    m.refused.insert((tenant.clone(), rid));
                    full = e.code() == Code::ResourceExhausted;
                }
                // Hardware faults (Unavailable, Internal) and transport errors: outcome unknown.
                Err(_) => {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                }
            }
        }
    }
}

/// The model's promises against the daemon. Returns (violations, in progress,
/// leases checked).
async fn check_model(
    c: &mut Client,
    model: &Mutex<Model>,
    rng: &mut StdRng,
) -> (Vec<String>, bool, u64) {
    let mut v = Vec::new();
    let mut in_progress = false;
    let mut checked = 0;
    let live = match c.list_leases(pb::ListLeasesRequest::default()).await {
        Ok(l) => l.into_inner().leases,
        Err(e) => return (vec![format!("ListLeases failed: {e}")], false, 0),
    };
    let live_by_id: HashMap<&str, &pb::Lease> = live.iter().map(|l| (l.id.as_str(), l)).collect();
    let tracked: Vec<(String, Tracked)> = {
        let m = model.lock().unwrap();
        m.leases
            .iter()
            .filter(|(_, t)| !t.retired || rng.gen_bool(0.02))
            .map(|(k, t)| (k.clone(), t.clone()))
            .collect()
    };
    let mut retire = Vec::new();
    for (id, t) in &tracked {
        checked += 1;
        match t.rel {
            Rel::No => {
                match live_by_id.get(id.as_str()) {
                    Some(l) if l.state == pb::LeaseState::Active as i32 => {}
                    Some(l) => v.push(format!("acknowledged lease {id} is in state {}", l.state)),
                    None => v.push(format!("acknowledged lease {id} is not live")),
                }
                match c
                    .resolve_token(pb::ResolveTokenRequest {
                        token: t.token.clone(),
                    })
                    .await
                {
                    Ok(r) => {
                        let got = r.into_inner().lease.map(|l| l.id).unwrap_or_default();
                        if got != *id {
                            v.push(format!("token of {id} resolves to {got}"));
                        }
                    }
                    Err(e) => v.push(format!("token of acknowledged lease {id}: {e}")),
                }
            }
            Rel::Acked => {
                let l = c
                    .get_lease(pb::GetLeaseRequest {
                        lease_id: id.clone(),
                    })
                    .await;
                match l {
                    Ok(l) => {
                        let l = l.into_inner().lease.unwrap();
                        if l.state == pb::LeaseState::Revoking as i32 {
                            in_progress = true;
                            v.push(format!("released lease {id} is still revoking"));
                        } else if l.state != pb::LeaseState::Released as i32 {
                            v.push(format!("released lease {id} is in state {}", l.state));
                        } else {
                            retire.push(id.clone());
                        }
                    }
                    Err(e) => v.push(format!("released lease {id}: GetLease: {e}")),
                }
                if live_by_id
                    .get(id.as_str())
                    .is_some_and(|l| l.state != pb::LeaseState::Revoking as i32)
                {
                    v.push(format!("released lease {id} is listed as live"));
                }
                if !in_progress {
                    let r = c
                        .resolve_token(pb::ResolveTokenRequest {
                            token: t.token.clone(),
                        })
                        .await;
                    if r.is_ok() {
                        v.push(format!("token of released lease {id} still resolves"));
                    }
                }
            }
            Rel::InDoubt => {}
        }
        // The request id still names this lease.
        if !t.retired || t.rel != Rel::Acked {
            let mut req = create_req(&t.tenant, t.shape.clone());
            req.request_id = t.request_id.clone();
            match c.create_lease(req).await {
                Ok(r) => {
                    let r = r.into_inner();
                    let got = r.lease.map(|l| l.id).unwrap_or_default();
                    if got != *id || !r.replayed {
                        v.push(format!(
                            "retry of {} gave {got} (replayed {}), want {id}",
                            t.request_id, r.replayed
                        ));
                    }
                }
                Err(e) => v.push(format!("retry of {} for {id}: {e}", t.request_id)),
            }
        }
    }
    // Every live lease is one the clients asked for.
    {
        let m = model.lock().unwrap();
        for l in &live {
            let known = m.leases.contains_key(&l.id) || (m.in_doubt.contains_key(&l.request_id));
            if !known {
                v.push(format!(
                    "live lease {} (request {:?}) was never acknowledged nor asked for",
                    l.id, l.request_id
                ));
            }
            if m.refused
                .contains(&(l.tenant.clone(), l.request_id.clone()))
            {
                v.push(format!(
                    "live lease {} carries refused request {}",
                    l.id, l.request_id
                ));
            }
        }
    }
    if v.is_empty() {
        let mut m = model.lock().unwrap();
        for id in retire {
            if let Some(t) = m.leases.get_mut(&id) {
                t.retired = true;
            }
        }
    }
    (v, in_progress, checked)
}

/// Settle what the last cycle left in doubt: re-send releases and creates (with
/// their request ids), and check the answers name one lease each.
async fn resolve_in_doubt(c: &mut Client, model: &Mutex<Model>) -> Vec<String> {
    let mut v = Vec::new();
    let releases: Vec<String> = {
        let m = model.lock().unwrap();
        m.leases
            .iter()
            .filter(|(_, t)| t.rel == Rel::InDoubt)
            .map(|(k, _)| k.clone())
            .collect()
    };
    for id in releases {
        match c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: id.clone(),
                reason: "crash harness retry".into(),
            })
            .await
        {
            Ok(_) => model.lock().unwrap().leases.get_mut(&id).unwrap().rel = Rel::Acked,
            Err(e) => v.push(format!("re-sent release of {id}: {e}")),
        }
    }
    let creates: Vec<InDoubtCreate> = model.lock().unwrap().in_doubt.values().cloned().collect();
    for cr in creates {
        let mut req = create_req(&cr.tenant, cr.shape.clone());
        req.request_id = cr.request_id.clone();
        let first = c.create_lease(req.clone()).await;
        // The lease the retry named, if it is live (recorded under the lock).
        let created = {
            let mut m = model.lock().unwrap();
            m.in_doubt.remove(&cr.request_id);
            match first {
                Ok(r) => {
                    let r = r.into_inner();
                    let l = r.lease.unwrap();
                    if l.state == pb::LeaseState::Active as i32 {
                        m.leases.insert(
                            l.id.clone(),
                            Tracked {
                                owner: cr.owner,
                                tenant: cr.tenant.clone(),
                                request_id: cr.request_id.clone(),
                                shape: cr.shape.clone(),
                                token: r.token,
                                rel: Rel::No,
                                retired: false,
                            },
                        );
                        Some(l.id)
                    } else {
                        // Found ended: nothing live may carry this request id.
                        m.refused.insert((cr.tenant.clone(), cr.request_id.clone()));
                        None
                    }
                }
                Err(e) if definitive(e.code()) => {
                    m.refused.insert((cr.tenant.clone(), cr.request_id.clone()));
                    None
                }
                Err(e) => {
                    v.push(format!("re-sent create {}: {e}", cr.request_id));
                    None
                }
            }
        };
        let Some(id) = created else { continue };
        match c.create_lease(req).await {
            Ok(again) => {
                let again = again.into_inner();
                let id2 = again.lease.unwrap().id;
                if id2 != id || !again.replayed {
                    v.push(format!(
                        "request {} gave {id} then {id2} (replayed {})",
                        cr.request_id, again.replayed
                    ));
                }
            }
            Err(e) => v.push(format!("second retry of {}: {e}", cr.request_id)),
        }
    }
    v
}

/// Check until the state is consistent; violations only count once no work is in
/// progress (or after ~10 s of waiting for it).
async fn verify(
    c: &mut Client,
    sim: &invariants::Hardware,
    model: &Mutex<Model>,
    rng: &mut StdRng,
    what: &str,
) -> (Vec<String>, u64) {
    for attempt in 0.. {
        let (mut v, busy) = check_structure(c, &**sim).await;
        let (v2, busy2, checked) = check_model(c, model, rng).await;
        v.extend(v2);
        if v.is_empty() {
            return (v, checked);
        }
        if !(busy || busy2) || attempt >= 200 {
            return (
                v.into_iter().map(|s| format!("{what}: {s}")).collect(),
                checked,
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    unreachable!()
}

fn seed() -> u64 {
    std::env::var("TESSERA_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
}

#[test]
fn leases_survive_random_sigkills_under_load() {
    let seed = seed();
    let cycles: usize = std::env::var("TESSERA_CRASH_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    println!("crash harness: seed {seed} (TESSERA_CRASH_SEED={seed} replays it)");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut d = TestDaemon::start_with(GPUS, "").unwrap();
    let sim = sim_of(&d);
    let model = Arc::new(Mutex::new(Model::default()));
    let r = rt();
    let mut checked = 0u64;
    let mut faults = 0u32;
    let mut kills = 0usize;
    for cycle in 0..cycles {
        // Every fourth cycle arms a hardware fault on a random GPU.
        if cycle % 4 == 3 {
            let gpu = rng.gen_range(0..2);
            match rng.gen_range(0..4) {
                0 => sim.fail_next_create(gpu, CreateStage::Gi).unwrap(),
                1 => sim.fail_next_create(gpu, CreateStage::Ci).unwrap(),
                2 => sim.crash_next_create_after_gi(gpu).unwrap(),
                _ => sim.fail_next_destroy(gpu).unwrap(),
            }
            faults += 1;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let delay = rng.gen_range(0..=50);
        let seeds: Vec<u64> = (0..TASKS).map(|_| rng.r#gen()).collect();
        r.block_on(async {
            let c = d.client().await.unwrap();
            let tasks: Vec<_> = seeds
                .into_iter()
                .enumerate()
                .map(|(i, s)| {
                    tokio::spawn(load(i, cycle, s, c.clone(), model.clone(), stop.clone()))
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(delay)).await;
            d.kill().unwrap();
            kills += 1;
            stop.store(true, Ordering::SeqCst);
            for t in tasks {
                tokio::time::timeout(Duration::from_secs(30), t)
                    .await
                    .expect("a load task hung after the kill")
                    .unwrap();
            }
        });
        // Faults not consumed must not strike the reconciliation: the harness checks
        // reconciliation against a known hardware state.
        for gpu in 0..2 {
            sim.clear_faults(gpu).unwrap();
        }
        if let Err(e) = d.spawn() {
            panic!("cycle {cycle}: restart failed (seed {seed}): {e}");
        }
        let v = r.block_on(async {
            let mut c = d.client().await.unwrap();
            let (mut v, n) = verify(
                &mut c,
                &sim,
                &model,
                &mut rng,
                &format!("cycle {cycle} after restart"),
            )
            .await;
            checked += n;
            v.extend(resolve_in_doubt(&mut c, &model).await);
            let (v2, n) = verify(
                &mut c,
                &sim,
                &model,
                &mut rng,
                &format!("cycle {cycle} after retries"),
            )
            .await;
            checked += n;
            v.extend(v2);
            v
        });
        let mut m = model.lock().unwrap();
        for s in v {
            m.violation(s);
        }
        if !m.violations.is_empty() {
            break;
        }
    }
    let m = model.lock().unwrap();
    let several = m.leases.values().filter(|t| is_several(&t.shape)).count();
    let shared = m
        .leases
        .values()
        .filter(|t| is_shared_mps(&t.shape))
        .count();
    println!(
        "crash harness: {kills} kill cycles, {} leases acknowledged ({several} of several partitions, {shared} shared MPS or MPS in MIG), {checked} lease checks, {} ops, {faults} faults armed, {} violations, seed {seed}",
        m.leases.len(),
        m.ops,
        m.violations.len()
    );
    assert!(
        m.violations.is_empty(),
        "seed {seed}: {} violations:\n{}\n--- daemon log tail ---\n{}",
        m.violations.len(),
        m.violations.join("\n"),
        tail(&d.log(), 60)
    );
    assert!(kills >= 50.min(cycles), "only {kills} kills");
    assert!(m.ops > 0 && !m.leases.is_empty(), "the load did nothing");
}

/// Poll a lease (every 50 ms, for up to 10 s) until it reaches `want`; returns the
/// last state seen.
async fn wait_for_state(c: &mut Client, lease_id: &str, want: pb::LeaseState) -> i32 {
    let mut state = -1;
    for _ in 0..200 {
        state = lease_of(c, lease_id).await.state;
        if state == want as i32 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    state
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A create that dies between the GI and the CI leaves no GI behind: the daemon
/// answers with the NVML error and undoes the half-done instance, so the placement
/// is usable again and no instance without a record remains (before or after a
/// restart).
#[test]
fn a_create_that_fails_after_the_gi_leaves_no_instance_behind() {
    let mut d = TestDaemon::start_with(GPUS, "").unwrap();
    let sim = sim_of(&d);
    let r = rt();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        sim.crash_next_create_after_gi(0).unwrap();
        let mut req = create_req("team-a", shape::mig("7g.80gb"));
        req.gpu_index = Some(0);
        req.request_id = "half".into();
        let err = c.create_lease(req.clone()).await.unwrap_err();
        // NVML's "unknown error" is the hardware's state now: retry later.
        assert_eq!(err.code(), Code::Unavailable, "{err}");
        assert!(
            err.message()
                .contains("nvmlGpuInstanceCreateComputeInstance"),
            "the error names the failed NVML call: {}",
            err.message()
        );
        assert!(
            sim.instances(0).unwrap().is_empty(),
            "the GI of the failed create is destroyed: {:?}",
            sim.instances(0).unwrap()
        );
        // The same placement works again, for a retry of the same request.
        let l = c.create_lease(req).await.unwrap().into_inner();
        assert!(!l.replayed, "the failed lease is not replayed");
        assert_eq!(l.lease.unwrap().partition.unwrap().gpu_index, 0);
        let (v, _) = check_structure(&mut c, &*sim).await;
        assert!(v.is_empty(), "{v:?}");
    });
    d.kill().unwrap();
    d.spawn().unwrap();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        let (v, _) = check_structure(&mut c, &*sim).await;
        assert!(v.is_empty(), "{v:?}");
        assert_eq!(sim.instances(0).unwrap().len(), 1);
    });
    assert!(!d.log().contains("not created by tesserad"), "{}", d.log());
}

/// A CI-stage failure is rolled back by the unit create: a precise error, no lease,
/// no instance; a retry with the same request id makes one lease.
#[test]
fn a_failed_ci_create_is_a_precise_error_and_a_retry_succeeds() {
    let d = TestDaemon::start_with(GPUS, "").unwrap();
    let sim = sim_of(&d);
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        sim.fail_next_create(1, CreateStage::Ci).unwrap();
        let mut req = create_req("team-a", shape::mig("3g.40gb"));
        req.gpu_index = Some(1);
        req.request_id = "ci".into();
        let err = c.create_lease(req.clone()).await.unwrap_err();
        // NVML's "unknown error" is the hardware's state now: retry later.
        assert_eq!(err.code(), Code::Unavailable, "{err}");
        assert!(
            err.message()
                .contains("nvmlGpuInstanceCreateComputeInstance"),
            "{}",
            err.message()
        );
        assert!(sim.instances(1).unwrap().is_empty());
        let live = c
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .leases;
        assert!(
            live.is_empty(),
            "no live lease after a failed create: {live:?}"
        );
        let a = c.create_lease(req.clone()).await.unwrap().into_inner();
        let b = c.create_lease(req).await.unwrap().into_inner();
        assert_eq!(a.lease.unwrap().id, b.lease.unwrap().id);
        assert!(b.replayed);
        assert_eq!(sim.instances(1).unwrap().len(), 1);
    });
}

/// A destroy that fails once leaves the lease revoking; the daemon finishes the
/// teardown by itself. A process holding the instance blocks the teardown (the
/// lease stays revoking, across a crash and restart) until it exits.
#[test]
fn failed_and_blocked_teardowns_finish_later_even_across_a_restart() {
    let mut d = TestDaemon::start_with(GPUS, "").unwrap();
    let sim = sim_of(&d);
    let r = rt();
    let mut rng = StdRng::seed_from_u64(2);
    let model = Mutex::new(Model::default());
    let (busy, busy_token, busy_gi, busy_ci) = r.block_on(async {
        let mut c = d.client().await.unwrap();
        let mut req = create_req("team-a", shape::mig("2g.20gb"));
        req.gpu_index = Some(0);
        let a = c.create_lease(req.clone()).await.unwrap().into_inner();
        let b = c.create_lease(req).await.unwrap().into_inner();
        let a_id = a.lease.unwrap().id;
        let bl = b.lease.unwrap();
        let bm = bl.partition.as_ref().unwrap().mig.clone().unwrap();

        // 1. One failed destroy: released answers revoking, then it finishes.
        sim.fail_next_destroy(0).unwrap();
        let rel = c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: a_id.clone(),
                reason: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(rel.state, pb::LeaseState::Revoking as i32);
        let state = wait_for_state(&mut c, &a_id, pb::LeaseState::Released).await;
        assert_eq!(
            state,
            pb::LeaseState::Released as i32,
            "the retry finished it"
        );
        assert_eq!(sim.instances(0).unwrap().len(), 1);

        // 2. A process in the instance blocks its teardown.
        sim.add_process(0, Some(bm.gi_id), Some(bm.ci_id), 4242, 1 << 30)
            .unwrap();
        let rel = c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: bl.id.clone(),
                reason: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(rel.state, pb::LeaseState::Revoking as i32);
        (bl.id, b.token, bm.gi_id, bm.ci_id)
    });
    let _ = (busy_gi, busy_ci);
    // Crash while the teardown is blocked.
    d.kill().unwrap();
    d.spawn().unwrap();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        let l = lease_of(&mut c, &busy).await;
        assert_eq!(
            l.state,
            pb::LeaseState::Revoking as i32,
            "still blocked by the process after the restart"
        );
        let (v, busy_now) = check_structure(&mut c, &*sim).await;
        assert!(
            v.is_empty(),
            "the blocked instance is still explained: {v:?}"
        );
        assert!(busy_now);
        sim.remove_process(0, 4242).unwrap();
        let state = wait_for_state(&mut c, &busy, pb::LeaseState::Released).await;
        assert_eq!(state, pb::LeaseState::Released as i32);
        assert!(sim.instances(0).unwrap().is_empty(), "no instance leaked");
        let err = c
            .resolve_token(pb::ResolveTokenRequest { token: busy_token })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        let (v, _) = verify(&mut c, &sim, &model, &mut rng, "converged").await;
        assert!(v.is_empty(), "{v:?}");
    });
    // Restart once more: nothing left to reconcile, nothing foreign.
    d.kill().unwrap();
    d.spawn().unwrap();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        let (v, busy_now) = check_structure(&mut c, &*sim).await;
        assert!(v.is_empty() && !busy_now, "{v:?}");
    });
    assert!(!d.log().contains("not created by tesserad"), "{}", d.log());
}

/// A teardown that keeps failing at the GPU instance's destroy (over NVML the
/// compute instance is already gone then), the daemon killed: the start finishes
/// it, and nothing is left or set aside as foreign.
#[test]
fn a_teardown_that_failed_halfway_is_finished_after_a_restart() {
    let mut d = TestDaemon::start_with(GPUS, "").unwrap();
    let sim = sim_of(&d);
    let r = rt();
    let id = r.block_on(async {
        let mut c = d.client().await.unwrap();
        let mut req = create_req("team-a", shape::mig("3g.40gb"));
        req.gpu_index = Some(0);
        let l = c
            .create_lease(req)
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(sim.instances(0).unwrap().len(), 1);
        d.sim(&["fault", "--call", "destroy_instance", "--fail-rate", "1"]);
        let rel = c
            .release_lease(pb::ReleaseLeaseRequest {
                lease_id: l.id.clone(),
                reason: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert_eq!(rel.state, pb::LeaseState::Revoking as i32);
        l.id
    });
    d.kill().unwrap();
    d.sim(&["clear-faults"]);
    d.spawn().unwrap();
    r.block_on(async {
        let mut c = d.client().await.unwrap();
        let state = wait_for_state(&mut c, &id, pb::LeaseState::Released).await;
        assert_eq!(state, pb::LeaseState::Released as i32);
        assert!(sim.instances(0).unwrap().is_empty(), "the GI was left");
        let (v, _) = check_structure(&mut c, &*sim).await;
        assert!(v.is_empty(), "{v:?}");
        let node = c
            .get_node(pb::GetNodeRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(node.gpus[0].free_slices, 8, "{:?}", node.gpus[0]);
    });
}
