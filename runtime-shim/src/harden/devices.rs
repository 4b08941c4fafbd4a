//! Devices come only from the lease. The tenant's GPU nodes and device-cgroup allow
//! rules are refused; `linux.devices` and the devices cgroup are rewritten (deny all,
//! then exactly the lease's nodes; runc appends its own defaults); the /proc entries of
//! other GPUs and the MIG capabilities of other instances are masked.

use super::base::{Context, Findings};
use crate::host::PathKind;
use serde_json::{Value, json};

/// The device nodes runc always creates and allows (path, major, minor).
pub const RUNC_DEFAULT_NODES: &[(&str, i64, i64)] = &[
    ("/dev/null", 1, 3),
    ("/dev/zero", 1, 5),
    ("/dev/full", 1, 7),
    ("/dev/random", 1, 8),
    ("/dev/urandom", 1, 9),
    ("/dev/tty", 5, 0),
];

/// Device-cgroup allow rules containerd's default spec carries; runc grants the same
/// ones itself (or they are not needed), so they are dropped rather than refused.
/// (type, major, minor; -1 = any)
pub const BASELINE_RULES: &[(&str, i64, i64)] = &[
    ("c", 1, 3),
    ("c", 1, 5),
    ("c", 1, 7),
    ("c", 1, 8),
    ("c", 1, 9),
    ("c", 5, 0),
    ("c", 5, 1),
    ("c", 5, 2),
    ("c", 136, -1),
    ("c", 10, 200),
];

/// The capability paths (relative to /proc/driver/nvidia/capabilities) no lease may get.
pub const NEVER_GRANTED: &[&str] = &["mig/config", "mig/monitor"];

fn num(v: Option<&Value>) -> Option<i64> {
    match v {
        None | Some(Value::Null) => Some(-1),
        Some(v) => v.as_i64(),
    }
}

fn is_gpu(ctx: &Context, path: Option<&str>, major: i64) -> bool {
    path.is_some_and(|p| super::mounts::normalize(p).starts_with("/dev/nvidia"))
        || ctx.policy().gpu_device_majors.contains(&major)
        || ctx.host.gpu_majors().contains(&major)
}

fn check_tenant_nodes(spec: &Value, ctx: &Context, f: &mut Findings) {
    let nodes = spec
        .pointer("/linux/devices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for d in &nodes {
        let path = d.get("path").and_then(Value::as_str);
        let (Some(major), Some(minor)) = (num(d.get("major")), num(d.get("minor"))) else {
            f.refuse("malformed spec: a linux.devices entry has a bad major or minor");
            continue;
        };
        let shown = path.unwrap_or("?");
        if is_gpu(ctx, path, major) {
            f.refuse(format!(
                "the spec asks for GPU device node {shown} ({major}:{minor}); GPU devices come only from the lease"
            ));
        } else if RUNC_DEFAULT_NODES
            .iter()
            .any(|(p, ma, mi)| Some(*p) == path && *ma == major && *mi == minor)
        {
            f.note(format!(
                "{shown} dropped from linux.devices (runc creates it)"
            ));
        } else {
            f.refuse(format!(
                "the spec asks for device node {shown} ({major}:{minor}); devices come only from the lease"
            ));
        }
    }
}

fn check_tenant_rules(spec: &Value, ctx: &Context, f: &mut Findings) {
    let rules = spec
        .pointer("/linux/resources/devices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for r in &rules {
        if !r.is_object() {
            f.refuse("malformed spec: a device cgroup rule is not an object");
            continue;
        }
        match r.get("allow") {
            Some(Value::Bool(false)) => continue,
            Some(Value::Bool(true)) => {}
            _ => {
                f.refuse("malformed spec: a device cgroup rule has no boolean allow");
                continue;
            }
        }
        let ty = r.get("type").and_then(Value::as_str).unwrap_or("a");
        let (Some(major), Some(minor)) = (num(r.get("major")), num(r.get("minor"))) else {
            f.refuse("malformed spec: a device cgroup rule has a bad major or minor");
            continue;
        };
        let access = r.get("access").and_then(Value::as_str).unwrap_or("rwm");
        let shown = format!("{ty} {}:{} {access}", star(major), star(minor));
        if ty == "a" || major < 0 {
            f.refuse(format!(
                "the spec's device cgroup rule ({shown}) allows every device"
            ));
        } else if is_gpu(ctx, None, major) {
            f.refuse(format!(
                "the spec's device cgroup rule ({shown}) allows GPU devices; they come only from the lease"
            ));
        } else if BASELINE_RULES
            .iter()
            .any(|(t, ma, mi)| *t == ty && *ma == major && *mi == minor)
        {
            f.note(format!(
                "device cgroup rule {shown} dropped (runc's defaults apply)"
            ));
        } else {
            f.refuse(format!(
                "the spec's device cgroup rule ({shown}) allows a device outside the lease"
            ));
        }
    }
}

