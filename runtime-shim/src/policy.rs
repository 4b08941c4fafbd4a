//! The hardening policy: what a tenant spec may ask for. Loaded from the `[policy]` table
//! of runtime.toml; unknown keys are refused (fail closed).

use serde::Deserialize;
use std::path::PathBuf;

/// What to do when the host has no AppArmor LSM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AppArmorMode {
    /// Refuse every container on a host without AppArmor.
    Required,
    /// Go on without AppArmor and say so in the log.
    IfAvailable,
}

/// What to do with a container that carries no lease token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NoToken {
    /// Same hardening, no GPU node.
    Baseline,
    /// Refuse it.
    Refuse,
}

fn caps(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_string()).collect()
}

fn default_allowed_caps() -> Vec<String> {
    // Docker's default set minus MKNOD, NET_RAW, SYS_CHROOT, SETFCAP, SETPCAP.
    caps(&[
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FSETID",
        "CAP_FOWNER",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_NET_BIND_SERVICE",
        "CAP_KILL",
        "CAP_AUDIT_WRITE",
    ])
}

fn default_forbidden_caps() -> Vec<String> {
    caps(&[
        "CAP_SYS_ADMIN",
        "CAP_SYS_PTRACE",
        "CAP_SYS_MODULE",
        "CAP_NET_ADMIN",
        "CAP_SYS_RAWIO",
        "CAP_DAC_READ_SEARCH",
        "CAP_BPF",
        "CAP_PERFMON",
    ])
}

fn default_sysctls() -> Vec<String> {
    // Kubernetes' "safe" sysctls (namespaced, cannot affect other tenants).
    caps(&[
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    ])
}

fn default_sensitive() -> Vec<String> {
    // Trees: the path and everything below it.
    caps(&[
        "/proc",
        "/sys",
        "/dev",
        "/boot",
        "/root",
        "/run/tessera",
        "/var/lib/tessera",
        "/etc/tessera",
        "/run/runc",
        "/tmp/nvidia-mps",
        "/var/lib/kubelet/pki",
    ])
}

fn default_protected() -> Vec<String> {
    // Files whose directories may not be mounted either: the file and every ancestor
    // ("/", "/run", "/etc"...) are refused, siblings below those ancestors are not.
    caps(&[
        "/run/containerd/containerd.sock",
        "/var/run/containerd/containerd.sock",
        "/run/docker.sock",
        "/var/run/docker.sock",
        "/run/crio/crio.sock",
        "/var/run/crio/crio.sock",
        "/run/tessera/tesserad.sock",
        "/etc/shadow",
        "/etc/tessera/runtime.toml",
        "/var/lib/tessera/state.db",
        "/var/lib/containerd/io.containerd.metadata.v1.bolt/meta.db",
        "/var/lib/docker/containers",
    ])
}

fn default_mount_types() -> Vec<String> {
    caps(&[
        "bind", "proc", "sysfs", "devpts", "tmpfs", "mqueue", "cgroup", "cgroup2", "none",
    ])
}

fn default_selinux() -> Vec<String> {
    caps(&[
        "unconfined_t",
        "spc_t",
        "container_runtime_t",
        "kernel_t",
        "init_t",
    ])
}

fn default_gpu_majors() -> Vec<i64> {
    vec![195]
}

fn default_pids() -> i64 {
    4096
}

fn default_apparmor_profile() -> String {
    "tessera-tenant".to_string()
}

fn default_max_bytes() -> u64 {
    4 * 1024 * 1024
}

