//! The policy table: every field of the OCI runtime spec (config.json, and the process
//! JSON of `exec`) is copied, checked, rewritten or refused. A field the table does not
//! know, including future spec fields and unknown top-level keys, refuses the
//! container with its JSON path. docs/security.md lists the table with the reasons.
//!
//! The walk here decides which fields may appear at all; the checks and rewrites of
//! the fields it lets through live beside it ([`check`], and the sibling modules:
//! namespaces, caps, mounts, devices, cgroups, seccomp, apparmor).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::base::{Context, Findings, strings};
use super::identity::{self, Identity};
use super::mounts::{is_under, normalize};
use crate::host::{ChainError, HostView};

/// What the runtime does with a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Passed to runc as written (only its JSON type is checked).
    Copied,
    /// Passed to runc after a check that can refuse it.
    Checked,
    /// Replaced or extended by the runtime (the tenant's value is not trusted).
    Rewritten,
    /// Its presence refuses the container.
    Refused,
}

/// One row of the table: a JSON path (`*` = any array index or map key), its class,
/// whether the walk descends below it, and why.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    pub path: &'static str,
    pub class: Class,
    /// False for leaves and for maps whose keys are checked by [`check`].
    pub descend: bool,
    pub why: &'static str,
}

use Class::{Checked, Copied, Refused, Rewritten};

const fn f(path: &'static str, class: Class, descend: bool, why: &'static str) -> Field {
    Field {
        path,
        class,
        descend,
        why,
    }
}

/// The table. Paths are JSON pointers below the spec's root (config.json), or below
/// `/process` for the process JSON of `exec`.
pub const TABLE: &[Field] = &[
    f("/ociVersion", Copied, false, "the spec version runc checks"),
    f(
        "/hostname",
        Copied,
        false,
        "the container's own UTS namespace",
    ),
    f(
        "/domainname",
        Copied,
        false,
        "the container's own UTS namespace",
    ),
    f("/root", Checked, true, "the rootfs"),
    f(
        "/root/path",
        Checked,
        false,
        "inside the bundle or the engine's recorded rootfs of this container, root-owned, passed to runc canonical",
    ),
    f(
        "/root/readonly",
        Copied,
        false,
        "a read-only rootfs only restricts",
    ),
    f("/process", Checked, true, "the init process"),
    f("/process/terminal", Copied, false, "a pty from runc"),
    f("/process/consoleSize", Copied, true, "the pty size"),
    f("/process/consoleSize/height", Copied, false, "the pty size"),
    f("/process/consoleSize/width", Copied, false, "the pty size"),
    f(
        "/process/user",
        Copied,
        true,
        "the uid and gids inside the container's namespaces",
    ),
    f(
        "/process/user/uid",
        Copied,
        false,
        "a uid inside the container",
    ),
    f(
        "/process/user/gid",
        Copied,
        false,
        "a gid inside the container",
    ),
    f("/process/user/umask", Copied, false, "the file mode mask"),
    f(
        "/process/user/additionalGids",
        Copied,
        true,
        "gids inside the container",
    ),
    f(
        "/process/user/additionalGids/*",
        Copied,
        false,
        "a gid inside the container",
    ),
    f("/process/user/username", Copied, false, "informational"),
    f("/process/args", Copied, true, "the command"),
    f("/process/args/*", Copied, false, "an argument"),
    f(
        "/process/commandLine",
        Copied,
        false,
        "the command (Windows form, ignored by runc)",
    ),
    f(
        "/process/env",
        Rewritten,
        true,
        "the lease token is dropped, the lease's variables win",
    ),
    f(
        "/process/env/*",
        Rewritten,
        false,
        "an environment variable",
    ),
    f(
        "/process/cwd",
        Copied,
        false,
        "resolved by runc inside the container",
    ),
    f(
        "/process/capabilities",
        Rewritten,
        true,
        "reduced to the policy's allowed set; a forbidden one refuses",
    ),
    f(
        "/process/capabilities/bounding",
        Rewritten,
        true,
        "capability set",
    ),
    f(
        "/process/capabilities/bounding/*",
        Rewritten,
        false,
        "a capability",
    ),
    f(
        "/process/capabilities/effective",
        Rewritten,
        true,
        "capability set",
    ),
    f(
        "/process/capabilities/effective/*",
        Rewritten,
        false,
        "a capability",
    ),
    f(
        "/process/capabilities/inheritable",
        Rewritten,
        true,
        "capability set",
    ),
    f(
        "/process/capabilities/inheritable/*",
        Rewritten,
        false,
        "a capability",
    ),
    f(
        "/process/capabilities/permitted",
        Rewritten,
        true,
        "capability set",
    ),
    f(
        "/process/capabilities/permitted/*",
        Rewritten,
        false,
        "a capability",
    ),
    f(
        "/process/capabilities/ambient",
        Rewritten,
        true,
        "capability set",
    ),
    f(
        "/process/capabilities/ambient/*",
        Rewritten,
        false,
        "a capability",
    ),
    f(
        "/process/rlimits",
        Checked,
        true,
        "only known limits, capped",
    ),
    f("/process/rlimits/*", Checked, true, "a limit"),
    f(
        "/process/rlimits/*/type",
        Checked,
        false,
        "RLIMIT_NOFILE, RLIMIT_NPROC, RLIMIT_CORE, RLIMIT_STACK, RLIMIT_MSGQUEUE only",
    ),
    f("/process/rlimits/*/hard", Checked, false, "capped"),
    f("/process/rlimits/*/soft", Checked, false, "capped"),
    f("/process/noNewPrivileges", Rewritten, false, "always true"),
    f(
        "/process/apparmorProfile",
        Rewritten,
        false,
        "always the policy's profile",
    ),
    f(
        "/process/oomScoreAdj",
        Checked,
        false,
        "-998 or more: -999 and -1000 would make the host kill other tenants first",
    ),
    f(
        "/process/selinuxLabel",
        Checked,
        false,
        "refused unless the policy allows SELinux labels",
    ),
    f(
        "/process/scheduler",
        Checked,
        true,
        "real-time policies would starve other tenants",
    ),
    f(
        "/process/scheduler/policy",
        Checked,
        false,
        "SCHED_OTHER, SCHED_BATCH or SCHED_IDLE only",
    ),
    f("/process/scheduler/nice", Checked, false, "0 or more"),
    f("/process/scheduler/priority", Checked, false, "0 only"),
    f(
        "/process/scheduler/flags",
        Refused,
        false,
        "scheduler flags are not allowed",
    ),
    f(
        "/process/scheduler/runtime",
        Refused,
        false,
        "deadline scheduling is not allowed",
    ),
    f(
        "/process/scheduler/deadline",
        Refused,
        false,
        "deadline scheduling is not allowed",
    ),
    f(
        "/process/scheduler/period",
        Refused,
        false,
        "deadline scheduling is not allowed",
    ),
    f(
        "/process/ioPriority",
        Checked,
        true,
        "no real-time I/O class",
    ),
    f(
        "/process/ioPriority/class",
        Checked,
        false,
        "IOPRIO_CLASS_BE or IOPRIO_CLASS_IDLE only",
    ),
    f(
        "/process/ioPriority/priority",
        Copied,
        false,
        "the level within the class",
    ),
    f(
        "/process/execCPUAffinity",
        Refused,
        false,
        "runc's exec CPU placement is not allowed",
    ),
    f(
        "/mounts",
        Checked,
        true,
        "bind sources from allowed prefixes only; kernel filesystems with fixed options",
    ),
    f("/mounts/*", Checked, true, "a mount"),
    f(
        "/mounts/*/destination",
        Checked,
        false,
        "never a GPU node; resolved by runc inside the rootfs",
    ),
    f(
        "/mounts/*/source",
        Checked,
        false,
        "for binds: canonical, under an allowed prefix, every ancestor root-owned",
    ),
    f("/mounts/*/type", Checked, false, "the policy's mount types"),
    f(
        "/mounts/*/options",
        Checked,
        true,
        "fixed for kernel filesystems",
    ),
    f("/mounts/*/options/*", Checked, false, "a mount option"),
    f(
        "/mounts/*/uidMappings",
        Refused,
        false,
        "id-mapped mounts are not allowed",
    ),
    f(
        "/mounts/*/gidMappings",
        Refused,
        false,
        "id-mapped mounts are not allowed",
    ),
    f(
        "/hooks",
        Refused,
        false,
        "hooks run on the host as root: never from a tenant spec",
    ),
    f(
        "/annotations",
        Checked,
        false,
        "runc- and systemd-acting keys refused; the token is dropped",
    ),
    f("/linux", Checked, true, "Linux specifics"),
    f(
        "/linux/namespaces",
        Checked,
        true,
        "new namespaces, or the pod sandbox's; never a mount namespace path",
    ),
    f("/linux/namespaces/*", Checked, true, "a namespace"),
    f(
        "/linux/namespaces/*/type",
        Checked,
        false,
        "a known namespace type",
    ),
    f(
        "/linux/namespaces/*/path",
        Checked,
        false,
        "/proc/<pid>/ns/<type> or a CNI netns, never the host's",
    ),
    f(
        "/linux/uidMappings",
        Copied,
        true,
        "user namespace mappings (the policy may require one)",
    ),
    f("/linux/uidMappings/*", Copied, true, "a mapping"),
    f("/linux/uidMappings/*/containerID", Copied, false, "mapping"),
    f("/linux/uidMappings/*/hostID", Copied, false, "mapping"),
    f("/linux/uidMappings/*/size", Copied, false, "mapping"),
    f(
        "/linux/gidMappings",
        Copied,
        true,
        "user namespace mappings",
    ),
    f("/linux/gidMappings/*", Copied, true, "a mapping"),
    f("/linux/gidMappings/*/containerID", Copied, false, "mapping"),
    f("/linux/gidMappings/*/hostID", Copied, false, "mapping"),
    f("/linux/gidMappings/*/size", Copied, false, "mapping"),
    f(
        "/linux/devices",
        Checked,
        false,
        "no GPU node except the lease's; the lease's nodes are added",
    ),
    f(
        "/linux/cgroupsPath",
        Checked,
        false,
        "inside the pod's cgroup as runc recorded its sandbox (systemd slices expanded); a sandbox's directly in its own pod's cgroup below a kubepods root; directly in a configured parent outside Kubernetes; ending in this container",
    ),
    f("/linux/resources", Checked, true, "cgroup limits"),
    f(
        "/linux/resources/devices",
        Rewritten,
        false,
        "replaced: deny all, then the lease's nodes",
    ),
    f(
        "/linux/resources/memory",
        Copied,
        false,
        "a limit only restricts",
    ),
    f(
        "/linux/resources/cpu",
        Copied,
        false,
        "a limit only restricts",
    ),
    f(
        "/linux/resources/pids",
        Rewritten,
        false,
        "capped by the policy and the lease",
    ),
    f(
        "/linux/resources/blockIO",
        Copied,
        false,
        "a weight or limit only restricts",
    ),
    f(
        "/linux/resources/hugepageLimits",
        Copied,
        false,
        "a limit only restricts",
    ),
    f(
        "/linux/resources/network",
        Refused,
        false,
        "network classes are host-wide",
    ),
    f(
        "/linux/resources/rdma",
        Refused,
        false,
        "RDMA devices are not leased",
    ),
    f(
        "/linux/resources/unified",
        Checked,
        false,
        "no devices, pids, cgroup-core or rdma files",
    ),
    f(
        "/linux/sysctl",
        Checked,
        false,
        "the namespaced safe set only",
    ),
    f(
        "/linux/seccomp",
        Rewritten,
        false,
        "replaced by the tenant profile",
    ),
    f(
        "/linux/rootfsPropagation",
        Checked,
        false,
        "private or slave only: shared would leak mounts to the host",
    ),
    f(
        "/linux/maskedPaths",
        Rewritten,
        false,
        "extended to at least Docker's and the other GPUs'",
    ),
    f(
        "/linux/readonlyPaths",
        Rewritten,
        false,
        "extended to at least Docker's",
    ),
    f(
        "/linux/mountLabel",
        Checked,
        false,
        "refused unless the policy allows SELinux labels",
    ),
    f(
        "/linux/intelRdt",
        Refused,
        false,
        "cache and memory-bandwidth allocation are host-wide",
    ),
    f(
        "/linux/netDevices",
        Refused,
        false,
        "moving host network devices into a container",
    ),
    f(
        "/linux/personality",
        Refused,
        false,
        "execution domains are not allowed",
    ),
    f(
        "/linux/timeOffsets",
        Refused,
        false,
        "time namespace offsets are not allowed",
    ),
    f(
        "/linux/memoryPolicy",
        Refused,
        false,
        "NUMA memory policy is not allowed",
    ),
];

