//! The runc this runtime hands containers to must carry the fixes for the known
//! container-escape CVEs, unless runtime.toml acknowledges them by name
//! (`runc_cve_acknowledged`, for a distribution build with backports).

use std::path::Path;
use std::process::{Child, Command, Stdio};

/// The CVEs `runc` lacks fixes for and nobody acknowledged: `Err` refuses the
/// container naming them; `Ok(Some)` is a warning to log each time an
/// acknowledgement is relied on.
pub fn check(runc: &Path, acknowledged: &[String]) -> Result<Option<String>, String> {
    start(runc).judge(acknowledged)
}

/// `runc --version`, started: [`Pending::judge`] waits for its answer. runc is a
/// Go program that takes a few milliseconds to start; a container start does its
/// other work (the token's resolve, the hardening) meanwhile, and judges before
/// anything is bound, written or run.
pub fn start(runc: &Path) -> Pending {
    let child = Command::new(runc)
        .arg("--version")
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok();
    Pending { child }
}

/// A `runc --version` running.
#[derive(Debug)]
pub struct Pending {
    child: Option<Child>,
}

impl Pending {
    /// Wait for the version and judge it ([`judge`]); a runc that could not be
    /// run is of unknown version, and refused.
    pub fn judge(self, acknowledged: &[String]) -> Result<Option<String>, String> {
        let out = self
            .child
            .and_then(|c| c.wait_with_output().ok())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let version = tessera_common::runc::parse_version(&out);
        judge(version, acknowledged)
    }
}

/// [`check`] for a known (or unknown) version.
pub fn judge(
    version: Option<(u64, u64, u64)>,
    acknowledged: &[String],
) -> Result<Option<String>, String> {
    let shown = version.map_or_else(
        || "of unknown version".to_string(),
        |(a, b, c)| format!("{a}.{b}.{c}"),
    );
    let unfixed = tessera_common::runc::unfixed(version);
    let missing: Vec<&str> = unfixed
        .iter()
        .copied()
        .filter(|c| !acknowledged.iter().any(|a| a == c))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "runc {shown} lacks the fixes for {} (runc 1.2.8, 1.3.3, 1.4.0): upgrade runc, or if this build carries backports name them in runtime.toml's runc_cve_acknowledged",
            missing.join(", ")
        ));
    }
    Ok((!unfixed.is_empty()).then(|| {
        format!(
            "tessera-runtime: WARNING: runc {shown} predates the fixes for {}; relying on runtime.toml's runc_cve_acknowledged",
            unfixed.join(", ")
        )
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_vulnerable_runc_is_refused_unless_each_cve_is_acknowledged() {
        let e = judge(Some((1, 1, 5)), &[]).unwrap_err();
        assert!(
            e.contains("CVE-2025-31133") && e.contains("runc_cve_acknowledged"),
            "{e}"
        );
        let some = vec!["CVE-2025-31133".to_string()];
        let e = judge(Some((1, 1, 5)), &some).unwrap_err();
        assert!(
            !e.contains("CVE-2025-31133,") && e.contains("CVE-2025-52565"),
            "{e}"
        );
        let all: Vec<String> = tessera_common::runc::MOUNT_RACE_CVES
            .iter()
            .map(|s| s.to_string())
            .collect();
        let w = judge(Some((1, 1, 5)), &all).unwrap().unwrap();
        assert!(w.contains("WARNING"), "{w}");
        assert_eq!(judge(Some((1, 2, 8)), &[]).unwrap(), None);
        assert!(judge(None, &[]).is_err(), "an unknown runc is not trusted");
    }
}
