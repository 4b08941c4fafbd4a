//! Stopping a container through its cgroup: freeze it, send SIGTERM to every
//! process, thaw, wait a grace period, then freeze again and SIGKILL whatever is
//! left (or `cgroup.kill` on cgroup v2). cgroup v1 and v2 both, through cgroups-rs.
//! Which cgroup may be touched is the caller's decision (the lease core checks it).

use std::time::{Duration, Instant};

use cgroups_rs::Cgroup;
use cgroups_rs::freezer::FreezerController;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::{HostError, Stopped};

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
) -> Result<usize, HostError> {
    let freezer = cg.controller_of::<FreezerController>();
    let freeze_err = |e: cgroups_rs::error::Error| HostError::Freeze {
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

/// Stop every process of one container's cgroup (`rel`, relative to the
/// hierarchy roots; blocking): freeze, SIGTERM, thaw, wait `grace`, then kill what
/// is left. Returns what it did.
pub fn stop_cgroup(container: &str, rel: &str, grace: Duration) -> Result<Stopped, HostError> {
    let cg = Cgroup::load(cgroups_rs::hierarchies::auto(), rel);
    let mut out = Stopped {
        container: container.to_string(),
        ..Default::default()
    };
    if !cg.exists() || cg.procs().is_empty() {
        return Ok(out);
    }
    out.terminated = signal_frozen(&cg, Signal::SIGTERM, container, rel)?;
    if wait_empty(&cg, grace) {
        return Ok(out);
    }
    // v2 on 5.14+ kills the whole tree atomically; otherwise freeze and SIGKILL.
    let killed_by_kernel = cg.v2() && cg.kill().is_ok();
    out.killed = if killed_by_kernel {
        cg.procs().len()
    } else {
        signal_frozen(&cg, Signal::SIGKILL, container, rel)?
    };
    if wait_empty(&cg, Duration::from_secs(5)) {
        Ok(out)
    } else {
        Err(HostError::StillRunning {
            container: container.to_string(),
            path: rel.to_string(),
            left: cg.procs().len(),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

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
        let r = stop_cgroup("c1", &rel, Duration::from_millis(500));
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
