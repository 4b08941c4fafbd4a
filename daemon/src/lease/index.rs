//! The lease table's maps with the indexes the hot paths need, so that no request
//! scans every live lease: leases with each tenant's live usage (quota admission),
//! and partitions by GPU with each GPU's MPS load (placement) and the uids its shared
//! MPS servers serve (binding).
//!
//! A change goes through `get_mut`, whose guard takes the entry out of the indexes
//! and puts it back when dropped: an index cannot miss a change.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;

use crate::config::Amounts;
use crate::gpu::MpsMode;
use crate::model::{Lease, LeaseState, MpsPart, PartKind, Partition};
use crate::partition::{MpsLoad, MpsShare};

use super::quota;

/// What a tenant's live leases hold, summed without overflow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Usage {
    leases: u64,
    mig_slices: u64,
    mps_sm_percent: u64,
    memory_bytes: u128,
    whole_gpus: u64,
}

impl Usage {
    fn add(&mut self, a: Amounts) {
        self.leases += 1;
        self.mig_slices += u64::from(a.mig_slices);
        self.mps_sm_percent += u64::from(a.mps_sm_percent);
        self.memory_bytes += u128::from(a.memory_bytes);
        self.whole_gpus += u64::from(a.whole_gpus);
    }

    fn remove(&mut self, a: Amounts) {
        self.leases = self.leases.saturating_sub(1);
        self.mig_slices = self.mig_slices.saturating_sub(u64::from(a.mig_slices));
        self.mps_sm_percent = self
            .mps_sm_percent
            .saturating_sub(u64::from(a.mps_sm_percent));
        self.memory_bytes = self.memory_bytes.saturating_sub(u128::from(a.memory_bytes));
        self.whole_gpus = self.whole_gpus.saturating_sub(u64::from(a.whole_gpus));
    }

    /// As quota amounts (each saturating, as `quota::add` does).
    fn amounts(&self) -> Amounts {
        Amounts {
            mig_slices: u32::try_from(self.mig_slices).unwrap_or(u32::MAX),
            mps_sm_percent: u32::try_from(self.mps_sm_percent).unwrap_or(u32::MAX),
            memory_bytes: u64::try_from(self.memory_bytes).unwrap_or(u64::MAX),
            whole_gpus: u32::try_from(self.whole_gpus).unwrap_or(u32::MAX),
        }
    }
}

/// Records by id with an index of them that follows every change: a record is
/// counted out of the index before it changes and in again after.
#[derive(Debug)]
pub(crate) struct Indexed<T, I> {
    by_id: HashMap<String, T>,
    ix: I,
}

/// What an [`Indexed`] table keeps of its records besides their ids.
pub(crate) trait Index<T> {
    fn count_in(&mut self, t: &T);
    fn count_out(&mut self, t: &T);
}

impl<T, I: Default> Default for Indexed<T, I> {
    fn default() -> Self {
        Indexed {
            by_id: HashMap::new(),
            ix: I::default(),
        }
    }
}

impl<T, I: Index<T>> Indexed<T, I> {
    pub(crate) fn get(&self, id: &str) -> Option<&T> {
        self.by_id.get(id)
    }

    pub(crate) fn get_mut(&mut self, id: &str) -> Option<IndexedMut<'_, T, I>> {
        let item = self.by_id.get_mut(id)?;
        self.ix.count_out(item);
        Some(IndexedMut {
            item,
            ix: &mut self.ix,
        })
    }

    pub(crate) fn insert(&mut self, id: String, item: T) -> Option<T> {
        let old = self.by_id.remove(&id);
        if let Some(o) = &old {
            self.ix.count_out(o);
        }
        self.ix.count_in(&item);
        self.by_id.insert(id, item);
        old
    }

    pub(crate) fn remove(&mut self, id: &str) -> Option<T> {
        let old = self.by_id.remove(id)?;
        self.ix.count_out(&old);
        Some(old)
    }

    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &String> {
        self.by_id.keys()
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.by_id.values()
    }

    /// Change every record (a rare, whole-table update such as health marks).
    pub(crate) fn for_each_mut(&mut self, mut f: impl FnMut(&mut T)) {
        for item in self.by_id.values_mut() {
            self.ix.count_out(item);
            f(item);
            self.ix.count_in(item);
        }
    }
}

