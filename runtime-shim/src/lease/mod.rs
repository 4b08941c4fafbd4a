//! Token -> partition over the daemon's unix socket, failing closed: no answer, an
//! unknown token, a lease that is not ACTIVE, or a malformed answer is a refusal.
//! The runtime is synchronous; a current-thread tokio runtime exists only for the RPCs,
//! each under a deadline.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;
use thiserror::Error;
use tonic::transport::Channel;

pub mod cache;

/// Errors resolving a token or talking to the daemon.
#[derive(Debug, Error)]
pub enum LeaseError {
    #[error("the tessera daemon at {socket} is unavailable: {message}")]
    Unavailable { socket: PathBuf, message: String },
    #[error("the tessera daemon did not answer within {0:?}")]
    Timeout(Duration),
    #[error("unknown lease token: {0}")]
    UnknownToken(String),
    #[error("lease token refused: {0}")]
    Denied(String),
    #[error("lease {lease_id} is {state}, not ACTIVE")]
    NotActive { lease_id: String, state: String },
    #[error("lease {lease_id} expired at {expires_at_ms} ms")]
    Expired {
        lease_id: String,
        expires_at_ms: i64,
    },
    #[error("the daemon's answer is not usable: {0}")]
    Invalid(String),
    #[error("the daemon answered {code:?}: {message}")]
    Rpc { code: tonic::Code, message: String },
    #[error("starting the RPC runtime: {0}")]
    Runtime(std::io::Error),
    /// The token list is malformed (empty entry, duplicate, too many).
    #[error("the lease token list is refused: {0}")]
    TokenList(String),
    /// Several leases that cannot be given to one container together.
    #[error("these leases cannot run in one container: {0}")]
    Merge(String),
}

/// The most leases one container may run on (a Kubernetes container asking for
/// several devices of a resource gets one lease per device).
pub const MAX_TOKENS: usize = 16;

/// Split the token annotation (or `TESSERA_LEASE_TOKEN`): one token, or several
/// joined by `,` (a token is a prefix and hex digits, so a comma never occurs in
/// one). Empty entries, duplicates and more than [`MAX_TOKENS`] are refused.
pub fn parse_tokens(s: &str) -> Result<Vec<String>, LeaseError> {
    let bad = |m: String| LeaseError::TokenList(m);
    let mut out: Vec<String> = Vec::new();
    for (i, t) in s.split(',').enumerate() {
        let t = t.trim();
        if t.is_empty() {
            return Err(bad(format!("entry {} is empty", i + 1)));
        }
        if out.iter().any(|o| o == t) {
            return Err(bad(format!("entry {} repeats an earlier token", i + 1)));
        }
        out.push(t.to_string());
        if out.len() > MAX_TOKENS {
            return Err(bad(format!("more than {MAX_TOKENS} tokens")));
        }
    }
    Ok(out)
}

/// The variables whose values are lists a CUDA program reads in order: joined
/// with `,` across leases.
const JOINED_ENV: [&str; 3] = [
    "TESSERA_LEASE_ID",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
];

