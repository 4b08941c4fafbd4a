//! The Kubernetes manifests in deploy/kubernetes/ say what docs/kubernetes.md says:
//! the DaemonSet mounts kubelet's sockets, the run and state directories from the
//! host and is privileged only in the container that must be; its ConfigMap is a
//! tesserad config that validates with the device plugin on; the sample pod asks
//! for a MIG partition with the tessera runtime class; the quota is on requests.
//! The DRA files (deploy/kubernetes/dra/) parse as the Kubernetes types they are:
//! device classes selecting the driver's devices by type, sample claims for a MIG
//! profile and an MPS class, the DaemonSet patch (node name, plugin directories,
//! service account), RBAC narrowed to the node's own slices and pool, and the
//! policy that holds pods using ResourceClaims to the tessera runtime class.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use serde_yaml_ng::Value;

fn manifest(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/kubernetes")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn s<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, k| match k.parse::<usize>() {
        Ok(i) => &v[i],
        Err(_) => &v[*k],
    })
}

#[test]
fn the_daemonset_mounts_kubelet_and_tessera_host_paths_and_is_privileged_only_where_it_must() {
    let ds = manifest("daemonset.yaml");
    assert_eq!(ds["kind"], "DaemonSet");
    let spec = s(&ds, &["spec", "template", "spec"]);
    let host_paths: Vec<(String, String)> = spec["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|v| {
            Some((
                v["name"].as_str()?.to_string(),
                v["hostPath"]["path"].as_str()?.to_string(),
            ))
        })
        .collect();
    let daemon = spec["containers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "tesserad")
        .unwrap();
    for want in [
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
        "/run/tessera",
        "/var/lib/tessera",
    ] {
        let (vol, _) = host_paths
            .iter()
            .find(|(_, p)| p == want)
            .unwrap_or_else(|| panic!("no hostPath volume for {want}"));
        let mounted = daemon["volumeMounts"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|m| m["name"] == vol.as_str() && m["mountPath"] == want);
        assert!(
            mounted,
            "{want} is not mounted at the same path in tesserad"
        );
    }
    assert_eq!(daemon["securityContext"]["privileged"], true);
    for c in spec["initContainers"].as_sequence().unwrap() {
        assert_ne!(c["securityContext"]["privileged"], true, "{:?}", c["name"]);
        assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    }
    assert_eq!(spec["automountServiceAccountToken"], false);
    // Callers are identified by their pid: the host's PID namespace.
    assert_eq!(spec["hostPID"], true);
    // The init container's command is the image's own installer (deploy/image).
    let init = &spec["initContainers"][0];
    let cmd = init["command"][0].as_str().unwrap();
    let installer = cmd.rsplit('/').next().unwrap();
    assert!(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/image")
            .join(installer)
            .is_file(),
        "the init container runs {cmd}, which the image does not have"
    );
    assert_eq!(
        spec["nodeSelector"]["tessera.io/node"],
        manifest("runtimeclass.yaml")["scheduling"]["nodeSelector"]["tessera.io/node"]
    );
}

#[test]
fn the_configmap_is_a_valid_tesserad_config_with_the_device_plugin_on() {
    let cm = manifest("configmap.yaml");
    let toml = cm["data"]["tesserad.toml"].as_str().unwrap();
    let cfg = tesserad::config::Config::parse(&PathBuf::from("configmap.yaml"), toml)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(cfg.kubernetes.device_plugin);
    assert!(cfg.kubernetes.mix.contains_key("mig-1g.10gb"));
    // The DaemonSet mounts the ConfigMap where tesserad reads it.
    let ds = manifest("daemonset.yaml");
    let cmd = s(
        &ds,
        &["spec", "template", "spec", "containers", "0", "command"],
    );
    assert!(
        cmd.as_sequence()
            .unwrap()
            .iter()
            .any(|a| a == "/etc/tessera/tesserad.toml")
    );
}

#[test]
fn the_sample_pod_asks_for_a_mig_partition_with_the_tessera_runtime_class() {
    let pod = manifest("sample-pod.yaml");
    assert_eq!(pod["spec"]["runtimeClassName"], "tessera");
    assert_eq!(manifest("runtimeclass.yaml")["handler"], "tessera");
    let limits = s(&pod, &["spec", "containers", "0", "resources", "limits"]);
    assert_eq!(limits["tessera.io/mig-1g.10gb"], 1);
    assert!(pod["metadata"]["annotations"]["tessera.io/lease-token"].is_null());
    let q = manifest("resourcequota.yaml");
    assert_eq!(q["spec"]["hard"]["requests.tessera.io/mig-1g.10gb"], "4");
}

