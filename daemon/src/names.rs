//! Names and ids: the vocabulary every layer shares. Record ids, tenant and
//! priority-class names, and how a long name is shortened in a message.
//!
//! Owns: the rules for what a name may be. May not touch: anything else of the
//! daemon (this module imports nothing from the crate).

use tessera_common::clock::now_ms;

/// A name that breaks its rule, with the field it was given in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {message}")]
pub struct InvalidName {
    pub field: &'static str,
    pub message: String,
}

/// A new record id: the prefix, the creation time (ms, 12 hex digits) and 64 random
/// bits. Ids sort by creation, so the rows and index entries a batch of commits adds
/// land in the same few B-tree pages instead of one random page each (fewer pages
/// written per durable commit), and listings by id read oldest first.
pub fn new_id(prefix: &str) -> String {
    let ms = now_ms().max(0) as u64 & 0xffff_ffff_ffff;
    format!("{prefix}{ms:012x}{:016x}", rand::random::<u64>())
}

/// Names of tenants and priority classes: 1..=63 of [a-z0-9._-], starting with
/// [a-z0-9] (fits a Kubernetes namespace, which the runtime may bind tenants to).
pub fn validate_name(field: &'static str, name: &str) -> Result<(), InvalidName> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok {
        return Ok(());
    }
    Err(InvalidName {
        field,
        message: format!(
            "{:?} must be 1-63 characters of a-z, 0-9, '.', '_' or '-', starting with a letter or digit",
            truncate(name, 80)
        ),
    })
}

/// A tenant name (see [`validate_name`]).
pub fn validate_tenant(tenant: &str) -> Result<(), InvalidName> {
    validate_name("tenant", tenant)
}

/// `s` cut to at most `n` bytes (on a character boundary), with "…" when cut: user
/// input quoted in a message stays short.
pub fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Lease labels the kubelet device plugin sets: the class of the device a lease stands
/// for, and the pod (namespace and name) that holds it.
pub const LABEL_K8S_CLASS: &str = "tessera.io/k8s-class";
pub const LABEL_K8S_NAMESPACE: &str = "tessera.io/k8s-namespace";
pub const LABEL_K8S_POD: &str = "tessera.io/k8s-pod";

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_sort_by_creation() {
        let a = new_id("l-");
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = new_id("l-");
        assert!(a.starts_with("l-") && a.len() == 2 + 12 + 16, "{a}");
        assert!(a < b, "{a} then {b}");
        let many: std::collections::HashSet<String> = (0..1000).map(|_| new_id("p-")).collect();
        assert_eq!(many.len(), 1000);
    }

    #[test]
    fn names_follow_the_kubernetes_namespace_shape() {
        for ok in ["team-a", "a", "0x.y_z", &"a".repeat(63)] {
            assert!(validate_tenant(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", "Team", "a b", &"a".repeat(64), "ä"] {
            let e = validate_tenant(bad).unwrap_err();
            assert_eq!(e.field, "tenant");
        }
        let e = validate_name("priority_class", "X").unwrap_err();
        assert!(
            e.to_string().starts_with("invalid priority_class: \"X\""),
            "{e}"
        );
    }

    #[test]
    fn truncation_keeps_characters_whole() {
        assert_eq!(truncate("short", 80), "short");
        assert_eq!(truncate("ééé", 3), "é…");
    }
}
