//! Python `grpcio` clients run by the tests (clients that are not tonic): which
//! Python, stubs generated from proto/ by grpcio-tools, and a pytest run with a
//! deadline whose summary goes to the CI log.
//!
//! The Python comes from `$TESSERA_PYTHON` (`make test` points it at the venv it
//! creates with the pinned packages), else `python3`. Without grpcio, grpcio-tools and
//! pytest a test says SKIPPED, unless `TESSERA_REQUIRE_PYTHON=1` (set by `make test`,
//! so CI cannot skip it), which makes it fail instead.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Written past the test harness's capture, so CI logs show it.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The Python to use if it can import every one of `modules`, or why there is none
/// (`lacks` names the packages for the message).
fn python(modules: &[&str], lacks: &str) -> Result<PathBuf, String> {
    let py = std::env::var_os("TESSERA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("python3"));
    let out = Command::new(&py)
        .args(["-c", &format!("import {}", modules.join(", "))])
        .output()
        .map_err(|e| format!("{}: {e}", py.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} lacks {lacks} (`make pyvenv` installs them): {}",
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

/// The Python that imports `modules`, or `None` after printing SKIPPED with the
/// reason; an error when `TESSERA_REQUIRE_PYTHON=1` forbids skipping.
pub fn python_with_or_skip(modules: &[&str], lacks: &str) -> anyhow::Result<Option<PathBuf>> {
    match python(modules, lacks) {
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

/// The Python with grpcio, or `None` after printing SKIPPED with the reason; an
/// error when `TESSERA_REQUIRE_PYTHON=1` forbids skipping.
pub fn python_or_skip() -> anyhow::Result<Option<PathBuf>> {
    python_with_or_skip(
        &["grpc", "grpc_tools", "pytest"],
        "grpcio, grpcio-tools or pytest",
    )
}

/// Python stubs for `files` (paths below proto/), generated into `out`.
pub fn generate_stubs(py: &Path, out: &Path, files: &[&str]) -> anyhow::Result<()> {
    for file in files {
        let o = Command::new(py)
            .args(["-m", "grpc_tools.protoc", "-I"])
            .arg(repo().join("proto"))
            .arg(format!("--python_out={}", out.display()))
            .arg(format!("--grpc_python_out={}", out.display()))
            .arg(file)
            .output()
            .with_context(|| format!("{}: grpc_tools.protoc", py.display()))?;
        if !o.status.success() {
            bail!(
                "grpc_tools.protoc {file}:\n{}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
    Ok(())
}

/// What a pytest run gave: its exit (none when it ran past its deadline and was
/// killed) and its output.
pub struct PytestRun {
    pub status: Option<ExitStatus>,
    pub output: String,
}

impl PytestRun {
    /// pytest's own summary line ("8 passed in 0.30s").
    pub fn summary(&self) -> &str {
        self.output
            .lines()
            .rev()
            .find(|l| l.contains(" passed"))
            .unwrap_or("(no pytest summary)")
            .trim_matches(|c: char| c == '=' || c.is_whitespace())
    }
}

/// Run `pytest -v SCRIPT` (a path below the repository) with `PYTHONPATH=stubs` and
/// `envs`, killed after `limit`; its output is kept in `stubs/pytest.log`.
pub fn pytest(
    py: &Path,
    script: &str,
    stubs: &Path,
    envs: &[(&str, &std::ffi::OsStr)],
    limit: Duration,
) -> anyhow::Result<PytestRun> {
    let log = stubs.join("pytest.log");
    let log_file =
        std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
    let mut cmd = Command::new(py);
    cmd.args(["-m", "pytest", "-v", "-p", "no:cacheprovider"])
        .arg(repo().join(script))
        .env("PYTHONPATH", stubs)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().context("pytest log")?)
        .stderr(log_file);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().context("spawn pytest")?;
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().context("wait for pytest")? {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    Ok(PytestRun { status, output })
}
