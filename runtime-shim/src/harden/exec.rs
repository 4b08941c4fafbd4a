//! `exec`: the process runc starts is always one the runtime wrote, from the
//! container's record of its create ([`crate::record`]) and what the caller asked:
//! the process JSON (`--process`) or the command-line flags. It may not give a
//! process more than the container has: its own user, group and additional groups
//! (always written explicitly: runc would default a missing one to root), no
//! capability beyond the container's bounding set, `noNewPrivileges` forced, the
//! container's own AppArmor profile and SELinux label, the lease's variables.

use super::base::{Findings, strings};
use super::caps;
use crate::cli::SubArgs;
use crate::policy::{Policy, cap_name};
use crate::record::{Record, User};
use serde_json::{Value, json};

/// What the runtime recorded about a container at its create.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ContainerState {
    /// The bounding set.
    pub bounding: Vec<String>,
    /// The container's own five capability sets, by OCI name (a set left out:
    /// empty). An exec'd process gets no capability outside the container's set of
    /// the same name.
    pub caps: std::collections::BTreeMap<String, Vec<String>>,
    /// The CPU resources it was granted (update may not loosen them).
    pub cpu: Option<crate::resources::Cpu>,
    pub apparmor_profile: Option<String>,
    pub process_label: Option<String>,
    /// The user, group and additional groups the container was started with.
    pub user: User,
    /// The lease's variables the container was started with (`KEY=value`), given to
    /// every exec'd process too.
    pub lease_env: Vec<String>,
    /// The device cgroup rules the container was started with.
    pub device_rules: Vec<Value>,
    /// The pids and memory limits it was granted.
    pub pids_limit: Option<i64>,
    pub memory_limit: Option<i64>,
    pub memory_swap: Option<i64>,
}

/// The environment variables the runtime sets from a lease.
pub const LEASE_ENV_KEYS: &[&str] = &[
    tessera_common::contract::LEASE_ID_ENV,
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY",
    // A shared MPS lease's client-side limits (the server sets none).
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
];

impl ContainerState {
    /// The state of a container from its record.
    pub fn from_record(r: &Record) -> Self {
        let opt = |k: &str| {
            r.process
                .get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
        };
        Self {
            bounding: r
                .process
                .pointer("/capabilities/bounding")
                .and_then(strings)
                .unwrap_or_default()
                .iter()
                .map(|c| cap_name(c))
                .collect(),
            caps: caps::SETS
                .iter()
                .map(|set| {
                    let own = r
                        .process
                        .pointer(&format!("/capabilities/{set}"))
                        .and_then(strings)
                        .unwrap_or_default()
                        .iter()
                        .map(|c| cap_name(c))
                        .collect();
                    ((*set).to_string(), own)
                })
                .collect(),
            cpu: r.cpu.clone(),
            apparmor_profile: opt("apparmorProfile"),
            process_label: opt("selinuxLabel"),
            user: r.user.clone(),
            lease_env: r.lease_env.clone(),
            device_rules: r.devices.clone(),
            pids_limit: r.pids_limit,
            memory_limit: r.memory_limit,
            memory_swap: r.memory_swap,
        }
    }

    /// The groups an exec'd process may name: the container's group and additional
    /// groups.
    fn groups(&self) -> Vec<u32> {
        let mut g = vec![self.user.gid];
        g.extend(&self.user.additional_gids);
        g
    }
}

/// The lease id(s) the runtime recorded in a hardened spec's annotations.
pub fn lease_id_of(spec: &Value) -> Option<&str> {
    spec.pointer(&format!(
        "/annotations/{}",
        super::base::LEASE_ID_ANNOTATION.replace('/', "~1")
    ))
    .and_then(Value::as_str)
}

/// `uid[:gid]` as exec's `--user` writes it (decimal numbers only).
fn parse_user(s: &str) -> Option<(u32, Option<u32>)> {
    let num = |x: &str| {
        x.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| x.parse().ok())
            .flatten()
    };
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (u, Some(num(g)?)),
        None => (s, None),
    };
    Some((num(u)?, g))
}

