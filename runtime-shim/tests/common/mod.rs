//! Shared test helpers (also meant for the lead's end-to-end tests): a fake tesserad on a
//! unix socket, a busybox-static rootfs, a static syscall probe, GPU device nodes made
//! with mknod, a containerd-default-like spec, a runtime config, and an OCI image tarball.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use tessera_proto::v1 as pb;
use tonic::{Request, Response, Status};

/// Whether root-only tests can run; prints "SKIPPED: <reason>" when not.
pub fn can_run_as_root(what: &str, need: &[&str]) -> bool {
    if !nix::unistd::geteuid().is_root() {
        // Written past the test harness's capture, so CI logs show the skip.
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("SKIPPED: {what}: not root\n"),
        );
        return false;
    }
    for bin in need {
        if which(bin).is_none() {
            // Written past the test harness's capture, so CI logs show the skip.
            let _ = std::io::Write::write_fmt(
                &mut std::io::stderr(),
                format_args!("SKIPPED: {what}: {bin} not found\n"),
            );
            return false;
        }
    }
    true
}

/// Find a program in the usual places.
pub fn which(bin: &str) -> Option<PathBuf> {
    for dir in [
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ] {
        let p = Path::new(dir).join(bin);
        if p.exists() {
            return Some(p);
        }
    }
    None
}

// ---------------------------------------------------------------- fake daemon

/// What the fake daemon answers for one token.
pub type Answer = Result<pb::ResolveTokenResponse, (tonic::Code, String)>;

/// Calls the fake daemon received.
#[derive(Debug, Default, Clone)]
pub struct Recorded {
    pub resolves: Vec<String>,
    pub binds: Vec<pb::BindContainerRequest>,
    pub unbinds: Vec<String>,
    pub reports: Vec<pb::ReportAdmissionRequest>,
}

#[derive(Clone)]
struct FakeService {
    answers: Arc<HashMap<String, Answer>>,
    rec: Arc<Mutex<Recorded>>,
    fail_bind: bool,
}

/// A fake tesserad serving the runtime's RPCs on a unix socket (the others answer
/// UNIMPLEMENTED). Stops when dropped.
pub struct FakeDaemon {
    pub socket: PathBuf,
    rec: Arc<Mutex<Recorded>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeDaemon {
    /// Serve `answers` on `socket`.
    pub fn start(socket: &Path, answers: HashMap<String, Answer>) -> Self {
        Self::start_with(socket, answers, false)
    }

    /// Like `start`; `fail_bind` makes BindContainer answer FAILED_PRECONDITION.
    pub fn start_with(socket: &Path, answers: HashMap<String, Answer>, fail_bind: bool) -> Self {
        let rec = Arc::new(Mutex::new(Recorded::default()));
        let svc = FakeService {
            answers: Arc::new(answers),
            rec: rec.clone(),
            fail_bind,
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let path = socket.to_path_buf();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let _ = std::fs::remove_file(&path);
                let listener = tokio::net::UnixListener::bind(&path).unwrap();
                ready_tx.send(()).unwrap();
                tonic::transport::Server::builder()
                    .add_service(pb::tessera_server::TesseraServer::new(svc))
                    .serve_with_incoming_shutdown(
                        tokio_stream::wrappers::UnixListenerStream::new(listener),
                        async {
                            let _ = rx.await;
                        },
                    )
                    .await
                    .unwrap();
            });
        });
        ready_rx.recv().unwrap();
        Self {
            socket: socket.to_path_buf(),
            rec,
            stop: Some(tx),
            thread: Some(thread),
        }
    }

    /// What it received so far.
    pub fn recorded(&self) -> Recorded {
        self.rec.lock().unwrap().clone()
    }
}

impl Drop for FakeDaemon {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

fn unimpl<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("not in the fake daemon"))
}

