//! `exec`: the process JSON (`--process`) and the command-line overrides may not give a
//! process more than the container has: no capability beyond the container's bounding
//! set, `noNewPrivileges` forced, the container's own AppArmor profile and SELinux label.

use super::{Findings, caps, strings};
use crate::bundle;
use crate::cli::SubArgs;
use crate::policy::{Policy, cap_name};
use serde_json::{Value, json};
use std::path::Path;

/// What runc recorded about a running container (`<root>/<id>/state.json`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ContainerState {
    /// The bounding set.
    pub bounding: Vec<String>,
    pub apparmor_profile: Option<String>,
    pub process_label: Option<String>,
    /// The uid and gid the container was started with (from its bundle's hardened
    /// config.json, which runc's state names in its `bundle=` label).
    pub user: Option<(u64, u64)>,
    /// The lease's variables the container was started with (`KEY=value`), given to
    /// every exec'd process too.
    pub lease_env: Vec<String>,
    /// The device cgroup rules the container was started with (its hardened
    /// config.json's `linux.resources.devices`), when they could be read.
    pub device_rules: Option<Vec<Value>>,
}

/// The environment variables the runtime sets from a lease.
pub const LEASE_ENV_KEYS: &[&str] = &[
    "TESSERA_LEASE_ID",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY",
    // A shared MPS lease's client-side limits (the server sets none).
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
];

impl ContainerState {
    /// Read runc's state for `id` under `root` (host paths; no symlink at the file).
    pub fn load(root: &Path, id: &str, max: u64) -> Result<Self, String> {
        let (v, spec) = state_and_spec(root, id, max)?;
        let mut s = Self::from_state(&v).ok_or_else(|| {
            format!(
                "{}: unexpected format",
                root.join(id).join("state.json").display()
            )
        })?;
        if let Some(spec) = spec {
            s.device_rules = spec
                .pointer("/linux/resources/devices")
                .and_then(Value::as_array)
                .cloned();
            s.user = spec
                .pointer("/process/user/uid")
                .and_then(Value::as_u64)
                .zip(spec.pointer("/process/user/gid").and_then(Value::as_u64));
            if let Some(lease_id) = lease_id_of(&spec) {
                s.lease_env = spec
                    .pointer("/process/env")
                    .and_then(strings)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|e| {
                        LEASE_ENV_KEYS
                            .iter()
                            .any(|k| e.starts_with(&format!("{k}=")))
                    })
                    .filter(|e| !e.starts_with("TESSERA_LEASE_ID="))
                    .collect();
                // The lease id the runtime recorded, whatever the process JSON says.
                s.lease_env.push(format!("TESSERA_LEASE_ID={lease_id}"));
            }
        }
        Ok(s)
    }

    /// Extract the fields from a parsed state.json.
    pub fn from_state(v: &Value) -> Option<Self> {
        let config = v.get("config")?;
        let bounding = match config.pointer("/capabilities/Bounding") {
            None | Some(Value::Null) => Vec::new(),
            Some(b) => strings(b)?,
        };
        let opt = |k: &str| {
            config
                .get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
        };
        Some(Self {
            bounding: bounding.iter().map(|c| cap_name(c)).collect(),
            apparmor_profile: opt("apparmor_profile"),
            process_label: opt("process_label"),
            user: None,
            lease_env: Vec::new(),
            device_rules: None,
        })
    }
}

/// runc's state of container `id` under `root`, and the hardened config.json of the
/// bundle it names (`None` when that cannot be read).
fn state_and_spec(root: &Path, id: &str, max: u64) -> Result<(Value, Option<Value>), String> {
    if id.is_empty() || id.contains('/') || id == "." || id == ".." {
        return Err(format!("container id {id:?} is not valid"));
    }
    let max = max.max(16 * 1024 * 1024);
    let v = bundle::load_json(&root.join(id).join("state.json"), max)
        .map_err(|e| format!("cannot read the container's state: {e}"))?;
    let spec = bundle_of(&v).and_then(|b| bundle::load_json(&b.join("config.json"), max).ok());
    Ok((v, spec))
}

