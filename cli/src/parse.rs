//! Parsers for command-line values: sizes, percentages, MIG and MPS shapes, labels,
//! durations and points in time. Each returns a [`ParseError`] that clap prints as a
//! usage error (exit code 2).

use std::time::{Duration, SystemTime};

use tessera_proto::v1::{MigShape, MpsShape};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    #[error(transparent)]
    Size(#[from] tessera_common::size::SizeError),
    #[error("invalid percentage {0:?}: expected a whole number 1..100, e.g. 25% or 25")]
    Percent(String),
    #[error("invalid MPS share {0:?}: expected SM%,MEMORY, e.g. 25%,8GiB")]
    MpsFormat(String),
    #[error("MPS memory limit must be more than 0 bytes")]
    MpsZeroMemory,
    #[error(
        "invalid MIG profile {0:?}: expected a GPU instance profile like 1g.10gb, optionally /COMPUTE like 1g.10gb/1c"
    )]
    Mig(String),
    #[error("invalid label {0:?}: expected KEY=VALUE with a non-empty key")]
    Label(String),
    #[error("invalid duration {0:?}: {1}")]
    Duration(String, String),
    #[error("duration {0:?} is shorter than one second")]
    DurationTooShort(String),
    #[error(
        "invalid time {0:?}: expected RFC 3339 (UTC, e.g. 2026-11-21T10:00:00Z) or a duration ago (e.g. 2h, 30m ago)"
    )]
    Time(String),
}

/// Parses a byte size by the one rule every Tessera tool and config file follows
/// (binary units, SI spellings refused): see [`tessera_common::size`].
pub fn parse_size(input: &str) -> Result<u64, ParseError> {
    Ok(tessera_common::size::parse_size(input)?)
}

/// Parses a percentage 1..=100, with or without a trailing `%`.
pub fn parse_percent(input: &str) -> Result<u32, ParseError> {
    let s = input.trim();
    let digits = s.strip_suffix('%').unwrap_or(s).trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ParseError::Percent(input.to_owned()));
    }
    match digits.parse::<u32>() {
        Ok(p) if (1..=100).contains(&p) => Ok(p),
        _ => Err(ParseError::Percent(input.to_owned())),
    }
}

/// Parses an MPS share `SM%,MEMORY`: "25%,8GiB", "25,8G", "50%,16384MiB".
pub fn parse_mps(input: &str) -> Result<MpsShape, ParseError> {
    let (sm, mem) = input
        .split_once(',')
        .ok_or_else(|| ParseError::MpsFormat(input.to_owned()))?;
    let sm_percent = parse_percent(sm)?;
    let memory_bytes = parse_size(mem)?;
    if memory_bytes == 0 {
        return Err(ParseError::MpsZeroMemory);
    }
    Ok(MpsShape {
        sm_percent,
        memory_bytes,
        ..Default::default()
    })
}

/// Parses a MIG shape `GI[/CI]`: "1g.10gb", "1g.10gb+me", "3g.40gb/1c".
/// Only the syntax is checked here; the daemon knows which profiles its GPUs offer.
pub fn parse_mig(input: &str) -> Result<MigShape, ParseError> {
    let s = input.trim();
    let (gi, ci) = match s.split_once('/') {
        Some((gi, ci)) => (gi, Some(ci)),
        None => (s, None),
    };
    if !is_gi_profile(gi) || ci.is_some_and(|ci| !is_ci_profile(ci)) {
        return Err(ParseError::Mig(input.to_owned()));
    }
    Ok(MigShape {
        profile: gi.to_owned(),
        compute_profile: ci.unwrap_or_default().to_owned(),
        count: 0,
    })
}

/// `<n>g.<m>gb` with an optional `+suffix` (e.g. `+me`, `+gfx`).
fn is_gi_profile(s: &str) -> bool {
    let (base, suffix) = match s.split_once('+') {
        Some((b, suf)) => (b, Some(suf)),
        None => (s, None),
    };
    if let Some(suf) = suffix
        && (suf.is_empty() || !suf.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'+'))
    {
        return false;
    }
    let Some((slices, mem)) = base.split_once("g.") else {
        return false;
    };
    let Some(mem) = mem.strip_suffix("gb") else {
        return false;
    };
    all_digits(slices) && all_digits(mem)
}

/// `<n>c` (e.g. `1c`, `2c`); `4c.3g.40gb` style full names are accepted too.
fn is_ci_profile(s: &str) -> bool {
    match s.split_once("c.") {
        Some((n, gi)) => all_digits(n) && is_gi_profile(gi),
        None => s.strip_suffix('c').is_some_and(all_digits),
    }
}

fn all_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// Parses a label `KEY=VALUE`. The key must be non-empty; the value may be empty.
pub fn parse_label(input: &str) -> Result<(String, String), ParseError> {
    match input.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() && k.trim() == k => Ok((k.to_owned(), v.to_owned())),
        _ => Err(ParseError::Label(input.to_owned())),
    }
}

/// Parses a duration with humantime ("1h", "30m", "1h 30m"); at least one second.
pub fn parse_duration(input: &str) -> Result<Duration, ParseError> {
    let d = humantime::parse_duration(input.trim())
        .map_err(|e| ParseError::Duration(input.to_owned(), e.to_string()))?;
    if d < Duration::from_secs(1) {
        return Err(ParseError::DurationTooShort(input.to_owned()));
    }
    Ok(d)
}

