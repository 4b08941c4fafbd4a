//! GPU health: marks GPUs and MIG instances out of service (from NVML events, polls
//! or an operator), keeps the marks in the store until they are back, tells the
//! leases on them, and keeps new placements off them.
//!
//! A mark is written to the store before it takes effect in memory, and cleared in
//! the same order, so a restart neither forgets a sick GPU nor revives one.

use std::sync::Arc;
use std::time::Duration;

use tessera_common::clock::now_ms;
use tracing::{error, info, warn};

use crate::config::OnUnhealthy;
use crate::gpu::{HealthCause, HealthEvent};
use crate::model::{HealthMark, LeaseState, PartKind};

use super::error::LeaseError;
use super::events::EventKind;
use super::manager::LeaseManager;
use super::plan::{GpuRead, Marks, Outcome, Publish};
use super::table::State;

/// Where a health change comes from (for the log and the events).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthSource {
    Event,
    Poll,
    Operator,
}

impl HealthSource {
    fn as_str(self) -> &'static str {
        match self {
            HealthSource::Event => "NVML event",
            HealthSource::Poll => "NVML poll",
            HealthSource::Operator => "operator",
        }
    }
}

impl State {
    /// The mark that keeps `gpu` (or its instance `gi_id`) out of service, if any:
    /// a GPU-wide mark covers every instance.
    pub(super) fn unhealthy(&self, gpu: u32, gi_id: Option<u32>) -> Option<&HealthMark> {
        self.health
            .get(&(gpu, None))
            .or_else(|| gi_id.and_then(|gi| self.health.get(&(gpu, Some(gi)))))
    }

    /// Set each live lease's `unhealthy` from the marks.
    pub(super) fn refresh_lease_health(&mut self) {
        let State {
            leases,
            partitions,
            health,
            ..
        } = self;
        leases.for_each_mut(|l| {
            // Any of its partitions out of service (a multi-partition lease has
            // several GPUs or instances).
            let mark = l.partition_ids().find_map(|id| {
                let p = partitions.get(id);
                let gpu = p.map_or(l.gpu, |p| p.gpu);
                let gi = p.and_then(|p| p.mig()).and_then(|m| m.gi_id);
                health
                    .get(&(gpu, None))
                    .or_else(|| gi.and_then(|gi| health.get(&(gpu, Some(gi)))))
            });
            l.unhealthy = mark.map(HealthMark::describe);
        });
    }
}

impl LeaseManager {
    /// Every GPU and instance out of service now.
    pub fn health_marks(&self) -> Vec<HealthMark> {
        let mut marks: Vec<HealthMark> = self.read().health.values().cloned().collect();
        marks.sort_by_key(|m| (m.gpu, m.gi_id));
        marks
    }

    /// The marks the store kept, on the GPUs as they are indexed now (matched by
    /// UUID). Marks of GPUs this host no longer has are kept in the store, unused.
    pub(super) fn load_health(&self, st: &mut State) -> Result<(), LeaseError> {
        for mut m in self.store.health_marks()? {
            let Some(g) = st.gpus.iter().find(|g| g.info.uuid == m.gpu_uuid) else {
                warn!(gpu = %m.gpu_uuid, "a health mark names a GPU this host does not have");
                continue;
            };
            m.gpu = g.info.index;
            warn!(mark = %m.describe(), "out of service since before this start");
            st.health.insert((m.gpu, m.gi_id), m);
        }
        // Leases are loaded healthy (it is not stored): without marks there is
        // nothing to refresh (it visits every lease).
        if !st.health.is_empty() {
            st.refresh_lease_health();
        }
        Ok(())
    }

    /// An event from the hardware. Non-critical ones are logged only.
    pub async fn apply_health_event(&self, ev: HealthEvent) {
        if !ev.is_critical() {
            info!(gpu = ev.gpu, gi = ?ev.gi_id, cause = %ev.cause, "GPU event (not a hardware fault)");
            return;
        }
        let gi = ev.instance_scope();
        if let Err(e) = self
            .mark_unhealthy(ev.gpu, gi, ev.cause, HealthSource::Event)
            .await
        {
            error!(gpu = ev.gpu, error = %e, "could not record a GPU health event");
        }
    }

