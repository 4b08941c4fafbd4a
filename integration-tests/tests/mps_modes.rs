//! MPS modes, end to end on the simulator over gRPC and the CLI: shared leases of a
//! tenant on one GPU share one MPS server (running concurrently, limits client-side
//! in the container's env); isolated leases get a server each (time-sliced, limits on
//! the daemon side); a GPU serves one mode at a time; the last shared lease stops its
//! server; the GPU reports how its servers share it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use tessera_integration_tests::{TestDaemon, rt};
use tessera_proto::v1 as pb;
use tonic::transport::Channel;

type Client = tessera_proto::v1::tessera_client::TesseraClient<Channel>;

fn mps(tenant: &str, sm_percent: u32, gib: u64, mode: pb::MpsMode) -> pb::CreateLeaseRequest {
    pb::CreateLeaseRequest {
        tenant: tenant.into(),
        shape: Some(pb::Shape {
            kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent,
                memory_bytes: gib << 30,
                mode: mode as i32,
            })),
        }),
        ..Default::default()
    }
}

/// The simulated A100-40GB (index 2), the only GPU without MIG in DEV_GPUS.
async fn mps_gpu(c: &mut Client) -> pb::Gpu {
    c.get_node(pb::GetNodeRequest {})
        .await
        .unwrap()
        .into_inner()
        .gpus
        .into_iter()
        .find(|g| g.index == 2)
        .unwrap()
}