/// The row for a concrete path (`/mounts/3/source` matches `/mounts/*/source`): the
/// first row of [`TABLE`] that matches.
pub fn lookup(path: &str) -> Option<&'static Field> {
    // The walk looks up every node of the spec (hundreds in a CRI spec): the rows are
    // indexed once per process by depth and first segment, and a lookup compares only
    // the rows under its own key and under a wildcard first segment, the first match
    // of each kept in table order (same answer as `matches` on every row in order).
    type Rows = Vec<(usize, Vec<&'static str>)>;
    static INDEX: std::sync::OnceLock<std::collections::HashMap<(usize, &'static str), Rows>> =
        std::sync::OnceLock::new();
    let index = INDEX.get_or_init(|| {
        let mut index = std::collections::HashMap::<_, Rows>::new();
        for (i, row) in TABLE.iter().enumerate() {
            let segs: Vec<&'static str> = row.path.split('/').collect();
            let first = segs.get(1).copied().unwrap_or_default();
            index
                .entry((segs.len(), first))
                .or_default()
                .push((i, segs));
        }
        index
    });
    let segs: Vec<&str> = path.split('/').collect();
    let first_match = |first: &str| {
        index.get(&(segs.len(), first)).and_then(|rows| {
            rows.iter()
                .find(|(_, p)| p.iter().zip(&segs).all(|(a, b)| *a == "*" || a == b))
                .map(|(i, _)| *i)
        })
    };
    let own = first_match(segs.get(1).copied().unwrap_or_default());
    let wild = first_match("*");
    let i = match (own, wild) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b)?,
    };
    TABLE.get(i)
}

/// The plain form of [`lookup`]'s match, which tests check it against.
#[cfg(test)]
fn matches(pattern: &str, path: &str) -> bool {
    let mut p = pattern.split('/');
    let mut q = path.split('/');
    loop {
        match (p.next(), q.next()) {
            (None, None) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            _ => return false,
        }
    }
}

fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// Walk the spec: a field the table does not know, or one it refuses, is a refusal
/// naming its JSON path. `prefix` is "" for config.json and "/process" for the
/// process JSON of `exec`.
pub fn walk(v: &Value, prefix: &str, f: &mut Findings) {
    let children: Vec<(String, &Value)> = match v {
        Value::Object(m) => m.iter().map(|(k, v)| (escape(k), v)).collect(),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, v)| (i.to_string(), v))
            .collect(),
        _ => return,
    };
    for (key, child) in children {
        let path = format!("{prefix}/{key}");
        match lookup(&path) {
            None => f.refuse(format!(
                "{path}: not in the runtime's policy table (unknown fields are refused)"
            )),
            Some(row) if row.class == Refused => {
                if !child.is_null() {
                    f.refuse(format!("{path}: refused: {}", row.why));
                }
            }
            Some(row) if row.descend => walk(child, &path, f),
            Some(_) => {}
        }
    }
}

/// Annotation key prefixes that make runc, crun or systemd act: refused.
const ACTING_ANNOTATIONS: &[&str] = &["org.systemd.property.", "run.oci.", "org.criu."];

/// Rlimits a tenant may set, with their cap.
const RLIMITS: &[(&str, u64)] = &[
    ("RLIMIT_NOFILE", 1 << 20),
    ("RLIMIT_NPROC", 1 << 16),
    ("RLIMIT_CORE", u64::MAX),
    ("RLIMIT_STACK", 1 << 30),
    ("RLIMIT_MSGQUEUE", 1 << 24),
];

/// Checks of the fields the walk lets through that no sibling module makes.
pub fn check(spec: &mut Value, ctx: &Context, ident: &Identity, f: &mut Findings) {
    process_fields(
        spec.get("process").unwrap_or(&Value::Null),
        "/process",
        ctx.policy(),
        f,
    );
    if let Some(ann) = spec.get("annotations").and_then(Value::as_object) {
        for k in ann.keys().filter(|k| k.contains('=')) {
            f.refuse(format!(
                "/annotations/{}: refused: a key with '=' would read as another key in runc's record (labels are key=value)",
                escape(k)
            ));
        }
        for k in ann.keys() {
            if let Some(p) = ACTING_ANNOTATIONS.iter().find(|p| k.starts_with(*p)) {
                f.refuse(format!(
                    "/annotations/{}: refused: {p}* annotations make the runtime or systemd act",
                    escape(k)
                ));
            }
        }
    }
    if let Some(label) = spec.pointer("/linux/mountLabel").and_then(Value::as_str)
        && !label.is_empty()
        && !ctx.policy().allow_selinux_labels
    {
        f.refuse("/linux/mountLabel: refused: the policy does not allow SELinux labels");
    }
    if let Some(p) = spec
        .pointer("/linux/rootfsPropagation")
        .and_then(Value::as_str)
        && !matches!(p, "" | "private" | "rprivate" | "slave" | "rslave")
    {
        f.refuse(format!(
            "/linux/rootfsPropagation: {p:?} would share mounts with the host; private or slave only"
        ));
    }
    if let Some(list) = spec.pointer("/linux/namespaces").and_then(Value::as_array) {
        for (i, ns) in list.iter().enumerate() {
            namespace_path(ns, i, ctx, ident, f);
        }
    }
    // runc opens the path it is given: the one that was judged, `..` and `//` gone.
    if let Some(list) = spec
        .pointer_mut("/linux/namespaces")
        .and_then(Value::as_array_mut)
    {
        for ns in list.iter_mut().filter_map(Value::as_object_mut) {
            if let Some(p) = ns
                .get("path")
                .and_then(Value::as_str)
                .filter(|p| p.starts_with('/'))
            {
                let n = normalize(p);
                ns.insert("path".into(), json!(n));
            }
        }
    }
    cgroups_path(spec, ctx, ident, f);
    root_path(spec, ctx, f);
    kernel_mounts(spec, f);
    bind_sources(spec, ctx, ident, f);
    cgroup_file_names(spec, f);
}

/// runc makes cgroup file names of `unified` keys and hugepage sizes and joins them to
/// the container's cgroup directory: a `/` or `..` there would reach another cgroup's
/// files.
fn cgroup_file_names(spec: &Value, f: &mut Findings) {
    let Some(res) = spec.pointer("/linux/resources") else {
        return;
    };
    // Typed as runc reads them (what the record of the create keeps): a key spelt
    // otherwise than runc's struct field is refused.
    if let Err(reasons) = crate::resources::parse_create(res) {
        for r in reasons {
            f.refuse(r);
        }
    }
    for k in res
        .get("unified")
        .and_then(Value::as_object)
        .into_iter()
        .flat_map(|m| m.keys())
    {
        if !crate::resources::cgroup_file_name_ok(k) {
            f.refuse(format!(
                "/linux/resources/unified/{}: not a cgroup file name",
                escape(k)
            ));
        }
    }
    for (i, h) in res
        .get("hugepageLimits")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let size = h.get("pageSize").and_then(Value::as_str).unwrap_or("");
        if !crate::resources::page_size_ok(size) {
            f.refuse(format!(
                "/linux/resources/hugepageLimits/{i}/pageSize: {size:?} is not a page size"
            ));
        }
    }
}

/// Process fields (config.json's `process`, or the process JSON of `exec`).
pub fn process_fields(p: &Value, at: &str, policy: &crate::policy::Policy, f: &mut Findings) {
    if let Some(adj) = p.get("oomScoreAdj").and_then(Value::as_i64)
        && adj < -998
    {
        f.refuse(format!(
            "{at}/oomScoreAdj: {adj} is below -998: the kernel would kill other tenants' processes first"
        ));
    }
    if let Some(label) = p.get("selinuxLabel").and_then(Value::as_str)
        && !label.is_empty()
        && !policy.allow_selinux_labels
    {
        f.refuse(format!(
            "{at}/selinuxLabel: refused: the policy does not allow SELinux labels"
        ));
    }
    if let Some(list) = p.get("rlimits").and_then(Value::as_array) {
        for (i, r) in list.iter().enumerate() {
            let ty = r.get("type").and_then(Value::as_str).unwrap_or("");
            let Some((_, cap)) = RLIMITS.iter().find(|(n, _)| *n == ty) else {
                f.refuse(format!(
                    "{at}/rlimits/{i}/type: {ty:?} is not a limit a tenant may set"
                ));
                continue;
            };
            for k in ["hard", "soft"] {
                match r.get(k) {
                    Some(v) if v.as_u64().is_some_and(|n| n <= *cap) => {}
                    None => {}
                    Some(v) => f.refuse(format!(
                        "{at}/rlimits/{i}/{k}: {v} is above the cap of {cap} for {ty}"
                    )),
                }
            }
        }
    }
    if let Some(s) = p.get("scheduler") {
        let policy = s
            .get("policy")
            .and_then(Value::as_str)
            .unwrap_or("SCHED_OTHER");
        if !matches!(policy, "SCHED_OTHER" | "SCHED_BATCH" | "SCHED_IDLE") {
            f.refuse(format!(
                "{at}/scheduler/policy: {policy} would starve other tenants"
            ));
        }
        if s.get("nice").and_then(Value::as_i64).is_some_and(|n| n < 0) {
            f.refuse(format!(
                "{at}/scheduler/nice: a negative nice value is not allowed"
            ));
        }
        if s.get("priority")
            .and_then(Value::as_i64)
            .is_some_and(|n| n != 0)
        {
            f.refuse(format!("{at}/scheduler/priority: must be 0"));
        }
    }
    if let Some(class) = p.pointer("/ioPriority/class").and_then(Value::as_str)
        && !matches!(class, "IOPRIO_CLASS_BE" | "IOPRIO_CLASS_IDLE")
    {
        f.refuse(format!(
            "{at}/ioPriority/class: {class} would starve other tenants' I/O"
        ));
    }
}

