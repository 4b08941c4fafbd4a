//! The CRI end-to-end harness: a private containerd (its own root, state, sockets and
//! CNI configuration in a temp dir) with `tessera-runtime` registered as the `tessera`
//! runtime handler, OCI images built locally from a rootfs (no registry is reachable in
//! CI), and requests shaped as kubelet shapes them. The client is generated from the
//! vendored kubernetes/cri-api proto (`proto/cri-api/`).
//!
//! Networking: a CNI `bridge` without gateway, masquerade or uplink on a private subnet,
//! so a pod gets its own network namespace (the runtime refuses the host's) and nothing
//! leaves the host.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;
use sha2::Digest;
use tonic::transport::Channel;

/// The CRI v1 API generated from kubernetes/cri-api.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    tonic::include_proto!("runtime.v1");
}

pub use pb::image_service_client::ImageServiceClient;
pub use pb::runtime_service_client::RuntimeServiceClient;

/// The runtime handler (RuntimeClass handler) tessera-runtime is registered as.
pub const HANDLER: &str = "tessera";
/// The annotation carrying a lease token (what the device plugin's Allocate returns).
pub use tessera_common::contract::LEASE_TOKEN_ANNOTATION as TOKEN_ANNOTATION;
/// The CRI plugin's namespace in containerd.
pub const K8S_NS: &str = "k8s.io";
/// The sandbox (pause) image: busybox sleeping, built locally.
pub const PAUSE_IMAGE: &str = "docker.io/tessera-e2e/pause:1";
/// The workload image: the busybox rootfs with `sh` as its command.
pub const TEST_IMAGE: &str = "docker.io/tessera-e2e/busybox:1";

/// An OCI image layout tarball of `rootfs` named `name` whose config runs `entrypoint`
/// (`ctr images import` reads it).
pub fn oci_image(
    work: &Path,
    rootfs: &Path,
    name: &str,
    entrypoint: &[&str],
) -> anyhow::Result<PathBuf> {
    let stem: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let dir = work.join(format!("oci-{stem}"));
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).with_context(|| blobs.display().to_string())?;
    let layer = work.join(format!("{stem}-layer.tar"));
    let out = Command::new("tar")
        .args(["--numeric-owner", "--owner=0", "--group=0", "-C"])
        .arg(rootfs)
        .arg("-cf")
        .arg(&layer)
        .arg(".")
        .output()
        .context("tar")?;
    if !out.status.success() {
        bail!("tar {}: {}", rootfs.display(), text(&out));
    }
    let layer_bytes = std::fs::read(&layer).with_context(|| layer.display().to_string())?;
    let add = |bytes: &[u8]| -> anyhow::Result<(String, usize)> {
        let digest = hex::encode(sha2::Sha256::digest(bytes));
        let p = blobs.join(&digest);
        std::fs::write(&p, bytes).with_context(|| p.display().to_string())?;
        Ok((format!("sha256:{digest}"), bytes.len()))
    };
    let (layer_digest, layer_size) = add(&layer_bytes)?;
    let arch = if cfg!(target_arch = "aarch64") {
        "arm64"
    } else {
        "amd64"
    };
    let config = json!({
        "architecture": arch, "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Entrypoint": entrypoint, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]}
    });
    let (config_digest, config_size) = add(&serde_json::to_vec(&config)?)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": layer_size}]
    });
    let (manifest_digest, manifest_size) = add(&serde_json::to_vec(&manifest)?)?;
    let tag = name.rsplit(':').next().unwrap_or("latest");
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest, "size": manifest_size,
            "platform": {"architecture": arch, "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": tag}
        }]
    });
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index)?)?;
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    let tarball = work.join(format!("{stem}.tar"));
    let out = Command::new("tar")
        .arg("-C")
        .arg(&dir)
        .arg("-cf")
        .arg(&tarball)
        .args(["oci-layout", "index.json", "blobs"])
        .output()
        .context("tar")?;
    if !out.status.success() {
        bail!("tar {}: {}", dir.display(), text(&out));
    }
    Ok(tarball)
}

/// stdout and stderr of a finished command, together.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Where the CNI plugins are: Debian's containernetworking-plugins, or the usual
/// upstream place.
pub fn cni_bin_dir() -> Option<PathBuf> {
    ["/usr/lib/cni", "/opt/cni/bin"]
        .iter()
        .map(PathBuf::from)
        .find(|d| d.join("bridge").exists() && d.join("host-local").exists())
}