    /// Take `gpu` (or its instance) out of service. Returns false when it already
    /// was (the first cause stays).
    pub async fn mark_unhealthy(
        &self,
        gpu: u32,
        gi_id: Option<u32>,
        cause: HealthCause,
        source: HealthSource,
    ) -> Result<bool, LeaseError> {
        let mark = {
            let st = self.read();
            let Some(g) = st.gpus.iter().find(|g| g.info.index == gpu) else {
                return Err(LeaseError::NotFound(format!("no GPU {gpu}")));
            };
            if st.health.contains_key(&(gpu, gi_id)) {
                return Ok(false);
            }
            HealthMark {
                gpu_uuid: g.info.uuid.clone(),
                gpu,
                gi_id,
                cause,
                since_ms: now_ms(),
            }
        };
        let marked = Outcome {
            marked: vec![mark.clone()],
            ..Outcome::default()
        };
        self.commit(marked, Publish::IfCommitted).await?;
        warn!(mark = %mark.describe(), source = source.as_str(), "taken out of service: no new placements");
        let affected = self.leases_under(&self.read(), gpu, gi_id);
        let revoke = self.config.health.on_unhealthy == OnUnhealthy::Revoke;
        for (lease, partition) in &affected {
            let then = if revoke {
                "the lease is revoked ([health] on_unhealthy = \"revoke\")"
            } else {
                "the lease keeps running; no new placements there"
            };
            self.emit(
                EventKind::Unhealthy,
                lease,
                partition.as_ref(),
                format!("{} ({}): {then}", mark.describe(), source.as_str()),
            );
        }
        if revoke {
            for (lease, _) in affected {
                let reason = format!("unhealthy: {}", mark.describe());
                if let Err(e) = self.end(&lease.id, LeaseState::Revoked, &reason).await {
                    warn!(lease = %lease.id, error = %e, "could not revoke a lease on an unhealthy GPU");
                }
            }
        }
        Ok(true)
    }

    /// Return `gpu` (or its instance) to service. Returns the mark it cleared.
    pub async fn mark_healthy(
        &self,
        gpu: u32,
        gi_id: Option<u32>,
        source: HealthSource,
        why: &str,
    ) -> Result<Option<HealthMark>, LeaseError> {
        let Some(mark) = self.read().health.get(&(gpu, gi_id)).cloned() else {
            if !self.read().gpus.iter().any(|g| g.info.index == gpu) {
                return Err(LeaseError::NotFound(format!("no GPU {gpu}")));
            }
            return Ok(None);
        };
        // A GPU that could not be read is read again first: one that still does
        // not answer stays out of service, whoever asks (nothing of it is known to
        // serve a lease with: its device node, its memory, its mode).
        if gi_id.is_none()
            && let Err(e) = self.refresh_gpu(gpu).await
        {
            let unreadable = self
                .read()
                .gpus
                .iter()
                .any(|g| g.info.index == gpu && g.info.fault.is_some());
            if unreadable {
                return Err(LeaseError::Hardware(e));
            }
            warn!(gpu, error = %e, "could not read the MIG profiles of a GPU back in service");
        }
        let unmarked = Outcome {
            unmarked: vec![mark.clone()],
            ..Outcome::default()
        };
        self.commit(unmarked, Publish::IfCommitted).await?;
        info!(mark = %mark.describe(), source = source.as_str(), why, "back in service");
        let affected = self.leases_under(&self.read(), gpu, gi_id);
        for (lease, partition) in &affected {
            self.emit(
                EventKind::Healthy,
                lease,
                partition.as_ref(),
                format!(
                    "back in service ({}: {why}); was {}",
                    source.as_str(),
                    mark.describe()
                ),
            );
        }
        Ok(Some(mark))
    }