/// What a container running on every one of `leases` (in order) may use: the
/// devices (each node once), device-cgroup rules, capabilities and GPUs of all,
/// `CUDA_VISIBLE_DEVICES` and `NVIDIA_VISIBLE_DEVICES` joined in order, and the
/// lease ids joined with `,`. One lease is returned unchanged. Refused: leases
/// of different tenants, more than one MPS share (a process has one
/// `CUDA_MPS_PIPE_DIRECTORY`), one container path naming different device nodes,
/// and another variable set to different values.
pub fn merge(mut leases: Vec<ResolvedLease>) -> Result<ResolvedLease, LeaseError> {
    let bad = |m: String| LeaseError::Merge(m);
    if leases.len() <= 1 {
        return leases
            .pop()
            .ok_or_else(|| bad("no lease to run on".to_string()));
    }
    let mps = leases
        .iter()
        .filter(|l| l.env.contains_key("CUDA_MPS_PIPE_DIRECTORY") || !l.mounts.is_empty())
        .count();
    if mps > 1 {
        return Err(bad(format!(
            "CUDA_MPS_PIPE_DIRECTORY: {mps} of the leases are MPS shares and a container can use one MPS server"
        )));
    }
    let mut it = leases.into_iter();
    let mut out = it
        .next()
        .ok_or_else(|| bad("no lease to run on".to_string()))?;
    for l in it {
        if l.tenant != out.tenant {
            return Err(bad(format!(
                "tenant: lease {} belongs to {} and lease {} to {}",
                out.lease_id, out.tenant, l.lease_id, l.tenant
            )));
        }
        for d in l.devices {
            match out
                .devices
                .iter_mut()
                .find(|o| o.container_path == d.container_path)
            {
                None => out.devices.push(d),
                Some(o) if (o.kind, o.major, o.minor) != (d.kind, d.major, d.minor) => {
                    return Err(bad(format!(
                        "devices: {} is {}:{} for one lease and {}:{} for lease {}",
                        d.container_path, o.major, o.minor, d.major, d.minor, l.lease_id
                    )));
                }
                Some(o) => {
                    // The same node: the union of what the leases allow.
                    for c in d.permissions.chars() {
                        if !o.permissions.contains(c) {
                            o.permissions.push(c);
                        }
                    }
                    o.file_mode |= d.file_mode;
                }
            }
        }
        for (k, v) in l.env {
            match out.env.get_mut(&k) {
                None => {
                    out.env.insert(k, v);
                }
                Some(o) if *o == v => {}
                Some(o) if JOINED_ENV.contains(&k.as_str()) => {
                    if !o.split(',').any(|x| x == v) {
                        o.push(',');
                        o.push_str(&v);
                    }
                }
                Some(o) => {
                    return Err(bad(format!(
                        "env {k}: {o:?} for one lease and {v:?} for lease {}",
                        l.lease_id
                    )));
                }
            }
        }
        out.mounts.extend(l.mounts);
        for g in l.visible_gpu_indices {
            if !out.visible_gpu_indices.contains(&g) {
                out.visible_gpu_indices.push(g);
            }
        }
        for c in l.granted_capabilities {
            if !out.granted_capabilities.contains(&c) {
                out.granted_capabilities.push(c);
            }
        }
        out.pids_limit = match (out.pids_limit, l.pids_limit) {
            (0, b) => b,
            (a, 0) => a,
            (a, b) => a.min(b),
        };
        out.lease_id = format!("{},{}", out.lease_id, l.lease_id);
    }
    // The container's cgroup goes under the first lease's parent; every lease is
    // bound to that cgroup, so revoking any of them stops the container.
    Ok(out)
}

/// A device node the lease grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseDevice {
    pub host_path: PathBuf,
    pub container_path: String,
    /// 'c' or 'b'.
    pub kind: char,
    pub major: i64,
    pub minor: i64,
    /// Device cgroup access, a subset of "rwm".
    pub permissions: String,
    pub file_mode: u32,
}

/// A mount the lease asks for (the MPS pipe directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseMount {
    pub source: String,
    pub destination: String,
    pub options: Vec<String>,
}

/// What the daemon says a token may use.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResolvedLease {
    pub lease_id: String,
    pub tenant: String,
    pub devices: Vec<LeaseDevice>,
    pub env: BTreeMap<String, String>,
    pub mounts: Vec<LeaseMount>,
    pub visible_gpu_indices: Vec<u32>,
    /// Relative to /proc/driver/nvidia/capabilities, e.g. "gpu0/mig/gi3/access".
    pub granted_capabilities: Vec<String>,
    pub cgroup_parent: String,
    pub pids_limit: u64,
    /// The pod the lease's token is bound to (the first pod that used it), or empty.
    pub pod: String,
}

fn clean_abs(p: &str) -> bool {
    p.starts_with('/') && !p.contains('\0') && !p.split('/').any(|c| c == ".." || c == ".")
}

