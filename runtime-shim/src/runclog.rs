//! Messages in runc's `--log` file, in the format asked (`--log-format json|text`), so that
//! containerd shows tessera's refusals like runc's own errors.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

/// runc's log sink.
#[derive(Debug, Clone, Default)]
pub struct RuncLog {
    pub path: Option<PathBuf>,
    pub json: bool,
}

/// RFC 3339 UTC time with seconds ("2024-01-01T00:00:00Z").
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

impl RuncLog {
    /// The sink from runc's global flags.
    pub fn new(path: Option<&str>, format: Option<&str>) -> Self {
        Self {
            path: path.filter(|p| !p.is_empty()).map(PathBuf::from),
            json: format == Some("json"),
        }
    }

    /// One log line in the chosen format.
    pub fn line(&self, level: &str, msg: &str, now: SystemTime) -> String {
        let time = rfc3339(now);
        if self.json {
            serde_json::json!({"level": level, "msg": msg, "time": time}).to_string()
        } else {
            format!(
                "time={:?} level={level} msg={}",
                time,
                serde_json::Value::String(msg.to_string())
            )
        }
    }

    /// Append a line; failures to log are reported on stderr only.
    pub fn write(&self, level: &str, msg: &str) {
        let Some(path) = &self.path else { return };
        let line = self.line(level, msg, SystemTime::now());
        let r = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = r {
            eprintln!("tessera-runtime: writing log {}: {e}", path.display());
        }
    }

    pub fn error(&self, msg: &str) {
        self.write("error", msg);
    }
    pub fn warn(&self, msg: &str) {
        self.write("warning", msg);
    }
    pub fn info(&self, msg: &str) {
        self.write("info", msg);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn time_format() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(1_704_067_200)),
            "2024-01-01T00:00:00Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(1_709_210_096)),
            "2024-02-29T12:34:56Z"
        );
    }

    #[test]
    fn json_and_text_lines_like_runc() {
        let t = UNIX_EPOCH + Duration::from_secs(1_704_067_200);
        let j = RuncLog::new(Some("/x"), Some("json")).line("error", "no \"lease\"", t);
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(v["level"], "error");
        assert_eq!(v["msg"], "no \"lease\"");
        assert_eq!(v["time"], "2024-01-01T00:00:00Z");
        let l = RuncLog::new(Some("/x"), None).line("error", "refused", t);
        assert_eq!(
            l,
            "time=\"2024-01-01T00:00:00Z\" level=error msg=\"refused\""
        );
    }

    #[test]
    fn appends_to_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("log.json");
        let log = RuncLog::new(Some(p.to_str().unwrap()), Some("json"));
        log.error("one");
        log.warn("two");
        let text = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["level"], "warning");
    }
}
