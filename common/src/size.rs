//! Byte sizes as operators write them, in the CLI and in every config file.
//!
//! The one rule: a number, optionally with a fraction, then an optional unit. Units
//! are binary, case-insensitive: `B` (or none) = bytes, `K`/`KiB` = 1024,
//! `M`/`MiB` = 1024², `G`/`GiB` = 1024³, `T`/`TiB` = 1024⁴. The SI spellings `KB`,
//! `MB`, `GB`, `TB` are refused as ambiguous (is "40GB" 40·10⁹ or 40·2³⁰ bytes?), with
//! the binary spelling suggested. Fractions are computed exactly (no floating point);
//! a fraction of a byte is refused.

/// Why a size was refused. Each message names the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("empty size")]
    Empty,
    #[error(
        "invalid size {0:?}: expected a number with an optional unit (B, K/KiB, M/MiB, G/GiB, T/TiB), e.g. 8GiB or 16384MiB"
    )]
    Invalid(String),
    #[error(
        "size {input:?} is ambiguous: SI units are not accepted; write {suggest:?} (binary units)"
    )]
    SiUnit { input: String, suggest: String },
    #[error("size {0:?} does not fit in 64 bits")]
    Overflow(String),
}

const KIB: u64 = 1024;

fn multiplier(unit: &str) -> Option<u64> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => KIB.pow(2),
        "g" | "gib" => KIB.pow(3),
        "t" | "tib" => KIB.pow(4),
        _ => return None,
    })
}

/// A byte count for people: the largest binary unit, up to two decimals, e.g.
/// `"20 GiB"`, `"1.5 MiB"`, `"512 B"`.
#[allow(clippy::cast_precision_loss)]
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    let mut scaled = bytes as f64;
    while scaled >= 1024.0 && unit < UNITS.len() - 1 {
        scaled /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        return format!("{bytes} B");
    }
    let text = format!("{scaled:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text} {}", UNITS[unit])
}

/// Parse a byte size by the rule of this module.
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(SizeError::Empty);
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let unit = unit.trim();
    let invalid = || SizeError::Invalid(input.to_owned());
    let overflow = || SizeError::Overflow(input.to_owned());
    let Some(mult) = multiplier(unit) else {
        let lower = unit.to_ascii_lowercase();
        if matches!(lower.as_str(), "kb" | "mb" | "gb" | "tb") && !number.is_empty() {
            return Err(SizeError::SiUnit {
                input: input.to_owned(),
                suggest: format!("{number}{}iB", unit[..1].to_ascii_uppercase()),
            });
        }
        return Err(invalid());
    };
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return Err(invalid());
    }
    let Some((whole, frac)) = number.split_once('.') else {
        let whole: u64 = number.parse().map_err(|_| overflow())?;
        return whole.checked_mul(mult).ok_or_else(overflow);
    };
    if frac.contains('.') {
        return Err(invalid());
    }
    let whole: u64 = whole.parse().map_err(|_| overflow())?;
    let whole_bytes = whole.checked_mul(mult).ok_or_else(overflow)?;
    // The fraction in exact integer arithmetic: digits / 10^len * multiplier.
    let frac = &frac[..frac.len().min(12)];
    let digits: u128 = frac.parse().map_err(|_| invalid())?;
    if mult == 1 && digits != 0 {
        return Err(invalid());
    }
    let scale = 10u128.pow(u32::try_from(frac.len()).unwrap_or(12));
    let frac_bytes = u64::try_from(digits * u128::from(mult) / scale).map_err(|_| overflow())?;
    whole_bytes.checked_add(frac_bytes).ok_or_else(overflow)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const GIB: u64 = 1024 * 1024 * 1024;

    #[test]
    fn binary_units_any_case_with_exact_fractions() {
        assert_eq!(parse_size("8GiB").unwrap(), 8 * GIB);
        assert_eq!(parse_size("8G").unwrap(), 8 * GIB);
        assert_eq!(parse_size("8g").unwrap(), 8 * GIB);
        assert_eq!(parse_size("16384MiB").unwrap(), 16 * GIB);
        assert_eq!(parse_size("512K").unwrap(), 512 * 1024);
        assert_eq!(parse_size("2TiB").unwrap(), 2 * 1024 * GIB);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4096B").unwrap(), 4096);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 * GIB / 2);
        assert_eq!(parse_size("0.25 G").unwrap(), GIB / 4);
        assert_eq!(parse_size(" 12 ").unwrap(), 12);
    }

    #[test]
    fn malformed_sizes_are_refused() {
        for bad in [
            "GiB", "8 gigs", "-1G", "1.2.3G", ".5G", "5.G", "1.5", "x", "lots",
        ] {
            assert_eq!(
                parse_size(bad),
                Err(SizeError::Invalid(bad.into())),
                "{bad:?}"
            );
        }
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert_eq!(
            parse_size("99999999999T"),
            Err(SizeError::Overflow("99999999999T".into()))
        );
    }

    #[test]
    fn si_units_are_refused_with_the_binary_spelling() {
        let err = parse_size("40GB").unwrap_err();
        assert_eq!(
            err,
            SizeError::SiUnit {
                input: "40GB".into(),
                suggest: "40GiB".into()
            }
        );
        assert!(err.to_string().contains("\"40GiB\""), "{err}");
        assert!(
            matches!(parse_size("512mb"), Err(SizeError::SiUnit { suggest, .. }) if suggest == "512MiB")
        );
    }
}