/// The lease id(s) the runtime recorded in a hardened spec's annotations.
fn lease_id_of(spec: &Value) -> Option<&str> {
    spec.pointer(&format!(
        "/annotations/{}",
        super::LEASE_ID_ANNOTATION.replace('/', "~1")
    ))
    .and_then(Value::as_str)
}

/// Whether container `id` runs on a lease, by the lease-id annotation the runtime
/// writes into every leased container's hardened config.json: `Some(false)` only when
/// that file was read and names no lease, `None` when it cannot be told (runc's state
/// or the bundle is gone, as after `run`).
pub fn runs_on_lease(root: &Path, id: &str, max: u64) -> Option<bool> {
    let (_, spec) = state_and_spec(root, id, max).ok()?;
    Some(lease_id_of(&spec?).is_some())
}

/// The bundle directory runc recorded in the state's `bundle=` label.
fn bundle_of(state: &Value) -> Option<std::path::PathBuf> {
    state
        .pointer("/config/labels")?
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .find_map(|l| l.strip_prefix("bundle="))
        .map(std::path::PathBuf::from)
}

/// The argv of an `exec` without `--process` (runc builds the process from the
/// container's config.json and appends each `--env`, the last of a name winning):
/// the lease's variables go last among the flags, right before the container id,
/// so that a `--env CUDA_VISIBLE_DEVICES=...` of the caller does not hide them.
/// They are spelt with the name the caller used (`-e` or `--env`): runc refuses
/// "two forms of the same flag".
pub fn argv_with_lease_env(argv: &[String], sub: &SubArgs, lease_env: &[String]) -> Vec<String> {
    let mut out = argv.to_vec();
    let Some(&(mut at, _)) = sub.positionals.first() else {
        return out;
    };
    if lease_env.is_empty() {
        return out;
    }
    // `exec [flags] -- ID ...`: flags go before the terminator.
    if at > 0 && argv.get(at - 1).is_some_and(|t| t == "--") {
        at -= 1;
    }
    let short = sub
        .flags
        .iter()
        .filter(|f| f.name == "env")
        .filter_map(|f| argv.get(f.index))
        .any(|tok| tok.trim_start_matches('-').split('=').next() == Some("e"));
    let flag = if short { "-e" } else { "--env" };
    for (n, e) in lease_env.iter().enumerate() {
        out.insert(at + n, format!("{flag}={e}"));
    }
    out
}

/// `uid[:gid]` as exec's `--user` writes it.
fn parse_user(s: &str) -> Option<(u64, Option<u64>)> {
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g.parse().ok()?)),
        None => (s, None),
    };
    Some((u.parse().ok()?, g))
}

/// Check exec's command-line overrides: `--cap` is refused, and `--apparmor`,
/// `--process-label`, `--no-new-privs=false` may not loosen the container.
pub fn check_flags(sub: &SubArgs, state: &ContainerState, f: &mut Findings) {
    for c in sub.values("cap") {
        f.refuse(format!(
            "exec --cap {c} is refused: exec may not add capabilities"
        ));
    }
    if let Some(a) = sub.value("apparmor")
        && Some(a) != state.apparmor_profile.as_deref()
    {
        f.refuse(format!(
            "exec --apparmor {a} differs from the container's AppArmor profile"
        ));
    }
    if let Some(l) = sub.value("process-label")
        && Some(l) != state.process_label.as_deref()
    {
        f.refuse(format!(
            "exec --process-label {l} differs from the container's SELinux label"
        ));
    }
    if sub.value("no-new-privs") == Some("false") {
        f.refuse("exec --no-new-privs=false is refused");
    }
    if let Some(u) = sub.value("user") {
        match (parse_user(u), state.user) {
            (Some((uid, gid)), Some((cu, cg))) if uid == cu && gid.is_none_or(|g| g == cg) => {}
            (_, None) => f.refuse(format!(
                "exec --user {u}: the container's own user is unknown, so no other may be chosen"
            )),
            _ => f.refuse(format!(
                "exec --user {u} is refused: the container runs as {}",
                state
                    .user
                    .map_or_else(String::new, |(u, g)| format!("{u}:{g}"))
            )),
        }
    }
}

