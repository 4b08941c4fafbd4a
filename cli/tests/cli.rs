//! The `tessera` binary against an in-process fake tesserad on a unix socket: what an
//! operator sees (stdout, stderr, exit code) and what the daemon receives.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};

use tessera_proto::v1 as pb;
use tessera_proto::v1::tessera_server::{Tessera, TesseraServer};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

type Reply<T> = Result<Response<T>, Status>;

#[derive(Default)]
struct Fake {
    list_requests: Mutex<Vec<pb::ListLeasesRequest>>,
    create_requests: Mutex<Vec<pb::CreateLeaseRequest>>,
    watch_requests: Mutex<Vec<pb::WatchLeasesRequest>>,
}

fn lease(id: &str, tenant: &str) -> pb::Lease {
    pb::Lease {
        id: id.to_owned(),
        tenant: tenant.to_owned(),
        state: pb::LeaseState::Active as i32,
        shape: Some(pb::Shape {
            kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent: 25,
                memory_bytes: 8 << 30,
                ..Default::default()
            })),
        }),
        partition: None,
        created_at_ms: 1_795_255_200_000,
        expires_at_ms: 1_795_258_800_000,
        ttl_seconds: 3600,
        ..Default::default()
    }
}

#[tonic::async_trait]
impl Tessera for Fake {
    async fn get_node(&self, _: Request<pb::GetNodeRequest>) -> Reply<pb::GetNodeResponse> {
        Ok(Response::new(pb::GetNodeResponse {
            hostname: "gpu-host-1".to_owned(),
            backend: "sim".to_owned(),
            version: "0.1.0".to_owned(),
            driver_version: "550.54".to_owned(),
            queued_requests: 0,
            gpus: vec![pb::Gpu {
                index: 0,
                uuid: "GPU-1111".to_owned(),
                name: "NVIDIA A100-SXM4-80GB".to_owned(),
                memory_bytes: 80 << 30,
                mig_enabled: true,
                mig_pending: true,
                free_slices: 7,
                profiles: vec![pb::ProfileCapacity {
                    profile: "1g.10gb".to_owned(),
                    gi_profile_id: 19,
                    slices: 1,
                    memory_bytes: 10_468_982_784,
                    sm_count: 14,
                    free: 7,
                    max_count: 7,
                }],
                ..Default::default()
            }],
        }))
    }
    async fn create_lease(
        &self,
        req: Request<pb::CreateLeaseRequest>,
    ) -> Reply<pb::CreateLeaseResponse> {
        let req = req.into_inner();
        self.create_requests.lock().unwrap().push(req.clone());
        if req.tenant != "team-a" {
            return Err(Status::resource_exhausted(
                "tenant team-b: no 1g.10gb free on any GPU",
            ));
        }
        Ok(Response::new(pb::CreateLeaseResponse {
            lease: Some(lease("l-1", &req.tenant)),
            token: "tok-secret-123".to_owned(),
            replayed: false,
        }))
    }
    async fn renew_lease(
        &self,
        _: Request<pb::RenewLeaseRequest>,
    ) -> Reply<pb::RenewLeaseResponse> {
        Err(Status::not_found("no lease l-404"))
    }
    async fn release_lease(
        &self,
        _: Request<pb::ReleaseLeaseRequest>,
    ) -> Reply<pb::ReleaseLeaseResponse> {
        Err(Status::unimplemented("not in this fake"))
    }
    async fn get_lease(&self, _: Request<pb::GetLeaseRequest>) -> Reply<pb::GetLeaseResponse> {
        Err(Status::unimplemented("not in this fake"))
    }
    async fn list_leases(
        &self,
        req: Request<pb::ListLeasesRequest>,
    ) -> Reply<pb::ListLeasesResponse> {
        // Two pages of one lease each, as a daemon answers a page size of 1 or
        // one whose page stops short of its message limit.
        let req = req.into_inner();
        let first = req.page_token.is_empty();
        self.list_requests.lock().unwrap().push(req);
        Ok(Response::new(if first {
            pb::ListLeasesResponse {
                leases: vec![lease("l-1", "team-a")],
                next_page_token: "page-2".to_owned(),
                revision: 41,
            }
        } else {
            pb::ListLeasesResponse {
                leases: vec![lease("l-2", "team-b")],
                next_page_token: String::new(),
                revision: 41,
            }
        }))
    }
    type WatchLeasesStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::LeaseEvent, Status>>>;
    async fn watch_leases(
        &self,
        req: Request<pb::WatchLeasesRequest>,
    ) -> Reply<Self::WatchLeasesStream> {
        self.watch_requests.lock().unwrap().push(req.into_inner());
        let events = vec![
            Ok(pb::LeaseEvent {
                kind: pb::LeaseEventKind::Created as i32,
                lease: Some(lease("l-1", "team-a")),
                at_ms: 1_795_255_200_000,
                message: "mps 25% on gpu 0".to_owned(),
                revision: 42,
            }),
            Ok(pb::LeaseEvent {
                kind: pb::LeaseEventKind::Released as i32,
                lease: Some(lease("l-1", "team-a")),
                at_ms: 1_795_255_260_000,
                message: String::new(),
                revision: 43,
            }),
        ];
        Ok(Response::new(tokio_stream::iter(events)))
    }
    async fn resolve_token(
        &self,
        _: Request<pb::ResolveTokenRequest>,
    ) -> Reply<pb::ResolveTokenResponse> {
        Err(Status::unimplemented("not in this fake"))
    }
    async fn bind_container(
        &self,
        _: Request<pb::BindContainerRequest>,
    ) -> Reply<pb::BindContainerResponse> {
        Err(Status::unimplemented("not in this fake"))
    }
    async fn unbind_container(
        &self,
        _: Request<pb::UnbindContainerRequest>,
    ) -> Reply<pb::UnbindContainerResponse> {
        Err(Status::unimplemented("not in this fake"))
    }
    async fn report_admission(
        &self,
        _: Request<pb::ReportAdmissionRequest>,
    ) -> Reply<pb::ReportAdmissionResponse> {
        Err(Status::unimplemented("not in this fake"))
    }
    async fn get_usage(&self, _: Request<pb::GetUsageRequest>) -> Reply<pb::GetUsageResponse> {
        Err(Status::unimplemented("usage accounting is not built yet"))
    }
    async fn reload_config(
        &self,
        _: Request<pb::ReloadConfigRequest>,
    ) -> Reply<pb::ReloadConfigResponse> {
        Ok(Response::new(pb::ReloadConfigResponse {
            message: "reloaded: 3 tenants".to_owned(),
        }))
    }
    async fn grant_quota(
        &self,
        _: Request<pb::GrantQuotaRequest>,
    ) -> Reply<pb::GrantQuotaResponse> {
        Err(Status::permission_denied("admin only"))
    }
    async fn get_quota(&self, _: Request<pb::GetQuotaRequest>) -> Reply<pb::GetQuotaResponse> {
        Err(Status::unimplemented("not in this fake"))
    }
    async fn set_gpu_health(
        &self,
        _: Request<pb::SetGpuHealthRequest>,
    ) -> Reply<pb::SetGpuHealthResponse> {
        Err(Status::unimplemented("not in this fake"))
    }
}

