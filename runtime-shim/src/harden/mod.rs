//! From a tenant spec (and the lease it names) to a hardened spec, or a refusal that
//! names every reason. Pure apart from reading host facts (never the rootfs): the caller
//! writes the result and execs runc.

pub mod allowlist;
pub mod apparmor;
pub mod base;
pub mod caps;
pub mod cdi;
pub mod cgroups;
pub mod devices;
pub mod exec;
pub mod identity;
pub mod json;
pub mod mounts;
pub mod namespaces;
pub mod seccomp;
pub mod update;

use crate::policy::Policy;
use serde_json::{Value, json};
use std::path::Path;

pub use base::{
    Context, DEFAULT_MASKED, DEFAULT_READONLY, DEFAULT_TERMINATION_PATH, Findings,
    LEASE_ID_ANNOTATION, POD_ANNOTATIONS, SANDBOX_NAMESPACE_ANNOTATION,
    TERMINATION_PATH_ANNOTATION, TOKEN_ANNOTATION, TOKEN_ENV, annotation, is_cri_sandbox,
    obj_entry, pod_of, strings,
};

/// The outcome: admitted with the hardened spec, or refused with every reason.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub admitted: bool,
    pub reasons: Vec<String>,
    /// What was changed or dropped on the way (for the log and `check`).
    pub notes: Vec<String>,
    /// The hardened spec. With the built-in seccomp profile its `linux.seccomp` is
    /// [`seccomp::BUILTIN_PLACEHOLDER`]: write it with [`Decision::config_json`], and
    /// read it whole with [`Decision::full_spec`].
    pub spec: Value,
    builtin_seccomp: Option<BuiltinText>,
}

/// The built-in seccomp profile's text (compared by its text).
#[derive(Debug, Clone, Copy)]
struct BuiltinText(&'static serde_json::value::RawValue);

impl PartialEq for BuiltinText {
    fn eq(&self, other: &Self) -> bool {
        self.0.get() == other.0.get()
    }
}

impl Decision {
    /// Refused before any hardening, for the reasons in `f`.
    fn refused(f: Findings, spec: Value) -> Self {
        Self {
            admitted: false,
            reasons: f.reasons,
            notes: f.notes,
            spec,
            builtin_seccomp: None,
        }
    }

    /// The hardened spec as config.json: the built-in seccomp profile written where
    /// its placeholder is.
    pub fn config_json(&self) -> serde_json::Result<Vec<u8>> {
        match self.builtin_seccomp {
            Some(t) => seccomp::spliced(&self.spec, t.0),
            None => serde_json::to_vec(&self.spec),
        }
    }

    /// The hardened spec with the built-in seccomp profile in place, as a JSON tree
    /// (what [`Decision::config_json`] writes).
    pub fn full_spec(&self) -> Value {
        let mut spec = self.spec.clone();
        if let Some(t) = self.builtin_seccomp
            && let Some(linux) = spec.get_mut("linux").and_then(Value::as_object_mut)
            && linux.get("seccomp").and_then(Value::as_str) == Some(seccomp::BUILTIN_PLACEHOLDER)
            && let Ok(oci) = serde_json::from_str::<Value>(t.0.get())
        {
            linux.insert("seccomp".to_string(), oci);
        }
        spec
    }
}

#[derive(Clone, Copy)]
enum Ty {
    Object,
    Str,
    Bool,
    Array,
    StrArray,
    StrMap,
}

/// Fields the hardening reads, with the JSON type they must have.
const SHAPE: &[(&str, Ty)] = &[
    ("/process", Ty::Object),
    ("/process/env", Ty::StrArray),
    ("/process/args", Ty::StrArray),
    ("/process/capabilities", Ty::Object),
    ("/process/capabilities/bounding", Ty::StrArray),
    ("/process/capabilities/effective", Ty::StrArray),
    ("/process/capabilities/inheritable", Ty::StrArray),
    ("/process/capabilities/permitted", Ty::StrArray),
    ("/process/capabilities/ambient", Ty::StrArray),
    ("/process/noNewPrivileges", Ty::Bool),
    ("/process/apparmorProfile", Ty::Str),
    ("/process/selinuxLabel", Ty::Str),
    ("/root", Ty::Object),
    ("/root/path", Ty::Str),
    ("/mounts", Ty::Array),
    ("/hooks", Ty::Object),
    ("/annotations", Ty::StrMap),
    ("/linux", Ty::Object),
    ("/linux/namespaces", Ty::Array),
    ("/linux/devices", Ty::Array),
    ("/linux/resources", Ty::Object),
    ("/linux/resources/devices", Ty::Array),
    ("/linux/resources/pids", Ty::Object),
    ("/linux/resources/unified", Ty::StrMap),
    ("/linux/sysctl", Ty::StrMap),
    ("/linux/maskedPaths", Ty::StrArray),
    ("/linux/readonlyPaths", Ty::StrArray),
    ("/linux/cgroupsPath", Ty::Str),
    ("/linux/mountLabel", Ty::Str),
];

/// Check the JSON types of every field the hardening reads; a wrong type is a refusal.
pub fn check_shape(spec: &Value, f: &mut Findings) -> bool {
    let before = f.reasons.len();
    for (ptr, ty) in SHAPE {
        let Some(v) = spec.pointer(ptr) else { continue };
        if v.is_null() {
            continue;
        }
        let ok = match ty {
            Ty::Object => v.is_object(),
            Ty::Str => v.is_string(),
            Ty::Bool => v.is_boolean(),
            Ty::Array => v.is_array(),
            Ty::StrArray => strings(v).is_some(),
            Ty::StrMap => v
                .as_object()
                .is_some_and(|m| m.values().all(Value::is_string)),
        };
        if !ok {
            f.refuse(format!("malformed spec: {ptr} has the wrong JSON type"));
        }
    }
    f.reasons.len() == before
}

/// Why the spec's lease token cannot be told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("process.env sets {TOKEN_ENV} to different tokens")]
    TwoInEnv,
    #[error("the annotation {TOKEN_ANNOTATION} and {TOKEN_ENV} name different tokens")]
    Disagree,
    #[error("the lease token is empty")]
    Empty,
}

