//! Namespaces and sysctls: no host PID/IPC/mount/UTS namespace, no host network unless
//! the policy allows it, no joining the host's namespaces by path; sysctls from a safe
//! list only.

use super::base::{Context, Findings};
use serde_json::Value;
use std::path::Path;

pub use crate::host::proc_name;

/// Namespaces a tenant container must have of its own.
const REQUIRED: &[&str] = &["pid", "ipc", "mount", "uts"];

pub fn apply(spec: &mut Value, ctx: &Context, f: &mut Findings) {
    let policy = ctx.policy();
    let list = spec
        .pointer("/linux/namespaces")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut present = Vec::new();
    for ns in &list {
        let Some(ty) = ns.get("type").and_then(Value::as_str) else {
            f.refuse("malformed spec: a linux.namespaces entry has no type");
            continue;
        };
        if proc_name(ty).is_none() {
            f.refuse(format!("unknown namespace type {ty:?}"));
            continue;
        }
        present.push(ty.to_string());
        match ns.get("path") {
            None | Some(Value::Null) => {}
            Some(Value::String(p)) if p.is_empty() => {}
            Some(Value::String(p)) => {
                let host = ctx.host;
                match host
                    .stat(Path::new(p))
                    .and_then(|m| host.is_host_namespace(ty, m.dev, m.ino))
                {
                    Ok(true) => {
                        let allowed = ty == "network" && policy.allow_host_network;
                        if !allowed {
                            f.refuse(format!("the spec joins the host's {ty} namespace ({p})"));
                        }
                    }
                    Ok(false) => {}
                    Err(e) => f.refuse(format!("cannot check the {ty} namespace path {p}: {e}")),
                }
            }
            Some(_) => f.refuse(format!(
                "malformed spec: the {ty} namespace path is not a string"
            )),
        }
    }
    for ty in REQUIRED {
        if !present.iter().any(|p| p == ty) {
            f.refuse(format!("the spec shares the host's {ty} namespace"));
        }
    }
    if !present.iter().any(|p| p == "network") && !policy.allow_host_network {
        f.refuse("the spec shares the host's network namespace");
    }
    if policy.require_user_namespace && !present.iter().any(|p| p == "user") {
        f.refuse("the policy requires a user namespace and the spec has none");
    }
    if let Some(sysctl) = spec.pointer("/linux/sysctl").and_then(Value::as_object) {
        for key in sysctl.keys() {
            if !policy.allowed_sysctls.iter().any(|a| a == key) {
                f.refuse(format!("sysctl {key} is not in the safe list"));
            }
        }
    }
}
