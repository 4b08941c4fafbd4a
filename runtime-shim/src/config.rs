//! tessera-runtime's own configuration. Found without relying on the environment
//! (conmon and containerd's shims do not pass it on), in this order:
//!
//! 1. `TESSERA_RUNTIME_CONFIG`, when set: an override (a missing file is an error);
//! 2. `<argv[0]>.toml`, when the runtime was started by an absolute path (a symlink
//!    named `/usr/local/bin/tessera-gpu` reads `/usr/local/bin/tessera-gpu.toml`);
//! 3. `<the executable's real path>.toml` (`/usr/bin/tessera-runtime.toml`);
//! 4. `/etc/tessera/runtime.toml` (when missing: the built-in defaults).
//!
//! A file found next to the binary (2, 3) must be owned by root (or the caller) and
//! writable by nobody else, like the binary itself. Unknown keys refuse to start
//! (fail closed).

use crate::policy::Policy;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Where the config is read from when none is named or found next to the binary.
pub const DEFAULT_PATH: &str = "/etc/tessera/runtime.toml";
/// The environment variable naming another config file (an override).
pub const ENV_VAR: &str = "TESSERA_RUNTIME_CONFIG";

/// Errors loading the runtime config.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// A host library (or file) bind-mounted read-only into GPU containers.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DriverLibrary {
    /// Absolute host path.
    pub source: PathBuf,
    /// Path in the container; the same as `source` when absent.
    #[serde(default)]
    pub destination: Option<PathBuf>,
    /// Skip it (with a note) when the host lacks it, instead of refusing.
    #[serde(default)]
    pub optional: bool,
}

fn default_runc() -> PathBuf {
    PathBuf::from("/usr/sbin/runc")
}
fn default_socket() -> PathBuf {
    PathBuf::from("/run/tessera/tesserad.sock")
}
fn default_timeout() -> u64 {
    5000
}
fn default_nvidia_proc() -> PathBuf {
    PathBuf::from("/proc/driver/nvidia")
}
fn default_state_dir() -> PathBuf {
    PathBuf::from("/run/tessera-runtime")
}
fn default_passthrough() -> Vec<String> {
    vec!["NOTIFY_SOCKET".to_string()]
}

/// The runtime config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Absolute path of the real runtime (runc >= 1.1.12 recommended; see README).
    #[serde(default = "default_runc")]
    pub runc_path: PathBuf,
    #[serde(default = "default_socket")]
    pub daemon_socket: PathBuf,
    /// Deadline for each daemon RPC.
    #[serde(default = "default_timeout")]
    pub daemon_timeout_ms: u64,
    /// Environment variables passed on to runc (PATH is always set to a fixed value).
    #[serde(default = "default_passthrough")]
    pub env_passthrough: Vec<String>,
    /// Host directory with the driver's `gpus/` and `capabilities/` (for masking).
    #[serde(default = "default_nvidia_proc")]
    pub nvidia_proc_root: PathBuf,
    /// When not empty, a lease's tenant must match the pod's Kubernetes namespace:
    /// tenant -> namespaces it may run in.
    #[serde(default)]
    pub tenant_namespaces: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    pub driver_libraries: Vec<DriverLibrary>,
    /// Where the NVIDIA Container Toolkit's CDI spec (`nvidia-ctk cdi generate`) may
    /// be: the first that exists lists the driver's files, in place of
    /// `driver_libraries`. Absent: /etc/cdi/nvidia.{yaml,json}, then nvidia*.yaml|json
    /// in /var/run/cdi and /etc/cdi. `[]`: never (only `driver_libraries`).
    #[serde(default)]
    pub nvidia_cdi_specs: Option<Vec<PathBuf>>,
    /// CVEs of runc that the operator acknowledges as fixed in this runc although its
    /// version predates the fix (a distribution backport), or as an accepted risk.
    /// A container is refused while runc lacks a fix not named here.
    #[serde(default)]
    pub runc_cve_acknowledged: Vec<String>,
    /// The runtime's own state: the cache of `runc --version` answers (root's, 0700;
    /// one not root's alone is ignored).
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    #[serde(default)]
    pub policy: Policy,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            runc_path: default_runc(),
            daemon_socket: default_socket(),
            daemon_timeout_ms: default_timeout(),
            env_passthrough: default_passthrough(),
            nvidia_proc_root: default_nvidia_proc(),
            tenant_namespaces: BTreeMap::new(),
            driver_libraries: Vec::new(),
            nvidia_cdi_specs: None,
            runc_cve_acknowledged: Vec::new(),
            state_dir: default_state_dir(),
            policy: Policy::default(),
        }
    }
}

/// Where the config was found, and whether a missing file there is an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub path: PathBuf,
    /// Named by the environment: must exist.
    pub explicit: bool,
    /// Found next to the binary: must be root-owned and writable by nobody else.
    pub beside_binary: bool,
}

/// The candidate next to a program path: `<path>.toml`.
fn beside(program: &Path) -> PathBuf {
    let mut s = program.as_os_str().to_os_string();
    s.push(".toml");
    PathBuf::from(s)
}

