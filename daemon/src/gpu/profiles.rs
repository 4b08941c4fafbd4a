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

use super::{CiProfile, GiProfile, Placement};

const MIB: u64 = 1024 * 1024;

/// Memory slices per GPU (placement starts and sizes are in these units).
pub const MEMORY_SLICES: u32 = 8;
/// Compute slices per GPU.
pub const COMPUTE_SLICES: u32 = 7;

/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE`.
pub const GI_PROFILE_1_SLICE: u32 = 0;
/// `NVML_GPU_INSTANCE_PROFILE_2_SLICE`.
pub const GI_PROFILE_2_SLICE: u32 = 1;
/// `NVML_GPU_INSTANCE_PROFILE_3_SLICE`.
pub const GI_PROFILE_3_SLICE: u32 = 2;
/// `NVML_GPU_INSTANCE_PROFILE_4_SLICE`.
pub const GI_PROFILE_4_SLICE: u32 = 3;
/// `NVML_GPU_INSTANCE_PROFILE_7_SLICE`.
pub const GI_PROFILE_7_SLICE: u32 = 4;
/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1` (1 slice + all media engines, "+me").
pub const GI_PROFILE_1_SLICE_REV1: u32 = 7;
/// `NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2` (1 compute slice, 2 memory slices).
pub const GI_PROFILE_1_SLICE_REV2: u32 = 9;

/// `NVML_COMPUTE_INSTANCE_PROFILE_<N>_SLICE` for N compute slices, per NVML's numbering
/// (1c=0, 2c=1, 3c=2, 4c=3, 7c=4, 8c=5, 6c=6).
pub fn ci_profile_id(slices: u32) -> Option<u32> {
    match slices {
        1 => Some(0),
        2 => Some(1),
        3 => Some(2),
        4 => Some(3),
        7 => Some(4),
        8 => Some(5),
        6 => Some(6),
        _ => None,
    }
}

/// The compute-instance profiles a GI with `gi_slices` compute slices allows, as
/// (CI compute slices, max count), from the reference table.
pub fn ci_layout(gi_slices: u32) -> &'static [(u32, u32)] {
    match gi_slices {
        1 => &[(1, 1)],
        2 => &[(1, 2), (2, 1)],
        3 => &[(1, 3), (2, 1), (3, 1)],
        4 => &[(1, 4), (2, 2), (4, 1)],
        7 => &[(1, 7), (2, 3), (3, 2), (4, 1), (7, 1)],
        _ => &[],
    }
}

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

/// One row of the reference GI table for one model.
struct Row {
    id: u32,
    slices: u32,
    memory_slices: u32,
    /// Short memory label in the profile name ("10gb").
    label: &'static str,
    memory_mib: u64,
    sm_count: u32,
    max_count: u32,
    starts: &'static [u32],
    media_extensions: bool,
}

impl GpuModel {
    pub const ALL: [GpuModel; 4] = [
        GpuModel::A100Sxm40Gb,
        GpuModel::A100Sxm80Gb,
        GpuModel::H100Hbm3_80Gb,
        GpuModel::H200_141Gb,
    ];

