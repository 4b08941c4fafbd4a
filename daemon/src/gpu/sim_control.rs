//! The simulator's control file: faults injected per NVML call (a failure rate, a
//! delay, the code to fail with) and the health of the simulated hardware (XID and
//! ECC events waiting for the daemon, GPUs fallen off the bus, pending page
//! retirements).
//!
//! It sits next to the state file (`<state>.control.json`) and is written by whoever
//! plays the hardware's misfortune: `tesserad sim ...`, a chaos test, an integration
//! test in another process. The daemon reads it on every simulated call (a `stat`
//! when nothing changed) and consumes the events. Faults from the config's
//! `[[sim.faults]]` apply on top, for the daemon's whole life.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use super::health::{HealthCause, HealthEvent};
use super::types::{GpuError, NvmlCode};

/// The simulated calls a fault can target (the `GpuBackend` methods), and `*`.
pub const CALLS: &[&str] = &[
    "*",
    "devices",
    "gi_profiles",
    "create_instance",
    "destroy_instance",
    "instances",
    "processes",
    "utilization",
    "mps_start",
    "mps_stop",
    "mps_daemons",
    "health_poll",
    "topology",
];

fn default_code() -> NvmlCode {
    NvmlCode::Unknown
}

/// A fault on one simulated call: each call waits `delay_ms`, then fails with
/// `code` with probability `fail_rate`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallFault {
    /// A `GpuBackend` call (`create_instance`, `destroy_instance`, `mps_start`, ...)
    /// or `*` for every call.
    pub call: String,
    /// 0.0 (never) to 1.0 (always).
    #[serde(default)]
    pub fail_rate: f64,
    /// Added to every such call, failing or not (a slow driver).
    #[serde(default)]
    pub delay_ms: u64,
    /// The NVML code of the failure. Default `Unknown`.
    #[serde(default = "default_code")]
    pub code: NvmlCode,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallFaultError {
    #[error("unknown call {call:?}; one of {}", CALLS.join(", "))]
    UnknownCall { call: String },
    #[error("fail_rate {rate} of call {call:?} is not within 0.0..=1.0")]
    BadRate { call: String, rate: String },
}

impl CallFault {
    pub fn validate(&self) -> Result<(), CallFaultError> {
        if !CALLS.contains(&self.call.as_str()) {
            return Err(CallFaultError::UnknownCall {
                call: self.call.clone(),
            });
        }
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err(CallFaultError::BadRate {
                call: self.call.clone(),
                rate: self.fail_rate.to_string(),
            });
        }
        Ok(())
    }

    fn applies_to(&self, call: &str) -> bool {
        self.call == "*" || self.call == call
    }
}

/// What the control file holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Control {
    #[serde(default)]
    pub call_faults: Vec<CallFault>,
    /// Events not yet delivered to the daemon.
    #[serde(default)]
    pub events: Vec<HealthEvent>,
    /// GPUs fallen off the bus: their calls fail with `GPU_IS_LOST`.
    #[serde(default)]
    pub lost: BTreeSet<u32>,
    /// GPUs with retired pages or remapped rows pending.
    #[serde(default)]
    pub pending_retirement: BTreeSet<u32>,
}

type Stamp = (u64, u64, i64, i64, u64);

