//! `tessera watch`: one line per lease event until the daemon closes the stream.

use serde::Serialize;
use tessera_proto::v1 as pb;
use tokio_stream::StreamExt;

use crate::client::{CliError, Daemon};
use crate::output::{self, LeaseView, abs_time, event_kind_name};

#[derive(Debug, Serialize)]
pub struct EventView {
    pub kind: String,
    /// Where to resume from (`tessera watch --since`).
    pub revision: u64,
    pub at_ms: i64,
    pub message: String,
    pub lease: Option<LeaseView>,
}

impl From<&pb::LeaseEvent> for EventView {
    fn from(e: &pb::LeaseEvent) -> Self {
        Self {
            kind: event_kind_name(e.kind),
            revision: e.revision,
            at_ms: e.at_ms,
            message: e.message.clone(),
            lease: e.lease.as_ref().map(LeaseView::from),
        }
    }
}

impl EventView {
    /// "2026-11-21T10:00:00Z  created  l-7f3a  team-a  mig 1g.10gb on gpu 0  @17"
    pub fn line(&self) -> String {
        let (id, tenant) = self
            .lease
            .as_ref()
            .map_or(("-", "-"), |l| (l.id.as_str(), l.tenant.as_str()));
        let message = if self.message.is_empty() {
            "-"
        } else {
            self.message.as_str()
        };
        format!(
            "{}  {:<17}  {id}  {tenant}  {message}  @{}",
            abs_time(self.at_ms),
            self.kind,
            self.revision
        )
    }
}

pub async fn run(
    daemon: &mut Daemon,
    tenant: Option<String>,
    since: Option<u64>,
    bookmarks: bool,
    json: bool,
) -> anyhow::Result<()> {
    let mut stream = daemon
        .client
        .watch_leases(pb::WatchLeasesRequest {
            tenant: tenant.unwrap_or_default(),
            since_revision: since.unwrap_or(0),
            bookmarks,
        })
        .await
        .map_err(|s| daemon.fail("WatchLeases", s))?
        .into_inner();
    while let Some(item) = stream.next().await {
        let event = item.map_err(|s| daemon.fail("WatchLeases", s))?;
        let view = EventView::from(&event);
        let mut line = if json {
            serde_json::to_string(&view)?
        } else {
            view.line()
        };
        line.push('\n');
        output::print(&line)?;
    }
    Err(CliError::StreamEnded {
        socket: daemon.socket.clone(),
    }
    .into())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::output::tests::{NOW, sample_lease};

    fn event() -> pb::LeaseEvent {
        pb::LeaseEvent {
            kind: pb::LeaseEventKind::Created as i32,
            lease: Some(sample_lease()),
            at_ms: NOW,
            message: "mig 1g.10gb on gpu 0".to_owned(),
            revision: 17,
        }
    }

    #[test]
    fn event_line_has_time_kind_lease_tenant_message() {
        assert_eq!(
            EventView::from(&event()).line(),
            "2026-11-21T10:00:00Z  created            l-7f3a  team-a  mig 1g.10gb on gpu 0  @17"
        );
    }

    #[test]
    fn event_json_is_one_line_object() {
        let text = serde_json::to_string(&EventView::from(&event())).unwrap();
        assert!(!text.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["kind"], "created");
        assert_eq!(v["revision"], 17);
        assert_eq!(v["at_ms"], NOW);
        assert_eq!(v["lease"]["id"], "l-7f3a");
        assert_eq!(v["lease"]["state"], "active");
    }
}