/// A record being changed; the index follows when it is dropped.
pub(crate) struct IndexedMut<'a, T, I: Index<T>> {
    item: &'a mut T,
    ix: &'a mut I,
}

impl<T, I: Index<T>> Deref for IndexedMut<'_, T, I> {
    type Target = T;
    fn deref(&self) -> &T {
        self.item
    }
}

impl<T, I: Index<T>> DerefMut for IndexedMut<'_, T, I> {
    fn deref_mut(&mut self) -> &mut T {
        self.item
    }
}

impl<T, I: Index<T>> Drop for IndexedMut<'_, T, I> {
    fn drop(&mut self) {
        self.ix.count_in(self.item);
    }
}

/// Leases by id, with what each tenant's live leases use, the active leases by
/// expiry and the revoking ones (what housekeeping looks at four times a second).
pub(crate) type Leases = Indexed<Lease, LeaseIndexes>;

#[derive(Debug, Default)]
pub(crate) struct LeaseIndexes {
    usage: HashMap<String, Usage>,
    active_by_expiry: BTreeSet<(i64, String)>,
    revoking: BTreeSet<String>,
}

impl Index<Lease> for LeaseIndexes {
    fn count_in(&mut self, l: &Lease) {
        count_in(self, l);
    }

    fn count_out(&mut self, l: &Lease) {
        count_out(self, l);
    }
}

fn count_in(ix: &mut LeaseIndexes, l: &Lease) {
    if l.state().is_live() {
        ix.usage
            .entry(l.tenant.clone())
            .or_default()
            .add(quota::amounts_of_lease(l));
    }
    match l.state() {
        LeaseState::Active => {
            ix.active_by_expiry.insert((l.expires_at_ms, l.id.clone()));
        }
        LeaseState::Revoking => {
            ix.revoking.insert(l.id.clone());
        }
        _ => {}
    }
}

fn count_out(ix: &mut LeaseIndexes, l: &Lease) {
    if l.state().is_live()
        && let Some(u) = ix.usage.get_mut(&l.tenant)
    {
        u.remove(quota::amounts_of_lease(l));
        if u.leases == 0 {
            ix.usage.remove(&l.tenant);
        }
    }
    match l.state() {
        LeaseState::Active => {
            ix.active_by_expiry.remove(&(l.expires_at_ms, l.id.clone()));
        }
        LeaseState::Revoking => {
            ix.revoking.remove(&l.id);
        }
        _ => {}
    }
}

impl Leases {
    /// What `tenant`'s live (pending, active, revoking) leases use.
    pub(crate) fn live_usage(&self, tenant: &str) -> Amounts {
        self.ix
            .usage
            .get(tenant)
            .map(Usage::amounts)
            .unwrap_or_default()
    }

    /// The active leases that expire at `at_ms` or before, soonest first.
    pub(crate) fn active_expiring_by(&self, at_ms: i64) -> impl Iterator<Item = &Lease> {
        self.ix
            .active_by_expiry
            .range(..(at_ms.saturating_add(1), String::new()))
            .filter_map(|(_, id)| self.by_id.get(id))
    }

    /// The revoking leases.
    pub(crate) fn revoking(&self) -> impl Iterator<Item = &Lease> {
        self.ix.revoking.iter().filter_map(|id| self.by_id.get(id))
    }
}

/// Token hashes and the leases they name, both ways (a lease's tokens are dropped
/// with it without scanning every token).
#[derive(Debug, Default)]
pub(crate) struct Tokens {
    by_hash: HashMap<String, String>,
    by_lease: HashMap<String, Vec<String>>,
}

