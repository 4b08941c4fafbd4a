//! `create` and `run`: judge the tenant's spec, bind the container to its leases, write
//! the hardened spec into the runtime's own bundle, and run runc on it as a child (started
//! early, while the spec is judged, where runc's version is known to be admitted:
//! [`crate::early`]). Validate first, then act: nothing is bound, written or run
//! before every check has passed.

use crate::bundle::{self, BundleError, Staged};
use crate::cli::{Command, SubArgs};
use crate::early::{EarlyError, EarlyRunc};
use crate::harden::exec as hexec;
use crate::host::HostFacts;
use crate::lease::cache::AnswerCache;
use crate::lease::{DaemonClient, LeaseError};
use crate::pipeline::admit::{Admission, admit};
use crate::pipeline::bind::bind_all;
use crate::plan::{ExecPlan, Outcome};
use crate::record::{Record, RecordError, Records};
use crate::refusal::Refusal;
use crate::runc_cves::Pending;
use crate::session::{Session, bundle_dir};
use serde_json::Value;
use std::path::{Path, PathBuf};
use tessera_proto::v1 as pb;
use thiserror::Error;

/// Why a create is refused before or after the policy's decision.
#[derive(Debug, Error)]
pub enum CreateError {
    #[error("container id {0:?} is not valid")]
    InvalidId(String),
    #[error("{cmd} --{flag} is refused: {why}")]
    RefusedFlag {
        cmd: &'static str,
        flag: &'static str,
        why: &'static str,
    },
    #[error("container {id} already exists under {root}")]
    Exists { id: String, root: String },
    #[error("making the container's own bundle: {0}")]
    OwnBundle(#[source] RecordError),
    #[error("the spec has no root.path")]
    NoRootPath,
    #[error("root.path {}: {source}", path.display())]
    RootPath {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Serialize {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error("keeping the container's record: {0}")]
    KeepRecord(#[source] RecordError),
    #[error(transparent)]
    Early(#[from] EarlyError),
    #[error("UnbindContainer after an unchecked bind: {0}")]
    Unbind(#[source] LeaseError),
}

/// runc's create flags: --bundle is what is judged, --console-socket, --pid-file and
/// --preserve-fds the caller's plumbing (forwarded); these two loosen the container for
/// every tenant and are refused.
const REFUSED_FLAGS: [(&str, &str); 2] = [
    (
        "no-pivot",
        "the rootfs would be entered with MS_MOVE and chroot, which a process can climb out of",
    ),
    (
        "no-new-keyring",
        "the container would share the caller's session keyring",
    ),
];

/// The create's own checks of its command line: the descriptors it passes on, the
/// container id, the flags it refuses.
fn check_args(cmd: Command, sub: &SubArgs, id: &str) -> Result<i32, Refusal> {
    let keep = crate::fds::preserve_fds(sub)?;
    // The record of this create replaces any of the same root and id: a container
    // runc already has under that id keeps its own, as runc would refuse the create.
    if id.is_empty() || id.contains('/') || id == "." || id == ".." {
        return Err(CreateError::InvalidId(id.to_string()).into());
    }
    for (flag, why) in REFUSED_FLAGS {
        if sub.is_set(flag) {
            return Err(CreateError::RefusedFlag {
                cmd: cmd.name(),
                flag,
                why,
            }
            .into());
        }
    }
    Ok(keep)
}

pub fn run(s: &Session, cmd: Command, sub: &SubArgs) -> Outcome {
    let id = sub.first_positional().unwrap_or_default().to_string();
    let what = format!("{} {id}", cmd.name());
    let keep = match check_args(cmd, sub, &id) {
        Ok(n) => n,
        Err(r) => return s.refuse(&what, &r),
    };
    let bundle = bundle_dir(sub);
    let root = s.root().to_string();
    let records = s.records();
    // Held until runc has ended and the record says how: no second create of this
    // root and id runs meanwhile.
    let _lock = match records.lock(&root, &id) {
        Ok(l) => l,
        Err(e) => return s.refuse(&what, &e.into()),
    };
    if let Err(r) = check_free(&root, &id) {
        return s.refuse(&what, &r);
    }
    // The tenant's config.json, read once. runc never opens it: it gets the runtime's
    // own bundle directory, whose config.json only the runtime writes (crate::early).
    // One that cannot be read is refused below, by admit.
    let tenant = bundle::read_with_mode(
        &bundle.join(bundle::CONFIG_JSON),
        s.cfg.policy.max_config_bytes,
    )
    .ok();
    let mut own = match records.fresh_bundle_dir(&root, &id) {
        Ok(dir) => OwnBundle {
            records: &records,
            root: &root,
            id: &id,
            dir,
            keep: false,
        },
        Err(e) => return s.refuse(&what, &CreateError::OwnBundle(e).into()),
    };
    let plan = match s.plan_own_bundle(cmd, sub, &own.dir, keep) {
        Outcome::Exec(p) => p,
        refused => return refused,
    };
    // runc's version is asked now and judged once the spec is decided, before
    // anything is bound, written or run.
    let cache = crate::runc_cves::VersionCache::new(&s.cfg.state_dir);
    let mut runc_version = Some(crate::runc_cves::start(&s.cfg.runc_path, Some(&cache)));
    let early = start_early(
        s,
        &what,
        tenant.is_some(),
        runc_version.as_ref(),
        &own,
        &plan,
    );
    let (tenant, tenant_mode) = tenant.map_or((None, None), |(b, m)| (Some(b), Some(m)));
    let client = s.client();
    let create = Create {
        s,
        cmd,
        id: &id,
        what: &what,
        bundle: &bundle,
        client: client.as_ref(),
        answers: AnswerCache::new(&s.cfg.state_dir),
    };
    let tenant = (tenant.as_deref(), tenant_mode);
    let written = create.decide_and_write(tenant, &own.dir, &mut runc_version, early, &records);
    let (early, leased) = match written {
        Ok(w) => w,
        Err(out) => return out,
    };
    // runc runs as this process's child, so that how its create ended is known: a
    // create that failed leaves no record, no own bundle and no binding behind.
    drop(client);
    run_runc(s, &what, early, &plan, &mut own, leased)
}

/// No container of this id is under the root (runc would refuse the create).
fn check_free(root: &str, id: &str) -> Result<(), Refusal> {
    if std::fs::symlink_metadata(Path::new(root).join(id)).is_ok() {
        let exists = CreateError::Exists {
            id: id.to_string(),
            root: root.to_string(),
        };
        return Err(exists.into());
    }
    Ok(())
}

/// Start runc now, to wait for the spec in a FIFO, when runc's version is known to be
/// admitted and the tenant's spec could be read; otherwise it is started once the spec
/// is decided.
fn start_early(
    s: &Session,
    what: &str,
    tenant_read: bool,
    runc_version: Option<&Pending>,
    own: &OwnBundle<'_>,
    plan: &ExecPlan,
) -> Option<EarlyRunc> {
    let admitted =
        runc_version.is_some_and(|v| v.cached_and_admitted(&s.cfg.runc_cve_acknowledged));
    if !(tenant_read && admitted) {
        return None;
    }
    match EarlyRunc::start(&own.dir, plan) {
        Ok(e) => Some(e),
        Err(e) => {
            s.log.info(&format!(
                "tessera-runtime: {what}: runc is started once the spec is decided: {e}"
            ));
            None
        }
    }
}

/// runc, started early or now, waited for (for `run`, as long as the container); the
/// create is then finished as it ended.
fn run_runc(
    s: &Session,
    what: &str,
    early: Option<EarlyRunc>,
    plan: &ExecPlan,
    own: &mut OwnBundle<'_>,
    leased: bool,
) -> Outcome {
    let runc = match early {
        Some(r) => r,
        None => match EarlyRunc::spawn_decided(plan) {
            Ok(r) => r,
            Err(e) => {
                let refusal = Refusal::from(e);
                finish_create(s, own, leased, false);
                return s.refuse(what, &refusal);
            }
        },
    };
    match runc.wait() {
        Ok(status) => {
            finish_create(s, own, leased, status.success());
            Outcome::Mirror(status)
        }
        Err(e) => {
            let out = s.fail(what, &e);
            finish_create(s, own, leased, false);
            out
        }
    }
}

/// The hardened config.json staged in the runtime's own bundle and beside the tenant's.
type StagedPair = (Staged, Staged);

/// What the create decided and did before writing: the admission, the hardened
/// config.json, and the daemon's answers to the binds.
struct Decided {
    adm: Admission,
    hardened: Vec<u8>,
    bound: Vec<pb::BindContainerResponse>,
}

/// How a bind ended.
enum Bound {
    Yes(Vec<pb::BindContainerResponse>),
    /// Refused on (or unchecked for) an answer kept from an earlier start, which is
    /// forgotten: decide again on the daemon's current one.
    Again,
}

/// One create, as it decides and commits.
struct Create<'a> {
    s: &'a Session,
    cmd: Command,
    id: &'a str,
    what: &'a str,
    bundle: &'a Path,
    client: Option<&'a DaemonClient>,
    answers: AnswerCache,
}

impl Create<'_> {
    /// Decide, then write what was decided (see [`Create::commit`]), then keep the
    /// daemon's answers. The early runc (if any) is handed back with whether the
    /// container is leased; a refusal is how the runtime ends (the early runc, dropped
    /// with it, is killed).
    fn decide_and_write(
        &self,
        (tenant, tenant_mode): (Option<&[u8]>, Option<u32>),
        own_dir: &Path,
        runc_version: &mut Option<Pending>,
        mut early: Option<EarlyRunc>,
        records: &Records,
    ) -> Result<(Option<EarlyRunc>, bool), Outcome> {
        let s = self.s;
        let (decided, staged) = self
            .decide(tenant, tenant_mode, own_dir, runc_version)
            .map_err(|r| s.refuse_reported(self.client, self.id, self.cmd.name(), self.what, &r))?;
        self.commit(&decided, staged, early.as_mut(), records)
            .map_err(|r| s.refuse(self.what, &r))?;
        self.keep_answers(&decided);
        Ok((early, !decided.adm.answers.is_empty()))
    }

    /// Admit, stage and bind. At most twice: a bind refused on an answer kept from an
    /// earlier start (the daemon's answer has changed since, or the bind is refused for
    /// another reason) forgets that answer and decides again on the daemon's current
    /// one.
    fn decide(
        &self,
        tenant: Option<&[u8]>,
        tenant_mode: Option<u32>,
        own_dir: &Path,
        runc_version: &mut Option<Pending>,
    ) -> Result<(Decided, StagedPair), Refusal> {
        let mut kept = Some(&self.answers);
        loop {
            let adm = self.admit(kept, tenant, runc_version)?;
            let lease_id = adm.lease_id();
            // The new config.json is written in the runtime's own bundle (what runc
            // reads) and beside the tenant's (what the engine sees), then the daemon
            // records the binding, and the renames happen only once the container is
            // bound to every lease. A write that fails binds nothing.
            let (staged, hardened) = self
                .stage(&adm, own_dir, tenant_mode)
                .map_err(|e| Refusal::from(e).on_lease(&lease_id))?;
            // A dropped `staged` takes its temp file: config.json stays the tenant's
            // (or the FIFO runc waits on, which a refusal replaces by the tenant's).
            match self.bind(&adm, kept.is_some()) {
                Ok(Bound::Yes(bound)) => {
                    let decided = Decided {
                        adm,
                        hardened,
                        bound,
                    };
                    return Ok((decided, staged));
                }
                Ok(Bound::Again) => kept = None,
                Err(r) => return Err(r.on_lease(lease_id)),
            }
        }
    }

    /// The policy's decision, with root.path made absolute and runc's version judged
    /// (the first time only).
    fn admit(
        &self,
        kept: Option<&AnswerCache>,
        tenant: Option<&[u8]>,
        runc_version: &mut Option<Pending>,
    ) -> Result<Admission, Refusal> {
        let s = self.s;
        let mut adm = admit(s, self.client, self.bundle, self.id, kept, tenant)?;
        // runc resolves a relative root.path in the bundle it is given, the runtime's
        // own: the judged path (inside the tenant's bundle) is written absolute.
        absolute_root_path(&mut adm.decision.spec, self.bundle)?;
        if let Some(pending) = runc_version.take() {
            let verdict = pending.judge(&s.cfg.runc_cve_acknowledged);
            for n in &verdict.cache_notes {
                s.log.warn(n);
            }
            match verdict.result {
                Err(unfixed) => return Err(Refusal::from(unfixed).on_lease(adm.lease_id())),
                Ok(Some(warning)) => s.log.warn(&warning),
                Ok(None) => {}
            }
        }
        Ok(adm)
    }

    /// The hardened config.json, staged in the runtime's own bundle (0600) and beside
    /// the tenant's (with the mode of the tenant's file).
    fn stage(
        &self,
        adm: &Admission,
        own_dir: &Path,
        tenant_mode: Option<u32>,
    ) -> Result<(StagedPair, Vec<u8>), CreateError> {
        let bytes = adm
            .decision
            .config_json()
            .map_err(|source| CreateError::Serialize {
                path: self.bundle.join(bundle::CONFIG_JSON),
                source,
            })?;
        let mine = bundle::stage_with_mode(own_dir, &bytes, 0o600)?;
        let theirs = match tenant_mode {
            Some(mode) => bundle::stage_with_mode(self.bundle, &bytes, mode),
            None => bundle::stage(self.bundle, &bytes),
        }?;
        Ok(((mine, theirs), bytes))
    }

    /// Bind the container to its leases (none: nothing to bind). A kept answer counts
    /// only when the daemon says it checked it: an older daemon ignores it.
    fn bind(&self, adm: &Admission, kept: bool) -> Result<Bound, Refusal> {
        let s = self.s;
        if adm.answers.is_empty() {
            return Ok(Bound::Yes(Vec::new()));
        }
        match bind_all(s, self.client, adm, self.id, self.cmd) {
            Ok(b)
                if kept
                    && adm
                        .answers
                        .iter()
                        .zip(&b)
                        .any(|(a, r)| a.kept && !r.resolution_checked) =>
            {
                // Unbound, forgotten, and decided again.
                if let Some(c) = self.client
                    && let Err(e) = c.unbind(self.id, s.root())
                {
                    return Err(CreateError::Unbind(e).into());
                }
                self.forget_kept(adm);
                s.log.warn(&format!(
                    "tessera-runtime: {}: the daemon did not check the kept ResolveToken \
                     answer (an older tesserad?); deciding again on its current answer",
                    self.what
                ));
                Ok(Bound::Again)
            }
            Ok(b) => Ok(Bound::Yes(b)),
            Err(reason) if kept && adm.answers.iter().any(|a| a.kept) => {
                self.forget_kept(adm);
                s.log.info(&format!(
                    "tessera-runtime: {}: the kept ResolveToken answer was refused at \
                     bind ({reason}); deciding again on the daemon's current answer",
                    self.what
                ));
                Ok(Bound::Again)
            }
            Err(reason) => Err(reason.into()),
        }
    }

    fn forget_kept(&self, adm: &Admission) {
        for a in adm.answers.iter().filter(|a| a.kept) {
            self.answers.forget(&a.token);
        }
    }

    /// What exec and update judge against later is kept in the runtime's own state
    /// first, then the hardened file replaces the tenant's (or the FIFO in its place),
    /// then an early runc gets it through the FIFO if it opened that already. A failure
    /// undoes the record and the binds, and is reported.
    fn commit(
        &self,
        decided: &Decided,
        staged: StagedPair,
        early: Option<&mut EarlyRunc>,
        records: &Records,
    ) -> Result<(), Refusal> {
        let s = self.s;
        let lease_id = decided.adm.lease_id();
        if let Err(e) = self.write(decided, staged, early, records) {
            let refusal = Refusal::from(e);
            if let Err(e) = records.remove(s.root(), self.id) {
                s.log.warn(&format!("tessera-runtime: {}: {e}", self.what));
            }
            if let Some(c) = self.client
                && !decided.adm.answers.is_empty()
            {
                let _ = c.unbind(self.id, s.root());
            }
            let cmd = self.cmd.name();
            s.report(
                self.client,
                self.id,
                &lease_id,
                false,
                &refusal.reasons,
                cmd,
            );
            return Err(refusal);
        }
        for n in &decided.adm.decision.notes {
            if n.contains("AppArmor") {
                s.log.warn(&format!("tessera-runtime: {n}"));
            } else {
                s.log.info(&format!("tessera-runtime: {n}"));
            }
        }
        if decided.adm.answers.is_empty() {
            let cmd = self.cmd.name();
            s.report(self.client, self.id, &lease_id, true, &[], cmd);
        }
        Ok(())
    }

    /// The record, then the tenant's config.json, then the runtime's own, then the FIFO.
    fn write(
        &self,
        decided: &Decided,
        (mine, theirs): StagedPair,
        early: Option<&mut EarlyRunc>,
        records: &Records,
    ) -> Result<(), CreateError> {
        let spec = &decided.adm.decision.spec;
        let record = Record::from_spec(
            self.id,
            self.s.root(),
            self.bundle,
            spec,
            hexec::lease_id_of(spec),
            hexec::LEASE_ENV_KEYS,
        )?;
        records.put(&record).map_err(CreateError::KeepRecord)?;
        theirs.commit()?;
        mine.commit()?;
        if let Some(r) = early {
            r.feed(&decided.hardened)?;
        }
        Ok(())
    }

    /// The daemon confirmed these answers by binding: the next start on the same lease
    /// may judge against them without asking. Kept as the bind left them: a first bind
    /// with a pod claims the token for it, which the daemon's answer says from then on.
    fn keep_answers(&self, decided: &Decided) {
        for (a, bind) in decided.adm.answers.iter().zip(&decided.bound) {
            let lease = bind.lease.as_ref();
            if a.kept
                && lease.is_none_or(|l| a.judged.lease.as_ref().is_some_and(|j| j.pod == l.pod))
            {
                continue;
            }
            let mut judged = a.judged.clone();
            if let (Some(j), Some(l)) = (judged.lease.as_mut(), lease) {
                j.pod.clone_from(&l.pod);
            }
            if let Err(e) = self.answers.put(&a.token, &judged) {
                self.s.log.warn(&format!(
                    "tessera-runtime: keeping the ResolveToken answer: {e}"
                ));
            }
        }
    }
}

/// Make a relative `root.path` (judged inside the tenant's bundle) absolute: the
/// canonical bundle joined with it.
fn absolute_root_path(spec: &mut Value, bundle: &Path) -> Result<(), CreateError> {
    let Some(path) = spec.pointer("/root/path").and_then(Value::as_str) else {
        return Err(CreateError::NoRootPath);
    };
    if Path::new(path).is_absolute() {
        return Ok(());
    }
    let full = bundle.join(path);
    let canon = std::fs::canonicalize(&full)
        .map_err(|source| CreateError::RootPath { path: full, source })?;
    if let Some(root) = spec.get_mut("root").and_then(Value::as_object_mut) {
        root.insert(
            "path".to_string(),
            Value::String(canon.to_string_lossy().into_owned()),
        );
    }
    Ok(())
}

/// The runtime's own bundle directory of a create: removed when dropped, unless the
/// container was made.
struct OwnBundle<'a> {
    records: &'a Records,
    root: &'a str,
    id: &'a str,
    dir: PathBuf,
    keep: bool,
}

impl Drop for OwnBundle<'_> {
    fn drop(&mut self) {
        if !self.keep {
            let _ = self.records.remove_bundle_dir(self.root, self.id);
        }
    }
}

/// After runc's create (or run) ended: a container runc now has under the root,
/// started after the record was written, gets its init written into the record (exec
/// and update then check it is still that one). Otherwise (runc failed, or `run` ended
/// and runc deleted the container) the record and the own bundle are removed and the
/// container is unbound from its leases.
fn finish_create(s: &Session, own: &mut OwnBundle<'_>, leased: bool, ok: bool) {
    let (root, id) = (own.root, own.id);
    let exists = std::fs::symlink_metadata(Path::new(root).join(id)).is_ok();
    if ok && exists {
        // Kept even when the init cannot be read: the record's start time still ties
        // it to a container made after it.
        own.keep = true;
        record_init(s, own.records, root, id);
        return;
    }
    if let Err(e) = own.records.remove(root, id) {
        s.log.warn(&format!("tessera-runtime: {id}: {e}"));
    }
    let _ = own.records.remove_bundle_dir(root, id);
    if leased
        && let Some(c) = s.client()
        && let Err(e) = c.unbind(id, root)
    {
        s.log.warn(&format!(
            "tessera-runtime: UnbindContainer {id} after runc's create failed: {e}"
        ));
    }
}

/// Write the container's init (runc's state.json) into its record.
fn record_init(s: &Session, records: &Records, root: &str, id: &str) {
    let state = crate::harden::identity::read_state(&HostFacts::default(), Path::new(root), id);
    match (records.get(root, id), state) {
        (Ok(mut r), Ok(st)) if r.matches(st.init_pid, st.init_start).is_ok() => {
            r.instance = Some(crate::record::Instance {
                init_pid: st.init_pid,
                init_start: st.init_start,
            });
            if let Err(e) = records.put(&r) {
                s.log
                    .warn(&format!("tessera-runtime: recording {id}'s init: {e}"));
            }
        }
        (Ok(_), Ok(_)) => s.log.warn(&format!(
            "tessera-runtime: {id}: runc's init started before the create's record: not recorded"
        )),
        (r, st) => s.log.warn(&format!(
            "tessera-runtime: recording {id}'s init: {}",
            r.err()
                .map(|e| e.to_string())
                .or(st.err().map(|e| e.to_string()))
                .unwrap_or_default()
        )),
    }
}