#[tonic::async_trait]
impl pb::tessera_server::Tessera for FakeService {
    async fn get_node(
        &self,
        _: Request<pb::GetNodeRequest>,
    ) -> Result<Response<pb::GetNodeResponse>, Status> {
        unimpl()
    }
    async fn create_lease(
        &self,
        _: Request<pb::CreateLeaseRequest>,
    ) -> Result<Response<pb::CreateLeaseResponse>, Status> {
        unimpl()
    }
    async fn renew_lease(
        &self,
        _: Request<pb::RenewLeaseRequest>,
    ) -> Result<Response<pb::RenewLeaseResponse>, Status> {
        unimpl()
    }
    async fn release_lease(
        &self,
        _: Request<pb::ReleaseLeaseRequest>,
    ) -> Result<Response<pb::ReleaseLeaseResponse>, Status> {
        unimpl()
    }
    async fn get_lease(
        &self,
        _: Request<pb::GetLeaseRequest>,
    ) -> Result<Response<pb::GetLeaseResponse>, Status> {
        unimpl()
    }
    async fn list_leases(
        &self,
        _: Request<pb::ListLeasesRequest>,
    ) -> Result<Response<pb::ListLeasesResponse>, Status> {
        unimpl()
    }
    type WatchLeasesStream = tokio_stream::Empty<Result<pb::LeaseEvent, Status>>;
    async fn watch_leases(
        &self,
        _: Request<pb::WatchLeasesRequest>,
    ) -> Result<Response<Self::WatchLeasesStream>, Status> {
        unimpl()
    }
    async fn resolve_token(
        &self,
        req: Request<pb::ResolveTokenRequest>,
    ) -> Result<Response<pb::ResolveTokenResponse>, Status> {
        let token = req.into_inner().token;
        self.rec.lock().unwrap().resolves.push(token.clone());
        match self.answers.get(&token) {
            Some(Ok(a)) => Ok(Response::new(a.clone())),
            Some(Err((code, msg))) => Err(Status::new(*code, msg.clone())),
            None => Err(Status::not_found("unknown token")),
        }
    }
    async fn bind_container(
        &self,
        req: Request<pb::BindContainerRequest>,
    ) -> Result<Response<pb::BindContainerResponse>, Status> {
        if self.fail_bind {
            return Err(Status::failed_precondition("lease is being revoked"));
        }
        let req = req.into_inner();
        let Some(Ok(answer)) = self.answers.get(&req.token) else {
            return Err(Status::not_found("unknown token"));
        };
        let mut rec = self.rec.lock().unwrap();
        // A bind that names its command carries the admission report, as tesserad
        // records it.
        if !req.admission_command.is_empty() {
            rec.reports.push(pb::ReportAdmissionRequest {
                container_id: req.container_id.clone(),
                lease_id: answer
                    .lease
                    .as_ref()
                    .map(|l| l.id.clone())
                    .unwrap_or_default(),
                admitted: true,
                reasons: Vec::new(),
                command: req.admission_command.clone(),
            });
        }
        rec.binds.push(req);
        Ok(Response::new(pb::BindContainerResponse::default()))
    }
    async fn unbind_container(
        &self,
        req: Request<pb::UnbindContainerRequest>,
    ) -> Result<Response<pb::UnbindContainerResponse>, Status> {
        self.rec
            .lock()
            .unwrap()
            .unbinds
            .push(req.into_inner().container_id);
        Ok(Response::new(pb::UnbindContainerResponse::default()))
    }
    async fn report_admission(
        &self,
        req: Request<pb::ReportAdmissionRequest>,
    ) -> Result<Response<pb::ReportAdmissionResponse>, Status> {
        self.rec.lock().unwrap().reports.push(req.into_inner());
        Ok(Response::new(pb::ReportAdmissionResponse::default()))
    }
    async fn get_usage(
        &self,
        _: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::GetUsageResponse>, Status> {
        unimpl()
    }
    async fn reload_config(
        &self,
        _: Request<pb::ReloadConfigRequest>,
    ) -> Result<Response<pb::ReloadConfigResponse>, Status> {
        unimpl()
    }
    async fn grant_quota(
        &self,
        _: Request<pb::GrantQuotaRequest>,
    ) -> Result<Response<pb::GrantQuotaResponse>, Status> {
        unimpl()
    }
    async fn get_quota(
        &self,
        _: Request<pb::GetQuotaRequest>,
    ) -> Result<Response<pb::GetQuotaResponse>, Status> {
        unimpl()
    }
    async fn set_gpu_health(
        &self,
        _: Request<pb::SetGpuHealthRequest>,
    ) -> Result<Response<pb::SetGpuHealthResponse>, Status> {
        unimpl()
    }
}

/// An ACTIVE lease answer granting `devices` (host path, container path, major, minor).
pub fn lease_answer(
    lease_id: &str,
    tenant: &str,
    devices: &[(&Path, &str, i64, i64)],
    mps_pipe_dir: Option<&Path>,
    cgroup_parent: &str,
) -> pb::ResolveTokenResponse {
    pb::ResolveTokenResponse {
        lease: Some(pb::Lease {
            id: lease_id.to_string(),
            tenant: tenant.to_string(),
            state: pb::LeaseState::Active as i32,
            expires_at_ms: tessera_runtime::lease::now_ms() + 3_600_000,
            ..Default::default()
        }),
        tenant: tenant.to_string(),
        devices: devices
            .iter()
            .map(|(h, c, ma, mi)| pb::DeviceNode {
                host_path: h.to_string_lossy().into_owned(),
                container_path: (*c).to_string(),
                r#type: "c".to_string(),
                major: *ma,
                minor: *mi,
                permissions: "rw".to_string(),
                file_mode: 0o666,
            })
            .collect(),
        env: [
            (
                "CUDA_VISIBLE_DEVICES".to_string(),
                "GPU-00000000-1111-2222-3333-444444444444".to_string(),
            ),
            (
                "CUDA_MPS_PIPE_DIRECTORY".to_string(),
                "/run/nvidia-mps".to_string(),
            ),
        ]
        .into_iter()
        .collect(),
        mounts: mps_pipe_dir
            .map(|d| pb::Mount {
                source: d.to_string_lossy().into_owned(),
                destination: "/run/nvidia-mps".to_string(),
                r#type: "bind".to_string(),
                options: vec!["rbind".to_string(), "rw".to_string()],
            })
            .into_iter()
            .collect(),
        visible_gpu_indices: vec![0],
        granted_capabilities: vec![
            "gpu0/mig/gi1/access".to_string(),
            "gpu0/mig/gi1/ci0/access".to_string(),
        ],
        cgroup_parent: cgroup_parent.to_string(),
        pids_limit: 256,
        // This fake does not compare answers at bind, so the runtime keeps none.
        bind_checks_resolution: false,
    }
}

// ---------------------------------------------------------------- host fixtures

/// GPU nodes made with mknod in `dir`: nvidia0 (195:0), nvidia1 (195:1), nvidiactl
/// (195:255). Needs root.
pub fn gpu_dev_dir(dir: &Path) -> PathBuf {
    let dev = dir.join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for (name, minor) in [("nvidia0", 0u64), ("nvidia1", 1), ("nvidiactl", 255)] {
        let p = dev.join(name);
        nix::sys::stat::mknod(
            &p,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(195, minor),
        )
        .unwrap();
    }
    dev
}

/// A fake driver /proc tree: two GPUs and MIG capabilities.
pub fn fake_nvidia_proc(dir: &Path) -> PathBuf {
    let root = dir.join("proc-nvidia");
    for (bus, minor) in [("0000:3b:00.0", 0), ("0000:5e:00.0", 1)] {
        let g = root.join("gpus").join(bus);
        std::fs::create_dir_all(&g).unwrap();
        std::fs::write(
            g.join("information"),
            format!("Model: H100\nDevice Minor: {minor}\n"),
        )
        .unwrap();
    }
    for f in [
        "mig/config",
        "mig/monitor",
        "gpu0/mig/gi1/access",
        "gpu0/mig/gi1/ci0/access",
        "gpu0/mig/gi2/access",
        "gpu1/mig/gi1/access",
    ] {
        let p = root.join("capabilities").join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "").unwrap();
    }
    root
}