/// Where the lease token is, if anywhere: the annotation, or `TESSERA_LEASE_TOKEN` in
/// `process.env`. Two different tokens are an error.
pub fn find_token(spec: &Value) -> Result<Option<String>, TokenError> {
    let from_annotation = spec
        .pointer(&format!(
            "/annotations/{}",
            TOKEN_ANNOTATION.replace('/', "~1")
        ))
        .and_then(Value::as_str)
        .map(str::to_string);
    let mut env_tokens: Vec<String> = spec
        .pointer("/process/env")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter_map(|e| e.strip_prefix(&format!("{TOKEN_ENV}=")))
        .map(str::to_string)
        .collect();
    env_tokens.dedup();
    if env_tokens.len() > 1 {
        return Err(TokenError::TwoInEnv);
    }
    let from_env = env_tokens.pop();
    match (from_annotation, from_env) {
        (Some(a), Some(e)) if a != e => Err(TokenError::Disagree),
        (Some(t), _) | (None, Some(t)) if t.trim().is_empty() => Err(TokenError::Empty),
        (Some(t), _) | (None, Some(t)) => Ok(Some(t)),
        (None, None) => Ok(None),
    }
}

pub use crate::refusal::{PRIVILEGED_REFUSAL, line as refusal_line};

/// The one reason to show for a privileged container (`podman --privileged`,
/// Kubernetes `securityContext.privileged`): its spec allows every device in the
/// devices cgroup, which only privileged mode asks for. `None` for any other spec.
pub fn privileged(spec: &Value) -> Option<String> {
    let allow_all = spec
        .pointer("/linux/resources/devices")
        .and_then(Value::as_array)
        .is_some_and(|rules| {
            rules.iter().any(|r| {
                r.get("allow") == Some(&Value::Bool(true))
                    && r.get("type")
                        .and_then(Value::as_str)
                        .is_none_or(|t| t == "a" || t.is_empty())
                    && r.get("major").and_then(Value::as_i64).is_none_or(|m| m < 0)
            })
        });
    if !allow_all {
        return None;
    }
    let sys_admin = spec
        .pointer("/process/capabilities/bounding")
        .and_then(strings)
        .is_some_and(|c| {
            c.iter()
                .any(|c| crate::policy::cap_name(c) == "CAP_SYS_ADMIN")
        });
    let asks = if sys_admin {
        "every host device and CAP_SYS_ADMIN"
    } else {
        "every host device"
    };
    Some(format!(
        "{PRIVILEGED_REFUSAL} (the spec asks for {asks}: podman/docker --privileged or Kubernetes securityContext.privileged); run it unprivileged, the lease's GPU is given without privileges"
    ))
}

