//! An outcome as the store and the table take it: its rows written in one
//! transaction ([`write_outcome_rows`]), the same applied to the table ([`apply`],
//! with its [`Marks`]), and what a change's outcome replaced, put back when its
//! commit is refused ([`Replaced`]). The executor calls these; they take no lock.

use crate::model::{Lease, Partition};
use crate::store::{StoreError, Writer};

use super::plan::{Marks, Outcome};
use super::table::State;

/// An outcome's rows, in one transaction: leases (the ended ones with their usage
/// record), partitions deleted then written, the ended leases' tokens, the intents.
pub(super) fn write_outcome_rows(w: &Writer<'_>, o: &Outcome) -> Result<(), StoreError> {
    for l in &o.ended {
        w.put_lease(l)?;
    }
    if let Some((l, usage)) = &o.usage {
        crate::usage::insert_record(w.conn(), l, usage)?;
    }
    for l in &o.leases {
        w.put_lease(l)?;
    }
    for id in &o.gone {
        w.delete_partition(id)?;
    }
    for p in &o.parts {
        w.put_partition(p)?;
    }
    for l in &o.ended {
        w.delete_tokens(&l.id)?;
    }
    for (i, at, how) in &o.finished {
        w.finish_intent(*i, *at, how)?;
    }
    for g in &o.quota_grants {
        w.put_grant(g)?;
    }
    for m in &o.marked {
        w.put_health_mark(m)?;
    }
    for m in &o.unmarked {
        w.delete_health_mark(&m.key())?;
    }
    Ok(())
}

/// Step 5 of an outcome: the table as the commit left the store.
pub(super) fn apply(st: &mut State, o: Outcome) {
    for id in &o.gone {
        st.partitions.remove(id);
    }
    for p in o.parts {
        st.partitions.insert(p.id.clone(), p);
    }
    for l in o.leases {
        if let Some(mut held) = st.leases.get_mut(&l.id) {
            *held = l;
        }
    }
    for l in &o.ended {
        st.forget_lease(l);
    }
    apply_marks(st, o.marks);
    let health_changed = !(o.marked.is_empty() && o.unmarked.is_empty());
    for m in o.marked {
        st.health.insert((m.gpu, m.gi_id), m);
    }
    for m in &o.unmarked {
        st.health.remove(&(m.gpu, m.gi_id));
    }
    if health_changed {
        st.refresh_lease_health();
    }
}

/// The table's bookkeeping of an outcome.
fn apply_marks(st: &mut State, m: Marks) {
    for id in m.notices_sent {
        st.expiring_notified.insert(id);
    }
    for id in &m.notices_cleared {
        st.expiring_notified.remove(id);
    }
    st.resolved.extend(m.resolved);
    st.tearing_down.extend(m.tearing_down);
    for (id, backoff) in m.teardown_backoff {
        match backoff {
            Some(b) => st.teardown_backoff.insert(id, b),
            None => st.teardown_backoff.remove(&id),
        };
    }
    for (id, backoff) in m.mps_backoff {
        match backoff {
            Some(b) => st.mps_backoff.insert(id, b),
            None => st.mps_backoff.remove(&id),
        };
    }
    st.foreign.extend(m.foreign);
    if let Some(at) = m.mps_checked_ms {
        st.mps_checked_ms = at;
    }
    for h in m.host_claims {
        *st.host_claims.entry(h).or_default() += 1;
    }
    if let Some(read) = m.gpu_read
        && let Some(g) = st.gpus.iter_mut().find(|g| g.info.index == read.gpu)
    {
        if let Some(info) = read.info {
            g.info = info;
        }
        g.profiles = read.profiles;
    }
}

/// What a [`Change`]'s outcome replaced in the table: put back when its commit is
/// refused.
pub(super) struct Replaced {
    leases: Vec<Option<Lease>>,
    parts: Vec<Option<Partition>>,
    notified: Vec<bool>,
}

impl Replaced {
    pub(super) fn of(st: &State, o: &Outcome) -> Self {
        Replaced {
            leases: o
                .leases
                .iter()
                .map(|l| st.leases.get(&l.id).cloned())
                .collect(),
            parts: o
                .parts
                .iter()
                .map(|p| st.partitions.get(&p.id).cloned())
                .collect(),
            notified: o
                .marks
                .notices_cleared
                .iter()
                .map(|id| st.expiring_notified.contains(id))
                .collect(),
        }
    }

    /// Every record of `applied` the table still holds as applied, as it was.
    pub(super) fn restore(self, st: &mut State, applied: &Outcome) {
        for (now, before) in applied.leases.iter().zip(self.leases) {
            if let (Some(mut held), Some(before)) = (st.leases.get_mut(&now.id), before)
                && *held == *now
            {
                *held = before;
            }
        }
        for (now, before) in applied.parts.iter().zip(self.parts) {
            if st.partitions.get(&now.id) != Some(now) {
                continue;
            }
            match before {
                Some(before) => {
                    st.partitions.insert(now.id.clone(), before);
                }
                None => {
                    st.partitions.remove(&now.id);
                }
            }
        }
        for (id, was) in applied.marks.notices_cleared.iter().zip(self.notified) {
            if was {
                st.expiring_notified.insert(id.clone());
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::model::{Origin, PartKind, PartitionState};

    fn part(id: &str, state: PartitionState) -> Partition {
        Partition {
            id: id.into(),
            gpu: 0,
            gpu_uuid: "GPU-0".into(),
            origin: Origin::Dynamic,
            state,
            lease_id: None,
            kind: PartKind::WholeGpu,
        }
    }

    /// A refused change is undone record by record, except where a later change
    /// has replaced what it applied.
    #[test]
    fn a_refused_change_is_put_back_but_a_later_change_is_kept() {
        let mut st = State::default();
        st.partitions
            .insert("a".into(), part("a", PartitionState::Ready));
        st.partitions
            .insert("b".into(), part("b", PartitionState::Ready));
        st.expiring_notified.insert("l1".into());
        let change = Outcome {
            parts: vec![
                part("a", PartitionState::Destroying),
                part("b", PartitionState::Destroying),
                part("c", PartitionState::Creating),
            ],
            marks: Marks {
                notices_cleared: vec!["l1".into()],
                ..Marks::default()
            },
            ..Outcome::default()
        };
        let replaced = Replaced::of(&st, &change);
        apply(&mut st, change.clone());
        assert!(!st.expiring_notified.contains("l1"));
        // Another change replaces b before the commit is refused.
        st.partitions
            .insert("b".into(), part("b", PartitionState::Ready));
        st.partitions.get_mut("b").unwrap().lease_id = Some("l2".into());
        replaced.restore(&mut st, &change);
        assert_eq!(st.partitions.get("a").unwrap().state, PartitionState::Ready);
        assert_eq!(
            st.partitions.get("b").unwrap().lease_id.as_deref(),
            Some("l2"),
            "the later change stays"
        );
        assert!(st.partitions.get("c").is_none(), "a record it added goes");
        assert!(st.expiring_notified.contains("l1"), "the notice is back");
    }
}