impl Tokens {
    /// The lease `hash` names.
    pub(crate) fn get(&self, hash: &str) -> Option<&String> {
        self.by_hash.get(hash)
    }

    pub(crate) fn insert(&mut self, hash: String, lease_id: String) {
        if let Some(old) = self.by_hash.insert(hash.clone(), lease_id.clone()) {
            self.unlink(&old, &hash);
        }
        self.by_lease.entry(lease_id).or_default().push(hash);
    }

    pub(crate) fn extend(&mut self, pairs: impl IntoIterator<Item = (String, String)>) {
        for (hash, lease_id) in pairs {
            self.insert(hash, lease_id);
        }
    }

    /// Forget every token of `lease_id`.
    pub(crate) fn remove_lease(&mut self, lease_id: &str) {
        for hash in self.by_lease.remove(lease_id).unwrap_or_default() {
            self.by_hash.remove(&hash);
        }
    }

    fn unlink(&mut self, lease_id: &str, hash: &str) {
        if let Some(v) = self.by_lease.get_mut(lease_id) {
            v.retain(|h| h != hash);
            if v.is_empty() {
                self.by_lease.remove(lease_id);
            }
        }
    }
}

/// The partitions of one GPU: MIG and whole-GPU ones by id, MPS shares summed, and
/// for each shared MPS server (by pipe directory) how many of its shares have a
/// container running as each uid.
#[derive(Debug, Default)]
pub(crate) struct GpuParts {
    pub(crate) placed: BTreeSet<String>,
    pub(crate) mps: MpsLoad,
    shared_owners: HashMap<PathBuf, BTreeMap<u32, usize>>,
    /// The shares of each shared MPS server on the GPU, by the server's key
    /// ([`Partition::mps_daemon_key`]).
    shared_servers: HashMap<String, BTreeSet<String>>,
}

/// The key of the shared MPS server `p` is a share of (None: not a shared share). A
/// shared server's key is its directory's name, whatever lease holds the share, so no
/// lease id is needed.
fn shared_server_key(p: &Partition) -> Option<String> {
    p.mps()
        .filter(|m| m.mode == MpsMode::Shared)
        .and_then(|_| p.mps_daemon_key(""))
}

/// A share of a shared MPS server with a container bound: its server and the uid.
fn shared_owner(p: &Partition) -> Option<(&MpsPart, u32)> {
    let m = p.mps().filter(|m| m.mode == MpsMode::Shared)?;
    Some((m, m.owner_uid?))
}

/// Partitions by id, indexed by GPU.
pub(crate) type Partitions = Indexed<Partition, ByGpu>;

/// The partitions of each GPU.
#[derive(Debug, Default)]
pub(crate) struct ByGpu(HashMap<u32, GpuParts>);

impl Index<Partition> for ByGpu {
    fn count_in(&mut self, p: &Partition) {
        place(&mut self.0, p);
    }

    fn count_out(&mut self, p: &Partition) {
        unplace(&mut self.0, p);
    }
}

fn share_of(p: &Partition) -> Option<MpsShare> {
    match &p.kind {
        // Shares inside a MIG instance are the instance's, not the GPU's (the
        // table skips them among the placed partitions).
        PartKind::Mps(m) if m.host.is_none() => Some(MpsShare {
            sm_percent: m.sm_percent,
            memory_bytes: m.memory_bytes,
            mode: m.mode,
        }),
        _ => None,
    }
}

fn place(by_gpu: &mut HashMap<u32, GpuParts>, p: &Partition) {
    let g = by_gpu.entry(p.gpu).or_default();
    match share_of(p) {
        Some(s) => g.mps.push(s),
        None => {
            g.placed.insert(p.id.clone());
        }
    }
    if let Some(key) = shared_server_key(p) {
        g.shared_servers
            .entry(key)
            .or_default()
            .insert(p.id.clone());
    }
    if let Some((m, uid)) = shared_owner(p) {
        *g.shared_owners
            .entry(m.pipe_dir.clone())
            .or_default()
            .entry(uid)
            .or_default() += 1;
    }
}

