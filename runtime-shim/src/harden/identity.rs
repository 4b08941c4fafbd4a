//! Who a container is, from state the tenant cannot write.
//!
//! A spec's annotations are the tenant's (see docs/security.md, the threat model): the
//! pod and sandbox a container names are only claims. A claim is believed when runc's
//! own record of the sandbox, `<--root>/<sandbox id>/state.json` (root-owned, written
//! by runc when the sandbox was created), says the same: that container is a pod
//! sandbox by its own annotations (runc keeps them as `labels`), it is still running
//! (its init pid alive with the start time runc recorded), and its pod (uid, namespace,
//! name) is the one the container claims. Every pod-scoped privilege follows from
//! that record, never from the container's spec: the namespaces it may join (the
//! sandbox's init process only), the cgroup it may be put in (below the sandbox's pod
//! cgroup as runc recorded it), the kubelet and CRI directories it may mount. A
//! container that names no sandbox gets none of them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::base::{Context, Findings};
use crate::host::HostView;
use crate::policy::Policy;

/// containerd CRI's annotation: `sandbox` or `container`.
pub const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
/// containerd CRI's annotation: the pod sandbox's container id.
pub const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// containerd CRI's annotation: the pod's uid.
pub const SANDBOX_UID: &str = "io.kubernetes.cri.sandbox-uid";
/// containerd CRI's annotation: the pod's namespace.
pub const SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";
/// containerd CRI's annotation: the pod's name.
pub const SANDBOX_NAME: &str = "io.kubernetes.cri.sandbox-name";

/// Which fact of a pod an annotation claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fact {
    Uid,
    Namespace,
    Name,
}

/// Annotations that claim something of a pod, and what.
const POD_CLAIMS: &[(&str, Fact)] = &[
    (SANDBOX_UID, Fact::Uid),
    ("io.kubernetes.pod.uid", Fact::Uid),
    (SANDBOX_NAMESPACE, Fact::Namespace),
    ("io.kubernetes.pod.namespace", Fact::Namespace),
    (SANDBOX_NAME, Fact::Name),
    ("io.kubernetes.pod.name", Fact::Name),
];

/// Largest runc state file read (runc's are a few KiB; a spec's annotations count).
pub const MAX_STATE_BYTES: u64 = 4 * 1024 * 1024;

/// A Kubernetes pod, as its sandbox's record names it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pod {
    pub uid: String,
    pub namespace: String,
    pub name: String,
}

impl Pod {
    fn fact(&self, f: Fact) -> &str {
        match f {
            Fact::Uid => &self.uid,
            Fact::Namespace => &self.namespace,
            Fact::Name => &self.name,
        }
    }
}

/// A running pod sandbox, from runc's record of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    pub id: String,
    pub pod: Pod,
    /// runc's init process of the sandbox and its start time (clock ticks after boot,
    /// field 22 of /proc/<pid>/stat), as runc recorded them and still true.
    pub init_pid: u32,
    pub init_start: u64,
    /// The sandbox's own cgroup, as components below the hierarchy's root.
    pub cgroup: Vec<String>,
    /// The pod's cgroup: the sandbox's cgroup's parent, directly below a configured
    /// kubepods root in kubelet's layout for the pod's uid ([`pod_cgroups`]).
    pub pod_cgroup: Vec<String>,
}

impl Sandbox {
    /// The pod's cgroup, as [`read_sandbox`] found it.
    pub fn pod_cgroup(&self) -> Option<&[String]> {
        Some(&self.pod_cgroup)
    }
}

/// Who a container is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// Not in a pod: no pod-scoped privileges.
    Outside,
    /// A pod's sandbox (pause) container itself, being created: the first container of
    /// its pod, whose identity the CRI writes into its spec.
    OwnSandbox { id: String, pod: Pod },
    /// A container of the pod whose running sandbox runc records under `--root`.
    Member(Sandbox),
}

impl Identity {
    /// The pod sandbox's id (its own, for the sandbox).
    pub fn sandbox_id(&self) -> Option<&str> {
        match self {
            Identity::Outside => None,
            Identity::OwnSandbox { id, .. } => Some(id),
            Identity::Member(s) => Some(&s.id),
        }
    }

