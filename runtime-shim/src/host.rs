//! Facts about the host the hardening needs, read once from host paths (never from a
//! container's rootfs): AppArmor, GPU device majors, and the driver's /proc entries (for
//! masking); and the runtime's own (the host's) namespaces, read only when a spec names
//! a namespace path to join.

use crate::harden::apparmor::AppArmorHost;
use crate::harden::namespaces::proc_name;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// What the hardening knows about the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    pub apparmor: AppArmorHost,
    /// Majors of the "nvidia*" character devices in /proc/devices, read the first time
    /// a check needs them (a spec with device nodes or device cgroup rules of its own;
    /// most have neither): the kernel formats every driver's line on each read of that
    /// file, 0.07-0.09 ms of a container start.
    gpu_majors: std::cell::OnceCell<Vec<i64>>,
    /// Entries of `<nvidia_proc_root>/gpus/`: name (PCI bus id) and device minor, when
    /// the `information` file says.
    pub nvidia_gpus: Vec<(String, Option<i64>)>,
    /// Files below `<nvidia_proc_root>/capabilities/`, relative ("gpu0/mig/gi1/access").
    pub nvidia_capabilities: Vec<String>,
}

impl HostFacts {
    /// Read the facts from this host.
    pub fn gather(nvidia_proc_root: &Path) -> Self {
        Self {
            apparmor: apparmor_host(),
            gpu_majors: std::cell::OnceCell::new(),
            nvidia_gpus: nvidia_gpus(&nvidia_proc_root.join("gpus")),
            nvidia_capabilities: nvidia_capabilities(&nvidia_proc_root.join("capabilities")),
        }
    }

    /// The majors of the host's "nvidia*" character devices (/proc/devices, read once).
    pub fn gpu_majors(&self) -> &[i64] {
        self.gpu_majors.get_or_init(|| {
            read_proc("/proc/devices")
                .map(|t| nvidia_majors(&t))
                .unwrap_or_default()
        })
    }

    /// These facts with the GPU majors given rather than read (tests).
    pub fn with_gpu_majors(self, majors: Vec<i64>) -> Self {
        Self {
            gpu_majors: std::cell::OnceCell::from(majors),
            ..self
        }
    }

    /// These facts with AppArmor's state given rather than read (tests).
    pub fn with_apparmor(self, apparmor: AppArmorHost) -> Self {
        Self { apparmor, ..self }
    }
}

/// Whether (dev, ino) is the host's namespace of type `ty` (an OCI type): the runtime's
/// own, which containerd, CRI-O and podman start in the host's namespaces. Read when a
/// spec names a namespace path, not on every start (most specs name none). `Err` when
/// the type is unknown or the runtime's own namespace cannot be read: the caller refuses.
pub fn is_host_namespace(ty: &str, dev: u64, ino: u64) -> std::io::Result<bool> {
    let name = proc_name(ty).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("unknown namespace type {ty:?}"),
        )
    })?;
    let own = format!("/proc/self/ns/{name}");
    let m = std::fs::metadata(&own)
        .map_err(|e| std::io::Error::new(e.kind(), format!("the host's own {own}: {e}")))?;
    Ok((m.dev(), m.ino()) == (dev, ino))
}

/// A /proc file (its size shows as 0) read with a page-sized buffer: the kernel makes
/// the whole text again for each read, and `read_to_string` starts with 32 bytes.
fn read_proc(path: &str) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::with_capacity(8192);
    std::fs::File::open(path)?.read_to_string(&mut text)?;
    Ok(text)
}

fn apparmor_host() -> AppArmorHost {
    let enabled = std::fs::read_to_string("/sys/module/apparmor/parameters/enabled")
        .is_ok_and(|s| s.trim() == "Y");
    let loaded = std::fs::read_to_string("/sys/kernel/security/apparmor/profiles")
        .ok()
        .map(|t| {
            t.lines()
                .filter_map(|l| l.rsplit_once(" (").map(|(n, _)| n.to_string()))
                .collect()
        });
    AppArmorHost { enabled, loaded }
}

/// The majors of "nvidia*" character devices in /proc/devices text.
pub fn nvidia_majors(proc_devices: &str) -> Vec<i64> {
    let mut in_char = false;
    let mut out = Vec::new();
    for line in proc_devices.lines() {
        let line = line.trim();
        if line.starts_with("Character devices") {
            in_char = true;
            continue;
        }
        if line.starts_with("Block devices") {
            in_char = false;
            continue;
        }
        if !in_char {
            continue;
        }
        if let Some((major, name)) = line.split_once(char::is_whitespace)
            && name.trim().starts_with("nvidia")
            && let Ok(m) = major.parse()
        {
            out.push(m);
        }
    }
    out
}