/// Find the config (see the module's order). `env` is `TESSERA_RUNTIME_CONFIG`,
/// `argv0` the program name as started, `exe` the executable's real path; `exists`
/// answers whether a candidate file is there.
pub fn discover(
    env: Option<&std::ffi::OsStr>,
    argv0: Option<&Path>,
    exe: Option<&Path>,
    exists: impl Fn(&Path) -> bool,
) -> Found {
    if let Some(v) = env.filter(|v| !v.is_empty()) {
        return Found {
            path: PathBuf::from(v),
            explicit: true,
            beside_binary: false,
        };
    }
    let candidates = [argv0.filter(|p| p.is_absolute()), exe];
    for program in candidates.into_iter().flatten() {
        let path = beside(program);
        if exists(&path) {
            return Found {
                path,
                explicit: false,
                beside_binary: true,
            };
        }
    }
    Found {
        path: PathBuf::from(DEFAULT_PATH),
        explicit: false,
        beside_binary: false,
    }
}

impl RuntimeConfig {
    /// Find and load the config of this process (see the module's order).
    pub fn load_discovered(argv0: Option<&Path>) -> Result<(Self, Found), ConfigError> {
        let env = std::env::var_os(ENV_VAR);
        let exe = std::env::current_exe().ok();
        let found = discover(env.as_deref(), argv0, exe.as_deref(), |p| {
            std::fs::symlink_metadata(p).is_ok()
        });
        if found.beside_binary {
            check_owner(&found.path)?;
        }
        let cfg = Self::load(&found.path, found.explicit)?;
        Ok((cfg, found))
    }

    /// Load and validate a config file. A missing file at the default path gives the
    /// defaults; a missing file named explicitly is an error.
    pub fn load(path: &Path, explicit: bool) -> Result<Self, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => {
                let cfg = Self::default();
                cfg.validate(path)?;
                return Ok(cfg);
            }
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        Self::parse(&text, path)
    }

    /// Parse and validate config text (`path` is for messages).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let cfg: Self = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        self.validate_paths(path)?;
        self.validate_policy(path)?;
        let bad = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        for name in &self.env_passthrough {
            if name.is_empty() || name.contains('=') || name == "PATH" {
                return Err(bad(format!(
                    "env_passthrough entry {name:?} is not allowed"
                )));
            }
        }
        Ok(())
    }

    /// The runtime's own paths are absolute (runc, the daemon's socket, the state
    /// dir, the NVIDIA CDI specs, the driver libraries) and the daemon's timeout set.
    fn validate_paths(&self, path: &Path) -> Result<(), ConfigError> {
        let bad = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        if !self.runc_path.is_absolute() {
            return Err(bad(format!(
                "runc_path must be absolute, got {}",
                self.runc_path.display()
            )));
        }
        if !self.daemon_socket.is_absolute() {
            return Err(bad("daemon_socket must be absolute".to_string()));
        }
        if !self.state_dir.is_absolute() {
            return Err(bad("state_dir must be absolute".to_string()));
        }
        if self.daemon_timeout_ms == 0 {
            return Err(bad("daemon_timeout_ms must be positive".to_string()));
        }
        for p in self.nvidia_cdi_specs.iter().flatten() {
            if !p.is_absolute() {
                return Err(bad(format!(
                    "nvidia_cdi_specs entry {} is not absolute",
                    p.display()
                )));
            }
        }
        for lib in &self.driver_libraries {
            if !lib.source.is_absolute()
                || lib.destination.as_ref().is_some_and(|d| !d.is_absolute())
            {
                return Err(bad(format!(
                    "driver library {} needs absolute paths",
                    lib.source.display()
                )));
            }
        }
        Ok(())
    }

    /// The policy is one a container can be judged by.
    fn validate_policy(&self, path: &Path) -> Result<(), ConfigError> {
        let bad = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let p = &self.policy;
        if p.pids_limit <= 0 {
            return Err(bad("policy.pids_limit must be positive".to_string()));
        }
        for c in &p.allowed_capabilities {
            let c = crate::policy::cap_name(c);
            if p.forbidden_capabilities
                .iter()
                .any(|f| crate::policy::cap_name(f) == c)
            {
                return Err(bad(format!(
                    "policy allows and forbids the same capability {c}"
                )));
            }
        }
        for parent in &p.cgroup_parents {
            if let Err(e) = crate::cgroup_names::parent_components(parent) {
                return Err(bad(format!("policy.cgroup_parents: {e}")));
            }
        }
        for root in &p.kubepods_roots {
            if let Err(e) = crate::cgroup_names::parent_components(root) {
                return Err(bad(format!("policy.kubepods_roots: {e}")));
            }
        }
        for root in &p.cri_runc_roots {
            if !root.is_absolute() {
                return Err(bad(format!(
                    "policy.cri_runc_roots entry {} is not absolute",
                    root.display()
                )));
            }
        }
        if p.apparmor_profile.is_empty() {
            return Err(bad("policy.apparmor_profile is empty".to_string()));
        }
        Ok(())
    }
}

