//! cgroups: a container stays in the cgroup its caller gave (kubelet's pod cgroup,
//! podman's; checked in allowlist.rs to be the container's own); a spec that names
//! none goes under the lease's parent. A pids limit is always set, and the tenant may
//! not write device, pids or cgroup-core files through `resources.unified`.

use super::base::{Context, Findings};
use serde_json::{Value, json};

/// Unified (cgroup v2) key prefixes a tenant spec may not set.
pub const UNIFIED_FORBIDDEN: &[&str] = &["devices.", "pids.", "cgroup.", "rdma."];

/// The slice a lease's container goes under with `--systemd-cgroup` when its spec
/// names no cgroup.
pub const SYSTEMD_SLICE: &str = "tessera.slice";

/// Why a lease's cgroup parent cannot hold its container.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParentError {
    #[error("the lease's cgroup parent {0:?} is not a clean path")]
    NotClean(String),
    #[error("the lease's cgroup parent is the root cgroup")]
    Root,
}

/// The cgroupsPath for a container whose spec names none: under the lease's `parent`
/// (cgroupfs), or `tessera.slice:tessera:<id>` (systemd: the lease's containers
/// are found through their bindings, not through a tree).
pub fn cgroups_path(parent: &str, id: &str, systemd: bool) -> Result<String, ParentError> {
    if systemd {
        return Ok(format!("{SYSTEMD_SLICE}:tessera:{id}"));
    }
    if parent.split('/').any(|c| c == ".." || c == ".") || parent.contains('\0') {
        return Err(ParentError::NotClean(parent.to_string()));
    }
    let p = super::mounts::normalize(parent);
    if p == "/" {
        return Err(ParentError::Root);
    }
    Ok(format!("{p}/{id}"))
}

pub fn apply(spec: &mut Value, ctx: &Context, f: &mut Findings) {
    let id = ctx.container_id;
    if id.is_empty() || id.contains('/') || id == "." || id == ".." {
        f.refuse(format!("container id {id:?} is not valid"));
    }
    if let Some(unified) = spec
        .pointer("/linux/resources/unified")
        .and_then(Value::as_object)
    {
        for k in unified.keys() {
            if UNIFIED_FORBIDDEN.iter().any(|p| k.starts_with(p)) {
                f.refuse(format!(
                    "the spec sets the cgroup file {k} (linux.resources.unified)"
                ));
            }
        }
    }
    if let Some(path) = spec.pointer("/linux/cgroupsPath").and_then(Value::as_str)
        && path.split(['/', ':']).any(|c| c == "..")
    {
        f.refuse(format!("linux.cgroupsPath {path:?} climbs out with '..'"));
    }
    let mut limit = ctx.policy().pids_limit;
    if let Some(asked) = spec
        .pointer("/linux/resources/pids/limit")
        .and_then(Value::as_i64)
        && asked > 0
    {
        limit = limit.min(asked);
    }
    if let Some(lease) = ctx.lease {
        if let Ok(l) = i64::try_from(lease.pids_limit)
            && l > 0
        {
            limit = limit.min(l);
        }
        let given = spec
            .pointer("/linux/cgroupsPath")
            .and_then(Value::as_str)
            .is_some_and(|p| !p.is_empty());
        if given {
            // Kept where the caller put it (allowlist.rs checked it is the
            // container's own); the daemon finds it through the binding.
            f.note("the container stays in the cgroup its caller gave");
        } else if lease.cgroup_parent.is_empty() {
            f.refuse("the lease has no cgroup parent");
        } else {
            match cgroups_path(&lease.cgroup_parent, id, ctx.systemd_cgroup) {
                Ok(p) => {
                    if let Some(linux) = super::base::obj_entry(spec, "linux") {
                        linux.insert("cgroupsPath".to_string(), json!(p));
                    }
                }
                Err(e) => f.refuse(e.to_string()),
            }
        }
    }
    if let Some(linux) = spec.get_mut("linux")
        && let Some(res) = super::base::obj_entry(linux, "resources")
        && let Some(pids) = res
            .entry("pids")
            .or_insert_with(|| json!({}))
            .as_object_mut()
    {
        pids.insert("limit".to_string(), json!(limit));
    }
}