/// The source of the static syscall probe copied into test rootfs.
pub const PROBE_C: &str = include_str!("probe.c");

/// A busybox-static rootfs in `dir/rootfs`: /bin/busybox, a symlink per applet, and
/// /bin/probe (a static C helper issuing raw syscalls) when a C compiler is there.
pub fn busybox_rootfs(dir: &Path) -> PathBuf {
    let rootfs = dir.join("rootfs");
    for d in ["bin", "proc", "sys", "dev", "tmp", "etc", "run", "root"] {
        std::fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    let busybox = which("busybox").expect("busybox-static");
    std::fs::copy(&busybox, rootfs.join("bin/busybox")).unwrap();
    let list = Command::new(&busybox).arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let applet = applet.trim();
        if applet.is_empty() || applet == "busybox" {
            continue;
        }
        let _ = std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet));
    }
    std::fs::write(rootfs.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(rootfs.join("etc/group"), "root:x:0:\n").unwrap();
    if let Some(cc) = which("cc").or_else(|| which("gcc")) {
        let src = dir.join("probe.c");
        std::fs::write(&src, PROBE_C).unwrap();
        let st = Command::new(cc)
            .args(["-static", "-O1", "-o"])
            .arg(rootfs.join("bin/probe"))
            .arg(&src)
            .status()
            .unwrap();
        assert!(st.success(), "building the static probe failed");
    }
    rootfs
}