/// Judge every flag runc's exec takes. The ones that shape the process (`--user`,
/// `--additional-gids`, `--apparmor`, `--process-label`, `--no-new-privs`, `--cwd`,
/// `--env`, `--tty`) become part of the process JSON the runtime writes, and only
/// the container's own user, groups and confinement pass; `--cap`, `--cgroup` and
/// `--ignore-paused` are refused. `--detach`, `--pid-file`, `--console-socket` and
/// `--preserve-fds` are the caller's own plumbing and are forwarded.
pub fn check_flags(sub: &SubArgs, state: &ContainerState, f: &mut Findings) {
    for c in sub.values("cap") {
        f.refuse(format!(
            "exec --cap {c} is refused: exec may not add capabilities"
        ));
    }
    if let Some(c) = sub.value("cgroup") {
        f.refuse(format!(
            "exec --cgroup {c} is refused: an exec'd process stays in the container's cgroup"
        ));
    }
    if sub.is_set("ignore-paused") {
        f.refuse("exec --ignore-paused is refused: a paused (frozen) container runs nothing new");
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
    let me = &state.user;
    if let Some(u) = sub.value("user") {
        match parse_user(u) {
            Some((uid, gid)) if uid == me.uid && gid.is_none_or(|g| g == me.gid) => {}
            _ => f.refuse(format!(
                "exec --user {u} is refused: the container runs as {}:{}",
                me.uid, me.gid
            )),
        }
    }
    let groups = state.groups();
    for g in sub.values("additional-gids") {
        let ok = g
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| g.parse::<u32>().ok())
            .flatten()
            .is_some_and(|n| groups.contains(&n));
        if !ok {
            f.refuse(format!(
                "exec --additional-gids {g} is refused: the container's groups are {groups:?}"
            ));
        }
    }
}

/// The process of an exec without `--process`, as runc would build it from the
/// container's config.json and the flags, but from the container's record (the
/// bundle's config.json is not trusted after the create): its process with the
/// command after the container id, `--cwd`, `--tty` and each `--env` added.
pub fn process_from_flags(record: &Record, sub: &SubArgs, f: &mut Findings) -> Value {
    let mut p = record.process.clone();
    let args: Vec<&str> = sub
        .positionals
        .iter()
        .skip(1)
        .map(|(_, a)| a.as_str())
        .collect();
    if args.is_empty() {
        f.refuse("exec: no command to run after the container id");
    }
    if let Some(obj) = p.as_object_mut() {
        obj.insert("args".to_string(), json!(args));
        obj.insert("terminal".to_string(), json!(sub.is_set("tty")));
        if let Some(c) = sub.value("cwd") {
            obj.insert("cwd".to_string(), json!(c));
        }
        let mut env = obj.get("env").and_then(strings).unwrap_or_default();
        env.extend(sub.values("env").into_iter().map(str::to_string));
        obj.insert("env".to_string(), json!(env));
    }
    p
}

/// The `user` of an exec'd process: the container's uid, gid and additional gids,
/// always written out. The process JSON may repeat them or name fewer additional
/// groups, never another user or group.
fn exec_user(asked: Option<&Value>, state: &ContainerState, f: &mut Findings) -> Value {
    let me = &state.user;
    let mut user = json!({"uid": me.uid, "gid": me.gid, "additionalGids": me.additional_gids});
    let Some(asked) = asked.filter(|u| !u.is_null()) else {
        return user;
    };
    let Some(obj) = asked.as_object() else {
        f.refuse("/process/user: not an object");
        return user;
    };
    for (k, want) in [("uid", me.uid), ("gid", me.gid)] {
        if let Some(v) = obj.get(k)
            && v.as_u64() != Some(u64::from(want))
        {
            f.refuse(format!(
                "/process/user/{k}: exec as {k} {v} is refused: the container runs as {}:{}",
                me.uid, me.gid
            ));
        }
    }
    let groups = state.groups();
    match obj.get("additionalGids") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for (i, g) in a.iter().enumerate() {
                if !g
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .is_some_and(|n| groups.contains(&n))
                {
                    f.refuse(format!(
                        "/process/user/additionalGids/{i}: group {g} is refused: the container's groups are {groups:?}"
                    ));
                }
            }
        }
        Some(_) => f.refuse("/process/user/additionalGids: not a list of groups"),
    }
    if let Some(m) = obj.get("umask").filter(|m| !m.is_null()) {
        match m.as_u64().filter(|m| *m <= 0o777) {
            Some(m) => user["umask"] = json!(m),
            None => f.refuse("/process/user/umask: not a file mode"),
        }
    }
    user
}

/// The process's AppArmor profile is the container's (another is noted and replaced);
/// another SELinux label is refused.
fn check_lsm(obj: &serde_json::Map<String, Value>, state: &ContainerState, f: &mut Findings) {
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
}

