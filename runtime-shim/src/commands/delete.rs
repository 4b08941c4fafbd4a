//! `delete`: runc deletes first, as this process's child; then the runtime forgets what
//! it kept of the container and unbinds it from its leases.

use crate::early::EarlyRunc;
use crate::plan::Outcome;
use crate::session::Session;
use std::path::Path;

pub fn run(s: &Session, id: &str) -> Outcome {
    let plan = match s.plan(0) {
        Outcome::Exec(p) => p,
        other => return other,
    };
    // Only a container runc no longer has under this root loses its record and its
    // lease bindings, and only the one this root's record says this runtime bound (a
    // delete under another root, or of a container runc refuses to delete, unbinds
    // nothing).
    let status = match EarlyRunc::spawn_decided(&plan).and_then(EarlyRunc::wait) {
        Ok(status) => status,
        Err(e) => return s.fail(&format!("delete {id}"), &e),
    };
    let root = s.root();
    let gone = std::fs::symlink_metadata(Path::new(root).join(id)).is_err();
    if status.success() && gone {
        forget(s, root, id);
    }
    Outcome::Mirror(status)
}

/// Unbind a container runc has deleted and remove its record and own bundle.
fn forget(s: &Session, root: &str, id: &str) {
    let records = s.records();
    let Ok(record) = records.get(root, id) else {
        return;
    };
    if record.lease_id.is_some()
        && let Some(c) = s.client()
        && let Err(e) = c.unbind(id, root)
        && !matches!(e, crate::lease::LeaseError::UnknownToken(_))
    {
        s.log
            .warn(&format!("tessera-runtime: UnbindContainer {id}: {e}"));
    }
    if let Err(e) = records.remove(root, id) {
        s.log.warn(&format!("tessera-runtime: delete {id}: {e}"));
    }
    let _ = records.remove_bundle_dir(root, id);
}
