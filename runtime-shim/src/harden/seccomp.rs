//! The tenant seccomp profile: kept as data (configs/seccomp/tenant.toml, a reason beside
//! each rule), checked with libseccomp ([`check`]), and written to the spec's
//! `linux.seccomp` for runc to apply. It replaces whatever the tenant spec carried.
//!
//! The built-in profile is checked when the runtime is built: build.rs runs [`check`] on
//! it and embeds the OCI form it produces, so a profile that fails its checks stops the
//! build, and a container start only reads the result (the checks were a fifth of the
//! runtime's own CPU per start). A container start does not even parse that text: the
//! hardened spec carries a placeholder where the profile goes, and
//! [`super::Decision::config_json`] writes the embedded text there as it is (parsing it
//! into a JSON tree, copying it into the spec and writing it out again cost 0.15 ms of
//! each start). A profile file named by the policy is read and checked on every start.

mod check;

pub use check::{CLONE_NS_MASK, MUST_DENY, SeccompError};
use check::{ProfileFile, arch_of};
use libseccomp::ScmpArch;
use serde_json::Value;
use serde_json::value::RawValue;
use std::path::{Path, PathBuf};

/// The built-in profile.
pub const BUILTIN: &str = include_str!("../../../configs/seccomp/tenant.toml");

/// The built-in profile as build.rs checked it: its OCI form for the target architecture.
const BUILTIN_OCI: &str = include_str!(concat!(env!("OUT_DIR"), "/tenant-oci.json"));

/// How the built-in profile is named in messages.
const BUILTIN_NAME: &str = "<built-in configs/seccomp/tenant.toml>";

/// The host's architecture, as libseccomp names it.
fn native_arch() -> ScmpArch {
    arch_of(std::env::consts::ARCH)
}

/// What a hardened spec carries in `linux.seccomp` when the built-in profile applies:
/// [`super::Decision::config_json`] writes the profile there. A spec written any other
/// way keeps this string, which runc refuses (it wants an object): fail closed.
pub const BUILTIN_PLACEHOLDER: &str =
    "tessera: the built-in seccomp profile, written in by Decision::config_json";

/// A checked profile, ready to be written into specs.
#[derive(Debug, Clone)]
pub struct Profile {
    oci: Oci,
    /// Where it came from (for messages).
    pub source: PathBuf,
}

/// The OCI `linux.seccomp` object for the host's architecture.
#[derive(Debug, Clone)]
enum Oci {
    /// The built-in profile's text as build.rs wrote it (checked there): written into
    /// config.json as it is.
    Builtin(&'static RawValue),
    /// A profile file's, checked on this start.
    Checked(Value),
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

    /// The built-in profile, as build.rs checked it (its text is only scanned here:
    /// that it is one JSON value).
    pub fn builtin() -> Result<Self, SeccompError> {
        let path = Path::new(BUILTIN_NAME);
        let raw = serde_json::from_str::<&'static RawValue>(BUILTIN_OCI).map_err(|source| {
            SeccompError::Builtin {
                path: path.to_path_buf(),
                source,
            }
        })?;
        Ok(Self {
            oci: Oci::Builtin(raw),
            source: path.to_path_buf(),
        })
    }

    /// The OCI `linux.seccomp` object, as a JSON tree (the built-in profile is parsed
    /// for this: `check`'s output and tests, never a container start).
    pub fn oci(&self) -> Result<Value, SeccompError> {
        match &self.oci {
            Oci::Builtin(raw) => {
                serde_json::from_str(raw.get()).map_err(|source| SeccompError::Builtin {
                    path: self.source.clone(),
                    source,
                })
            }
            Oci::Checked(v) => Ok(v.clone()),
        }
    }

    /// The built-in profile's text, when this is the built-in profile.
    pub fn builtin_text(&self) -> Option<&'static RawValue> {
        match &self.oci {
            Oci::Builtin(raw) => Some(raw),
            Oci::Checked(_) => None,
        }
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

    /// Check a parsed profile and produce the OCI form for the host's architecture.
    fn check(file: &ProfileFile, path: &Path) -> Result<Self, SeccompError> {
        Ok(Self {
            oci: Oci::Checked(check::check(file, path, native_arch())?),
            source: path.to_path_buf(),
        })
    }

    /// Whether the profile lets `name` through with no argument filter.
    pub fn allows_unconditionally(&self, name: &str) -> bool {
        let Ok(oci) = self.oci() else {
            return false;
        };
        syscall_rules(&oci).iter().any(|r| {
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

/// Replace the spec's seccomp with the tenant profile (the built-in one as
/// [`BUILTIN_PLACEHOLDER`]). Returns a note when the tenant's own profile was dropped.
pub fn apply(spec: &mut Value, profile: &Profile) -> Option<String> {
    let linux = super::json::obj_entry(spec, "linux")?;
    let had = linux.get("seccomp").is_some_and(|s| !s.is_null());
    let oci = match &profile.oci {
        Oci::Builtin(_) => Value::String(BUILTIN_PLACEHOLDER.to_string()),
        Oci::Checked(v) => v.clone(),
    };
    linux.insert("seccomp".to_string(), oci);
    had.then(|| "the spec's own seccomp profile was replaced by the tenant profile".to_string())
}

/// `spec` as JSON, with `raw` (the built-in profile's text) in `linux.seccomp`
/// where [`apply`] put the placeholder. Everything else is written as
/// `serde_json::to_vec` would.
pub fn spliced(spec: &Value, raw: &RawValue) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&Spliced { spec, raw })
}

struct Spliced<'a> {
    spec: &'a Value,
    raw: &'a RawValue,
}

