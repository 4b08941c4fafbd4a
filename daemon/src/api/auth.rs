//! Who is calling: peer credentials on the unix socket (SO_PEERCRED), or the client
//! certificate's common name on the mTLS listener, mapped to a principal by the
//! config's `[[auth.principals]]` rules (first match wins); or, on the TLS listener,
//! an OIDC bearer token (verified by [`super::oidc`]) mapped by
//! `[[auth.oidc.rules]]` (first match wins). An unmapped caller gets
//! PermissionDenied. uid 0 and the daemon's own uid are always admin. A call with
//! both a client certificate and a token, or a token anywhere else than the TLS
//! listener with `[auth.oidc]`, is refused.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use tonic::transport::server::UdsConnectInfo;

use tonic::{Request, Status};

use super::oidc::{self, Refusal, TokenVerdict, Verified};
use crate::audit::OidcSubject;
use crate::config::{ClaimRule, PrincipalRule, Role};

/// An identified caller. `oidc`: the token's subject, when the caller showed one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    Admin {
        name: String,
        oidc: Option<Arc<OidcSubject>>,
    },
    Runtime {
        name: String,
    },
    Tenant {
        name: String,
        tenant: String,
        oidc: Option<Arc<OidcSubject>>,
    },
}

impl Principal {
    pub fn name(&self) -> &str {
        match self {
            Principal::Admin { name, .. }
            | Principal::Runtime { name }
            | Principal::Tenant { name, .. } => name,
        }
    }

    /// Who the token named, for a caller that showed one (the audit records it).
    pub fn oidc(&self) -> Option<&OidcSubject> {
        match self {
            Principal::Admin { oidc, .. } | Principal::Tenant { oidc, .. } => oidc.as_deref(),
            Principal::Runtime { .. } => None,
        }
    }

    pub fn tenant(&self) -> Option<&str> {
        match self {
            Principal::Tenant { tenant, .. } => Some(tenant),
            _ => None,
        }
    }
}

/// How the caller reached the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    Unix {
        uid: u32,
        gid: u32,
        /// Supplementary groups, as the kernel recorded them at `connect`.
        groups: Vec<u32>,
        pid: Option<i32>,
        /// The peer runs in other mount or PID namespaces than the daemon (inside a
        /// container), or that could not be told: never an admin, whatever its uid.
        contained: bool,
    },
    Cert {
        common_name: String,
    },
    /// A verified OIDC bearer token (TLS listener).
    Token(Arc<Verified>),
    /// A bearer token that was not accepted, or not alone (with a client
    /// certificate): refused with its status.
    Refused(Refusal),
    Unknown,
}

impl Caller {
    pub fn describe(&self) -> String {
        match self {
            Caller::Unix {
                uid,
                gid,
                contained: true,
                ..
            } => format!("uid {uid} gid {gid} inside a container"),
            Caller::Unix { uid, gid, .. } => format!("uid {uid} gid {gid}"),
            Caller::Cert { common_name } => format!("certificate CN={common_name:?}"),
            Caller::Token(t) => format!(
                "OIDC subject {:?} of {:?}",
                t.subject.subject, t.subject.issuer
            ),
            Caller::Refused(_) => "a caller with a refused bearer token".into(),
            Caller::Unknown => "an unidentified caller".into(),
        }
    }

    /// The verified token's subject, when the caller showed one.
    pub fn oidc(&self) -> Option<&OidcSubject> {
        match self {
            Caller::Token(t) => Some(&t.subject),
            _ => None,
        }
    }
}

/// A unix-socket connection's peer, looked at once, when the connection is
/// accepted: its credentials (SO_PEERCRED, fixed at `connect`), its supplementary
/// groups (SO_PEERGROUPS, fixed at `connect` too: never read again from
/// /proc/<pid>/status, whose pid may by then be another process's), and whether the
/// process that connected runs in the daemon's mount and PID namespaces. Every
/// request on the connection is that process's: looking at its namespaces per
/// request cost four `stat`s of /proc each (8 % of the daemon's CPU under 32
/// clients), and a later look can only be less true (the process gone, its pid
/// reused).
#[derive(Debug, Clone)]
pub struct UnixPeer {
    pub info: UdsConnectInfo,
    /// None: no credentials (the caller is unknown).
    pub contained: Option<bool>,
    /// The peer's supplementary groups at `connect` (empty when the kernel could not
    /// say: then no rule matches by them).
    pub groups: Vec<u32>,
}