    /// The pod.
    pub fn pod(&self) -> Option<&Pod> {
        match self {
            Identity::Outside => None,
            Identity::OwnSandbox { pod, .. } => Some(pod),
            Identity::Member(s) => Some(&s.pod),
        }
    }
}

fn annotation<'v>(spec: &'v Value, key: &str) -> Option<&'v str> {
    spec.get("annotations")?
        .get(key)?
        .as_str()
        .filter(|v| !v.is_empty())
}

/// An id usable as one path component.
pub fn is_component(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s != "."
        && s != ".."
}

/// Who the container `ctx.container_id` with `spec` is; a claim that runc's state does
/// not bear out is refused (and the container is then `Outside`).
pub fn identify(spec: &Value, ctx: &Context, f: &mut Findings) -> Identity {
    let claimed_sandbox = annotation(spec, SANDBOX_ID);
    let claims: Vec<(&str, Fact, &str)> = POD_CLAIMS
        .iter()
        .filter_map(|(k, fact)| annotation(spec, k).map(|v| (*k, *fact, v)))
        .collect();
    let is_sandbox = annotation(spec, CONTAINER_TYPE) == Some("sandbox");
    // Only the CRI makes pods: a container made under any other runc root (`ctr`,
    // podman, a direct call) is in no pod, whatever its spec claims.
    if (is_sandbox || claimed_sandbox.is_some() || !claims.is_empty())
        && trusted_cri_root(ctx.host, ctx.runc_root, ctx.policy()).is_none()
    {
        f.refuse(format!(
            "/annotations: the spec names a pod, but --root {} is not the CRI's runc root (policy.cri_runc_roots: {}): only the CRI makes a pod's containers",
            ctx.runc_root.display(),
            ctx.policy()
                .cri_runc_roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
        return Identity::Outside;
    }
    if is_sandbox {
        return identify_sandbox(spec, ctx, claimed_sandbox, &claims, f);
    }
    let Some(sid) = claimed_sandbox else {
        if let Some((k, _, _)) = claims.first() {
            f.refuse(format!(
                "/annotations/{}: the spec names a pod but no sandbox ({SANDBOX_ID}); a pod's container is known by its running sandbox",
                k.replace('/', "~1")
            ));
        }
        return Identity::Outside;
    };
    identify_member(ctx, sid, &claims, f)
}

/// A spec that says it is a pod sandbox: its own, the CRI's, for one pod that has no
/// other running sandbox.
fn identify_sandbox(
    spec: &Value,
    ctx: &Context,
    claimed_sandbox: Option<&str>,
    claims: &[(&str, Fact, &str)],
    f: &mut Findings,
) -> Identity {
    let id = ctx.container_id;
    if claimed_sandbox != Some(id) {
        f.refuse(format!(
            "/annotations: the spec says it is a pod sandbox ({CONTAINER_TYPE}) but its {SANDBOX_ID} is not its own id {id:?}"
        ));
        return Identity::Outside;
    }
    if !super::base::is_cri_sandbox(spec, id, ctx.policy()) {
        f.refuse(
            "/annotations: the spec says it is a pod sandbox but asks for devices or forbidden capabilities a sandbox never has",
        );
        return Identity::Outside;
    }
    let Some(pod) = own_pod(claims, f) else {
        return Identity::Outside;
    };
    if !check_own_sandbox(spec, ctx, &pod, f) {
        return Identity::Outside;
    }
    Identity::OwnSandbox {
        id: id.to_string(),
        pod,
    }
}

/// A container of the pod of running sandbox `sid`, as runc's record of it says; what
/// the spec claims of the pod must be what that record says.
fn identify_member(
    ctx: &Context,
    sid: &str,
    claims: &[(&str, Fact, &str)],
    f: &mut Findings,
) -> Identity {
    let id = ctx.container_id;
    let at = format!("/annotations/{}", SANDBOX_ID.replace('/', "~1"));
    if !is_component(sid) || sid == id {
        f.refuse(format!("{at}: {sid:?} is not another container's id"));
        return Identity::Outside;
    }
    let sandbox = match read_sandbox(ctx.host, ctx.runc_root, sid, ctx.policy()) {
        Ok(s) => s,
        Err(e) => {
            f.refuse(format!("{at}: the pod sandbox {sid} is not known: {e}"));
            return Identity::Outside;
        }
    };
    let mut ok = true;
    for (k, fact, v) in claims {
        let have = sandbox.pod.fact(*fact);
        if *v != have {
            f.refuse(format!(
                "/annotations/{}: {v:?} is not the pod of sandbox {sid} ({have:?} by runc's record)",
                k.replace('/', "~1")
            ));
            ok = false;
        }
    }
    if ok {
        Identity::Member(sandbox)
    } else {
        Identity::Outside
    }
}

/// A sandbox's pod, from its own spec: the uid is required.
fn own_pod(claims: &[(&str, Fact, &str)], f: &mut Findings) -> Option<Pod> {
    let mut pod = Pod::default();
    for (k, fact, v) in claims {
        let slot = match fact {
            Fact::Uid => &mut pod.uid,
            Fact::Namespace => &mut pod.namespace,
            Fact::Name => &mut pod.name,
        };
        if !slot.is_empty() && slot != v {
            f.refuse(format!(
                "/annotations/{}: {v:?} contradicts {slot:?}",
                k.replace('/', "~1")
            ));
            return None;
        }
        *slot = (*v).to_string();
    }
    if pod.uid.is_empty() {
        f.refuse(format!(
            "/annotations: a pod sandbox must name its pod's uid ({SANDBOX_UID})"
        ));
        return None;
    }
    if !is_pod_uid(&pod.uid) {
        f.refuse(format!(
            "/annotations/{}: {:?} is not a pod uid (letters, digits and '-')",
            SANDBOX_UID.replace('/', "~1"),
            pod.uid
        ));
        return None;
    }
    Some(pod)
}

/// A pod uid as Kubernetes makes them (a UUID): letters, digits and `-` only, so that
/// kubelet's systemd escaping (`-` to `_`) maps no two uids to one slice.
pub fn is_pod_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= 128
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The configured CRI runc root (policy.cri_runc_roots) that `root` is, compared
/// canonically; `None` when it is none of them.
pub fn trusted_cri_root<'p>(
    host: &dyn HostView,
    root: &Path,
    policy: &'p Policy,
) -> Option<&'p Path> {
    let canon = canonical_or_planned(host, root)?;
    policy
        .cri_runc_roots
        .iter()
        .find(|r| canonical_or_planned(host, r).is_some_and(|c| c == canon))
        .map(PathBuf::as_path)
}

