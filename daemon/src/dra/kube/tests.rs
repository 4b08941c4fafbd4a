#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::config::OnUnhealthy;
use crate::dra::claims::{ClaimRef, ClaimSourceError};

fn slice_config() -> SliceConfig {
    SliceConfig {
        node_name: "node-a".into(),
        mps_classes: Vec::new(),
        on_unhealthy: OnUnhealthy::Keep,
    }
}

/// A kubeconfig of an HTTPS server that is not there: the client is built (TLS
/// included) and a publish is an error the task logs and retries, not a panic.
#[tokio::test]
async fn a_kubeconfig_is_read_and_an_unreachable_server_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    // A port nobody listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let path = dir.path().join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: k\n  cluster:\n    server: https://127.0.0.1:{port}\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: c\n  context:\n    cluster: k\n    user: u\n"
        ),
    )
    .unwrap();
    let client = connect(Some(&path)).await.unwrap();
    let mut publisher = Publisher::new(client, slice_config());
    let err = publisher.publish(&NodeState::default()).await.unwrap_err();
    assert!(matches!(err, KubeError::Api { .. }), "{err}");
    assert!(err.to_string().contains("node-a"), "{err}");

    let missing = dir.path().join("nope");
    let Err(err) = connect(Some(&missing)).await else {
        panic!("a missing kubeconfig made a client");
    };
    assert!(matches!(err, KubeError::Kubeconfig { .. }), "{err}");
    assert!(err.to_string().contains("nope"), "{err}");
}

#[test]
fn a_claim_of_another_uid_or_without_allocation_is_refused() {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"},
        "spec": {},
    }))
    .unwrap();
    let r = ClaimRef {
        namespace: "ns".into(),
        name: "c".into(),
        uid: "u-1".into(),
    };
    assert!(matches!(
        claims::allocation_of(&r, &claim),
        Err(ClaimSourceError::NotAllocated(_))
    ));
    let other = ClaimRef {
        uid: "u-2".into(),
        ..r
    };
    assert!(matches!(
        claims::allocation_of(&other, &claim),
        Err(ClaimSourceError::NotFound(_))
    ));
}