fn unplace(by_gpu: &mut HashMap<u32, GpuParts>, p: &Partition) {
    let Some(g) = by_gpu.get_mut(&p.gpu) else {
        return;
    };
    match share_of(p) {
        Some(s) => g.mps.remove(s),
        None => {
            g.placed.remove(&p.id);
        }
    }
    if let Some((m, uid)) = shared_owner(p)
        && let Some(uids) = g.shared_owners.get_mut(&m.pipe_dir)
    {
        if let Some(n) = uids.get_mut(&uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                uids.remove(&uid);
            }
        }
        if uids.is_empty() {
            g.shared_owners.remove(&m.pipe_dir);
        }
    }
    if let Some(key) = shared_server_key(p)
        && let Some(ids) = g.shared_servers.get_mut(&key)
    {
        ids.remove(&p.id);
        if ids.is_empty() {
            g.shared_servers.remove(&key);
        }
    }
    if g.placed.is_empty()
        && g.mps.is_empty()
        && g.shared_owners.is_empty()
        && g.shared_servers.is_empty()
    {
        by_gpu.remove(&p.gpu);
    }
}

impl Partitions {
    /// The MIG and whole-GPU partitions on `gpu`, and the sum of its MPS shares.
    pub(crate) fn on_gpu(&self, gpu: u32) -> (impl Iterator<Item = &Partition>, MpsLoad) {
        let parts = self.ix.0.get(&gpu);
        let placed = parts
            .into_iter()
            .flat_map(|g| g.placed.iter())
            .filter_map(|id| self.by_id.get(id));
        (placed, parts.map(|g| g.mps).unwrap_or_default())
    }

    /// The shares of the shared MPS server `key` on `gpu`.
    pub(crate) fn shared_server_shares(
        &self,
        gpu: u32,
        key: &str,
    ) -> impl Iterator<Item = &Partition> {
        self.ix
            .0
            .get(&gpu)
            .and_then(|g| g.shared_servers.get(key))
            .into_iter()
            .flatten()
            .filter_map(|id| self.by_id.get(id))
    }