impl ResolvedLease {
    /// Check and convert the daemon's answer. `now_ms` is the current unix time.
    pub fn from_proto(resp: pb::ResolveTokenResponse, now_ms: i64) -> Result<Self, LeaseError> {
        let bad = |m: String| LeaseError::Invalid(m);
        let lease = resp
            .lease
            .ok_or_else(|| bad("no lease in the answer".to_string()))?;
        let state = pb::LeaseState::try_from(lease.state).unwrap_or(pb::LeaseState::Unspecified);
        if state != pb::LeaseState::Active {
            return Err(LeaseError::NotActive {
                lease_id: lease.id,
                state: state
                    .as_str_name()
                    .trim_start_matches("LEASE_STATE_")
                    .to_string(),
            });
        }
        if lease.expires_at_ms > 0 && lease.expires_at_ms <= now_ms {
            return Err(LeaseError::Expired {
                lease_id: lease.id,
                expires_at_ms: lease.expires_at_ms,
            });
        }
        if lease.id.is_empty() {
            return Err(bad("the lease has no id".to_string()));
        }
        let tenant = match (resp.tenant.as_str(), lease.tenant.as_str()) {
            ("", "") => return Err(bad("the lease has no tenant".to_string())),
            (a, b) if !a.is_empty() && !b.is_empty() && a != b => {
                return Err(bad(format!("tenant {a:?} differs from the lease's {b:?}")));
            }
            (a, b) => if a.is_empty() { b } else { a }.to_string(),
        };
        let mut devices = Vec::new();
        for d in resp.devices {
            let kind = match d.r#type.as_str() {
                "c" => 'c',
                "b" => 'b',
                t => return Err(bad(format!("device {} has type {t:?}", d.host_path))),
            };
            if !clean_abs(&d.host_path)
                || !clean_abs(&d.container_path)
                || !d.container_path.starts_with("/dev/")
            {
                return Err(bad(format!(
                    "device {} -> {} is not a clean /dev path",
                    d.host_path, d.container_path
                )));
            }
            if d.major < 0 || d.minor < 0 {
                return Err(bad(format!("device {} has a negative number", d.host_path)));
            }
            let perms = if d.permissions.is_empty() {
                "rw".to_string()
            } else {
                d.permissions
            };
            if !perms.chars().all(|c| "rwm".contains(c)) {
                return Err(bad(format!(
                    "device {} has permissions {perms:?}",
                    d.host_path
                )));
            }
            devices.push(LeaseDevice {
                host_path: PathBuf::from(d.host_path),
                container_path: d.container_path,
                kind,
                major: d.major,
                minor: d.minor,
                permissions: perms,
                file_mode: if d.file_mode == 0 {
                    0o666
                } else {
                    d.file_mode & 0o777
                },
            });
        }
        for k in resp.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(bad(format!("env name {k:?}")));
            }
        }
        let mut mounts = Vec::new();
        for m in resp.mounts {
            if !(m.r#type.is_empty() || m.r#type == "bind") {
                return Err(bad(format!(
                    "mount {} has type {:?}",
                    m.destination, m.r#type
                )));
            }
            if !clean_abs(&m.source) || !clean_abs(&m.destination) {
                return Err(bad(format!(
                    "mount {} -> {} is not a clean absolute path",
                    m.source, m.destination
                )));
            }
            mounts.push(LeaseMount {
                source: m.source,
                destination: m.destination,
                options: m.options,
            });
        }
        for c in &resp.granted_capabilities {
            if c.is_empty() || c.starts_with('/') || c.split('/').any(|p| p == ".." || p.is_empty())
            {
                return Err(bad(format!("capability path {c:?}")));
            }
        }
        Ok(Self {
            pod: lease.pod,
            lease_id: lease.id,
            tenant,
            devices,
            env: resp.env.into_iter().collect(),
            mounts,
            visible_gpu_indices: resp.visible_gpu_indices,
            granted_capabilities: resp.granted_capabilities,
            cgroup_parent: resp.cgroup_parent,
            pids_limit: resp.pids_limit,
        })
    }
}

/// Current unix time in milliseconds.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn map_status(s: tonic::Status, socket: &Path) -> LeaseError {
    match s.code() {
        tonic::Code::NotFound => LeaseError::UnknownToken(s.message().to_string()),
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => {
            LeaseError::Denied(s.message().to_string())
        }
        tonic::Code::Unavailable => LeaseError::Unavailable {
            socket: socket.to_path_buf(),
            message: s.message().to_string(),
        },
        code => LeaseError::Rpc {
            code,
            message: s.message().to_string(),
        },
    }
}

/// What the runtime tells the daemon about a container it binds to a lease.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Binding {
    pub container_id: String,
    /// The cgroup the container runs in (cgroupfs path or systemd's
    /// `slice:prefix:name`): where a revocation stops it.
    pub cgroup_path: String,
    pub runtime_root: String,
    pub uid: Option<u32>,
    /// Host path of the container's termination-message file, or empty.
    pub termination_log: String,
    /// The pod (CRI sandbox id, else pod uid), or empty outside Kubernetes.
    pub pod: String,
    /// The runtime's command (create, run): the bind is then also the
    /// container's admission report (one call instead of two). Empty: none.
    pub admission_command: String,
}

