//! Checks of a create request that need no state: names, labels, request id, TTL.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::names::{truncate, validate_tenant};
use crate::partition::Shape;

use super::error::LeaseError;
use super::error::invalid;
use super::plan::CreateRequest;

/// Most bytes a lease's labels may take in all (keys and values). Every event of a
/// lease carries a copy of them, and the event buffer holds 4096 events.
pub(super) const MAX_LABEL_BYTES: usize = 16 * 1024;

pub(super) fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), LeaseError> {
    if labels.len() > 64 {
        return Err(invalid(
            "labels",
            format!("{} labels; at most 64", labels.len()),
        ));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= 253
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b));
        if !key_ok {
            return Err(invalid(
                "labels",
                format!(
                    "key {:?} must be 1-253 characters of A-Z, a-z, 0-9, '.', '_', '/', '-'",
                    truncate(k, 80)
                ),
            ));
        }
        if v.len() > 1024 || v.chars().any(char::is_control) {
            return Err(invalid(
                "labels",
                format!("value of {k:?} must be at most 1024 printable characters"),
            ));
        }
    }
    let total: usize = labels.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total > MAX_LABEL_BYTES {
        return Err(invalid(
            "labels",
            format!("{total} bytes of keys and values; at most {MAX_LABEL_BYTES} in all"),
        ));
    }
    Ok(())
}

/// Priority classes are names like tenants (1-63 of [a-z0-9._-]); the daemon keeps
/// one per lease and copies it into every event, so it must be short.
pub(super) fn validate_priority_class(class: &str) -> Result<(), LeaseError> {
    validate_tenant(class).map_err(|_| {
        invalid(
            "priority_class",
            format!(
                "{:?} must be 1-63 characters of a-z, 0-9, '.', '_' or '-', starting with a letter or digit",
                truncate(class, 80)
            ),
        )
    })
}

pub(super) fn validate_request_id(rid: &str) -> Result<(), LeaseError> {
    if rid.len() > 128 || rid.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(invalid(
            "request_id",
            "must be at most 128 characters without spaces or control characters",
        ));
    }
    Ok(())
}

/// Checks a create request without touching any state: tenant, shape present,
/// request id, labels, priority class and TTL (against `limits`; None = the default
/// TTL). Returns the shape and the TTL to use. Every refusal is
/// [`LeaseError::InvalidArgument`] naming its field. Whether the shape itself is
/// possible is the planner's question ([`partition::plan`]).
pub fn validate_create(
    req: &CreateRequest,
    limits: &crate::config::LeaseConfig,
) -> Result<(Shape, Duration), LeaseError> {
    validate_tenant(&req.tenant)?;
    let shape = req
        .shape
        .clone()
        .ok_or_else(|| invalid("shape", "one of mig, mps or whole_gpu is required"))?;
    if let Some(rid) = &req.request_id {
        validate_request_id(rid)?;
    }
    validate_labels(&req.labels)?;
    validate_count(req, &shape)?;
    if let Some(class) = &req.priority_class {
        validate_priority_class(class)?;
    }
    let ttl = req.ttl.unwrap_or(limits.default_ttl);
    validate_ttl(ttl, limits)?;
    Ok((shape, ttl))
}

/// A lease of several partitions: N whole GPUs or N MIG instances (1..=64), placed
/// by topology (never pinned); a topology constraint only with several.
fn validate_count(req: &CreateRequest, shape: &Shape) -> Result<(), LeaseError> {
    use crate::partition::topology::TopologyConstraint;
    if req.count <= 1 {
        if req.topology != TopologyConstraint::Any {
            return Err(invalid(
                "topology",
                "a topology constraint is for a lease of several partitions (a count above 1)",
            ));
        }
        return Ok(());
    }
    if req.count > 64 {
        return Err(invalid(
            "shape.count",
            format!("at most 64 partitions in one lease, got {}", req.count),
        ));
    }
    if !matches!(shape, Shape::Mig { .. } | Shape::WholeGpu) {
        return Err(invalid(
            "shape.count",
            "only MIG instances and whole GPUs come several to a lease",
        ));
    }
    if req.gpu_index.is_some() {
        return Err(invalid(
            "gpu_index",
            "a lease of several partitions is placed by topology and cannot be pinned to one GPU",
        ));
    }
    Ok(())
}

/// A lease's TTL (a new lease's, a renewal's) within the configured range.
pub(super) fn validate_ttl(
    ttl: std::time::Duration,
    limits: &crate::config::LeaseConfig,
) -> Result<(), LeaseError> {
    if ttl < limits.min_ttl || ttl > limits.max_ttl {
        return Err(invalid(
            "ttl_seconds",
            format!(
                "{}s is outside the allowed {}s..={}s",
                ttl.as_secs(),
                limits.min_ttl.as_secs(),
                limits.max_ttl.as_secs()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_bounded_in_count_size_and_total() {
        let mk = |n: usize, vlen: usize| -> BTreeMap<String, String> {
            (0..n)
                .map(|i| (format!("k{i}"), "v".repeat(vlen)))
                .collect()
        };
        assert!(validate_labels(&mk(64, 200)).is_ok(), "64 x ~200 B fits");
        assert!(validate_labels(&mk(65, 1)).is_err(), "65 labels");
        assert!(validate_labels(&mk(1, 1025)).is_err(), "a value over 1 KiB");
        // 64 values of 1 KiB each are each allowed but 64 KiB in all is not.
        let err = validate_labels(&mk(64, 1024)).unwrap_err();
        assert!(err.to_string().contains("at most 16384 in all"), "{err}");
    }
}