impl serde::Serialize for Spliced<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let Value::Object(top) = self.spec else {
            return self.spec.serialize(s);
        };
        let mut m = s.serialize_map(Some(top.len()))?;
        for (k, v) in top {
            match v {
                Value::Object(linux) if k == "linux" => m.serialize_entry(
                    k,
                    &Linux {
                        linux,
                        raw: self.raw,
                    },
                )?,
                _ => m.serialize_entry(k, v)?,
            }
        }
        m.end()
    }
}

struct Linux<'a> {
    linux: &'a serde_json::Map<String, Value>,
    raw: &'a RawValue,
}

impl serde::Serialize for Linux<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.linux.len()))?;
        for (k, v) in self.linux {
            if k == "seccomp" && v.as_str() == Some(BUILTIN_PLACEHOLDER) {
                m.serialize_entry(k, self.raw)?;
            } else {
                m.serialize_entry(k, v)?;
            }
        }
        m.end()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::check::{oci_arch_name, resolves};
    use super::*;
    use libseccomp::ScmpArch;
    use serde_json::json;
    use std::collections::HashSet;
    use std::str::FromStr;

    #[test]
    fn builtin_profile_loads_and_blocks_the_reference_list() {
        let p = Profile::load(None).unwrap();
        let oci = p.oci().unwrap();
        assert_eq!(oci["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(oci["defaultErrnoRet"], 1);
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
        let rules = syscall_rules(&oci);
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
    fn the_built_in_profile_is_what_checking_its_toml_here_gives() {
        // build.rs checked the TOML with the same code; what it embedded must be exactly
        // what the check gives on this host, with the libseccomp linked here.
        let from_toml: ProfileFile = toml::from_str(BUILTIN).unwrap();
        assert!(
            from_toml
                .allow
                .iter()
                .any(|r| r.args.iter().any(|a| a.value_two != 0))
        );
        let parsed = Profile::parse(BUILTIN, Path::new("tenant.toml")).unwrap();
        let parsed = parsed.oci().unwrap();
        assert_eq!(parsed, Profile::builtin().unwrap().oci().unwrap());
        assert_eq!(parsed, Profile::load(None).unwrap().oci().unwrap());
    }

    /// The emitted filter enforces the profile rule for rule: every allowed name is allowed
    /// with exactly its rule's argument filters (and never unconditionally when the rule
    /// has filters), every [[errno]] name gets its errno, every [[deny]] name is allowed by
    /// no rule and so gets the default EPERM, and nothing else is allowed.
    #[test]
    fn emitted_filter_matches_the_profile_rule_for_rule() {
        let file: ProfileFile = toml::from_str(BUILTIN).unwrap();
        let profile = Profile::builtin().unwrap();
        let p = profile.oci().unwrap();
        let native = native_arch();
        assert_eq!(p["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(p["defaultErrnoRet"], 1);
        assert_eq!(p["architectures"], json!([oci_arch_name(native).unwrap()]));
        let rules = syscall_rules(&p);
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
                    assert!(
                        !profile.allows_unconditionally(n),
                        "{n} must stay conditional"
                    );
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
        // The built-in profile: its placeholder, which `spliced` writes over.
        let p = Profile::load(None).unwrap();
        let mut spec = json!({"linux": {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW"}}});
        assert!(apply(&mut spec, &p).is_some());
        assert_eq!(spec["linux"]["seccomp"], BUILTIN_PLACEHOLDER);
        let mut spec = json!({});
        assert!(apply(&mut spec, &p).is_none());
        assert_eq!(spec["linux"]["seccomp"], BUILTIN_PLACEHOLDER);
        // A profile file's: the object itself.
        let file = Profile::parse(BUILTIN, Path::new("tenant.toml")).unwrap();
        let mut spec = json!({"linux": {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW"}}});
        assert!(apply(&mut spec, &file).is_some());
        assert_eq!(spec["linux"]["seccomp"], file.oci().unwrap());
        assert_eq!(spec["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ERRNO");
    }

    #[test]
    fn spliced_writes_the_builtin_text_where_the_placeholder_was() {
        let p = Profile::load(None).unwrap();
        let raw = p.builtin_text().unwrap();
        let mut spec = json!({"ociVersion": "1.0.2", "linux": {"namespaces": [{"type": "pid"}],
            "seccomp": {"defaultAction": "SCMP_ACT_ALLOW"}, "sysctl": {}}, "process": {"args": ["sh"]}});
        apply(&mut spec, &p);
        let bytes = spliced(&spec, raw).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(!text.contains(BUILTIN_PLACEHOLDER), "{text}");
        assert!(text.contains(raw.get()), "the text as build.rs wrote it");
        let written: Value = serde_json::from_slice(&bytes).unwrap();
        let mut want = spec.clone();
        want["linux"]["seccomp"] = p.oci().unwrap();
        assert_eq!(written, want);
        // The placeholder is only replaced where the profile goes: elsewhere it is the
        // tenant's text, written as it was.
        let mut spec = json!({"annotations": {"a": BUILTIN_PLACEHOLDER}, "linux": {}});
        apply(&mut spec, &p);
        let written: Value = serde_json::from_slice(&spliced(&spec, raw).unwrap()).unwrap();
        assert_eq!(written["annotations"]["a"], BUILTIN_PLACEHOLDER);
        assert_eq!(written["linux"]["seccomp"], p.oci().unwrap());
        // A spec without a linux object (no placeholder) is written as it is.
        let plain = json!({"process": {}});
        assert_eq!(
            spliced(&plain, raw).unwrap(),
            serde_json::to_vec(&plain).unwrap()
        );
    }
}