    /// The short name used in the daemon config ("h100-80gb").
    pub fn short_name(self) -> &'static str {
        match self {
            GpuModel::A100Sxm40Gb => "a100-40gb",
            GpuModel::A100Sxm80Gb => "a100-80gb",
            GpuModel::H100Hbm3_80Gb => "h100-80gb",
            GpuModel::H200_141Gb => "h200-141gb",
        }
    }

    /// The name NVML reports (`nvmlDeviceGetName`).
    pub fn marketing_name(self) -> &'static str {
        match self {
            GpuModel::A100Sxm40Gb => "NVIDIA A100-SXM4-40GB",
            GpuModel::A100Sxm80Gb => "NVIDIA A100-SXM4-80GB",
            GpuModel::H100Hbm3_80Gb => "NVIDIA H100 80GB HBM3",
            GpuModel::H200_141Gb => "NVIDIA H200",
        }
    }

    /// Parse a short name ("h100-80gb", case-insensitive) or a marketing name.
    pub fn from_name(name: &str) -> Option<GpuModel> {
        let name = name.trim();
        GpuModel::ALL
            .into_iter()
            .find(|m| m.short_name().eq_ignore_ascii_case(name) || m.marketing_name() == name)
    }

    pub fn memory_bytes(self) -> u64 {
        let gib = match self {
            GpuModel::A100Sxm40Gb => 40,
            GpuModel::A100Sxm80Gb | GpuModel::H100Hbm3_80Gb => 80,
            GpuModel::H200_141Gb => 141,
        };
        gib * 1024 * MIB
    }

    pub fn sm_count(self) -> u32 {
        match self {
            GpuModel::A100Sxm40Gb | GpuModel::A100Sxm80Gb => 108,
            GpuModel::H100Hbm3_80Gb | GpuModel::H200_141Gb => 132,
        }
    }

    fn rows(self) -> [Row; 7] {
        // (label, MiB, SMs) per profile id, in table order: 0, 7, 9, 1, 2, 3, 4.
        // Memory in the reference is in GiB with two decimals (nvidia-smi rounds MiB
        // values): 9.62 GiB is 9856 MiB, 19.62 GiB is 20096 MiB.
        let t: [(&'static str, u64, u32); 7] = match self {
            GpuModel::A100Sxm40Gb => [
                ("5gb", 4864, 14),
                ("5gb", 4864, 14),
                ("10gb", 9856, 14),
                ("10gb", 9856, 28),
                ("20gb", 19968, 42),
                ("20gb", 20096, 56),
                ("40gb", 40448, 98),
            ],
            // 1g.20gb and 7g.80gb are marked unconfirmed in the reference; the values
            // are those NVIDIA's MIG user guide lists (19.50 and 78.75 GiB).
            GpuModel::A100Sxm80Gb => [
                ("10gb", 9728, 14),
                ("10gb", 9728, 14),
                ("20gb", 19968, 14),
                ("20gb", 19968, 28),
                ("40gb", 40192, 42),
                ("40gb", 40192, 56),
                ("80gb", 80640, 98),
            ],
            GpuModel::H100Hbm3_80Gb => [
                ("10gb", 9984, 16),
                ("10gb", 9984, 16),
                ("20gb", 20096, 26),
                ("20gb", 20096, 32),
                ("40gb", 40448, 60),
                ("40gb", 40448, 64),
                ("80gb", 81152, 132),
            ],
            // As a real H200 (driver 580.159.04) reports them: 32.5 and 69.75 GiB
            // for the 35gb and 71gb profiles, 140 GiB for the 7g.
            GpuModel::H200_141Gb => [
                ("18gb", 16384, 16),
                ("18gb", 16384, 16),
                ("35gb", 33280, 26),
                ("35gb", 33280, 32),
                ("71gb", 71424, 60),
                ("71gb", 71424, 64),
                ("141gb", 143360, 132),
            ],
        };
        let row = |i: usize,
                   id: u32,
                   slices: u32,
                   memory_slices: u32,
                   max_count: u32,
                   starts: &'static [u32],
                   media_extensions: bool| Row {
            id,
            slices,
            memory_slices,
            label: t[i].0,
            memory_mib: t[i].1,
            sm_count: t[i].2,
            max_count,
            starts,
            media_extensions,
        };
        [
            row(
                0,
                GI_PROFILE_1_SLICE,
                1,
                1,
                7,
                &[0, 1, 2, 3, 4, 5, 6],
                false,
            ),
            row(
                1,
                GI_PROFILE_1_SLICE_REV1,
                1,
                1,
                1,
                &[0, 1, 2, 3, 4, 5, 6],
                true,
            ),
            row(2, GI_PROFILE_1_SLICE_REV2, 1, 2, 4, &[0, 2, 4, 6], false),
            row(3, GI_PROFILE_2_SLICE, 2, 2, 3, &[0, 2, 4], false),
            row(4, GI_PROFILE_3_SLICE, 3, 4, 2, &[0, 4], false),
            row(5, GI_PROFILE_4_SLICE, 4, 4, 1, &[0], false),
            row(6, GI_PROFILE_7_SLICE, 7, 8, 1, &[0], false),
        ]
    }

    /// SM count of the plain n-slice GI profile (what an n-slice CI gets).
    fn sm_of_slices(self, slices: u32) -> u32 {
        let id = match slices {
            1 => GI_PROFILE_1_SLICE,
            2 => GI_PROFILE_2_SLICE,
            3 => GI_PROFILE_3_SLICE,
            4 => GI_PROFILE_4_SLICE,
            7 => GI_PROFILE_7_SLICE,
            _ => return 0,
        };
        self.rows()
            .iter()
            .find(|r| r.id == id)
            .map_or(0, |r| r.sm_count)
    }

    /// The GI profiles of this model, in the reference table's order.
    pub fn gi_profiles(self) -> Vec<GiProfile> {
        self.rows()
            .iter()
            .map(|r| GiProfile {
                id: r.id,
                name: format!(
                    "{}g.{}{}",
                    r.slices,
                    r.label,
                    if r.media_extensions { "+me" } else { "" }
                ),
                slices: r.slices,
                memory_slices: r.memory_slices,
                memory_bytes: r.memory_mib * MIB,
                sm_count: r.sm_count,
                max_count: r.max_count,
                placements: placements_at(r.starts, r.memory_slices),
                ci_profiles: ci_profiles_for(r.slices, r.sm_count, |n| self.sm_of_slices(n)),
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
