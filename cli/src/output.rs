//! Output for people (aligned tables, human sizes and times) and for scripts (JSON views
//! of the proto messages, enums as lowercase names, times as unix milliseconds like the API).

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, UNIX_EPOCH};

use serde::Serialize;
use tessera_proto::v1 as pb;

// ---------------------------------------------------------------- tables

/// A table of left-aligned columns separated by two spaces, headers in upper case.
#[derive(Debug, Default)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Self {
        Self {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let ncols = self
            .rows
            .iter()
            .map(Vec::len)
            .chain(std::iter::once(self.headers.len()))
            .max()
            .unwrap_or(0);
        let mut widths = vec![0usize; ncols];
        for line in std::iter::once(&self.headers).chain(&self.rows) {
            for (i, cell) in line.iter().enumerate() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for line in std::iter::once(&self.headers).chain(&self.rows) {
            let mut text = String::new();
            for (i, cell) in line.iter().enumerate() {
                if i > 0 {
                    text.push_str("  ");
                }
                text.push_str(cell);
                let pad = widths[i].saturating_sub(cell.chars().count());
                text.extend(std::iter::repeat_n(' ', pad));
            }
            out.push_str(text.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Writes `text` to stdout. A closed pipe (`tessera lease list | head`) is not an error.
pub fn print(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Pretty JSON of `value` on stdout, followed by a newline.
pub fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    print(&text)?;
    Ok(())
}

// ---------------------------------------------------------------- sizes and times

/// A size in binary units with at most two decimals: "0 B", "512 B", "9.75 GiB", "80 GiB".
pub use tessera_common::size::human as human_bytes;

/// RFC 3339 (UTC, seconds) of unix milliseconds; "-" for 0 (unset).
pub fn abs_time(ms: i64) -> String {
    match u64::try_from(ms) {
        Ok(0) | Err(_) => "-".to_owned(),
        Ok(ms) => {
            humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
        }
    }
}

/// "in 59m 12s" or "3h 2m ago" (two largest units); "-" for 0 (unset).
pub fn rel_time(ms: i64, now_ms: i64) -> String {
    if ms == 0 {
        return "-".to_owned();
    }
    let delta = ms.saturating_sub(now_ms);
    let span = short_duration(delta.unsigned_abs() / 1000);
    if span == "0s" {
        "now".to_owned()
    } else if delta > 0 {
        format!("in {span}")
    } else {
        format!("{span} ago")
    }
}

/// Absolute and relative: "2026-11-21T15:00:00Z (in 59m 12s)".
pub fn when(ms: i64, now_ms: i64) -> String {
    if ms == 0 {
        return "-".to_owned();
    }
    format!("{} ({})", abs_time(ms), rel_time(ms, now_ms))
}

/// Seconds as at most two units: "1d 2h", "59m 12s", "5s".
pub fn short_duration(secs: u64) -> String {
    let parts = [
        (secs / 86_400, "d"),
        (secs % 86_400 / 3600, "h"),
        (secs % 3600 / 60, "m"),
        (secs % 60, "s"),
    ];
    let Some(first) = parts.iter().position(|(n, _)| *n > 0) else {
        return "0s".to_owned();
    };
    parts[first..]
        .iter()
        .take(2)
        .filter(|(n, _)| *n > 0)
        .map(|(n, u)| format!("{n}{u}"))
        .collect::<Vec<_>>()
        .join(" ")
}

// ---------------------------------------------------------------- enum names

pub fn lease_state_name(state: i32) -> String {
    use pb::LeaseState as S;
    match S::try_from(state) {
        Ok(S::Unspecified) => "unspecified".to_owned(),
        Ok(S::Pending) => "pending".to_owned(),
        Ok(S::Active) => "active".to_owned(),
        Ok(S::Revoking) => "revoking".to_owned(),
        Ok(S::Released) => "released".to_owned(),
        Ok(S::Expired) => "expired".to_owned(),
        Ok(S::Revoked) => "revoked".to_owned(),
        Ok(S::Failed) => "failed".to_owned(),
        Err(_) => format!("unknown({state})"),
    }
}

pub fn partition_kind_name(kind: i32) -> String {
    use pb::PartitionKind as K;
    match K::try_from(kind) {
        Ok(K::Unspecified) => "unspecified".to_owned(),
        Ok(K::Mig) => "mig".to_owned(),
        Ok(K::Mps) => "mps".to_owned(),
        Ok(K::WholeGpu) => "gpu".to_owned(),
        Err(_) => format!("unknown({kind})"),
    }
}

pub fn event_kind_name(kind: i32) -> String {
    use pb::LeaseEventKind as K;
    match K::try_from(kind) {
        Ok(K::Unspecified) => "unspecified".to_owned(),
        Ok(K::Created) => "created".to_owned(),
        Ok(K::Renewed) => "renewed".to_owned(),
        Ok(K::Expiring) => "expiring".to_owned(),
        Ok(K::Released) => "released".to_owned(),
        Ok(K::Revoked) => "revoked".to_owned(),
        Ok(K::Revoking) => "revoking".to_owned(),
        Ok(K::Preempting) => "preempting".to_owned(),
        Ok(K::ContainerBound) => "container_bound".to_owned(),
        Ok(K::ContainerUnbound) => "container_unbound".to_owned(),
        Ok(K::MpsRestarted) => "mps_restarted".to_owned(),
        Ok(K::Unhealthy) => "unhealthy".to_owned(),
        Ok(K::Healthy) => "healthy".to_owned(),
        Ok(K::Moved) => "moved".to_owned(),
        Ok(K::Bookmark) => "bookmark".to_owned(),
        Err(_) => format!("unknown({kind})"),
    }
}

/// MIG mode as NVML reports it: the current mode, and the pending one (what the
/// GPU switches to at its next reset) when that differs.
pub fn mig_mode(gpu: &pb::Gpu) -> &'static str {
    match (gpu.mig_enabled, gpu.mig_pending) {
        (true, true) => "on",
        (false, false) => "off",
        (false, true) => "off (on after reset)",
        (true, false) => "on (off after reset)",
    }
}

// ---------------------------------------------------------------- JSON views

#[derive(Debug, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ShapeView {
    Mig {
        profile: String,
        compute_profile: String,
    },
    Mps {
        sm_percent: u32,
        memory_bytes: u64,
        /// "isolated", "shared", or "" when the server did not say.
        mode: String,
        /// MPS inside MIG: the instance's GI profile.
        #[serde(skip_serializing_if = "String::is_empty")]
        mig_profile: String,
    },
    Gpu,
    Unspecified,
}

impl From<Option<&pb::Shape>> for ShapeView {
    fn from(shape: Option<&pb::Shape>) -> Self {
        use pb::shape::Kind;
        match shape.and_then(|s| s.kind.as_ref()) {
            Some(Kind::Mig(m)) => Self::Mig {
                profile: m.profile.clone(),
                compute_profile: m.compute_profile.clone(),
            },
            Some(Kind::Mps(m)) => Self::Mps {
                sm_percent: m.sm_percent,
                memory_bytes: m.memory_bytes,
                mode: mps_mode_name(m.mode).to_owned(),
                mig_profile: m.mig_profile.clone(),
            },
            Some(Kind::WholeGpu(_)) => Self::Gpu,
            // A lease always carries the shape chosen for a need.
            Some(Kind::Need(_)) | None => Self::Unspecified,
        }
    }
}

impl ShapeView {
    /// "mig 1g.10gb", "mig 3g.40gb/1c", "mps 25% 8 GiB shared", "gpu".
    pub fn describe(&self) -> String {
        match self {
            Self::Mig {
                profile,
                compute_profile,
            } if compute_profile.is_empty() => format!("mig {profile}"),
            Self::Mig {
                profile,
                compute_profile,
            } => format!("mig {profile}/{compute_profile}"),
            Self::Mps {
                sm_percent,
                memory_bytes,
                mode,
                mig_profile,
            } => {
                let mut s = format!("mps {sm_percent}% {}", human_bytes(*memory_bytes));
                if !mode.is_empty() {
                    s.push(' ');
                    s.push_str(mode);
                }
                if !mig_profile.is_empty() {
                    s.push_str(" in ");
                    s.push_str(mig_profile);
                }
                s
            }
            Self::Gpu => "gpu".to_owned(),
            Self::Unspecified => "-".to_owned(),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct MigPartitionView {
    pub profile: String,
    pub gi_profile_id: u32,
    pub placement_start: u32,
    pub placement_size: u32,
    pub gi_id: u32,
    pub ci_id: u32,
    pub compute_profile: String,
    pub mig_uuid: String,
    pub memory_bytes: u64,
    pub sm_count: u32,
    /// MPS inside MIG: the tenant whose shares it hosts.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub mps_host_tenant: String,
}

#[derive(Debug, Serialize)]
pub struct MpsPartitionView {
    pub sm_percent: u32,
    pub memory_bytes: u64,
    pub pipe_dir: String,
    pub log_dir: String,
    pub mode: String,
    /// MPS inside MIG: the partition id of its host instance.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub mig_host: String,
}

/// "isolated", "shared", or "" (unspecified: an older daemon).
pub fn mps_mode_name(mode: i32) -> &'static str {
    match pb::MpsMode::try_from(mode) {
        Ok(pb::MpsMode::Isolated) => "isolated",
        Ok(pb::MpsMode::Shared) => "shared",
        _ => "",
    }
}

#[derive(Debug, Serialize)]
pub struct PartitionView {
    pub id: String,
    pub kind: String,
    pub gpu_index: u32,
    pub gpu_uuid: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigPartitionView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsPartitionView>,
    pub lease_id: String,
    pub origin: String,
    /// "ready", or "creating" / "destroying" while its hardware change is under way
    /// (empty from a daemon older than this field).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub state: String,
}

impl From<&pb::Partition> for PartitionView {
    fn from(p: &pb::Partition) -> Self {
        Self {
            id: p.id.clone(),
            kind: partition_kind_name(p.kind),
            gpu_index: p.gpu_index,
            gpu_uuid: p.gpu_uuid.clone(),
            mig: p.mig.as_ref().map(|m| MigPartitionView {
                profile: m.profile.clone(),
                gi_profile_id: m.gi_profile_id,
                placement_start: m.placement_start,
                placement_size: m.placement_size,
                gi_id: m.gi_id,
                ci_id: m.ci_id,
                compute_profile: m.compute_profile.clone(),
                mig_uuid: m.mig_uuid.clone(),
                memory_bytes: m.memory_bytes,
                sm_count: m.sm_count,
                mps_host_tenant: m.mps_host_tenant.clone(),
            }),
            mps: p.mps.as_ref().map(|m| MpsPartitionView {
                sm_percent: m.sm_percent,
                memory_bytes: m.memory_bytes,
                pipe_dir: m.pipe_dir.clone(),
                log_dir: m.log_dir.clone(),
                mode: mps_mode_name(m.mode).to_owned(),
                mig_host: m.mig_host.clone(),
            }),
            lease_id: p.lease_id.clone(),
            origin: p.origin.clone(),
            state: p.state.clone(),
        }
    }
}

impl PartitionView {
    /// What the partition is, for a table cell: "1g.10gb", "1g.10gb/1c", "25% 8 GiB",
    /// "gpu"; "1g.10gb (destroying)" while its hardware change is under way.
    pub fn describe(&self) -> String {
        let what = self.what();
        match self.state.as_str() {
            "" | "ready" => what,
            other => format!("{what} ({other})"),
        }
    }

    fn what(&self) -> String {
        if let Some(m) = &self.mig {
            if m.compute_profile.is_empty() {
                m.profile.clone()
            } else {
                format!("{}/{}", m.profile, m.compute_profile)
            }
        } else if let Some(m) = &self.mps {
            format!("{}% {}", m.sm_percent, human_bytes(m.memory_bytes))
        } else {
            self.kind.clone()
        }
    }

    pub fn memory_bytes(&self) -> Option<u64> {
        self.mig
            .as_ref()
            .map(|m| m.memory_bytes)
            .or(self.mps.as_ref().map(|m| m.memory_bytes))
    }
}

#[derive(Debug, Serialize)]
pub struct ContainerView {
    pub id: String,
    pub cgroup_path: String,
    pub runtime_root: String,
    pub bound_at_ms: i64,
    /// Host path of its termination-message file (where a lease's end is explained).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub termination_log_path: String,
}

#[derive(Debug, Serialize)]
pub struct LeaseView {
    pub id: String,
    pub tenant: String,
    pub state: String,
    pub shape: ShapeView,
    pub partition: Option<PartitionView>,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub ttl_seconds: u64,
    pub request_id: String,
    pub labels: BTreeMap<String, String>,
    pub containers: Vec<ContainerView>,
    pub priority_class: String,
    pub burst: bool,
    pub end_reason: String,
    /// Why its GPU or instance is out of service ("" while healthy).
    pub unhealthy: String,
    pub ended_at_ms: i64,
    /// The pod its token is bound to ("" until a pod used it).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub pod: String,
    /// A lease of several partitions (N whole GPUs or N MIG instances): how many,
    /// each of them (`partition` is the first), and how their GPUs connect.
    #[serde(skip_serializing_if = "is_one")]
    pub count: u32,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topology: Option<TopologyView>,
}

fn is_one(n: &u32) -> bool {
    *n <= 1
}

/// How the GPUs of a multi-partition lease connect.
#[derive(Debug, Serialize)]
pub struct TopologyView {
    pub gpu_indices: Vec<u32>,
    /// The worst pair's closest common PCIe ancestor.
    pub worst_level: String,
    /// The fewest NVLinks between any two (0: some pair is PCIe only).
    pub min_nvlinks: u32,
}

impl TopologyView {
    /// "gpus 0,1: NVLink (18 links each pair), PCIe: one switch".
    pub fn describe(&self) -> String {
        let gpus = join_indices(&self.gpu_indices);
        if self.gpu_indices.len() <= 1 {
            return format!("gpu {gpus}: all on one GPU");
        }
        let nvlink = if self.min_nvlinks > 0 {
            format!("NVLink ({} links or more each pair)", self.min_nvlinks)
        } else {
            "no NVLink between some pair".to_owned()
        };
        let pcie = match self.worst_level.as_str() {
            "internal" => "one board",
            "single" => "one PCIe switch",
            "multiple" => "several PCIe switches",
            "host_bridge" => "one host bridge",
            "node" => "one NUMA node",
            "system" => "across NUMA nodes",
            other => other,
        };
        format!("gpus {gpus}: {nvlink}; PCIe: {pcie}")
    }
}

fn join_indices(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

impl From<&pb::Lease> for LeaseView {
    fn from(l: &pb::Lease) -> Self {
        Self {
            id: l.id.clone(),
            tenant: l.tenant.clone(),
            state: lease_state_name(l.state),
            shape: ShapeView::from(l.shape.as_ref()),
            partition: l.partition.as_ref().map(PartitionView::from),
            created_at_ms: l.created_at_ms,
            expires_at_ms: l.expires_at_ms,
            ttl_seconds: l.ttl_seconds,
            request_id: l.request_id.clone(),
            labels: l
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            containers: l
                .containers
                .iter()
                .map(|c| ContainerView {
                    id: c.id.clone(),
                    cgroup_path: c.cgroup_path.clone(),
                    runtime_root: c.runtime_root.clone(),
                    bound_at_ms: c.bound_at_ms,
                    termination_log_path: c.termination_log_path.clone(),
                })
                .collect(),
            priority_class: l.priority_class.clone(),
            burst: l.burst,
            end_reason: l.end_reason.clone(),
            unhealthy: l.unhealthy.clone(),
            ended_at_ms: l.ended_at_ms,
            pod: l.pod.clone(),
            count: u32::try_from(l.partitions.len()).unwrap_or(u32::MAX),
            partitions: if l.partitions.len() > 1 {
                l.partitions.iter().map(PartitionView::from).collect()
            } else {
                Vec::new()
            },
            topology: l.topology.as_ref().map(|t| TopologyView {
                gpu_indices: t.gpu_indices.clone(),
                worst_level: t.worst_level.clone(),
                min_nvlinks: t.min_nvlinks,
            }),
        }
    }
}

impl LeaseView {
    pub fn labels_text(&self) -> String {
        if self.labels.is_empty() {
            return "-".to_owned();
        }
        self.labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn gpu_text(&self) -> String {
        if self.partitions.len() > 1 {
            let mut gpus: Vec<u32> = self.partitions.iter().map(|p| p.gpu_index).collect();
            gpus.sort_unstable();
            gpus.dedup();
            return join_indices(&gpus);
        }
        self.partition
            .as_ref()
            .map_or_else(|| "-".to_owned(), |p| p.gpu_index.to_string())
    }

    /// The shape, with "x N" for a lease of several partitions.
    pub fn shape_text(&self) -> String {
        if self.count > 1 {
            format!("{} x{}", self.shape.describe(), self.count)
        } else {
            self.shape.describe()
        }
    }

    /// The lease as "key: value" lines, containers as a table beneath.
    pub fn render_detail(&self, now_ms: i64) -> String {
        let mut kv: Vec<(&str, String)> = vec![
            ("lease", self.id.clone()),
            ("tenant", self.tenant.clone()),
            ("state", self.state.clone()),
            ("shape", self.shape_text()),
        ];
        self.partition_lines(&mut kv);
        self.time_and_label_lines(&mut kv, now_ms);
        let width = kv.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
        let mut out = String::new();
        for (k, v) in &kv {
            // An empty key continues the line above (a lease's further partitions).
            let key = if k.is_empty() {
                String::new()
            } else {
                format!("{k}:")
            };
            out.push_str(&format!("{key:<width$} {v}\n"));
        }
        self.containers_text(&mut out, now_ms);
        out
    }

    /// Its partition, or each of its partitions and their topology.
    fn partition_lines(&self, kv: &mut Vec<(&str, String)>) {
        if self.partitions.len() > 1 {
            for (i, p) in self.partitions.iter().enumerate() {
                let mut what = format!("{} on gpu {} ({})", p.describe(), p.gpu_index, p.gpu_uuid);
                if let Some(m) = &p.mig
                    && !m.mig_uuid.is_empty()
                {
                    what.push_str(&format!(", {}", m.mig_uuid));
                }
                let key = if i == 0 { "partitions" } else { "" };
                kv.push((key, format!("{} {what}", p.id)));
            }
            if let Some(t) = &self.topology {
                kv.push(("topology", t.describe()));
            }
        } else if let Some(p) = &self.partition {
            let mut what = format!("{} on gpu {} ({})", p.describe(), p.gpu_index, p.gpu_uuid);
            if let Some(mem) = p.memory_bytes() {
                what.push_str(&format!(", {}", human_bytes(mem)));
            }
            kv.push(("partition", format!("{} {what}", p.id)));
            if let Some(m) = &p.mig
                && !m.mig_uuid.is_empty()
            {
                kv.push(("mig uuid", m.mig_uuid.clone()));
            }
        } else {
            kv.push(("partition", "-".to_owned()));
        }
    }

    /// Its times, priority, burst, request id, labels, end and pod.
    fn time_and_label_lines(&self, kv: &mut Vec<(&str, String)>, now_ms: i64) {
        kv.push(("created", when(self.created_at_ms, now_ms)));
        kv.push(("expires", when(self.expires_at_ms, now_ms)));
        kv.push(("ttl", short_duration(self.ttl_seconds)));
        if !self.priority_class.is_empty() {
            kv.push(("priority class", self.priority_class.clone()));
        }
        kv.push(("burst", if self.burst { "yes" } else { "no" }.to_owned()));
        if !self.request_id.is_empty() {
            kv.push(("request id", self.request_id.clone()));
        }
        kv.push(("labels", self.labels_text()));
        if self.ended_at_ms != 0 {
            // A lease still revoking (its containers in their grace) has not ended:
            // its time is when it will at the latest.
            let key = if self.state == "revoking" || self.ended_at_ms > now_ms {
                "ending by"
            } else {
                "ended"
            };
            kv.push((key, when(self.ended_at_ms, now_ms)));
        }
        if !self.unhealthy.is_empty() {
            kv.push(("UNHEALTHY", self.unhealthy.clone()));
        }
        if !self.end_reason.is_empty() {
            kv.push(("end reason", self.end_reason.clone()));
        }
        if !self.pod.is_empty() {
            kv.push(("pod", self.pod.clone()));
        }
    }

    fn containers_text(&self, out: &mut String, now_ms: i64) {
        if self.containers.is_empty() {
            out.push_str("containers: none\n");
            return;
        }
        out.push_str("containers:\n");
        let mut t = Table::new(&["ID", "BOUND", "CGROUP"]);
        for c in &self.containers {
            t.row(vec![
                c.id.clone(),
                rel_time(c.bound_at_ms, now_ms),
                c.cgroup_path.clone(),
            ]);
        }
        for line in t.render().lines() {
            out.push_str("  ");
            out.push_str(line);
            out.push('\n');
        }
    }
}

/// The lease list table.
pub fn lease_table(leases: &[LeaseView], now_ms: i64) -> String {
    let mut t = Table::new(&[
        "ID",
        "TENANT",
        "STATE",
        "SHAPE",
        "GPU",
        "EXPIRES",
        "CONTAINERS",
        "LABELS",
    ]);
    for l in leases {
        let expires = if l.ended_at_ms != 0 {
            let verb = if l.state == "revoking" || l.ended_at_ms > now_ms {
                "ending"
            } else {
                "ended"
            };
            format!("{verb} {}", rel_time(l.ended_at_ms, now_ms))
        } else {
            rel_time(l.expires_at_ms, now_ms)
        };
        t.row(vec![
            l.id.clone(),
            l.tenant.clone(),
            l.state.clone(),
            l.shape_text(),
            l.gpu_text(),
            expires,
            l.containers.len().to_string(),
            l.labels_text(),
        ]);
    }
    t.render()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const NOW: i64 = 1_795_255_200_000; // 2026-11-21T10:00:00Z

    pub(crate) fn sample_lease() -> pb::Lease {
        pb::Lease {
            id: "l-7f3a".to_owned(),
            tenant: "team-a".to_owned(),
            state: pb::LeaseState::Active as i32,
            shape: Some(pb::Shape {
                kind: Some(pb::shape::Kind::Mig(pb::MigShape {
                    profile: "1g.10gb".to_owned(),
                    compute_profile: String::new(),
                    count: 0,
                })),
            }),
            partition: Some(pb::Partition {
                id: "p-0-3".to_owned(),
                kind: pb::PartitionKind::Mig as i32,
                gpu_index: 0,
                gpu_uuid: "GPU-1111".to_owned(),
                mig: Some(pb::MigPartition {
                    profile: "1g.10gb".to_owned(),
                    gi_profile_id: 19,
                    placement_start: 3,
                    placement_size: 1,
                    gi_id: 9,
                    ci_id: 0,
                    compute_profile: String::new(),
                    mig_uuid: "MIG-2222".to_owned(),
                    memory_bytes: 10_468_982_784, // 9.75 GiB
                    sm_count: 14,
                    mps_host_tenant: String::new(),
                }),
                mps: None,
                lease_id: "l-7f3a".to_owned(),
                origin: "dynamic".to_owned(),
                state: "ready".to_owned(),
            }),
            created_at_ms: NOW - 60_000,
            expires_at_ms: NOW + 3_540_000,
            ttl_seconds: 3600,
            request_id: "req-1".to_owned(),
            labels: [("team".to_owned(), "ml".to_owned())].into_iter().collect(),
            containers: vec![pb::Container {
                id: "c1".to_owned(),
                cgroup_path: "/sys/fs/cgroup/tessera/c1".to_owned(),
                runtime_root: "/run/tessera-runtime".to_owned(),
                bound_at_ms: NOW - 30_000,
                ..Default::default()
            }],
            priority_class: "normal".to_owned(),
            burst: false,
            end_reason: String::new(),
            unhealthy: String::new(),
            ended_at_ms: 0,
            pod: String::new(),
            partitions: vec![],
            topology: None,
        }
    }

    /// A partition whose instance is being made or torn down says so; a ready one,
    /// or one from a daemon that does not report its state, does not.
    #[test]
    fn a_partition_under_way_says_so() {
        let mut p = sample_lease().partition.unwrap();
        assert_eq!(PartitionView::from(&p).describe(), "1g.10gb");
        p.state = "destroying".to_owned();
        assert_eq!(PartitionView::from(&p).describe(), "1g.10gb (destroying)");
        p.state = String::new();
        assert_eq!(PartitionView::from(&p).describe(), "1g.10gb");
    }

    /// A lease of two whole GPUs: both partitions, their GPUs and their link.
    #[test]
    fn a_multi_gpu_lease_shows_every_partition_and_the_link() {
        let gpu = |id: &str, i: u32| pb::Partition {
            id: id.to_owned(),
            kind: pb::PartitionKind::WholeGpu as i32,
            gpu_index: i,
            gpu_uuid: format!("GPU-{i}"),
            lease_id: "l-7f3a".to_owned(),
            origin: "dynamic".to_owned(),
            ..Default::default()
        };
        let mut l = sample_lease();
        l.shape = Some(pb::Shape {
            kind: Some(pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count: 2 })),
        });
        l.partition = Some(gpu("p-a", 4));
        l.partitions = vec![gpu("p-a", 4), gpu("p-b", 5)];
        l.topology = Some(pb::LeaseTopology {
            gpu_indices: vec![4, 5],
            worst_level: "single".to_owned(),
            min_nvlinks: 18,
        });
        let v = LeaseView::from(&l);
        let text = v.render_detail(NOW);
        assert!(text.contains("shape:          gpu x2"), "{text}");
        assert!(text.contains("p-a gpu on gpu 4 (GPU-4)"), "{text}");
        assert!(
            text.contains("\n                p-b gpu on gpu 5 (GPU-5)\n"),
            "{text}"
        );
        assert!(
            text.contains("gpus 4,5: NVLink (18 links or more each pair); PCIe: one PCIe switch"),
            "{text}"
        );
        let table = lease_table(&[v], NOW);
        assert!(table.contains("gpu x2") && table.contains("4,5"), "{table}");
        let json = serde_json::to_value(LeaseView::from(&l)).unwrap();
        assert_eq!(json["count"], 2);
        assert_eq!(json["partitions"].as_array().unwrap().len(), 2);
        assert_eq!(json["topology"]["min_nvlinks"], 18);
        // One partition: none of the multi fields in JSON.
        let one = serde_json::to_value(LeaseView::from(&sample_lease())).unwrap();
        assert!(one.get("partitions").is_none() && one.get("count").is_none());
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1024), "1 KiB");
        assert_eq!(human_bytes(10_468_982_784), "9.75 GiB");
        assert_eq!(human_bytes(80 * 1024 * 1024 * 1024), "80 GiB");
        assert_eq!(human_bytes(1536 * 1024 * 1024), "1.5 GiB");
    }

    #[test]
    fn relative_and_absolute_times() {
        assert_eq!(abs_time(NOW), "2026-11-21T10:00:00Z");
        assert_eq!(abs_time(0), "-");
        assert_eq!(rel_time(NOW + 3_552_000, NOW), "in 59m 12s");
        assert_eq!(rel_time(NOW - 90_061_000, NOW), "1d 1h ago");
        assert_eq!(rel_time(NOW + 7_200_000, NOW), "in 2h");
        assert_eq!(rel_time(NOW, NOW), "now");
        assert_eq!(when(NOW + 60_000, NOW), "2026-11-21T10:01:00Z (in 1m)");
    }

    #[test]
    fn table_columns_align() {
        let mut t = Table::new(&["ID", "NAME"]);
        t.row(vec!["1".to_owned(), "short".to_owned()]);
        t.row(vec!["12345".to_owned(), "x".to_owned()]);
        assert_eq!(t.render(), "ID     NAME\n1      short\n12345  x\n");
    }

    #[test]
    fn lease_list_table_of_a_sample_lease() {
        let view = LeaseView::from(&sample_lease());
        let text = lease_table(&[view], NOW);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(
            lines[0],
            "ID      TENANT  STATE   SHAPE        GPU  EXPIRES  CONTAINERS  LABELS"
        );
        assert_eq!(
            lines[1],
            "l-7f3a  team-a  active  mig 1g.10gb  0    in 59m   1           team=ml"
        );
    }

    #[test]
    fn a_lease_still_ending_is_not_shown_as_ended() {
        let mut l = sample_lease();
        l.state = pb::LeaseState::Revoking as i32;
        l.ended_at_ms = NOW + 3_000;
        let text = LeaseView::from(&l).render_detail(NOW);
        assert!(text.contains("state:          revoking\n"), "{text}");
        assert!(text.contains("ending by:"), "{text}");
        assert!(text.contains("(in 3s)"), "{text}");
        assert!(!text.contains("ended:"), "{text}");
        l.state = pb::LeaseState::Released as i32;
        l.ended_at_ms = NOW - 5_000;
        let text = LeaseView::from(&l).render_detail(NOW);
        assert!(text.contains("ended:"), "{text}");
        assert!(!text.contains("ending by:"), "{text}");
    }

    #[test]
    fn lease_detail_of_a_sample_lease() {
        let text = LeaseView::from(&sample_lease()).render_detail(NOW);
        assert!(text.contains("state:          active\n"), "{text}");
        assert!(
            text.contains("partition:      p-0-3 1g.10gb on gpu 0 (GPU-1111), 9.75 GiB\n"),
            "{text}"
        );
        assert!(
            text.contains("expires:        2026-11-21T10:59:00Z (in 59m)\n"),
            "{text}"
        );
        assert!(text.contains("labels:         team=ml\n"), "{text}");
        assert!(
            text.contains("  c1  30s ago  /sys/fs/cgroup/tessera/c1\n"),
            "{text}"
        );
    }

    #[test]
    fn lease_json_shape() {
        let json = serde_json::to_value(LeaseView::from(&sample_lease())).unwrap();
        assert_eq!(json["id"], "l-7f3a");
        assert_eq!(json["state"], "active");
        assert_eq!(json["shape"]["kind"], "mig");
        assert_eq!(json["shape"]["profile"], "1g.10gb");
        assert_eq!(json["partition"]["kind"], "mig");
        assert_eq!(json["partition"]["mig"]["memory_bytes"], 10_468_982_784u64);
        assert!(json["partition"].get("mps").is_none());
        assert_eq!(json["expires_at_ms"], NOW + 3_540_000);
        assert_eq!(json["labels"]["team"], "ml");
        assert_eq!(json["containers"][0]["id"], "c1");
    }

    #[test]
    fn shapes_as_json_and_text() {
        let mps = ShapeView::from(Some(&pb::Shape {
            kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent: 25,
                memory_bytes: 8 << 30,
                mode: pb::MpsMode::Unspecified as i32,
                ..Default::default()
            })),
        }));
        assert_eq!(mps.describe(), "mps 25% 8 GiB");
        assert_eq!(
            serde_json::to_value(&mps).unwrap(),
            serde_json::json!({"kind": "mps", "sm_percent": 25, "memory_bytes": 8u64 << 30, "mode": ""})
        );
        let shared = ShapeView::from(Some(&pb::Shape {
            kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent: 25,
                memory_bytes: 8 << 30,
                mode: pb::MpsMode::Shared as i32,
                ..Default::default()
            })),
        }));
        assert_eq!(shared.describe(), "mps 25% 8 GiB shared");
        let in_mig = ShapeView::from(Some(&pb::Shape {
            kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent: 25,
                memory_bytes: 8 << 30,
                mode: pb::MpsMode::Shared as i32,
                mig_profile: "3g.40gb".into(),
            })),
        }));
        assert_eq!(in_mig.describe(), "mps 25% 8 GiB shared in 3g.40gb");
        let gpu = ShapeView::from(Some(&pb::Shape {
            kind: Some(pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count: 0 })),
        }));
        assert_eq!(
            serde_json::to_value(&gpu).unwrap(),
            serde_json::json!({"kind": "gpu"})
        );
    }

    #[test]
    fn enum_names_are_lowercase() {
        assert_eq!(
            lease_state_name(pb::LeaseState::Revoking as i32),
            "revoking"
        );
        assert_eq!(lease_state_name(42), "unknown(42)");
        assert_eq!(
            event_kind_name(pb::LeaseEventKind::ContainerBound as i32),
            "container_bound"
        );
        assert_eq!(
            partition_kind_name(pb::PartitionKind::WholeGpu as i32),
            "gpu"
        );
    }
}