impl UnixPeer {
    /// The peer as far as its credentials tell (no groups: no rule matches by them).
    pub fn of(info: UdsConnectInfo) -> UnixPeer {
        let contained = info
            .peer_cred
            .map(|cred| cred.pid().is_none_or(|pid| !in_host_namespaces(pid)));
        UnixPeer {
            info,
            contained,
            groups: Vec::new(),
        }
    }

    /// The peer of the accepted connection `fd`, its groups included.
    pub fn accepted(info: UdsConnectInfo, fd: std::os::fd::BorrowedFd<'_>) -> UnixPeer {
        UnixPeer {
            groups: peer_groups(fd).unwrap_or_default(),
            ..UnixPeer::of(info)
        }
    }
}

/// The supplementary groups of a unix socket's peer as the kernel recorded them when
/// it connected (SO_PEERGROUPS, Linux 4.13).
pub fn peer_groups(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<Vec<u32>> {
    use std::os::fd::AsRawFd;
    const GID: usize = std::mem::size_of::<libc::gid_t>();
    let mut buf: Vec<libc::gid_t> = vec![0; 32];
    loop {
        let mut len = libc::socklen_t::try_from(buf.len() * GID)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: `buf` is valid for writes of `len` bytes and outlives the call; the
        // fd is borrowed from a live socket for the duration of the call.
        let rc = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                buf.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let len = usize::try_from(len).unwrap_or(0);
        if rc == 0 {
            buf.truncate(len / GID);
            return Ok(buf);
        }
        let e = std::io::Error::last_os_error();
        // ERANGE: the kernel wrote the size it needs into `len`.
        if e.raw_os_error() == Some(libc::ERANGE) && len / GID > buf.len() && len / GID <= 65536 {
            buf.resize(len / GID, 0);
            continue;
        }
        return Err(e);
    }
}

/// Read a request's caller from its connection (and its bearer token).
pub fn caller_of<T>(req: &Request<T>) -> Caller {
    let cert_cn = || {
        req.peer_certs()
            .and_then(|certs| certs.first().and_then(|c| common_name(c.as_ref())))
    };
    if let Some(TokenVerdict(verdict)) = req.extensions().get::<TokenVerdict>() {
        // Any client certificate is an identity, one without a common name too.
        if req.peer_certs().is_some_and(|certs| !certs.is_empty()) {
            return Caller::Refused(Refusal::two_identities(&cert_cn().unwrap_or_default()));
        }
        return match verdict {
            Ok(t) => Caller::Token(t.clone()),
            Err(r) => Caller::Refused(r.clone()),
        };
    }
    if req.metadata().contains_key("authorization") {
        return Caller::Refused(Refusal::not_accepted_here());
    }
    if let Some(peer) = req.extensions().get::<UnixPeer>()
        && let (Some(cred), Some(contained)) = (peer.info.peer_cred, peer.contained)
    {
        return Caller::Unix {
            uid: cred.uid(),
            gid: cred.gid(),
            groups: peer.groups.clone(),
            pid: cred.pid(),
            contained,
        };
    }
    if let Some(info) = req.extensions().get::<UdsConnectInfo>()
        && let Some(cred) = info.peer_cred
    {
        return Caller::Unix {
            uid: cred.uid(),
            gid: cred.gid(),
            groups: Vec::new(),
            pid: cred.pid(),
            contained: cred.pid().is_none_or(|pid| !in_host_namespaces(pid)),
        };
    }
    if let Some(cn) = cert_cn() {
        return Caller::Cert { common_name: cn };
    }
    Caller::Unknown
}

/// Whether process `pid` is on the host: it shares the mount and PID namespaces of
/// the host's init (PID 1 as the daemon sees it, or `[auth] host_pid`), and so is not
/// inside a container.
/// False when it cannot be told (the process is gone).
///
/// The host is init's namespaces, not the daemon's own: systemd runs tesserad in a
/// mount namespace of its own (`ProtectSystem=strict`), and the DaemonSet runs it in a
/// pod's (with `hostPID`, PID 1 is the host's init). Where init's namespaces cannot be
/// read, the daemon's own stand in.
pub fn in_host_namespaces(pid: i32) -> bool {
    in_namespaces_of(HOST_PID.load(Ordering::Relaxed), pid)
}

/// The process whose namespaces are the host's (`[auth] host_pid`, default 1).
static HOST_PID: AtomicI32 = AtomicI32::new(1);

/// Set `[auth] host_pid` before the first caller is identified (the daemon's start).
pub fn set_host_pid(pid: i32) {
    HOST_PID.store(pid, Ordering::Relaxed);
}

fn in_namespaces_of(host_pid: i32, pid: i32) -> bool {
    use std::os::unix::fs::MetadataExt;
    const NAMESPACES: [&str; 2] = ["mnt", "pid"];
    let id = |p: String| std::fs::metadata(p).map(|m| (m.dev(), m.ino()));
    // The host's namespaces do not change: read once (a failed read is not kept, and
    // nothing is trusted while it fails).
    static HOST: OnceLock<[(u64, u64); 2]> = OnceLock::new();
    let host = match HOST.get() {
        Some(host) => *host,
        None => {
            let read = |proc: &str| {
                Some([
                    id(format!("/proc/{proc}/ns/{}", NAMESPACES[0])).ok()?,
                    id(format!("/proc/{proc}/ns/{}", NAMESPACES[1])).ok()?,
                ])
            };
            match read(&host_pid.to_string()).or_else(|| read("self")) {
                Some(ns) => *HOST.get_or_init(|| ns),
                None => return false,
            }
        }
    };
    let own = host;
    NAMESPACES
        .iter()
        .zip(own)
        .all(|(ns, own)| id(format!("/proc/{pid}/ns/{ns}")).is_ok_and(|peer| peer == own))
}

/// The subject common name of a DER certificate.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_string();
    Some(cn)
}

