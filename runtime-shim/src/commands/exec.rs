//! `exec`: the process to run in a container this runtime created, judged against the
//! container's record and written anew as the runtime's own document for runc.

use crate::bundle;
use crate::cli::{Command, SubArgs};
use crate::harden::{Findings, exec as hexec};
use crate::plan::Outcome;
use crate::record::Record;
use crate::refusal::Refusal;
use crate::session::Session;
use std::path::Path;

/// The exec flags that are the caller's own plumbing, forwarded to runc as parsed;
/// every other one is judged and becomes part of the process JSON.
const EXEC_FORWARDED: &[&str] = &["console-socket", "detach", "pid-file", "preserve-fds"];

pub fn run(s: &Session, sub: &SubArgs) -> Outcome {
    let id = sub.first_positional().unwrap_or_default().to_string();
    let what = format!("exec {id}");
    let checked = crate::fds::preserve_fds(sub)
        .map_err(Refusal::from)
        .and_then(|keep| Ok((keep, s.record_of(&id)?)));
    let (keep, record) = match checked {
        Ok(c) => c,
        Err(r) => return s.refuse(&what, &r),
    };
    let doc = match process_document(s, sub, &record)
        .and_then(|bytes| s.own_document(&bytes, keep).map_err(Refusal::from))
    {
        Ok(d) => d,
        Err(r) => {
            let client = s.client();
            return s.refuse_reported(client.as_ref(), &id, "exec", &what, &r);
        }
    };
    let forwarded = SubArgs {
        flags: sub
            .flags
            .iter()
            .filter(|fl| EXEC_FORWARDED.contains(&fl.name))
            .cloned()
            .collect(),
        positionals: vec![(0, id)],
    };
    s.plan_with_document(Command::Exec, forwarded, "process", doc, keep)
}

/// The tenant's process JSON, or the container's own process with the flags: in either
/// case judged and written anew, with the container's user and groups.
fn process_document(s: &Session, sub: &SubArgs, record: &Record) -> Result<Vec<u8>, Refusal> {
    let state = hexec::ContainerState::from_record(record);
    let mut f = Findings::default();
    hexec::check_flags(sub, &state, &mut f);
    let asked = match sub.value("process") {
        Some(p) => bundle::load_json(Path::new(p), s.cfg.policy.max_config_bytes)
            .map_err(|e| f.refuse(e.to_string()))
            .ok(),
        None => Some(hexec::process_from_flags(record, sub, &mut f)),
    };
    let process = asked.map(|p| hexec::harden_process(p, &state, &s.cfg.policy, &mut f));
    match process {
        Some(p) if f.reasons.is_empty() => serde_json::to_vec(&p).map_err(Refusal::from),
        _ => Err(Refusal::many(f.reasons)),
    }
}