/// A namespace path: never a mount or user namespace by path. A process's namespace
/// file (`/proc/<pid>/ns/<type>`) only of the container's own pod sandbox as runc
/// recorded it ([`Identity::Member`]): `<pid>` must be the sandbox's init process,
/// still the one runc started (same start time). A CNI netns file (under /run/netns)
/// only for a pod sandbox itself.
/// A CNI netns file (`/run/netns/<name>`): for the pod sandbox only, and a fresh one.
fn join_netns(at: &str, path: &str, ctx: &Context, ident: &Identity, f: &mut Findings) {
    if !matches!(ident, Identity::OwnSandbox { .. }) {
        f.refuse(format!(
            "{at}: a CNI netns file ({path}) is for the pod sandbox only; a container joins its sandbox's namespaces"
        ));
        return;
    }
    // The CRI makes a fresh netns for each sandbox: one a process is already in
    // is another pod's.
    match ctx.host.stat(Path::new(path)) {
        Ok(m) if identity::netns_in_use(ctx.host, m.dev(), m.ino()) => f.refuse(format!(
            "{at}: the netns {path} is already another pod's (a process is in it); a pod sandbox joins a fresh one"
        )),
        Ok(_) => {}
        Err(e) => f.refuse(format!("{at}: {path}: {e}")),
    }
}

fn namespace_path(ns: &Value, i: usize, ctx: &Context, ident: &Identity, f: &mut Findings) {
    let ty = ns.get("type").and_then(Value::as_str).unwrap_or("");
    let Some(path) = ns
        .get("path")
        .and_then(Value::as_str)
        .filter(|p| !p.is_empty())
    else {
        return;
    };
    let at = format!("/linux/namespaces/{i}/path");
    match ty {
        "mount" => {
            f.refuse(format!(
                "{at}: joining a mount namespace by path ({path}) would give the container another's root"
            ));
            return;
        }
        "user" if !ctx.policy().allow_user_namespace_path => {
            f.refuse(format!(
                "{at}: joining a user namespace by path is not allowed"
            ));
            return;
        }
        "user" => return,
        _ => {}
    }
    let name = crate::host::proc_name(ty).unwrap_or("?");
    let n = normalize(path);
    let parts: Vec<&str> = n.trim_start_matches('/').split('/').collect();
    let proc_pid = (parts.len() == 4 && parts[0] == "proc" && parts[2] == "ns" && parts[3] == name)
        .then(|| parts[1].parse::<u32>().ok())
        .flatten()
        .filter(|pid| *pid > 1);
    // containerd 1.6/1.7 name it /var/run/netns/<name> (a symlink to /run on most
    // hosts), newer ones /run/netns/<name>: exactly one component below either.
    let netns_form = ty == "network"
        && Path::new(&n)
            .parent()
            .is_some_and(|d| d == Path::new("/run/netns") || d == Path::new("/var/run/netns"))
        && Path::new(&n).file_name().is_some();
    if netns_form {
        join_netns(&at, path, ctx, ident, f);
        return;
    }
    let Some(pid) = proc_pid else {
        f.refuse(format!(
            "{at}: {path} is not a namespace file (/proc/<pid>/ns/{name} of the pod's sandbox{})",
            if ty == "network" {
                ", or a CNI netns under /run/netns for the sandbox"
            } else {
                ""
            }
        ));
        return;
    };
    let Identity::Member(sandbox) = ident else {
        f.refuse(format!(
            "{at}: joining process {pid}'s {ty} namespace needs the pod sandbox's id (io.kubernetes.cri.sandbox-id) naming a running sandbox in runc's state: a container outside a pod joins no namespace"
        ));
        return;
    };
    if pid != sandbox.init_pid {
        f.refuse(format!(
            "{at}: process {pid} is not the pod sandbox's ({} runs as {})",
            sandbox.id, sandbox.init_pid
        ));
    } else if ctx.host.proc_start_time(pid) != Some(sandbox.init_start) {
        f.refuse(format!(
            "{at}: process {pid} is no longer the pod sandbox {}'s init process",
            sandbox.id
        ));
    }
}

/// `linux.cgroupsPath` as the caller gave it (kept, with a lease or without: pod
/// limits, QoS, eviction and CRI stats see the container where kubelet put it): the
/// container's own cgroup, ending in its id, and
/// - a pod's container: strictly inside its pod's cgroup, the parent of the sandbox's
///   cgroup as runc recorded it (never the sandbox's own);
/// - a pod sandbox: directly in its own pod's cgroup below a kubepods root (checked
///   by [`identity::identify`]);
/// - outside Kubernetes: directly in a configured parent (policy.cgroup_parents),
///   named by its id;
///
/// compared as cgroups, systemd slices expanded as systemd nests them. The systemd
/// form goes with `--systemd-cgroup` and only with it. A spec without one gets the
/// lease's tree (cgroups.rs).
fn cgroups_path(spec: &Value, ctx: &Context, ident: &Identity, f: &mut Findings) {
    let Some(path) = spec
        .pointer("/linux/cgroupsPath")
        .and_then(Value::as_str)
        .filter(|p| !p.is_empty())
    else {
        return; // identify() refuses a pod sandbox without one
    };
    let Some(comps) = own_cgroup(path, ctx, f) else {
        return;
    };
    let at = "/linux/cgroupsPath";
    let shown = format!("/{}", comps.join("/"));
    // A container's cgroup is its own: runc makes it at create. One that exists
    // already is another container's (runc would only warn that it is not empty and
    // join it, and a lease's release would then kill that container too).
    match identity::cgroup_exists(ctx.host, &comps) {
        Ok(None) => {}
        Ok(Some(dir)) => {
            f.refuse(format!(
                "{at}: the cgroup {shown} already exists ({}): a container's cgroup is made by runc at its create, never joined",
                dir.display()
            ));
            return;
        }
        Err(e) => {
            f.refuse(format!("{at}: cannot tell whether {shown} exists: {e}"));
            return;
        }
    }
    check_placement(path, &comps, &shown, ctx, ident, f);
}

/// `cgroupsPath` as components, in the driver's form, ending in this container's id
/// and outside the runtime's lease tree.
fn own_cgroup(path: &str, ctx: &Context, f: &mut Findings) -> Option<Vec<String>> {
    let at = "/linux/cgroupsPath";
    let id = ctx.container_id;
    if path.contains(':') && !ctx.systemd_cgroup {
        f.refuse(format!(
            "{at}: {path:?} is systemd's slice:prefix:name form, but the runtime was not given --systemd-cgroup (set SystemdCgroup = true in containerd's runtime options, or use a cgroupfs path)"
        ));
        return None;
    }
    let systemd = ctx.systemd_cgroup;
    let comps = match identity::cgroup_components(path, systemd) {
        Ok(c) => c,
        Err(e) => {
            f.refuse(format!(
                "{at}: {e}{}",
                if systemd {
                    " (--systemd-cgroup takes systemd's slice:prefix:name form)"
                } else {
                    ""
                }
            ));
            return None;
        }
    };
    let last = comps.last().map(String::as_str).unwrap_or("");
    let own_leaf = if systemd {
        path.rsplit(':').next() == Some(id)
    } else {
        last == id || last.ends_with(&format!("-{id}")) || last.ends_with(&format!("-{id}.scope"))
    };
    if !own_leaf
        || comps
            .first()
            .is_some_and(|c| c == "tessera" || c == "tessera.slice")
    {
        f.refuse(format!(
            "{at}: {path:?} must end in this container's id ({id}) and lie outside the runtime's lease tree"
        ));
        return None;
    }
    Some(comps)
}

