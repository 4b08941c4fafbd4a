//! The daemon records the container on every lease of its tokens, or on none.

use super::admit::Admission;
use crate::cli::Command;
use crate::harden;
use crate::lease::{Binding, DaemonClient, LeaseError};
use crate::session::Session;
use serde_json::Value;
use tessera_proto::v1 as pb;
use thiserror::Error;

/// Why the container was not bound.
#[derive(Debug, Error)]
pub enum BindError {
    #[error("no daemon client to bind the container")]
    NoClient,
    #[error("BindContainer failed: {0}")]
    Bind(#[source] LeaseError),
}

/// What the daemon records of a container on its leases, from the hardened spec.
fn binding(s: &Session, spec: &Value, id: &str, cmd: Command) -> Binding {
    Binding {
        container_id: id.to_string(),
        cgroup_path: spec
            .pointer("/linux/cgroupsPath")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        runtime_root: s.root().to_string(),
        uid: spec
            .pointer("/process/user/uid")
            .and_then(Value::as_u64)
            .and_then(|u| u32::try_from(u).ok()),
        termination_log: harden::termination_log_source(spec).unwrap_or_default(),
        pod: harden::pod_of(spec).unwrap_or_default(),
        // The bind carries the admission report; a failure after it (saving
        // config.json) unbinds and reports the refusal.
        admission_command: cmd.name().to_string(),
    }
}

/// Bind the container to every lease of its tokens, or to none: a failed bind unbinds
/// the container from those already bound (UnbindContainer forgets it on every lease).
/// `Ok` has the daemon's answer to each bind (in the answers' order).
pub fn bind_all(
    s: &Session,
    client: Option<&DaemonClient>,
    adm: &Admission,
    id: &str,
    cmd: Command,
) -> Result<Vec<pb::BindContainerResponse>, BindError> {
    // admit() resolved the token, so there is a client; stay closed regardless.
    let Some(c) = client else {
        return Err(BindError::NoClient);
    };
    let binding = binding(s, &adm.decision.spec, id, cmd);
    let mut bound = Vec::with_capacity(adm.answers.len());
    for (i, a) in adm.answers.iter().enumerate() {
        match c.bind(&a.token, &binding, Some(&a.judged)) {
            Ok(answer) => bound.push(answer),
            Err(e) => {
                if i > 0
                    && let Err(u) = c.unbind(id, s.root())
                {
                    s.log.warn(&format!(
                        "tessera-runtime: UnbindContainer {id} after a failed bind: {u}"
                    ));
                }
                return Err(BindError::Bind(e));
            }
        }
    }
    Ok(bound)
}
