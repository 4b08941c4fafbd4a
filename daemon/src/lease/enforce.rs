//! Which cgroup a lease's container may be stopped through: only cgroups under the
//! lease's own parent (`tessera/<lease id>/...`, where the runtime puts them). A
//! binding naming any other path is refused; the stopping itself is the host's
//! ([`crate::host::HostOps::stop_cgroup`]).

use std::time::Duration;

use crate::host::{HostError, HostOps, Stopped};
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
    #[error(transparent)]
    Host(#[from] HostError),
}

/// Stop one container of `lease_id` through its cgroup, which must lie under the
/// lease's parent (blocking).
pub fn stop_container(
    host: &dyn HostOps,
    lease_id: &str,
    b: &ContainerBinding,
    grace: Duration,
) -> Result<Stopped, EnforceError> {
    let rel = cgroup_of(lease_id, b)?;
    Ok(host.stop_cgroup(&b.id, &rel, grace)?)
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
}