/// Validate and harden an exec process JSON.
pub fn harden_process(
    mut process: Value,
    state: &ContainerState,
    policy: &Policy,
    f: &mut Findings,
) -> Value {
    let Some(obj) = process.as_object() else {
        f.refuse("the exec process is not a JSON object");
        return process;
    };
    // The same table as create's `process`: unknown or refused fields refuse.
    super::allowlist::walk(&process, "/process", f);
    super::allowlist::process_fields(&process, "/process", policy, f);
    if let Some(c) = obj.get("capabilities")
        && !c.is_null()
    {
        let ok = c.as_object().is_some_and(|m| {
            caps::SETS.iter().all(|s| {
                m.get(*s)
                    .is_none_or(|v| v.is_null() || strings(v).is_some())
            })
        });
        if !ok {
            f.refuse("malformed exec process: capabilities");
            return process;
        }
    }
    if let (Some(uid), Some((cu, cg))) = (
        process.pointer("/user/uid").and_then(Value::as_u64),
        state.user,
    ) {
        let gid = process
            .pointer("/user/gid")
            .and_then(Value::as_u64)
            .unwrap_or(cg);
        if (uid, gid) != (cu, cg) {
            f.refuse(format!(
                "/process/user: exec as {uid}:{gid} is refused: the container runs as {cu}:{cg}"
            ));
        }
    }
    let reduced = caps::reduce(
        obj.get("capabilities"),
        policy,
        Some(&state.bounding),
        "exec --process",
        f,
    );
    let asked_aa = obj
        .get("apparmorProfile")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty());
    if let Some(a) = asked_aa
        && Some(a) != state.apparmor_profile.as_deref()
    {
        // containerd sends the profile of the original spec (CRI's default profile, say);
        // the process gets the container's own, whatever it asked for.
        f.note(format!(
            "exec --process AppArmor profile {a} replaced by the container's"
        ));
    }
    let asked_label = obj
        .get("selinuxLabel")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty());
    if let Some(l) = asked_label
        && Some(l) != state.process_label.as_deref()
    {
        f.refuse(format!(
            "exec --process asks for SELinux label {l}, not the container's"
        ));
    }
    if let Some(obj) = process.as_object_mut() {
        // kubectl exec, exec probes and podman exec see the lease like the init
        // process: its variables win over the process JSON's.
        if !state.lease_env.is_empty() {
            let mut env = obj.get("env").and_then(strings).unwrap_or_default();
            for e in &state.lease_env {
                let key = e.split('=').next().unwrap_or_default();
                env.retain(|x| !x.starts_with(&format!("{key}=")));
                env.push(e.clone());
            }
            obj.insert("env".to_string(), json!(env));
        }
        obj.insert("capabilities".to_string(), reduced);
        obj.insert("noNewPrivileges".to_string(), json!(true));
        match &state.apparmor_profile {
            Some(p) => obj.insert("apparmorProfile".to_string(), json!(p)),
            None => obj.remove("apparmorProfile"),
        };
        match &state.process_label {
            Some(l) => obj.insert("selinuxLabel".to_string(), json!(l)),
            None => obj.remove("selinuxLabel"),
        };
    }
    process
}

/// What `update` may change: CPU (with cpuset), memory, pids (up to the policy's
/// limit) and hugepages. Everything else is isolation, not tuning, and refused with
/// the field named.
pub const UPDATE_MAY_CHANGE: &str = "CPU, memory, pids, hugepages and cpuset";

/// cgroup v2 files (`unified`) an update may write: the same resources.
const UNIFIED_TUNABLE: &[&str] = &["cpu.", "cpuset.", "memory.", "hugetlb."];