    /// A GPU that did not answer (at start or since) read again: its description
    /// where it was unreadable, its MIG profiles where none were read. Err while it
    /// still does not answer; nothing changes then.
    async fn refresh_gpu(&self, gpu: u32) -> Result<(), crate::gpu::GpuError> {
        let (faulty, mig, needs_profiles) = {
            let st = self.read();
            let Some(g) = st.gpus.iter().find(|g| g.info.index == gpu) else {
                return Ok(());
            };
            (
                g.info.fault.is_some(),
                g.info.mig_current,
                g.profiles.is_empty(),
            )
        };
        if !(faulty || (mig && needs_profiles)) {
            return Ok(());
        }
        let backend = self.backend.clone();
        let read = tokio::task::spawn_blocking(move || {
            let info = if faulty {
                Some(backend.device(gpu)?)
            } else {
                None
            };
            let profiles = if info.as_ref().map_or(mig, |i| i.mig_current) {
                read_profiles(backend.as_ref(), gpu)?
            } else {
                Vec::new()
            };
            Ok::<_, crate::gpu::GpuError>((info, profiles))
        })
        .await
        .map_err(|e| crate::gpu::GpuError::Task(e.to_string()))?;
        let (info, profiles) = read?;
        self.publish_only(Outcome::marks(Marks {
            gpu_read: Some(GpuRead {
                gpu,
                info,
                profiles,
            }),
            ..Marks::default()
        }));
        Ok(())
    }

    /// Live leases on `gpu` (on its instance `gi_id` only, when given).
    fn leases_under(
        &self,
        st: &State,
        gpu: u32,
        gi_id: Option<u32>,
    ) -> Vec<(crate::model::Lease, Option<crate::model::Partition>)> {
        st.leases
            .values()
            .filter(|l| l.state().is_live())
            .filter_map(|l| {
                // Any partition of the lease (several for a multi-partition lease).
                l.partition_ids().find_map(|id| {
                    let p = st.partitions.get(id);
                    if p.map_or(l.gpu, |p| p.gpu) != gpu {
                        return None;
                    }
                    let on_it = match (gi_id, p.map(|p| &p.kind)) {
                        (None, _) => true,
                        (Some(gi), Some(PartKind::Mig(m))) => m.gi_id == Some(gi),
                        (Some(_), _) => false,
                    };
                    on_it.then(|| (l.clone(), p.cloned()))
                })
            })
            .collect()
    }

    /// Poll every GPU for what events do not cover; clear poll-made marks that the
    /// hardware says are over.
    pub async fn poll_health(&self) {
        let gpus: Vec<u32> = self.read().gpus.iter().map(|g| g.info.index).collect();
        for gpu in gpus {
            let backend = self.backend.clone();
            let read = tokio::task::spawn_blocking(move || backend.health_poll(gpu)).await;
            let reading = match read {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    warn!(gpu, error = %e, "GPU health poll failed");
                    continue;
                }
                Err(_) => continue,
            };
            let current = self.read().health.get(&(gpu, None)).cloned();
            let result = match (reading, current) {
                (Some(cause), None) => self
                    .mark_unhealthy(gpu, None, cause, HealthSource::Poll)
                    .await
                    .map(|_| ()),
                (None, Some(m)) if m.cause.clears_by_poll() => match self.refresh_gpu(gpu).await {
                    Ok(()) => self
                        .mark_healthy(gpu, None, HealthSource::Poll, "the poll reads healthy")
                        .await
                        .map(|_| ()),
                    // Answers the poll but not yet the queries it is served by.
                    Err(e) => {
                        info!(gpu, error = %e, "GPU not yet back: it is read again at the next poll");
                        Ok(())
                    }
                },
                _ => Ok(()),
            };
            if let Err(e) = result {
                error!(gpu, error = %e, "could not record a GPU health change");
            }
        }
    }

    /// Wait for NVML health events (on a blocking thread, one wait at a time) and
    /// poll on `[health] poll_interval`, until `stop` fires.
    pub async fn run_health_watch(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        let poll_every = self.config.health.poll_interval;
        let mut next_poll = tokio::time::Instant::now();
        let mut failures = 0u32;
        loop {
            if *stop.borrow() {
                return;
            }
            if !poll_every.is_zero() && tokio::time::Instant::now() >= next_poll {
                self.poll_health().await;
                next_poll = tokio::time::Instant::now() + poll_every;
            }
            if !self.config.health.watch_events {
                tokio::select! {
                    _ = tokio::time::sleep_until(next_poll) => continue,
                    _ = stop.changed() => return,
                }
            }
            let backend = self.backend.clone();
            let wait = tokio::task::spawn_blocking(move || {
                backend.health_events(Duration::from_millis(500))
            });
            let events = tokio::select! {
                r = wait => r,
                _ = stop.changed() => return,
            };
            match events {
                Ok(Ok(events)) => {
                    failures = 0;
                    for ev in events {
                        self.apply_health_event(ev).await;
                    }
                }
                Ok(Err(e)) => {
                    // Without events, polling still covers what it can. Back off so
                    // a driver without event support does not spin.
                    failures = failures.saturating_add(1);
                    if failures == 1 {
                        warn!(error = %e, "cannot wait for GPU health events; polling only until this clears");
                    }
                    let pause = Duration::from_secs(1 << failures.min(6));
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = stop.changed() => return,
                    }
                }
                Err(_) => return,
            }
        }
    }
}