/// A spec like containerd's default (ctr run) for `args`.
pub fn base_spec(args: &[&str]) -> Value {
    let caps = json!([
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FSETID",
        "CAP_FOWNER",
        "CAP_MKNOD",
        "CAP_NET_RAW",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETFCAP",
        "CAP_SETPCAP",
        "CAP_NET_BIND_SERVICE",
        "CAP_SYS_CHROOT",
        "CAP_KILL",
        "CAP_AUDIT_WRITE"
    ]);
    json!({
        "ociVersion": "1.0.2-dev",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/bin", "TERM=xterm"],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": true
        },
        "root": {"path": "rootfs"},
        "hostname": "tenant",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/run", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}
        ],
        "linux": {
            "resources": {"devices": [
                {"allow": false, "access": "rwm"},
                {"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"},
                {"allow": true, "type": "c", "major": 5, "minor": 2, "access": "rwm"},
                {"allow": true, "type": "c", "major": 136, "access": "rwm"}
            ]},
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}
            ],
            "maskedPaths": ["/proc/acpi", "/proc/kcore"],
            "readonlyPaths": ["/proc/sys"]
        }
    })
}

/// Write `spec` as `bundle/config.json` (creating `bundle`).
pub fn write_spec(bundle: &Path, spec: &Value) {
    std::fs::create_dir_all(bundle).unwrap();
    std::fs::write(
        bundle.join("config.json"),
        serde_json::to_vec_pretty(spec).unwrap(),
    )
    .unwrap();
}

/// A runtime.toml for tests: this host's runc, the given socket, AppArmor if-available,
/// the 2025 runc CVEs acknowledged (CI runs Debian bookworm's runc 1.1.5, which
/// predates their fixes: the runtime logs a warning for each container), and the
/// cgroup parents of `ctr` in the tests' containerd namespace and of the systemd test.
pub fn runtime_config(dir: &Path, socket: &Path, nvidia_proc: &Path, extra: &str) -> PathBuf {
    let runc = which("runc").unwrap_or_else(|| PathBuf::from("/usr/sbin/runc"));
    let p = dir.join("runtime.toml");
    std::fs::write(
        &p,
        format!(
            "runc_path = {runc:?}\nstate_dir = {state:?}\ndaemon_socket = {socket:?}\ndaemon_timeout_ms = 3000\nnvidia_proc_root = {nvidia_proc:?}\nrunc_cve_acknowledged = [\"CVE-2025-31133\", \"CVE-2025-52565\", \"CVE-2025-52881\"]\n{extra}\n[policy]\napparmor = \"if-available\"\ncgroup_parents = [\"/default\", \"/tessera-test\", \"e2etest.slice\"]\n",
            state = dir.join("runtime-state"),
        ),
    )
    .unwrap();
    p
}

/// The tessera-runtime binary under test: `TESSERA_TEST_RUNTIME` when set (`make test`
/// runs the runc suites again on the statically linked release binary that `make
/// build` ships), else the one cargo built with the tests.
pub fn runtime_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TESSERA_TEST_RUNTIME") {
        return PathBuf::from(p);
    }
    // Set for this package's own tests; other packages (the end-to-end tests in
    // integration-tests/) find the binary next to their test executable.
    if let Some(p) = option_env!("CARGO_BIN_EXE_tessera-runtime") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("tessera-runtime")
}

// ---------------------------------------------------------------- OCI image