/// A client of the daemon's unix socket. It connects on its first call and keeps
/// the connection for the next ones (a start makes two or three calls: one
/// connection and HTTP/2 handshake instead of one each).
pub struct DaemonClient {
    socket: PathBuf,
    timeout: Duration,
    rt: tokio::runtime::Runtime,
    channel: std::cell::RefCell<Option<Channel>>,
}

impl std::fmt::Debug for DaemonClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonClient")
            .field("socket", &self.socket)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl DaemonClient {
    pub fn new(socket: &Path, timeout: Duration) -> Result<Self, LeaseError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(LeaseError::Runtime)?;
        Ok(Self {
            socket: socket.to_path_buf(),
            timeout,
            rt,
            channel: std::cell::RefCell::new(None),
        })
    }

    /// The socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn call<T, F, Fut>(&self, timeout: Duration, f: F) -> Result<T, LeaseError>
    where
        F: FnOnce(TesseraClient<Channel>) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let socket = self.socket.clone();
        let cached = self.channel.borrow().clone();
        let slot = &self.channel;
        self.rt.block_on(async move {
            let work = async {
                let channel = match cached {
                    Some(c) => c,
                    None => {
                        let c = tessera_common::unix::channel(&socket).await.map_err(|e| {
                            LeaseError::Unavailable {
                                socket: socket.clone(),
                                message: std::error::Error::source(&e.source)
                                    .map_or_else(|| e.source.to_string(), |s| s.to_string()),
                            }
                        })?;
                        *slot.borrow_mut() = Some(c.clone());
                        c
                    }
                };
                f(TesseraClient::new(channel))
                    .await
                    .map_err(|s| map_status(s, &socket))
            };
            tokio::time::timeout(timeout, work)
                .await
                .map_err(|_| LeaseError::Timeout(timeout))?
        })
    }

    /// Resolve a token: the daemon's answer as it came (to send back with the bind,
    /// and to keep), and the lease it describes, checked.
    pub fn resolve_answer(
        &self,
        token: &str,
    ) -> Result<(pb::ResolveTokenResponse, ResolvedLease), LeaseError> {
        let req = pb::ResolveTokenRequest {
            token: token.to_string(),
        };
        let resp = self.call(self.timeout, |mut c| async move {
            c.resolve_token(req).await.map(tonic::Response::into_inner)
        })?;
        let lease = ResolvedLease::from_proto(resp.clone(), now_ms())?;
        Ok((resp, lease))
    }

    /// Record that a container runs on the token's lease. `judged` is the answer the
    /// spec was judged against: a daemon that checks it refuses the bind
    /// (FAILED_PRECONDITION, reason RESOLUTION_CHANGED) when it is no longer the
    /// current one.
    /// Returns the daemon's answer: the lease as the bind left it, and whether the
    /// daemon checked `judged` (an older daemon does not).
    pub fn bind(
        &self,
        token: &str,
        b: &Binding,
        judged: Option<&pb::ResolveTokenResponse>,
    ) -> Result<pb::BindContainerResponse, LeaseError> {
        let req = pb::BindContainerRequest {
            token: token.to_string(),
            container_id: b.container_id.clone(),
            cgroup_path: b.cgroup_path.clone(),
            runtime_root: b.runtime_root.clone(),
            uid: b.uid,
            termination_log_path: b.termination_log.clone(),
            pod: b.pod.clone(),
            admission_command: b.admission_command.clone(),
            resolved: judged.cloned(),
        };
        self.call(self.timeout, |mut c| async move {
            c.bind_container(req).await.map(tonic::Response::into_inner)
        })
    }

    /// Forget a container (on delete), only as bound under runc root `runtime_root`.
    pub fn unbind(&self, container_id: &str, runtime_root: &str) -> Result<(), LeaseError> {
        let req = pb::UnbindContainerRequest {
            container_id: container_id.to_string(),
            runtime_root: runtime_root.to_string(),
        };
        self.call(self.timeout, |mut c| async move {
            c.unbind_container(req).await.map(|_| ())
        })
    }

    /// Report an admission or refusal for the audit log (callers treat it as best effort,
    /// so it gets a shorter deadline).
    pub fn report(
        &self,
        container_id: &str,
        lease_id: &str,
        admitted: bool,
        reasons: &[String],
        command: &str,
    ) -> Result<(), LeaseError> {
        let req = pb::ReportAdmissionRequest {
            container_id: container_id.to_string(),
            lease_id: lease_id.to_string(),
            admitted,
            reasons: reasons.to_vec(),
            command: command.to_string(),
        };
        let t = self.timeout.min(Duration::from_millis(1000));
        self.call(t, |mut c| async move {
            c.report_admission(req).await.map(|_| ())
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn answer() -> pb::ResolveTokenResponse {
        pb::ResolveTokenResponse {
            lease: Some(pb::Lease {
                id: "l1".into(),
                tenant: "acme".into(),
                state: pb::LeaseState::Active as i32,
                expires_at_ms: 2_000,
                ..Default::default()
            }),
            tenant: "acme".into(),
            devices: vec![pb::DeviceNode {
                host_path: "/dev/nvidia0".into(),
                container_path: "/dev/nvidia0".into(),
                r#type: "c".into(),
                major: 195,
                minor: 0,
                permissions: "rw".into(),
                file_mode: 0,
            }],
            cgroup_parent: "/tessera/l1".into(),
            ..Default::default()
        }
    }

    #[test]
    fn active_lease_converts() {
        let l = ResolvedLease::from_proto(answer(), 1_000).unwrap();
        assert_eq!(l.lease_id, "l1");
        assert_eq!(l.devices[0].file_mode, 0o666);
    }

    #[test]
    fn inactive_expired_and_malformed_answers_are_refused() {
        let mut a = answer();
        a.lease.as_mut().unwrap().state = pb::LeaseState::Revoked as i32;
        let e = ResolvedLease::from_proto(a, 1_000).unwrap_err().to_string();
        assert!(e.contains("REVOKED"), "{e}");
        assert!(matches!(
            ResolvedLease::from_proto(answer(), 3_000),
            Err(LeaseError::Expired { .. })
        ));
        let mut a = answer();
        a.devices[0].container_path = "/dev/../etc/shadow".into();
        assert!(ResolvedLease::from_proto(a, 1_000).is_err());
        let mut a = answer();
        a.devices[0].permissions = "rwx".into();
        assert!(ResolvedLease::from_proto(a, 1_000).is_err());
        let mut a = answer();
        a.tenant = "other".into();
        assert!(ResolvedLease::from_proto(a, 1_000).is_err());
        let mut a = answer();
        a.granted_capabilities = vec!["../../sysrq".into()];
        assert!(ResolvedLease::from_proto(a, 1_000).is_err());
        let mut a = answer();
        a.lease = None;
        assert!(ResolvedLease::from_proto(a, 1_000).is_err());
    }

    fn mig(id: &str, minor: i64, uuid: &str) -> ResolvedLease {
        let mut a = answer();
        a.lease.as_mut().unwrap().id = id.into();
        a.devices.push(pb::DeviceNode {
            host_path: format!("/dev/nvidia-caps/nvidia-cap{minor}"),
            container_path: format!("/dev/nvidia-caps/nvidia-cap{minor}"),
            r#type: "c".into(),
            major: 237,
            minor,
            permissions: "r".into(),
            file_mode: 0o444,
        });
        a.env = [
            ("TESSERA_LEASE_ID".to_string(), id.to_string()),
            ("CUDA_VISIBLE_DEVICES".to_string(), uuid.to_string()),
            ("NVIDIA_VISIBLE_DEVICES".to_string(), "void".to_string()),
        ]
        .into();
        a.granted_capabilities = vec![format!("gpu0/mig/gi{minor}/access")];
        a.cgroup_parent = format!("tessera/{id}");
        a.visible_gpu_indices = vec![0];
        a.pids_limit = if id == "l2" { 100 } else { 200 };
        ResolvedLease::from_proto(a, 1_000).unwrap()
    }

    fn mps(id: &str) -> ResolvedLease {
        let mut l = mig(id, 9, "GPU-1");
        l.env
            .insert("CUDA_MPS_PIPE_DIRECTORY".into(), "/tmp/nvidia-mps".into());
        l.mounts.push(LeaseMount {
            source: format!("/run/tessera/mps/{id}"),
            destination: "/tmp/nvidia-mps".into(),
            options: vec!["rbind".into()],
        });
        l
    }

    #[test]
    fn token_lists_split_on_commas_and_refuse_empty_duplicate_and_too_many() {
        assert_eq!(parse_tokens("tsr1_ab").unwrap(), ["tsr1_ab"]);
        assert_eq!(
            parse_tokens("tsr1_ab,tsr1_cd").unwrap(),
            ["tsr1_ab", "tsr1_cd"]
        );
        assert_eq!(parse_tokens(" tsr1_ab , tsr1_cd").unwrap().len(), 2);
        for bad in [
            "",
            "tsr1_ab,",
            ",tsr1_ab",
            "tsr1_ab,,tsr1_cd",
            "tsr1_ab,tsr1_ab",
        ] {
            let e = parse_tokens(bad).unwrap_err();
            assert!(matches!(e, LeaseError::TokenList(_)), "{bad:?}: {e}");
        }
        let many: Vec<String> = (0..=MAX_TOKENS).map(|i| format!("tsr1_{i:x}")).collect();
        assert_eq!(
            parse_tokens(&many[..MAX_TOKENS].join(",")).unwrap().len(),
            16
        );
        let e = parse_tokens(&many.join(",")).unwrap_err().to_string();
        assert!(e.contains("more than 16"), "{e}");
    }

    #[test]
    fn one_lease_merges_to_itself() {
        let l = mig("l1", 3, "MIG-a");
        assert_eq!(merge(vec![l.clone()]).unwrap(), l);
        assert!(merge(Vec::new()).is_err());
    }

    #[test]
    fn two_mig_leases_merge_devices_once_and_join_lists_in_order() {
        let m = merge(vec![mig("l1", 3, "MIG-a"), mig("l2", 12, "MIG-b")]).unwrap();
        assert_eq!(m.lease_id, "l1,l2");
        assert_eq!(m.env["TESSERA_LEASE_ID"], "l1,l2");
        assert_eq!(m.env["CUDA_VISIBLE_DEVICES"], "MIG-a,MIG-b");
        assert_eq!(m.env["NVIDIA_VISIBLE_DEVICES"], "void");
        let paths: Vec<&str> = m
            .devices
            .iter()
            .map(|d| d.container_path.as_str())
            .collect();
        // /dev/nvidia0 is shared: once.
        assert_eq!(
            paths,
            [
                "/dev/nvidia0",
                "/dev/nvidia-caps/nvidia-cap3",
                "/dev/nvidia-caps/nvidia-cap12"
            ]
        );
        assert_eq!(
            m.granted_capabilities,
            ["gpu0/mig/gi3/access", "gpu0/mig/gi12/access"]
        );
        assert_eq!(m.visible_gpu_indices, [0]);
        assert_eq!(m.pids_limit, 100);
        assert_eq!(m.cgroup_parent, "tessera/l1");
        // The order of the tokens is the order of the GPUs CUDA sees.
        let m = merge(vec![mig("l2", 12, "MIG-b"), mig("l1", 3, "MIG-a")]).unwrap();
        assert_eq!(m.env["CUDA_VISIBLE_DEVICES"], "MIG-b,MIG-a");
    }

    #[test]
    fn merging_refuses_two_mps_shares_other_tenants_and_clashing_nodes() {
        let e = merge(vec![mps("l1"), mps("l2")]).unwrap_err().to_string();
        assert!(e.contains("CUDA_MPS_PIPE_DIRECTORY"), "{e}");
        assert!(!e.contains('\n'));
        // One MPS share next to a MIG instance is fine.
        let m = merge(vec![mps("l1"), mig("l2", 12, "MIG-b")]).unwrap();
        assert_eq!(m.mounts.len(), 1);
        let mut other = mig("l2", 12, "MIG-b");
        other.tenant = "globex".into();
        let e = merge(vec![mig("l1", 3, "MIG-a"), other])
            .unwrap_err()
            .to_string();
        assert!(e.contains("tenant"), "{e}");
        let mut clash = mig("l2", 12, "MIG-b");
        clash.devices[0].minor = 1;
        let e = merge(vec![mig("l1", 3, "MIG-a"), clash])
            .unwrap_err()
            .to_string();
        assert!(e.contains("/dev/nvidia0"), "{e}");
        let mut env = mig("l2", 12, "MIG-b");
        env.env
            .insert("NVIDIA_DRIVER_CAPABILITIES".into(), "all".into());
        let mut first = mig("l1", 3, "MIG-a");
        first
            .env
            .insert("NVIDIA_DRIVER_CAPABILITIES".into(), "compute".into());
        let e = merge(vec![first, env]).unwrap_err().to_string();
        assert!(e.contains("NVIDIA_DRIVER_CAPABILITIES"), "{e}");
    }

    #[test]
    fn no_daemon_is_unavailable() {
        let c = DaemonClient::new(
            Path::new("/nonexistent/tesserad.sock"),
            Duration::from_secs(2),
        )
        .unwrap();
        let e = c.resolve_answer("tok").unwrap_err();
        assert!(matches!(e, LeaseError::Unavailable { .. }), "{e}");
    }
}
