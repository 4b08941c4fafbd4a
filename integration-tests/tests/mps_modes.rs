//! MPS modes, end to end on the simulator over gRPC and the CLI: shared leases of a
//! tenant on one GPU share one MPS server (running concurrently, limits client-side
//! in the container's env); isolated leases get a server each (time-sliced, limits on
//! the daemon side); a GPU serves one mode at a time; the last shared lease stops its
//! server; the GPU reports how its servers share it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use tessera_integration_tests::{DEV_GPUS, TestDaemon, invariants::sim_of, lease_of, rt};
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
                ..Default::default()
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
            ..Default::default()
        })
        .await
        .unwrap();

        // The first lease leaves: the server stays for the second (the same control
        // daemon, not a new one started after it: the simulator hands each start a
        // new pid); the last one stops it.
        let servers = || {
            let mut s: Vec<(String, Option<u32>)> = sim_of(&d, DEV_GPUS)
                .mps_daemons()
                .unwrap()
                .into_iter()
                .filter(|m| m.running && m.spec.gpu == 2)
                .map(|m| (m.spec.lease_id, m.pid))
                .collect();
            s.sort();
            s
        };
        let before = servers();
        assert_eq!(before.len(), 1, "{before:?}");
        release(&mut c, &first_lease).await;
        let g = mps_gpu(&mut c).await;
        assert_eq!(g.mps_servers, 1, "{g:?}");
        assert_eq!(
            servers(),
            before,
            "the shared server was stopped or restarted"
        );
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

fn mig_share(tenant: &str, sm_percent: u32, gib: u64, profile: &str) -> pb::CreateLeaseRequest {
    pb::CreateLeaseRequest {
        tenant: tenant.into(),
        shape: Some(pb::Shape {
            kind: Some(pb::shape::Kind::Mps(pb::MpsShape {
                sm_percent,
                memory_bytes: gib << 30,
                mig_profile: profile.into(),
                ..Default::default()
            })),
        }),
        ..Default::default()
    }
}

/// The MIG instances hosting MPS shares: (partition id, gpu, profile, uuid).
async fn mps_hosts(c: &mut Client) -> Vec<(String, u32, String, String)> {
    let node = c
        .get_node(pb::GetNodeRequest {})
        .await
        .unwrap()
        .into_inner();
    let shares: Vec<String> = node
        .gpus
        .iter()
        .flat_map(|g| g.partitions.iter())
        .filter_map(|p| p.mps.as_ref().map(|m| m.mig_host.clone()))
        .filter(|h| !h.is_empty())
        .collect();
    let mut hosts: Vec<(String, u32, String, String)> = node
        .gpus
        .iter()
        .flat_map(|g| g.partitions.iter())
        .filter(|p| p.lease_id.is_empty() && shares.contains(&p.id))
        .filter_map(|p| {
            let m = p.mig.as_ref()?;
            Some((
                p.id.clone(),
                p.gpu_index,
                m.profile.clone(),
                m.mig_uuid.clone(),
            ))
        })
        .collect();
    hosts.sort();
    hosts
}

/// Any MIG instance not leased and not in the static pool (tesserad creates none
/// other than MPS hosts here).
async fn unleased_instances(c: &mut Client) -> usize {
    let node = c
        .get_node(pb::GetNodeRequest {})
        .await
        .unwrap()
        .into_inner();
    node.gpus
        .iter()
        .flat_map(|g| g.partitions.iter())
        .filter(|p| p.mig.is_some() && p.lease_id.is_empty())
        .count()
}

#[test]
fn mps_shares_inside_a_mig_instance_share_its_one_server() {
    let mut d = TestDaemon::start("").unwrap();
    let (ok, out) = d.cli(&[
        "lease", "create", "--tenant", "team-a", "--mps", "30%,8GiB", "--in-mig", "3g.40gb",
    ]);
    assert!(
        ok && out.contains("mps 30% 8 GiB shared in 3g.40gb"),
        "{out}"
    );

    let (a2, overflow) = rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let hosts = mps_hosts(&mut c).await;
        assert_eq!(hosts.len(), 1, "{hosts:?}");
        let (host, _, profile, uuid) = hosts[0].clone();
        assert_eq!(profile, "3g.40gb");
        assert!(uuid.starts_with("MIG-"), "{uuid}");
        let (ok, out) = d.cli(&["node"]);
        assert!(ok && out.contains("hosts MPS of team-a"), "{out}");

        // The tenant's next share joins the instance; its container gets the
        // instance's devices and the share's limits.
        let a2 = c
            .create_lease(mig_share("team-a", 50, 10, "3g.40gb"))
            .await
            .unwrap()
            .into_inner();
        let l = a2.lease.clone().unwrap();
        let p = l.partition.clone().unwrap();
        assert_eq!(p.mps.clone().unwrap().mig_host, host);
        assert_eq!(p.gpu_uuid, uuid);
        let r = c
            .resolve_token(pb::ResolveTokenRequest {
                token: a2.token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.env["CUDA_VISIBLE_DEVICES"], uuid);
        assert_eq!(r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50");
        assert_eq!(r.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=10240M");
        assert_eq!(r.granted_capabilities.len(), 2, "{r:?}");
        assert!(
            r.devices
                .iter()
                .any(|n| n.container_path.starts_with("/dev/nvidia-caps/")),
            "{r:?}"
        );

        // 30% + 50% + 30% > 100%: a second instance; another tenant never joins.
        let overflow = c
            .create_lease(mig_share("team-a", 30, 1, "3g.40gb"))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let b = c
            .create_lease(mig_share("team-b", 10, 1, "3g.40gb"))
            .await
            .unwrap()
            .into_inner()
            .lease
            .unwrap();
        let hosts = mps_hosts(&mut c).await;
        assert_eq!(hosts.len(), 3, "{hosts:?}");
        for l in [&overflow, &b] {
            assert_ne!(l.partition.clone().unwrap().mps.unwrap().mig_host, host);
        }
        release(&mut c, &b.id).await;

        // Refused with the reason: more than the instance holds, isolated mode.
        let st = c
            .create_lease(mig_share("team-a", 10, 40, "3g.40gb"))
            .await
            .unwrap_err();
        assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
        let mut iso = mig_share("team-a", 10, 1, "3g.40gb");
        if let Some(pb::shape::Kind::Mps(m)) = iso.shape.as_mut().and_then(|s| s.kind.as_mut()) {
            m.mode = pb::MpsMode::Isolated as i32;
        }
        let st = c.create_lease(iso).await.unwrap_err();
        assert!(st.message().contains("one MPS server"), "{st:?}");
        (l, overflow)
    });

    // A restart keeps the shares, their instances and their servers.
    d.stop().unwrap();
    d.spawn().unwrap();
    rt().block_on(async {
        let mut c = d.client().await.unwrap();
        let l = lease_of(&mut c, &a2.id).await;
        assert_eq!(l.state, pb::LeaseState::Active as i32);
        assert_eq!(mps_hosts(&mut c).await.len(), 2);

        // Every share released: the instances go with their last share
        // (housekeeping destroys them).
        let all = c
            .list_leases(pb::ListLeasesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .leases;
        for l in all
            .iter()
            .filter(|l| l.state == pb::LeaseState::Active as i32)
        {
            release(&mut c, &l.id).await;
        }
        let _ = overflow;
        let mut left = usize::MAX;
        for _ in 0..200 {
            left = unleased_instances(&mut c).await;
            if left == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert_eq!(left, 0, "the MPS host instances were destroyed");
    });
}
