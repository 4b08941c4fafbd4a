//! NVIDIA's published MIG profile and placement tables as data.
//!
//! The simulator serves these tables; the NVML backend reads the real ones from the
//! driver and only falls back on [`ci_profiles_for`] to describe the compute-instance
//! profiles of a GI profile that has no instance yet (NVML can only list CI profiles
//! through an existing GI).
//!
//! Ids follow NVML: GI profile ids are `NVML_GPU_INSTANCE_PROFILE_*` (the "NVML id"
//! column of the reference), CI profile ids are `NVML_COMPUTE_INSTANCE_PROFILE_*`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::types::{CiProfile, GiProfile, Placement};

const MIB: u64 = 1024 * 1024;

/// Memory slices per GPU (placement starts and sizes are in these units).
pub const MEMORY_SLICES: u32 = 8;
/// Compute slices per GPU.
pub const COMPUTE_SLICES: u32 = 7;

use tessera_common::mig::MigModel;
pub use tessera_common::mig::{
    GI_PROFILE_1_SLICE, GI_PROFILE_1_SLICE_REV1, GI_PROFILE_1_SLICE_REV2, GI_PROFILE_2_SLICE,
    GI_PROFILE_3_SLICE, GI_PROFILE_4_SLICE, GI_PROFILE_7_SLICE, ci_layout, ci_profile_id,
};

/// A GI profile's placements: one per start slice, each `memory_slices` wide.
pub fn placements_at(starts: &[u32], memory_slices: u32) -> Vec<Placement> {
    starts
        .iter()
        .map(|&start| Placement {
            start,
            size: memory_slices,
        })
        .collect()
}

/// CI profiles for a GI with `gi_slices` compute slices and `gi_sm_count` SMs.
/// `sm_of_slices(n)` gives the SM count of an n-slice CI that is smaller than the GI
/// (on real GPUs: the SM count of the n-slice GI profile); a CI spanning the whole
/// GI gets all of the GI's SMs.
pub fn ci_profiles_for(
    gi_slices: u32,
    gi_sm_count: u32,
    sm_of_slices: impl Fn(u32) -> u32,
) -> Vec<CiProfile> {
    ci_layout(gi_slices)
        .iter()
        .filter_map(|&(slices, max_count)| {
            let id = ci_profile_id(slices)?;
            let sm_count = if slices == gi_slices {
                gi_sm_count
            } else {
                sm_of_slices(slices)
            };
            Some(CiProfile {
                id,
                name: format!("{slices}c"),
                slices,
                max_count,
                sm_count,
            })
        })
        .collect()
}

/// The GPU models the simulator knows (and the reference tables describe).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GpuModel {
    #[serde(rename = "a100-40gb")]
    A100Sxm40Gb,
    #[serde(rename = "a100-80gb")]
    A100Sxm80Gb,
    #[serde(rename = "h100-80gb")]
    H100Hbm3_80Gb,
    #[serde(rename = "h200-141gb")]
    H200_141Gb,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown GPU model {0:?}: expected one of a100-40gb, a100-80gb, h100-80gb, h200-141gb")]
pub struct UnknownModel(pub String);

impl GpuModel {
    pub const ALL: [GpuModel; 4] = [
        GpuModel::A100Sxm40Gb,
        GpuModel::A100Sxm80Gb,
        GpuModel::H100Hbm3_80Gb,
        GpuModel::H200_141Gb,
    ];

    /// The model's row in the MIG tables.
    fn mig(self) -> MigModel {
        match self {
            GpuModel::A100Sxm40Gb => MigModel::A100Sxm40Gb,
            GpuModel::A100Sxm80Gb => MigModel::A100Sxm80Gb,
            GpuModel::H100Hbm3_80Gb => MigModel::H100Hbm3_80Gb,
            GpuModel::H200_141Gb => MigModel::H200_141Gb,
        }
    }