fn star(n: i64) -> String {
    if n < 0 {
        "*".to_string()
    } else {
        n.to_string()
    }
}

fn check_lease_nodes(ctx: &Context, f: &mut Findings) {
    let Some(lease) = ctx.lease else { return };
    for d in &lease.devices {
        let name = d.container_path.rsplit('/').next().unwrap_or_default();
        let host_name = d
            .host_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if ["nvidia-cap1", "nvidia-cap2"].contains(&name)
            || ["nvidia-cap1", "nvidia-cap2"].contains(&host_name.as_str())
        {
            f.refuse(format!(
                "the lease grants {} (MIG config/monitor capability): never granted to a tenant",
                d.container_path
            ));
            continue;
        }
        // The host node must exist and be what the lease says it is.
        match ctx.host.lstat(&d.host_path) {
            Ok(m) => {
                let kind_ok = (d.kind == 'c' && m.kind == PathKind::CharDevice)
                    || (d.kind == 'b' && m.kind == PathKind::BlockDevice);
                let rdev = m.rdev();
                let (ma, mi) = (i64::from(libc::major(rdev)), i64::from(libc::minor(rdev)));
                if !kind_ok || ma != d.major || mi != d.minor {
                    f.refuse(format!(
                        "the lease's device {} is not the node {} {}:{} on the host",
                        d.host_path.display(),
                        d.kind,
                        d.major,
                        d.minor
                    ));
                }
            }
            Err(e) => f.refuse(format!(
                "the lease's device {} is missing on the host: {e}",
                d.host_path.display()
            )),
        }
    }
    for c in &lease.granted_capabilities {
        if NEVER_GRANTED.contains(&c.as_str()) {
            f.refuse(format!(
                "the lease grants the {c} capability: never granted to a tenant"
            ));
        }
    }
}

pub fn apply(spec: &mut Value, ctx: &Context, f: &mut Findings) {
    check_tenant_nodes(spec, ctx, f);
    check_tenant_rules(spec, ctx, f);
    check_lease_nodes(ctx, f);
    let devices = ctx
        .lease
        .map_or_else(Vec::new, |lease| lease.devices.clone());
    let nodes: Vec<Value> = devices
        .iter()
        .map(|d| {
            json!({"path": d.container_path, "type": d.kind.to_string(), "major": d.major,
                   "minor": d.minor, "fileMode": d.file_mode, "uid": 0, "gid": 0})
        })
        .collect();
    let mut rules = vec![json!({"allow": false, "access": "rwm"})];
    rules.extend(devices.iter().map(|d| {
        json!({"allow": true, "type": d.kind.to_string(), "major": d.major, "minor": d.minor,
               "access": d.permissions})
    }));
    if let Some(linux) = super::base::obj_entry(spec, "linux") {
        linux.insert("devices".to_string(), Value::Array(nodes));
    }
    if let Some(linux) = spec.get_mut("linux")
        && let Some(res) = super::base::obj_entry(linux, "resources")
    {
        res.insert("devices".to_string(), Value::Array(rules));
    }
}

/// Container paths to mask: every /proc/driver/nvidia entry without a lease; with one,
/// the gpus/ entries of other GPUs, the capabilities of other instances, and always
/// mig/config and mig/monitor.
pub fn masked_paths(ctx: &Context) -> Vec<String> {
    const PROC: &str = "/proc/driver/nvidia";
    let Some(lease) = ctx.lease else {
        return vec![PROC.to_string()];
    };
    let allowed_minors: Vec<i64> = lease
        .devices
        .iter()
        .filter(|d| d.major == 195 && d.minor < 254)
        .map(|d| d.minor)
        .collect();
    let mut out: Vec<String> = NEVER_GRANTED
        .iter()
        .map(|c| format!("{PROC}/capabilities/{c}"))
        .collect();
    for (name, minor) in ctx.host.nvidia_gpus() {
        if !minor.is_some_and(|m| allowed_minors.contains(&m)) {
            out.push(format!("{PROC}/gpus/{name}"));
        }
    }
    for cap in ctx.host.nvidia_capabilities() {
        if !lease.granted_capabilities.contains(cap) {
            let p = format!("{PROC}/capabilities/{cap}");
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}
