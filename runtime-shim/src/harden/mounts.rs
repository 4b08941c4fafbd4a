//! Mounts: refuse bind mounts of sensitive host paths and of GPU nodes, refuse mount
//! types outside the policy and extra procfs/sysfs instances; add the lease's mounts
//! (nosuid,nodev,noexec) and the driver libraries (read-only, from host paths in the
//! runtime config, never from the image). runc performs every mount.

use super::base::{Context, Findings, strings};
use crate::config::DriverLibrary;
use crate::host::HostView;
use crate::lease::LeaseMount;
use crate::policy::Policy;
use serde_json::{Value, json};
use std::path::Path;

/// Lexically normalise an absolute path: collapse `//`, `.` and `..` (never touching the
/// filesystem).
pub fn normalize(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

/// Whether `path` is `base` or below it (both normalised).
pub fn is_under(path: &str, base: &str) -> bool {
    if base == "/" {
        return path == "/";
    }
    path == base || path.starts_with(&format!("{base}/"))
}

/// The host forms of a mount source to check: as written (normalised) and, when it
/// exists on the host, canonical (a host symlink to /proc...). Host paths only: the
/// rootfs is never looked at.
fn host_forms(host: &dyn HostView, source: &str) -> Vec<String> {
    let lexical = normalize(source);
    let mut forms = vec![lexical.clone()];
    if let Ok(c) = host.canonicalize(Path::new(&lexical)) {
        let c = c.to_string_lossy().into_owned();
        if c != lexical {
            forms.push(c);
        }
    }
    forms
}

/// Why a bind-mount source is not allowed, if it is not: a GPU node, inside a sensitive
/// tree, or a protected file or one of its ancestor directories.
pub fn sensitive_hit(host: &dyn HostView, source: &str, policy: &Policy) -> Option<String> {
    for form in host_forms(host, source) {
        if form.starts_with("/dev/nvidia") {
            return Some(format!("GPU device path {form}"));
        }
        for s in &policy.sensitive_host_paths {
            let s = normalize(s);
            if is_under(&form, &s) {
                return Some(format!("under {s}"));
            }
        }
        for p in &policy.protected_host_files {
            let p = normalize(p);
            if is_under(&p, &form) || form == "/" {
                return Some(format!("exposes {p}"));
            }
        }
    }
    None
}

/// Why a lease mount source is not acceptable: a shared directory (one MPS pipe dir per
/// lease, never the host-wide one or /dev/shm) or a protected file's ancestor.
fn lease_mount_problem(host: &dyn HostView, source: &str, policy: &Policy) -> Option<String> {
    for form in host_forms(host, source) {
        for shared in ["/tmp/nvidia-mps", "/dev", "/proc", "/sys"] {
            if is_under(&form, shared) {
                return Some(format!("under {shared}"));
            }
        }
        if form == "/tmp" || form == "/" {
            return Some(format!("{form} is shared by every tenant"));
        }
        for p in &policy.protected_host_files {
            let p = normalize(p);
            if is_under(&p, &form) {
                return Some(format!("exposes {p}"));
            }
        }
    }
    None
}

fn is_bind(ty: &str, options: &[String]) -> bool {
    ty == "bind" || options.iter().any(|o| o == "bind" || o == "rbind")
}

/// The driver's files for a GPU container: from the NVIDIA Container Toolkit's CDI
/// spec when the host has one (its mounts only: never its hooks, device nodes or
/// env; the lease gives the devices), else the configured `driver_libraries`. A spec
/// that exists but cannot be read, parsed or trusted refuses the container.
pub(crate) fn driver_files(
    config: &crate::config::RuntimeConfig,
    f: &mut Findings,
) -> Vec<DriverLibrary> {
    let candidates = match &config.nvidia_cdi_specs {
        Some(list) => list.clone(),
        None => tessera_common::cdi::nvidia_spec_paths(),
    };
    match tessera_common::cdi::NvidiaCdi::find(&candidates) {
        Ok(Some(n)) => {
            f.note(format!(
                "driver files from the CDI spec {}",
                n.path.display()
            ));
            n.mounts
                .into_iter()
                .map(|m| DriverLibrary {
                    source: m.host_path.into(),
                    destination: Some(m.container_path.into()),
                    optional: true,
                })
                .collect()
        }
        Ok(None) => config.driver_libraries.clone(),
        Err(e) => {
            f.refuse(format!("the driver's CDI spec: {e}"));
            Vec::new()
        }
    }
}

pub fn apply(spec: &mut Value, ctx: &Context, f: &mut Findings) {
    let mut list = spec
        .get("mounts")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for m in &list {
        check_mount(m, ctx, f);
    }
    if let Some(lease) = ctx.lease {
        for m in &lease.mounts {
            list.extend(lease_mount(m, ctx, f));
        }
        for lib in &driver_files(ctx.config, f) {
            list.extend(driver_mount(lib, ctx, f));
        }
    }
    if let Some(m) = spec.as_object_mut() {
        m.insert("mounts".to_string(), Value::Array(list));
    }
}

/// One of the tenant's mounts: no GPU device path, no sensitive host path bound, a
/// type the policy allows, no extra procfs or sysfs.
fn check_mount(m: &Value, ctx: &Context, f: &mut Findings) {
    let policy = ctx.policy();
    let Some(dest) = m.get("destination").and_then(Value::as_str) else {
        f.refuse("malformed spec: a mount has no destination");
        return;
    };
    let ty = m.get("type").and_then(Value::as_str).unwrap_or("");
    let source = m.get("source").and_then(Value::as_str).unwrap_or("");
    let options = match m.get("options") {
        None | Some(Value::Null) => Vec::new(),
        Some(o) => match strings(o) {
            Some(o) => o,
            None => {
                f.refuse(format!("malformed spec: the options of mount {dest}"));
                return;
            }
        },
    };
    let ndest = normalize(dest);
    if source.starts_with('/') && normalize(source).starts_with("/dev/nvidia") {
        f.refuse(format!(
            "the spec mounts GPU device path {source}; GPU devices come only from the lease"
        ));
    }
    if ndest.starts_with("/dev/nvidia") {
        f.refuse(format!(
            "the spec mounts onto GPU device path {dest}; GPU devices come only from the lease"
        ));
    }
    if is_bind(ty, &options) {
        if !source.starts_with('/') {
            f.refuse(format!(
                "bind mount {dest} has a relative source {source:?}"
            ));
        } else if let Some(hit) = sensitive_hit(ctx.host, source, policy) {
            f.refuse(format!(
                "bind mount of sensitive host path {source} ({hit}) onto {dest}"
            ));
        }
        return;
    }
    if !policy.allowed_mount_types.iter().any(|t| t == ty) {
        f.refuse(format!("mount type {ty:?} at {dest} is not allowed"));
        return;
    }
    match ty {
        "proc" if ndest != "/proc" => {
            f.refuse(format!(
                "an extra procfs at {dest} would escape the masked paths"
            ));
        }
        "sysfs" if ndest != "/sys" => {
            f.refuse(format!(
                "an extra sysfs at {dest} would escape the masked paths"
            ));
        }
        _ => {}
    }
}

/// The lease's mount (its MPS pipe directory), checked, as the spec's mount.
fn lease_mount(m: &LeaseMount, ctx: &Context, f: &mut Findings) -> Option<Value> {
    let policy = ctx.policy();
    let src = normalize(&m.source);
    if !m.source.starts_with('/') || !m.destination.starts_with('/') {
        f.refuse(format!(
            "the lease's mount {} -> {} is not absolute",
            m.source, m.destination
        ));
        return None;
    }
    if let Some(hit) = lease_mount_problem(ctx.host, &src, policy) {
        f.refuse(format!(
            "the lease's mount source {} is a shared or sensitive host path ({hit})",
            m.source
        ));
        return None;
    }
    let mut options: Vec<String> = m
        .options
        .iter()
        .filter(|o| !matches!(o.as_str(), "suid" | "dev" | "exec" | "bind" | "rbind"))
        .cloned()
        .collect();
    options.insert(0, "rbind".to_string());
    for o in ["nosuid", "nodev", "noexec"] {
        if !options.iter().any(|x| x == o) {
            options.push(o.to_string());
        }
    }
    Some(json!({
        "destination": m.destination, "type": "bind", "source": src, "options": options,
    }))
}

/// A driver library the lease's container gets (read-only), when the host has it.
fn driver_mount(lib: &DriverLibrary, ctx: &Context, f: &mut Findings) -> Option<Value> {
    let src = lib.source.to_string_lossy().into_owned();
    let dest = lib
        .destination
        .as_deref()
        .unwrap_or(&lib.source)
        .to_string_lossy()
        .into_owned();
    match ctx.host.lstat(&lib.source) {
        Ok(_) => Some(json!({
            "destination": dest, "type": "bind", "source": src,
            "options": ["bind", "ro", "nosuid", "nodev"],
        })),
        Err(_) if lib.optional => {
            f.note(format!(
                "optional driver library {src} is absent on this host"
            ));
            None
        }
        Err(e) => {
            f.refuse(format!("driver library {src} is missing on the host: {e}"));
            None
        }
    }
}
