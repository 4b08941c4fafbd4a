//! AppArmor: set the tenant profile when the host has the AppArmor LSM; without it the
//! policy decides (`required` refuses, `if-available` goes on and says so).

use super::base::{Context, Findings};
use crate::policy::AppArmorMode;
use serde_json::{Value, json};

/// The shipped profile text (configs/apparmor/tessera-tenant).
pub const PROFILE_TEXT: &str = include_str!("../../../configs/apparmor/tessera-tenant");

pub use crate::host::AppArmorHost;

/// The decision for one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Set this profile.
    Set(String),
    /// Go on without AppArmor (note for the log).
    Skip(String),
    /// Refuse.
    Refuse(String),
}

/// Decide what to do given the policy and the host.
pub fn decide(mode: AppArmorMode, profile: &str, host: &AppArmorHost) -> Decision {
    if !host.enabled {
        return match mode {
            AppArmorMode::Required => Decision::Refuse(
                "the policy requires AppArmor and this host has no AppArmor LSM".to_string(),
            ),
            AppArmorMode::IfAvailable => Decision::Skip(format!(
                "the host has no AppArmor LSM: running without the {profile} profile (policy: if-available)"
            )),
        };
    }
    match &host.loaded {
        Some(loaded) if !loaded.iter().any(|p| p == profile) => Decision::Refuse(format!(
            "the AppArmor profile {profile} is not loaded (apparmor_parser -r configs/apparmor/tessera-tenant)"
        )),
        _ => Decision::Set(profile.to_string()),
    }
}

pub fn apply(spec: &mut Value, ctx: &Context, f: &mut Findings) {
    let policy = ctx.policy();
    let asked = spec
        .pointer("/process/apparmorProfile")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string);
    if let Some(a) = &asked
        && a != &policy.apparmor_profile
    {
        f.note(format!(
            "the spec's AppArmor profile {a} is replaced by {}",
            policy.apparmor_profile
        ));
    }
    let Some(process) = spec.get_mut("process").and_then(Value::as_object_mut) else {
        return;
    };
    match decide(
        policy.apparmor,
        &policy.apparmor_profile,
        ctx.host.apparmor(),
    ) {
        Decision::Set(p) => {
            process.insert("apparmorProfile".to_string(), json!(p));
        }
        Decision::Skip(note) => {
            process.remove("apparmorProfile");
            f.note(note);
        }
        Decision::Refuse(r) => f.refuse(r),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn decision_table() {
        let none = AppArmorHost::default();
        assert!(
            matches!(decide(AppArmorMode::Required, "p", &none), Decision::Refuse(r) if r.contains("no AppArmor"))
        );
        assert!(
            matches!(decide(AppArmorMode::IfAvailable, "p", &none), Decision::Skip(n) if n.contains("if-available"))
        );
        let on = AppArmorHost {
            enabled: true,
            loaded: Some(vec!["p".into(), "docker-default".into()]),
        };
        assert_eq!(
            decide(AppArmorMode::Required, "p", &on),
            Decision::Set("p".into())
        );
        assert_eq!(
            decide(AppArmorMode::IfAvailable, "p", &on),
            Decision::Set("p".into())
        );
        let missing = AppArmorHost {
            enabled: true,
            loaded: Some(vec!["docker-default".into()]),
        };
        assert!(
            matches!(decide(AppArmorMode::IfAvailable, "p", &missing), Decision::Refuse(r) if r.contains("not loaded"))
        );
        let unreadable = AppArmorHost {
            enabled: true,
            loaded: None,
        };
        assert_eq!(
            decide(AppArmorMode::Required, "p", &unreadable),
            Decision::Set("p".into())
        );
    }

    #[test]
    fn shipped_profile_denies_what_matters() {
        let t = PROFILE_TEXT;
        assert!(t.contains("profile tessera-tenant"));
        for rule in [
            "deny mount,",
            "deny umount,",
            "deny pivot_root,",
            "deny ptrace (trace)",
            "deny @{PROC}/sysrq-trigger",
            "deny @{PROC}/kcore",
            "deny /sys/firmware/**",
            "deny /sys/kernel/security/**",
            "deny @{PROC}/driver/nvidia/capabilities/mig/config",
            "deny @{PROC}/driver/nvidia/capabilities/mig/monitor",
            "deny capability sys_admin,",
            "deny capability sys_module,",
        ] {
            assert!(t.contains(rule), "profile lacks {rule:?}");
        }
        // Balanced braces: a syntax slip would make apparmor_parser refuse the file.
        assert_eq!(t.matches('{').count(), t.matches('}').count());
    }
}