/// The host path of the container's termination-message file: the source of the
/// bind mount whose destination is the termination path (kubelet's annotation, else
/// `/dev/termination-log`). Read from the hardened spec, whose bind sources are
/// canonical host paths checked outside the rootfs; nothing is resolved here.
pub fn termination_log_source(spec: &Value) -> Option<String> {
    let want = annotation(spec, TERMINATION_PATH_ANNOTATION).unwrap_or(DEFAULT_TERMINATION_PATH);
    let want = mounts::normalize(want);
    spec.get("mounts")?
        .as_array()?
        .iter()
        .filter(|m| {
            m.get("destination")
                .and_then(Value::as_str)
                .is_some_and(|d| mounts::normalize(d) == want)
        })
        .filter(|m| {
            let options = m.get("options").and_then(strings).unwrap_or_default();
            m.get("type").and_then(Value::as_str) == Some("bind")
                || options.iter().any(|o| o == "bind" || o == "rbind")
        })
        .filter_map(|m| m.get("source").and_then(Value::as_str))
        .rfind(|s| s.starts_with('/'))
        .map(str::to_string)
}

fn check_hooks(spec: &mut Value, f: &mut Findings) {
    if let Some(hooks) = spec.get("hooks").and_then(Value::as_object) {
        for (kind, list) in hooks {
            let paths: Vec<String> = match list.as_array() {
                Some(a) => a
                    .iter()
                    .map(|h| {
                        h.get("path")
                            .and_then(Value::as_str)
                            .unwrap_or("?")
                            .to_string()
                    })
                    .collect(),
                None => vec!["?".to_string()],
            };
            if !paths.is_empty() {
                f.refuse(format!(
                    "OCI hooks are not allowed in a tenant spec: {kind} ({})",
                    paths.join(", ")
                ));
            }
        }
    }
    if let Some(m) = spec.as_object_mut() {
        m.remove("hooks");
    }
}

fn check_root(spec: &Value, ctx: &Context, f: &mut Findings) {
    let Some(path) = spec.pointer("/root/path").and_then(Value::as_str) else {
        f.refuse("the spec has no root.path");
        return;
    };
    let full = if Path::new(path).is_absolute() {
        Path::new(path).to_path_buf()
    } else {
        ctx.bundle.join(path)
    };
    if mounts::normalize(&full.to_string_lossy()) == "/" {
        f.refuse("root.path is the host's /");
        return;
    }
    match ctx.host.lstat(&full) {
        Ok(m) if m.is_symlink() => {
            f.refuse(format!("root.path {path} is a symlink"));
        }
        Ok(m) if !m.is_dir() => f.refuse(format!("root.path {path} is not a directory")),
        Ok(_) => {}
        Err(e) => f.refuse(format!("root.path {}: {e}", full.display())),
    }
}

fn harden_process(spec: &mut Value, ctx: &Context, f: &mut Findings) {
    let Some(process) = spec.get_mut("process").and_then(Value::as_object_mut) else {
        f.refuse("the spec has no process");
        return;
    };
    if process.get("noNewPrivileges") == Some(&Value::Bool(false)) {
        f.note("process.noNewPrivileges was false; set to true");
    }
    process.insert("noNewPrivileges".to_string(), Value::Bool(true));
    if let Some(label) = process.get("selinuxLabel").and_then(Value::as_str)
        && let Some(t) = forbidden_selinux_type(label, ctx.policy())
    {
        f.refuse(format!("process.selinuxLabel uses the forbidden type {t}"));
    }
    // Env: drop the token, apply the lease's variables (the lease wins).
    let mut env: Vec<String> = process
        .get("env")
        .and_then(strings)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| !e.starts_with(&format!("{TOKEN_ENV}=")))
        .collect();
    if let Some(lease) = ctx.lease {
        for (k, v) in &lease.env {
            let prefix = format!("{k}=");
            env.retain(|e| !e.starts_with(&prefix));
            env.push(format!("{k}={v}"));
        }
    }
    process.insert("env".to_string(), json!(env));
}

/// The SELinux type of a label (`user:role:type:level`) if the policy forbids it.
pub fn forbidden_selinux_type<'p>(label: &str, policy: &'p Policy) -> Option<&'p str> {
    let ty = label.split(':').nth(2).unwrap_or(label);
    policy
        .forbidden_selinux_types
        .iter()
        .find(|t| t.as_str() == ty)
        .map(String::as_str)
}