/// `path` canonical; when it does not exist yet (runc makes its root on the first
/// create of a boot), its nearest existing ancestor canonical with the rest appended,
/// the rest having no `.` or `..`. `None` for a relative path.
pub fn canonical_or_planned(host: &dyn HostView, path: &Path) -> Option<PathBuf> {
    if !path.is_absolute() {
        return None;
    }
    if let Ok(c) = host.canonicalize(path) {
        return Some(c);
    }
    let mut rest = Vec::new();
    let mut cur = path;
    loop {
        match cur.components().next_back()? {
            std::path::Component::Normal(n) => rest.push(n.to_os_string()),
            _ => return None,
        }
        cur = cur.parent()?;
        if let Ok(c) = host.canonicalize(cur) {
            return Some(rest.iter().rev().fold(c, |p, n| p.join(n)));
        }
    }
}

/// Every cgroup kubelet could give pod `uid`, one per configured kubepods root and
/// QoS class: `<root>/pod<uid>`, `<root>/burstable/pod<uid>`,
/// `<root>/besteffort/pod<uid>`; for a slice root `k.slice`,
/// `k-pod<uid>.slice`, `k-burstable-pod<uid>.slice`, `k-besteffort-pod<uid>.slice`
/// (nested as systemd nests them, the uid's `-` written `_`).
pub fn pod_cgroups(uid: &str, policy: &Policy) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    if !is_pod_uid(uid) {
        return out;
    }
    for root in &policy.kubepods_roots {
        let Ok(base) = parent_components(root) else {
            continue;
        };
        if let Some(name) = root.strip_suffix(".slice").filter(|_| !root.contains('/')) {
            let escaped = uid.replace('-', "_");
            let mut guaranteed = base.clone();
            guaranteed.push(format!("{name}-pod{escaped}.slice"));
            out.push(guaranteed);
            for qos in ["burstable", "besteffort"] {
                let mut c = base.clone();
                c.push(format!("{name}-{qos}.slice"));
                c.push(format!("{name}-{qos}-pod{escaped}.slice"));
                out.push(c);
            }
        } else {
            let mut guaranteed = base.clone();
            guaranteed.push(format!("pod{uid}"));
            out.push(guaranteed);
            for qos in ["burstable", "besteffort"] {
                let mut c = base.clone();
                c.push(qos.to_string());
                c.push(format!("pod{uid}"));
                out.push(c);
            }
        }
    }
    out
}