/// Maps callers to principals; the rules can be replaced on reload.
#[derive(Debug)]
pub struct Authenticator {
    rules: RwLock<Arc<Vec<PrincipalRule>>>,
    /// `[[auth.oidc.rules]]`, and the verifier the TLS listener checks tokens with.
    oidc_rules: RwLock<Arc<Vec<ClaimRule>>>,
    oidc: Option<Arc<oidc::Verifier>>,
    own_uid: u32,
    /// Counts rule replacements: a caller identified at one generation is the same
    /// principal until the next.
    generation: AtomicU64,
}

impl Authenticator {
    pub fn new(rules: Vec<PrincipalRule>) -> Self {
        Authenticator {
            rules: RwLock::new(Arc::new(rules)),
            oidc_rules: RwLock::new(Arc::new(Vec::new())),
            oidc: None,
            own_uid: nix::unistd::geteuid().as_raw(),
            generation: AtomicU64::new(0),
        }
    }

    /// Accept OIDC bearer tokens on the TLS listener, mapped by the verifier's
    /// configured rules.
    pub fn with_oidc(mut self, verifier: Arc<oidc::Verifier>) -> Self {
        self.set_oidc_rules(verifier.config().rules.clone());
        self.oidc = Some(verifier);
        self
    }

    /// The token verifier, when `[auth.oidc]` is configured.
    pub fn oidc(&self) -> Option<Arc<oidc::Verifier>> {
        self.oidc.clone()
    }