    /// The uid that the shared MPS server of `p` serves for its other shares: the uid
    /// of a container bound to another share of the same server. None when `p` is not
    /// a shared-mode share or no other share of its server has a container.
    pub(crate) fn shared_server_owner(&self, p: &Partition) -> Option<u32> {
        let m = p.mps().filter(|m| m.mode == MpsMode::Shared)?;
        let uids = self.ix.0.get(&p.gpu)?.shared_owners.get(&m.pipe_dir)?;
        // What the table holds for `p` itself is counted in the index: leave it out.
        let own = self
            .by_id
            .get(&p.id)
            .and_then(shared_owner)
            .filter(|(o, _)| o.pipe_dir == m.pipe_dir)
            .map(|(_, uid)| uid);
        uids.iter()
            .find(|&(uid, n)| *n > usize::from(own == Some(*uid)))
            .map(|(uid, _)| *uid)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    use super::*;
    use crate::model::{MpsPart, NewLease, Origin, PartitionState};
    use crate::partition::Shape;

    const GIB: u64 = 1 << 30;

    fn mps_lease(id: &str, tenant: &str, sm: u32) -> Lease {
        Lease::reserved(
            NewLease {
                id: id.into(),
                tenant: tenant.into(),
                shape: Shape::Mps {
                    sm_percent: sm,
                    memory_bytes: GIB,
                    mode: crate::gpu::MpsMode::Isolated,
                },
                partition_id: format!("p-{id}"),
                gpu: 0,
                more_partitions: vec![],
                created_at_ms: 1,
                ttl_secs: 60,
                request_id: None,
                labels: BTreeMap::new(),
                priority_class: String::new(),
                burst: false,
            },
            true,
        )
    }

    /// What the tenant's live leases use, summed the slow way.
    fn scanned(leases: &Leases, tenant: &str) -> Amounts {
        leases
            .values()
            .filter(|l| l.tenant == tenant && l.state().is_live())
            .fold(Amounts::default(), |acc, l| {
                quota::add(acc, quota::amounts_of(&l.shape))
            })
    }

    #[test]
    fn tenant_usage_follows_every_change_of_a_lease() {
        let mut leases = Leases::default();
        for (i, tenant) in ["a", "a", "b", "a"].iter().enumerate() {
            let l = mps_lease(&format!("l{i}"), tenant, 10 + i as u32);
            leases.insert(l.id.clone(), l);
        }
        let check = |leases: &Leases| {
            for t in ["a", "b", "c"] {
                assert_eq!(leases.live_usage(t), scanned(leases, t), "tenant {t}");
            }
        };
        check(&leases);
        assert_eq!(leases.live_usage("a").mps_sm_percent, 10 + 11 + 13);

        // Through the guard: pending -> active -> revoking -> released.
        leases.get_mut("l0").unwrap().activate().unwrap();
        check(&leases);
        leases
            .get_mut("l0")
            .unwrap()
            .begin_end(LeaseState::Released, "done")
            .unwrap();
        check(&leases);
        assert_eq!(leases.live_usage("a").mps_sm_percent, 10 + 11 + 13);
        leases.get_mut("l0").unwrap().finish_end(5).unwrap();
        check(&leases);
        assert_eq!(leases.live_usage("a").mps_sm_percent, 11 + 13);

        // A failed creation, a replaced record, a removal, a whole-table update.
        leases.get_mut("l1").unwrap().fail("no".into(), 3).unwrap();
        check(&leases);
        let mut other = mps_lease("l3", "b", 40);
        other.activate().unwrap();
        leases.insert("l3".into(), other);
        check(&leases);
        leases.remove("l2");
        leases.for_each_mut(|l| l.unhealthy = Some("xid".into()));
        check(&leases);
        assert_eq!(leases.live_usage("a"), Amounts::default());
        assert_eq!(leases.live_usage("b").mps_sm_percent, 40);
    }

    #[test]
    fn active_leases_by_expiry_and_revoking_ones_follow_changes() {
        let mut leases = Leases::default();
        for (i, expires) in [300, 100, 200].iter().enumerate() {
            let mut l = mps_lease(&format!("l{i}"), "a", 1);
            l.expires_at_ms = *expires;
            leases.insert(l.id.clone(), l);
        }
        let ids = |it: Box<dyn Iterator<Item = &Lease> + '_>| -> Vec<String> {
            it.map(|l| l.id.clone()).collect()
        };
        // Pending leases are not active yet.
        assert!(ids(Box::new(leases.active_expiring_by(1000))).is_empty());
        for id in ["l0", "l1", "l2"] {
            leases.get_mut(id).unwrap().activate().unwrap();
        }
        assert_eq!(ids(Box::new(leases.active_expiring_by(200))), ["l1", "l2"]);
        assert_eq!(
            ids(Box::new(leases.active_expiring_by(99))),
            Vec::<String>::new()
        );
        // A renewal moves it; a revocation takes it out and into the revoking set.
        leases.get_mut("l1").unwrap().expires_at_ms = 400;
        leases
            .get_mut("l2")
            .unwrap()
            .begin_end(LeaseState::Revoked, "gone")
            .unwrap();
        assert_eq!(ids(Box::new(leases.active_expiring_by(350))), ["l0"]);
        assert_eq!(ids(Box::new(leases.revoking())), ["l2"]);
        leases.get_mut("l2").unwrap().finish_end(9).unwrap();
        assert!(ids(Box::new(leases.revoking())).is_empty());
        leases.remove("l1");
        assert_eq!(ids(Box::new(leases.active_expiring_by(i64::MAX))), ["l0"]);
    }