/// The hardening policy.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Capabilities a container may keep (every set is reduced to these).
    #[serde(default = "default_allowed_caps")]
    pub allowed_capabilities: Vec<String>,
    /// Capabilities whose mere request refuses the container.
    #[serde(default = "default_forbidden_caps")]
    pub forbidden_capabilities: Vec<String>,
    #[serde(default)]
    pub allow_host_network: bool,
    /// Require a (non-host) user namespace.
    #[serde(default)]
    pub require_user_namespace: bool,
    /// Pids limit when neither spec nor lease sets a lower one.
    #[serde(default = "default_pids")]
    pub pids_limit: i64,
    #[serde(default = "default_sysctls")]
    pub allowed_sysctls: Vec<String>,
    /// Host trees that may not be bind-mounted (the path or anything below it).
    #[serde(default = "default_sensitive")]
    pub sensitive_host_paths: Vec<String>,
    /// Host files that may not be bind-mounted, nor may any directory above them.
    #[serde(default = "default_protected")]
    pub protected_host_files: Vec<String>,
    /// Mount types a tenant spec may use.
    #[serde(default = "default_mount_types")]
    pub allowed_mount_types: Vec<String>,
    #[serde(default = "default_selinux")]
    pub forbidden_selinux_types: Vec<String>,
    /// Device majors that are GPU nodes (plus every "nvidia*" major in /proc/devices).
    #[serde(default = "default_gpu_majors")]
    pub gpu_device_majors: Vec<i64>,
    #[serde(default = "default_apparmor_mode")]
    pub apparmor: AppArmorMode,
    #[serde(default = "default_apparmor_profile")]
    pub apparmor_profile: String,
    /// A seccomp profile file replacing the built-in one (configs/seccomp/tenant.toml).
    #[serde(default)]
    pub seccomp_profile: Option<PathBuf>,
    #[serde(default = "default_no_token")]
    pub no_token: NoToken,
    /// Largest config.json / process.json accepted.
    #[serde(default = "default_max_bytes")]
    pub max_config_bytes: u64,
    /// SELinux labels (`process.selinuxLabel`, `linux.mountLabel`) are refused unless
    /// this is true (then the forbidden types still refuse).
    #[serde(default)]
    pub allow_selinux_labels: bool,
    /// Joining a user namespace by path (rootless setups).
    #[serde(default)]
    pub allow_user_namespace_path: bool,
    /// Where container engines keep rootfs trees outside the bundle (podman's
    /// graph root): `root.path` may lie below one.
    #[serde(default = "default_storage_roots")]
    pub container_storage_roots: Vec<PathBuf>,
    /// podman's run root: a container's own `overlay-containers/<id>/userdata` below
    /// it may be bind-mounted.
    #[serde(default = "default_run_roots")]
    pub container_run_roots: Vec<PathBuf>,
    /// containerd's root and state directories: the pod's own CRI sandbox files below
    /// them may be bind-mounted.
    #[serde(default = "default_containerd_root")]
    pub containerd_root: PathBuf,
    #[serde(default = "default_containerd_state")]
    pub containerd_state: PathBuf,
    /// kubelet's root: the pod's own `pods/<uid>` below it may be bind-mounted.
    #[serde(default = "default_kubelet_root")]
    pub kubelet_root: PathBuf,
    /// Further host prefixes bind mounts may come from, each read-only unless marked
    /// writable.
    #[serde(default)]
    pub bind_sources: Vec<BindSource>,
    /// Where a container outside Kubernetes (no running pod sandbox named) may put
    /// itself with `linux.cgroupsPath`: strictly inside one of these cgroups, a
    /// cgroupfs path (`/libpod_parent`) or a systemd slice (`machine.slice`, expanded
    /// as systemd nests slices). A pod's container goes inside its own pod's cgroup.
    #[serde(default = "default_cgroup_parents")]
    pub cgroup_parents: Vec<String>,
    /// The runc roots (`--root`) of the CRI's own runtime shims (containerd's
    /// `k8s.io` namespace): only a container created under one of these is a pod's
    /// (a sandbox, or a container of one). Anything else is outside any pod.
    #[serde(default = "default_cri_runc_roots")]
    pub cri_runc_roots: Vec<PathBuf>,
    /// kubelet's pod cgroup roots (`--cgroup-root` plus `kubepods`): a pod sandbox's
    /// pod cgroup lies directly below one, in kubelet's QoS layout (`<root>/pod<uid>`,
    /// `<root>/burstable/pod<uid>`, `<root>/besteffort/pod<uid>`; with systemd,
    /// `kubepods.slice` gives `kubepods-pod<uid>.slice`,
    /// `kubepods-burstable-pod<uid>.slice`, `kubepods-besteffort-pod<uid>.slice`).
    #[serde(default = "default_kubepods_roots")]
    pub kubepods_roots: Vec<String>,
}

fn default_cri_runc_roots() -> Vec<PathBuf> {
    vec![PathBuf::from("/run/containerd/runc/k8s.io")]
}

fn default_kubepods_roots() -> Vec<String> {
    caps(&["/kubepods", "kubepods.slice"])
}

fn default_cgroup_parents() -> Vec<String> {
    // ctr's namespace cgroup, podman's with cgroupfs and with systemd.
    caps(&["/default", "/libpod_parent", "machine.slice"])
}

/// An operator-allowed bind-mount source prefix.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BindSource {
    pub path: PathBuf,
    #[serde(default)]
    pub writable: bool,
}

fn default_storage_roots() -> Vec<PathBuf> {
    vec![PathBuf::from("/var/lib/containers/storage")]
}

fn default_run_roots() -> Vec<PathBuf> {
    vec![PathBuf::from("/run/containers/storage")]
}

fn default_containerd_root() -> PathBuf {
    PathBuf::from("/var/lib/containerd")
}

fn default_containerd_state() -> PathBuf {
    PathBuf::from("/run/containerd")
}

fn default_kubelet_root() -> PathBuf {
    PathBuf::from("/var/lib/kubelet")
}

fn default_apparmor_mode() -> AppArmorMode {
    AppArmorMode::Required
}

fn default_no_token() -> NoToken {
    NoToken::Baseline
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            allowed_capabilities: default_allowed_caps(),
            forbidden_capabilities: default_forbidden_caps(),
            allow_host_network: false,
            require_user_namespace: false,
            pids_limit: default_pids(),
            allowed_sysctls: default_sysctls(),
            sensitive_host_paths: default_sensitive(),
            protected_host_files: default_protected(),
            allowed_mount_types: default_mount_types(),
            forbidden_selinux_types: default_selinux(),
            gpu_device_majors: default_gpu_majors(),
            apparmor: default_apparmor_mode(),
            apparmor_profile: default_apparmor_profile(),
            seccomp_profile: None,
            no_token: default_no_token(),
            max_config_bytes: default_max_bytes(),
            allow_selinux_labels: false,
            allow_user_namespace_path: false,
            container_storage_roots: default_storage_roots(),
            container_run_roots: default_run_roots(),
            containerd_root: default_containerd_root(),
            containerd_state: default_containerd_state(),
            kubelet_root: default_kubelet_root(),
            bind_sources: Vec::new(),
            cgroup_parents: default_cgroup_parents(),
            cri_runc_roots: default_cri_runc_roots(),
            kubepods_roots: default_kubepods_roots(),
        }
    }
}

/// Normalise a capability name: upper case with the `CAP_` prefix.
pub fn cap_name(s: &str) -> String {
    let up = s.trim().to_ascii_uppercase();
    if up.starts_with("CAP_") {
        up
    } else {
        format!("CAP_{up}")
    }
}