async fn release(c: &mut Client, id: &str) {
    let l = c
        .release_lease(pb::ReleaseLeaseRequest {
            lease_id: id.into(),
            reason: "done".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap();
    assert_eq!(l.state, pb::LeaseState::Released as i32, "{l:?}");
}

fn mps_part(l: &pb::Lease) -> pb::MpsPartition {
    l.partition.clone().unwrap().mps.unwrap()
}

#[test]
fn shared_leases_share_one_server_and_isolated_ones_get_their_own() {
    let d = TestDaemon::start("").unwrap();

    // The CLI: --mps-mode shared, and the lease says so.
    let (ok, out) = d.cli(&[
        "lease",
        "create",
        "--tenant",
        "team-a",
        "--mps",
        "30%,8GiB",
        "--mps-mode",
        "shared",
    ]);
    assert!(ok && out.contains("mps 30% 8 GiB shared"), "{out}");
    let (ok, out) = d.cli(&[
        "lease",
        "create",
        "--tenant",
        "team-a",
        "--gpu",
        "--mps-mode",
        "shared",
    ]);
    assert!(!ok && out.contains("--mps-mode applies to --mps"), "{out}");

    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let node = mps_gpu(&mut c).await;
        let first = node.partitions[0].clone();
        let first_lease = first.lease_id.clone();

        // A second shared lease of the tenant joins the same server.
        let second = c
            .create_lease(mps("team-a", 40, 8, pb::MpsMode::Shared))
            .await
            .unwrap()
            .into_inner();
        let second_lease = second.lease.clone().unwrap();
        let p2 = mps_part(&second_lease);
        assert_eq!(p2.mode, pb::MpsMode::Shared as i32);
        assert_eq!(p2.pipe_dir, first.mps.clone().unwrap().pipe_dir);
        assert!(p2.pipe_dir.contains("shared-gpu2-team-a"), "{p2:?}");
        let g = mps_gpu(&mut c).await;
        assert_eq!(g.mps_mode, pb::MpsMode::Shared as i32);
        assert_eq!((g.mps_servers, g.mps_time_slice_percent), (1, 100));
        assert_eq!(g.mps_sm_percent_used, 70);

        // Its limits are the client's: in the container's env.
        let r = c
            .resolve_token(pb::ResolveTokenRequest {
                token: second.token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "40");
        assert_eq!(r.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=8192M");
        assert_eq!(r.env["CUDA_MPS_PIPE_DIRECTORY"], "/run/nvidia-mps");

        // One mode per GPU: an isolated share (the configured default) is refused
        // with the reason.
        let st = c
            .create_lease(mps("team-a", 10, 1, pb::MpsMode::Unspecified))
            .await
            .unwrap_err();
        assert!(
            st.message()
                .contains("serves shared shares, isolated asked"),
            "{st:?}"
        );

        // Another tenant's shared leases get their own server, time-sliced
        // against the first.
        let other = c
            .create_lease(mps("team-b", 10, 1, pb::MpsMode::Shared))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        assert!(mps_part(&other).pipe_dir.contains("shared-gpu2-team-b"));
        let g = mps_gpu(&mut c).await;
        assert_eq!((g.mps_servers, g.mps_time_slice_percent), (2, 50));
        release(&mut c, &other.id).await;

        // The server serves one uid: the first container's.
        let bind = |token: &str, id: &str, uid: u32| pb::BindContainerRequest {
            token: token.into(),
            container_id: id.into(),
            uid: Some(uid),
            ..Default::default()
        };
        c.bind_container(bind(&second.token, "c-1", 1000))
            .await
            .unwrap();
        let (ok, out) = d.cli(&["node"]);
        assert!(
            ok && out.contains("shared mode, 1 server: its clients run concurrently"),
            "{out}"
        );
        c.unbind_container(pb::UnbindContainerRequest {
            container_id: "c-1".into(),
        })
        .await
        .unwrap();

        // The first lease leaves: the server stays for the second; the last one
        // stops it.
        release(&mut c, &first_lease).await;
        let g = mps_gpu(&mut c).await;
        assert_eq!(g.mps_servers, 1, "{g:?}");
        release(&mut c, &second_lease.id).await;
        let g = mps_gpu(&mut c).await;
        assert_eq!((g.mps_servers, g.mps_mode), (0, 0), "{g:?}");

        // Now isolated: a server per lease, time-sliced.
        for sm in [20, 30] {
            let l = c
                .create_lease(mps("team-a", sm, 4, pb::MpsMode::Unspecified))
                .await
                .unwrap()
                .into_inner()
                .lease
                .unwrap();
            assert_eq!(mps_part(&l).mode, pb::MpsMode::Isolated as i32);
        }
        let g = mps_gpu(&mut c).await;
        assert_eq!(g.mps_mode, pb::MpsMode::Isolated as i32);
        assert_eq!((g.mps_servers, g.mps_time_slice_percent), (2, 50));
        let st = c
            .create_lease(mps("team-a", 10, 1, pb::MpsMode::Shared))
            .await
            .unwrap_err();
        assert!(
            st.message()
                .contains("serves isolated shares, shared asked"),
            "{st:?}"
        );
        let (ok, out) = d.cli(&["node"]);
        assert!(
            ok && out.contains("isolated mode, 2 servers time-sliced, 50% of the time each"),
            "{out}"
        );
    });
}

#[test]
fn a_shared_server_serves_one_uid() {
    let d = TestDaemon::start("[partition]\nmps_mode = \"shared\"\n").unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        // Unspecified: the configured default, shared.
        let a = c
            .create_lease(mps("team-a", 20, 2, pb::MpsMode::Unspecified))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            mps_part(a.lease.as_ref().unwrap()).mode,
            pb::MpsMode::Shared as i32
        );
        let b = c
            .create_lease(mps("team-a", 20, 2, pb::MpsMode::Unspecified))
            .await
            .unwrap()
            .into_inner();
        let bind = |token: &str, id: &str, uid: u32| pb::BindContainerRequest {
            token: token.into(),
            container_id: id.into(),
            uid: Some(uid),
            ..Default::default()
        };
        c.bind_container(bind(&a.token, "c-a", 1000)).await.unwrap();
        let st = c
            .bind_container(bind(&b.token, "c-b", 2000))
            .await
            .unwrap_err();
        assert_eq!(st.code(), tonic::Code::FailedPrecondition);
        assert!(
            st.message()
                .contains("the shared MPS server of GPU 2 serves uid 1000"),
            "{st:?}"
        );
        c.bind_container(bind(&b.token, "c-b", 1000)).await.unwrap();
    });
}