/// Whether the device rule `r` allows nothing more than one of the `lease` rules
/// allows (a deny rule always: it only narrows).
pub fn device_rule_within(r: &Value, lease: &[Value]) -> bool {
    if r.get("allow") == Some(&json!(false)) {
        return true;
    }
    if r.get("allow") != Some(&json!(true)) {
        return false;
    }
    let ty = |v: &Value| {
        v.get("type")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .unwrap_or("a")
            .to_string()
    };
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_i64).filter(|n| *n >= 0);
    let access = |v: &Value| {
        v.get("access")
            .and_then(Value::as_str)
            .unwrap_or("rwm")
            .to_string()
    };
    lease
        .iter()
        .filter(|l| l.get("allow") == Some(&json!(true)))
        .any(|l| {
            let (lt, rt) = (ty(l), ty(r));
            let type_ok = lt == "a" || lt == rt;
            let num_ok = |k: &str| match (num(l, k), num(r, k)) {
                (None, _) => true,
                (Some(a), Some(b)) => a == b,
                (Some(_), None) => false,
            };
            let la = access(l);
            type_ok
                && num_ok("major")
                && num_ok("minor")
                && access(r).chars().all(|c| la.contains(c))
        })
}

/// `update --resources`: only [`UPDATE_MAY_CHANGE`] may change; what runc gets is
/// returned. Device rules are accepted when they allow nothing beyond the lease's
/// (containerd's CRI sends a deny-all rule, and the device plugin's allows, with
/// every update) and are replaced by the container's own rules from its hardened
/// config.json (`lease_rules`): the lease's devices are re-applied with every update.
/// Without those rules only deny rules pass, and runc keeps the container's own.
pub fn check_update_resources(
    r: &Value,
    policy: &Policy,
    lease_rules: Option<&[Value]>,
    f: &mut Findings,
) -> Value {
    let Some(obj) = r.as_object() else {
        f.refuse("update: the resources JSON is not an object");
        return r.clone();
    };
    let empty = |v: &Value| v.is_null() || v.as_object().is_some_and(|m| m.is_empty());
    let mut out = obj.clone();
    for (k, v) in obj {
        match k.as_str() {
            "cpu" | "memory" | "hugepageLimits" => {}
            "devices" => {
                let Some(rules) = v.as_array() else {
                    if !v.is_null() {
                        f.refuse("/devices: not a list of device rules");
                    }
                    out.remove(k);
                    continue;
                };
                let lease = lease_rules.unwrap_or_default();
                for (i, rule) in rules.iter().enumerate() {
                    if !device_rule_within(rule, lease) {
                        f.refuse(format!(
                            "/devices/{i}: update may not allow a device beyond the lease's rules ({rule})"
                        ));
                    }
                }
                match lease_rules {
                    Some(l) => {
                        out.insert(k.clone(), json!(l));
                    }
                    None => {
                        out.remove(k);
                    }
                }
            }
            "pids" => {
                let limit = v.get("limit").and_then(Value::as_i64);
                match limit {
                    Some(l) if l > 0 && l <= policy.pids_limit => {}
                    None if v.is_null() => {}
                    _ => f.refuse(format!(
                        "/pids/limit: update may set a pids limit of 1..={} only",
                        policy.pids_limit
                    )),
                }
            }
            "unified" => {
                for key in v.as_object().into_iter().flatten().map(|(k, _)| k) {
                    if !UNIFIED_TUNABLE.iter().any(|p| key.starts_with(p)) {
                        f.refuse(format!(
                            "/unified/{key}: update may change {UPDATE_MAY_CHANGE} only"
                        ));
                    }
                }
                if !v.is_null() && !v.is_object() {
                    f.refuse("/unified: not a map of cgroup files");
                }
            }
            "blockIO" | "network" | "rdma" => {
                if !empty(v) {
                    f.refuse(format!("/{k}: update may change {UPDATE_MAY_CHANGE} only"));
                }
            }
            other => f.refuse(format!(
                "/{other}: unknown resources key (update may change {UPDATE_MAY_CHANGE} only)"
            )),
        }
    }
    Value::Object(out)
}

