//! Capabilities: refuse forbidden ones by name, reduce every set to the allowlist.

use super::base::{Findings, strings};
use crate::policy::{Policy, cap_name};
use serde_json::{Value, json};

/// The five OCI capability sets.
pub const SETS: &[&str] = &[
    "bounding",
    "effective",
    "inheritable",
    "permitted",
    "ambient",
];

/// Refuse forbidden capabilities in a `capabilities` object (naming each), and return
/// the reduced object. `ceiling` further limits what may be kept (for exec: the
/// container's own sets, by name): each set is kept within the container's set of the
/// same name. Asking for a capability outside its bounding set is refused; one in it but
/// outside the container's effective, permitted, inheritable or ambient set is dropped
/// from that set (engines send the container's original sets, which the create
/// reduced).
pub fn reduce(
    caps: Option<&Value>,
    policy: &Policy,
    ceiling: Option<&std::collections::BTreeMap<String, Vec<String>>>,
    what: &str,
    f: &mut Findings,
) -> Value {
    let allowed: Vec<String> = policy
        .allowed_capabilities
        .iter()
        .map(|c| cap_name(c))
        .collect();
    let forbidden: Vec<String> = policy
        .forbidden_capabilities
        .iter()
        .map(|c| cap_name(c))
        .collect();
    let mut out = serde_json::Map::new();
    for set in SETS {
        let asked: Vec<String> = caps
            .and_then(|c| c.get(*set))
            .and_then(strings)
            .unwrap_or_default()
            .iter()
            .map(|c| cap_name(c))
            .collect();
        let mut kept: Vec<String> = Vec::new();
        for c in asked {
            if forbidden.contains(&c) {
                f.refuse(format!("{what} asks for the forbidden capability {c}"));
                continue;
            }
            // Outside the policy: dropped, as at create (containerd's exec process carries
            // the container's original, unreduced sets).
            if !allowed.contains(&c) {
                f.note(format!("{what}: capability {c} dropped from the {set} set"));
                continue;
            }
            let has = |name: &str| {
                ceiling.is_none_or(|m| m.get(name).is_some_and(|own| own.contains(&c)))
            };
            if !has(set) {
                if !has("bounding") {
                    f.refuse(format!(
                        "{what} asks for capability {c}, which the container does not have"
                    ));
                } else {
                    f.note(format!(
                        "{what}: capability {c} dropped from the {set} set: not in the container's own {set} set"
                    ));
                }
                continue;
            }
            if !kept.contains(&c) {
                kept.push(c);
            }
        }
        out.insert((*set).to_string(), json!(kept));
    }
    // Ambient must be within permitted and inheritable, or the kernel refuses.
    let permitted = out.get("permitted").and_then(strings).unwrap_or_default();
    let inheritable = out.get("inheritable").and_then(strings).unwrap_or_default();
    if let Some(amb) = out.get("ambient").and_then(strings) {
        let amb: Vec<String> = amb
            .into_iter()
            .filter(|c| permitted.contains(c) && inheritable.contains(c))
            .collect();
        out.insert("ambient".to_string(), json!(amb));
    }
    Value::Object(out)
}

/// Reduce `process.capabilities` of a container spec.
pub fn apply(spec: &mut Value, policy: &Policy, f: &mut Findings) {
    let reduced = reduce(
        spec.pointer("/process/capabilities"),
        policy,
        None,
        "the spec",
        f,
    );
    if let Some(p) = spec.get_mut("process").and_then(Value::as_object_mut) {
        p.insert("capabilities".to_string(), reduced);
    }
}
