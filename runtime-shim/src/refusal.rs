//! The one shape every refusal of the runtime takes on its way out: the reasons (each a
//! line a user can act on) and the lease it concerns, if one was resolved. Every
//! module's typed error becomes a [`Refusal`] of one reason (its message); the policy
//! table's findings become one of many. The runtime reports it to the daemon (audit)
//! and prints it as one line, on stderr and as the last error of runc's log
//! ([`line`]), which containerd, CRI-O and podman show.

/// The start of the reason a privileged container is refused for; its line leads with it.
pub const PRIVILEGED_REFUSAL: &str = "privileged containers are not allowed";

/// Why a command is refused, and on which lease.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Refusal {
    /// Every reason, in the order found (never empty when reported).
    pub reasons: Vec<String>,
    /// The lease the refused container would have run on ("" when none was resolved).
    pub lease_id: String,
}

impl Refusal {
    /// A refusal for one reason, on no lease.
    pub fn one(reason: impl Into<String>) -> Self {
        Self {
            reasons: vec![reason.into()],
            lease_id: String::new(),
        }
    }

    /// A refusal for these reasons, on no lease.
    pub fn many(reasons: Vec<String>) -> Self {
        Self {
            reasons,
            lease_id: String::new(),
        }
    }

    /// This refusal, concerning `lease_id`.
    #[must_use]
    pub fn on_lease(mut self, lease_id: impl Into<String>) -> Self {
        self.lease_id = lease_id.into();
        self
    }

    /// The line that says it for the command `what` (see [`line`]).
    pub fn line(&self, what: &str) -> (String, bool) {
        line(what, &self.reasons)
    }
}

/// Every typed error of the runtime is refused for its message.
impl<E: std::error::Error> From<E> for Refusal {
    fn from(e: E) -> Self {
        Self::one(e.to_string())
    }
}

/// The one line a refusal is reported in (stderr and runc's log: containerd and conmon
/// show it). A privileged container's refusal leads with that reason and counts the
/// others (the cue to run `tessera-runtime check`); the bool says reasons were left
/// out of the line.
pub fn line(what: &str, reasons: &[String]) -> (String, bool) {
    let flat = |r: &str| r.replace(['\n', '\r'], " ");
    if let Some(p) = reasons.iter().find(|r| r.starts_with(PRIVILEGED_REFUSAL)) {
        let more = reasons.len() - 1;
        let tail = if more > 0 {
            format!(" [{more} more reason(s): tessera-runtime check lists them]")
        } else {
            String::new()
        };
        return (
            format!("tessera-runtime: {what} refused: {}{tail}", flat(p)),
            more > 0,
        );
    }
    let all: Vec<String> = reasons.iter().map(|r| flat(r)).collect();
    (
        format!("tessera-runtime: {what} refused: {}", all.join("; ")),
        false,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typed_error_is_refused_for_its_message() {
        let e = std::io::Error::other("no such thing");
        let r: Refusal = e.into();
        assert_eq!(r.reasons, ["no such thing"]);
        assert_eq!(r.lease_id, "");
        assert_eq!(
            r.on_lease("l-1").line("create c1").0,
            "tessera-runtime: create c1 refused: no such thing"
        );
    }
}