/// The MIG profiles of a GPU in MIG mode. None answering is an error: the GPU would
/// otherwise be shown with capacity it cannot give.
pub(super) fn read_profiles(
    backend: &dyn crate::gpu::GpuBackend,
    gpu: u32,
) -> Result<Vec<crate::gpu::GiProfile>, crate::gpu::GpuError> {
    let profiles = backend.gi_profiles(gpu)?;
    if profiles.is_empty() {
        return Err(crate::gpu::GpuError::Nvml {
            call: "nvmlDeviceGetGpuInstanceProfileInfoV",
            code: crate::gpu::NvmlCode::NotSupported,
            detail: format!("MIG is enabled on GPU {gpu} but no GPU-instance profile answers"),
        });
    }
    Ok(profiles)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;

    use super::*;
    use crate::config::Config;
    use crate::gpu::SimBackend;
    use crate::lease::CreateRequest;
    use crate::partition::Shape;
    use crate::store::Store;

    fn config(dir: &Path, extra: &str) -> Config {
        let text = format!(
            "[daemon]\nstate_dir = {d:?}\nrun_dir = {d:?}\n[gpu]\nbackend = \"sim\"\n\
             [sim]\nstate_file = {s:?}\n[[sim.gpus]]\nmodel = \"h100-80gb\"\n\
             [[sim.gpus]]\nmodel = \"h100-80gb\"\n{extra}",
            d = dir.display().to_string(),
            s = dir.join("sim.json").display().to_string(),
        );
        Config::parse(Path::new("test.toml"), &text).unwrap()
    }

    fn start(dir: &Path, extra: &str) -> (Arc<LeaseManager>, Arc<SimBackend>) {
        let cfg = config(dir, extra);
        let sim = Arc::new(crate::gpu::open_sim(&cfg.sim).unwrap());
        let store = Arc::new(Store::open(dir).unwrap());
        (LeaseManager::start(cfg, sim.clone(), store).unwrap(), sim)
    }

    fn ask(profile: &str, gpu: Option<u32>) -> CreateRequest {
        CreateRequest {
            tenant: "team-a".into(),
            shape: Some(Shape::Mig {
                profile: profile.into(),
                compute_profile: None,
            }),
            ttl: None,
            request_id: None,
            labels: BTreeMap::new(),
            priority_class: None,
            gpu_index: gpu,
            need: None,
            count: 0,
            topology: Default::default(),
            exact: None,
        }
    }

    #[tokio::test]
    async fn a_critical_xid_keeps_new_leases_off_the_gpu_tells_its_leases_and_outlives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (mgr, _sim) = start(dir.path(), "");
        let on0 = mgr.create(ask("1g.10gb", Some(0))).await.unwrap().lease;
        let mut events = mgr.subscribe();
        // An application XID says nothing about the hardware.
        mgr.apply_health_event(HealthEvent {
            gpu: 0,
            gi_id: None,
            cause: HealthCause::Xid { xid: 13 },
        })
        .await;
        assert!(mgr.health_marks().is_empty());
        mgr.apply_health_event(HealthEvent {
            gpu: 0,
            gi_id: None,
            cause: HealthCause::Xid { xid: 79 },
        })
        .await;
        let ev = events.recv().await.unwrap();
        assert_eq!(ev.kind, EventKind::Unhealthy);
        assert_eq!(ev.lease.id, on0.id);
        assert!(ev.message.contains("XID 79"), "{}", ev.message);
        let (l, _) = mgr.get(&on0.id).unwrap();
        assert!(l.unhealthy.as_deref().unwrap().contains("GPU 0"));
        assert_eq!(
            l.state(),
            LeaseState::Active,
            "default policy keeps the lease"
        );

        // Pinned to the sick GPU: a precise refusal. Unpinned: GPU 1, every time.
        let e = mgr.create(ask("1g.10gb", Some(0))).await.unwrap_err();
        assert!(matches!(e, LeaseError::GpuUnhealthy(_)), "{e}");
        for _ in 0..3 {
            assert_eq!(mgr.create(ask("1g.10gb", None)).await.unwrap().lease.gpu, 1);
        }
        let node = mgr.node();
        assert!(node[0].health.is_some() && node[1].health.is_none());

        // A restart remembers it; an operator brings it back.
        drop(events);
        mgr.begin_shutdown();
        drop(mgr);
        let (mgr, _sim) = start(dir.path(), "");
        assert_eq!(mgr.health_marks().len(), 1);
        assert!(mgr.get(&on0.id).unwrap().0.unhealthy.is_some());
        assert!(mgr.create(ask("1g.10gb", Some(0))).await.is_err());
        let cleared = mgr
            .mark_healthy(0, None, HealthSource::Operator, "reset done")
            .await
            .unwrap();
        assert!(cleared.is_some());
        assert!(mgr.get(&on0.id).unwrap().0.unhealthy.is_none());
        assert_eq!(
            mgr.create(ask("1g.10gb", Some(0))).await.unwrap().lease.gpu,
            0
        );
        assert!(mgr.store.health_marks().unwrap().is_empty());
    }

    #[tokio::test]
    async fn the_revoke_policy_ends_the_leases_on_a_sick_gpu_only() {
        let dir = tempfile::tempdir().unwrap();
        let (mgr, _sim) = start(dir.path(), "[health]\non_unhealthy = \"revoke\"\n");
        let on0 = mgr.create(ask("2g.20gb", Some(0))).await.unwrap().lease;
        let on1 = mgr.create(ask("2g.20gb", Some(1))).await.unwrap().lease;
        mgr.apply_health_event(HealthEvent {
            gpu: 0,
            gi_id: None,
            cause: HealthCause::DoubleBitEcc,
        })
        .await;
        let (l0, _) = mgr.get(&on0.id).unwrap();
        assert_eq!(l0.state(), LeaseState::Revoked);
        assert!(l0.end_reason().unwrap().contains("double-bit ECC"));
        assert_eq!(mgr.get(&on1.id).unwrap().0.state(), LeaseState::Active);
    }

    /// A lease of instances on both GPUs hears of its second GPU's fault, and the
    /// revoke policy ends it whole (all its instances destroyed).
    #[tokio::test]
    async fn a_multi_gpu_lease_follows_the_health_of_every_gpu_it_holds() {
        let dir = tempfile::tempdir().unwrap();
        let (mgr, sim) = start(dir.path(), "[health]\non_unhealthy = \"revoke\"\n");
        let three = mgr
            .create(CreateRequest {
                count: 3,
                ..ask("3g.40gb", None)
            })
            .await
            .unwrap()
            .lease;
        assert_eq!(three.gpu, 0, "its first partition is on gpu 0");
        let mut events = mgr.subscribe();
        mgr.apply_health_event(HealthEvent {
            gpu: 1,
            gi_id: None,
            cause: HealthCause::DoubleBitEcc,
        })
        .await;
        let ev = events.recv().await.unwrap();
        assert_eq!(
            (ev.kind, ev.lease.id.as_str()),
            (EventKind::Unhealthy, three.id.as_str())
        );
        let (l, _) = mgr.get(&three.id).unwrap();
        assert_eq!(l.state(), LeaseState::Revoked);
        assert!(l.end_reason().unwrap().contains("double-bit ECC"));
        use crate::gpu::GpuBackend;
        let left: usize = (0..2).map(|g| sim.instances(g).unwrap().len()).sum();
        assert_eq!(left, 0, "every instance of the lease went");
    }

    #[tokio::test]
    async fn a_contained_error_takes_out_its_instance_only() {
        let dir = tempfile::tempdir().unwrap();
        let (mgr, _sim) = start(dir.path(), "");
        let a = mgr.create(ask("2g.20gb", Some(0))).await.unwrap();
        let b = mgr.create(ask("2g.20gb", Some(0))).await.unwrap();
        let gi = a.partition.as_ref().unwrap().mig().unwrap().gi_id;
        mgr.apply_health_event(HealthEvent {
            gpu: 0,
            gi_id: gi,
            cause: HealthCause::Xid { xid: 94 },
        })
        .await;
        assert!(mgr.get(&a.lease.id).unwrap().0.unhealthy.is_some());
        assert!(mgr.get(&b.lease.id).unwrap().0.unhealthy.is_none());
        // The GPU itself still takes leases.
        assert_eq!(
            mgr.create(ask("1g.10gb", Some(0))).await.unwrap().lease.gpu,
            0
        );
        assert_eq!(mgr.node()[0].unhealthy_instances.len(), 1);
    }

    #[tokio::test]
    async fn a_gpu_lost_before_a_start_does_not_stop_it_and_its_leases_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (mgr, sim) = start(dir.path(), "");
        let on1 = mgr.create(ask("2g.20gb", Some(1))).await.unwrap().lease;
        mgr.begin_shutdown();
        drop(mgr);
        sim.control().update(|c| c.lost.insert(1)).unwrap();
        let (mgr, sim) = start(dir.path(), "");
        let marks = mgr.health_marks();
        assert_eq!((marks.len(), &marks[0].cause), (1, &HealthCause::Lost));
        let (l, _) = mgr.get(&on1.id).unwrap();
        assert_eq!(l.state(), LeaseState::Active);
        assert!(l.unhealthy.is_some());
        assert_eq!(mgr.create(ask("2g.20gb", None)).await.unwrap().lease.gpu, 0);
        // Back: in service again, with its profiles, by the poll alone.
        sim.control().update(|c| c.lost.remove(&1)).unwrap();
        mgr.poll_health().await;
        assert!(mgr.health_marks().is_empty());
        assert_eq!(
            mgr.create(ask("1g.10gb", Some(1))).await.unwrap().lease.gpu,
            1
        );
    }

    #[tokio::test]
    async fn a_lost_gpu_is_noticed_by_the_poll_and_returns_by_itself_when_back() {
        let dir = tempfile::tempdir().unwrap();
        let (mgr, sim) = start(dir.path(), "");
        sim.control().update(|c| c.lost.insert(1)).unwrap();
        mgr.poll_health().await;
        let marks = mgr.health_marks();
        assert_eq!(marks.len(), 1);
        assert_eq!((marks[0].gpu, &marks[0].cause), (1, &HealthCause::Lost));
        assert!(mgr.create(ask("1g.10gb", Some(1))).await.is_err());
        sim.control().update(|c| c.lost.remove(&1)).unwrap();
        mgr.poll_health().await;
        assert!(mgr.health_marks().is_empty());
        // An XID mark, by contrast, stays until an operator clears it.
        mgr.apply_health_event(HealthEvent {
            gpu: 1,
            gi_id: None,
            cause: HealthCause::Xid { xid: 48 },
        })
        .await;
        mgr.poll_health().await;
        assert_eq!(mgr.health_marks().len(), 1);
    }
}