/// The pod cgroup of a sandbox cgroup: its parent, when that is one of pod `uid`'s
/// cgroups in kubelet's layout below a configured kubepods root ([`pod_cgroups`]).
pub fn pod_cgroup_of<'c>(
    sandbox_cgroup: &'c [String],
    uid: &str,
    policy: &Policy,
) -> Option<&'c [String]> {
    let (_, parent) = sandbox_cgroup.split_last()?;
    pod_cgroups(uid, policy)
        .iter()
        .any(|c| c.as_slice() == parent)
        .then_some(parent)
}

/// A pod sandbox being created (the CRI's first container of its pod, under a
/// trusted runc root) must be its pod's only sandbox: its cgroup directly in one of
/// its pod's cgroups below a configured kubepods root, no other QoS class holding a
/// cgroup of that pod, that pod cgroup holding no process yet, and no other running
/// sandbox of the pod under any CRI runc root. `false` (with the reasons) otherwise.
fn check_own_sandbox(spec: &Value, ctx: &Context, pod: &Pod, f: &mut Findings) -> bool {
    let at = "/linux/cgroupsPath";
    let uid = &pod.uid;
    let Some(path) = spec
        .pointer(at)
        .and_then(Value::as_str)
        .filter(|p| !p.is_empty())
    else {
        f.refuse(format!(
            "{at}: a pod sandbox names its cgroup, in its pod's (pod{uid})"
        ));
        return false;
    };
    let comps = match cgroup_components(path, ctx.systemd_cgroup) {
        Ok(c) => c,
        Err(e) => {
            f.refuse(format!("{at}: {e}"));
            return false;
        }
    };
    let policy = ctx.policy();
    let candidates = pod_cgroups(uid, policy);
    let Some(pod_cg) = pod_cgroup_of(&comps, uid, policy) else {
        f.refuse(format!(
            "{at}: {path:?} (/{}): a pod sandbox's cgroup lies directly in its pod's cgroup, directly below a kubepods root (policy.kubepods_roots: {}), e.g. /{}",
            comps.join("/"),
            policy.kubepods_roots.join(", "),
            candidates.first().map(|c| c.join("/")).unwrap_or_default()
        ));
        return false;
    };
    let mut ok = true;
    for other in candidates.iter().filter(|c| c.as_slice() != pod_cg) {
        match cgroup_exists(ctx.host, other) {
            Ok(None) => {}
            Ok(Some(_)) => {
                f.refuse(format!(
                    "{at}: pod {uid} already has a cgroup /{} (another QoS class): a pod has one pod cgroup",
                    other.join("/")
                ));
                ok = false;
            }
            Err(e) => {
                f.refuse(format!("{at}: {e}"));
                ok = false;
            }
        }
    }
    // The sandbox is its pod's first container: a pod cgroup that already holds
    // processes is another pod's (a sandbox claiming its uid).
    match cgroup_has_processes(ctx.host, pod_cg) {
        Ok(false) => {}
        Ok(true) => {
            f.refuse(format!(
                "{at}: the pod cgroup /{} already holds processes: a pod sandbox is the first of its pod",
                pod_cg.join("/")
            ));
            ok = false;
        }
        Err(e) => {
            f.refuse(format!(
                "{at}: cannot tell whether the pod cgroup /{} is empty: {e}",
                pod_cg.join("/")
            ));
            ok = false;
        }
    }
    if let Some(other) = running_sandbox_of(ctx.host, uid, ctx.container_id, policy) {
        f.refuse(format!(
            "/annotations: pod {uid} already has a running sandbox {other}: a pod has one sandbox"
        ));
        ok = false;
    }
    ok
}