/// The container's cgroup is where its identity puts it: inside its pod's cgroup, or
/// directly in a configured parent outside a pod.
fn check_placement(
    path: &str,
    comps: &[String],
    shown: &str,
    ctx: &Context,
    ident: &Identity,
    f: &mut Findings,
) {
    let at = "/linux/cgroupsPath";
    let id = ctx.container_id;
    let systemd = ctx.systemd_cgroup;
    let last = comps.last().map(String::as_str).unwrap_or("");
    match ident {
        Identity::Member(sb) => match sb.pod_cgroup() {
            None => f.refuse(format!(
                "{at}: the pod sandbox {}'s cgroup /{} (by runc's record) is not in a cgroup of pod {}: none is given to its containers",
                sb.id,
                sb.cgroup.join("/"),
                sb.pod.uid
            )),
            Some(pod) => {
                if comps.len() <= pod.len()
                    || !comps.starts_with(pod)
                    || comps.starts_with(&sb.cgroup)
                {
                    f.refuse(format!(
                        "{at}: {path:?} ({shown}) is not inside its pod's cgroup /{} (pod {}, by runc's record of sandbox {})",
                        pod.join("/"),
                        sb.pod.uid,
                        sb.id
                    ));
                }
            }
        },
        // identify() admitted the sandbox only with its cgroup directly in its own
        // pod's cgroup below a kubepods root, that pod's only one, still empty.
        Identity::OwnSandbox { .. } => {}
        // Outside a pod: the container's own cgroup directly in a configured
        // parent, named by its id (`<parent>/<id>`, podman's `libpod-<id>`, systemd's
        // `<prefix>-<id>.scope`), never inside another container's cgroup.
        Identity::Outside => {
            let parents = &ctx.policy().cgroup_parents;
            let own_name = if systemd {
                true // `<prefix>-<id>.scope`, checked above
            } else {
                last == id || last == format!("libpod-{id}")
            };
            let inside = parents.iter().any(|p| {
                identity::parent_components(p)
                    .is_ok_and(|p| comps.len() == p.len() + 1 && comps.starts_with(&p))
            });
            if !inside || !own_name {
                f.refuse(format!(
                    "{at}: {path:?} ({shown}) is not in a pod (no running sandbox named): it must be directly in a configured cgroup parent (policy.cgroup_parents: {}) and named by this container's id ({id}, libpod-{id}, or slice:prefix:{id} with systemd)",
                    parents.join(", ")
                ));
            }
        }
    }
}

pub use crate::host::root_owned_chain;

/// A bind source: root-owned, below directories as [`root_owned_chain`] wants them. A
/// regular file may itself be writable by others: kubelet makes every container's
/// termination-log file 0666 so that a non-root process can write its message, and
/// writing a file's content cannot swap a component of its path.
fn bind_source_chain(host: &dyn HostView, path: &Path) -> Result<(), ChainError> {
    let m = host.lstat(path).map_err(|source| ChainError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if !m.is_file() {
        return root_owned_chain(host, path);
    }
    if m.uid() != 0 {
        return Err(ChainError::NotRoot {
            path: path.to_path_buf(),
            uid: m.uid(),
        });
    }
    path.parent().map_or(Ok(()), |p| root_owned_chain(host, p))
}

/// `root.path`: inside the bundle (containerd, `ctr`), or the container's own rootfs
/// in a configured container-storage root as the engine recorded it (podman:
/// [`storage_rootfs`]), only when the bundle is that container's own userdata in the
/// same store; root-owned all the way up; runc gets the canonical path.
fn root_path(spec: &mut Value, ctx: &Context, f: &mut Findings) {
    let Some(path) = spec.pointer("/root/path").and_then(Value::as_str) else {
        return; // check_root refuses a missing root
    };
    let full = if Path::new(path).is_absolute() {
        PathBuf::from(path)
    } else {
        ctx.bundle.join(path)
    };
    let Ok(canon) = ctx.host.canonicalize(&full) else {
        return; // check_root reports it
    };
    let bundle = ctx
        .host
        .canonicalize(ctx.bundle)
        .unwrap_or_else(|_| ctx.bundle.to_path_buf());
    let c = canon.to_string_lossy().into_owned();
    let inside_bundle = canon != bundle && canon.starts_with(&bundle);
    let storage = ctx
        .policy()
        .container_storage_roots
        .iter()
        .find(|r| is_under(&c, &normalize(&r.to_string_lossy())));
    match (inside_bundle, storage) {
        (true, _) => {}
        (false, Some(r)) => {
            if let Some(why) = in_own_storage(ctx, r, &canon, &bundle) {
                f.refuse(why);
                return;
            }
        }
        (false, None) => {
            f.refuse(format!(
                "/root/path: {c} is neither inside the bundle ({}) nor under a container-storage root (policy.container_storage_roots)",
                bundle.display()
            ));
            return;
        }
    }
    if let Err(e) = root_owned_chain(ctx.host, &canon) {
        f.refuse(format!("/root/path: {e}"));
        return;
    }
    // A relative path that names the same directory stays as written (runc
    // resolves it in the bundle, whose ancestors were just found root-owned).
    let same = !Path::new(path).is_absolute() && bundle.join(path) == canon;
    if !same && let Some(root) = spec.get_mut("root").and_then(Value::as_object_mut) {
        root.insert("path".into(), json!(c));
    }
}

/// Why `canon`, a `root.path` under the container-storage root `r`, is not this
/// container's own rootfs there (the bundle its own userdata, the engine's record).
fn in_own_storage(ctx: &Context, r: &Path, canon: &Path, bundle: &Path) -> Option<String> {
    let c = canon.to_string_lossy();
    let root = ctx.host.canonicalize(r).unwrap_or_else(|_| r.to_path_buf());
    // Ids are unique per runc root only: the store's record of this id is
    // this container's only when podman runs it, with its own userdata
    // directory in that store as the bundle.
    let own_bundle = STORAGE_DRIVERS.iter().any(|d| {
        root.join(format!("{d}-containers"))
            .join(ctx.container_id)
            .join("userdata")
            == bundle
    });
    if !own_bundle || component(Some(ctx.container_id)).is_none() {
        return Some(format!(
            "/root/path: {c} is in the container storage {}, but the bundle {} is not this container's own userdata there (<driver>-containers/{}/userdata)",
            root.display(),
            bundle.display(),
            ctx.container_id
        ));
    }
    match storage_rootfs(ctx.host, &root, ctx.container_id) {
        Ok(own) if own == canon => {}
        Ok(own) => {
            return Some(format!(
                "/root/path: {c} is not this container's own rootfs in {} ({} by the engine's record)",
                root.display(),
                own.display()
            ));
        }
        Err(e) => {
            return Some(format!(
                "/root/path: {c} is in the container storage {}, but this container's rootfs there is not known: {e}",
                root.display()
            ));
        }
    }
    None
}

/// Why a container's rootfs in a containers-storage store is not known.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("{0:?} is not a container id")]
    NotAnId(String),
    #[error(transparent)]
    File(#[from] crate::bundle::BundleError),
    #[error("{} is writable by others", .0.display())]
    Writable(PathBuf),
    #[error(transparent)]
    Chain(#[from] ChainError),
    #[error("{}: {source}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}: layer {layer:?} is not a plain id", path.display())]
    Layer { path: PathBuf, layer: String },
    #[error("no <driver>-containers/containers.json (overlay, vfs or btrfs)")]
    NoStore,
    #[error("{id} is not in {files}")]
    NotIn { id: String, files: String },
}

/// Largest containers-storage `containers.json` read.
const MAX_CONTAINERS_JSON: u64 = 64 * 1024 * 1024;

/// Where containers/storage (podman, buildah, CRI-O) mounts a layer, by driver.
fn layer_rootfs(root: &Path, driver: &str, layer: &str) -> Option<PathBuf> {
    Some(match driver {
        "overlay" => root.join("overlay").join(layer).join("merged"),
        "vfs" => root.join("vfs/dir").join(layer),
        "btrfs" => root.join("btrfs/subvolumes").join(layer),
        _ => return None,
    })
}

/// Container `id`'s own rootfs in the containers/storage store at `root` (canonical):
/// the layer `<driver>-containers/containers.json` (root-owned, read without
/// following a symlink) records for this id, where the driver mounts it.
pub fn storage_rootfs(host: &dyn HostView, root: &Path, id: &str) -> Result<PathBuf, StorageError> {
    if component(Some(id)).is_none() {
        return Err(StorageError::NotAnId(id.to_string()));
    }
    let mut seen = Vec::new();
    for driver in ["overlay", "vfs", "btrfs"] {
        let file = root.join(format!("{driver}-containers/containers.json"));
        if host.lstat(&file).is_err() {
            continue;
        }
        let (bytes, mode) = host.read_file(&file, MAX_CONTAINERS_JSON)?;
        if mode & 0o022 != 0 {
            return Err(StorageError::Writable(file));
        }
        root_owned_chain(host, &file)?;
        let list: Value = match serde_json::from_slice(&bytes) {
            Ok(v) => v,
            Err(source) => return Err(StorageError::Json { path: file, source }),
        };
        let layer = list
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c.get("id").and_then(Value::as_str) == Some(id))
            .and_then(|c| c.get("layer").and_then(Value::as_str));
        match layer {
            Some(l) if component(Some(l)).is_some() => {
                if let Some(p) = layer_rootfs(root, driver, l) {
                    return Ok(p);
                }
            }
            Some(l) => {
                return Err(StorageError::Layer {
                    path: file.clone(),
                    layer: l.to_string(),
                });
            }
            None => seen.push(file.display().to_string()),
        }
    }
    if seen.is_empty() {
        Err(StorageError::NoStore)
    } else {
        Err(StorageError::NotIn {
            id: id.to_string(),
            files: seen.join(", "),
        })
    }
}

/// Kernel filesystems get fixed, safe options whatever the spec asked.
fn kernel_mounts(spec: &mut Value, f: &mut Findings) {
    let Some(list) = spec.get_mut("mounts").and_then(Value::as_array_mut) else {
        return;
    };
    for m in list.iter_mut() {
        let ty = m
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let fixed: &[&str] = match ty.as_str() {
            "proc" => &["nosuid", "noexec", "nodev"],
            "sysfs" => &["nosuid", "noexec", "nodev", "ro"],
            "cgroup" | "cgroup2" => &["nosuid", "noexec", "nodev", "relatime", "ro"],
            "mqueue" => &["nosuid", "noexec", "nodev"],
            "devpts" => &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
            ],
            _ => continue,
        };
        let mut opts: Vec<String> = fixed.iter().map(|s| (*s).to_string()).collect();
        // A devpts gid (the tty group) is kept; nothing else of the spec's.
        if ty == "devpts"
            && let Some(gid) = m
                .get("options")
                .and_then(strings)
                .unwrap_or_default()
                .into_iter()
                .find(|o| o.starts_with("gid="))
        {
            opts.push(gid);
        }
        let asked = m.get("options").and_then(strings).unwrap_or_default();
        if asked.iter().any(|o| o == "rw") && fixed.contains(&"ro") {
            let dest = m.get("destination").and_then(Value::as_str).unwrap_or("?");
            f.note(format!("{ty} at {dest} asked rw: mounted read-only"));
        }
        if let Some(o) = m.as_object_mut() {
            o.insert("options".into(), json!(opts));
        }
    }
}

