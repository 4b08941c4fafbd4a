//! The tenant seccomp profile: kept as data (configs/seccomp/tenant.toml, a reason beside
//! each rule), checked with libseccomp when the runtime starts, and written to the spec's
//! `linux.seccomp` for runc to apply. It replaces whatever the tenant spec carried.
//!
//! The built-in profile is embedded as JSON converted from the TOML at build time
//! (build.rs): parsing TOML was most of the profile's per-start cost. Every check still
//! runs on every start; a profile file named by the policy is read as TOML.

use libseccomp::{ScmpArch, ScmpSyscall};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use thiserror::Error;

/// The built-in profile.
pub const BUILTIN: &str = include_str!("../../../configs/seccomp/tenant.toml");

/// The built-in profile, converted from [`BUILTIN`] to JSON by build.rs.
const BUILTIN_JSON: &str = include_str!(concat!(env!("OUT_DIR"), "/tenant.json"));

/// How the built-in profile is named in messages.
const BUILTIN_NAME: &str = "<built-in configs/seccomp/tenant.toml>";

/// Syscalls that no tenant profile may allow, with or without argument filters: the
/// GPU-tenant extras of the reference on top of Docker's default refusals.
pub const MUST_DENY: &[&str] = &[
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "unshare",
    "setns",
    "clone3",
    "mount",
    "umount2",
    "pivot_root",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "reboot",
];

/// The namespace flags `clone` must be guarded by.
pub const CLONE_NS_MASK: u64 = 0x7E02_0000;