/// What a private containerd needs.
#[derive(Debug, Clone)]
pub struct ContainerdSetup {
    /// Everything of containerd's goes below this directory (keep it short: unix
    /// socket paths are limited to 108 bytes).
    pub dir: PathBuf,
    /// The tessera-runtime binary registered as the `tessera` handler (BinaryName).
    /// containerd passes no environment of its choosing to it: the runtime reads
    /// `<runtime_bin>.toml` beside it.
    pub runtime_bin: PathBuf,
    /// The CNI plugins' directory.
    pub cni_bin_dir: PathBuf,
    /// A number unique on this host among running harnesses (bridge name, subnet).
    pub slot: u32,
    /// Register the handler with runc's systemd cgroup driver (`SystemdCgroup = true`,
    /// kubeadm's default): cgroup parents are slices, containers scopes.
    pub systemd_cgroup: bool,
}

/// A running private containerd with the CRI plugin.
pub struct Containerd {
    pub setup: ContainerdSetup,
    pub socket: PathBuf,
    pub bridge: String,
    child: Option<Child>,
}

impl ContainerdSetup {
    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }
    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }
}

impl Containerd {
    /// Write the configuration (CRI with the `tessera` handler, CNI bridge) and start
    /// containerd; wait until it answers.
    pub fn start(setup: ContainerdSetup) -> anyhow::Result<Containerd> {
        let dir = &setup.dir;
        let socket = dir.join("ctrd.sock");
        let cni_conf = dir.join("cni");
        std::fs::create_dir_all(&cni_conf).with_context(|| cni_conf.display().to_string())?;
        let bridge = format!("tscri{}", setup.slot % 100_000);
        let subnet = format!("10.251.{}.0/24", setup.slot % 250);
        let conflist = json!({
            "cniVersion": "1.0.0",
            "name": format!("tessera-e2e-{}", setup.slot),
            "plugins": [{
                "type": "bridge",
                "bridge": bridge,
                "isGateway": false,
                "ipMasq": false,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet}]],
                    "dataDir": dir.join("cni-ipam"),
                }
            }]
        });
        std::fs::write(
            cni_conf.join("10-tessera-e2e.conflist"),
            serde_json::to_vec_pretty(&conflist)?,
        )?;
        let config = dir.join("containerd.toml");
        let toml = format!(
            r#"version = 2
root = {root:?}
state = {state:?}
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = {sock:?}
[ttrpc]
  address = {ttrpc:?}
[debug]
  address = {debug:?}
[plugins."io.containerd.internal.v1.opt"]
  path = {opt:?}
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {pause:?}
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true
  # Never below containerd's own score: lowering it needs CAP_SYS_RESOURCE, which a
  # CI sandbox may withhold from root (kubelet gives sandboxes -998).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {cni_bin:?}
    conf_dir = {cni_conf:?}
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{handler}]
      runtime_type = "io.containerd.runc.v2"
      pod_annotations = [{token:?}]
      container_annotations = [{token:?}]
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{handler}.options]
        BinaryName = {bin:?}
        SystemdCgroup = {systemd}