    fn part(id: &str, gpu: u32, kind: PartKind) -> Partition {
        Partition {
            id: id.into(),
            gpu,
            gpu_uuid: format!("GPU-{gpu}"),
            origin: Origin::Dynamic,
            state: PartitionState::Ready,
            lease_id: Some(format!("l-{id}")),
            kind,
        }
    }

    fn mps(sm: u32) -> PartKind {
        PartKind::Mps(MpsPart {
            sm_percent: sm,
            memory_bytes: GIB,
            pipe_dir: PathBuf::from("/run/p"),
            log_dir: PathBuf::from("/run/l"),
            owner_uid: None,
            host: None,
            mode: crate::gpu::MpsMode::Isolated,
        })
    }

    #[test]
    fn a_lease_s_tokens_go_with_it() {
        let mut t = Tokens::default();
        t.extend([
            ("h1".to_string(), "a".to_string()),
            ("h2".into(), "b".into()),
        ]);
        t.insert("h3".into(), "a".into());
        // A hash named again moves to its new lease.
        t.insert("h2".into(), "a".into());
        t.remove_lease("a");
        assert_eq!((t.get("h1"), t.get("h2"), t.get("h3")), (None, None, None));
        t.insert("h4".into(), "b".into());
        t.remove_lease("a");
        assert_eq!(t.get("h4").map(String::as_str), Some("b"));
        t.remove_lease("b");
        assert!(t.by_hash.is_empty() && t.by_lease.is_empty());
    }

    #[test]
    fn partitions_by_gpu_follow_inserts_changes_and_removals() {
        let mut parts = Partitions::default();
        parts.insert("a".into(), part("a", 0, mps(10)));
        parts.insert("b".into(), part("b", 0, mps(20)));
        parts.insert("c".into(), part("c", 1, PartKind::WholeGpu));
        parts.insert("d".into(), part("d", 1, mps(5)));
        let (placed, load) = parts.on_gpu(0);
        assert_eq!(placed.count(), 0);
        assert_eq!((load.len(), load.sm_percent), (2, 30));
        let (placed, load) = parts.on_gpu(1);
        assert_eq!(placed.map(|p| p.id.clone()).collect::<Vec<_>>(), ["c"]);
        assert_eq!(load.sm_percent, 5);

        // A change of size through the guard, a move to another GPU, a removal.
        if let PartKind::Mps(m) = &mut parts.get_mut("a").unwrap().kind {
            m.sm_percent = 15;
        }
        parts.get_mut("d").unwrap().gpu = 0;
        parts.remove("c");
        parts.insert("b".into(), part("b", 0, mps(1)));
        let (placed, load) = parts.on_gpu(0);
        assert_eq!(placed.count(), 0);
        assert_eq!((load.len(), load.sm_percent), (3, 15 + 5 + 1));
        let (placed, load) = parts.on_gpu(1);
        assert_eq!((placed.count(), load), (0, MpsLoad::default()));
        assert_eq!(parts.len(), 3);
    }

    fn shared(pipe: &str, owner: Option<u32>) -> PartKind {
        let PartKind::Mps(mut m) = mps(10) else {
            unreachable!()
        };
        m.mode = crate::gpu::MpsMode::Shared;
        m.pipe_dir = PathBuf::from(pipe);
        m.owner_uid = owner;
        PartKind::Mps(m)
    }

    fn set_owner(parts: &mut Partitions, id: &str, uid: Option<u32>) {
        if let PartKind::Mps(m) = &mut parts.get_mut(id).unwrap().kind {
            m.owner_uid = uid;
        }
    }