#[test]
fn pods_asking_for_tessera_resources_must_use_the_runtime_class() {
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/admission-policy.yaml");
    let text = std::fs::read_to_string(&p).unwrap();
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    assert_eq!(docs[0]["kind"], "ValidatingAdmissionPolicy");
    let rule = docs[0]["spec"]["validations"][0]["expression"]
        .as_str()
        .unwrap();
    assert!(rule.contains("runtimeClassName == 'tessera'"), "{rule}");
    // CDI devices named in pod annotations (containerd injects them) count too.
    assert!(rule.contains("variables.asksTesseraCdi"), "{rule}");
    let vars = serde_json::to_string(&docs[0]["spec"]["variables"]).unwrap();
    assert!(
        vars.contains("cdi.k8s.io/") && vars.contains("tessera.io/"),
        "{vars}"
    );
    assert_eq!(docs[1]["spec"]["policyName"], docs[0]["metadata"]["name"]);
    assert_eq!(docs[1]["spec"]["validationActions"][0], "Deny");
}

fn documents(name: &str) -> Vec<Value> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/kubernetes/dra")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap_or_else(|e| panic!("{name}: {e}")))
        .collect()
}

/// A YAML document as the k8s-openapi type of its kind (fields and types checked).
fn typed<T: serde::de::DeserializeOwned>(doc: &Value) -> T {
    let json = serde_json::to_value(doc).unwrap();
    serde_json::from_value(json).unwrap_or_else(|e| panic!("{doc:?}: {e}"))
}

#[test]
fn the_dra_device_classes_select_the_drivers_devices_by_type() {
    use k8s_openapi::api::resource::v1::DeviceClass;
    let classes: Vec<DeviceClass> = documents("deviceclasses.yaml").iter().map(typed).collect();
    let names: Vec<_> = classes
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "mig.gpu.tessera.io",
            "mps.gpu.tessera.io",
            "gpu.gpu.tessera.io"
        ]
    );
    for c in &classes {
        let kind = c
            .metadata
            .name
            .as_deref()
            .unwrap()
            .split('.')
            .next()
            .unwrap();
        let cel = &c.spec.selectors.as_ref().unwrap()[0]
            .cel
            .as_ref()
            .unwrap()
            .expression;
        assert!(cel.contains(&format!(
            "device.driver == \"{}\"",
            tesserad::dra::DRIVER_NAME
        )));
        assert!(
            cel.contains(&format!(
                "device.attributes[\"gpu.tessera.io\"].type == \"{kind}\""
            )),
            "{cel}"
        );
    }
}

#[test]
fn the_sample_claims_ask_for_a_mig_profile_and_an_mps_class_with_the_runtime_class() {
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
    let docs = documents("sample-claims.yaml");
    let templates: Vec<ResourceClaimTemplate> = docs
        .iter()
        .filter(|d| d["kind"] == "ResourceClaimTemplate")
        .map(typed)
        .collect();
    let pods: Vec<Pod> = docs
        .iter()
        .filter(|d| d["kind"] == "Pod")
        .map(typed)
        .collect();
    assert_eq!((templates.len(), pods.len()), (2, 2));
    let request = |t: &ResourceClaimTemplate| {
        let r = &t
            .spec
            .spec
            .devices
            .as_ref()
            .unwrap()
            .requests
            .as_ref()
            .unwrap()[0];
        let e = r.exactly.as_ref().unwrap();
        (
            e.device_class_name.clone(),
            e.selectors.as_ref().unwrap()[0]
                .cel
                .as_ref()
                .unwrap()
                .expression
                .clone(),
        )
    };
    let (class, cel) = request(&templates[0]);
    assert_eq!(class, "mig.gpu.tessera.io");
    assert!(cel.contains("profile == \"1g.10gb\""), "{cel}");
    let (class, cel) = request(&templates[1]);
    assert_eq!(class, "mps.gpu.tessera.io");
    assert!(cel.contains("mpsClass == \"small\""), "{cel}");
    for p in &pods {
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.runtime_class_name.as_deref(), Some("tessera"));
        let claim = &spec.resource_claims.as_ref().unwrap()[0];
        assert!(
            templates
                .iter()
                .any(|t| t.metadata.name == claim.resource_claim_template_name)
        );
        let used = &spec.containers[0]
            .resources
            .as_ref()
            .unwrap()
            .claims
            .as_ref()
            .unwrap()[0];
        assert_eq!(used.name, claim.name);
    }
}