/// Most containers looked at under one runc root for another sandbox of a pod.
const MAX_SCANNED: usize = 10_000;

/// A running pod sandbox of pod `uid` other than `except` under any CRI runc root,
/// as `<root>/<id>`.
fn running_sandbox_of(
    host: &dyn HostView,
    uid: &str,
    except: &str,
    policy: &Policy,
) -> Option<String> {
    for root in &policy.cri_runc_roots {
        let Ok(rd) = host.read_dir(root) else {
            continue;
        };
        for e in rd.into_iter().take(MAX_SCANNED) {
            let name = e.name;
            if name == except || !is_component(&name) {
                continue;
            }
            let Ok(st) = read_state(host, root, &name) else {
                continue;
            };
            let label = |k: &str| st.labels.get(k).map(String::as_str);
            if label(CONTAINER_TYPE) == Some("sandbox")
                && label(SANDBOX_UID) == Some(uid)
                && host.proc_start_time(st.init_pid) == Some(st.init_start)
            {
                return Some(format!("{}/{name}", root.display()));
            }
        }
    }
    None
}

/// What runc recorded of a container, as far as identity needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuncState {
    pub id: String,
    pub init_pid: u32,
    pub init_start: u64,
    /// The spec's annotations (`key=value` labels), and runc's own `bundle=`.
    pub labels: BTreeMap<String, String>,
    /// The container's cgroup as components (empty when runc chose it).
    pub cgroup: Vec<String>,
}

/// Read runc's record of container `id` under `root`: `<root>/<id>/state.json`,
/// without following a symlink, at most [`MAX_STATE_BYTES`], root-owned and writable
/// by nobody else all the way up.
pub fn read_state(host: &dyn HostView, root: &Path, id: &str) -> Result<RuncState, RuncStateError> {
    if !is_component(id) {
        return Err(RuncStateError::NotAnId(id.to_string()));
    }
    let root = host
        .canonicalize(root)
        .map_err(|source| RuncStateError::Root {
            path: root.to_path_buf(),
            source,
        })?;
    let path = root.join(id).join("state.json");
    let (bytes, mode) = host.read_file(&path, MAX_STATE_BYTES)?;
    if mode & 0o022 != 0 {
        return Err(RuncStateError::Writable(path));
    }
    crate::host::root_owned_chain(host, &path)?;
    let v: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(source) => return Err(RuncStateError::Json { path, source }),
    };
    parse_state(&v).map_err(|reason| RuncStateError::Fields { path, reason })
}

/// Why runc's record of a container cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum RuncStateError {
    #[error("{0:?} is not a container id")]
    NotAnId(String),
    #[error("{}: {source}", path.display())]
    Root {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    File(#[from] crate::bundle::BundleError),
    #[error("{} is writable by others", .0.display())]
    Writable(PathBuf),
    #[error(transparent)]
    Chain(#[from] crate::host::ChainError),
    #[error("{}: {source}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}: {reason}", path.display())]
    Fields { path: PathBuf, reason: StateError },
}

/// Why a pod sandbox is not known.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(transparent)]
    State(#[from] RuncStateError),
    #[error("runc's record is of {0:?}")]
    OtherRecord(String),
    #[error("{id} is not a pod sandbox by its own record ({CONTAINER_TYPE}={container_type:?})")]
    NotSandbox { id: String, container_type: String },
    #[error("the sandbox {0} names no pod uid")]
    NoPodUid(String),
    #[error(
        "the sandbox {id}'s cgroup /{cgroup} is not directly in a cgroup of its pod {pod} below a kubepods root (policy.kubepods_roots)"
    )]
    NotInPodCgroup {
        id: String,
        cgroup: String,
        pod: String,
    },
    #[error("the sandbox {id} is not running (its init process {init_pid} is gone)")]
    NotRunning { id: String, init_pid: u32 },
}

/// Why the cgroup hierarchies cannot be looked at.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{} is too deep or too wide to look at", .0.display())]
    TooBig(PathBuf),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What a runc state document lacks.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("no {0}")]
    Missing(&'static str),
    #[error("the label {0} is there twice")]
    LabelTwice(String),
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup_names::CgroupNameError),
}

