//! `tessera quota ...` and `tessera reload`: thin wrappers on the admin RPCs.

use std::time::{Duration, SystemTime};

use clap::{Args, Subcommand};
use serde::Serialize;
use tessera_proto::v1 as pb;

use crate::client::{CliError, Daemon};
use crate::output::{self, Table, human_bytes, when};
use crate::parse;

#[derive(Debug, Subcommand)]
pub enum QuotaCmd {
    /// A tenant's guaranteed and burst quota and what it uses now.
    Show {
        /// Tenant.
        tenant: String,
    },
    /// A temporary extra burst quota for a tenant, with an expiry and a reason.
    Grant(GrantArgs),
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("amount").required(true).multiple(true)))]
pub struct GrantArgs {
    /// Tenant.
    pub tenant: String,
    /// Extra MIG compute slices.
    #[arg(long, group = "amount")]
    pub mig_slices: Option<u32>,
    /// Extra MPS SM percentage (summed over leases; may exceed 100 across GPUs).
    #[arg(long, group = "amount")]
    pub mps_sm_percent: Option<u32>,
    /// Extra memory (e.g. 16GiB).
    #[arg(long, group = "amount", value_parser = parse::parse_size)]
    pub memory: Option<u64>,
    /// Extra whole GPUs.
    #[arg(long, group = "amount")]
    pub whole_gpus: Option<u32>,
    /// How long the grant lasts (e.g. 2h).
    #[arg(long, value_parser = parse::parse_duration)]
    pub expires: Duration,
    /// Why, for the audit log.
    #[arg(long)]
    pub reason: String,
}

#[derive(Debug, Serialize, Default)]
pub struct AmountsView {
    pub mig_slices: u32,
    pub mps_sm_percent: u32,
    pub memory_bytes: u64,
    pub whole_gpus: u32,
}

impl From<Option<&pb::QuotaAmounts>> for AmountsView {
    fn from(a: Option<&pb::QuotaAmounts>) -> Self {
        a.map_or_else(Self::default, |a| Self {
            mig_slices: a.mig_slices,
            mps_sm_percent: a.mps_sm_percent,
            memory_bytes: a.memory_bytes,
            whole_gpus: a.whole_gpus,
        })
    }
}

#[derive(Debug, Serialize)]
pub struct QuotaView {
    pub tenant: String,
    pub priority_class: String,
    pub guaranteed: AmountsView,
    pub burst: AmountsView,
    pub used: AmountsView,
}

impl From<&pb::GetQuotaResponse> for QuotaView {
    fn from(q: &pb::GetQuotaResponse) -> Self {
        Self {
            tenant: q.tenant.clone(),
            priority_class: q.priority_class.clone(),
            guaranteed: AmountsView::from(q.guaranteed.as_ref()),
            burst: AmountsView::from(q.burst.as_ref()),
            used: AmountsView::from(q.used.as_ref()),
        }
    }
}

pub fn quota_text(q: &QuotaView) -> String {
    let mut out = format!(
        "tenant {}  priority class {}\n",
        q.tenant,
        if q.priority_class.is_empty() {
            "-"
        } else {
            &q.priority_class
        }
    );
    let mut t = Table::new(&["RESOURCE", "USED", "GUARANTEED", "BURST"]);
    let cols = [&q.used, &q.guaranteed, &q.burst];
    t.row(
        std::iter::once("mig slices".to_owned())
            .chain(cols.iter().map(|a| a.mig_slices.to_string()))
            .collect(),
    );
    t.row(
        std::iter::once("mps sm%".to_owned())
            .chain(cols.iter().map(|a| format!("{}%", a.mps_sm_percent)))
            .collect(),
    );
    t.row(
        std::iter::once("memory".to_owned())
            .chain(cols.iter().map(|a| human_bytes(a.memory_bytes)))
            .collect(),
    );
    t.row(
        std::iter::once("whole gpus".to_owned())
            .chain(cols.iter().map(|a| a.whole_gpus.to_string()))
            .collect(),
    );
    out.push_str(&t.render());
    out
}

impl GrantArgs {
    pub fn to_request(&self, now: SystemTime) -> Result<pb::GrantQuotaRequest, CliError> {
        let expires = now
            .checked_add(self.expires)
            .and_then(parse::system_time_to_ms)
            .ok_or_else(|| CliError::Usage("--expires is too far in the future".to_owned()))?;
        if self.reason.trim().is_empty() {
            return Err(CliError::Usage("--reason must not be empty".to_owned()));
        }
        Ok(pb::GrantQuotaRequest {
            tenant: self.tenant.clone(),
            extra_burst: Some(pb::QuotaAmounts {
                mig_slices: self.mig_slices.unwrap_or(0),
                mps_sm_percent: self.mps_sm_percent.unwrap_or(0),
                memory_bytes: self.memory.unwrap_or(0),
                whole_gpus: self.whole_gpus.unwrap_or(0),
            }),
            expires_at_ms: expires,
            reason: self.reason.clone(),
        })
    }
}

impl QuotaCmd {
    /// Checks the grant before anything is sent.
    pub fn validate(&self) -> Result<(), CliError> {
        match self {
            Self::Grant(args) => args.to_request(SystemTime::now()).map(drop),
            Self::Show { .. } => Ok(()),
        }
    }
}