#[test]
fn the_dra_daemonset_patch_names_the_node_mounts_the_plugin_dirs_and_uses_the_rbac_account() {
    let patch = &documents("daemonset-patch.yaml")[0];
    let spec = s(patch, &["spec", "template", "spec"]);
    let rbac = documents("rbac.yaml");
    let account = rbac.iter().find(|d| d["kind"] == "ServiceAccount").unwrap();
    assert_eq!(spec["serviceAccountName"], account["metadata"]["name"]);
    assert_eq!(spec["automountServiceAccountToken"], true);
    let daemon = &spec["containers"][0];
    // The patch merges into the DaemonSet's container of that name.
    let ds = manifest("daemonset.yaml");
    assert_eq!(
        &daemon["name"],
        s(
            &ds,
            &["spec", "template", "spec", "containers", "0", "name"]
        )
    );
    let env = daemon["env"].as_sequence().unwrap();
    assert!(
        env.iter().any(|e| e["name"] == "NODE_NAME"
            && e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName")
    );
    for want in [
        "/var/lib/kubelet/plugins",
        "/var/lib/kubelet/plugins_registry",
    ] {
        let vol = spec["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["hostPath"]["path"] == want)
            .unwrap_or_else(|| panic!("no hostPath {want}"));
        assert!(
            daemon["volumeMounts"]
                .as_sequence()
                .unwrap()
                .iter()
                .any(|m| m["name"] == vol["name"] && m["mountPath"] == want),
            "{want} not mounted"
        );
    }
    // RBAC: slices written, claims only read; the policy keeps writes to the node's own.
    let role = rbac.iter().find(|d| d["kind"] == "ClusterRole").unwrap();
    let rules = role["rules"].as_sequence().unwrap();
    let claims = rules
        .iter()
        .find(|r| r["resources"][0] == "resourceclaims")
        .unwrap();
    assert_eq!(claims["verbs"].as_sequence().unwrap().len(), 1);
    assert_eq!(claims["verbs"][0], "get");
    let policy = rbac
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicy")
        .unwrap();
    let rules = serde_json::to_string(&policy["spec"]["validations"]).unwrap();
    assert!(
        rules.contains("spec.?nodeName") && rules.contains("userNodeName"),
        "{rules}"
    );
    assert!(rules.contains("gpu.tessera.io"), "{rules}");
    // Another node's pool is refused too (a slice of this node naming node B's pool
    // at a higher generation would hide B's devices from the scheduler), and an
    // UPDATE is judged on the slice as it was as well as as it would be.
    assert!(
        rules.contains("s.spec.pool.name == variables.userNodeName"),
        "{rules}"
    );
    let vars = serde_json::to_string(&policy["spec"]["variables"]).unwrap();
    assert!(vars.contains("[oldObject, object]"), "{vars}");
    let binding = rbac
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicyBinding")
        .unwrap();
    assert_eq!(binding["spec"]["policyName"], policy["metadata"]["name"]);
}

#[test]
fn pods_using_resource_claims_must_use_the_runtime_class() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    // Without it, a pod with a gpu.tessera.io claim and no runtimeClassName runs
    // under plain runc with the claim's CDI devices and token, never judged by
    // tessera-runtime.
    let docs = documents("admission-policy.yaml");
    let policy: ValidatingAdmissionPolicy = typed(&docs[0]);
    let binding: ValidatingAdmissionPolicyBinding = typed(&docs[1]);
    let spec = policy.spec.unwrap();
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    let rules = spec.match_constraints.unwrap().resource_rules.unwrap();
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(&["pods".to_string()][..])
    );
    let ops = rules[0].operations.clone().unwrap();
    assert!(ops.contains(&"CREATE".to_string()) && ops.contains(&"UPDATE".to_string()));
    let vars = serde_json::to_string(&spec.variables).unwrap();
    assert!(vars.contains("object.spec.resourceClaims"), "{vars}");
    let rule = &spec.validations.unwrap()[0].expression;
    assert!(rule.contains("!variables.usesClaims"), "{rule}");
    assert!(rule.contains("runtimeClassName == 'tessera'"), "{rule}");
    let b = binding.spec;
    assert_eq!(Some(b.policy_name), policy.metadata.name);
    assert_eq!(b.validation_actions, ["Deny"]);
}
