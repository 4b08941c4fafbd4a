//! `tessera lease ...`: create, list, show, renew, release.

use std::collections::HashMap;
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use tessera_proto::v1 as pb;

use crate::client::{CliError, Daemon};
use crate::output::{self, LeaseView, lease_table};
use crate::parse;

#[derive(Debug, Subcommand)]
pub enum LeaseCmd {
    /// Lease a MIG instance, an MPS share or a whole GPU; prints the lease and its token.
    Create(Box<CreateArgs>),
    /// List leases (live ones unless --state or --all).
    List(ListArgs),
    /// Show one lease, with the containers bound to it.
    Show {
        /// Lease id.
        id: String,
    },
    /// Extend a lease's expiry.
    Renew {
        /// Lease id.
        id: String,
        /// New time to live from now (e.g. 1h, 30m); default: the lease's own TTL.
        #[arg(long, value_parser = parse::parse_duration)]
        ttl: Option<Duration>,
    },
    /// Release a lease: its containers are stopped and its partition freed.
    Release {
        /// Lease id.
        id: String,
        /// Why, for the audit log.
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("shape").required(true).multiple(false)))]
pub struct CreateArgs {
    /// Tenant the lease is for. Default: the caller's own tenant (a tenant's unix
    /// principal, client certificate or token decides it); an admin names one.
    #[arg(long)]
    pub tenant: Option<String>,
    /// A MIG instance: GPU instance profile, optionally /compute profile (1g.10gb, 3g.40gb/1c).
    #[arg(long, group = "shape", value_parser = parse::parse_mig, value_name = "PROFILE[/CI]")]
    pub mig: Option<pb::MigShape>,
    /// An MPS share: SM percentage and memory limit (25%,8GiB or 50,16384MiB).
    #[arg(long, group = "shape", value_parser = parse::parse_mps, value_name = "SM%,MEMORY")]
    pub mps: Option<pb::MpsShape>,
    /// A whole GPU.
    #[arg(long, group = "shape")]
    pub gpu: bool,
    /// N whole GPUs in one lease, the best connected free set (see --topology).
    #[arg(long, group = "shape", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub gpus: Option<u32>,
    /// With --mig: N instances of the profile in one lease, placed together by
    /// topology and created all or none.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub count: Option<u32>,
    /// With --gpus or --count: how closely the GPUs must be connected: "nvlink"
    /// (every pair by NVLink), "numa" (one NUMA node) or "any" (the best there
    /// is). Refused, naming why, when room exists but not within it.
    #[arg(long, value_enum, value_name = "LINK")]
    pub topology: Option<TopologyArg>,
    /// Ask by need: this much device memory (e.g. 20GiB); the daemon picks the
    /// smallest partition that fits now (see --isolation).
    #[arg(long, group = "shape", value_parser = parse::parse_size, value_name = "SIZE")]
    pub memory: Option<u64>,
    /// With --memory: "hardware" (its own MIG instance or GPU; the default) or
    /// "shared" (an MPS share with SMs in proportion to the memory).
    #[arg(long, value_enum, value_name = "KIND")]
    pub isolation: Option<IsolationArg>,
    /// With --mps (or --memory --isolation shared): "isolated" (its own MPS control
    /// daemon, limits enforced by it; servers on one GPU time-slice) or "shared" (the
    /// GPU's one server for the tenant, leases run concurrently, limits client-side).
    /// Default: the daemon's partition.mps_mode.
    #[arg(long, value_enum, value_name = "MODE")]
    pub mps_mode: Option<MpsModeArg>,
    /// With --mps: MPS inside MIG, a share of a MIG instance of this profile (SM% of
    /// the instance, memory within it) on the instance's one MPS server.
    #[arg(long, value_name = "PROFILE")]
    pub in_mig: Option<String>,
    /// Time to live (e.g. 1h, 30m); default: the daemon's configured default.
    #[arg(long, value_parser = parse::parse_duration)]
    pub ttl: Option<Duration>,
    /// Idempotency key: a retry with the same id returns the same lease.
    #[arg(long)]
    pub request_id: Option<String>,
    /// A label KEY=VALUE; repeat for more.
    #[arg(long = "label", value_parser = parse::parse_label, value_name = "KEY=VALUE")]
    pub labels: Vec<(String, String)>,
    /// Priority class; default: the tenant's.
    #[arg(long)]
    pub priority_class: Option<String>,
    /// Pin the lease to this GPU (index).
    #[arg(long)]
    pub gpu_index: Option<u32>,
    /// When there is no room now, wait up to this long (e.g. 30s, 5m) in the daemon's
    /// admission queue for leases to end (at most its lease.max_queue_wait).
    #[arg(long, value_parser = parse::parse_duration)]
    pub wait: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MpsModeArg {
    Isolated,
    Shared,
}

impl From<MpsModeArg> for pb::MpsMode {
    fn from(m: MpsModeArg) -> Self {
        match m {
            MpsModeArg::Isolated => Self::Isolated,
            MpsModeArg::Shared => Self::Shared,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TopologyArg {
    Any,
    Numa,
    Nvlink,
}

impl From<TopologyArg> for pb::TopologyConstraint {
    fn from(t: TopologyArg) -> Self {
        match t {
            TopologyArg::Any => Self::Any,
            TopologyArg::Numa => Self::Numa,
            TopologyArg::Nvlink => Self::Nvlink,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IsolationArg {
    Hardware,
    Shared,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum StateArg {
    Active,
    Pending,
    Revoking,
    Released,
    Expired,
    Revoked,
    Failed,
}

impl From<StateArg> for pb::LeaseState {
    fn from(s: StateArg) -> Self {
        match s {
            StateArg::Active => Self::Active,
            StateArg::Pending => Self::Pending,
            StateArg::Revoking => Self::Revoking,
            StateArg::Released => Self::Released,
            StateArg::Expired => Self::Expired,
            StateArg::Revoked => Self::Revoked,
            StateArg::Failed => Self::Failed,
        }
    }
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only this tenant's leases.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only leases in this state.
    #[arg(long, value_enum, conflicts_with = "all")]
    pub state: Option<StateArg>,
    /// Include ended leases (released, expired, revoked, failed).
    #[arg(long)]
    pub all: bool,
    /// Show at most this many leases (the oldest first); without it, every one.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: Option<u32>,
}

/// The most leases the CLI asks for in one page (the daemon's maximum).
const PAGE_SIZE: u32 = 1000;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LeaseArgError {
    #[error("label {0:?} given twice")]
    DuplicateLabel(String),
    #[error("--mps-mode applies to --mps or to --memory with --isolation shared")]
    MpsModeWithoutMps,
    #[error("--topology applies to a lease of several partitions: --gpus N or --mig P --count N")]
    TopologyWithoutCount,
    #[error("--count applies to --mig (for whole GPUs: --gpus N)")]
    CountWithoutMig,
    #[error("--in-mig applies to --mps (an MPS share inside a MIG instance)")]
    InMigWithoutMps,
    #[error("--isolation applies to --memory (a lease asked for by need)")]
    IsolationWithoutMemory,
    #[error("--wait of {0} s is too long")]
    WaitTooLong(u64),
}

impl CreateArgs {
    /// The request this command sends.
    pub fn to_request(&self) -> Result<pb::CreateLeaseRequest, LeaseArgError> {
        use pb::shape::Kind;
        let mps_mode = self
            .mps_mode
            .map_or(pb::MpsMode::Unspecified, pb::MpsMode::from) as i32;
        // What clap's `requires` would say: it is not enforced here, for arguments
        // of a required group, so the pairs are checked by hand.
        if self.isolation.is_some() && self.memory.is_none() {
            return Err(LeaseArgError::IsolationWithoutMemory);
        }
        if self.in_mig.is_some() && self.mps.is_none() {
            return Err(LeaseArgError::InMigWithoutMps);
        }
        let isolation = self.isolation.unwrap_or(IsolationArg::Hardware);
        let shared_need = self.memory.is_some() && isolation == IsolationArg::Shared;
        if self.mps_mode.is_some() && self.mps.is_none() && !shared_need {
            return Err(LeaseArgError::MpsModeWithoutMps);
        }
        if self.count.is_some() && self.mig.is_none() {
            return Err(LeaseArgError::CountWithoutMig);
        }
        if self.topology.is_some() && self.gpus.is_none() && self.count.is_none() {
            return Err(LeaseArgError::TopologyWithoutCount);
        }
        let kind = if let Some(m) = &self.mig {
            Kind::Mig(pb::MigShape {
                count: self.count.unwrap_or(0),
                ..m.clone()
            })
        } else if let Some(m) = &self.mps {
            Kind::Mps(pb::MpsShape {
                mode: mps_mode,
                mig_profile: self.in_mig.clone().unwrap_or_default(),
                ..m.clone()
            })
        } else if let Some(memory_bytes) = self.memory {
            Kind::Need(pb::NeedShape {
                memory_bytes,
                isolation: match isolation {
                    IsolationArg::Hardware => pb::Isolation::Hardware,
                    IsolationArg::Shared => pb::Isolation::Shared,
                } as i32,
                mps_mode,
            })
        } else {
            // clap's "shape" group guarantees exactly one of --mig, --mps, --gpu,
            // --gpus, --memory.
            Kind::WholeGpu(pb::WholeGpuShape {
                count: self.gpus.unwrap_or(0),
            })
        };
        let mut labels = HashMap::new();
        for (k, v) in &self.labels {
            if labels.insert(k.clone(), v.clone()).is_some() {
                return Err(LeaseArgError::DuplicateLabel(k.clone()));
            }
        }
        Ok(pb::CreateLeaseRequest {
            tenant: self.tenant.clone().unwrap_or_default(),
            shape: Some(pb::Shape { kind: Some(kind) }),
            ttl_seconds: self.ttl.map_or(0, |d| d.as_secs()),
            request_id: self.request_id.clone().unwrap_or_default(),
            labels,
            priority_class: self.priority_class.clone().unwrap_or_default(),
            gpu_index: self.gpu_index,
            topology: self.topology.map_or(
                pb::TopologyConstraint::Unspecified,
                pb::TopologyConstraint::from,
            ) as i32,
            queue_wait_ms: match self.wait {
                None => 0,
                Some(d) => u32::try_from(d.as_millis())
                    .map_err(|_| LeaseArgError::WaitTooLong(d.as_secs()))?,
            },
        })
    }
}

impl LeaseCmd {
    /// Checks what clap cannot (duplicate labels) before anything is sent.
    pub fn validate(&self) -> Result<(), CliError> {
        match self {
            Self::Create(args) => args
                .to_request()
                .map(drop)
                .map_err(|e| CliError::Usage(e.to_string())),
            _ => Ok(()),
        }
    }
}

#[derive(Debug, Serialize)]
struct CreatedView {
    lease: Option<LeaseView>,
    token: String,
    replayed: bool,
}

const TOKEN_NOTICE: &str = "This token is shown once: store it now. tesserad keeps only its hash and cannot show it again.";

pub async fn run(daemon: &mut Daemon, cmd: LeaseCmd, json: bool) -> anyhow::Result<()> {
    let now = parse::now_ms();
    match cmd {
        LeaseCmd::Create(args) => {
            let req = args.to_request()?;
            let resp = daemon
                .client
                .create_lease(req)
                .await
                .map_err(|s| daemon.fail("CreateLease", s))?
                .into_inner();
            let view = CreatedView {
                lease: resp.lease.as_ref().map(LeaseView::from),
                token: resp.token,
                replayed: resp.replayed,
            };
            if json {
                eprintln!("{TOKEN_NOTICE}");
                return output::print_json(&view);
            }
            let mut text = String::new();
            if view.replayed {
                text.push_str("request id matched an existing lease: returning it with a new token (earlier tokens stay valid)\n");
            }
            if let Some(lease) = &view.lease {
                text.push_str(&lease.render_detail(now));
            }
            text.push_str(&format!("\ntoken: {}\n{TOKEN_NOTICE}\n", view.token));
            output::print(&text)?;
        }
        LeaseCmd::List(args) => list(daemon, args, json, now).await?,
        LeaseCmd::Show { id } => {
            let resp = daemon
                .client
                .get_lease(pb::GetLeaseRequest { lease_id: id })
                .await
                .map_err(|s| daemon.fail("GetLease", s))?
                .into_inner();
            print_lease(resp.lease.as_ref(), json, now)?;
        }
        LeaseCmd::Renew { id, ttl } => {
            let resp = daemon
                .client
                .renew_lease(pb::RenewLeaseRequest {
                    lease_id: id,
                    ttl_seconds: ttl.map_or(0, |d| d.as_secs()),
                })
                .await
                .map_err(|s| daemon.fail("RenewLease", s))?
                .into_inner();
            print_lease(resp.lease.as_ref(), json, now)?;
        }
        LeaseCmd::Release { id, reason } => {
            let resp = daemon
                .client
                .release_lease(pb::ReleaseLeaseRequest {
                    lease_id: id,
                    reason: reason.unwrap_or_default(),
                })
                .await
                .map_err(|s| daemon.fail("ReleaseLease", s))?
                .into_inner();
            // Times are shown relative to when the answer came: a release waits for
            // the containers' grace period, so "now" from before the call would
            // put the end in the future ("ended in 3s").
            print_lease(resp.lease.as_ref(), json, parse::now_ms())?;
        }
    }
    Ok(())
}

/// Every page of the listing (up to `--limit` leases). `--json` prints one JSON
/// array page by page, so the output is a valid array once complete and a long
/// listing starts showing at once; the table needs every row for its widths.
async fn list(daemon: &mut Daemon, args: ListArgs, json: bool, now: i64) -> anyhow::Result<()> {
    let mut req = pb::ListLeasesRequest {
        tenant: args.tenant.unwrap_or_default(),
        state: args
            .state
            .map_or(pb::LeaseState::Unspecified, pb::LeaseState::from) as i32,
        include_ended: args.all,
        ..Default::default()
    };
    let mut left = args.limit;
    let mut views: Vec<LeaseView> = Vec::new();
    let mut shown = 0usize;
    if json {
        output::print("[")?;
    }
    loop {
        let size = left.map_or(PAGE_SIZE, |n| n.min(PAGE_SIZE));
        req.page_size = i32::try_from(size).unwrap_or(i32::MAX);
        let resp = daemon
            .client
            .list_leases(req.clone())
            .await
            .map_err(|s| daemon.fail("ListLeases", s))?
            .into_inner();
        let take = left.map_or(resp.leases.len(), |n| resp.leases.len().min(n as usize));
        if json {
            let mut text = String::new();
            for l in &resp.leases[..take] {
                text.push_str(if shown == 0 { "\n" } else { ",\n" });
                text.push_str(&serde_json::to_string_pretty(&LeaseView::from(l))?);
                shown += 1;
            }
            output::print(&text)?;
        } else {
            views.extend(resp.leases[..take].iter().map(LeaseView::from));
        }
        if let Some(n) = left.as_mut() {
            *n = n.saturating_sub(u32::try_from(take).unwrap_or(u32::MAX));
        }
        if resp.next_page_token.is_empty() || left == Some(0) {
            break;
        }
        req.page_token = resp.next_page_token;
    }
    if json {
        return Ok(output::print(if shown == 0 { "]\n" } else { "\n]\n" })?);
    }
    if views.is_empty() {
        output::print("no leases\n")?;
    } else {
        output::print(&lease_table(&views, now))?;
    }
    Ok(())
}

fn print_lease(lease: Option<&pb::Lease>, json: bool, now: i64) -> anyhow::Result<()> {
    let view = lease.map(LeaseView::from);
    if json {
        return output::print_json(&view);
    }
    match view {
        Some(v) => output::print(&v.render_detail(now))?,
        None => output::print("the daemon returned no lease\n")?,
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use clap::Parser;

    type Harness = crate::harness::Harness<LeaseCmd>;

    fn create(args: &[&str]) -> Result<CreateArgs, clap::Error> {
        let argv = ["tessera", "create"].iter().chain(args);
        match Harness::try_parse_from(argv)?.cmd {
            LeaseCmd::Create(c) => Ok(*c),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn create_waits_in_the_queue_only_when_asked() {
        let args = ["--tenant", "t", "--mig", "7g.80gb"];
        let req = create(&args).unwrap().to_request().unwrap();
        assert_eq!(req.queue_wait_ms, 0, "no --wait: refused at once");
        let mut with = args.to_vec();
        with.extend(["--wait", "30s"]);
        let req = create(&with).unwrap().to_request().unwrap();
        assert_eq!(req.queue_wait_ms, 30_000);
        with.extend(["--wait", "60d"]);
        assert!(create(&with).is_err(), "--wait given twice");
        let long = ["--tenant", "t", "--mig", "7g.80gb", "--wait", "60d"];
        let err = create(&long).unwrap().to_request().unwrap_err();
        assert!(err.to_string().contains("too long"), "{err}");
    }

    #[test]
    fn create_mps_request() {
        let req = create(&[
            "--tenant",
            "team-a",
            "--mps",
            "25%,8GiB",
            "--ttl",
            "1h",
            "--label",
            "team=ml",
            "--label",
            "run=7",
            "--request-id",
            "r1",
            "--gpu-index",
            "1",
        ])
        .unwrap()
        .to_request()
        .unwrap();
        assert_eq!(req.tenant, "team-a");
        assert_eq!(
            req.shape.unwrap().kind,
            Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent: 25,
                memory_bytes: 8 << 30,
                mode: pb::MpsMode::Unspecified as i32,
                ..Default::default()
            }))
        );
        assert_eq!(req.ttl_seconds, 3600);
        assert_eq!(req.labels.get("team").map(String::as_str), Some("ml"));
        assert_eq!(req.labels.len(), 2);
        assert_eq!(req.request_id, "r1");
        assert_eq!(req.gpu_index, Some(1));
    }

    #[test]
    fn several_gpus_or_instances_with_a_topology_constraint() {
        let req = |args: &[&str]| {
            let mut argv = vec!["--tenant", "t"];
            argv.extend_from_slice(args);
            create(&argv)
        };
        let r = req(&["--gpus", "4", "--topology", "nvlink"])
            .unwrap()
            .to_request()
            .unwrap();
        assert_eq!(
            r.shape.unwrap().kind,
            Some(pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count: 4 }))
        );
        assert_eq!(r.topology, pb::TopologyConstraint::Nvlink as i32);
        let r = req(&["--mig", "3g.40gb", "--count", "3", "--topology", "numa"])
            .unwrap()
            .to_request()
            .unwrap();
        match r.shape.unwrap().kind {
            Some(pb::shape::Kind::Mig(m)) => {
                assert_eq!((m.profile.as_str(), m.count), ("3g.40gb", 3))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(r.topology, pb::TopologyConstraint::Numa as i32);
        // No constraint: unspecified (the daemon's "any").
        let r = req(&["--gpus", "2"]).unwrap().to_request().unwrap();
        assert_eq!(r.topology, pb::TopologyConstraint::Unspecified as i32);
        // What does not go together is refused before anything is sent.
        assert_eq!(
            req(&["--count", "2", "--gpu"]).unwrap().to_request(),
            Err(LeaseArgError::CountWithoutMig),
            "--count needs --mig"
        );
        assert!(req(&["--gpus", "2", "--gpu"]).is_err(), "one shape");
        assert!(req(&["--gpus", "0"]).is_err());
        assert_eq!(
            req(&["--gpu", "--topology", "nvlink"])
                .unwrap()
                .to_request(),
            Err(LeaseArgError::TopologyWithoutCount)
        );
    }

    #[test]
    fn in_mig_and_isolation_go_with_their_shapes_only() {
        let to_req = |args: &[&str]| {
            let mut argv = vec!["--tenant", "t"];
            argv.extend_from_slice(args);
            create(&argv).unwrap().to_request()
        };
        assert_eq!(
            to_req(&["--gpu", "--in-mig", "3g.40gb"]).unwrap_err(),
            LeaseArgError::InMigWithoutMps
        );
        assert_eq!(
            to_req(&["--mig", "1g.10gb", "--isolation", "shared"]).unwrap_err(),
            LeaseArgError::IsolationWithoutMemory
        );
        let Some(pb::shape::Kind::Mps(m)) = to_req(&["--mps", "50%,4GiB", "--in-mig", "3g.40gb"])
            .unwrap()
            .shape
            .unwrap()
            .kind
        else {
            panic!("not an MPS share")
        };
        assert_eq!(m.mig_profile, "3g.40gb");
        let Some(pb::shape::Kind::Need(n)) =
            to_req(&["--memory", "8GiB"]).unwrap().shape.unwrap().kind
        else {
            panic!("not a need")
        };
        assert_eq!(
            n.isolation,
            pb::Isolation::Hardware as i32,
            "hardware by default"
        );
    }

    #[test]
    fn mps_mode_goes_with_an_mps_share_only() {
        let shape = |args: &[&str]| {
            let mut argv = vec!["--tenant", "t"];
            argv.extend_from_slice(args);
            create(&argv)
                .unwrap()
                .to_request()
                .map(|r| r.shape.unwrap().kind)
        };
        assert_eq!(
            shape(&["--mps", "25%,8GiB", "--mps-mode", "shared"]).unwrap(),
            Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent: 25,
                memory_bytes: 8 << 30,
                mode: pb::MpsMode::Shared as i32,
                ..Default::default()
            }))
        );
        let Some(pb::shape::Kind::Need(n)) = shape(&[
            "--memory",
            "8GiB",
            "--isolation",
            "shared",
            "--mps-mode",
            "isolated",
        ])
        .unwrap() else {
            panic!("not a need")
        };
        assert_eq!(n.mps_mode, pb::MpsMode::Isolated as i32);
        for other in [&["--gpu"][..], &["--memory", "8GiB"], &["--mig", "1g.10gb"]] {
            let mut args = other.to_vec();
            args.extend(["--mps-mode", "shared"]);
            assert_eq!(shape(&args).unwrap_err(), LeaseArgError::MpsModeWithoutMps);
        }
        let err =
            create(&["--tenant", "t", "--mps", "25%,8GiB", "--mps-mode", "both"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue);
    }

    #[test]
    fn without_tenant_the_daemon_takes_the_callers_own() {
        let req = create(&["--gpu"]).unwrap().to_request().unwrap();
        assert_eq!(req.tenant, "", "an empty tenant: the caller's own");
    }

    #[test]
    fn create_needs_exactly_one_shape() {
        let err = create(&["--tenant", "t"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        let err = create(&["--tenant", "t", "--gpu", "--mig", "1g.10gb"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
        let req = create(&["--tenant", "t", "--gpu"])
            .unwrap()
            .to_request()
            .unwrap();
        assert_eq!(
            req.shape.unwrap().kind,
            Some(pb::shape::Kind::WholeGpu(pb::WholeGpuShape { count: 0 }))
        );
        assert_eq!(req.ttl_seconds, 0, "no --ttl means the daemon's default");
        assert_eq!(req.gpu_index, None);
    }

    #[test]
    fn create_refuses_bad_values_and_duplicate_labels() {
        let err = create(&["--tenant", "t", "--mps", "150%,8G"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        let err = create(&["--tenant", "t", "--gpu", "--label", "novalue"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        let args = create(&["--tenant", "t", "--gpu", "--label", "a=1", "--label", "a=2"]).unwrap();
        assert_eq!(
            args.to_request().unwrap_err(),
            LeaseArgError::DuplicateLabel("a".to_owned())
        );
    }

    #[test]
    fn list_state_maps_to_proto() {
        let parsed = Harness::try_parse_from(["tessera", "list", "--state", "revoking"]).unwrap();
        let LeaseCmd::List(args) = parsed.cmd else {
            panic!("not list")
        };
        assert_eq!(
            pb::LeaseState::from(args.state.unwrap()),
            pb::LeaseState::Revoking
        );
        assert!(Harness::try_parse_from(["tessera", "list", "--state", "bogus"]).is_err());
    }
}