/// An id from an annotation, usable as one path component.
fn component(s: Option<&str>) -> Option<&str> {
    s.filter(|s| {
        !s.is_empty()
            && s.len() <= 128
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && *s != "."
            && *s != ".."
    })
}

/// containers/storage's drivers: a container's files live in `<driver>-containers`.
const STORAGE_DRIVERS: &[&str] = &["overlay", "vfs", "btrfs", "zfs", "aufs", "devmapper"];

/// The prefixes this container's bind sources may come from, with whether a writable
/// bind is allowed. The pod's directories (containerd's sandbox files, kubelet's pod
/// directory) follow from the pod's identity as runc recorded it, never from the
/// spec's claims: a container outside a pod gets none.
pub fn bind_prefixes(ctx: &Context, ident: &Identity) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let bundle = ctx
        .host
        .canonicalize(ctx.bundle)
        .unwrap_or_else(|_| ctx.bundle.to_path_buf());
    out.push((bundle.to_string_lossy().into_owned(), true));
    let p = ctx.policy();
    // containerd's sandbox files of the pod: only for a container the CRI made (its
    // bundle is containerd's task directory for this id, under the CRI's runc root).
    if let Some(sid) = component(ident.sandbox_id())
        && is_cri_task_bundle(ctx, &bundle)
    {
        for root in [&p.containerd_root, &p.containerd_state] {
            let dir = root.join("io.containerd.grpc.v1.cri/sandboxes").join(sid);
            out.push((normalize(&dir.to_string_lossy()), true));
        }
    }
    // kubelet's pod directory for the pod's containers (the sandbox mounts none).
    let member_pod = match ident {
        Identity::Member(s) => Some(s.pod.uid.as_str()),
        _ => None,
    };
    if let Some(uid) = component(member_pod) {
        let dir = p.kubelet_root.join("pods").join(uid);
        out.push((normalize(&dir.to_string_lossy()), true));
    }
    // podman: only when this bundle is the container's own userdata in a
    // containers-storage store (podman passes `<graphroot>/<driver>-containers/<id>/
    // userdata` as --bundle): its run directory's files podman writes for the
    // container (hosts, hostname, resolv.conf, .containerenv) writable, the rest of
    // that directory (conmon.pid, pidfile, ...) read-only.
    if let Some(driver) = storage_bundle_driver(ctx, &bundle) {
        for root in &p.container_run_roots {
            let dir = root
                .join(format!("{driver}-containers"))
                .join(ctx.container_id)
                .join("userdata");
            out.push((normalize(&dir.to_string_lossy()), false));
            for file in RUN_DIR_FILES {
                out.push((normalize(&dir.join(file).to_string_lossy()), true));
            }
        }
    }
    for b in &p.bind_sources {
        out.push((normalize(&b.path.to_string_lossy()), b.writable));
    }
    out
}

/// The files of podman's run directory (`<runroot>/<driver>-containers/<id>/userdata`)
/// a container may have writable: what podman writes for the container's /etc and
/// /run. Never conmon.pid, pidfile or the directory itself.
pub const RUN_DIR_FILES: &[&str] = &["hosts", "hostname", "resolv.conf", ".containerenv"];