/// The file's identity and change time: `Some(None)` when there is no file,
/// `None` when it cannot be looked at (then it is read, and that read says why).
fn stamp(path: &Path) -> Option<Option<Stamp>> {
    use std::os::unix::fs::MetadataExt;
    match fs::metadata(path) {
        Ok(m) => Some(Some((
            m.dev(),
            m.ino(),
            m.mtime(),
            m.mtime_nsec(),
            m.size(),
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(None),
        Err(_) => None,
    }
}

/// The control file of one simulated host.
#[derive(Debug)]
pub struct SimControl {
    path: PathBuf,
    lock_path: PathBuf,
    configured: Vec<CallFault>,
    /// The file as last read, by its stamp (None: there was no file). Every
    /// simulated call looks here: one `stat` when nothing changed.
    cache: Mutex<Option<(Option<Stamp>, Arc<Control>)>>,
}

impl SimControl {
    /// The control file beside `state_file`, with the config's faults.
    pub fn beside(state_file: &Path, configured: Vec<CallFault>) -> SimControl {
        let name = state_file.file_name().unwrap_or_default().to_os_string();
        let mut control = name.clone();
        control.push(".control.json");
        let mut lock = name;
        lock.push(".control.lock");
        SimControl {
            path: state_file.with_file_name(control),
            lock_path: state_file.with_file_name(lock),
            configured,
            cache: Mutex::new(None),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> GpuError + '_ {
        move |source| GpuError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// The file as it is now (a missing file is no fault at all).
    pub fn current(&self) -> Result<Arc<Control>, GpuError> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let now = stamp(&self.path);
        if let (Some(now), Some((seen, c))) = (now, cache.as_ref())
            && now == *seen
        {
            return Ok(c.clone());
        }
        let control = Arc::new(self.load()?);
        // A file that could not be looked at is read again next time.
        *cache = now.map(|s| (s, control.clone()));
        Ok(control)
    }

    fn load(&self) -> Result<Control, GpuError> {
        match fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| GpuError::CorruptState {
                path: self.path.clone(),
                detail: e.to_string(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Control::default()),
            Err(e) => Err(Self::io(&self.path)(e)),
        }
    }

    /// Change the file under its lock (other processes write it too).
    pub fn update<T>(&self, f: impl FnOnce(&mut Control) -> T) -> Result<T, GpuError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.lock_path)
            .map_err(Self::io(&self.lock_path))?;
        let _lock = Flock::lock(file, FlockArg::LockExclusive)
            .map_err(|(_, errno)| Self::io(&self.lock_path)(errno.into()))?;
        let mut control = self.load()?;
        let before = control.clone();
        let out = f(&mut control);
        if control != before {
            let json = serde_json::to_vec_pretty(&control).map_err(|e| GpuError::CorruptState {
                path: self.path.clone(),
                detail: e.to_string(),
            })?;
            let mut tmp = self.path.clone().into_os_string();
            tmp.push(format!(".tmp.{}", std::process::id()));
            let tmp = PathBuf::from(tmp);
            let written = File::create(&tmp)
                .and_then(|mut f| f.write_all(&json))
                .and_then(|()| fs::rename(&tmp, &self.path));
            if let Err(e) = written {
                let _ = fs::remove_file(&tmp);
                return Err(Self::io(&self.path)(e));
            }
        }
        Ok(out)
    }

    /// The fault point at the start of every simulated call: the configured and
    /// injected delays, then maybe an injected failure, then `GPU_IS_LOST` for a GPU
    /// fallen off the bus.
    pub fn before(&self, call: &'static str, gpu: Option<u32>) -> Result<(), GpuError> {
        let control = self.current()?;
        let faults = self
            .configured
            .iter()
            .chain(&control.call_faults)
            .filter(|f| f.applies_to(call));
        let mut delay = 0;
        let mut failure = None;
        for f in faults {
            delay += f.delay_ms;
            if failure.is_none() && f.fail_rate > 0.0 && rand::random::<f64>() < f.fail_rate {
                failure = Some(f.code);
            }
        }
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay));
        }
        if let Some(code) = failure {
            return Err(GpuError::Nvml {
                call,
                code,
                detail: "injected fault".into(),
            });
        }
        if let Some(g) = gpu
            && control.lost.contains(&g)
        {
            return Err(GpuError::Nvml {
                call,
                code: NvmlCode::GpuIsLost,
                detail: format!("GPU {g} has fallen off the bus"),
            });
        }
        Ok(())
    }

    /// What a health poll of `gpu` reads.
    pub fn poll(&self, gpu: u32) -> Result<Option<HealthCause>, GpuError> {
        let c = self.current()?;
        Ok(if c.lost.contains(&gpu) {
            Some(HealthCause::Lost)
        } else if c.pending_retirement.contains(&gpu) {
            Some(HealthCause::PendingRetirement)
        } else {
            None
        })
    }

    /// The events waiting, consumed; waits up to `timeout` for the first one.
    pub fn take_events(&self, timeout: Duration) -> Result<Vec<HealthEvent>, GpuError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if !self.current()?.events.is_empty() {
                return self.update(|c| std::mem::take(&mut c.events));
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Ok(Vec::new());
            }
            std::thread::sleep((deadline - now).min(Duration::from_millis(100)));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn control(dir: &Path, configured: Vec<CallFault>) -> SimControl {
        SimControl::beside(&dir.join("sim.json"), configured)
    }

    /// No file is no fault, and that answer is kept only while there is no file:
    /// one written by another process later is seen at the next call.
    #[test]
    fn a_file_written_after_calls_without_one_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let c = control(dir.path(), vec![]);
        c.before("destroy_instance", Some(0)).unwrap();
        c.before("destroy_instance", Some(0)).unwrap();
        let writer = control(dir.path(), vec![]);
        writer
            .update(|c| {
                c.call_faults.push(CallFault {
                    call: "destroy_instance".into(),
                    fail_rate: 1.0,
                    delay_ms: 0,
                    code: NvmlCode::InUse,
                })
            })
            .unwrap();
        assert!(c.before("destroy_instance", Some(0)).is_err());
        std::fs::remove_file(c.path()).unwrap();
        c.before("destroy_instance", Some(0)).unwrap();
    }

    #[test]
    fn a_certain_fault_fails_its_call_only_and_a_delay_slows_it() {
        let dir = tempfile::tempdir().unwrap();
        let c = control(dir.path(), vec![]);
        c.update(|c| {
            c.call_faults.push(CallFault {
                call: "destroy_instance".into(),
                fail_rate: 1.0,
                delay_ms: 30,
                code: NvmlCode::InUse,
            })
        })
        .unwrap();
        let t = std::time::Instant::now();
        let e = c.before("destroy_instance", Some(0)).unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(30));
        assert_eq!(e.nvml_code(), Some(NvmlCode::InUse));
        c.before("create_instance", Some(0)).unwrap();
        // Another handle on the same file (another process) sees it too, and clears it.
        let other = control(dir.path(), vec![]);
        other.update(|c| c.call_faults.clear()).unwrap();
        c.before("destroy_instance", Some(0)).unwrap();
    }

    #[test]
    fn configured_faults_hold_and_are_validated() {
        let dir = tempfile::tempdir().unwrap();
        let f = CallFault {
            call: "*".into(),
            fail_rate: 1.0,
            delay_ms: 0,
            code: NvmlCode::Unknown,
        };
        f.validate().unwrap();
        let c = control(dir.path(), vec![f]);
        assert!(c.before("instances", None).is_err());
        let bad = CallFault {
            call: "create".into(),
            ..CallFault {
                call: String::new(),
                fail_rate: 0.5,
                delay_ms: 0,
                code: NvmlCode::Unknown,
            }
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("create_instance")
        );
        let rate = CallFault {
            call: "mps_start".into(),
            fail_rate: 1.5,
            delay_ms: 0,
            code: NvmlCode::Unknown,
        };
        assert!(matches!(
            rate.validate(),
            Err(CallFaultError::BadRate { .. })
        ));
    }

    #[test]
    fn a_lost_gpu_fails_its_calls_and_polls_lost_until_it_is_back() {
        let dir = tempfile::tempdir().unwrap();
        let c = control(dir.path(), vec![]);
        c.update(|c| c.lost.insert(1)).unwrap();
        assert_eq!(
            c.before("instances", Some(1)).unwrap_err().nvml_code(),
            Some(NvmlCode::GpuIsLost)
        );
        c.before("instances", Some(0)).unwrap();
        assert_eq!(c.poll(1).unwrap(), Some(HealthCause::Lost));
        c.update(|c| c.lost.remove(&1)).unwrap();
        assert_eq!(c.poll(1).unwrap(), None);
    }

    #[test]
    fn events_are_delivered_once() {
        let dir = tempfile::tempdir().unwrap();
        let c = control(dir.path(), vec![]);
        assert!(c.take_events(Duration::from_millis(10)).unwrap().is_empty());
        let ev = HealthEvent {
            gpu: 0,
            gi_id: None,
            cause: HealthCause::Xid { xid: 79 },
        };
        c.update(|c| c.events.push(ev.clone())).unwrap();
        assert_eq!(c.take_events(Duration::from_secs(1)).unwrap(), vec![ev]);
        assert!(c.take_events(Duration::ZERO).unwrap().is_empty());
    }
}