"#,
            root = setup.root(),
            state = setup.state(),
            sock = socket,
            ttrpc = dir.join("ctrd.ttrpc.sock"),
            debug = dir.join("ctrd.debug.sock"),
            opt = dir.join("opt"),
            pause = PAUSE_IMAGE,
            cni_bin = setup.cni_bin_dir,
            cni_conf = cni_conf,
            handler = HANDLER,
            token = TOKEN_ANNOTATION,
            bin = setup.runtime_bin,
            systemd = setup.systemd_cgroup,
        );
        std::fs::write(&config, toml).with_context(|| config.display().to_string())?;
        let log_path = dir.join("containerd.log");
        let log =
            std::fs::File::create(&log_path).with_context(|| log_path.display().to_string())?;
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .env_remove("TESSERA_RUNTIME_CONFIG")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawn containerd")?;
        let mut c = Containerd {
            setup,
            socket,
            bridge,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(ch) = c.child.as_mut()
                && let Some(status) = ch.try_wait()?
            {
                c.child = None;
                bail!("containerd exited with {status} at start:\n{}", c.log());
            }
            if c.ctr(&["version"])?.status.success() {
                return Ok(c);
            }
            if Instant::now() > deadline {
                bail!("containerd did not answer in 60 s:\n{}", c.log());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// containerd's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.setup.dir.join("containerd.log")).unwrap_or_default()
    }

    /// `ctr --address <ours> -n k8s.io ARGS`.
    pub fn ctr(&self, args: &[&str]) -> anyhow::Result<Output> {
        Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(["--namespace", K8S_NS])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .context("run ctr")
    }

    /// Wait (up to 60 s) until the CRI plugin reports the runtime and the network
    /// ready, as kubelet waits before it runs pods.
    pub async fn wait_ready(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let last = match self.runtime().await {
                Ok(mut rs) => match rs.status(pb::StatusRequest { verbose: false }).await {
                    Ok(r) => {
                        let conds = r
                            .into_inner()
                            .status
                            .map(|s| s.conditions)
                            .unwrap_or_default();
                        let ready = |t: &str| conds.iter().any(|c| c.r#type == t && c.status);
                        if ready("RuntimeReady") && ready("NetworkReady") {
                            return Ok(());
                        }
                        format!("{conds:?}")
                    }
                    Err(e) => e.to_string(),
                },
                Err(e) => format!("{e:#}"),
            };
            if Instant::now() > deadline {
                bail!(
                    "the CRI plugin is not ready after 60 s: {last}\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Import an image tarball into the CRI plugin's namespace (native snapshotter, as
    /// the CRI plugin is configured) and wait until the CRI image service lists it.
    pub async fn import_image(&self, tarball: &Path, name: &str) -> anyhow::Result<()> {
        let path = tarball.to_string_lossy().into_owned();
        let out = self.ctr(&["images", "import", "--snapshotter", "native", &path])?;
        if !out.status.success() {
            bail!("ctr images import {path}: {}", text(&out));
        }
        let mut images = self.images().await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let st = images
                .image_status(pb::ImageStatusRequest {
                    image: Some(pb::ImageSpec {
                        image: name.to_string(),
                        ..Default::default()
                    }),
                    verbose: false,
                })
                .await?
                .into_inner();
            if st.image.is_some() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the CRI image service does not list {name} 30 s after the import");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn channel(&self) -> anyhow::Result<Channel> {
        crate::channel(&self.socket).await
    }

    /// A CRI RuntimeService client on containerd's socket.
    pub async fn runtime(&self) -> anyhow::Result<RuntimeServiceClient<Channel>> {
        Ok(RuntimeServiceClient::new(self.channel().await?))
    }

    /// A CRI ImageService client on containerd's socket.
    pub async fn images(&self) -> anyhow::Result<ImageServiceClient<Channel>> {
        Ok(ImageServiceClient::new(self.channel().await?))
    }

    /// StopPodSandbox and RemovePodSandbox for every pod; the calls that failed.
    pub async fn remove_all_pods(&self) -> anyhow::Result<Vec<String>> {
        let mut rs = self.runtime().await?;
        let pods = rs
            .list_pod_sandbox(pb::ListPodSandboxRequest::default())
            .await?
            .into_inner()
            .items;
        let mut errs = Vec::new();
        for p in pods {
            if let Err(e) = rs
                .stop_pod_sandbox(pb::StopPodSandboxRequest {
                    pod_sandbox_id: p.id.clone(),
                })
                .await
            {
                errs.push(format!("StopPodSandbox {}: {e}", p.id));
            }
            if let Err(e) = rs
                .remove_pod_sandbox(pb::RemovePodSandboxRequest {
                    pod_sandbox_id: p.id.clone(),
                })
                .await
            {
                errs.push(format!("RemovePodSandbox {}: {e}", p.id));
            }
        }
        Ok(errs)
    }

    /// Stop and remove every pod as kubelet would (StopPodSandbox tears down the
    /// network, RemovePodSandbox the containers), then stop containerd and remove the
    /// bridge. Errors are collected, not fatal: this is cleanup.
    pub fn shutdown(&mut self) -> Vec<String> {
        let mut errors = Vec::new();
        if self.child.is_none() {
            return errors;
        }
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => match rt.block_on(self.remove_all_pods()) {
                Ok(errs) => errors.extend(errs),
                Err(e) => errors.push(format!("listing pods: {e:#}")),
            },
            Err(e) => errors.push(format!("tokio runtime: {e}")),
        }
        if let Some(mut c) = self.child.take() {
            if let Ok(pid) = i32::try_from(c.id()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    _ => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
        }
        if Path::new("/sys/class/net").join(&self.bridge).exists() {
            match Command::new("ip")
                .args(["link", "del", &self.bridge])
                .output()
            {
                Ok(o) if o.status.success() => {}
                Ok(o) => errors.push(format!("ip link del {}: {}", self.bridge, text(&o))),
                Err(e) => errors.push(format!("ip link del {}: {e}", self.bridge)),
            }
        }
        errors
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        for e in self.shutdown() {
            // Written past the test harness's capture: cleanup trouble shows in CI logs.
            let _ = std::io::Write::write_fmt(
                &mut std::io::stderr(),
                format_args!("cri harness cleanup: {e}\n"),
            );
        }
    }
}

/// Remove the cgroup directory `rel` (relative to each hierarchy's root, e.g.
/// "/tessera-e2e-1") and everything below it in every cgroup v1 hierarchy and in the
/// v2 tree, deepest first. Directories still holding processes stay.
pub fn remove_cgroup_tree(rel: &str) {
    fn rm(dir: &Path) {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    rm(&e.path());
                }
            }
        }
        let _ = std::fs::remove_dir(dir);
    }
    let rel = rel.trim_start_matches('/');
    if rel.is_empty() {
        return;
    }
    let root = Path::new("/sys/fs/cgroup");
    rm(&root.join(rel));
    if let Ok(rd) = std::fs::read_dir(root) {
        for h in rd.flatten() {
            rm(&h.path().join(rel));
        }
    }
}

/// A pod as kubelet describes it to the runtime.
#[derive(Debug, Clone)]
pub struct Pod {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    /// The pod's cgroup (cgroupfs driver), e.g. "/kubepods/besteffort/pod<uid>".
    pub cgroup_parent: String,
    /// kubelet's root dir (pods/<uid>/... below it).
    pub kubelet_root: PathBuf,
    /// Where the pod's logs go (kubelet: /var/log/pods/<ns>_<name>_<uid>).
    pub log_dir: PathBuf,
    pub annotations: Vec<(String, String)>,
}

impl Pod {
    /// A pod `name` in namespace "default" whose cgroup is `<cgroup_root>/pod<uid>`.
    pub fn new(name: &str, uid: &str, cgroup_root: &str, base: &Path) -> Pod {
        Pod {
            name: name.to_string(),
            namespace: "default".to_string(),
            uid: uid.to_string(),
            cgroup_parent: format!("{}/pod{uid}", cgroup_root.trim_end_matches('/')),
            kubelet_root: base.join("kubelet"),
            log_dir: base.join("pods").join(format!("default_{name}_{uid}")),
            annotations: vec![
                ("kubernetes.io/config.source".into(), "api".into()),
                (
                    "kubernetes.io/config.seen".into(),
                    "2026-01-01T00:00:00.000000000Z".into(),
                ),
            ],
        }
    }

    pub fn pod_dir(&self) -> PathBuf {
        self.kubelet_root.join("pods").join(&self.uid)
    }

    fn labels(&self) -> std::collections::HashMap<String, String> {
        [
            ("io.kubernetes.pod.name", self.name.as_str()),
            ("io.kubernetes.pod.namespace", self.namespace.as_str()),
            ("io.kubernetes.pod.uid", self.uid.as_str()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// The PodSandboxConfig kubelet sends (cgroupfs driver, pod network, container
    /// PID namespace, seccomp Unconfined: kubelet's default without --seccomp-default).
    pub fn sandbox_config(&self) -> anyhow::Result<pb::PodSandboxConfig> {
        std::fs::create_dir_all(&self.log_dir)
            .with_context(|| self.log_dir.display().to_string())?;
        let mut labels = self.labels();
        labels.insert("app".into(), self.name.clone());
        Ok(pb::PodSandboxConfig {
            metadata: Some(pb::PodSandboxMetadata {
                name: self.name.clone(),
                uid: self.uid.clone(),
                namespace: self.namespace.clone(),
                attempt: 0,
            }),
            hostname: self.name.clone(),
            log_directory: self.log_dir.to_string_lossy().into_owned(),
            dns_config: Some(pb::DnsConfig {
                servers: vec!["127.0.0.53".into()],
                searches: vec!["default.svc.cluster.local".into()],
                options: vec!["ndots:5".into()],
            }),
            labels,
            annotations: self.annotations.iter().cloned().collect(),
            linux: Some(pb::LinuxPodSandboxConfig {
                cgroup_parent: self.cgroup_parent.clone(),
                security_context: Some(pb::LinuxSandboxSecurityContext {
                    namespace_options: Some(pb::NamespaceOption {
                        network: pb::NamespaceMode::Pod as i32,
                        pid: pb::NamespaceMode::Container as i32,
                        ipc: pb::NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    seccomp: Some(pb::SecurityProfile {
                        profile_type: pb::security_profile::ProfileType::Unconfined as i32,
                        localhost_ref: String::new(),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    /// The ContainerConfig kubelet sends for container `name` (attempt `attempt`) of
    /// this pod running `command` in `image`, with kubelet's mounts: /etc/hosts, the
    /// termination-log file (created here as kubelet does) and a read-only service
    /// account volume; `annotations` are the device plugin's (the lease token).
    pub fn container_config(
        &self,
        name: &str,
        attempt: u32,
        image: &str,
        command: &[&str],
        annotations: &[(&str, &str)],
    ) -> anyhow::Result<pb::ContainerConfig> {
        let pod_dir = self.pod_dir();
        let hosts = pod_dir.join("etc-hosts");
        let sa = pod_dir.join("volumes/kubernetes.io~projected/kube-api-access-e2e");
        std::fs::create_dir_all(&sa).with_context(|| sa.display().to_string())?;
        std::fs::write(sa.join("namespace"), &self.namespace)?;
        std::fs::write(
            &hosts,
            format!(
                "127.0.0.1\tlocalhost\n::1\tlocalhost\n10.0.0.1\t{}\n",
                self.name
            ),
        )
        .with_context(|| hosts.display().to_string())?;
        let term = self.termination_log(name, attempt);
        if let Some(parent) = term.parent() {
            std::fs::create_dir_all(parent).with_context(|| parent.display().to_string())?;
        }
        std::fs::write(&term, b"").with_context(|| term.display().to_string())?;
        std::fs::set_permissions(
            &term,
            <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o666),
        )?;
        let mut labels = self.labels();
        labels.insert("io.kubernetes.container.name".into(), name.into());
        let mut ann: std::collections::HashMap<String, String> = [
            ("io.kubernetes.container.hash", "1a2b3c4d"),
            (
                "io.kubernetes.container.terminationMessagePath",
                "/dev/termination-log",
            ),
            ("io.kubernetes.container.terminationMessagePolicy", "File"),
            ("io.kubernetes.pod.terminationGracePeriod", "30"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        ann.insert(
            "io.kubernetes.container.restartCount".into(),
            attempt.to_string(),
        );
        for (k, v) in annotations {
            ann.insert((*k).to_string(), (*v).to_string());
        }
        let mount = |container: &str, host: &Path, readonly: bool| pb::Mount {
            container_path: container.to_string(),
            host_path: host.to_string_lossy().into_owned(),
            readonly,
            selinux_relabel: false,
            propagation: pb::MountPropagation::PropagationPrivate as i32,
            ..Default::default()
        };
        Ok(pb::ContainerConfig {
            metadata: Some(pb::ContainerMetadata {
                name: name.to_string(),
                attempt,
            }),
            image: Some(pb::ImageSpec {
                image: image.to_string(),
                user_specified_image: image.to_string(),
                ..Default::default()
            }),
            command: command.iter().map(|s| (*s).to_string()).collect(),
            envs: vec![
                pb::KeyValue {
                    key: "KUBERNETES_SERVICE_HOST".into(),
                    value: "10.96.0.1".into(),
                },
                pb::KeyValue {
                    key: "KUBERNETES_SERVICE_PORT".into(),
                    value: "443".into(),
                },
            ],
            mounts: vec![
                mount("/etc/hosts", &hosts, false),
                mount("/dev/termination-log", &term, false),
                mount("/var/run/secrets/kubernetes.io/serviceaccount", &sa, true),
            ],
            labels,
            annotations: ann,
            log_path: format!("{name}/{attempt}.log"),
            linux: Some(pb::LinuxContainerConfig {
                resources: Some(pb::LinuxContainerResources {
                    cpu_period: 100_000,
                    cpu_quota: 0,
                    cpu_shares: 2,
                    memory_limit_in_bytes: 0,
                    oom_score_adj: 1000,
                    ..Default::default()
                }),
                security_context: Some(pb::LinuxContainerSecurityContext {
                    namespace_options: Some(pb::NamespaceOption {
                        network: pb::NamespaceMode::Pod as i32,
                        pid: pb::NamespaceMode::Container as i32,
                        ipc: pb::NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    seccomp: Some(pb::SecurityProfile {
                        profile_type: pb::security_profile::ProfileType::Unconfined as i32,
                        localhost_ref: String::new(),
                    }),
                    masked_paths: KUBELET_MASKED_PATHS.iter().map(|s| (*s).into()).collect(),
                    readonly_paths: KUBELET_READONLY_PATHS.iter().map(|s| (*s).into()).collect(),
                    ..Default::default()
                }),
            }),
            ..Default::default()
        })
    }

    /// The host file kubelet bind-mounts at /dev/termination-log for `name`/`attempt`.
    pub fn termination_log(&self, name: &str, attempt: u32) -> PathBuf {
        self.pod_dir()
            .join("containers")
            .join(name)
            .join(format!("e2e{attempt:04}"))
    }
}

/// kubelet's default masked paths (securitycontext.defaultMaskedPaths).
pub const KUBELET_MASKED_PATHS: &[&str] = &[
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// kubelet's default read-only paths (securitycontext.defaultReadonlyPaths).
pub const KUBELET_READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// What containerd (1.7 and later, `enable_cdi`) does with a `CDIDevice` kubelet names
/// in a ContainerConfig, done here because Debian's containerd 1.6 has no CDI: the
/// fully-qualified `id` (`vendor.io/class=name`) is looked up in the specs of
/// `cdi_dir`, and the spec's and the device's container edits are applied to `cfg` as
/// the env, device nodes and bind mounts containerd would put in the OCI spec. The
/// device is also named in `cdi_devices`, as kubelet sends it.
pub fn apply_cdi_device(
    cfg: &mut pb::ContainerConfig,
    cdi_dir: &Path,
    id: &str,
) -> anyhow::Result<()> {
    use tessera_common::cdi::{ContainerEdits, Spec};
    let (kind, name) = id
        .split_once('=')
        .with_context(|| format!("CDI device {id:?} is not kind=name"))?;
    let mut found: Option<(Spec, ContainerEdits)> = None;
    for entry in std::fs::read_dir(cdi_dir).with_context(|| cdi_dir.display().to_string())? {
        let path = entry?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let body = std::fs::read(&path).with_context(|| path.display().to_string())?;
        let spec: Spec =
            serde_json::from_slice(&body).with_context(|| path.display().to_string())?;
        if spec.kind != kind {
            continue;
        }
        if let Some(d) = spec.devices.iter().find(|d| d.name == name) {
            if found.is_some() {
                bail!(
                    "CDI device {id} is in more than one spec of {}",
                    cdi_dir.display()
                );
            }
            let edits = d.container_edits.clone();
            found = Some((spec, edits));
        }
    }
    let Some((spec, device)) = found else {
        bail!("no CDI spec in {} has the device {id}", cdi_dir.display());
    };
    for edits in [&spec.container_edits, &device] {
        for env in &edits.env {
            let (k, v) = env.split_once('=').unwrap_or((env.as_str(), ""));
            cfg.envs.retain(|kv| kv.key != k);
            cfg.envs.push(pb::KeyValue {
                key: k.to_string(),
                value: v.as_bytes().to_vec(),
            });
        }
        for n in &edits.device_nodes {
            cfg.devices.push(pb::Device {
                container_path: n.path.clone(),
                host_path: n.host_path.clone().unwrap_or_else(|| n.path.clone()),
                permissions: n.permissions.clone().unwrap_or_else(|| "rwm".into()),
            });
        }
        for m in &edits.mounts {
            cfg.mounts.push(pb::Mount {
                container_path: m.container_path.clone(),
                host_path: m.host_path.clone(),
                readonly: m.options.iter().any(|o| o == "ro"),
                selinux_relabel: false,
                propagation: pb::MountPropagation::PropagationPrivate as i32,
                ..Default::default()
            });
        }
    }
    cfg.cdi_devices.push(pb::CdiDevice {
        name: id.to_string(),
    });
    Ok(())
}
