//! What the CLI says about itself: shell completion scripts and man pages, both
//! generated from the same clap definition as the commands (so they cannot drift).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap_complete::Shell;

/// Write the completion script for `shell` to `out`.
pub fn completion(mut cmd: clap::Command, shell: Shell, out: &mut dyn Write) {
    let name = cmd.get_name().to_string();
    clap_complete::generate(shell, &mut cmd, name, out);
}

/// Write `tessera.1` and one page per subcommand (`tessera-lease-create.1`, ...)
/// into `dir`, creating it; returns the files written, sorted.
pub fn manpages(cmd: clap::Command, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    clap_mangen::generate_to(cmd, dir)
        .with_context(|| format!("writing man pages into {}", dir.display()))?;
    let mut written: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "1"))
        .collect();
    written.sort();
    Ok(written)
}