    #[test]
    fn a_shared_server_s_shares_are_found_by_gpu_and_server() {
        let mut parts = Partitions::default();
        parts.insert("a".into(), part("a", 0, shared("/run/mps/s0/pipe", None)));
        parts.insert(
            "b".into(),
            part("b", 0, shared("/run/mps/s0/pipe", Some(7))),
        );
        parts.insert("c".into(), part("c", 0, shared("/run/mps/s1/pipe", None)));
        parts.insert("d".into(), part("d", 1, shared("/run/mps/s0/pipe", None)));
        parts.insert("i".into(), part("i", 0, mps(10)));
        let shares = |parts: &Partitions, gpu: u32, key: &str| {
            let mut ids: Vec<String> = parts
                .shared_server_shares(gpu, key)
                .map(|p| p.id.clone())
                .collect();
            ids.sort();
            ids
        };
        assert_eq!(shares(&parts, 0, "s0"), ["a", "b"]);
        assert_eq!(shares(&parts, 0, "s1"), ["c"]);
        assert_eq!(shares(&parts, 1, "s0"), ["d"], "another GPU's server");
        assert!(
            shares(&parts, 0, "i").is_empty(),
            "an isolated share is no server's"
        );
        // A move to another GPU, a change of server through the guard, a removal.
        parts.get_mut("a").unwrap().gpu = 1;
        if let PartKind::Mps(m) = &mut parts.get_mut("c").unwrap().kind {
            m.pipe_dir = PathBuf::from("/run/mps/s0/pipe");
        }
        parts.remove("b");
        assert_eq!(shares(&parts, 0, "s0"), ["c"]);
        assert!(shares(&parts, 0, "s1").is_empty());
        assert_eq!(shares(&parts, 1, "s0"), ["a", "d"]);
        for id in ["a", "c", "d", "i"] {
            parts.remove(id);
        }
        assert!(parts.ix.0.is_empty(), "{:?}", parts.ix.0);
    }

    #[test]
    fn a_shared_server_s_uid_is_the_one_its_other_shares_run_as() {
        let mut parts = Partitions::default();
        parts.insert("a".into(), part("a", 0, shared("/run/s0", None)));
        parts.insert("b".into(), part("b", 0, shared("/run/s0", None)));
        parts.insert("c".into(), part("c", 1, shared("/run/s1", Some(7))));
        parts.insert("i".into(), part("i", 0, mps(10)));
        let owner = |parts: &Partitions, id: &str| {
            let p = parts.get(id).unwrap().clone();
            parts.shared_server_owner(&p)
        };
        assert_eq!(owner(&parts, "a"), None, "no container bound yet");
        set_owner(&mut parts, "a", Some(1000));
        assert_eq!(owner(&parts, "b"), Some(1000), "b shares a's server");
        assert_eq!(owner(&parts, "a"), None, "a's own uid does not bind a");
        assert_eq!(
            owner(&parts, "i"),
            None,
            "an isolated share has no shared owner"
        );
        set_owner(&mut parts, "b", Some(1000));
        assert_eq!(owner(&parts, "a"), Some(1000));
        // Another GPU's server serves its own uid.
        let mut on_1 = parts.get("b").unwrap().clone();
        on_1.gpu = 1;
        on_1.id = "x".into();
        if let PartKind::Mps(m) = &mut on_1.kind {
            m.pipe_dir = PathBuf::from("/run/s1");
        }
        assert_eq!(parts.shared_server_owner(&on_1), Some(7));
        // The containers go: the server serves nobody.
        set_owner(&mut parts, "a", None);
        assert_eq!(owner(&parts, "a"), Some(1000), "b still runs as 1000");
        parts.remove("b");
        assert_eq!(owner(&parts, "a"), None);
        parts.remove("a");
        parts.remove("i");
        parts.remove("c");
        assert_eq!(parts.len(), 0);
        assert!(parts.ix.0.is_empty(), "{:?}", parts.ix.0);
    }
}
