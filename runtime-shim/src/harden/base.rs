//! What every step of the hardening shares: the [`Context`] it judges in, the
//! [`Findings`] it collects, the annotations it reads, and small JSON helpers. Every
//! other module of `harden` builds on this one and none of them on `harden/mod.rs`.

use crate::config::RuntimeConfig;
use crate::host::HostView;
use crate::lease::ResolvedLease;
use crate::policy::Policy;
use serde_json::Value;

pub use super::json::{obj_entry, strings};
use std::path::Path;

/// The annotation carrying the lease token, the env variable (in `process.env`) that
/// may carry it instead, and the annotation the runtime adds with the lease id.
pub use tessera_common::contract::{
    LEASE_ID_ANNOTATION, LEASE_TOKEN_ANNOTATION as TOKEN_ANNOTATION, LEASE_TOKEN_ENV as TOKEN_ENV,
};
/// The CRI annotation with the pod's namespace.
pub const SANDBOX_NAMESPACE_ANNOTATION: &str = "io.kubernetes.cri.sandbox-namespace";

/// kubelet's annotation naming the container's termination-message path.
pub const TERMINATION_PATH_ANNOTATION: &str = "io.kubernetes.container.terminationMessagePath";
/// Where kubelet mounts the termination-message file unless the pod says otherwise.
pub const DEFAULT_TERMINATION_PATH: &str = "/dev/termination-log";
/// The annotations that name a container's pod, most stable first: the pod's uid
/// (containerd's CRI, then kubelet's own), then the CRI sandbox id.
pub const POD_ANNOTATIONS: &[&str] = &[
    "io.kubernetes.cri.sandbox-uid",
    "io.kubernetes.pod.uid",
    "io.kubernetes.cri.sandbox-id",
];

/// Docker's default masked paths (kept even if the tenant spec dropped them).
pub const DEFAULT_MASKED: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];
/// Docker's default read-only paths.
pub const DEFAULT_READONLY: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// Everything the hardening needs besides the spec.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    pub config: &'a RuntimeConfig,
    pub seccomp: &'a super::seccomp::Profile,
    /// The host as the hardening reads it (never the rootfs).
    pub host: &'a dyn HostView,
    pub lease: Option<&'a ResolvedLease>,
    pub container_id: &'a str,
    pub systemd_cgroup: bool,
    pub bundle: &'a Path,
    /// runc's state root (`--root`): where the pod sandbox's state is read from.
    pub runc_root: &'a Path,
}

impl Context<'_> {
    /// The hardening policy.
    pub fn policy(&self) -> &Policy {
        &self.config.policy
    }
}

/// Collects refusals and notes.
#[derive(Debug, Default)]
pub struct Findings {
    pub reasons: Vec<String>,
    pub notes: Vec<String>,
}

impl Findings {
    pub fn refuse(&mut self, r: impl Into<String>) {
        let r = r.into();
        if !self.reasons.contains(&r) {
            self.reasons.push(r);
        }
    }
    pub fn note(&mut self, n: impl Into<String>) {
        self.notes.push(n.into());
    }
}

pub fn annotation<'v>(spec: &'v Value, key: &str) -> Option<&'v str> {
    spec.get("annotations")
        .and_then(|a| a.get(key))
        .and_then(Value::as_str)
        .filter(|v| !v.is_empty())
}

/// The pod a container belongs to, from the annotations containerd's CRI sets (the
/// pod uid, else the sandbox id); `None` outside Kubernetes.
pub fn pod_of(spec: &Value) -> Option<String> {
    POD_ANNOTATIONS
        .iter()
        .find_map(|k| annotation(spec, k))
        .map(str::to_string)
}

/// Whether the spec really is containerd's pod sandbox (pause) container, which runs
/// no tenant code: the CRI annotations agree (`container-type` sandbox, `sandbox-id`
/// equal to this container's id), it asks for no device and for no forbidden
/// capability. A spec that only claims to be one gets no exemption.
pub fn is_cri_sandbox(spec: &Value, id: &str, policy: &Policy) -> bool {
    let ann = |k: &str| {
        spec.get("annotations")
            .and_then(|a| a.get(k))
            .and_then(Value::as_str)
    };
    if ann("io.kubernetes.cri.container-type") != Some("sandbox") {
        return false;
    }
    let same_id = ann("io.kubernetes.cri.sandbox-id") == Some(id) && !id.is_empty();
    let no_devices = spec
        .pointer("/linux/devices")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty);
    let caps = spec
        .pointer("/process/capabilities")
        .and_then(Value::as_object)
        .map(|sets| {
            sets.values()
                .filter_map(strings)
                .flatten()
                .map(|c| crate::policy::cap_name(&c))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let no_forbidden = !caps.iter().any(|c| {
        policy
            .forbidden_capabilities
            .iter()
            .any(|f| crate::policy::cap_name(f) == *c)
    });
    same_id && no_devices && no_forbidden
}
