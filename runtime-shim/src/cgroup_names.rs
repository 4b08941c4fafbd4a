//! cgroup paths as the components of the directory they name, for cgroupfs
//! (`/a/b/c`) and for systemd (`slice:prefix:name`, `a-b.slice`): pure text, checked to
//! be clean (nothing that would climb out of the hierarchy).

use thiserror::Error;

/// Why a cgroup path or slice name is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CgroupNameError {
    #[error("{0:?} is not absolute")]
    NotAbsolute(String),
    #[error("{0:?} is the root cgroup")]
    RootCgroup(String),
    #[error("{0:?} has an empty, '.' or '..' component (it is not a clean path)")]
    NotClean(String),
    #[error("{0:?} is not a slice")]
    NotSlice(String),
    #[error("{0:?} is the root slice")]
    RootSlice(String),
    #[error("{0:?} is not a plain slice name")]
    NotPlainSlice(String),
    #[error("{0:?} is not slice:prefix:name")]
    NotSystemd(String),
    #[error("{0:?}: the prefix and name must be plain and name a scope")]
    NotScope(String),
}

type Components = Result<Vec<String>, CgroupNameError>;

/// A cgroupfs `cgroupsPath` as components: absolute, no empty, `.` or `..` component.
pub fn cgroupfs_components(path: &str) -> Components {
    let rest = path
        .strip_prefix('/')
        .ok_or_else(|| CgroupNameError::NotAbsolute(path.to_string()))?;
    if rest.is_empty() {
        return Err(CgroupNameError::RootCgroup(path.to_string()));
    }
    rest.split('/')
        .map(|c| {
            if c.is_empty() || c == "." || c == ".." || c.contains('\0') {
                Err(CgroupNameError::NotClean(path.to_string()))
            } else {
                Ok(c.to_string())
            }
        })
        .collect()
}

/// A systemd slice name as the cgroups systemd nests it in: `a-b-c.slice` lives at
/// `a.slice/a-b.slice/a-b-c.slice`.
pub fn expand_slice(slice: &str) -> Components {
    let name = slice
        .strip_suffix(".slice")
        .ok_or_else(|| CgroupNameError::NotSlice(slice.to_string()))?;
    if name == "-" {
        return Err(CgroupNameError::RootSlice(slice.to_string()));
    }
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !valid || name.split('-').any(str::is_empty) {
        return Err(CgroupNameError::NotPlainSlice(slice.to_string()));
    }
    let mut out = Vec::new();
    let mut prefix = String::new();
    for part in name.split('-') {
        if !prefix.is_empty() {
            prefix.push('-');
        }
        prefix.push_str(part);
        out.push(format!("{prefix}.slice"));
    }
    Ok(out)
}

/// A systemd `cgroupsPath` (`slice:prefix:name`) as the components of the scope
/// systemd makes for it (`<expanded slice>/<prefix>-<name>.scope`).
pub fn systemd_components(path: &str) -> Components {
    let parts: Vec<&str> = path.split(':').collect();
    let [slice, prefix, name] = parts.as_slice() else {
        return Err(CgroupNameError::NotSystemd(path.to_string()));
    };
    let plain = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    };
    if !plain(prefix) || !plain(name) || name.ends_with(".slice") {
        return Err(CgroupNameError::NotScope(path.to_string()));
    }
    let mut c = expand_slice(slice)?;
    c.push(format!("{prefix}-{name}.scope"));
    Ok(c)
}

/// A `cgroupsPath` as components, in the driver's form.
pub fn cgroup_components(path: &str, systemd: bool) -> Components {
    if systemd {
        systemd_components(path)
    } else {
        cgroupfs_components(path)
    }
}

/// An operator-configured cgroup parent (`/a/b` or `a-b.slice`) as components.
pub fn parent_components(parent: &str) -> Components {
    if parent.ends_with(".slice") && !parent.contains('/') {
        expand_slice(parent)
    } else {
        cgroupfs_components(parent)
    }
}