/// A point in time given as RFC 3339 (UTC) or as a duration before `now` ("2h", "2h ago").
/// Returns unix milliseconds.
pub fn parse_time_at(input: &str, now: SystemTime) -> Result<i64, ParseError> {
    let s = input.trim();
    let t = if let Ok(t) = humantime::parse_rfc3339_weak(s) {
        t
    } else {
        let d = s.strip_suffix("ago").unwrap_or(s).trim();
        let d = humantime::parse_duration(d).map_err(|_| ParseError::Time(input.to_owned()))?;
        now.checked_sub(d)
            .ok_or_else(|| ParseError::Time(input.to_owned()))?
    };
    system_time_to_ms(t).ok_or_else(|| ParseError::Time(input.to_owned()))
}

/// [`parse_time_at`] relative to now, for clap.
pub fn parse_time_ago(input: &str) -> Result<i64, ParseError> {
    parse_time_at(input, SystemTime::now())
}

pub use tessera_common::clock::{now_ms, system_time_to_ms};

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const GIB: u64 = 1024 * 1024 * 1024;

    #[test]
    fn sizes_follow_the_shared_rule() {
        assert_eq!(parse_size("8GiB").unwrap(), 8 * GIB);
        assert_eq!(parse_size("1.5G").unwrap(), 3 * GIB / 2);
        let si = parse_size("8GB").unwrap_err().to_string();
        assert!(si.contains("\"8GiB\""), "{si}");
        assert!(parse_size("8 gigs").is_err());
    }

    #[test]
    fn percents() {
        assert_eq!(parse_percent("25%").unwrap(), 25);
        assert_eq!(parse_percent("25").unwrap(), 25);
        assert_eq!(parse_percent("100%").unwrap(), 100);
        for bad in ["0", "0%", "101%", "-5", "25.5", "%", "", "abc"] {
            assert!(parse_percent(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn mps_shares() {
        assert_eq!(
            parse_mps("25%,8GiB").unwrap(),
            MpsShape {
                sm_percent: 25,
                memory_bytes: 8 * GIB,
                ..Default::default()
            }
        );
        assert_eq!(
            parse_mps("25,8G").unwrap(),
            MpsShape {
                sm_percent: 25,
                memory_bytes: 8 * GIB,
                ..Default::default()
            }
        );
        assert_eq!(
            parse_mps("50%,16384MiB").unwrap(),
            MpsShape {
                sm_percent: 50,
                memory_bytes: 16 * GIB,
                ..Default::default()
            }
        );
        assert!(matches!(parse_mps("25%"), Err(ParseError::MpsFormat(_))));
        assert!(matches!(parse_mps("0%,8G"), Err(ParseError::Percent(_))));
        assert_eq!(parse_mps("25%,0"), Err(ParseError::MpsZeroMemory));
        assert!(matches!(parse_mps("25%,8GB"), Err(ParseError::Size(_))));
    }

    #[test]
    fn mig_shapes() {
        let m = parse_mig("1g.10gb").unwrap();
        assert_eq!(
            (m.profile.as_str(), m.compute_profile.as_str()),
            ("1g.10gb", "")
        );
        let m = parse_mig("3g.40gb/1c").unwrap();
        assert_eq!(
            (m.profile.as_str(), m.compute_profile.as_str()),
            ("3g.40gb", "1c")
        );
        let m = parse_mig("1g.10gb+me").unwrap();
        assert_eq!(m.profile, "1g.10gb+me");
        assert!(parse_mig("3g.40gb/1c.3g.40gb").is_ok());
        for bad in [
            "",
            "1g",
            "1g.10",
            "g.10gb",
            "1g.10gb/",
            "1g.10gb/c",
            "1g.10gb+",
            "big",
        ] {
            assert!(parse_mig(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn labels() {
        assert_eq!(
            parse_label("team=ml").unwrap(),
            ("team".to_owned(), "ml".to_owned())
        );
        assert_eq!(
            parse_label("expr=a=b").unwrap(),
            ("expr".to_owned(), "a=b".to_owned())
        );
        assert_eq!(
            parse_label("empty=").unwrap(),
            ("empty".to_owned(), String::new())
        );
        for bad in ["noequals", "=value", " k=v", ""] {
            assert!(parse_label(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("30m").unwrap(), Duration::from_secs(1800));
        assert!(matches!(
            parse_duration("500ms"),
            Err(ParseError::DurationTooShort(_))
        ));
        assert!(matches!(
            parse_duration("soon"),
            Err(ParseError::Duration(..))
        ));
    }

    #[test]
    fn times_absolute_and_ago() {
        let now = std::time::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(
            parse_time_at("2026-11-21T10:00:00Z", now).unwrap(),
            1_795_255_200_000
        );
        assert_eq!(
            parse_time_at("2h", now).unwrap(),
            (1_800_000_000 - 7200) * 1000
        );
        assert_eq!(
            parse_time_at("30m ago", now).unwrap(),
            (1_800_000_000 - 1800) * 1000
        );
        assert!(parse_time_at("yesterday-ish", now).is_err());
    }
}