/// Whether `bundle` (canonical) is containerd's task directory of this container
/// under the CRI's runc root: `<containerd_state>/io.containerd.runtime.v2.task/
/// <namespace>/<id>`, the namespace being the CRI runc root's last component
/// (`/run/containerd/runc/k8s.io`: `k8s.io`).
pub fn is_cri_task_bundle(ctx: &Context, bundle: &Path) -> bool {
    let Some(root) = identity::trusted_cri_root(ctx.host, ctx.runc_root, ctx.policy()) else {
        return false;
    };
    let Some(ns) = root.file_name() else {
        return false;
    };
    let state = &ctx.policy().containerd_state;
    let state = ctx
        .host
        .canonicalize(state)
        .unwrap_or_else(|_| state.clone());
    component(Some(ctx.container_id)).is_some()
        && bundle
            == state
                .join("io.containerd.runtime.v2.task")
                .join(ns)
                .join(ctx.container_id)
}

/// The containers/storage driver when `bundle` (canonical) is this container's own
/// userdata directory in a configured store, `<graphroot>/<driver>-containers/<id>/
/// userdata`: what podman passes as --bundle.
pub fn storage_bundle_driver(ctx: &Context, bundle: &Path) -> Option<&'static str> {
    let id = component(Some(ctx.container_id))?;
    ctx.policy().container_storage_roots.iter().find_map(|r| {
        let root = ctx.host.canonicalize(r).unwrap_or_else(|_| r.clone());
        STORAGE_DRIVERS.iter().copied().find(|driver| {
            bundle
                == root
                    .join(format!("{driver}-containers"))
                    .join(id)
                    .join("userdata")
        })
    })
}

/// Where `path` (canonical) lies in an engine's tree of per-container directories
/// (containerd's task directories `<containerd_state>/io.containerd.runtime.v2.task/
/// <ns>/<id>`, containers-storage's `<driver>-containers/<id>/userdata` in its stores
/// and run roots): the first component below that container's directory, or `""`
/// when `path` is the directory itself or above it. `None` outside those trees.
fn engine_file(ctx: &Context, path: &Path) -> Option<String> {
    let p = ctx.policy();
    let canon = |r: &Path| ctx.host.canonicalize(r).unwrap_or_else(|_| r.to_path_buf());
    let rel = |base: &Path| -> Option<Vec<String>> {
        Some(
            path.strip_prefix(base)
                .ok()?
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect(),
        )
    };
    // <state>/io.containerd.runtime.v2.task/<ns>/<id>/<file>
    if let Some(c) = rel(&canon(&p.containerd_state).join("io.containerd.runtime.v2.task")) {
        return Some(c.get(2).cloned().unwrap_or_default());
    }
    for root in p
        .container_storage_roots
        .iter()
        .chain(&p.container_run_roots)
    {
        let root = canon(root);
        for driver in STORAGE_DRIVERS {
            // <root>/<driver>-containers/<id>/userdata/<file>
            if let Some(c) = rel(&root.join(format!("{driver}-containers"))) {
                return Some(c.get(2).cloned().unwrap_or_default());
            }
        }
    }
    None
}

/// Files in a bundle that the runtime, runc, containerd's shim or podman's conmon read
/// or keep: never bind-mounted writable (`config.json` is what the runtime trusts on
/// `exec` and `update`; the rest are pids, sockets and logs of the engine).
pub const BUNDLE_FILES: &[&str] = &[
    "config.json",
    "state.json",
    "log.json",
    "init.pid",
    "options.json",
    "runtime",
    "address",
    "shim.pid",
    "shim-binary-path",
    "bootstrap.json",
    "work",
    "pidfile",
    "conmon.pid",
    "ctl",
    "winsz",
    "attach",
    "oci-log",
    "ctr.log",
    "exit",
];

/// Tessera's own paths: never bind-mounted, whatever a prefix allows.
fn own_paths(ctx: &Context) -> Vec<String> {
    let mut v = vec![
        "/run/tessera".to_string(),
        "/var/lib/tessera".to_string(),
        "/etc/tessera".to_string(),
    ];
    // runc's state (the records identity is read from) and the runtime's own.
    for dir in [ctx.runc_root, ctx.config.state_dir.as_path()] {
        let c = ctx
            .host
            .canonicalize(dir)
            .unwrap_or_else(|_| dir.to_path_buf());
        v.push(normalize(&c.to_string_lossy()));
    }
    if let Some(dir) = ctx.config.daemon_socket.parent() {
        v.push(normalize(&dir.to_string_lossy()));
    }
    v
}

/// Bind sources: the canonical host path must lie under an allowed prefix (read-only
/// where the prefix says so), never under Tessera's own paths, with every ancestor
/// root-owned; runc is handed that canonical path, so no component can be swapped
/// between this check and its mount.
fn bind_sources(spec: &mut Value, ctx: &Context, ident: &Identity, f: &mut Findings) {
    let bundle = ctx
        .host
        .canonicalize(ctx.bundle)
        .unwrap_or_else(|_| ctx.bundle.to_path_buf());
    let scope = BindScope {
        prefixes: bind_prefixes(ctx, ident),
        bundle: normalize(&bundle.to_string_lossy()),
        own: own_paths(ctx),
        rootfs: spec.pointer("/root/path").and_then(Value::as_str).map(|p| {
            let full = if Path::new(p).is_absolute() {
                PathBuf::from(p)
            } else {
                ctx.bundle.join(p)
            };
            normalize(&full.to_string_lossy())
        }),
    };
    let Some(list) = spec.get_mut("mounts").and_then(Value::as_array_mut) else {
        return;
    };
    for (i, m) in list.iter_mut().enumerate() {
        if let Some(c) = scope.judge(i, m, ctx, f)
            && let Some(o) = m.as_object_mut()
        {
            o.insert("source".into(), json!(c));
        }
    }
}

/// Where a container's bind sources may come from, and what they may never be.
struct BindScope {
    /// Allowed prefixes, each with whether it may be bound writable.
    prefixes: Vec<(String, bool)>,
    /// The bundle, canonical.
    bundle: String,
    /// Tessera's own paths.
    own: Vec<String>,
    /// The container's rootfs (as written), normalized.
    rootfs: Option<String>,
}

impl BindScope {
    /// A bind mount's source judged: its canonical path, to write in its place; `None`
    /// for a mount that is not a bind mount or is refused.
    fn judge(&self, i: usize, m: &Value, ctx: &Context, f: &mut Findings) -> Option<String> {
        let ty = m.get("type").and_then(Value::as_str).unwrap_or("");
        let options = m.get("options").and_then(strings).unwrap_or_default();
        let bind = ty == "bind" || options.iter().any(|o| o == "bind" || o == "rbind");
        if !bind {
            return None;
        }
        let at = format!("/mounts/{i}/source");
        let Some(source) = m.get("source").and_then(Value::as_str) else {
            f.refuse(format!("{at}: a bind mount needs a source"));
            return None;
        };
        if !source.starts_with('/') {
            return None; // mounts.rs refuses relative sources
        }
        // Never resolve a path inside the container's rootfs as root: its symlinks
        // are the tenant's.
        if let Some(rootfs) = &self.rootfs
            && is_under(&normalize(source), rootfs)
        {
            f.refuse(format!("{at}: {source} is inside the container's rootfs"));
            return None;
        }
        let canon = match ctx.host.canonicalize(Path::new(source)) {
            Ok(c) => c,
            Err(e) => {
                f.refuse(format!("{at}: {source}: {e}"));
                return None;
            }
        };
        let c = canon.to_string_lossy().into_owned();
        let readonly = options.iter().any(|o| o == "ro");
        let refused = self
            .protected(&c, &canon, readonly, ctx)
            .or_else(|| self.not_allowed(&c, readonly))
            .or_else(|| {
                bind_source_chain(ctx.host, &canon)
                    .err()
                    .map(|e| e.to_string())
            });
        if let Some(why) = refused {
            f.refuse(format!("{at}: {why}"));
            return None;
        }
        Some(c)
    }

