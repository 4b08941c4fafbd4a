//! What a lease's CDI spec put into the spec. `podman run --device
//! tessera.io/lease=<id>` (or containerd with CDI on) applies the lease's CDI spec to
//! config.json before the runtime runs: its device nodes, their device-cgroup rules
//! and its mounts (the MPS pipe directory, the driver's files). Those that are exactly
//! the lease's own, by path, type, major, minor (and source and destination for a
//! mount), are taken out here, before anything is judged, and the runtime writes them
//! again from the lease as it does for every container. Anything else of the kind
//! stays in the spec and is judged, and refused, as a tenant's: another GPU's node, a
//! rule for another device, a mount of another lease's directory. Without a lease
//! nothing is taken out. Its env needs nothing: the lease's variables always win.

use serde_json::Value;

use super::base::{Context, Findings, strings};
use super::mounts::normalize;
use crate::lease::{LeaseDevice, ResolvedLease};

/// Take the lease's own CDI edits out of `spec`, noting each.
pub fn strip_lease_edits(spec: &mut Value, ctx: &Context, f: &mut Findings) {
    let Some(lease) = ctx.lease else {
        return;
    };
    strip_nodes(spec, lease, f);
    strip_rules(spec, lease, f);
    strip_mounts(spec, lease, ctx, f);
}

/// Whether `d` is the node of this type and number.
fn same_node(d: &LeaseDevice, kind: &str, major: i64, minor: i64) -> bool {
    kind.len() == 1 && kind.starts_with(d.kind) && d.major == major && d.minor == minor
}

/// The lease's own device nodes.
fn strip_nodes(spec: &mut Value, lease: &ResolvedLease, f: &mut Findings) {
    if let Some(nodes) = spec
        .pointer_mut("/linux/devices")
        .and_then(Value::as_array_mut)
    {
        nodes.retain(|n| {
            let (Some(path), Some(major), Some(minor)) = (
                n.get("path").and_then(Value::as_str),
                n.get("major").and_then(Value::as_i64),
                n.get("minor").and_then(Value::as_i64),
            ) else {
                return true;
            };
            let kind = n.get("type").and_then(Value::as_str).unwrap_or("");
            let own = lease.devices.iter().any(|d| {
                normalize(&d.container_path) == normalize(path) && same_node(d, kind, major, minor)
            });
            if own {
                f.note(format!(
                    "device node {path} ({major}:{minor}) from the lease's CDI spec: the lease's own, written by the runtime"
                ));
            }
            !own
        });
    }
}

/// The device-cgroup rules that allow the lease's own nodes.
fn strip_rules(spec: &mut Value, lease: &ResolvedLease, f: &mut Findings) {
    if let Some(rules) = spec
        .pointer_mut("/linux/resources/devices")
        .and_then(Value::as_array_mut)
    {
        rules.retain(|r| {
            let (Some(true), Some(kind), Some(major), Some(minor), Some(access)) = (
                r.get("allow").and_then(Value::as_bool),
                r.get("type").and_then(Value::as_str),
                r.get("major").and_then(Value::as_i64),
                r.get("minor").and_then(Value::as_i64),
                r.get("access").and_then(Value::as_str),
            ) else {
                return true;
            };
            let own = !access.is_empty()
                && access.chars().all(|c| "rwm".contains(c))
                && lease
                    .devices
                    .iter()
                    .any(|d| same_node(d, kind, major, minor));
            if own {
                f.note(format!(
                    "device cgroup rule {kind} {major}:{minor} {access} from the lease's CDI spec: the runtime writes the lease's rules"
                ));
            }
            !own
        });
    }
}

/// The lease's mounts and the driver's files, as the runtime will mount them.
fn strip_mounts(spec: &mut Value, lease: &ResolvedLease, ctx: &Context, f: &mut Findings) {
    // The lease's mounts and the driver's files, as the runtime will mount them.
    let mut scratch = Findings::default();
    let own_mounts: Vec<(String, String)> = lease
        .mounts
        .iter()
        .map(|m| (normalize(&m.source), normalize(&m.destination)))
        .chain(
            super::mounts::driver_files(ctx.config, &mut scratch)
                .into_iter()
                .map(|l| {
                    let dest = l.destination.as_deref().unwrap_or(&l.source).to_path_buf();
                    (
                        normalize(&l.source.to_string_lossy()),
                        normalize(&dest.to_string_lossy()),
                    )
                }),
        )
        .collect();
    if let Some(mounts) = spec.get_mut("mounts").and_then(Value::as_array_mut) {
        mounts.retain(|m| {
            let (Some(src), Some(dest)) = (
                m.get("source").and_then(Value::as_str),
                m.get("destination").and_then(Value::as_str),
            ) else {
                return true;
            };
            let ty = m.get("type").and_then(Value::as_str).unwrap_or("");
            let options = m.get("options").and_then(strings).unwrap_or_default();
            let bind = ty == "bind" || options.iter().any(|o| o == "bind" || o == "rbind");
            let own = bind
                && own_mounts
                    .iter()
                    .any(|(s, d)| *s == normalize(src) && *d == normalize(dest));
            if own {
                f.note(format!(
                    "mount {src} -> {dest} from the lease's CDI spec: the lease's own, mounted by the runtime"
                ));
            }
            !own
        });
    }
}
