//! `tessera audit`: read tesserad's audit log (JSON lines, with its rotated files),
//! filtered by tenant and time. Reads the files directly: it works with the daemon
//! stopped, and needs read access to the log (root or the log's group).

use std::path::{Path, PathBuf};

use clap::Args;

use crate::output::{self, Table};
use crate::parse;

/// Default log path: tesserad's state directory.
pub const DEFAULT_AUDIT_LOG: &str = "/var/lib/tessera/audit.jsonl";

#[derive(Debug, Args)]
pub struct AuditArgs {
    /// The audit log (rotated files NAME.1, NAME.2, ... are read too).
    #[arg(long, default_value = DEFAULT_AUDIT_LOG)]
    pub file: PathBuf,
    /// Only records about this tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// From: RFC 3339 time or a duration ago ("2h").
    #[arg(long, value_parser = parse::parse_time_ago)]
    pub since: Option<i64>,
    /// Until: RFC 3339 time or a duration ago.
    #[arg(long, value_parser = parse::parse_time_ago)]
    pub until: Option<i64>,
    /// Only refusals (anything but "ok" and "admitted").
    #[arg(long)]
    pub refusals: bool,
}

/// The files of a log, oldest first.
fn files(path: &Path) -> Vec<PathBuf> {
    let mut rotated = Vec::new();
    for n in 1..=64 {
        let mut s = path.to_path_buf().into_os_string();
        s.push(format!(".{n}"));
        let p = PathBuf::from(s);
        if !p.exists() {
            break;
        }
        rotated.push(p);
    }
    rotated.reverse();
    rotated.push(path.to_path_buf());
    rotated
}

/// Does a record pass the filters?
fn keep(rec: &serde_json::Value, a: &AuditArgs) -> bool {
    let at = rec["at_ms"].as_i64().unwrap_or(0);
    if a.since.is_some_and(|s| at < s) || a.until.is_some_and(|u| at > u) {
        return false;
    }
    if let Some(t) = &a.tenant
        && rec["tenant"].as_str() != Some(t.as_str())
    {
        return false;
    }
    if a.refusals && matches!(rec["result"].as_str(), Some("ok") | Some("admitted")) {
        return false;
    }
    true
}

pub fn run(a: &AuditArgs, json: bool) -> anyhow::Result<()> {
    let mut recs = Vec::new();
    let mut found = false;
    for f in files(&a.file) {
        let text = match std::fs::read_to_string(&f) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => anyhow::bail!("{}: {e}", f.display()),
        };
        found = true;
        for line in text.lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(line)
                && keep(&v, a)
            {
                recs.push(v);
            }
        }
    }
    if !found {
        anyhow::bail!(
            "{}: no audit log here (set --file to tesserad's [audit] path)",
            a.file.display()
        );
    }
    if json {
        let mut out = String::new();
        for r in &recs {
            out.push_str(&r.to_string());
            out.push('\n');
        }
        output::print(&out)?;
        return Ok(());
    }
    let mut t = Table::new(&[
        "TIME",
        "PRINCIPAL",
        "TENANT",
        "ACTION",
        "LEASE",
        "RESULT",
        "REASON",
    ]);
    for r in &recs {
        let s = |k: &str| r[k].as_str().unwrap_or("").to_string();
        let reasons: Vec<String> = r["reasons"]
            .as_array()
            .map(|v| {
                v.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        t.row(vec![
            output::abs_time(r["at_ms"].as_i64().unwrap_or(0)),
            principal(r),
            s("tenant"),
            s("action"),
            if s("container").is_empty() {
                s("lease")
            } else {
                format!("{} ({})", s("lease"), s("container"))
            },
            s("result"),
            reasons.join("; "),
        ]);
    }
    output::print(&t.render())?;
    Ok(())
}

/// The principal, and for a caller that showed an OIDC token the person it names
/// (username, else email, else subject): `team-a (ada)`.
fn principal(r: &serde_json::Value) -> String {
    let name = r["principal"].as_str().unwrap_or("");
    let oidc = &r["oidc"];
    ["preferred_username", "email", "subject"]
        .iter()
        .find_map(|k| oidc[k].as_str())
        .map_or_else(|| name.to_string(), |who| format!("{name} ({who})"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    #[test]
    fn a_token_caller_is_shown_with_the_person_it_names() {
        let r = serde_json::json!({"principal": "team-a", "oidc": {"issuer": "https://idp", "subject": "u-1", "email": "ada@example.com"}});
        assert_eq!(super::principal(&r), "team-a (ada@example.com)");
        let r = serde_json::json!({"principal": "team-a", "oidc": {"issuer": "https://idp", "subject": "u-1"}});
        assert_eq!(super::principal(&r), "team-a (u-1)");
        assert_eq!(
            super::principal(&serde_json::json!({"principal": "uid 0"})),
            "uid 0"
        );
    }

    use super::*;

    fn args() -> AuditArgs {
        AuditArgs {
            file: PathBuf::from("x"),
            tenant: None,
            since: None,
            until: None,
            refusals: false,
        }
    }

    #[test]
    fn filters_by_tenant_time_and_result() {
        let r: serde_json::Value = serde_json::json!({"at_ms": 100, "tenant": "a", "result": "ok"});
        let refused: serde_json::Value =
            serde_json::json!({"at_ms": 100, "tenant": "a", "result": "PermissionDenied"});
        assert!(keep(&r, &args()));
        assert!(!keep(
            &r,
            &AuditArgs {
                tenant: Some("b".into()),
                ..args()
            }
        ));
        assert!(!keep(
            &r,
            &AuditArgs {
                since: Some(101),
                ..args()
            }
        ));
        assert!(!keep(
            &r,
            &AuditArgs {
                until: Some(99),
                ..args()
            }
        ));
        assert!(!keep(
            &r,
            &AuditArgs {
                refusals: true,
                ..args()
            }
        ));
        assert!(keep(
            &refused,
            &AuditArgs {
                refusals: true,
                ..args()
            }
        ));
    }

    #[test]
    fn rotated_files_are_read_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.jsonl");
        for (name, at) in [
            ("audit.jsonl.2", 1),
            ("audit.jsonl.1", 2),
            ("audit.jsonl", 3),
        ] {
            std::fs::write(dir.path().join(name), format!("{{\"at_ms\":{at}}}\n")).unwrap();
        }
        let f = files(&p);
        assert_eq!(
            f.iter()
                .map(|p| p.file_name().unwrap().to_str().unwrap())
                .collect::<Vec<_>>(),
            vec!["audit.jsonl.2", "audit.jsonl.1", "audit.jsonl"]
        );
    }
}
