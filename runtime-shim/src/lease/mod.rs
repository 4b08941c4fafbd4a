//! Token -> partition over the daemon's unix socket, failing closed: no answer, an
//! unknown token, a lease that is not ACTIVE, or a malformed answer is a refusal.
//! The runtime is synchronous; a current-thread tokio runtime exists only for the RPCs,
//! each under a deadline.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_client::TesseraClient;
use thiserror::Error;
use tonic::transport::Channel;

pub mod cache;

/// What the daemon says a token may use: the grant of `tessera_common`, as the runtime
/// names it.
pub use tessera_common::grant::{
    Grant as ResolvedLease, GrantDevice as LeaseDevice, GrantError, GrantMount as LeaseMount,
};

/// What a container running on every one of `leases` (in order) may use
/// ([`ResolvedLease::merge`]).
pub fn merge(leases: Vec<ResolvedLease>) -> Result<ResolvedLease, LeaseError> {
    Ok(ResolvedLease::merge(leases)?)
}

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
    /// The answer is not a lease to run on (not ACTIVE, expired, malformed), or the
    /// leases cannot run in one container together.
    #[error(transparent)]
    Grant(#[from] GrantError),
    #[error("the daemon answered {code:?}: {message}")]
    Rpc { code: tonic::Code, message: String },
    #[error("starting the RPC runtime: {0}")]
    Runtime(std::io::Error),
    /// The token list is malformed (empty entry, duplicate, too many).
    #[error("the lease token list is refused: {0}")]
    TokenList(String),
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
            Err(GrantError::Expired { .. })
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