/// The identity-bearing fields of a runc state document.
pub fn parse_state(v: &Value) -> Result<RuncState, StateError> {
    let id = v
        .get("id")
        .and_then(Value::as_str)
        .ok_or(StateError::Missing("id"))?
        .to_string();
    let init_pid = v
        .get("init_process_pid")
        .and_then(Value::as_u64)
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p > 1)
        .ok_or(StateError::Missing("init_process_pid"))?;
    let init_start = v
        .get("init_process_start")
        .and_then(Value::as_u64)
        .ok_or(StateError::Missing("init_process_start"))?;
    let config = v.get("config").ok_or(StateError::Missing("config"))?;
    let mut labels = BTreeMap::new();
    for l in config
        .get("labels")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some((k, val)) = l.as_str().and_then(|l| l.split_once('='))
            && labels.insert(k.to_string(), val.to_string()).is_some()
        {
            return Err(StateError::LabelTwice(k.to_string()));
        }
    }
    let cg = config
        .get("cgroups")
        .ok_or(StateError::Missing("cgroups"))?;
    let s = |k: &str| cg.get(k).and_then(Value::as_str).unwrap_or("");
    let cgroup = if cg.get("Systemd").and_then(Value::as_bool) == Some(true) {
        let parent = if s("parent").is_empty() {
            "system.slice"
        } else {
            s("parent")
        };
        let mut c = expand_slice(parent)?;
        let name = s("name");
        if name.ends_with(".slice") {
            c.push(name.to_string());
        } else {
            c.push(format!("{}-{name}.scope", s("scope_prefix")));
        }
        c
    } else if s("path").is_empty() {
        Vec::new()
    } else {
        cgroupfs_components(s("path"))?
    };
    Ok(RuncState {
        id,
        init_pid,
        init_start,
        labels,
        cgroup,
    })
}

/// Read and check runc's record of the pod sandbox `id`: a sandbox by its own
/// labels, running, with a pod uid and a pod cgroup that names it.
pub fn read_sandbox(
    host: &dyn HostView,
    root: &Path,
    id: &str,
    policy: &Policy,
) -> Result<Sandbox, SandboxError> {
    let st = read_state(host, root, id)?;
    if st.id != id {
        return Err(SandboxError::OtherRecord(st.id));
    }
    let label = |k: &str| st.labels.get(k).map(String::as_str).unwrap_or("");
    if label(CONTAINER_TYPE) != "sandbox" || label(SANDBOX_ID) != id {
        return Err(SandboxError::NotSandbox {
            id: id.to_string(),
            container_type: label(CONTAINER_TYPE).to_string(),
        });
    }
    let pod = Pod {
        uid: label(SANDBOX_UID).to_string(),
        namespace: label(SANDBOX_NAMESPACE).to_string(),
        name: label(SANDBOX_NAME).to_string(),
    };
    if !is_pod_uid(&pod.uid) {
        return Err(SandboxError::NoPodUid(id.to_string()));
    }
    let Some(pod_cgroup) = pod_cgroup_of(&st.cgroup, &pod.uid, policy).map(<[String]>::to_vec)
    else {
        return Err(SandboxError::NotInPodCgroup {
            id: id.to_string(),
            cgroup: st.cgroup.join("/"),
            pod: pod.uid,
        });
    };
    match host.proc_start_time(st.init_pid) {
        Some(t) if t == st.init_start => {}
        _ => {
            return Err(SandboxError::NotRunning {
                id: id.to_string(),
                init_pid: st.init_pid,
            });
        }
    }
    Ok(Sandbox {
        id: st.id,
        pod,
        init_pid: st.init_pid,
        init_start: st.init_start,
        cgroup: st.cgroup,
        pod_cgroup,
    })
}

pub use crate::host::proc_start_time;