    /// The short name used in the daemon config ("h100-80gb").
    pub fn short_name(self) -> &'static str {
        self.mig().short_name()
    }

    /// The name NVML reports (`nvmlDeviceGetName`).
    pub fn marketing_name(self) -> &'static str {
        self.mig().marketing_name()
    }

    /// Parse a short name ("h100-80gb", case-insensitive) or a marketing name.
    pub fn from_name(name: &str) -> Option<GpuModel> {
        let name = name.trim();
        GpuModel::ALL
            .into_iter()
            .find(|m| m.short_name().eq_ignore_ascii_case(name) || m.marketing_name() == name)
    }

    pub fn memory_bytes(self) -> u64 {
        self.mig().memory_bytes()
    }

    pub fn sm_count(self) -> u32 {
        self.mig().sm_count()
    }

    /// The GI profiles of this model, in the reference table's order.
    pub fn gi_profiles(self) -> Vec<GiProfile> {
        let mig = self.mig();
        mig.gi_rows()
            .iter()
            .map(|r| GiProfile {
                id: r.id,
                name: r.name.to_string(),
                slices: r.slices,
                memory_slices: r.memory_slices,
                memory_bytes: r.memory_mib * MIB,
                sm_count: r.sm_count,
                max_count: r.max_count,
                placements: placements_at(r.starts, r.memory_slices),
                ci_profiles: ci_profiles_for(r.slices, r.sm_count, |n| mig.sm_of_slices(n)),
                media_extensions: r.media_extensions,
            })
            .collect()
    }

    /// One GI profile by NVML id.
    pub fn gi_profile(self, profile_id: u32) -> Option<GiProfile> {
        self.gi_profiles().into_iter().find(|p| p.id == profile_id)
    }
}

impl fmt::Display for GpuModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

