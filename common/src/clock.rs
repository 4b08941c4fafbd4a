//! The wall clock in unix milliseconds: the one unit leases, events and records use.

use std::time::{SystemTime, UNIX_EPOCH};

/// Unix milliseconds of a time; `None` before 1970 or out of range.
pub fn system_time_to_ms(t: SystemTime) -> Option<i64> {
    let d = t.duration_since(UNIX_EPOCH).ok()?;
    i64::try_from(d.as_millis()).ok()
}

/// Now, in unix milliseconds (0 if the clock is set before 1970).
pub fn now_ms() -> i64 {
    system_time_to_ms(SystemTime::now()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn times_before_the_epoch_have_no_ms() {
        assert_eq!(system_time_to_ms(UNIX_EPOCH - Duration::from_secs(1)), None);
        assert_eq!(
            system_time_to_ms(UNIX_EPOCH + Duration::from_millis(1500)),
            Some(1500)
        );
        // 2020-01-01 or later on any machine that runs these tests.
        assert!(now_ms() > 1_577_836_800_000);
    }
}
