//! nvidia-caps minors: the formula, and the `/proc/driver/nvidia-caps/mig-minors` text.
//!
//! The driver lists one line per capability, `<name> <minor>`:
//!
//! ```text
//! config 1
//! monitor 2
//! gpu0/gi0/access 3
//! gpu0/gi0/ci0/access 4
//! ```
//!
//! and the published values fit minor = 3 + gpu*135 + gi*9 (+ 1 + ci for a CI).

use super::types::MigMinors;

/// Minor of `config` (grants create/destroy of all instances: never for tenants).
pub const CONFIG_MINOR: u32 = 1;
/// Minor of `monitor` (grants monitoring of all instances: never for tenants).
pub const MONITOR_MINOR: u32 = 2;
/// GI ids per GPU in the minor space (135 = 15 * 9).
pub const GI_IDS_PER_GPU: u32 = 15;
/// CI ids per GI in the minor space (9 = the GI's own entry + 8 CIs).
pub const CI_IDS_PER_GI: u32 = 8;

/// Minor of `gpu<gpu>/gi<gi>/access`.
pub fn gi_minor(gpu: u32, gi: u32) -> u32 {
    3 + gpu * 135 + gi * 9
}

/// Minor of `gpu<gpu>/gi<gi>/ci<ci>/access`.
pub fn ci_minor(gpu: u32, gi: u32, ci: u32) -> u32 {
    gi_minor(gpu, gi) + 1 + ci
}

/// The full table the driver publishes for GPUs `0..gpu_count`: every GI id and
/// every CI id, whether or not an instance exists (like the real file).
pub fn full_table(gpu_count: u32) -> MigMinors {
    let mut m = MigMinors {
        config: Some(CONFIG_MINOR),
        monitor: Some(MONITOR_MINOR),
        ..MigMinors::default()
    };
    for gpu in 0..gpu_count {
        for gi in 0..GI_IDS_PER_GPU {
            m.gi_access.insert((gpu, gi), gi_minor(gpu, gi));
            for ci in 0..CI_IDS_PER_GI {
                m.ci_access.insert((gpu, gi, ci), ci_minor(gpu, gi, ci));
            }
        }
    }
    m
}

/// Render in the driver's text format, ordered like the driver prints it.
pub fn render(m: &MigMinors) -> String {
    let mut out = String::new();
    if let Some(c) = m.config {
        out.push_str(&format!("config {c}\n"));
    }
    if let Some(c) = m.monitor {
        out.push_str(&format!("monitor {c}\n"));
    }
    for (&(gpu, gi), minor) in &m.gi_access {
        out.push_str(&format!("gpu{gpu}/gi{gi}/access {minor}\n"));
        for (&(_, _, ci), minor) in m.ci_access.range((gpu, gi, 0)..=(gpu, gi, u32::MAX)) {
            out.push_str(&format!("gpu{gpu}/gi{gi}/ci{ci}/access {minor}\n"));
        }
    }
    out
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mig-minors line {line}: {detail}")]
pub struct MinorsParseError {
    pub line: usize,
    pub detail: String,
}

fn parse_prefixed(s: &str, prefix: &str) -> Option<u32> {
    let digits = s.strip_prefix(prefix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Parse the driver's text. Blank lines are skipped; a line that is not
/// `<name> <minor>` or whose name is not one of the known shapes is an error (a
/// format change must not silently drop capabilities).
pub fn parse(text: &str) -> Result<MigMinors, MinorsParseError> {
    let mut m = MigMinors::default();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let err = |detail: String| MinorsParseError { line, detail };
        let trimmed = raw.trim();
        if trimmed.is_empty() {
            continue;
        }
        let mut fields = trimmed.split_whitespace();
        let (Some(name), Some(minor), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(err(format!("expected \"<name> <minor>\", got {trimmed:?}")));
        };
        let minor: u32 = minor
            .parse()
            .map_err(|_| err(format!("minor {minor:?} is not a number")))?;
        if name == "config" {
            m.config = Some(minor);
            continue;
        }
        if name == "monitor" {
            m.monitor = Some(minor);
            continue;
        }
        let parts: Vec<&str> = name.split('/').collect();
        let bad = || err(format!("unknown capability name {name:?}"));
        match parts.as_slice() {
            [gpu, gi, "access"] => {
                let gpu = parse_prefixed(gpu, "gpu").ok_or_else(bad)?;
                let gi = parse_prefixed(gi, "gi").ok_or_else(bad)?;
                m.gi_access.insert((gpu, gi), minor);
            }
            [gpu, gi, ci, "access"] => {
                let gpu = parse_prefixed(gpu, "gpu").ok_or_else(bad)?;
                let gi = parse_prefixed(gi, "gi").ok_or_else(bad)?;
                let ci = parse_prefixed(ci, "ci").ok_or_else(bad)?;
                m.ci_access.insert((gpu, gi, ci), minor);
            }
            _ => return Err(bad()),
        }
    }
    Ok(m)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// The head of a real file (driver 535+), and the entries around a GPU boundary.
    const SAMPLE: &str = "config 1
monitor 2
gpu0/gi0/access 3
gpu0/gi0/ci0/access 4
gpu0/gi0/ci1/access 5
gpu0/gi0/ci7/access 11
gpu0/gi1/access 12
gpu0/gi1/ci0/access 13
gpu0/gi14/access 129
gpu0/gi14/ci7/access 137
gpu1/gi0/access 138
gpu1/gi0/ci0/access 139
gpu1/gi2/access 156
gpu1/gi2/ci0/access 157
";

    #[test]
    fn formula_matches_published_endpoints() {
        let parsed = parse(SAMPLE).unwrap();
        assert_eq!(parsed.config, Some(1));
        assert_eq!(parsed.monitor, Some(2));
        for (&(gpu, gi), &minor) in &parsed.gi_access {
            assert_eq!(gi_minor(gpu, gi), minor, "gpu{gpu}/gi{gi}");
        }
        for (&(gpu, gi, ci), &minor) in &parsed.ci_access {
            assert_eq!(ci_minor(gpu, gi, ci), minor, "gpu{gpu}/gi{gi}/ci{ci}");
        }
        assert_eq!(parsed.gi_access.len(), 5);
        assert_eq!(parsed.ci_access.len(), 7);
        assert_eq!(parsed.ci_access[&(1, 2, 0)], 157);
    }

    #[test]
    fn render_then_parse_round_trips() {
        let table = full_table(2);
        assert_eq!(table.gi_access.len(), 30);
        assert_eq!(table.ci_access.len(), 240);
        let text = render(&table);
        assert!(
            text.starts_with("config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n")
        );
        assert_eq!(parse(&text).unwrap(), table);
        // The last minor of GPU 0 is just below GPU 1's first.
        assert_eq!(table.ci_access[&(0, 14, 7)] + 1, table.gi_access[&(1, 0)]);
    }

    #[test]
    fn malformed_lines_are_refused_with_their_line() {
        let e = parse("config 1\ngpu0/gi0/access\n").unwrap_err();
        assert_eq!(e.line, 2);
        let e = parse("config x\n").unwrap_err();
        assert!(e.detail.contains("not a number"), "{e}");
        let e = parse("config 1\n\ngpu0/gix/access 3\n").unwrap_err();
        assert_eq!(e.line, 3);
        assert!(parse("gpu0/gi0/ci0/mem 4\n").is_err());
        assert!(parse("gpu-1/gi0/access 4\n").is_err());
        assert_eq!(parse("").unwrap(), MigMinors::default());
    }
}
