//! `update`: the resources asked for a container this runtime created, judged against
//! its record and written anew as the runtime's own document for runc.

use crate::bundle;
use crate::cli::{Command, SubArgs};
use crate::harden::{Findings, exec as hexec, update as hupdate};
use crate::plan::Outcome;
use crate::refusal::Refusal;
use crate::session::Session;
use std::io::Read;
use std::path::Path;
use thiserror::Error;

/// Largest resources JSON `update` reads.
pub const MAX_STDIN: usize = 60 * 1024;

/// Why update's `--resources` was not read.
#[derive(Debug, Error)]
pub enum ResourcesError {
    #[error("update: the resources JSON is larger than {0} bytes")]
    TooLarge(u64),
    #[error("update: reading stdin: {0}")]
    Stdin(#[source] std::io::Error),
    #[error("update: {0}")]
    File(#[from] bundle::BundleError),
    #[error("update: {0}")]
    Json(#[from] serde_json::Error),
}

pub fn run(s: &Session, sub: &SubArgs) -> Outcome {
    let id = sub.first_positional().unwrap_or_default().to_string();
    let what = format!("update {id}");
    let doc = match resources_document(s, sub, &id) {
        Ok(d) => d,
        Err(r) => {
            let client = s.client();
            return s.refuse_reported(client.as_ref(), &id, "update", &what, &r);
        }
    };
    let forwarded = SubArgs {
        flags: Vec::new(),
        positionals: vec![(0, id)],
    };
    s.plan_with_document(Command::Update, forwarded, "resources", doc, 0)
}

/// The resources judged against the container's record, written as the runtime's own
/// document (its fd and path).
fn resources_document(s: &Session, sub: &SubArgs, id: &str) -> Result<(i32, String), Refusal> {
    let mut f = Findings::default();
    let judged = s
        .record_of(id)
        .map_err(|e| f.refuse(e.to_string()))
        .ok()
        .and_then(|record| {
            let state = hexec::ContainerState::from_record(&record);
            asked(sub, &mut f).and_then(|r| hupdate::judge(r, &state, &s.cfg.policy, &mut f))
        });
    let doc = match judged {
        Some(r) if f.reasons.is_empty() => serde_json::to_vec(&r)
            .map_err(|e| e.to_string())
            .and_then(|bytes| s.own_document(&bytes, 0).map_err(|e| e.to_string()))
            .map_err(|e| f.refuse(e))
            .ok(),
        _ => None,
    };
    doc.filter(|_| f.reasons.is_empty())
        .ok_or_else(|| Refusal::many(f.reasons))
}

/// What the caller asks: `--resources` (a file, or `-` for stdin) or the flags.
fn asked(sub: &SubArgs, f: &mut Findings) -> Option<hupdate::Resources> {
    match sub.value("resources") {
        Some(r) => {
            // runc ignores every other flag with --resources: refused.
            hupdate::from_flags(sub, f);
            read_resources(r)
                .and_then(|b| Ok(bundle::parse_strict(&b)?))
                .map_err(|e| f.refuse(e.to_string()))
                .ok()
                .and_then(|v| hupdate::parse(&v, f))
        }
        None => Some(hupdate::from_flags(sub, f)),
    }
}

/// The bytes of update's `--resources`: a file (no symlink at its last component),
/// or stdin for `-`, at most [`MAX_STDIN`] bytes.
fn read_resources(r: &str) -> Result<Vec<u8>, ResourcesError> {
    let max = MAX_STDIN as u64;
    if r == "-" {
        let mut buf = Vec::new();
        return match std::io::stdin().take(max + 1).read_to_end(&mut buf) {
            Ok(_) if buf.len() as u64 <= max => Ok(buf),
            Ok(_) => Err(ResourcesError::TooLarge(max)),
            Err(e) => Err(ResourcesError::Stdin(e)),
        };
    }
    Ok(bundle::read_file_nofollow(Path::new(r), max)?)
}
