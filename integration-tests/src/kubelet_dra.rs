//! kubelet's side of a DRA driver, for the DRA suites: the plugin watcher's half of
//! pluginregistration v1 (find the socket in the registry dir, GetInfo, pick the
//! DRAPlugin service, NotifyRegistrationStatus) and a DRAPlugin v1 client of the
//! endpoint GetInfo names, over the vendored kubelet protos; and what a prepared
//! device's CDI ids say.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tessera_proto::k8s::dra::v1 as drav1;
use tessera_proto::k8s::pluginregistration::v1 as reg;
use tonic::transport::Channel;

/// kubelet's side: registered through the registry dir, a client of the endpoint.
pub struct Kubelet {
    pub info: reg::PluginInfo,
    pub dra: drav1::dra_plugin_client::DraPluginClient<Channel>,
}

impl Kubelet {
    /// What kubelet's plugin watcher does: find the one socket in `registry`,
    /// GetInfo, check it, dial the endpoint, and say it registered.
    pub async fn register(registry: &Path) -> Kubelet {
        let sockets: Vec<PathBuf> = std::fs::read_dir(registry)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(sockets.len(), 1, "one registration socket: {sockets:?}");
        let ch = tessera_common::unix::channel(&sockets[0]).await.unwrap();
        let mut registration = reg::registration_client::RegistrationClient::new(ch);
        let info = registration
            .get_info(reg::InfoRequest {})
            .await
            .unwrap()
            .into_inner();
        // kubelet's DRA handler: the newest DRAPlugin service it knows.
        let chosen = info
            .supported_versions
            .iter()
            .find(|v| ["v1.DRAPlugin", "v1beta1.DRAPlugin"].contains(&v.as_str()))
            .expect("a DRAPlugin service kubelet knows");
        assert_eq!(chosen, "v1.DRAPlugin");
        let ch = tessera_common::unix::channel(Path::new(&info.endpoint))
            .await
            .unwrap();
        registration
            .notify_registration_status(reg::RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            })
            .await
            .unwrap();
        Kubelet {
            info,
            dra: drav1::dra_plugin_client::DraPluginClient::new(ch),
        }
    }

    pub async fn prepare(
        &mut self,
        claims: &[(&str, &str, &str)],
    ) -> HashMap<String, drav1::NodePrepareResourceResponse> {
        let claims = claims
            .iter()
            .map(|(ns, name, uid)| drav1::Claim {
                namespace: ns.to_string(),
                name: name.to_string(),
                uid: uid.to_string(),
            })
            .collect();
        self.dra
            .node_prepare_resources(drav1::NodePrepareResourcesRequest { claims })
            .await
            .unwrap()
            .into_inner()
            .claims
    }

    pub async fn prepare_one(
        &mut self,
        ns: &str,
        name: &str,
        uid: &str,
    ) -> drav1::NodePrepareResourceResponse {
        let mut out = self.prepare(&[(ns, name, uid)]).await;
        assert_eq!(out.len(), 1);
        out.remove(uid).expect("the claim's answer")
    }

    pub async fn unprepare(&mut self, ns: &str, name: &str, uid: &str) -> String {
        let mut out = self
            .dra
            .node_unprepare_resources(drav1::NodeUnprepareResourcesRequest {
                claims: vec![drav1::Claim {
                    namespace: ns.into(),
                    name: name.into(),
                    uid: uid.into(),
                }],
            })
            .await
            .unwrap()
            .into_inner()
            .claims;
        out.remove(uid).expect("the claim's answer").error
    }
}

/// The lease a prepared device's CDI id names (the first; the second is its claim's
/// token spec).
pub fn lease_of(d: &drav1::Device) -> String {
    assert_eq!(d.cdi_device_ids.len(), 2, "{d:?}");
    assert!(
        d.cdi_device_ids[1].starts_with("tessera.io/claim="),
        "{d:?}"
    );
    d.cdi_device_ids[0]
        .strip_prefix("tessera.io/lease=")
        .unwrap_or_else(|| panic!("not a per-lease CDI id: {d:?}"))
        .to_string()
}

/// The tokens claim `uid`'s token spec gives its containers (root-only file).
pub fn claim_tokens(cdi_dir: &Path, uid: &str) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let path = cdi_dir.join(format!("tessera.io-claim-{uid}.json"));
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "{}",
        path.display()
    );
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(spec["kind"], "tessera.io/claim");
    assert_eq!(spec["devices"][0]["name"], uid);
    let env = spec["devices"][0]["containerEdits"]["env"][0]
        .as_str()
        .unwrap();
    env.strip_prefix("TESSERA_LEASE_TOKEN=")
        .unwrap()
        .split(',')
        .map(String::from)
        .collect()
}
