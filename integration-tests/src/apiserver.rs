//! The Kubernetes API server stand-in (`python/apiserver_standin.py`) for the DRA
//! suites: ResourceSlices and ResourceClaims of `resource.k8s.io/v1` over HTTP, every
//! write checked against the Kubernetes 1.36 schema and the API server's validation
//! rules. [`ApiServer::start`] runs it on a free loopback port; it stops when
//! dropped.
//!
//! The Python is `$TESSERA_PYTHON` (`make test` points it at its venv with the pinned
//! requirements), else `python3`; without `kubernetes-validate` a test says SKIPPED,
//! unless `TESSERA_REQUIRE_PYTHON=1` makes that a failure.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};

use crate::python::{python_with_or_skip, repo};

/// A running stand-in.
pub struct ApiServer {
    child: Child,
    port: u16,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The Python for the stand-in (with kubernetes-validate), or None after printing
/// SKIPPED (an error under `TESSERA_REQUIRE_PYTHON=1`).
fn python_or_skip() -> anyhow::Result<Option<PathBuf>> {
    python_with_or_skip(
        &["kubernetes_validate", "jsonschema"],
        "kubernetes-validate",
    )
}

/// Checks the documents of YAML manifests against the Kubernetes 1.36 schemas (and
/// the stand-in's rules): Some((all valid, the report)), None when skipped.
pub fn validate_manifests(paths: &[PathBuf]) -> anyhow::Result<Option<(bool, String)>> {
    let Some(py) = python_or_skip()? else {
        return Ok(None);
    };
    let out = Command::new(&py)
        .arg(repo().join("integration-tests/python/apiserver_standin.py"))
        .arg("--validate")
        .args(paths)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .output()
        .context("run the stand-in's validator")?;
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(Some((out.status.success(), report)))
}

impl ApiServer {
    /// Starts the stand-in; None after printing SKIPPED when no Python can run it
    /// (an error instead under `TESSERA_REQUIRE_PYTHON=1`).
    pub fn start() -> anyhow::Result<Option<ApiServer>> {
        let Some(py) = python_or_skip()? else {
            return Ok(None);
        };
        let script = repo().join("integration-tests/python/apiserver_standin.py");
        let mut child = Command::new(&py)
            .arg(&script)
            .args(["--port", "0"])
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("spawn {} {}", py.display(), script.display()))?;
        let stdout = child.stdout.take().context("the stand-in's stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("read the stand-in's port")?;
        let port = line
            .trim()
            .strip_prefix("LISTENING ")
            .and_then(|p| p.parse().ok());
        let Some(port) = port else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the API server stand-in did not start: {line:?}");
        };
        Ok(Some(ApiServer { child, port }))
    }

    /// Its base URL, `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A kubeconfig naming this stand-in as the cluster (what tesserad's
    /// `[kubernetes] kubeconfig` reads), written to `path`.
    pub fn write_kubeconfig(&self, path: &std::path::Path) -> anyhow::Result<()> {
        std::fs::write(
            path,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: standin\nclusters:\n- name: standin\n  cluster:\n    server: {}\nusers:\n- name: tesserad\n  user: {{}}\ncontexts:\n- name: standin\n  context:\n    cluster: standin\n    user: tesserad\n",
                self.url()
            ),
        )
        .with_context(|| path.display().to_string())
    }

    /// A kube-rs client of this stand-in (call inside a tokio runtime).
    pub fn client(&self) -> anyhow::Result<kube::Client> {
        let cfg = kube::Config::new(self.url().parse().context("the stand-in's URL")?);
        Ok(kube::Client::try_from(cfg)?)
    }

    /// Creates ResourceClaim `namespace/name` asking for one device of `class`, and
    /// writes its status as the scheduler would: allocated `device` of `pool`, this
    /// driver's. Its UID.
    pub async fn allocated_claim(
        client: &kube::Client,
        namespace: &str,
        name: &str,
        class: &str,
        pool: &str,
        device: &str,
    ) -> anyhow::Result<String> {
        let claim = serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": class, "allocationMode": "ExactCount", "count": 1}}]}}
        });
        let base = format!("/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims");
        let mut created = request(client, "POST", &base, Some(claim)).await?;
        let uid = created["metadata"]["uid"]
            .as_str()
            .context("the created claim has no uid")?
            .to_string();
        created["status"] = serde_json::json!({"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.tessera.io", "pool": pool, "device": device}
        ]}}});
        request(
            client,
            "PUT",
            &format!("{base}/{name}/status"),
            Some(created),
        )
        .await?;
        Ok(uid)
    }
}

/// One JSON request to the API server (`path` below its base URL).
pub async fn request(
    client: &kube::Client,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> anyhow::Result<serde_json::Value> {
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("Content-Type", "application/json")
        .body(body.map(|b| b.to_string().into_bytes()).unwrap_or_default())?;
    client
        .request::<serde_json::Value>(req)
        .await
        .with_context(|| format!("{method} {path}"))
}
