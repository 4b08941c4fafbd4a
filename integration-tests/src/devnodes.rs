//! GPU device nodes made on the "host" as the NVIDIA driver would make them, for tests
//! that run real containers on simulated GPUs.

use std::path::Path;

use anyhow::{Context, bail};
use tessera_proto::v1 as pb;

/// Makes the character device `path` (major, minor; mode 0666) below `dev_root`, with
/// its parent folders, unless it exists already.
pub fn mknod(path: &Path, dev_root: &Path, major: u64, minor: u64) -> anyhow::Result<()> {
    if !path.starts_with(dev_root) {
        bail!(
            "{} is outside the dev root {}",
            path.display(),
            dev_root.display()
        );
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| parent.display().to_string())?;
    }
    if path.exists() {
        return Ok(());
    }
    nix::sys::stat::mknod(
        path,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(major, minor),
    )
    .with_context(|| format!("mknod {}", path.display()))
}

/// Every node a resolved lease names (all below `dev_root`).
pub fn lease_nodes(resolved: &pb::ResolveTokenResponse, dev_root: &Path) -> anyhow::Result<()> {
    for d in &resolved.devices {
        mknod(
            Path::new(&d.host_path),
            dev_root,
            u64::try_from(d.major).context("negative major number")?,
            u64::try_from(d.minor).context("negative minor number")?,
        )?;
    }
    Ok(())
}
