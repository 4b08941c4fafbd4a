//! Exact where it can be: a static batch of MIG requests on 1 to 4 H100s, placed by the
//! daemon's planner (best fit, the largest requests first, as a batch known at once is
//! placed), against the exact optimum (the most memory slices any sub-batch that fits
//! could take, by brute force over the free-repacking reference's layouts).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_bench::trace::Repacker;
use tesserad::gpu::profiles::GpuModel;
use tesserad::gpu::{GiProfile, GpuInfo};
use tesserad::partition::{GpuView, OccupiedMig, PlanDecision, PlanOptions, Shape, plan};

const NAMES: [&str; 6] = [
    "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
];

fn node(n: u32) -> Vec<GpuView> {
    let m = GpuModel::H100Hbm3_80Gb;
    (0..n)
        .map(|index| GpuView {
            info: GpuInfo {
                index,
                uuid: format!("GPU-batch-{index}"),
                name: m.marketing_name().to_string(),
                memory_bytes: m.memory_bytes(),
                minor: index,
                pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + index),
                mig_current: true,
                mig_pending: true,
                sm_count: m.sm_count(),
                fault: None,
            },
            profiles: m.gi_profiles(),
            mig: Vec::new(),
            mps: Default::default(),
            whole_leased: false,
        })
        .collect()
}

/// Memory slices the planner places of `batch` (counts per profile of `profiles`).
fn planned(profiles: &[GiProfile], batch: &[u8], n: u32) -> u32 {
    let mut gpus = node(n);
    let mut order: Vec<usize> = (0..profiles.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(profiles[i].memory_slices));
    let mut slices = 0;
    for i in order {
        for _ in 0..batch[i] {
            let shape = Shape::Mig {
                profile: profiles[i].name.clone(),
                compute_profile: None,
            };
            if let Ok(PlanDecision::NewMig {
                gpu,
                gi_profile_id,
                placement,
                ..
            }) = plan(&shape, &gpus, &PlanOptions::default())
            {
                gpus[gpu as usize].mig.push(OccupiedMig {
                    gi_profile_id,
                    placement,
                    free_static: None,
                });
                slices += profiles[i].memory_slices;
            }
        }
    }
    slices
}

/// The most memory slices a sub-batch of `batch` that fits on `n` GPUs holds.
fn optimum(r: &mut Repacker, profiles: &[GiProfile], batch: &[u8], n: u32) -> u32 {
    let mut best = 0;
    let mut sub = vec![0u8; batch.len()];
    loop {
        let slices: u32 = sub
            .iter()
            .zip(profiles)
            .map(|(c, p)| u32::from(*c) * p.memory_slices)
            .sum();
        if slices > best && r.fits(&sub, n) {
            best = slices;
        }
        // Next sub-batch (odometer).
        let mut i = 0;
        loop {
            if i == sub.len() {
                return best;
            }
            if sub[i] < batch[i] {
                sub[i] += 1;
                break;
            }
            sub[i] = 0;
            i += 1;
        }
    }
}

#[test]
fn the_planner_packs_static_batches_within_2_percent_of_the_optimum() {
    let all = GpuModel::H100Hbm3_80Gb.gi_profiles();
    let profiles: Vec<GiProfile> = NAMES
        .iter()
        .map(|n| all.iter().find(|p| p.name == *n).unwrap().clone())
        .collect();
    let mut rng = StdRng::seed_from_u64(38);
    for n in 1..=4u32 {
        let mut r = Repacker::new(&profiles, n);
        let (mut got, mut best, mut exact, mut worst) = (0u32, 0u32, 0u32, 1.0f64);
        let batches = 150;
        for _ in 0..batches {
            // 2 to 5 requests per GPU: from a light batch to one well over the node.
            let len = rng.gen_range(2 * n..=5 * n);
            let mut batch = vec![0u8; profiles.len()];
            for _ in 0..len {
                batch[rng.gen_range(0..profiles.len())] += 1;
            }
            let p = planned(&profiles, &batch, n);
            let o = optimum(&mut r, &profiles, &batch, n);
            assert!(
                p <= o,
                "the planner placed more than the optimum: {batch:?}"
            );
            got += p;
            best += o;
            exact += u32::from(p == o);
            worst = worst.min(f64::from(p) / f64::from(o.max(1)));
        }
        let ratio = f64::from(got) / f64::from(best);
        println!(
            "{n} GPU(s): {batches} batches, planner / optimum {ratio:.4} (slices), \
             exact on {exact}, worst batch {worst:.3}"
        );
        assert!(ratio >= 0.98, "{n} GPUs: {ratio}");
    }
}