/// Whether any process is in cgroup `comps` or below it, in any mounted hierarchy
/// (cgroup v1 controllers, the v2 tree). `Err` when it cannot be told.
pub fn cgroup_has_processes(host: &dyn HostView, comps: &[String]) -> Result<bool, CgroupError> {
    fn walk(
        host: &dyn HostView,
        dir: &Path,
        depth: usize,
        budget: &mut usize,
    ) -> Result<bool, CgroupError> {
        if depth > 16 || *budget == 0 {
            return Err(CgroupError::TooBig(dir.to_path_buf()));
        }
        *budget -= 1;
        let procs = dir.join("cgroup.procs");
        match host.read_to_string(&procs) {
            Ok(t) if t.trim().is_empty() => {}
            Ok(_) => return Ok(true),
            Err(source) => {
                return Err(CgroupError::Io {
                    path: procs,
                    source,
                });
            }
        }
        let rd = host.read_dir(dir).map_err(|source| CgroupError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        for e in rd {
            if e.is_dir && walk(host, &e.path, depth + 1, budget)? {
                return Ok(true);
            }
        }
        Ok(false)
    }
    let mut budget = 4096;
    for point in cgroup_mounts(host)? {
        let dir = point.join(comps.join("/"));
        if host.stat(&dir).is_ok_and(|m| m.is_dir()) && walk(host, &dir, 0, &mut budget)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The mount points of the cgroup hierarchies (v1 controllers, the v2 tree) whose
/// root is the host's.
fn cgroup_mounts(host: &dyn HostView) -> Result<Vec<PathBuf>, CgroupError> {
    let mounts = host
        .read_to_string(Path::new("/proc/self/mountinfo"))
        .map_err(|source| CgroupError::Io {
            path: PathBuf::from("/proc/self/mountinfo"),
            source,
        })?;
    Ok(mounts
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split_whitespace().next().unwrap_or("");
            let root = left.split(' ').nth(3)?;
            let point = left.split(' ').nth(4)?;
            (matches!(fstype, "cgroup" | "cgroup2") && root == "/").then(|| PathBuf::from(point))
        })
        .collect())
}

/// The first directory of cgroup `comps` that exists in any mounted hierarchy, if
/// one does.
pub fn cgroup_exists(
    host: &dyn HostView,
    comps: &[String],
) -> Result<Option<PathBuf>, CgroupError> {
    if comps.is_empty() {
        return Ok(None);
    }
    for point in cgroup_mounts(host)? {
        let dir = point.join(comps.join("/"));
        match host.lstat(&dir) {
            Ok(_) => return Ok(Some(dir)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(CgroupError::Io { path: dir, source }),
        }
    }
    Ok(None)
}

/// Whether a process of this host is in the network namespace `(dev, ino)`.
pub fn netns_in_use(host: &dyn HostView, dev: u64, ino: u64) -> bool {
    let Ok(rd) = host.read_dir(Path::new("/proc")) else {
        return true;
    };
    rd.iter()
        .filter(|e| e.name.bytes().all(|b| b.is_ascii_digit()))
        .any(|e| {
            host.stat(&e.path.join("ns/net"))
                .is_ok_and(|m| (m.dev, m.ino) == (dev, ino))
        })
}

pub use crate::cgroup_names::{
    cgroup_components, cgroupfs_components, expand_slice, parent_components, systemd_components,
};

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn slices_nest_the_way_systemd_nests_them() {
        assert_eq!(
            expand_slice("a-b-c.slice").unwrap(),
            ["a.slice", "a-b.slice", "a-b-c.slice"]
        );
        assert_eq!(
            expand_slice("system-x.slice").unwrap(),
            ["system.slice", "system-x.slice"]
        );
        assert_eq!(
            expand_slice("user-0.slice").unwrap(),
            ["user.slice", "user-0.slice"]
        );
        for bad in [
            "-.slice",
            "a--b.slice",
            "-a.slice",
            "a-.slice",
            "a/b.slice",
            "a",
        ] {
            assert!(expand_slice(bad).is_err(), "{bad}");
        }
        assert_eq!(
            systemd_components("kubepods-pod1.slice:cri-containerd:c1").unwrap(),
            [
                "kubepods.slice",
                "kubepods-pod1.slice",
                "cri-containerd-c1.scope"
            ]
        );
        assert!(systemd_components("kubepods.slice:x:evil.slice").is_err());
        assert!(systemd_components(":x:c1").is_err());
        assert!(systemd_components("a.slice:x:c1:d").is_err());
    }

    #[test]
    fn cgroupfs_paths_must_be_clean_and_absolute() {
        assert_eq!(cgroupfs_components("/a/b").unwrap(), ["a", "b"]);
        for bad in ["a/b", "/", "/a//b", "/a/../b", "/a/./b", "/a/"] {
            assert!(cgroupfs_components(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_pod_cgroup_sits_directly_below_a_kubepods_root() {
        let p = Policy::default();
        let c = |s: &[&str]| s.iter().map(|x| (*x).to_string()).collect::<Vec<_>>();
        let fs = c(&["kubepods", "burstable", "podu-1", "sb"]);
        assert_eq!(
            pod_cgroup_of(&fs, "u-1", &p).unwrap(),
            &c(&["kubepods", "burstable", "podu-1"])[..]
        );
        assert!(pod_cgroup_of(&fs, "u-2", &p).is_none());
        assert!(pod_cgroup_of(&c(&["kubepods", "podu-1", "sb"]), "u-1", &p).is_some());
        let sd = c(&[
            "kubepods.slice",
            "kubepods-burstable.slice",
            "kubepods-burstable-podu_1.slice",
            "cri-containerd-sb.scope",
        ]);
        assert!(pod_cgroup_of(&sd, "u-1", &p).is_some());
        let guaranteed = c(&["kubepods.slice", "kubepods-podu_1.slice", "x-sb.scope"]);
        assert!(pod_cgroup_of(&guaranteed, "u-1", &p).is_some());
        // Not below a kubepods root, nested in another pod or sandbox, in a host
        // slice, or in a QoS cgroup itself: no pod cgroup.
        for bad in [
            c(&["kubepods", "sb"]),
            c(&["rt2top", "burstable", "podu-1", "sb"]),
            c(&["kubepods", "burstable", "podv", "podu-1", "sb"]),
            c(&["kubepods", "podv", "sbv", "podu-1", "sb"]),
            c(&["system.slice", "podu-1", "sb"]),
            c(&["kubepods", "guaranteed", "podu-1", "sb"]),
            c(&["system.slice", "system-podu_1.slice", "x-sb.scope"]),
            c(&[
                "kubepods.slice",
                "kubepods-burstable.slice",
                "kubepods-burstable-podv.slice",
                "kubepods-burstable-podv-podu_1.slice",
                "x-sb.scope",
            ]),
        ] {
            assert!(pod_cgroup_of(&bad, "u-1", &p).is_none(), "{bad:?}");
        }
        // A uid systemd's escaping would confuse with another is no pod uid.
        assert!(pod_cgroups("u_1", &p).is_empty());
        assert_eq!(pod_cgroups("u-1", &p).len(), 6);
    }

    #[test]
    fn runc_state_is_read_as_runc_writes_it() {
        let v = serde_json::json!({
            "id": "sb", "init_process_pid": 4242, "init_process_start": 99,
            "config": {"labels": ["io.kubernetes.cri.container-type=sandbox", "bundle=/b", "k=v=w"],
                       "cgroups": {"path": "/kubepods/podu/sb", "Systemd": false}}});
        let st = parse_state(&v).unwrap();
        assert_eq!(st.labels["k"], "v=w");
        // A label twice (an annotation key with '=' in it) is no record to trust.
        let mut twice = v.clone();
        twice["config"]["labels"] = serde_json::json!(["a=b", "a=c"]);
        assert!(parse_state(&twice).is_err());
        assert_eq!(st.cgroup, ["kubepods", "podu", "sb"]);
        let v = serde_json::json!({
            "id": "sb", "init_process_pid": 4242, "init_process_start": 99,
            "config": {"cgroups": {"path": "", "parent": "kubepods-podu.slice",
                       "scope_prefix": "cri-containerd", "name": "sb", "Systemd": true}}});
        assert_eq!(
            parse_state(&v).unwrap().cgroup,
            [
                "kubepods.slice",
                "kubepods-podu.slice",
                "cri-containerd-sb.scope"
            ]
        );
        assert!(proc_start_time(std::process::id()).is_some());
        assert!(proc_start_time(u32::MAX).is_none());
    }
}