/// `update` flags that change isolation rather than tuning.
pub fn check_update_flags(sub: &SubArgs, policy: &Policy, f: &mut Findings) {
    if let Some(v) = sub.value("pids-limit")
        && !v
            .parse::<i64>()
            .is_ok_and(|l| l > 0 && l <= policy.pids_limit)
    {
        f.refuse(format!(
            "update --pids-limit {v} is refused: 1..={} only",
            policy.pids_limit
        ));
    }
    for flag in ["l3-cache-schema", "mem-bw-schema"] {
        if let Some(v) = sub.value(flag) {
            f.refuse(format!(
                "update --{flag} {v} is refused: cache and memory-bandwidth allocation are host-wide"
            ));
        }
    }
    for flag in ["blkio-weight", "kernel-memory", "kernel-memory-tcp"] {
        if let Some(v) = sub.value(flag) {
            f.refuse(format!(
                "update --{flag} {v} is refused: update may change {UPDATE_MAY_CHANGE} only"
            ));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn state() -> ContainerState {
        ContainerState {
            bounding: vec!["CAP_KILL".into(), "CAP_CHOWN".into()],
            apparmor_profile: None,
            process_label: None,
            user: Some((1000, 1000)),
            lease_env: vec!["TESSERA_LEASE_ID=l-1".into()],
            device_rules: None,
        }
    }

    #[test]
    fn exec_may_not_pick_another_user() {
        let p = crate::policy::Policy::default();
        let mut f = Findings::default();
        harden_process(
            json!({"args": ["sh"], "user": {"uid": 0, "gid": 0}}),
            &state(),
            &p,
            &mut f,
        );
        assert!(
            f.reasons.iter().any(|r| r.contains("/process/user")),
            "{:?}",
            f.reasons
        );
        let mut f = Findings::default();
        harden_process(
            json!({"args": ["sh"], "user": {"uid": 1000, "gid": 1000}}),
            &state(),
            &p,
            &mut f,
        );
        assert!(f.reasons.is_empty(), "{:?}", f.reasons);
        assert_eq!(parse_user("0:0"), Some((0, Some(0))));
        assert_eq!(parse_user("1000"), Some((1000, None)));
        assert_eq!(parse_user("root"), None);
    }

    #[test]
    fn runc_state_format() {
        let v = json!({"config": {"capabilities": {"Bounding": ["CAP_KILL"], "Effective": []},
                                  "no_new_privileges": true, "apparmor_profile": "tessera-tenant"}});
        let s = ContainerState::from_state(&v).unwrap();
        assert_eq!(s.bounding, ["CAP_KILL"]);
        assert_eq!(s.apparmor_profile.as_deref(), Some("tessera-tenant"));
        assert!(ContainerState::from_state(&json!({})).is_none());
    }

    #[test]
    fn exec_process_is_hardened() {
        let mut f = Findings::default();
        let p = json!({"args": ["sh"], "noNewPrivileges": false,
                       "capabilities": {"bounding": ["CAP_KILL"], "effective": ["kill"]}});
        let out = harden_process(p, &state(), &crate::policy::Policy::default(), &mut f);
        assert!(f.reasons.is_empty(), "{:?}", f.reasons);
        assert_eq!(out["noNewPrivileges"], true);
        assert_eq!(out["capabilities"]["effective"], json!(["CAP_KILL"]));
    }

    #[test]
    fn exec_may_not_escalate() {
        for (p, want) in [
            (
                json!({"capabilities": {"bounding": ["CAP_SYS_ADMIN"]}}),
                "forbidden capability CAP_SYS_ADMIN",
            ),
            (
                json!({"capabilities": {"effective": ["CAP_SETUID"]}}),
                "CAP_SETUID, which the container does not have",
            ),
            (
                json!({"selinuxLabel": "system_u:system_r:spc_t:s0"}),
                "SELinux label",
            ),
            (
                json!({"capabilities": {"bounding": "CAP_KILL"}}),
                "malformed",
            ),
            (json!([1]), "not a JSON object"),
        ] {
            let mut f = Findings::default();
            harden_process(
                p.clone(),
                &state(),
                &crate::policy::Policy::default(),
                &mut f,
            );
            assert!(
                f.reasons.iter().any(|r| r.contains(want)),
                "{p}: {:?}",
                f.reasons
            );
        }
    }

    #[test]
    fn exec_gets_the_containers_apparmor_profile() {
        let mut f = Findings::default();
        let st = ContainerState {
            apparmor_profile: Some("tessera-tenant".into()),
            ..state()
        };
        let p = json!({"args": ["sh"], "apparmorProfile": "unconfined"});
        let out = harden_process(p, &st, &crate::policy::Policy::default(), &mut f);
        assert!(f.reasons.is_empty());
        assert_eq!(out["apparmorProfile"], "tessera-tenant");
        let out = harden_process(
            json!({"apparmorProfile": "unconfined"}),
            &state(),
            &crate::policy::Policy::default(),
            &mut f,
        );
        assert!(out.get("apparmorProfile").is_none());
    }

    #[test]
    fn update_rules() {
        let p = crate::policy::Policy::default();
        let lease = vec![
            json!({"allow": false, "access": "rwm"}),
            json!({"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rwm"}),
            json!({"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"}),
        ];
        let mut f = Findings::default();
        // What containerd's CRI sends: CPU, cpuset and memory with a deny-all
        // device rule (and the device plugin's allow, the lease's own device).
        let cri = json!({"memory": {"limit": 1}, "cpu": {"shares": 2, "cpus": "0-1"},
            "pids": {"limit": 100}, "hugepageLimits": [{"pageSize": "2MB", "limit": 0}],
            "unified": {"memory.high": "max"},
            "devices": [{"allow": false, "access": "rwm"},
                        {"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rw"}]});
        let out = check_update_resources(&cri, &p, Some(&lease), &mut f);
        assert!(f.reasons.is_empty(), "{:?}", f.reasons);
        assert_eq!(
            out["devices"],
            json!(lease),
            "the lease's rules are re-applied"
        );
        assert_eq!(out["memory"]["limit"], 1);
        assert_eq!(out["cpu"]["cpus"], "0-1");
        // Without the container's rules only deny rules pass, and none is sent.
        let mut f = Findings::default();
        let deny = json!({"cpu": {"shares": 2}, "devices": [{"allow": false, "access": "rwm"}]});
        let out = check_update_resources(&deny, &p, None, &mut f);
        assert!(f.reasons.is_empty(), "{:?}", f.reasons);
        assert!(out.get("devices").is_none(), "{out}");
        for (r, field) in [
            (
                json!({"devices": [{"allow": false, "access": "rwm"}, {"allow": true, "type": "c", "major": 195, "access": "rwm"}]}),
                "/devices/1",
            ),
            (
                json!({"devices": [{"allow": true, "type": "c", "major": 195, "minor": 1, "access": "rw"}]}),
                "/devices/0",
            ),
            (
                json!({"devices": [{"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rwm"}, {"allow": true, "access": "rwm"}]}),
                "/devices/1",
            ),
            (json!({"devices": [{"access": "rwm"}]}), "/devices/0"),
            (json!({"pids": {"limit": 0}}), "/pids/limit"),
            (json!({"pids": {"limit": 1_000_000}}), "/pids/limit"),
            (
                json!({"unified": {"devices.allow": "a"}}),
                "/unified/devices.allow",
            ),
            (
                json!({"unified": {"io.max": "8:0 rbps=1"}}),
                "/unified/io.max",
            ),
            (json!({"blockIO": {"weight": 10}}), "/blockIO"),
            (json!({"network": {"classID": 1}}), "/network"),
            (json!({"rdma": {"mlx5_0": {"hcaHandles": 1}}}), "/rdma"),
            (json!({"bogus": 1}), "/bogus"),
        ] {
            let mut f = Findings::default();
            check_update_resources(&r, &p, Some(&lease), &mut f);
            assert!(
                f.reasons.iter().any(|x| x.contains(field)),
                "{r}: want {field} in {:?}",
                f.reasons
            );
        }
        // An empty blockIO (what a marshalled struct may carry) changes nothing.
        let mut f = Findings::default();
        check_update_resources(&json!({"blockIO": {}}), &p, Some(&lease), &mut f);
        assert!(f.reasons.is_empty(), "{:?}", f.reasons);
    }

    /// A shared MPS lease's client-side limits are lease variables: an exec gets
    /// them from the container's hardened spec, over whatever the caller passes.
    #[test]
    fn an_exec_keeps_a_shared_mps_leases_limits() {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("bundle");
        std::fs::create_dir_all(&bundle).unwrap();
        std::fs::write(
            bundle.join("config.json"),
            json!({
                "annotations": {super::super::LEASE_ID_ANNOTATION: "l-1"},
                "process": {"env": [
                    "PATH=/bin",
                    "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps",
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
                ]}
            })
            .to_string(),
        )
        .unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("c1")).unwrap();
        std::fs::write(
            root.join("c1").join("state.json"),
            json!({"config": {"labels": [format!("bundle={}", bundle.display())]}}).to_string(),
        )
        .unwrap();
        let s = ContainerState::load(&root, "c1", 1 << 20).unwrap();
        for want in [
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
            "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps",
            "TESSERA_LEASE_ID=l-1",
        ] {
            assert!(
                s.lease_env.iter().any(|e| e == want),
                "{want}: {:?}",
                s.lease_env
            );
        }
        assert!(!s.lease_env.iter().any(|e| e.starts_with("PATH=")));
    }

    #[test]
    fn exec_without_a_process_file_gets_the_lease_env_last() {
        let lease = vec![
            "CUDA_VISIBLE_DEVICES=MIG-1".to_string(),
            "TESSERA_LEASE_ID=l-1".to_string(),
        ];
        for line in [
            "exec c1 sh",
            "exec -t c1 sh -c env",
            "exec --env CUDA_VISIBLE_DEVICES=all c1 sh",
            "exec -e=CUDA_VISIBLE_DEVICES=all -e A=1 c1 sh",
            "-root /r exec -d -e CUDA_VISIBLE_DEVICES=all c1 sh",
            "--root=/r exec -u 1000 -- c1 sh --env X=1",
        ] {
            let inv =
                crate::cli::parse_strings(line.split_whitespace().map(String::from).collect())
                    .unwrap();
            let (_, sub) = inv.command.clone().unwrap();
            let argv = argv_with_lease_env(&inv.argv, &sub, &lease);
            let again = crate::cli::parse_strings(argv).unwrap();
            let (_, sub2) = again.command.unwrap();
            let envs = sub2.values("env");
            // runc keeps the last value of a name: the lease's.
            assert_eq!(
                envs[envs.len() - 2..],
                ["CUDA_VISIBLE_DEVICES=MIG-1", "TESSERA_LEASE_ID=l-1"],
                "{line}"
            );
            let pos = |s: &SubArgs| {
                s.positionals
                    .iter()
                    .map(|(_, p)| p.clone())
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                pos(&sub2),
                pos(&sub),
                "{line}: the process's own argv is untouched"
            );
            assert_eq!(again.global, inv.global, "{line}");
            // One spelling of the flag, as the caller's (runc refuses two).
            let names: std::collections::BTreeSet<&str> = sub2
                .flags
                .iter()
                .filter(|f| f.name == "env")
                .map(|f| {
                    again.argv[f.index]
                        .trim_start_matches('-')
                        .split('=')
                        .next()
                        .unwrap()
                })
                .collect();
            assert_eq!(names.len(), 1, "{line}: {:?}", again.argv);
        }
    }

    #[test]
    fn an_exec_process_goes_through_the_table() {
        let mut f = Findings::default();
        harden_process(
            json!({"args": ["sh"], "oomScoreAdj": -1000, "futureKnob": 1,
                   "rlimits": [{"type": "RLIMIT_RTPRIO", "hard": 99, "soft": 99}]}),
            &state(),
            &crate::policy::Policy::default(),
            &mut f,
        );
        let all = f.reasons.join("\n");
        assert!(all.contains("/process/futureKnob: not in"), "{all}");
        assert!(all.contains("/process/oomScoreAdj"), "{all}");
        assert!(all.contains("/process/rlimits/0/type"), "{all}");
    }
}