    pub fn set_oidc_rules(&self, rules: Vec<ClaimRule>) {
        *self.oidc_rules.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(rules);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    pub fn set_rules(&self, rules: Vec<PrincipalRule>) {
        *self.rules.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(rules);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// Which set of rules is in force: it changes whenever the rules are replaced.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The principal of a caller, or PermissionDenied naming who was refused.
    pub fn identify(&self, caller: &Caller) -> Result<Principal, Status> {
        match caller {
            Caller::Refused(r) => return Err(r.status()),
            Caller::Token(t) => return self.identify_token(t),
            _ => {}
        }
        let rules = self.rules.read().unwrap_or_else(|p| p.into_inner()).clone();
        let matched = rules.iter().find(|r| match caller {
            Caller::Unix {
                uid, gid, groups, ..
            } => {
                r.uids.contains(uid)
                    || r.gids.contains(gid)
                    || groups.iter().any(|g| r.gids.contains(g))
            }
            Caller::Cert { common_name } => r.cert_cns.iter().any(|c| c == common_name),
            Caller::Token(_) | Caller::Refused(_) | Caller::Unknown => false,
        });
        let contained = matches!(
            caller,
            Caller::Unix {
                contained: true,
                ..
            }
        );
        if let Some(r) = matched {
            if contained && !matches!(r.role, Role::Tenant(_)) {
                return Err(Status::permission_denied(format!(
                    "{} matches principal {:?}, but a process inside a container is never an admin or the runtime: at most a tenant",
                    caller.describe(),
                    r.name
                )));
            }
            return Ok(match &r.role {
                Role::Admin => Principal::Admin {
                    name: r.name.clone(),
                    oidc: None,
                },
                Role::Runtime => Principal::Runtime {
                    name: r.name.clone(),
                },
                Role::Tenant(t) => Principal::Tenant {
                    name: r.name.clone(),
                    tenant: t.clone(),
                    oidc: None,
                },
            });
        }
        if let Caller::Unix {
            uid,
            contained: false,
            ..
        } = caller
            && (*uid == 0 || *uid == self.own_uid)
        {
            return Ok(Principal::Admin {
                name: format!("uid {uid}"),
                oidc: None,
            });
        }
        Err(Status::permission_denied(format!(
            "{} is not mapped to any principal in [[auth.principals]]",
            caller.describe()
        )))
    }
}

impl Authenticator {
    /// A verified token's principal: the first `[[auth.oidc.rules]]` it matches.
    fn identify_token(&self, t: &Verified) -> Result<Principal, Status> {
        let rules = self
            .oidc_rules
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let r = oidc::map_claims(&rules, t).map_err(Status::permission_denied)?;
        let oidc = Some(t.subject.clone());
        match &r.role {
            Role::Admin => Ok(Principal::Admin {
                name: r.name.clone(),
                oidc,
            }),
            Role::Tenant(tenant) => Ok(Principal::Tenant {
                name: r.name.clone(),
                tenant: tenant.clone(),
                oidc,
            }),
            // Refused by the config; never granted by a token.
            Role::Runtime => Err(Status::permission_denied(format!(
                "rule {:?} would make a token the runtime, which no token is",
                r.name
            ))),
        }
    }
}

/// The RPCs, for authorization and audit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rpc {
    GetNode,
    CreateLease,
    RenewLease,
    ReleaseLease,
    GetLease,
    ListLeases,
    WatchLeases,
    ResolveToken,
    BindContainer,
    UnbindContainer,
    ReportAdmission,
    GetUsage,
    ReloadConfig,
    GrantQuota,
    GetQuota,
    SetGpuHealth,
}

impl Rpc {
    pub const ALL: [Rpc; 16] = [
        Rpc::GetNode,
        Rpc::CreateLease,
        Rpc::RenewLease,
        Rpc::ReleaseLease,
        Rpc::GetLease,
        Rpc::ListLeases,
        Rpc::WatchLeases,
        Rpc::ResolveToken,
        Rpc::BindContainer,
        Rpc::UnbindContainer,
        Rpc::ReportAdmission,
        Rpc::GetUsage,
        Rpc::ReloadConfig,
        Rpc::GrantQuota,
        Rpc::GetQuota,
        Rpc::SetGpuHealth,
    ];