struct Daemon {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    fake: Arc<Fake>,
    _server: tokio::task::JoinHandle<()>,
}

async fn start() -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("tesserad.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let fake = Arc::new(Fake::default());
    let service = TesseraServer::from_arc(fake.clone());
    let server = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(UnixListenerStream::new(listener))
            .await
            .unwrap();
    });
    Daemon {
        _dir: dir,
        socket,
        fake,
        _server: server,
    }
}

async fn tessera(socket: &Path, args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_tessera"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env_remove("TESSERA_SOCKET")
        .output()
        .await
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn gpus_table_and_json() {
    let d = start().await;
    let out = tessera(&d.socket, &["gpus"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("INDEX  NAME"), "{stdout}");
    assert!(stdout.contains("GPU-1111  80 GiB  on   7"), "{stdout}");

    let out = tessera(&d.socket, &["--json", "gpus"]).await;
    assert_eq!(out.status.code(), Some(0));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json[0]["mig_mode"], "on");
    assert_eq!(json[0]["free_slices"], 7);

    let out = tessera(&d.socket, &["node"]).await;
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("1g.10gb  19  1       9.75 GiB  14   7     7"));
}

#[tokio::test]
async fn lease_create_prints_token_once_notice() {
    let d = start().await;
    let out = tessera(
        &d.socket,
        &[
            "lease", "create", "--tenant", "team-a", "--mps", "25%,8GiB", "--ttl", "1h", "--label",
            "team=ml",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("token: tok-secret-123\n"), "{stdout}");
    assert!(stdout.contains("shown once"), "{stdout}");
    assert!(
        stdout.contains("shape:") && stdout.contains("mps 25% 8 GiB"),
        "{stdout}"
    );
    let sent = d.fake.create_requests.lock().unwrap().clone();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].ttl_seconds, 3600);
    assert_eq!(sent[0].labels.get("team").map(String::as_str), Some("ml"));
}

#[tokio::test]
async fn refusal_exits_1_with_code_and_message() {
    let d = start().await;
    let out = tessera(
        &d.socket,
        &["lease", "create", "--tenant", "team-b", "--mig", "1g.10gb"],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "tessera: refused (ResourceExhausted): tenant team-b: no 1g.10gb free on any GPU\n"
    );
    let out = tessera(&d.socket, &["usage", "--from", "24h"]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("refused (Unimplemented): this tesserad does not implement GetUsage yet: usage accounting is not built yet"),
        "{}",
        text(&out.stderr)
    );
}