    /// Why `c` may never be bound (writable): Tessera's own paths, the bundle or above
    /// it, a file of the bundle or of any container's engine directory.
    fn protected(&self, c: &str, canon: &Path, readonly: bool, ctx: &Context) -> Option<String> {
        if let Some(o) = self.own.iter().find(|o| is_under(c, o)) {
            return Some(format!("{c} is under Tessera's own {o}"));
        }
        let bundle = &self.bundle;
        if is_under(bundle, c) {
            return Some(format!(
                "{c} is the bundle or a directory above it: the runtime and the engine keep files there that they trust later"
            ));
        }
        if is_under(c, bundle)
            && !readonly
            && let Some(name) = Path::new(c)
                .strip_prefix(bundle)
                .ok()
                .and_then(|rel| rel.components().next())
                .map(|first| first.as_os_str().to_string_lossy().into_owned())
            && (BUNDLE_FILES.contains(&name.as_str()) || name.starts_with(".config.json"))
        {
            return Some(format!(
                "{c} is the bundle's {name}, which the runtime or the engine reads later: never bind-mounted writable"
            ));
        }
        // Any container's engine directory (another's bundle, podman's run
        // directory), wherever a prefix allows it: its files are the engine's.
        let name = (!readonly).then(|| engine_file(ctx, canon)).flatten()?;
        if name.is_empty() {
            return Some(format!(
                "{c} is (or holds) a container's directory of the engine: never bind-mounted writable"
            ));
        }
        (BUNDLE_FILES.contains(&name.as_str()) || name.starts_with(".config.json")).then(|| {
            format!(
                "{c} is a container's {name}, which the runtime or the engine reads later: never bind-mounted writable"
            )
        })
    }

    /// Why `c` is not under an allowed prefix (writable where it is bound writable).
    fn not_allowed(&self, c: &str, readonly: bool) -> Option<String> {
        let allowed = self
            .prefixes
            .iter()
            .filter(|(p, _)| is_under(c, p))
            .map(|(_, w)| *w)
            .max();
        match allowed {
            None => Some(format!(
                "{c} is not under this container's bundle, its pod's sandbox or kubelet directories, or an operator-allowed prefix (policy.bind_sources)"
            )),
            Some(false) if !readonly => Some(format!(
                "{c} may be bind-mounted read-only only (add \"ro\")"
            )),
            Some(_) => None,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_indices_and_keys() {
        assert!(matches("/mounts/*/source", "/mounts/12/source"));
        assert!(!matches("/mounts/*/source", "/mounts/12/source/x"));
        assert_eq!(lookup("/linux/intelRdt").unwrap().class, Refused);
        assert!(lookup("/linux/futureField").is_none());
    }

    proptest::proptest! {
        /// The indexed lookup picks the same row as the first match in the table,
        /// for paths made of the table's own segments, indices and other keys.
        #[test]
        fn lookup_is_the_first_matching_row(
            picks in proptest::collection::vec((0usize..TABLE.len(), 0usize..8, 0u8..4), 1..7),
        ) {
            let mut path = String::new();
            for (row, depth, kind) in picks {
                let segs: Vec<&str> = TABLE[row].path.split('/').skip(1).collect();
                let seg = match kind {
                    0 => "7".to_string(),
                    1 => "futureField".to_string(),
                    2 => String::new(),
                    _ => segs.get(depth % segs.len().max(1)).copied().unwrap_or("x").to_string(),
                };
                path.push('/');
                path.push_str(&seg);
            }
            let linear = TABLE.iter().find(|r| matches(r.path, &path)).map(|r| r.path);
            proptest::prop_assert_eq!(lookup(&path).map(|r| r.path), linear, "{}", path);
        }
    }

    #[test]
    fn every_row_is_found_by_its_own_path() {
        for (i, row) in TABLE.iter().enumerate() {
            let concrete = row.path.replace('*', "3");
            let first = TABLE.iter().position(|r| matches(r.path, &concrete));
            assert_eq!(
                lookup(&concrete).map(|r| r.path),
                first.map(|j| TABLE[j].path),
                "{concrete}"
            );
            assert!(first.is_some_and(|j| j <= i), "{concrete}");
        }
    }

    #[test]
    fn unknown_and_refused_fields_are_named_by_path() {
        let spec = json!({
            "ociVersion": "1.0.2",
            "vm": {"hypervisor": {}},
            "linux": {"intelRdt": {"closID": "x"}, "resources": {"memory": {"limit": 1}}},
            "process": {"args": ["sh"], "user": {"uid": 0, "gid": 0}, "newThing": 1},
            "mounts": [{"destination": "/x", "type": "bind", "source": "/y", "uidMappings": []}],
        });
        let mut f = Findings::default();
        walk(&spec, "", &mut f);
        let all = f.reasons.join("\n");
        assert!(
            all.contains("/vm: not in the runtime's policy table"),
            "{all}"
        );
        assert!(all.contains("/linux/intelRdt: refused"), "{all}");
        assert!(all.contains("/process/newThing: not in"), "{all}");
        assert!(all.contains("/mounts/0/uidMappings: refused"), "{all}");
        assert_eq!(f.reasons.len(), 4, "{all}");
    }

    /// docs/security.md lists the table field by field: every row, with its class.
    #[test]
    fn the_security_doc_lists_every_row() {
        let doc = include_str!("../../../docs/security.md");
        for row in TABLE {
            let class = match row.class {
                Copied => "copied",
                Checked => "checked",
                Rewritten => "rewritten",
                Refused => "**refused**",
            };
            let line = format!("| `{}` | {class} |", row.path);
            assert!(doc.contains(&line), "docs/security.md lacks {line}");
        }
    }

    #[test]
    fn every_row_has_a_reason_and_a_unique_path() {
        let mut seen = std::collections::HashSet::new();
        for row in TABLE {
            assert!(!row.why.is_empty(), "{}", row.path);
            assert!(seen.insert(row.path), "duplicate row {}", row.path);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod sandbox_tests {
    use super::super::is_cri_sandbox;
    use crate::policy::Policy;
    use serde_json::json;

    #[test]
    fn only_a_consistent_sandbox_spec_is_exempt() {
        let p = Policy::default();
        let real = json!({
            "annotations": {"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-id": "abc"},
            "process": {"capabilities": {"bounding": ["CAP_CHOWN", "CAP_NET_RAW"]}},
        });
        assert!(is_cri_sandbox(&real, "abc", &p));
        assert!(
            !is_cri_sandbox(&real, "other-container", &p),
            "the id must be the sandbox's"
        );
        let mut devices = real.clone();
        devices["linux"] =
            json!({"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]});
        assert!(!is_cri_sandbox(&devices, "abc", &p));
        let mut caps = real.clone();
        caps["process"]["capabilities"]["bounding"] = json!(["SYS_ADMIN"]);
        assert!(!is_cri_sandbox(&caps, "abc", &p));
        let claim_only = json!({"annotations": {"io.kubernetes.cri.container-type": "sandbox"}});
        assert!(!is_cri_sandbox(&claim_only, "abc", &p));
    }
}
