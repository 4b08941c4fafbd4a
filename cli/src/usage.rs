//! `tessera usage`: partition-seconds per tenant over a window.

use clap::Args;
use serde::Serialize;
use tessera_proto::v1 as pb;

use crate::client::{CliError, Daemon};
use crate::output::{self, Table};
use crate::parse;

#[derive(Debug, Args)]
pub struct UsageArgs {
    /// Only this tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Window start: RFC 3339 UTC (2026-11-21T00:00:00Z) or a duration ago (24h, "2h ago").
    #[arg(long, value_parser = parse::parse_time_ago, value_name = "TIME")]
    pub from: Option<i64>,
    /// Window end, same forms as --from; default now.
    #[arg(long, value_parser = parse::parse_time_ago, value_name = "TIME")]
    pub to: Option<i64>,
    /// CSV with raw numbers instead of a table.
    #[arg(long)]
    pub csv: bool,
}

#[derive(Debug, Serialize)]
pub struct UsageView {
    pub tenant: String,
    pub leases: u64,
    pub mig_slice_seconds: f64,
    pub mps_sm_percent_seconds: f64,
    pub memory_gib_seconds: f64,
    pub whole_gpu_seconds: f64,
}

impl From<&pb::TenantUsage> for UsageView {
    fn from(u: &pb::TenantUsage) -> Self {
        Self {
            tenant: u.tenant.clone(),
            leases: u.leases,
            mig_slice_seconds: u.mig_slice_seconds,
            mps_sm_percent_seconds: u.mps_sm_percent_seconds,
            memory_gib_seconds: u.memory_gib_seconds,
            whole_gpu_seconds: u.whole_gpu_seconds,
        }
    }
}

impl UsageArgs {
    /// Checks the window before anything is sent.
    pub fn validate(&self) -> Result<(), CliError> {
        match (self.from, self.to) {
            (Some(from), Some(to)) if from > to => Err(CliError::Usage(format!(
                "--from ({}) is after --to ({})",
                output::abs_time(from),
                output::abs_time(to)
            ))),
            _ => Ok(()),
        }
    }
}

pub async fn run(daemon: &mut Daemon, args: UsageArgs, json: bool) -> anyhow::Result<()> {
    args.validate()?;
    let from_ms = args.from.unwrap_or(0);
    let to_ms = args.to.unwrap_or(0);
    let resp = daemon
        .client
        .get_usage(pb::GetUsageRequest {
            tenant: args.tenant.unwrap_or_default(),
            from_ms,
            to_ms,
        })
        .await
        .map_err(|s| daemon.fail("GetUsage", s))?
        .into_inner();
    let views: Vec<UsageView> = resp.usage.iter().map(UsageView::from).collect();
    if json {
        return output::print_json(&views);
    }
    if args.csv {
        output::print(&usage_csv(&views))?;
    } else if views.is_empty() {
        output::print("no usage in this window\n")?;
    } else {
        output::print(&usage_table(&views))?;
    }
    Ok(())
}

/// Hours with two decimals: people read GPU time in hours.
fn hours(seconds: f64) -> String {
    format!("{:.2}", seconds / 3600.0)
}

pub fn usage_table(views: &[UsageView]) -> String {
    let mut t = Table::new(&[
        "TENANT",
        "LEASES",
        "MIG SLICE-H",
        "MPS SM%-H",
        "MEMORY GIB-H",
        "WHOLE GPU-H",
    ]);
    for u in views {
        t.row(vec![
            u.tenant.clone(),
            u.leases.to_string(),
            hours(u.mig_slice_seconds),
            hours(u.mps_sm_percent_seconds),
            hours(u.memory_gib_seconds),
            hours(u.whole_gpu_seconds),
        ]);
    }
    t.render()
}

pub fn usage_csv(views: &[UsageView]) -> String {
    let mut out = String::from(
        "tenant,leases,mig_slice_seconds,mps_sm_percent_seconds,memory_gib_seconds,whole_gpu_seconds\n",
    );
    for u in views {
        out.push_str(&format!(
            "{},{},{},{},{},{}\n",
            csv_field(&u.tenant),
            u.leases,
            u.mig_slice_seconds,
            u.mps_sm_percent_seconds,
            u.memory_gib_seconds,
            u.whole_gpu_seconds
        ));
    }
    out
}

/// RFC 4180 quoting when a field needs it.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn sample() -> Vec<UsageView> {
        vec![UsageView {
            tenant: "team,a".to_owned(),
            leases: 3,
            mig_slice_seconds: 7200.0,
            mps_sm_percent_seconds: 90000.0,
            memory_gib_seconds: 1800.0,
            whole_gpu_seconds: 0.0,
        }]
    }

    #[test]
    fn csv_has_raw_numbers_and_quotes() {
        assert_eq!(
            usage_csv(&sample()),
            "tenant,leases,mig_slice_seconds,mps_sm_percent_seconds,memory_gib_seconds,whole_gpu_seconds\n\"team,a\",3,7200,90000,1800,0\n"
        );
    }

    #[test]
    fn table_in_hours() {
        let text = usage_table(&sample());
        let row = text.lines().nth(1).unwrap();
        assert_eq!(
            row,
            "team,a  3       2.00         25.00      0.50          0.00"
        );
    }
}
