//! CDI (Container Device Interface) specs: the types, the schema rules a runtime
//! enforces when it loads one, and the NVIDIA Container Toolkit's spec
//! (`nvidia-ctk cdi generate`), where the driver's files are listed. tesserad writes
//! a spec per lease; tessera-runtime reads the driver's files from NVIDIA's spec.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The CDI version the specs declare: the oldest that has everything they use
/// (device nodes with host paths, mounts, env: 0.5.0). A reader takes every version up
/// to its own, and older readers refuse newer specs: Debian 12's podman 4.3 reads
/// 0.5.0 at most.
pub const CDI_VERSION: &str = "0.5.0";

#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a CDI spec: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid CDI spec: {0}")]
    Invalid(String),
    /// A spec anyone but root (or this process's user) could have written: its
    /// mounts would go into every GPU container.
    #[error("{path}: not trusted: {why}")]
    Untrusted { path: PathBuf, why: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    pub path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    #[serde(default)]
    pub devices: Vec<Device>,
    #[serde(default)]
    pub container_edits: ContainerEdits,
}

/// `[A-Za-z0-9]([A-Za-z0-9<extra>]*[A-Za-z0-9])?`
fn name_ok(s: &str, extra: &[u8]) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || extra.contains(c))
}

/// The CDI spec rules a runtime enforces when it loads a spec: a version it knows,
/// `vendor/class` kind, device names, absolute container paths, `KEY=VALUE` env.
pub fn validate(spec: &Spec) -> Result<(), CdiError> {
    let bad = |m: String| Err(CdiError::Invalid(m));
    let v: Vec<&str> = spec.cdi_version.split('.').collect();
    if v.len() != 3
        || v.iter()
            .any(|p| p.is_empty() || !p.bytes().all(|c| c.is_ascii_digit()))
    {
        return bad(format!(
            "cdiVersion {:?} is not MAJOR.MINOR.PATCH",
            spec.cdi_version
        ));
    }
    let Some((vendor, class)) = spec.kind.split_once('/') else {
        return bad(format!("kind {:?} is not vendor/class", spec.kind));
    };
    if !name_ok(vendor, b".-") || !name_ok(class, b"_.-") {
        return bad(format!("kind {:?} is not vendor/class", spec.kind));
    }
    if spec.devices.is_empty() {
        return bad("a spec needs at least one device".into());
    }
    let mut edits = vec![&spec.container_edits];
    for d in &spec.devices {
        if !name_ok(&d.name, b"_.:-") {
            return bad(format!("device name {:?}", d.name));
        }
        if spec.devices.iter().filter(|o| o.name == d.name).count() > 1 {
            return bad(format!("device {:?} twice", d.name));
        }
        edits.push(&d.container_edits);
    }
    for e in edits {
        for n in &e.device_nodes {
            if !n.path.starts_with('/') {
                return bad(format!("device node path {:?} is not absolute", n.path));
            }
        }
        for m in &e.mounts {
            if !m.container_path.starts_with('/') || !m.host_path.starts_with('/') {
                return bad(format!(
                    "mount {} -> {} needs absolute paths",
                    m.host_path, m.container_path
                ));
            }
        }
        for kv in &e.env {
            if kv.split_once('=').is_none_or(|(k, _)| k.is_empty()) {
                return bad(format!("env entry {kv:?} is not KEY=VALUE"));
            }
        }
    }
    Ok(())
}

/// The driver's files as the NVIDIA Container Toolkit describes them.
#[derive(Debug, Clone)]
pub struct NvidiaCdi {
    pub path: PathBuf,
    /// Its spec-wide mounts (libraries, binaries, IPC sockets).
    pub mounts: Vec<Mount>,
}

/// Where `nvidia-ctk cdi generate` puts its spec, in the order CDI reads them.
pub fn nvidia_spec_paths() -> Vec<PathBuf> {
    let mut out = vec![
        PathBuf::from("/etc/cdi/nvidia.yaml"),
        PathBuf::from("/etc/cdi/nvidia.json"),
    ];
    for dir in ["/var/run/cdi", "/etc/cdi"] {
        if let Ok(rd) = std::fs::read_dir(dir) {
            let mut names: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                        n.starts_with("nvidia") && (n.ends_with(".yaml") || n.ends_with(".json"))
                    })
                })
                .collect();
            names.sort();
            out.extend(names);
        }
    }
    out
}