/// The GPU entries of a driver `gpus/` directory.
pub fn nvidia_gpus(dir: &Path) -> Vec<(String, Option<i64>)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Option<i64>)> = rd
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let minor = std::fs::read_to_string(e.path().join("information"))
                .ok()
                .and_then(|t| {
                    t.lines().find_map(|l| {
                        l.strip_prefix("Device Minor:")
                            .and_then(|v| v.trim().parse().ok())
                    })
                });
            (name, minor)
        })
        .collect();
    out.sort();
    out
}

/// Every file below a driver `capabilities/` directory, relative, at most 6 levels deep.
pub fn nvidia_capabilities(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, rel: &str, depth: usize, out: &mut Vec<String>) {
        if depth > 6 {
            return;
        }
        let Ok(rd) = std::fs::read_dir(base.join(rel)) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let r = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            match e.file_type() {
                Ok(t) if t.is_dir() => walk(base, &r, depth + 1, out),
                Ok(_) => out.push(r),
                Err(_) => {}
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, "", 0, &mut out);
    out.sort();
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn majors_from_proc_devices() {
        let t = "Character devices:\n  1 mem\n195 nvidia-frontend\n 508 nvidia-uvm\n 235 nvidia-caps\n\nBlock devices:\n  8 sd\n 9 nvidia-fake-block\n";
        assert_eq!(nvidia_majors(t), vec![195, 508, 235]);
    }

    #[test]
    fn gpu_majors_are_read_when_first_asked_and_can_be_given() {
        let f = HostFacts::gather(Path::new("/nonexistent"));
        assert!(f.gpu_majors.get().is_none(), "not read at gather");
        let text = read_proc("/proc/devices").unwrap();
        assert_eq!(f.gpu_majors(), nvidia_majors(&text));
        assert!(f.gpu_majors.get().is_some());
        let given = HostFacts::gather(Path::new("/nonexistent")).with_gpu_majors(vec![508]);
        assert_eq!(given.gpu_majors(), [508]);
    }

    #[test]
    fn driver_proc_tree() {
        let d = tempfile::tempdir().unwrap();
        for (bus, minor) in [("0000:3b:00.0", 0), ("0000:5e:00.0", 1)] {
            std::fs::create_dir_all(d.path().join("gpus").join(bus)).unwrap();
            std::fs::write(
                d.path().join("gpus").join(bus).join("information"),
                format!("Model: H100\nDevice Minor: {minor}\n"),
            )
            .unwrap();
        }
        std::fs::create_dir_all(d.path().join("gpus/0000:86:00.0")).unwrap();
        std::fs::create_dir_all(d.path().join("capabilities/gpu0/mig/gi1/ci0")).unwrap();
        std::fs::create_dir_all(d.path().join("capabilities/mig")).unwrap();
        std::fs::write(d.path().join("capabilities/mig/config"), "").unwrap();
        std::fs::write(d.path().join("capabilities/gpu0/mig/gi1/access"), "").unwrap();
        std::fs::write(d.path().join("capabilities/gpu0/mig/gi1/ci0/access"), "").unwrap();
        let f = HostFacts::gather(d.path());
        assert_eq!(
            f.nvidia_gpus,
            vec![
                ("0000:3b:00.0".to_string(), Some(0)),
                ("0000:5e:00.0".to_string(), Some(1)),
                ("0000:86:00.0".to_string(), None)
            ]
        );
        assert_eq!(
            f.nvidia_capabilities,
            [
                "gpu0/mig/gi1/access",
                "gpu0/mig/gi1/ci0/access",
                "mig/config"
            ]
        );
    }

    #[test]
    fn the_runtimes_own_namespaces_are_the_hosts_and_others_are_not() {
        let own = std::fs::metadata("/proc/self/ns/net").unwrap();
        assert!(is_host_namespace("network", own.dev(), own.ino()).unwrap());
        // The same inode under another type, and another namespace's inode, are not.
        assert!(!is_host_namespace("ipc", own.dev(), own.ino()).unwrap());
        let ipc = std::fs::metadata("/proc/self/ns/ipc").unwrap();
        assert!(!is_host_namespace("network", ipc.dev(), ipc.ino()).unwrap());
        let err = is_host_namespace("no-such-type", own.dev(), own.ino()).unwrap_err();
        assert!(err.to_string().contains("no-such-type"), "{err}");
    }
}
