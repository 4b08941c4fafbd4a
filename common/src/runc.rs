//! Which runc releases carry which security fixes, so that the runtime and `tessera
//! doctor` judge a runc the same way.

/// The 2025 mount and /dev/console race CVEs, fixed in runc 1.2.8, 1.3.3 and 1.4.0.
pub const MOUNT_RACE_CVES: &[&str] = &["CVE-2025-31133", "CVE-2025-52565", "CVE-2025-52881"];

/// The oldest release of each line that carries [`MOUNT_RACE_CVES`]' fixes.
pub const MOUNT_RACE_FIXED: &[(u64, u64, u64)] = &[(1, 2, 8), (1, 3, 3), (1, 4, 0)];

/// (major, minor, patch) from `runc --version` output ("runc version 1.1.5+ds1").
pub fn parse_version(out: &str) -> Option<(u64, u64, u64)> {
    let line = out.lines().find(|l| l.starts_with("runc version"))?;
    let v = line.split_whitespace().nth(2)?;
    let core: String = v
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let mut it = core.split('.').map(|p| p.parse::<u64>());
    let (Some(Ok(a)), Some(Ok(b))) = (it.next(), it.next()) else {
        return None;
    };
    let c = match it.next() {
        Some(Ok(c)) => c,
        _ => 0,
    };
    Some((a, b, c))
}

/// The CVEs a runc of version `v` lacks the fixes for (all of them when the version
/// is unknown). Distribution builds may carry backports the version does not show:
/// an operator acknowledges those explicitly.
pub fn unfixed(v: Option<(u64, u64, u64)>) -> Vec<&'static str> {
    let fixed = v.is_some_and(|v| {
        MOUNT_RACE_FIXED
            .iter()
            .any(|&(a, b, c)| (v.0, v.1) == (a, b) && v.2 >= c)
            || (v.0, v.1) > (1, 4)
    });
    if fixed {
        Vec::new()
    } else {
        MOUNT_RACE_CVES.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_against_the_2025_fixes() {
        assert_eq!(
            parse_version("runc version 1.1.5+ds1\ncommit: x\n"),
            Some((1, 1, 5))
        );
        assert_eq!(unfixed(Some((1, 1, 5))).len(), 3, "Debian bookworm's runc");
        assert_eq!(unfixed(Some((1, 2, 7))).len(), 3);
        assert!(unfixed(Some((1, 2, 8))).is_empty());
        assert_eq!(unfixed(Some((1, 3, 2))).len(), 3);
        assert!(unfixed(Some((1, 3, 3))).is_empty());
        assert!(unfixed(Some((1, 4, 0))).is_empty());
        assert!(unfixed(Some((1, 5, 0))).is_empty());
        assert_eq!(unfixed(None).len(), 3, "an unknown version is not trusted");
        assert_eq!(parse_version("crun version 1.8"), None);
    }
}
