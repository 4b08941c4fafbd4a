//! Stopping the containers of a lease that is revoked (released, expired or
//! preempted): freeze the container's cgroup, send SIGTERM to every process in it,
//! thaw, wait a grace period, then freeze again and SIGKILL whatever is left.
//! cgroup v1 and v2 both, through cgroups-rs.
//!
//! Only cgroups under the lease's own parent (`tessera/<lease id>/...`, where the
//! runtime puts them) are ever touched: a binding naming any other path is refused.

use std::time::{Duration, Instant};

use cgroups_rs::Cgroup;
use cgroups_rs::freezer::FreezerController;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::model::ContainerBinding;

#[derive(Debug, thiserror::Error)]
pub enum EnforceError {
    #[error(
        "container {container}: cgroup path {path:?} is not under this lease's parent {parent:?}; refusing to touch it"
    )]
    ForeignCgroup {
        container: String,
        path: String,
        parent: String,
    },
    #[error("container {container}: freezing {path}: {detail}")]
    Freeze {
        container: String,
        path: String,
        detail: String,
    },
    #[error("container {container}: {left} processes still in {path} after SIGKILL")]
    StillRunning {
        container: String,
        path: String,
        left: usize,
    },
}

/// What stopping one container took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stopped {
    pub container: String,
    /// Processes that got SIGTERM.
    pub terminated: usize,
    /// Processes still there after the grace period, which got SIGKILL.
    pub killed: usize,
}

/// The cgroup parent the runtime uses for a lease's containers.
pub fn lease_parent(lease_id: &str) -> String {
    format!("tessera/{lease_id}")
}

/// The cgroup of a binding, relative to the hierarchy roots, checked to lie under
/// the lease's parent.
pub fn cgroup_of(lease_id: &str, b: &ContainerBinding) -> Result<String, EnforceError> {
    let parent = lease_parent(lease_id);
    let rel = b.cgroup_path.trim_start_matches('/');
    let clean = !rel.is_empty()
        && !rel.contains(':')
        && !rel.contains('\0')
        && rel
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if !clean || !rel.starts_with(&format!("{parent}/")) {
        return Err(EnforceError::ForeignCgroup {
            container: b.id.clone(),
            path: b.cgroup_path.clone(),
            parent,
        });
    }
    Ok(rel.to_string())
}

fn signal_all(cg: &Cgroup, sig: Signal) -> usize {
    let mut n = 0;
    for p in cg.procs() {
        let Ok(raw) = i32::try_from(p.pid) else {
            continue;
        };
        if raw > 1 && kill(Pid::from_raw(raw), sig).is_ok() {
            n += 1;
        }
    }
    n
}

fn wait_empty(cg: &Cgroup, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if !cg.exists() || cg.procs().is_empty() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Freeze, signal, thaw: a frozen cgroup cannot fork away from the signal.
fn signal_frozen(
    cg: &Cgroup,
    sig: Signal,
    container: &str,
    path: &str,
) -> Result<usize, EnforceError> {
    let freezer = cg.controller_of::<FreezerController>();
    let freeze_err = |e: cgroups_rs::error::Error| EnforceError::Freeze {
        container: container.to_string(),
        path: path.to_string(),
        detail: e.to_string(),
    };
    if let Some(f) = freezer {
        f.freeze().map_err(freeze_err)?;
    }
    let n = signal_all(cg, sig);
    if let Some(f) = freezer {
        f.thaw().map_err(freeze_err)?;
    }
    Ok(n)
}

/// Stop every process of one container (blocking). Returns what it did.
pub fn stop_container(
    lease_id: &str,
    b: &ContainerBinding,
    grace: Duration,
) -> Result<Stopped, EnforceError> {
    let rel = cgroup_of(lease_id, b)?;
    let cg = Cgroup::load(cgroups_rs::hierarchies::auto(), &rel);
    let mut out = Stopped {
        container: b.id.clone(),
        ..Default::default()
    };
    if !cg.exists() || cg.procs().is_empty() {
        return Ok(out);
    }
    out.terminated = signal_frozen(&cg, Signal::SIGTERM, &b.id, &rel)?;
    if wait_empty(&cg, grace) {
        return Ok(out);
    }
    // v2 on 5.14+ kills the whole tree atomically; otherwise freeze and SIGKILL.
    let killed_by_kernel = cg.v2() && cg.kill().is_ok();
    out.killed = if killed_by_kernel {
        cg.procs().len()
    } else {
        signal_frozen(&cg, Signal::SIGKILL, &b.id, &rel)?
    };
    if wait_empty(&cg, Duration::from_secs(5)) {
        Ok(out)
    } else {
        Err(EnforceError::StillRunning {
            container: b.id.clone(),
            path: rel,
            left: cg.procs().len(),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn binding(path: &str) -> ContainerBinding {
        ContainerBinding {
            id: "c1".into(),
            cgroup_path: path.into(),
            runtime_root: String::new(),
            bound_at_ms: 0,
        }
    }

    #[test]
    fn only_cgroups_under_the_lease_parent_are_accepted() {
        assert_eq!(
            cgroup_of("l-1", &binding("/tessera/l-1/c1")).unwrap(),
            "tessera/l-1/c1"
        );
        for bad in [
            "",
            "/",
            "/tessera/l-2/c1",
            "/tessera/l-1/../../system.slice",
            "/tessera/l-1",
            "system.slice:tessera:c1",
            "/tessera/l-1//c1",
        ] {
            assert!(cgroup_of("l-1", &binding(bad)).is_err(), "{bad:?} accepted");
        }
    }

    /// Real cgroups: needs root and a writable cgroup hierarchy.
    #[test]
    fn a_container_cgroup_is_terminated_then_killed() {
        if !nix::unistd::geteuid().is_root() {
            // Written past the test harness's capture, so CI logs show the skip.
            let _ = std::io::Write::write_fmt(
                &mut std::io::stderr(),
                format_args!("SKIPPED: needs root to create cgroups\n"),
            );
            return;
        }
        let lease = format!("l-enforce-{}", std::process::id());
        let rel = format!("tessera/{lease}/c1");
        let cg = match cgroups_rs::cgroup_builder::CgroupBuilder::new(&rel)
            .build(cgroups_rs::hierarchies::auto())
        {
            Ok(cg) => cg,
            Err(e) => {
                // Written past the test harness's capture, so CI logs show the skip.
                let _ = std::io::Write::write_fmt(
                    &mut std::io::stderr(),
                    format_args!("SKIPPED: cannot create a cgroup here: {e}\n"),
                );
                return;
            }
        };
        // One process that stops on SIGTERM, one that ignores it.
        let mut polite = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        let mut stubborn = std::process::Command::new("sh")
            .args(["-c", "trap '' TERM; while :; do sleep 1; done"])
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        for c in [&polite, &stubborn] {
            cg.add_task_by_tgid(cgroups_rs::CgroupPid::from(u64::from(c.id())))
                .unwrap();
        }
        assert!(cg.procs().len() >= 2);
        let r = stop_container(
            &lease,
            &binding(&format!("/{rel}")),
            Duration::from_millis(500),
        );
        let _ = polite.wait();
        let _ = stubborn.wait();
        let r = r.unwrap();
        assert!(r.terminated >= 2, "{r:?}");
        assert!(
            r.killed >= 1,
            "the TERM-ignoring shell needed SIGKILL: {r:?}"
        );
        assert!(cg.procs().is_empty());
        let _ = cg.delete();
        let _ = Cgroup::load(cgroups_rs::hierarchies::auto(), format!("tessera/{lease}")).delete();
    }
}