/// Errors loading or checking a seccomp profile.
#[derive(Debug, Error)]
pub enum SeccompError {
    #[error("reading seccomp profile {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("seccomp profile {path}: {source}")]
    Parse {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("seccomp profile {path} (built-in, as JSON): {source}")]
    Builtin {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("seccomp profile {path}: {rule}: {message}")]
    Rule {
        path: PathBuf,
        rule: String,
        message: String,
    },
    #[error("seccomp profile {path}: {message}")]
    Profile { path: PathBuf, message: String },
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct Arg {
    index: u32,
    value: u64,
    #[serde(default)]
    value_two: u64,
    op: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct AllowRule {
    names: Vec<String>,
    reason: String,
    #[serde(default)]
    args: Vec<Arg>,
    #[serde(default)]
    arches: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct ErrnoRule {
    names: Vec<String>,
    reason: String,
    errno: u32,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct DenyRule {
    names: Vec<String>,
    reason: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileFile {
    default_action: String,
    default_errno: u32,
    architectures: Vec<String>,
    #[serde(default)]
    allow: Vec<AllowRule>,
    #[serde(default)]
    errno: Vec<ErrnoRule>,
    #[serde(default)]
    deny: Vec<DenyRule>,
}

const OPS: &[&str] = &[
    "SCMP_CMP_NE",
    "SCMP_CMP_LT",
    "SCMP_CMP_LE",
    "SCMP_CMP_EQ",
    "SCMP_CMP_GE",
    "SCMP_CMP_GT",
    "SCMP_CMP_MASKED_EQ",
];

const DEFAULT_ACTIONS: &[&str] = &[
    "SCMP_ACT_ERRNO",
    "SCMP_ACT_KILL",
    "SCMP_ACT_KILL_THREAD",
    "SCMP_ACT_KILL_PROCESS",
];

/// A checked profile, ready to be written into specs.
#[derive(Debug, Clone)]
pub struct Profile {
    /// The OCI `linux.seccomp` object for the host's architecture.
    pub oci: Value,
    /// Where it came from (for messages).
    pub source: PathBuf,
}

fn oci_arch_name(arch: ScmpArch) -> Option<&'static str> {
    match arch {
        ScmpArch::X8664 => Some("SCMP_ARCH_X86_64"),
        ScmpArch::Aarch64 => Some("SCMP_ARCH_AARCH64"),
        _ => None,
    }
}

fn native_arch() -> ScmpArch {
    if cfg!(target_arch = "aarch64") {
        ScmpArch::Aarch64
    } else {
        ScmpArch::X8664
    }
}

fn resolves(name: &str, arch: ScmpArch) -> bool {
    ScmpSyscall::from_name_by_arch(name, arch).is_ok_and(|s| i32::from(s) >= 0)
}

impl Profile {
    /// Load the profile named by the policy, or the built-in one.
    pub fn load(path: Option<&Path>) -> Result<Self, SeccompError> {
        match path {
            None => Self::builtin(),
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| SeccompError::Read {
                    path: p.to_path_buf(),
                    source,
                })?;
                Self::parse(&text, p)
            }
        }
    }

    /// The built-in profile, checked.
    pub fn builtin() -> Result<Self, SeccompError> {
        let path = Path::new(BUILTIN_NAME);
        let file: ProfileFile =
            serde_json::from_str(BUILTIN_JSON).map_err(|source| SeccompError::Builtin {
                path: path.to_path_buf(),
                source,
            })?;
        Self::check(&file, path)
    }

    /// Parse and check a profile (TOML text), producing the OCI form for the native
    /// architecture.
    pub fn parse(text: &str, path: &Path) -> Result<Self, SeccompError> {
        let file: ProfileFile = toml::from_str(text).map_err(|e| SeccompError::Parse {
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
        Self::check(&file, path)
    }

    /// Check a parsed profile and produce the OCI form for the native architecture.
    fn check(file: &ProfileFile, path: &Path) -> Result<Self, SeccompError> {
        let prof_err = |message: String| SeccompError::Profile {
            path: path.to_path_buf(),
            message,
        };
        if !DEFAULT_ACTIONS.contains(&file.default_action.as_str()) {
            return Err(prof_err(format!(
                "default_action {} is not a refusal: the profile must be an allowlist",
                file.default_action
            )));
        }
        let mut arches = Vec::new();
        for a in &file.architectures {
            let arch = ScmpArch::from_str(a)
                .ok()
                .filter(|arch| oci_arch_name(*arch).is_some())
                .ok_or_else(|| prof_err(format!("unsupported architecture {a}")))?;
            arches.push(arch);
        }
        let native = native_arch();
        let native_name = oci_arch_name(native).unwrap_or("SCMP_ARCH_X86_64");
        if !arches.contains(&native) {
            return Err(prof_err(format!(
                "architectures do not include the host's {native_name}"
            )));
        }

        let rule_err = |kind: &str, i: usize, reason: &str, message: String| SeccompError::Rule {
            path: path.to_path_buf(),
            rule: format!("[[{kind}]] #{} ({})", i + 1, short(reason)),
            message,
        };
        // Every name must resolve on one of the rule's architectures; the result is the
        // names that resolve on the native one (each name is resolved there only once).
        let check_names = |kind: &str,
                           i: usize,
                           reason: &str,
                           names: &[String],
                           rule_arches: &[ScmpArch]|
         -> Result<Vec<usize>, SeccompError> {
            if reason.trim().is_empty() {
                return Err(rule_err(kind, i, reason, "has no reason".to_string()));
            }
            if names.is_empty() {
                return Err(rule_err(kind, i, reason, "names no syscall".to_string()));
            }
            let on_native = rule_arches.contains(&native);
            let mut native_names = Vec::new();
            for (k, n) in names.iter().enumerate() {
                if on_native && resolves(n, native) {
                    native_names.push(k);
                } else if !rule_arches.iter().any(|a| *a != native && resolves(n, *a)) {
                    return Err(rule_err(
                        kind,
                        i,
                        reason,
                        format!("unknown syscall name {n:?}"),
                    ));
                }
            }
            Ok(native_names)
        };

        let mut rules = Vec::new();
        let mut allowed: HashSet<&str> = HashSet::new();
        for (i, r) in file.allow.iter().enumerate() {
            let mut rule_arches = Vec::new();
            for a in &r.arches {
                let arch = ScmpArch::from_str(a)
                    .ok()
                    .filter(|x| arches.contains(x))
                    .ok_or_else(|| {
                        rule_err(
                            "allow",
                            i,
                            &r.reason,
                            format!("architecture {a} not in the profile"),
                        )
                    })?;
                rule_arches.push(arch);
            }
            if rule_arches.is_empty() {
                rule_arches = arches.clone();
            }
            let native_names = check_names("allow", i, &r.reason, &r.names, &rule_arches)?;
            for a in &r.args {
                if a.index > 5 || !OPS.contains(&a.op.as_str()) {
                    return Err(rule_err(
                        "allow",
                        i,
                        &r.reason,
                        format!("bad argument filter (index {}, op {})", a.index, a.op),
                    ));
                }
            }
            for n in &r.names {
                if MUST_DENY.contains(&n.as_str()) {
                    return Err(rule_err(
                        "allow",
                        i,
                        &r.reason,
                        format!("allows {n}, which a GPU tenant must never get"),
                    ));
                }
                let guarded = r.args.iter().any(|a| {
                    a.index == 0
                        && a.op == "SCMP_CMP_MASKED_EQ"
                        && a.value & CLONE_NS_MASK == CLONE_NS_MASK
                        && a.value_two == 0
                });
                if n == "clone" && !guarded {
                    return Err(rule_err(
                        "allow",
                        i,
                        &r.reason,
                        "allows clone without the namespace-flag mask 0x7E020000".to_string(),
                    ));
                }
                allowed.insert(n);
            }
            let names: Vec<&str> = native_names.iter().map(|k| r.names[*k].as_str()).collect();
            if names.is_empty() {
                continue;
            }
            let mut rule = json!({"names": names, "action": "SCMP_ACT_ALLOW"});
            if !r.args.is_empty() {
                rule["args"] = Value::Array(
                    r.args
                        .iter()
                        .map(|a| {
                            json!({"index": a.index, "value": a.value,
                                   "valueTwo": a.value_two, "op": a.op})
                        })
                        .collect(),
                );
            }
            rules.push(rule);
        }
        let mut emit_errno = |kind: &str,
                              i: usize,
                              reason: &str,
                              names: &[String],
                              errno: u32|
         -> Result<(), SeccompError> {
            let native_names = check_names(kind, i, reason, names, &arches)?;
            for n in names {
                if allowed.contains(n.as_str()) {
                    return Err(rule_err(
                        kind,
                        i,
                        reason,
                        format!("{n} is also allowed by an [[allow]] rule"),
                    ));
                }
            }
            let names: Vec<&str> = native_names.iter().map(|k| names[*k].as_str()).collect();
            if !names.is_empty() {
                rules.push(json!({"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": errno}));
            }
            Ok(())
        };
        for (i, r) in file.errno.iter().enumerate() {
            emit_errno("errno", i, &r.reason, &r.names, r.errno)?;
        }
        // [[deny]] entries document refusals the default action already gives (EPERM);
        // they are checked (known names, not allowed elsewhere) but not emitted, which
        // keeps the filter runc compiles small.
        for (i, r) in file.deny.iter().enumerate() {
            check_names("deny", i, &r.reason, &r.names, &arches)?;
            if let Some(n) = r.names.iter().find(|n| allowed.contains(n.as_str())) {
                return Err(rule_err(
                    "deny",
                    i,
                    &r.reason,
                    format!("{n} is also allowed by an [[allow]] rule"),
                ));
            }
        }
        let mut oci = json!({
            "defaultAction": file.default_action,
            "architectures": [native_name],
            "syscalls": rules,
        });
        if file.default_action == "SCMP_ACT_ERRNO" {
            oci["defaultErrnoRet"] = json!(file.default_errno);
        }
        Ok(Self {
            oci,
            source: path.to_path_buf(),
        })
    }

    /// Whether the profile lets `name` through with no argument filter.
    pub fn allows_unconditionally(&self, name: &str) -> bool {
        syscall_rules(&self.oci).iter().any(|r| {
            r["action"] == "SCMP_ACT_ALLOW"
                && r.get("args").is_none()
                && r["names"]
                    .as_array()
                    .is_some_and(|ns| ns.iter().any(|n| n == name))
        })
    }
}

fn syscall_rules(v: &Value) -> Vec<Value> {
    v.get("syscalls")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

fn short(s: &str) -> String {
    let s = s.trim();
    if s.chars().count() > 48 {
        format!("{}...", s.chars().take(45).collect::<String>())
    } else {
        s.to_string()
    }
}

/// Replace the spec's seccomp with the tenant profile. Returns a note when the tenant's
/// own profile was dropped.
pub fn apply(spec: &mut Value, profile: &Profile) -> Option<String> {
    let linux = super::obj_entry(spec, "linux")?;
    let had = linux.get("seccomp").is_some_and(|s| !s.is_null());
    linux.insert("seccomp".to_string(), profile.oci.clone());
    had.then(|| "the spec's own seccomp profile was replaced by the tenant profile".to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profile_loads_and_blocks_the_reference_list() {
        let p = Profile::load(None).unwrap();
        assert_eq!(p.oci["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(p.oci["defaultErrnoRet"], 1);
        for n in [
            "read",
            "write",
            "openat",
            "execve",
            "futex",
            "mmap",
            "ioctl",
            "exit_group",
        ] {
            assert!(p.allows_unconditionally(n), "{n} should be allowed");
        }
        for n in [
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "userfaultfd",
            "io_uring_setup",
            "bpf",
            "perf_event_open",
            "keyctl",
            "unshare",
            "setns",
            "mount",
            "kexec_load",
            "init_module",
            "finit_module",
            "clone",
            "clone3",
            "socket",
            "mknod",
            "chroot",
            "open_by_handle_at",
            "add_key",
            "pivot_root",
        ] {
            assert!(
                !p.allows_unconditionally(n),
                "{n} must not be allowed unconditionally"
            );
        }
        let rules = syscall_rules(&p.oci);
        let clone3 = rules
            .iter()
            .find(|r| r["names"].as_array().unwrap().iter().any(|n| n == "clone3"))
            .unwrap();
        assert_eq!(clone3["errnoRet"], 38);
        let clone = rules
            .iter()
            .find(|r| r["names"].as_array().unwrap().iter().any(|n| n == "clone"))
            .unwrap();
        assert_eq!(clone["args"][0]["value"], CLONE_NS_MASK);
        assert_eq!(clone["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
    }

    #[test]
    fn builtin_json_is_exactly_the_toml_profile() {
        // build.rs converts the TOML to JSON; nothing may be lost or changed on the way.
        let from_toml: ProfileFile = toml::from_str(BUILTIN).unwrap();
        let from_json: ProfileFile = serde_json::from_str(BUILTIN_JSON).unwrap();
        assert_eq!(from_toml, from_json);
        assert!(
            from_json
                .allow
                .iter()
                .any(|r| r.args.iter().any(|a| a.value_two != 0))
        );
        let parsed = Profile::parse(BUILTIN, Path::new("tenant.toml")).unwrap();
        assert_eq!(parsed.oci, Profile::builtin().unwrap().oci);
        assert_eq!(parsed.oci, Profile::load(None).unwrap().oci);
    }

    /// The emitted filter enforces the profile rule for rule: every allowed name is allowed
    /// with exactly its rule's argument filters (and never unconditionally when the rule
    /// has filters), every [[errno]] name gets its errno, every [[deny]] name is allowed by
    /// no rule and so gets the default EPERM, and nothing else is allowed.
    #[test]
    fn emitted_filter_matches_the_profile_rule_for_rule() {
        let file: ProfileFile = toml::from_str(BUILTIN).unwrap();
        let p = Profile::builtin().unwrap();
        let native = native_arch();
        assert_eq!(p.oci["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(p.oci["defaultErrnoRet"], 1);
        assert_eq!(
            p.oci["architectures"],
            json!([oci_arch_name(native).unwrap()])
        );
        let rules = syscall_rules(&p.oci);
        let emitted = |name: &str, action: &str| -> Vec<Value> {
            rules
                .iter()
                .filter(|r| {
                    r["action"] == action
                        && r["names"].as_array().unwrap().iter().any(|n| n == name)
                })
                .cloned()
                .collect()
        };
        let mut allowed_names = HashSet::new();
        for r in &file.allow {
            let on_native = r.arches.is_empty()
                || r.arches
                    .iter()
                    .any(|a| ScmpArch::from_str(a).unwrap() == native);
            let want_args: Vec<Value> = r
                .args
                .iter()
                .map(|a| json!({"index": a.index, "value": a.value, "valueTwo": a.value_two, "op": a.op}))
                .collect();
            for n in &r.names {
                if !on_native || !resolves(n, native) {
                    assert!(emitted(n, "SCMP_ACT_ALLOW").is_empty(), "{n} not native");
                    continue;
                }
                allowed_names.insert(n.as_str());
                let got = emitted(n, "SCMP_ACT_ALLOW");
                assert!(
                    got.iter()
                        .any(|g| g.get("args").map_or(want_args.is_empty(), |a| {
                            a.as_array().unwrap() == &want_args
                        })),
                    "{n}: no emitted rule with args {want_args:?}: {got:?}"
                );
                if !want_args.is_empty() {
                    assert!(!p.allows_unconditionally(n), "{n} must stay conditional");
                }
            }
        }
        let clone = emitted("clone", "SCMP_ACT_ALLOW");
        assert_eq!(clone.len(), 1);
        assert_eq!(
            clone[0]["args"],
            json!([{"index": 0, "value": CLONE_NS_MASK, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}])
        );
        for r in &file.errno {
            for n in &r.names {
                let got = emitted(n, "SCMP_ACT_ERRNO");
                assert_eq!(got.len(), 1, "{n}");
                assert_eq!(got[0]["errnoRet"], r.errno, "{n}");
                assert!(emitted(n, "SCMP_ACT_ALLOW").is_empty(), "{n}");
            }
        }
        assert_eq!(emitted("clone3", "SCMP_ACT_ERRNO")[0]["errnoRet"], 38);
        for r in &file.deny {
            for n in &r.names {
                assert!(
                    rules.iter().all(|g| !g["names"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|x| x == n.as_str())),
                    "{n} must be left to the default EPERM"
                );
            }
        }
        for n in MUST_DENY {
            assert!(emitted(n, "SCMP_ACT_ALLOW").is_empty(), "{n}");
        }
        // Nothing is allowed that the profile does not allow.
        for g in &rules {
            if g["action"] == "SCMP_ACT_ALLOW" {
                for n in g["names"].as_array().unwrap() {
                    assert!(allowed_names.contains(n.as_str().unwrap()), "{n} extra");
                }
            }
        }
    }

    #[test]
    fn names_unknown_to_the_native_arch_are_checked_on_the_others() {
        // arch_prctl is x86_64-only: on an aarch64 host it is checked (it resolves on
        // x86_64) but not emitted; on x86_64 it is emitted.
        let text = "default_action = \"SCMP_ACT_ERRNO\"\ndefault_errno = 1\narchitectures = [\"SCMP_ARCH_X86_64\", \"SCMP_ARCH_AARCH64\"]\n[[allow]]\nreason = \"x\"\nnames = [\"read\", \"arch_prctl\"]\n";
        let p = Profile::parse(text, Path::new("p")).unwrap();
        assert!(p.allows_unconditionally("read"));
        assert_eq!(
            p.allows_unconditionally("arch_prctl"),
            native_arch() == ScmpArch::X8664
        );
        let with_unknown = text.replace(
            "architectures = [\"SCMP_ARCH_X86_64\", \"SCMP_ARCH_AARCH64\"]",
            "architectures = [\"SCMP_ARCH_X86_64\", \"SCMP_ARCH_AARCH64\"]\n[[errno]]\nreason = \"y\"\nnames = [\"reed\"]\nerrno = 38",
        );
        let e = Profile::parse(&with_unknown, Path::new("p"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"reed\"") && e.contains("[[errno]] #1 (y)"),
            "{e}"
        );
    }

    #[test]
    fn unknown_syscall_is_an_error_naming_the_rule() {
        let text = "default_action = \"SCMP_ACT_ERRNO\"\ndefault_errno = 1\narchitectures = [\"SCMP_ARCH_X86_64\", \"SCMP_ARCH_AARCH64\"]\n[[allow]]\nreason = \"files\"\nnames = [\"read\", \"reed\"]\n";
        let e = Profile::parse(text, Path::new("p.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"reed\"") && e.contains("[[allow]] #1 (files)"),
            "{e}"
        );
    }

    #[test]
    fn profiles_weaker_than_the_floor_are_refused() {
        let head = "default_action = \"SCMP_ACT_ERRNO\"\ndefault_errno = 1\narchitectures = [\"SCMP_ARCH_X86_64\", \"SCMP_ARCH_AARCH64\"]\n";
        for (body, want) in [
            (
                "[[allow]]\nreason = \"x\"\nnames = [\"ptrace\"]\n",
                "ptrace",
            ),
            (
                "[[allow]]\nreason = \"x\"\nnames = [\"clone\"]\n",
                "0x7E020000",
            ),
            (
                "[[allow]]\nreason = \"\"\nnames = [\"read\"]\n",
                "no reason",
            ),
            (
                "[[allow]]\nreason = \"x\"\nnames = [\"read\"]\n[[deny]]\nreason = \"y\"\nnames = [\"read\"]\n",
                "also allowed",
            ),
            (
                "[[allow]]\nreason = \"x\"\nnames = [\"read\"]\nbogus = 1\n",
                "bogus",
            ),
        ] {
            let e = Profile::parse(&format!("{head}{body}"), Path::new("p"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{body}: {e}");
        }
        let allow_all = "default_action = \"SCMP_ACT_ALLOW\"\ndefault_errno = 1\narchitectures = [\"SCMP_ARCH_X86_64\", \"SCMP_ARCH_AARCH64\"]\n";
        assert!(
            Profile::parse(allow_all, Path::new("p"))
                .unwrap_err()
                .to_string()
                .contains("allowlist")
        );
    }

    #[test]
    fn apply_replaces_the_tenant_profile() {
        let p = Profile::load(None).unwrap();
        let mut spec = json!({"linux": {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW"}}});
        assert!(apply(&mut spec, &p).is_some());
        assert_eq!(spec["linux"]["seccomp"], p.oci);
        let mut spec = json!({});
        assert!(apply(&mut spec, &p).is_none());
        assert_eq!(spec["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ERRNO");
    }
}