    /// Calls that change something (a lease, a binding, a grant, a GPU's health) or
    /// exist to be audited (admission reports): each needs its audit record.
    pub fn mutates(self) -> bool {
        matches!(
            self,
            Rpc::CreateLease
                | Rpc::RenewLease
                | Rpc::ReleaseLease
                | Rpc::BindContainer
                | Rpc::UnbindContainer
                | Rpc::ReportAdmission
                | Rpc::ReloadConfig
                | Rpc::GrantQuota
                | Rpc::SetGpuHealth
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Rpc::GetNode => "GetNode",
            Rpc::CreateLease => "CreateLease",
            Rpc::RenewLease => "RenewLease",
            Rpc::ReleaseLease => "ReleaseLease",
            Rpc::GetLease => "GetLease",
            Rpc::ListLeases => "ListLeases",
            Rpc::WatchLeases => "WatchLeases",
            Rpc::ResolveToken => "ResolveToken",
            Rpc::BindContainer => "BindContainer",
            Rpc::UnbindContainer => "UnbindContainer",
            Rpc::ReportAdmission => "ReportAdmission",
            Rpc::GetUsage => "GetUsage",
            Rpc::ReloadConfig => "ReloadConfig",
            Rpc::GrantQuota => "GrantQuota",
            Rpc::GetQuota => "GetQuota",
            Rpc::SetGpuHealth => "SetGpuHealth",
        }
    }
}

/// Which principal kinds may call an RPC at all. Tenant calls are further limited to
/// their own tenant by the service.
pub fn allowed(rpc: Rpc, p: &Principal) -> bool {
    match p {
        Principal::Admin { .. } => true,
        Principal::Runtime { .. } => matches!(
            rpc,
            Rpc::ResolveToken | Rpc::BindContainer | Rpc::UnbindContainer | Rpc::ReportAdmission
        ),
        Principal::Tenant { .. } => matches!(
            rpc,
            Rpc::GetNode
                | Rpc::CreateLease
                | Rpc::RenewLease
                | Rpc::ReleaseLease
                | Rpc::GetLease
                | Rpc::ListLeases
                | Rpc::WatchLeases
                | Rpc::GetUsage
                | Rpc::GetQuota
        ),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn rules() -> Vec<PrincipalRule> {
        vec![
            PrincipalRule {
                name: "kubelet-runtime".into(),
                role: Role::Runtime,
                uids: vec![],
                gids: vec![990],
                cert_cns: vec![],
            },
            PrincipalRule {
                name: "team-a".into(),
                role: Role::Tenant("team-a".into()),
                uids: vec![1000],
                gids: vec![],
                cert_cns: vec!["team-a-client".into()],
            },
        ]
    }

    /// A peer inside a container (other mount or PID namespace) is never the host
    /// admin, not even as uid 0, and never the runtime; a tenant rule still applies.
    #[test]
    fn a_contained_peer_is_never_admin_or_runtime() {
        let a = Authenticator::new(rules());
        let contained = |uid, gid, groups| Caller::Unix {
            uid,
            gid,
            groups,
            pid: None,
            contained: true,
        };
        let e = a.identify(&contained(0, 0, vec![])).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("inside a container"),
            "{}",
            e.message()
        );
        let e = a.identify(&contained(1234, 5, vec![990])).unwrap_err();
        assert!(
            e.message().contains("never an admin or the runtime"),
            "{}",
            e.message()
        );
        assert_eq!(
            a.identify(&contained(1000, 1000, vec![])).unwrap().tenant(),
            Some("team-a")
        );
        // This test process runs on the host: in the namespaces of PID 1.
        assert!(in_host_namespaces(std::process::id() as i32));
        assert!(
            !in_host_namespaces(i32::MAX),
            "a vanished peer is not trusted"
        );
    }

    /// The connection's peer is looked at once, when it is accepted, and that is
    /// what every request on it gets.
    #[tokio::test]
    async fn a_connection_peer_is_looked_at_once_and_kept_for_its_requests() {
        use tonic::transport::server::Connected;
        let (ours, _theirs) = tokio::net::UnixStream::pair().unwrap();
        let peer = UnixPeer::accepted(ours.connect_info(), std::os::fd::AsFd::as_fd(&ours));
        let cred = peer.info.peer_cred.expect("a socket pair has credentials");
        // The groups are the kernel's record of the peer at connect, not a later
        // look at /proc/<pid>/status.
        let mut want: Vec<u32> = nix::unistd::getgroups()
            .unwrap()
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        let mut got = peer.groups.clone();
        want.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, want);
        assert_eq!(cred.pid(), Some(std::process::id() as i32));
        assert_eq!(peer.contained, Some(false), "this process is on the host");
        let mut req = Request::new(());
        req.extensions_mut().insert(peer.clone());
        assert!(matches!(
            caller_of(&req),
            Caller::Unix {
                contained: false,
                ..
            }
        ));
        // Found inside a container when it connected: every request says so,
        // whatever its pid looks like later.
        let mut req = Request::new(());
        req.extensions_mut().insert(UnixPeer {
            contained: Some(true),
            ..peer
        });
        assert!(matches!(
            caller_of(&req),
            Caller::Unix {
                contained: true,
                ..
            }
        ));
    }

    #[test]
    fn callers_map_to_principals_first_match_and_root_is_admin() {
        let a = Authenticator::new(rules());
        let unix = |uid, gid, groups| Caller::Unix {
            uid,
            gid,
            groups,
            pid: None,
            contained: false,
        };
        assert_eq!(
            a.identify(&unix(1000, 1000, vec![])).unwrap().tenant(),
            Some("team-a")
        );
        assert!(matches!(
            a.identify(&unix(1234, 5, vec![990])).unwrap(),
            Principal::Runtime { .. }
        ));
        assert!(matches!(
            a.identify(&unix(0, 0, vec![])).unwrap(),
            Principal::Admin { .. }
        ));
        let e = a.identify(&unix(4242, 4242, vec![])).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("uid 4242"), "{}", e.message());
        assert_eq!(
            a.identify(&Caller::Cert {
                common_name: "team-a-client".into()
            })
            .unwrap()
            .tenant(),
            Some("team-a")
        );
        assert!(a.identify(&Caller::Unknown).is_err());
    }

    #[test]
    fn runtime_may_only_resolve_and_bind() {
        let rt = Principal::Runtime { name: "r".into() };
        let ok: Vec<_> = Rpc::ALL.iter().filter(|r| allowed(**r, &rt)).collect();
        assert_eq!(
            ok,
            vec![
                &Rpc::ResolveToken,
                &Rpc::BindContainer,
                &Rpc::UnbindContainer,
                &Rpc::ReportAdmission
            ]
        );
        let t = Principal::Tenant {
            name: "t".into(),
            tenant: "t".into(),
            oidc: None,
        };
        assert!(!allowed(Rpc::ResolveToken, &t));
        assert!(!allowed(Rpc::GrantQuota, &t));
        assert!(allowed(Rpc::CreateLease, &t));
    }
}
