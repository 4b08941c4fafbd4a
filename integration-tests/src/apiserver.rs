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

use crate::python::{repo, say};

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

/// The Python with kubernetes-validate, or why there is none.
fn python() -> Result<PathBuf, String> {
    let py = std::env::var_os("TESSERA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("python3"));
    let out = Command::new(&py)
        .args(["-c", "import kubernetes_validate, jsonschema"])
        .output()
        .map_err(|e| format!("{}: {e}", py.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} lacks kubernetes-validate (`make pyvenv` installs it): {}",
            py.display(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
                .trim()
        ));
    }
    Ok(py)
}

/// The Python for the stand-in, or None after printing SKIPPED (an error under
/// `TESSERA_REQUIRE_PYTHON=1`).
fn python_or_skip() -> anyhow::Result<Option<PathBuf>> {
    match python() {
        Ok(py) => Ok(Some(py)),
        Err(why) if std::env::var("TESSERA_REQUIRE_PYTHON").as_deref() == Ok("1") => {
            bail!("TESSERA_REQUIRE_PYTHON=1 but {why}")
        }
        Err(why) => {
            say(&format!("SKIPPED: {why}"));
            Ok(None)
        }
    }
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
}
