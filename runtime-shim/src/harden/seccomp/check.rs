//! The checks every tenant seccomp profile must pass, and the OCI form they produce:
//! an allowlist (a refusing default action), every syscall name known to libseccomp on
//! one of its rule's architectures, a reason beside each rule, never a syscall of the
//! must-deny floor, `clone` only under the namespace-flag mask, no name both allowed and
//! refused.
//!
//! build.rs compiles this file too: the built-in profile is checked when the runtime is
//! built (a profile that fails stops the build), and a profile file named by the policy
//! when the runtime starts.

use libseccomp::{ScmpArch, ScmpSyscall};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use thiserror::Error;

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
pub struct Arg {
    pub index: u32,
    pub value: u64,
    #[serde(default)]
    pub value_two: u64,
    pub op: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllowRule {
    pub names: Vec<String>,
    pub reason: String,
    #[serde(default)]
    pub args: Vec<Arg>,
    #[serde(default)]
    pub arches: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrnoRule {
    pub names: Vec<String>,
    pub reason: String,
    pub errno: u32,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenyRule {
    pub names: Vec<String>,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileFile {
    pub default_action: String,
    pub default_errno: u32,
    pub architectures: Vec<String>,
    #[serde(default)]
    pub allow: Vec<AllowRule>,
    #[serde(default)]
    pub errno: Vec<ErrnoRule>,
    #[serde(default)]
    pub deny: Vec<DenyRule>,
}

pub const OPS: &[&str] = &[
    "SCMP_CMP_NE",
    "SCMP_CMP_LT",
    "SCMP_CMP_LE",
    "SCMP_CMP_EQ",
    "SCMP_CMP_GE",
    "SCMP_CMP_GT",
    "SCMP_CMP_MASKED_EQ",
];

pub const DEFAULT_ACTIONS: &[&str] = &[
    "SCMP_ACT_ERRNO",
    "SCMP_ACT_KILL",
    "SCMP_ACT_KILL_THREAD",
    "SCMP_ACT_KILL_PROCESS",
];

pub fn oci_arch_name(arch: ScmpArch) -> Option<&'static str> {
    match arch {
        ScmpArch::X8664 => Some("SCMP_ARCH_X86_64"),
        ScmpArch::Aarch64 => Some("SCMP_ARCH_AARCH64"),
        _ => None,
    }
}

/// The libseccomp architecture of a Rust `target_arch` (x86_64 unless aarch64: the two
/// the profile supports).
pub fn arch_of(target_arch: &str) -> ScmpArch {
    if target_arch == "aarch64" {
        ScmpArch::Aarch64
    } else {
        ScmpArch::X8664
    }
}

pub fn resolves(name: &str, arch: ScmpArch) -> bool {
    ScmpSyscall::from_name_by_arch(name, arch).is_ok_and(|s| i32::from(s) >= 0)
}

fn short(s: &str) -> String {
    let s = s.trim();
    if s.chars().count() > 48 {
        format!("{}...", s.chars().take(45).collect::<String>())
    } else {
        s.to_string()
    }
}

/// Check a parsed profile and produce its OCI `linux.seccomp` object for `native`, the
/// architecture the containers run on: only the names that resolve there are emitted.
pub fn check(file: &ProfileFile, path: &Path, native: ScmpArch) -> Result<Value, SeccompError> {
    let c = Checker::new(file, path, native)?;
    let mut rules = Vec::new();
    let mut allowed: HashSet<&str> = HashSet::new();
    for (i, r) in file.allow.iter().enumerate() {
        if let Some(rule) = c.allow_rule(i, r, &mut allowed)? {
            rules.push(rule);
        }
    }
    for (i, r) in file.errno.iter().enumerate() {
        let native_names = c.check_names("errno", i, &r.reason, &r.names, &c.arches)?;
        c.not_allowed("errno", i, &r.reason, &r.names, &allowed)?;
        let names: Vec<&str> = native_names.iter().map(|k| r.names[*k].as_str()).collect();
        if !names.is_empty() {
            rules.push(json!({"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": r.errno}));
        }
    }
    // [[deny]] entries document refusals the default action already gives (EPERM);
    // they are checked (known names, not allowed elsewhere) but not emitted, which
    // keeps the filter runc compiles small.
    for (i, r) in file.deny.iter().enumerate() {
        c.check_names("deny", i, &r.reason, &r.names, &c.arches)?;
        c.not_allowed("deny", i, &r.reason, &r.names, &allowed)?;
    }
    let mut oci = json!({
        "defaultAction": file.default_action,
        "architectures": [c.native_name],
        "syscalls": rules,
    });
    if file.default_action == "SCMP_ACT_ERRNO" {
        oci["defaultErrnoRet"] = json!(file.default_errno);
    }
    Ok(oci)
}

/// A profile's checks, for one file and the native architecture.
struct Checker<'a> {
    path: &'a Path,
    native: ScmpArch,
    native_name: &'static str,
    /// The profile's architectures.
    arches: Vec<ScmpArch>,
}

impl<'a> Checker<'a> {
    /// The profile's default action is a refusal and its architectures are known and
    /// include the native one.
    fn new(file: &ProfileFile, path: &'a Path, native: ScmpArch) -> Result<Self, SeccompError> {
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
        let native_name = oci_arch_name(native).unwrap_or("SCMP_ARCH_X86_64");
        if !arches.contains(&native) {
            return Err(prof_err(format!(
                "architectures do not include the host's {native_name}"
            )));
        }
        Ok(Self {
            path,
            native,
            native_name,
            arches,
        })
    }

    fn rule_err(&self, kind: &str, i: usize, reason: &str, message: String) -> SeccompError {
        SeccompError::Rule {
            path: self.path.to_path_buf(),
            rule: format!("[[{kind}]] #{} ({})", i + 1, short(reason)),
            message,
        }
    }

    /// Every name must resolve on one of the rule's architectures; the result is the
    /// names that resolve on the native one (each name is resolved there only once).
    fn check_names(
        &self,
        kind: &str,
        i: usize,
        reason: &str,
        names: &[String],
        rule_arches: &[ScmpArch],
    ) -> Result<Vec<usize>, SeccompError> {
        if reason.trim().is_empty() {
            return Err(self.rule_err(kind, i, reason, "has no reason".to_string()));
        }
        if names.is_empty() {
            return Err(self.rule_err(kind, i, reason, "names no syscall".to_string()));
        }
        let native = self.native;
        let on_native = rule_arches.contains(&native);
        let mut native_names = Vec::new();
        for (k, n) in names.iter().enumerate() {
            if on_native && resolves(n, native) {
                native_names.push(k);
            } else if !rule_arches.iter().any(|a| *a != native && resolves(n, *a)) {
                return Err(self.rule_err(kind, i, reason, format!("unknown syscall name {n:?}")));
            }
        }
        Ok(native_names)
    }

    /// No name of an [[errno]] or [[deny]] rule is also allowed.
    fn not_allowed(
        &self,
        kind: &str,
        i: usize,
        reason: &str,
        names: &[String],
        allowed: &HashSet<&str>,
    ) -> Result<(), SeccompError> {
        match names.iter().find(|n| allowed.contains(n.as_str())) {
            Some(n) => Err(self.rule_err(
                kind,
                i,
                reason,
                format!("{n} is also allowed by an [[allow]] rule"),
            )),
            None => Ok(()),
        }
    }

    /// The architectures an [[allow]] rule names (all of the profile's when none).
    fn rule_arches(&self, i: usize, r: &AllowRule) -> Result<Vec<ScmpArch>, SeccompError> {
        let mut rule_arches = Vec::new();
        for a in &r.arches {
            let arch = ScmpArch::from_str(a)
                .ok()
                .filter(|x| self.arches.contains(x))
                .ok_or_else(|| {
                    self.rule_err(
                        "allow",
                        i,
                        &r.reason,
                        format!("architecture {a} not in the profile"),
                    )
                })?;
            rule_arches.push(arch);
        }
        if rule_arches.is_empty() {
            rule_arches.clone_from(&self.arches);
        }
        Ok(rule_arches)
    }

    /// An [[allow]] rule checked (known names, sane argument filters, nothing a GPU
    /// tenant must never get, clone only with the namespace mask), its names added to
    /// `allowed`; its OCI rule, unless no name resolves on the native architecture.
    fn allow_rule<'f>(
        &self,
        i: usize,
        r: &'f AllowRule,
        allowed: &mut HashSet<&'f str>,
    ) -> Result<Option<Value>, SeccompError> {
        let rule_arches = self.rule_arches(i, r)?;
        let native_names = self.check_names("allow", i, &r.reason, &r.names, &rule_arches)?;
        let err = |message: String| self.rule_err("allow", i, &r.reason, message);
        for a in &r.args {
            if a.index > 5 || !OPS.contains(&a.op.as_str()) {
                return Err(err(format!(
                    "bad argument filter (index {}, op {})",
                    a.index, a.op
                )));
            }
        }
        let guarded = r.args.iter().any(|a| {
            a.index == 0
                && a.op == "SCMP_CMP_MASKED_EQ"
                && a.value & CLONE_NS_MASK == CLONE_NS_MASK
                && a.value_two == 0
        });
        for n in &r.names {
            if MUST_DENY.contains(&n.as_str()) {
                return Err(err(format!(
                    "allows {n}, which a GPU tenant must never get"
                )));
            }
            if n == "clone" && !guarded {
                return Err(err(
                    "allows clone without the namespace-flag mask 0x7E020000".to_string(),
                ));
            }
            allowed.insert(n);
        }
        let names: Vec<&str> = native_names.iter().map(|k| r.names[*k].as_str()).collect();
        if names.is_empty() {
            return Ok(None);
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
        Ok(Some(rule))
    }
}
