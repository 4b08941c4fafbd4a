//! Which cgroup a lease's container may be stopped through. A container runs in the
//! cgroup its caller gave (kubelet's pod cgroup, podman's, or the lease's own
//! `tessera/<lease id>/` parent when the spec named none), recorded in its binding.
//! Only a container's *own* cgroup may be touched: a clean path whose last component
//! carries the container's id (`/kubepods/burstable/pod<uid>/<id>`,
//! `/libpod_parent/libpod-<id>`, systemd's `<slice>:<prefix>:<id>`), never a shared
//! parent such as `/system.slice`. A binding naming any other path is refused; the
//! stopping itself is the host's ([`crate::host::HostOps::stop_cgroup`]).

use std::time::Duration;

use crate::host::{HostError, HostOps, Stopped};
use crate::model::ContainerBinding;

#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    #[error(
        "container {container}: cgroup path {path:?} is not the container's own cgroup ({why}); refusing to touch it"
    )]
    ForeignCgroup {
        container: String,
        path: String,
        why: &'static str,
    },
    #[error(transparent)]
    Host(#[from] HostError),
}

/// Stop one container through its own cgroup (blocking).
pub fn stop_container(
    host: &dyn HostOps,
    b: &ContainerBinding,
    grace: Duration,
) -> Result<Stopped, EnforceError> {
    let rel = cgroup_of(b)?;
    Ok(host.stop_cgroup(&b.id, &rel, grace)?)
}

/// The cgroup parent the runtime uses for a lease's containers whose spec names
/// no cgroup.
pub fn lease_parent(lease_id: &str) -> String {
    format!("tessera/{lease_id}")
}

/// systemd's slice name to its path, as runc's systemd driver expands it:
/// `a-b-c.slice` -> `a.slice/a-b.slice/a-b-c.slice`.
pub fn expand_slice(slice: &str) -> Option<String> {
    let name = slice.strip_suffix(".slice")?;
    if name.is_empty() || slice.contains('/') {
        return None;
    }
    if name == "-" {
        return Some(String::new());
    }
    let mut path = Vec::new();
    let mut prefix = String::new();
    for part in name.split('-') {
        if part.is_empty() {
            return None;
        }
        path.push(format!("{prefix}{part}.slice"));
        prefix.push_str(part);
        prefix.push('-');
    }
    Some(path.join("/"))
}

/// The cgroup of a binding, relative to the hierarchy roots, checked to be the
/// container's own: cgroupfs paths as given, systemd's `slice:prefix:name` as runc's
/// systemd driver lays it out (`<expanded slice>/<prefix>-<name>.scope`).
pub fn cgroup_of(b: &ContainerBinding) -> Result<String, EnforceError> {
    let foreign = |why| EnforceError::ForeignCgroup {
        container: b.id.clone(),
        path: b.cgroup_path.clone(),
        why,
    };
    let path = b.cgroup_path.as_str();
    if b.id.is_empty() || b.id.contains('/') || b.id == "." || b.id == ".." {
        return Err(foreign("the container id is not a cgroup name"));
    }
    if path.contains('\0') || path.contains("..") {
        return Err(foreign("not a clean path"));
    }
    let (rel, leaf) = if path.contains(':') {
        let parts: Vec<&str> = path.split(':').collect();
        let [slice, prefix, name] = parts[..] else {
            return Err(foreign("a systemd cgroup is slice:prefix:name"));
        };
        if name.is_empty() || name.contains('/') || prefix.contains('/') {
            return Err(foreign("a systemd cgroup is slice:prefix:name"));
        }
        if name.ends_with(".slice") {
            return Err(foreign("a slice is shared, not a container's own cgroup"));
        }
        let slice = if slice.is_empty() {
            "system.slice"
        } else {
            slice
        };
        let expanded = expand_slice(slice).ok_or_else(|| foreign("not a valid slice name"))?;
        let unit = if prefix.is_empty() {
            format!("{name}.scope")
        } else {
            format!("{prefix}-{name}.scope")
        };
        let rel = if expanded.is_empty() {
            unit
        } else {
            format!("{expanded}/{unit}")
        };
        (rel, name.to_string())
    } else {
        let rel = path.trim_start_matches('/');
        let parts: Vec<&str> = rel.split('/').collect();
        if rel.is_empty() || parts.iter().any(|c| c.is_empty() || *c == ".") {
            return Err(foreign("not a clean path"));
        }
        if parts.len() < 2 {
            return Err(foreign("a top-level cgroup is shared"));
        }
        let leaf = parts.last().copied().unwrap_or_default().to_string();
        (rel.to_string(), leaf)
    };
    if !leaf.contains(&b.id) {
        return Err(foreign(
            "its last component does not carry the container id",
        ));
    }
    Ok(rel)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn binding(id: &str, path: &str) -> ContainerBinding {
        ContainerBinding {
            id: id.into(),
            cgroup_path: path.into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_containers_own_cgroup_is_accepted_where_its_caller_put_it() {
        for (id, path, want) in [
            ("c1", "/tessera/l-1/c1", "tessera/l-1/c1"),
            // containerd's cgroupfs driver: inside the pod's cgroup.
            (
                "abc123",
                "/kubepods/burstable/pod0f1e/abc123",
                "kubepods/burstable/pod0f1e/abc123",
            ),
            // podman's cgroupfs driver.
            (
                "abc123",
                "/libpod_parent/libpod-abc123",
                "libpod_parent/libpod-abc123",
            ),
            // kubelet's systemd driver, as runc's systemd driver lays it out.
            (
                "abc123",
                "kubepods-burstable-pod0f1e.slice:cri-containerd:abc123",
                "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f1e.slice/cri-containerd-abc123.scope",
            ),
            (
                "abc123",
                "machine.slice:libpod:abc123",
                "machine.slice/libpod-abc123.scope",
            ),
            ("abc123", ":runc:abc123", "system.slice/runc-abc123.scope"),
        ] {
            assert_eq!(cgroup_of(&binding(id, path)).unwrap(), want, "{path}");
        }
    }

    #[test]
    fn shared_or_unclean_cgroups_are_refused() {
        for (id, bad) in [
            ("c1", ""),
            ("c1", "/"),
            ("c1", "/system.slice"),
            ("c1", "/kubepods/burstable/pod0f1e"),
            ("c1", "/tessera/l-1/../../system.slice/c1"),
            ("c1", "/c1"),
            ("c1", "/tessera/l-1//c1"),
            ("c1", "/tessera/./c1"),
            ("c1", "system.slice:tessera"),
            ("c1", "system.slice:tessera:c1:x"),
            ("c1", "system.slice:tessera:other"),
            ("c1", "kubepods.slice:x:c1.slice"),
            ("c1", "kubepods--x.slice:x:c1"),
            ("c1", "a/b.slice:x:c1"),
            ("", "/tessera/l-1/x"),
            ("..", "/tessera/l-1/.."),
        ] {
            assert!(
                cgroup_of(&binding(id, bad)).is_err(),
                "{id} {bad:?} accepted"
            );
        }
    }

    #[test]
    fn slices_expand_like_runc() {
        assert_eq!(expand_slice("system.slice").unwrap(), "system.slice");
        assert_eq!(
            expand_slice("a-b-c.slice").unwrap(),
            "a.slice/a-b.slice/a-b-c.slice"
        );
        assert_eq!(expand_slice("-.slice").unwrap(), "");
        assert!(expand_slice("a").is_none());
        assert!(expand_slice(".slice").is_none());
        assert!(expand_slice("a--b.slice").is_none());
    }
}