/// A lease's tenant runs only in its Kubernetes namespaces: the pod's namespace as
/// runc's record of its sandbox names it (the spec's claim was checked against it).
fn check_tenant_binding(ident: &identity::Identity, ctx: &Context, f: &mut Findings) {
    let Some(lease) = ctx.lease else { return };
    let bindings = &ctx.config.tenant_namespaces;
    if bindings.is_empty() {
        return;
    }
    let ns = ident
        .pod()
        .map(|p| p.namespace.as_str())
        .filter(|n| !n.is_empty());
    match (ns, bindings.get(&lease.tenant)) {
        (None, _) => f.refuse(format!(
            "tenants are bound to Kubernetes namespaces and the container is in no pod whose sandbox names one ({SANDBOX_NAMESPACE_ANNOTATION})"
        )),
        (Some(ns), Some(allowed)) if allowed.iter().any(|a| a == ns) => {}
        (Some(ns), _) => f.refuse(format!(
            "the lease belongs to tenant {} which may not run in namespace {ns}",
            lease.tenant
        )),
    }
}

/// A lease bound to a pod serves that pod only (its record's uid, or its sandbox's
/// id): a container of another pod, or of none, is refused before anything is bound.
fn check_lease_pod(ident: &identity::Identity, ctx: &Context, f: &mut Findings) {
    let Some(lease) = ctx.lease else { return };
    if lease.pod.is_empty() {
        return;
    }
    match (ident.pod(), ident.sandbox_id()) {
        (Some(p), _) if p.uid == lease.pod => {}
        (_, Some(s)) if s == lease.pod => {}
        (Some(p), _) => f.refuse(format!(
            "the token of lease {} is bound to pod {}; pod {} may not use it",
            lease.lease_id, lease.pod, p.uid
        )),
        (None, _) => f.refuse(format!(
            "the token of lease {} is bound to pod {}; a container in no pod may not use it",
            lease.lease_id, lease.pod
        )),
    }
}

fn ensure_paths(spec: &mut Value, key: &str, want: &[String]) {
    let Some(linux) = obj_entry(spec, "linux") else {
        return;
    };
    let mut have = linux.get(key).and_then(strings).unwrap_or_default();
    for p in want {
        if !have.contains(p) {
            have.push(p.clone());
        }
    }
    linux.insert(key.to_string(), json!(have));
}

fn set_annotations(spec: &mut Value, ctx: &Context, ident: &identity::Identity) {
    let Some(ann) = obj_entry(spec, "annotations") else {
        return;
    };
    ann.remove(TOKEN_ANNOTATION);
    // The pod as the sandbox's record names it: what the binding reports (pod_of)
    // and what runc records. A container in no pod keeps no pod claim (identify
    // refused any it could not bear out; none may reach the daemon or runc's record).
    match ident.pod() {
        Some(pod) => {
            ann.insert(identity::SANDBOX_UID.to_string(), json!(pod.uid));
        }
        None => {
            for k in POD_ANNOTATIONS {
                ann.remove(*k);
            }
        }
    }
    match ctx.lease {
        Some(l) => {
            ann.insert(LEASE_ID_ANNOTATION.to_string(), json!(l.lease_id));
        }
        None => {
            ann.remove(LEASE_ID_ANNOTATION);
        }
    }
}