#[derive(Debug, Serialize)]
struct GrantView {
    grant_id: String,
    tenant: String,
    expires_at_ms: i64,
}

#[derive(Debug, Serialize)]
struct ReloadView {
    message: String,
}

pub async fn quota(daemon: &mut Daemon, cmd: QuotaCmd, json: bool) -> anyhow::Result<()> {
    match cmd {
        QuotaCmd::Show { tenant } => {
            let resp = daemon
                .client
                .get_quota(pb::GetQuotaRequest { tenant })
                .await
                .map_err(|s| daemon.fail("GetQuota", s))?
                .into_inner();
            let view = QuotaView::from(&resp);
            if json {
                return output::print_json(&view);
            }
            output::print(&quota_text(&view))?;
        }
        QuotaCmd::Grant(args) => {
            let req = args.to_request(SystemTime::now())?;
            let expires_at_ms = req.expires_at_ms;
            let tenant = req.tenant.clone();
            let resp = daemon
                .client
                .grant_quota(req)
                .await
                .map_err(|s| daemon.fail("GrantQuota", s))?
                .into_inner();
            let view = GrantView {
                grant_id: resp.grant_id,
                tenant,
                expires_at_ms,
            };
            if json {
                return output::print_json(&view);
            }
            output::print(&format!(
                "granted {} to {} until {}\n",
                view.grant_id,
                view.tenant,
                when(view.expires_at_ms, parse::now_ms())
            ))?;
        }
    }
    Ok(())
}

pub async fn reload(daemon: &mut Daemon, json: bool) -> anyhow::Result<()> {
    let resp = daemon
        .client
        .reload_config(pb::ReloadConfigRequest {})
        .await
        .map_err(|s| daemon.fail("ReloadConfig", s))?
        .into_inner();
    let view = ReloadView {
        message: resp.message,
    };
    if json {
        return output::print_json(&view);
    }
    let msg = if view.message.is_empty() {
        "configuration reloaded"
    } else {
        view.message.as_str()
    };
    output::print(&format!("{msg}\n"))?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::time::UNIX_EPOCH;

    type Harness = crate::harness::Harness<QuotaCmd>;

    #[test]
    fn grant_request_carries_amounts_expiry_and_reason() {
        let parsed = Harness::try_parse_from([
            "tessera",
            "grant",
            "team-a",
            "--mig-slices",
            "2",
            "--memory",
            "16GiB",
            "--expires",
            "2h",
            "--reason",
            "deadline",
        ])
        .unwrap();
        let QuotaCmd::Grant(args) = parsed.cmd else {
            panic!("not grant")
        };
        let now = UNIX_EPOCH + Duration::from_secs(1_000);
        let req = args.to_request(now).unwrap();
        assert_eq!(req.tenant, "team-a");
        assert_eq!(req.expires_at_ms, (1_000 + 7_200) * 1000);
        let extra = req.extra_burst.unwrap();
        assert_eq!(extra.mig_slices, 2);
        assert_eq!(extra.memory_bytes, 16 << 30);
        assert_eq!(extra.whole_gpus, 0);
        assert_eq!(req.reason, "deadline");
    }

    #[test]
    fn grant_needs_an_amount_expiry_and_reason() {
        let full = ["--mig-slices", "1", "--expires", "2h", "--reason", "r"];
        // Leave out each pair in turn: amount, expiry, reason.
        for skip in [0, 2, 4] {
            let mut argv = vec!["tessera", "grant", "t"];
            for (i, a) in full.iter().enumerate() {
                if i != skip && i != skip + 1 {
                    argv.push(a);
                }
            }
            assert!(Harness::try_parse_from(&argv).is_err(), "{argv:?}");
        }
        let mut argv = vec!["tessera", "grant", "t"];
        argv.extend(full);
        assert!(Harness::try_parse_from(&argv).is_ok(), "{argv:?}");
    }

    #[test]
    fn quota_table() {
        let view = QuotaView::from(&pb::GetQuotaResponse {
            tenant: "team-a".to_owned(),
            guaranteed: Some(pb::QuotaAmounts {
                mig_slices: 2,
                mps_sm_percent: 50,
                memory_bytes: 20 << 30,
                whole_gpus: 0,
            }),
            burst: None,
            used: Some(pb::QuotaAmounts {
                mig_slices: 1,
                mps_sm_percent: 0,
                memory_bytes: 10 << 30,
                whole_gpus: 0,
            }),
            priority_class: "high".to_owned(),
        });
        let text = quota_text(&view);
        assert!(
            text.starts_with("tenant team-a  priority class high\n"),
            "{text}"
        );
        assert!(
            text.contains("memory      10 GiB  20 GiB      0 B\n"),
            "{text}"
        );
        assert_eq!(
            serde_json::to_value(&view).unwrap()["burst"]["mig_slices"],
            0
        );
    }

    #[test]
    fn blank_reason_is_a_usage_error() {
        let parsed = Harness::try_parse_from([
            "tessera",
            "grant",
            "t",
            "--whole-gpus",
            "1",
            "--expires",
            "1h",
            "--reason",
            "  ",
        ])
        .unwrap();
        let err = parsed.cmd.validate().unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert_eq!(err.to_string(), "--reason must not be empty");
    }
}