/// The process's variables without the lease token (the runtime's to read, never the
/// process's: containerd builds an exec's env from the container's spec as it was
/// before the runtime judged it) and with the lease's in place of any of the same name.
fn with_lease_env(env: Option<&Value>, lease_env: &[String]) -> Vec<String> {
    let token = format!("{}=", tessera_common::contract::LEASE_TOKEN_ENV);
    let mut env = env.and_then(strings).unwrap_or_default();
    env.retain(|x| !x.starts_with(&token));
    for e in lease_env {
        let key = e.split('=').next().unwrap_or_default();
        env.retain(|x| !x.starts_with(&format!("{key}=")));
        env.push(e.clone());
    }
    env
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
    let user = exec_user(obj.get("user"), state, f);
    let reduced = caps::reduce(
        obj.get("capabilities"),
        policy,
        Some(&state.caps),
        "exec --process",
        f,
    );
    check_lsm(obj, state, f);
    if let Some(obj) = process.as_object_mut() {
        // kubectl exec, exec probes and podman exec see the lease like the init
        // process: its variables win over the process JSON's, and the token is gone.
        if obj.contains_key("env") || !state.lease_env.is_empty() {
            let env = with_lease_env(obj.get("env"), &state.lease_env);
            obj.insert("env".to_string(), json!(env));
        }
        obj.insert("user".to_string(), user);
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn state() -> ContainerState {
        let two = vec!["CAP_KILL".to_string(), "CAP_CHOWN".to_string()];
        ContainerState {
            bounding: two.clone(),
            caps: [
                ("bounding", two.clone()),
                ("effective", two.clone()),
                ("permitted", two),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
            user: User {
                uid: 1000,
                gid: 1000,
                additional_gids: vec![1000, 44],
            },
            lease_env: vec!["TESSERA_LEASE_ID=l-1".into()],
            ..ContainerState::default()
        }
    }

    #[test]
    fn exec_runs_as_the_containers_user_and_groups_only() {
        let p = crate::policy::Policy::default();
        let own = json!({"uid": 1000, "gid": 1000, "additionalGids": [1000, 44]});
        // Whatever part of the user is left out is the container's, never root's.
        for asked in [
            json!({"args": ["sh"]}),
            json!({"args": ["sh"], "user": null}),
            json!({"args": ["sh"], "user": {}}),
            json!({"args": ["sh"], "user": {"gid": 1000}}),
            json!({"args": ["sh"], "user": {"uid": 1000}}),
            json!({"args": ["sh"], "user": {"uid": 1000, "gid": 1000, "additionalGids": [44]}}),
        ] {
            let mut f = Findings::default();
            let out = harden_process(asked.clone(), &state(), &p, &mut f);
            assert!(f.reasons.is_empty(), "{asked}: {:?}", f.reasons);
            assert_eq!(out["user"], own, "{asked}");
        }
        for (asked, want) in [
            (json!({"uid": 0, "gid": 0}), "/process/user/uid"),
            (json!({"gid": 0}), "/process/user/gid"),
            (json!({"uid": 0}), "/process/user/uid"),
            (
                json!({"uid": 1000, "gid": 1000, "additionalGids": [0]}),
                "/process/user/additionalGids/0",
            ),
            (
                json!({"additionalGids": [44, 27]}),
                "/process/user/additionalGids/1",
            ),
            (
                json!({"additionalGids": "0"}),
                "/process/user/additionalGids",
            ),
            (json!({"uid": "1000"}), "/process/user/uid"),
            (json!([0]), "/process/user: not an object"),
        ] {
            let mut f = Findings::default();
            harden_process(json!({"args": ["sh"], "user": asked}), &state(), &p, &mut f);
            assert!(
                f.reasons.iter().any(|r| r.contains(want)),
                "{asked}: want {want} in {:?}",
                f.reasons
            );
        }
        assert_eq!(parse_user("0:0"), Some((0, Some(0))));
        assert_eq!(parse_user("1000"), Some((1000, None)));
        assert_eq!(parse_user("+1000"), None);
        assert_eq!(parse_user("root"), None);
    }

    #[test]
    fn exec_flags_are_judged() {
        let sub = |line: &str| {
            crate::cli::parse_strings(line.split_whitespace().map(String::from).collect())
                .unwrap()
                .command
                .unwrap()
                .1
        };
        for line in [
            "exec c1 sh",
            "exec -u 1000 c1 sh",
            "exec --user 1000:1000 -g 44 --additional-gids=1000 c1 sh",
            "exec --no-new-privs -t -d --cwd /tmp -e A=1 c1 sh",
        ] {
            let mut f = Findings::default();
            check_flags(&sub(line), &state(), &mut f);
            assert!(f.reasons.is_empty(), "{line}: {:?}", f.reasons);
        }
        for (line, want) in [
            ("exec -g 0 c1 sh", "--additional-gids 0"),
            ("exec --additional-gids=27 c1 sh", "--additional-gids 27"),
            ("exec -g 0x0 c1 sh", "--additional-gids 0x0"),
            ("exec --user 1000:0 c1 sh", "--user 1000:0"),
            ("exec -u 0 c1 sh", "--user 0"),
            ("exec --cgroup /other c1 sh", "--cgroup"),
            ("exec --ignore-paused c1 sh", "--ignore-paused"),
            ("exec --cap CAP_SYS_ADMIN c1 sh", "--cap"),
            ("exec --apparmor unconfined c1 sh", "--apparmor"),
            ("exec --process-label x c1 sh", "--process-label"),
            ("exec --no-new-privs=false c1 sh", "--no-new-privs=false"),
        ] {
            let mut f = Findings::default();
            check_flags(&sub(line), &state(), &mut f);
            assert!(
                f.reasons.iter().any(|r| r.contains(want)),
                "{line}: want {want} in {:?}",
                f.reasons
            );
        }
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

    /// A shared MPS lease's client-side limits are lease variables: an exec gets
    /// them from the container's record, over whatever the caller passes, with or
    /// without a process JSON.
    #[test]
    fn an_exec_keeps_a_shared_mps_leases_limits() {
        let spec = json!({
            "annotations": {super::super::base::LEASE_ID_ANNOTATION: "l-1"},
            "process": {"user": {"uid": 1000, "gid": 1000}, "args": ["sleep"], "env": [
                "PATH=/bin",
                "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
            ]}
        });
        let rec = Record::from_spec(
            "c1",
            "/r",
            std::path::Path::new("/b"),
            &spec,
            lease_id_of(&spec),
            LEASE_ENV_KEYS,
        )
        .unwrap();
        let st = ContainerState::from_record(&rec);
        let line = "exec -e CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 -e TESSERA_LEASE_ID=forged --tty c1 sh -c env";
        let inv =
            crate::cli::parse_strings(line.split_whitespace().map(String::from).collect()).unwrap();
        let sub = inv.command.unwrap().1;
        let mut f = Findings::default();
        let from_flags = process_from_flags(&rec, &sub, &mut f);
        for p in [
            from_flags,
            json!({"args": ["sh"], "env": ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100", "TESSERA_LEASE_ID=forged"]}),
        ] {
            let out = harden_process(p, &st, &crate::policy::Policy::default(), &mut f);
            assert!(f.reasons.is_empty(), "{:?}", f.reasons);
            let env = strings(&out["env"]).unwrap();
            for want in [
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M",
                "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps",
                "TESSERA_LEASE_ID=l-1",
            ] {
                assert!(env.iter().any(|e| e == want), "{want}: {env:?}");
            }
            assert!(
                !env.iter()
                    .any(|e| e.ends_with("=forged") || e.ends_with("=100"))
            );
            assert_eq!(
                out["user"],
                json!({"uid": 1000, "gid": 1000, "additionalGids": []})
            );
        }
        let mut f = Findings::default();
        let p = process_from_flags(&rec, &sub, &mut f);
        assert_eq!(p["args"], json!(["sh", "-c", "env"]));
        assert_eq!(p["terminal"], true);
    }

    /// containerd builds an exec's env from the container's spec as it stood before
    /// the runtime judged it: a token delivered as a variable (a DRA claim's CDI
    /// spec, `podman run -e`) must not reach the exec'd process either.
    #[test]
    fn an_exec_never_carries_the_lease_token() {
        let spec = json!({
            "annotations": {super::super::base::LEASE_ID_ANNOTATION: "l-1"},
            "process": {"user": {"uid": 1000, "gid": 1000}, "args": ["sleep"], "env": ["PATH=/bin"]}
        });
        let rec = Record::from_spec(
            "c1",
            "/r",
            std::path::Path::new("/b"),
            &spec,
            lease_id_of(&spec),
            LEASE_ENV_KEYS,
        )
        .unwrap();
        let line = "exec -e TESSERA_LEASE_TOKEN=tsr1_flag c1 sh -c env";
        let inv =
            crate::cli::parse_strings(line.split_whitespace().map(String::from).collect()).unwrap();
        let sub = inv.command.unwrap().1;
        let mut f = Findings::default();
        let from_flags = process_from_flags(&rec, &sub, &mut f);
        for lease_env in [vec![], vec!["TESSERA_LEASE_ID=l-1".to_string()]] {
            let mut st = ContainerState::from_record(&rec);
            st.lease_env = lease_env;
            for p in [
                from_flags.clone(),
                json!({"args": ["sh"], "env": ["PATH=/bin", "TESSERA_LEASE_TOKEN=tsr1_json"]}),
            ] {
                let out = harden_process(p, &st, &crate::policy::Policy::default(), &mut f);
                assert!(f.reasons.is_empty(), "{:?}", f.reasons);
                let env = strings(&out["env"]).unwrap();
                assert!(
                    !env.iter().any(|e| e.starts_with("TESSERA_LEASE_TOKEN=")),
                    "{env:?}"
                );
                assert!(env.iter().any(|e| e == "PATH=/bin"), "{env:?}");
            }
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