/// Validate a tenant spec against the policy and the lease and produce the hardened
/// spec. Nothing outside the returned value is changed.
pub fn harden(mut spec: Value, ctx: &Context) -> Decision {
    let mut f = Findings::default();
    if !spec.is_object() {
        f.refuse("the spec is not a JSON object");
        return Decision::refused(f, spec);
    }
    if !check_shape(&spec, &mut f) {
        return Decision::refused(f, spec);
    }
    allowlist::walk(&spec, "", &mut f);
    if let Err(e) = find_token(&spec) {
        f.refuse(e.to_string());
    }
    cdi::strip_lease_edits(&mut spec, ctx, &mut f);
    let ident = identity::identify(&spec, ctx, &mut f);
    check_tenant_binding(&ident, ctx, &mut f);
    check_lease_pod(&ident, ctx, &mut f);
    check_hooks(&mut spec, &mut f);
    check_root(&spec, ctx, &mut f);
    allowlist::check(&mut spec, ctx, &ident, &mut f);
    namespaces::apply(&mut spec, ctx, &mut f);
    caps::apply(&mut spec, ctx.policy(), &mut f);
    harden_process(&mut spec, ctx, &mut f);
    apparmor::apply(&mut spec, ctx, &mut f);
    mounts::apply(&mut spec, ctx, &mut f);
    devices::apply(&mut spec, ctx, &mut f);
    cgroups::apply(&mut spec, ctx, &mut f);
    if let Some(n) = seccomp::apply(&mut spec, ctx.seccomp) {
        f.note(n);
    }
    let masked: Vec<String> = DEFAULT_MASKED
        .iter()
        .map(|s| (*s).to_string())
        .chain(devices::masked_paths(ctx))
        .collect();
    ensure_paths(&mut spec, "maskedPaths", &masked);
    let ro: Vec<String> = DEFAULT_READONLY.iter().map(|s| (*s).to_string()).collect();
    ensure_paths(&mut spec, "readonlyPaths", &ro);
    set_annotations(&mut spec, ctx, &ident);
    Decision {
        admitted: f.reasons.is_empty(),
        reasons: f.reasons,
        notes: f.notes,
        spec,
        builtin_seccomp: ctx.seccomp.builtin_text().map(BuiltinText),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_privileged_spec_is_refused_in_one_line() {
        // What podman --privileged and containerd's privileged pods write.
        let spec = json!({"linux": {"resources": {"devices": [{"allow": true, "access": "rwm"}]}},
            "process": {"capabilities": {"bounding": ["CAP_SYS_ADMIN", "CAP_KILL"]}}});
        let p = privileged(&spec).unwrap();
        assert!(p.contains("every host device and CAP_SYS_ADMIN"), "{p}");
        let reasons = vec![
            "capability CAP_SYS_ADMIN is forbidden".to_string(),
            p.clone(),
            "device /dev/sda\nis not the lease's".to_string(),
        ];
        let (line, cut) = refusal_line("create c1", &reasons);
        assert!(cut);
        assert!(
            line.starts_with(
                "tessera-runtime: create c1 refused: privileged containers are not allowed"
            ),
            "{line}"
        );
        assert!(
            line.contains("2 more reason(s)") && !line.contains('\n'),
            "{line}"
        );
        // A narrower rule, or a deny-all, is not privileged mode.
        // podman writes the rule with an empty type.
        let podman = json!({"linux": {"resources": {"devices": [{"allow": true, "type": "", "access": "rwm"}]}}});
        assert!(privileged(&podman).unwrap().contains("every host device"));
        for rules in [
            json!([{"allow": false, "access": "rwm"}]),
            json!([{"allow": true, "type": "c", "major": 195, "access": "rw"}]),
        ] {
            assert!(privileged(&json!({"linux": {"resources": {"devices": rules}}})).is_none());
        }
        let (line, cut) = refusal_line("exec c1", &["a\nb".to_string(), "c".to_string()]);
        assert_eq!(line, "tessera-runtime: exec c1 refused: a b; c");
        assert!(!cut);
    }

    #[test]
    fn the_pod_is_named_by_its_uid_before_its_sandbox() {
        let spec = json!({"annotations": {
            "io.kubernetes.cri.sandbox-id": "sb-1",
            "io.kubernetes.cri.sandbox-uid": "uid-1"}});
        assert_eq!(pod_of(&spec).as_deref(), Some("uid-1"));
        let spec = json!({"annotations": {"io.kubernetes.cri.sandbox-id": "sb-1",
            "io.kubernetes.cri.sandbox-uid": ""}});
        assert_eq!(pod_of(&spec).as_deref(), Some("sb-1"));
        assert_eq!(pod_of(&json!({"annotations": {}})), None);
    }

    #[test]
    fn the_termination_log_is_the_bind_source_at_the_termination_path() {
        let kubelet = |dest: &str| {
            json!({"destination": dest, "type": "bind",
                   "source": "/var/lib/kubelet/pods/u/containers/app/1a2b",
                   "options": ["rbind", "rprivate", "rw"]})
        };
        let spec = json!({"mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            kubelet("/dev/termination-log")]});
        assert_eq!(
            termination_log_source(&spec).as_deref(),
            Some("/var/lib/kubelet/pods/u/containers/app/1a2b")
        );
        // The pod's own terminationMessagePath, which kubelet passes as an annotation.
        let mut spec = json!({"mounts": [kubelet("/tmp/why")]});
        assert_eq!(termination_log_source(&spec), None);
        spec["annotations"] = json!({TERMINATION_PATH_ANNOTATION: "/tmp/why"});
        assert!(termination_log_source(&spec).is_some());
        // Not a bind mount, or a relative source: none.
        let spec = json!({"mounts": [
            {"destination": "/dev/termination-log", "type": "tmpfs", "source": "tmpfs"}]});
        assert_eq!(termination_log_source(&spec), None);
        let spec = json!({"mounts": [
            {"destination": "/dev/termination-log", "type": "bind", "source": "rel/x"}]});
        assert_eq!(termination_log_source(&spec), None);
    }
}