#[tokio::test]
async fn lease_list_sends_filters_and_renders_rows() {
    let d = start().await;
    let out = tessera(
        &d.socket,
        &["lease", "list", "--tenant", "team-a", "--state", "revoking"],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().count(), 3, "{stdout}");
    assert!(
        stdout
            .lines()
            .nth(2)
            .unwrap()
            .starts_with("l-2  team-b  active  mps 25% 8 GiB  -"),
        "{stdout}"
    );
    let out = tessera(&d.socket, &["lease", "list", "--all", "--json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 2);
    assert_eq!(json[1]["shape"]["kind"], "mps");
    let sent = d.fake.list_requests.lock().unwrap().clone();
    // Each listing reads both pages, the second with the first's token and the
    // same filter.
    assert_eq!(sent.len(), 4);
    assert_eq!(sent[0].tenant, "team-a");
    assert_eq!(sent[0].state, pb::LeaseState::Revoking as i32);
    assert!(!sent[0].include_ended);
    assert_eq!(sent[0].page_token, "");
    assert_eq!(sent[1].page_token, "page-2");
    assert_eq!(sent[1].tenant, "team-a");
    assert_eq!(sent[1].state, pb::LeaseState::Revoking as i32);
    assert_eq!(sent[2].state, pb::LeaseState::Unspecified as i32);
    assert!(sent[2].include_ended);
    assert!(sent[3].include_ended);
}

#[tokio::test]
async fn lease_list_limit_stops_after_that_many() {
    let d = start().await;
    let out = tessera(&d.socket, &["lease", "list", "--limit", "1", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<&str> = json
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["l-1"]);
    let sent = d.fake.list_requests.lock().unwrap().clone();
    assert_eq!(sent.len(), 1, "no second page asked for");
    assert_eq!(sent[0].page_size, 1);
    let out = tessera(&d.socket, &["lease", "list", "--limit", "0"]).await;
    assert_eq!(out.status.code(), Some(2), "a limit of 0 is a usage error");
}

#[tokio::test]
async fn watch_json_one_object_per_line_then_stream_end_exits_3() {
    let d = start().await;
    let out = tessera(&d.socket, &["watch", "--json"]).await;
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    let first: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(first["kind"], "created");
    assert_eq!(first["lease"]["id"], "l-1");
    let second: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
    assert_eq!(second["kind"], "released");
    assert_eq!(second["revision"], 43);
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out.stderr).contains("closed the event stream"));
    let sent = d.fake.watch_requests.lock().unwrap().clone();
    assert_eq!(sent[0].since_revision, 0, "from now");
    assert!(!sent[0].bookmarks);
}

#[tokio::test]
async fn watch_since_resumes_from_that_revision() {
    let d = start().await;
    let out = tessera(&d.socket, &["watch", "--since", "41", "--bookmarks"]).await;
    assert_eq!(out.status.code(), Some(3));
    let stdout = text(&out.stdout);
    assert!(
        stdout.lines().next().unwrap().ends_with("  @42"),
        "{stdout}"
    );
    let sent = d.fake.watch_requests.lock().unwrap().clone();
    assert_eq!(sent[0].since_revision, 41);
    assert!(sent[0].bookmarks);
}

#[tokio::test]
async fn reload_prints_the_daemons_message() {
    let d = start().await;
    let out = tessera(&d.socket, &["reload"]).await;
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(text(&out.stdout), "reloaded: 3 tenants\n");
}

#[tokio::test]
async fn unreachable_daemon_exits_3_with_hint() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("none.sock");
    let out = tessera(&socket, &["gpus"]).await;
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(
        text(&out.stderr),
        format!(
            "tessera: cannot reach tesserad at {}: No such file or directory — is it running? set --socket or TESSERA_SOCKET\n",
            socket.display()
        )
    );
}

#[tokio::test]
async fn usage_error_exits_2_without_contacting_the_daemon() {
    let out = tessera(
        Path::new("/nonexistent.sock"),
        &["lease", "create", "--tenant", "t", "--mps", "25%"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("invalid MPS share"),
        "{}",
        text(&out.stderr)
    );
}

#[tokio::test]
async fn contradictory_arguments_exit_2_before_connecting() {
    let missing = Path::new("/nonexistent.sock");
    let out = tessera(
        missing,
        &[
            "usage",
            "--from",
            "2026-11-21T10:00:00Z",
            "--to",
            "2026-11-20T10:00:00Z",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "tessera: --from (2026-11-21T10:00:00Z) is after --to (2026-11-20T10:00:00Z)\n"
    );
    let out = tessera(
        missing,
        &[
            "lease", "create", "--tenant", "t", "--gpu", "--label", "a=1", "--label", "a=2",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(text(&out.stderr), "tessera: label \"a\" given twice\n");
}