/// Parse a spec file: JSON, or YAML (which JSON is a subset of).
pub fn parse_spec(path: &Path, text: &str) -> Result<Spec, CdiError> {
    let spec: Spec = serde_yaml_ng::from_str(text).map_err(|e| CdiError::Parse {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    validate(&spec).map_err(|e| CdiError::Parse {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    Ok(spec)
}

/// A regular file (not a link) owned by root or by this process's user, that
/// neither group nor others may write.
fn trusted(path: &Path, m: &std::fs::Metadata) -> Result<(), CdiError> {
    use std::os::unix::fs::MetadataExt;
    let why = if !m.file_type().is_file() {
        Some("not a regular file".to_string())
    } else if m.uid() != 0 && m.uid() != nix_euid() {
        Some(format!("owned by uid {}, not root", m.uid()))
    } else if m.mode() & 0o022 != 0 {
        Some(format!(
            "mode {:o} lets group or others write it",
            m.mode() & 0o777
        ))
    } else {
        None
    };
    match why {
        Some(why) => Err(CdiError::Untrusted {
            path: path.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}

fn nix_euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

impl NvidiaCdi {
    /// The first NVIDIA spec of `candidates` that exists, with kind `nvidia.com/gpu`.
    /// A spec that exists and does not parse is an error (not silently the fixed list).
    pub fn find(candidates: &[PathBuf]) -> Result<Option<NvidiaCdi>, CdiError> {
        for path in candidates {
            match std::fs::symlink_metadata(path) {
                Ok(m) => trusted(path, &m)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(CdiError::Io {
                        path: path.clone(),
                        source,
                    });
                }
            }
            let text = match std::fs::read_to_string(path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(CdiError::Io {
                        path: path.clone(),
                        source,
                    });
                }
            };
            let spec = parse_spec(path, &text)?;
            if spec.kind != "nvidia.com/gpu" {
                continue;
            }
            let mounts = spec
                .container_edits
                .mounts
                .into_iter()
                .filter(|m| m.container_path.starts_with('/') && m.host_path.starts_with('/'))
                .collect();
            return Ok(Some(NvidiaCdi {
                path: path.clone(),
                mounts,
            }));
        }
        Ok(None)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn spec(kind: &str, name: &str) -> Spec {
        Spec {
            cdi_version: CDI_VERSION.into(),
            kind: kind.into(),
            devices: vec![Device {
                name: name.into(),
                container_edits: ContainerEdits {
                    env: vec!["A=b".into()],
                    device_nodes: vec![DeviceNode {
                        path: "/dev/nvidia0".into(),
                        ..Default::default()
                    }],
                    mounts: vec![],
                },
            }],
            container_edits: ContainerEdits::default(),
        }
    }

    #[test]
    fn the_schema_rules_hold() {
        assert!(validate(&spec("tessera.io/lease", "l-01abc")).is_ok());
        for (kind, name) in [
            ("tessera.io", "x"),
            ("tessera.io/", "x"),
            ("-bad/lease", "x"),
            ("tessera.io/lease", ""),
            ("tessera.io/lease", "a/b"),
            ("tessera.io/lease", "x-"),
        ] {
            assert!(validate(&spec(kind, name)).is_err(), "{kind} {name}");
        }
        let mut s = spec("tessera.io/lease", "x");
        s.cdi_version = "0.6".into();
        assert!(validate(&s).is_err());
        let mut s = spec("tessera.io/lease", "x");
        s.devices[0].container_edits.env = vec!["=x".into()];
        assert!(validate(&s).is_err());
        let mut s = spec("tessera.io/lease", "x");
        s.devices[0].container_edits.device_nodes[0].path = "dev/nvidia0".into();
        assert!(validate(&s).is_err());
    }

    const NVIDIA_YAML: &str = r#"---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  deviceNodes:
  - path: /dev/nvidiactl
  mounts:
  - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05
    containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05
    options:
    - ro
    - nosuid
    - nodev
    - bind
  - hostPath: /usr/bin/nvidia-smi
    containerPath: /usr/bin/nvidia-smi
    options: [ro, nosuid, nodev, bind]
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-ctk
    args: [nvidia-ctk, hook, update-ldcache]
"#;

    #[test]
    fn the_driver_files_come_from_the_toolkit_spec_without_its_hooks() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("nvidia.yaml");
        std::fs::write(&yaml, NVIDIA_YAML).unwrap();
        let n = NvidiaCdi::find(&[dir.path().join("absent.yaml"), yaml.clone()])
            .unwrap()
            .unwrap();
        assert_eq!(n.path, yaml);
        let paths: Vec<&str> = n.mounts.iter().map(|m| m.container_path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05",
                "/usr/bin/nvidia-smi"
            ]
        );
        // Writable by others: not trusted.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&yaml, std::fs::Permissions::from_mode(0o666)).unwrap();
            let e = NvidiaCdi::find(std::slice::from_ref(&yaml)).unwrap_err();
            assert!(e.to_string().contains("not trusted"), "{e}");
            std::fs::set_permissions(&yaml, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        // A spec that exists but is not one is an error, not the fixed list.
        std::fs::write(&yaml, "cdiVersion: [").unwrap();
        let e = NvidiaCdi::find(std::slice::from_ref(&yaml)).unwrap_err();
        assert!(e.to_string().contains("nvidia.yaml"), "{e}");
        assert!(
            NvidiaCdi::find(&[dir.path().join("none.yaml")])
                .unwrap()
                .is_none()
        );
    }
}
