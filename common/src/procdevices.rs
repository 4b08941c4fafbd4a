//! `/proc/devices`: which major number the kernel gave each character-device driver.

/// The character-device entries of `/proc/devices` text, as (major, driver name).
/// Block devices are skipped; malformed lines are ignored.
pub fn char_devices(text: &str) -> impl Iterator<Item = (i64, &str)> {
    let mut in_char = false;
    text.lines().filter_map(move |line| {
        let line = line.trim();
        if line.starts_with("Character devices") {
            in_char = true;
            return None;
        }
        if line.starts_with("Block devices") {
            in_char = false;
            return None;
        }
        if !in_char {
            return None;
        }
        let (major, name) = line.split_once(char::is_whitespace)?;
        Some((major.parse().ok()?, name.trim()))
    })
}

/// The major of the character-device driver called exactly `name`.
pub fn major_of(text: &str, name: &str) -> Option<i64> {
    char_devices(text).find(|(_, n)| *n == name).map(|(m, _)| m)
}

/// The majors of every character-device driver whose name starts with `prefix`.
pub fn majors_with_prefix(text: &str, prefix: &str) -> Vec<i64> {
    char_devices(text)
        .filter(|(_, n)| n.starts_with(prefix))
        .map(|(m, _)| m)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n\
                        508 nvidia-uvm\n511 nvidia-caps\n\nBlock devices:\n  8 sd\n259 nvidia-block-lookalike\n";

    #[test]
    fn majors_come_from_the_character_section_only() {
        assert_eq!(major_of(TEXT, "nvidia-uvm"), Some(508));
        assert_eq!(major_of(TEXT, "nvidia-caps"), Some(511));
        assert_eq!(major_of(TEXT, "sd"), None);
        assert_eq!(major_of(TEXT, "nvidia-missing"), None);
        assert_eq!(majors_with_prefix(TEXT, "nvidia"), vec![195, 195, 508, 511]);
    }
}