fn sha256_file(p: &Path) -> String {
    let out = Command::new("sha256sum").arg(p).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

fn add_blob(blobs: &Path, src: &Path) -> (String, u64) {
    let digest = sha256_file(src);
    let size = std::fs::metadata(src).unwrap().len();
    std::fs::copy(src, blobs.join(&digest)).unwrap();
    (digest, size)
}

/// Build an OCI image tarball of `rootfs` named `name` (e.g.
/// "docker.io/library/tessera-busybox:test"): layer tar + config + manifest + index.json
/// + oci-layout, for `ctr images import`.
pub fn oci_image(dir: &Path, rootfs: &Path, name: &str) -> PathBuf {
    let work = dir.join("oci");
    let blobs = work.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let layer = dir.join("layer.tar");
    let st = Command::new("tar")
        .args(["--numeric-owner", "-C"])
        .arg(rootfs)
        .arg("-cf")
        .arg(&layer)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    let (layer_digest, layer_size) = add_blob(&blobs, &layer);
    let arch = if cfg!(target_arch = "aarch64") {
        "arm64"
    } else {
        "amd64"
    };
    let config = json!({
        "architecture": arch, "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]}
    });
    let config_path = dir.join("config.json.blob");
    std::fs::write(&config_path, serde_json::to_vec(&config).unwrap()).unwrap();
    let (config_digest, config_size) = add_blob(&blobs, &config_path);
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": format!("sha256:{config_digest}"), "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": format!("sha256:{layer_digest}"), "size": layer_size}]
    });
    let manifest_path = dir.join("manifest.blob");
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let (manifest_digest, manifest_size) = add_blob(&blobs, &manifest_path);
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{manifest_digest}"), "size": manifest_size,
            "platform": {"architecture": arch, "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(':').next().unwrap()}
        }]
    });
    std::fs::write(work.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(
        work.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    let tarball = dir.join("image.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(&work)
        .arg("-cf")
        .arg(&tarball)
        .args(["oci-layout", "index.json", "blobs"])
        .status()
        .unwrap();
    assert!(st.success());
    tarball
}

/// The start time of process `pid` (field 22 of /proc/<pid>/stat), as runc records it.
pub fn proc_start_time(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = text.rsplit_once(')').unwrap();
    rest.split_whitespace().nth(19).unwrap().parse().unwrap()
}

/// A pod sandbox as runc records it in `<runc_root>/<id>/state.json` (the fields the
/// runtime reads: its id, init pid and start time, labels, cgroup).
pub struct SandboxState<'a> {
    pub id: &'a str,
    pub pod_uid: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    /// A live process standing for the sandbox's init.
    pub pid: u32,
    /// cgroupfs path, or systemd's slice:prefix:name.
    pub cgroups_path: &'a str,
}

impl SandboxState<'_> {
    /// Write it (root's, 0600, in a 0711 directory, as runc does).
    pub fn write(&self, runc_root: &Path) {
        use std::os::unix::fs::PermissionsExt;
        let dir = runc_root.join(self.id);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(runc_root, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        let cgroups = match self.cgroups_path.split(':').collect::<Vec<_>>().as_slice() {
            [parent, prefix, name] => json!({"path": "", "parent": parent,
                "scope_prefix": prefix, "name": name, "Systemd": true}),
            _ => json!({"path": self.cgroups_path, "scope_prefix": "", "Systemd": false}),
        };
        let state = json!({
            "id": self.id,
            "init_process_pid": self.pid,
            "init_process_start": proc_start_time(self.pid),
            "created": "2026-01-01T00:00:00Z",
            "config": {
                "labels": [
                    "io.kubernetes.cri.container-type=sandbox",
                    format!("io.kubernetes.cri.sandbox-id={}", self.id),
                    format!("io.kubernetes.cri.sandbox-uid={}", self.pod_uid),
                    format!("io.kubernetes.cri.sandbox-namespace={}", self.namespace),
                    format!("io.kubernetes.cri.sandbox-name={}", self.name),
                    "bundle=/run/containerd/io.containerd.runtime.v2.task/k8s.io/sandbox",
                ],
                "cgroups": cgroups,
                "namespaces": [{"type": "NEWNET", "path": ""}],
            },
            "rootless": false,
            "cgroup_paths": {},
            "namespace_paths": {"NEWNET": format!("/proc/{}/ns/net", self.pid)},
        });
        let path = dir.join("state.json");
        std::fs::write(&path, serde_json::to_vec(&state).unwrap()).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
}

/// The shared busybox rootfs `<dir>/rootfs` as `<bundle>/rootfs` (hard links: same
/// files, no copy): a rootfs outside the bundle must be the container's own as its
/// engine recorded it, so a test bundle carries its rootfs. Returns the path to put
/// in `root.path`.
pub fn bundle_rootfs(dir: &Path, bundle: &Path) -> PathBuf {
    let dest = bundle.join("rootfs");
    if !dest.exists() {
        std::fs::create_dir_all(bundle).unwrap();
        let st = Command::new("cp")
            .arg("-al")
            .arg(dir.join("rootfs"))
            .arg(&dest)
            .status()
            .unwrap();
        assert!(st.success(), "cp -al rootfs into {}", bundle.display());
    }
    dest
}

/// The start time of process `pid`, or `None` when it is gone or a zombie.
pub fn proc_start_time_opt(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = text.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    if fields.next() == Some("Z") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}