/// A config found next to the binary decides the policy: it must be a regular
/// file owned by root (or the caller) that nobody else can write.
fn check_owner(path: &Path) -> Result<(), ConfigError> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let euid = nix::unistd::geteuid().as_raw();
    let why = if !m.is_file() {
        Some("is not a regular file")
    } else if m.uid() != 0 && m.uid() != euid {
        Some("is not owned by root")
    } else if m.mode() & 0o022 != 0 {
        Some("is writable by group or others")
    } else {
        None
    };
    match why {
        Some(w) => Err(ConfigError::Invalid {
            path: path.to_path_buf(),
            message: format!("the runtime config next to the binary {w}"),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn the_config_is_found_without_the_environment() {
        let argv0 = Path::new("/usr/local/bin/tessera-gpu");
        let exe = Path::new("/usr/bin/tessera-runtime");
        let none = |_: &Path| false;
        let all = |_: &Path| true;
        // The environment overrides everything, and must then exist.
        let f = discover(Some("/x.toml".as_ref()), Some(argv0), Some(exe), all);
        assert_eq!(f.path, PathBuf::from("/x.toml"));
        assert!(f.explicit && !f.beside_binary);
        // An empty variable is as good as none.
        let f = discover(Some("".as_ref()), None, None, all);
        assert_eq!(f.path, PathBuf::from(DEFAULT_PATH));
        // Next to the name it was started by, then next to the executable.
        let f = discover(None, Some(argv0), Some(exe), all);
        assert_eq!(f.path, PathBuf::from("/usr/local/bin/tessera-gpu.toml"));
        assert!(f.beside_binary && !f.explicit);
        let only_exe = |p: &Path| p == Path::new("/usr/bin/tessera-runtime.toml");
        let f = discover(None, Some(argv0), Some(exe), only_exe);
        assert_eq!(f.path, PathBuf::from("/usr/bin/tessera-runtime.toml"));
        // A relative argv[0] (runc found on PATH) names no directory.
        let f = discover(None, Some(Path::new("tessera-runtime")), None, all);
        assert_eq!(f.path, PathBuf::from(DEFAULT_PATH));
        // Nothing next to the binary: the fixed default (missing: the defaults).
        let f = discover(None, Some(argv0), Some(exe), none);
        assert_eq!(f.path, PathBuf::from(DEFAULT_PATH));
        assert!(!f.explicit && !f.beside_binary);
    }

    #[test]
    fn a_config_beside_the_binary_must_be_the_owners_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tessera-runtime.toml");
        std::fs::write(&p, "").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        check_owner(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = check_owner(&p).unwrap_err();
        assert!(e.to_string().contains("writable by group or others"), "{e}");
        let link = dir.path().join("link.toml");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(check_owner(&link).is_err());
    }

    #[test]
    fn shipped_config_parses() {
        let text = include_str!("../../configs/runtime.toml");
        let cfg = RuntimeConfig::parse(text, Path::new("configs/runtime.toml")).unwrap();
        assert_eq!(
            cfg.daemon_socket,
            PathBuf::from("/run/tessera/tesserad.sock")
        );
        assert!(
            !cfg.policy
                .allowed_capabilities
                .iter()
                .any(|c| c == "CAP_MKNOD")
        );
    }

    #[test]
    fn shipped_containerd_and_kubernetes_configs_name_the_runtime() {
        let snippet = include_str!("../../configs/containerd/tessera-runtime.toml");
        let v: toml::Value = toml::from_str(snippet).unwrap();
        let opts = &v["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["tessera"];
        assert_eq!(opts["runtime_type"].as_str(), Some("io.containerd.runc.v2"));
        assert_eq!(
            opts["options"]["BinaryName"].as_str(),
            Some("/usr/bin/tessera-runtime")
        );
        let rc = include_str!("../../deploy/kubernetes/runtimeclass.yaml");
        assert!(rc.contains("kind: RuntimeClass") && rc.contains("handler: tessera"));
    }

    #[test]
    fn unknown_keys_refuse_to_start() {
        let e =
            RuntimeConfig::parse("runc_pth = \"/usr/sbin/runc\"\n", Path::new("x")).unwrap_err();
        assert!(e.to_string().contains("runc_pth"), "{e}");
        let e = RuntimeConfig::parse("[policy]\nallow_everything = true\n", Path::new("x"))
            .unwrap_err();
        assert!(e.to_string().contains("allow_everything"), "{e}");
    }

    #[test]
    fn relative_runc_and_contradictions_are_refused() {
        assert!(RuntimeConfig::parse("runc_path = \"runc\"\n", Path::new("x")).is_err());
        let e = RuntimeConfig::parse(
            "[policy]\nallowed_capabilities = [\"SYS_ADMIN\"]\n",
            Path::new("x"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("CAP_SYS_ADMIN"), "{e}");
        assert!(
            RuntimeConfig::parse("[policy]\napparmor = \"sometimes\"\n", Path::new("x")).is_err()
        );
    }

    #[test]
    fn explicit_missing_file_is_an_error() {
        assert!(RuntimeConfig::load(Path::new("/nonexistent/tessera.toml"), true).is_err());
        assert!(RuntimeConfig::load(Path::new("/nonexistent/tessera.toml"), false).is_ok());
    }
}
