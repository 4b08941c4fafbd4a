//! Device names in this node's pool, and what each names.
//!
//! A device name is a DNS label (lowercase alphanumerics and `-`, at most 63):
//!
//! * `gpu-<i>`: GPU `i` whole;
//! * `gpu-<i>-mig-<start>-<profile>`: the MIG profile at placement `start` on GPU
//!   `i`, the profile's `.` written `-` and its `+` written `-` too (`1g.10gb+me` is
//!   `1g-10gb-me`): the first `-` of the profile part is its `.`, any later ones `+`;
//! * `gpu-<i>-mps-<class>-<slot>`: slot `slot` of MPS class `class` on GPU `i`
//!   (`class` a DNS label; the slot is after its last `-`).
//!
//! The name says where: the scheduler's choice of device is the lease's placement.

use std::fmt;

/// What a device name stands for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceName {
    WholeGpu {
        gpu: u32,
    },
    Mig {
        gpu: u32,
        /// NVML's profile name, e.g. `1g.10gb` or `1g.10gb+me`.
        profile: String,
        /// The placement's start slice.
        start: u32,
    },
    Mps {
        gpu: u32,
        /// The MPS class (`[[kubernetes.mps_classes]]` name).
        class: String,
        slot: u32,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceNameError {
    #[error("device name {0:?} is not one of gpu.tessera.io's")]
    Unknown(String),
    #[error("device name {name:?}: {why}")]
    Invalid { name: String, why: &'static str },
}

/// Most characters in a device name (a DNS label).
pub const MAX_NAME: usize = 63;

impl DeviceName {
    /// The GPU index the device is on.
    pub fn gpu(&self) -> u32 {
        match self {
            DeviceName::WholeGpu { gpu }
            | DeviceName::Mig { gpu, .. }
            | DeviceName::Mps { gpu, .. } => *gpu,
        }
    }

    /// Reads a device name; the inverse of `Display`.
    pub fn parse(name: &str) -> Result<DeviceName, DeviceNameError> {
        let invalid = |why| DeviceNameError::Invalid {
            name: name.to_string(),
            why,
        };
        if name.len() > MAX_NAME
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(invalid("not a DNS label"));
        }
        let rest = name
            .strip_prefix("gpu-")
            .ok_or_else(|| DeviceNameError::Unknown(name.to_string()))?;
        let (gpu, rest) = match rest.split_once('-') {
            Some((g, r)) => (g, Some(r)),
            None => (rest, None),
        };
        let gpu = number(gpu).ok_or_else(|| invalid("bad GPU index"))?;
        let Some(rest) = rest else {
            return Ok(DeviceName::WholeGpu { gpu });
        };
        if let Some(mig) = rest.strip_prefix("mig-") {
            let (start, slug) = mig
                .split_once('-')
                .ok_or_else(|| invalid("MIG device without a profile"))?;
            let start = number(start).ok_or_else(|| invalid("bad MIG placement start"))?;
            let profile = unslug(slug).ok_or_else(|| invalid("bad MIG profile"))?;
            return Ok(DeviceName::Mig {
                gpu,
                profile,
                start,
            });
        }
        if let Some(mps) = rest.strip_prefix("mps-") {
            let (class, slot) = mps
                .rsplit_once('-')
                .ok_or_else(|| invalid("MPS device without a slot"))?;
            let slot = number(slot).ok_or_else(|| invalid("bad MPS slot"))?;
            if class.is_empty() || class.starts_with('-') || class.ends_with('-') {
                return Err(invalid("bad MPS class"));
            }
            return Ok(DeviceName::Mps {
                gpu,
                class: class.to_string(),
                slot,
            });
        }
        Err(DeviceNameError::Unknown(name.to_string()))
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceName::WholeGpu { gpu } => write!(f, "gpu-{gpu}"),
            DeviceName::Mig {
                gpu,
                profile,
                start,
            } => write!(f, "gpu-{gpu}-mig-{start}-{}", slug(profile)),
            DeviceName::Mps { gpu, class, slot } => write!(f, "gpu-{gpu}-mps-{class}-{slot}"),
        }
    }
}

/// A decimal without sign or leading zeros (so each number has one spelling).
fn number(s: &str) -> Option<u32> {
    if s.is_empty() || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `1g.10gb+me` -> `1g-10gb-me`.
pub fn slug(profile: &str) -> String {
    profile.replace(['.', '+'], "-")
}

/// `1g-10gb-me` -> `1g.10gb+me`; None when not of that shape.
fn unslug(slug: &str) -> Option<String> {
    let mut parts = slug.split('-');
    let first = parts.next().filter(|p| !p.is_empty())?;
    let second = parts.next().filter(|p| !p.is_empty())?;
    let mut out = format!("{first}.{second}");
    for p in parts {
        if p.is_empty() {
            return None;
        }
        out.push('+');
        out.push_str(p);
    }
    Some(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn round(name: &str) -> DeviceName {
        let d = DeviceName::parse(name).unwrap();
        assert_eq!(d.to_string(), name, "{d:?}");
        d
    }

    #[test]
    fn names_read_back_as_written() {
        assert_eq!(round("gpu-0"), DeviceName::WholeGpu { gpu: 0 });
        assert_eq!(
            round("gpu-3-mig-4-1g-10gb"),
            DeviceName::Mig {
                gpu: 3,
                profile: "1g.10gb".into(),
                start: 4
            }
        );
        assert_eq!(
            round("gpu-1-mig-6-1g-10gb-me"),
            DeviceName::Mig {
                gpu: 1,
                profile: "1g.10gb+me".into(),
                start: 6
            }
        );
        assert_eq!(
            round("gpu-12-mps-small-7"),
            DeviceName::Mps {
                gpu: 12,
                class: "small".into(),
                slot: 7
            }
        );
        assert_eq!(
            round("gpu-0-mps-big-share-0"),
            DeviceName::Mps {
                gpu: 0,
                class: "big-share".into(),
                slot: 0
            }
        );
    }

    #[test]
    fn foreign_and_malformed_names_are_refused() {
        for bad in [
            "gpu-01",
            "gpu-",
            "gpu-x",
            "gpu-0-mig-1",
            "gpu-0-mig-01-1g-10gb",
            "gpu-0-mig-0-1g",
            "gpu-0-mig-0-1g--10gb",
            "gpu-0-mps-small",
            "gpu-0-mps--1",
            "GPU-0",
            "gpu-0-mig-0-1g.10gb",
        ] {
            assert!(
                matches!(
                    DeviceName::parse(bad),
                    Err(DeviceNameError::Invalid { .. } | DeviceNameError::Unknown(_))
                ),
                "{bad} was read as {:?}",
                DeviceName::parse(bad)
            );
        }
        assert_eq!(
            DeviceName::parse("nvidia-0"),
            Err(DeviceNameError::Unknown("nvidia-0".into()))
        );
        assert_eq!(
            DeviceName::parse("gpu-0-vgpu-1"),
            Err(DeviceNameError::Unknown("gpu-0-vgpu-1".into()))
        );
        let long = format!("gpu-0-mps-{}-1", "a".repeat(60));
        assert!(DeviceName::parse(&long).is_err());
    }
}