impl FromStr for GpuModel {
    type Err = UnknownModel;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GpuModel::from_name(s).ok_or_else(|| UnknownModel(s.to_owned()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn gib(bytes: u64) -> f64 {
        bytes as f64 / (1024.0 * 1024.0 * 1024.0)
    }

    #[test]
    fn names_parse_both_ways() {
        for m in GpuModel::ALL {
            assert_eq!(GpuModel::from_name(m.short_name()), Some(m));
            assert_eq!(GpuModel::from_name(m.marketing_name()), Some(m));
            assert_eq!(m.short_name().parse::<GpuModel>().unwrap(), m);
            assert_eq!(m.to_string(), m.short_name());
        }
        assert_eq!(
            GpuModel::from_name("H100-80GB"),
            Some(GpuModel::H100Hbm3_80Gb)
        );
        let err = "v100".parse::<GpuModel>().unwrap_err();
        assert!(err.to_string().contains("h100-80gb"), "{err}");
    }

    #[test]
    fn serde_uses_short_names() {
        #[derive(Deserialize)]
        struct C {
            model: GpuModel,
        }
        let c: C = toml::from_str("model = \"h200-141gb\"").unwrap();
        assert_eq!(c.model, GpuModel::H200_141Gb);
        assert!(toml::from_str::<C>("model = \"h100\"").is_err());
    }

    /// (id, name, GiB, SMs) per model, straight from the reference table.
    fn expected(m: GpuModel) -> Vec<(u32, &'static str, f64, u32)> {
        match m {
            GpuModel::A100Sxm40Gb => vec![
                (0, "1g.5gb", 4.75, 14),
                (7, "1g.5gb+me", 4.75, 14),
                (9, "1g.10gb", 9.62, 14),
                (1, "2g.10gb", 9.62, 28),
                (2, "3g.20gb", 19.50, 42),
                (3, "4g.20gb", 19.62, 56),
                (4, "7g.40gb", 39.50, 98),
            ],
            GpuModel::A100Sxm80Gb => vec![
                (0, "1g.10gb", 9.50, 14),
                (7, "1g.10gb+me", 9.50, 14),
                (9, "1g.20gb", 19.50, 14),
                (1, "2g.20gb", 19.50, 28),
                (2, "3g.40gb", 39.25, 42),
                (3, "4g.40gb", 39.25, 56),
                (4, "7g.80gb", 79.0, 98),
            ],
            GpuModel::H100Hbm3_80Gb => vec![
                (0, "1g.10gb", 9.75, 16),
                (7, "1g.10gb+me", 9.75, 16),
                (9, "1g.20gb", 19.62, 26),
                (1, "2g.20gb", 19.62, 32),
                (2, "3g.40gb", 39.50, 60),
                (3, "4g.40gb", 39.50, 64),
                (4, "7g.80gb", 79.25, 132),
            ],
            GpuModel::H200_141Gb => vec![
                (0, "1g.18gb", 16.00, 16),
                (7, "1g.18gb+me", 16.00, 16),
                (9, "1g.35gb", 32.50, 26),
                (1, "2g.35gb", 32.50, 32),
                (2, "3g.71gb", 69.75, 60),
                (3, "4g.71gb", 69.75, 64),
                (4, "7g.141gb", 140.0, 132),
            ],
        }
    }

    #[test]
    fn gi_tables_match_reference() {
        for m in GpuModel::ALL {
            let profiles = m.gi_profiles();
            let exp = expected(m);
            assert_eq!(profiles.len(), exp.len());
            for (p, (id, name, gib_exp, sm)) in profiles.iter().zip(exp) {
                assert_eq!(p.id, id, "{m} {name}");
                assert_eq!(p.name, name, "{m}");
                // "~79"/"~140" rows are approximate in the reference.
                let tol = if name.starts_with("7g.80gb") && m == GpuModel::A100Sxm80Gb
                    || name == "7g.141gb"
                {
                    0.5
                } else {
                    0.006
                };
                assert!((gib(p.memory_bytes) - gib_exp).abs() <= tol, "{m} {name}");
                assert_eq!(p.sm_count, sm, "{m} {name}");
                assert_eq!(p.media_extensions, name.ends_with("+me"));
            }
            let geometry: Vec<(u32, u32, u32, u32, Vec<u32>)> = profiles
                .iter()
                .map(|p| {
                    assert!(p.placements.iter().all(|pl| pl.size == p.memory_slices));
                    (
                        p.id,
                        p.slices,
                        p.memory_slices,
                        p.max_count,
                        p.placements.iter().map(|pl| pl.start).collect(),
                    )
                })
                .collect();
            assert_eq!(
                geometry,
                vec![
                    (0, 1, 1, 7, vec![0, 1, 2, 3, 4, 5, 6]),
                    (7, 1, 1, 1, vec![0, 1, 2, 3, 4, 5, 6]),
                    (9, 1, 2, 4, vec![0, 2, 4, 6]),
                    (1, 2, 2, 3, vec![0, 2, 4]),
                    (2, 3, 4, 2, vec![0, 4]),
                    (3, 4, 4, 1, vec![0]),
                    (4, 7, 8, 1, vec![0]),
                ],
                "{m}"
            );
            assert!(profiles.iter().all(|p| p.memory_bytes < m.memory_bytes()));
        }
    }

    #[test]
    fn ci_tables_match_reference() {
        for m in GpuModel::ALL {
            for p in m.gi_profiles() {
                let cis: Vec<(u32, &str, u32)> = p
                    .ci_profiles
                    .iter()
                    .map(|c| (c.id, c.name.as_str(), c.max_count))
                    .collect();
                let exp: Vec<(u32, &str, u32)> = match p.slices {
                    1 => vec![(0, "1c", 1)],
                    2 => vec![(0, "1c", 2), (1, "2c", 1)],
                    3 => vec![(0, "1c", 3), (1, "2c", 1), (2, "3c", 1)],
                    4 => vec![(0, "1c", 4), (1, "2c", 2), (3, "4c", 1)],
                    7 => vec![
                        (0, "1c", 7),
                        (1, "2c", 3),
                        (2, "3c", 2),
                        (3, "4c", 1),
                        (4, "7c", 1),
                    ],
                    other => panic!("unexpected slices {other}"),
                };
                assert_eq!(cis, exp, "{m} {}", p.name);
                let whole = p.ci_profiles.last().unwrap();
                assert_eq!(whole.slices, p.slices);
                assert_eq!(whole.sm_count, p.sm_count, "whole-GI CI gets all SMs");
            }
        }
        let h100_7g = GpuModel::H100Hbm3_80Gb
            .gi_profile(GI_PROFILE_7_SLICE)
            .unwrap();
        let sms: Vec<u32> = h100_7g.ci_profiles.iter().map(|c| c.sm_count).collect();
        assert_eq!(sms, vec![16, 32, 60, 64, 132]);
        let a100_3g = GpuModel::A100Sxm40Gb
            .gi_profile(GI_PROFILE_3_SLICE)
            .unwrap();
        let sms: Vec<u32> = a100_3g.ci_profiles.iter().map(|c| c.sm_count).collect();
        assert_eq!(sms, vec![14, 28, 42]);
    }
}
