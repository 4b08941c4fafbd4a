//! `check` (the runtime's own, run by hand): the decision on a bundle, as text or JSON,
//! without binding or running anything.

use crate::cli::SubArgs;
use crate::pipeline::admit::{admit, partial_spec};
use crate::plan::{EXIT_REFUSED, Outcome};
use crate::session::{Session, bundle_dir};
use std::fmt::Write as _;

pub fn run(s: &Session, sub: &SubArgs) -> Outcome {
    let bundle = bundle_dir(sub);
    let id = sub.value("id").unwrap_or("check").to_string();
    let client = s.client();
    // Always the daemon's current answer: `check` binds nothing that would confirm
    // a kept one.
    let (admitted, reasons, notes, spec) = match admit(s, client.as_ref(), &bundle, &id, None, None)
    {
        Ok(a) => {
            let spec = a.decision.full_spec();
            (true, a.decision.reasons, a.decision.notes, spec)
        }
        Err(refusal) => {
            // Show the spec as far as it could be hardened, for the operator.
            let spec = partial_spec(s, &bundle, &id);
            (false, refusal.reasons, Vec::new(), spec)
        }
    };
    let mut text = String::new();
    if sub.is_set("json") {
        let out = serde_json::json!({"admitted": admitted, "reasons": reasons, "spec": spec});
        let _ = writeln!(text, "{out}");
    } else {
        text.push_str(if admitted { "admitted\n" } else { "refused\n" });
        for r in &reasons {
            let _ = writeln!(text, "  reason: {r}");
        }
        for n in &notes {
            let _ = writeln!(text, "  note: {n}");
        }
        let pretty = serde_json::to_string_pretty(&spec).unwrap_or_else(|_| "null".to_string());
        let _ = writeln!(text, "{pretty}");
    }
    // A reader that goes away (`| head`) is not an error of the decision: no panic.
    let _ = std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes());
    Outcome::Exit(if admitted { 0 } else { EXIT_REFUSED })
}
