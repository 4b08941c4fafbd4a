//! `[kubernetes]`: the kubelet device plugin (off by default), its reserved mix of
//! partition classes, the namespace-to-tenant map and the CDI spec directory.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use tessera_common::size::parse_size;

use crate::names::validate_tenant;
use crate::partition::Shape;

use super::validator::{ConfigError, Validator};

/// The domain of every extended resource the plugin advertises.
pub const RESOURCE_DOMAIN: &str = "tessera.io";
/// Most devices one class may advertise (kubelet keeps them all in memory and in
/// its checkpoint; a node has at most a few dozen partitions).
pub const MAX_PER_CLASS: u32 = 256;

/// One advertised class: its shape and how many devices of it are kept reserved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassSpec {
    pub shape: Shape,
    pub count: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct KubernetesConfig {
    /// Serve kubelet's device plugin API (`device_plugin = true`).
    pub device_plugin: bool,
    /// Where kubelet.sock is and where the plugin's sockets go.
    pub device_plugin_dir: PathBuf,
    /// kubelet's PodResources socket (which pod holds which device).
    pub pod_resources_socket: PathBuf,
    /// The tenant of reserved devices and of leases whose pod (or its namespace's
    /// tenant) is not known yet.
    pub default_tenant: String,
    /// Kubernetes namespace -> tenant.
    pub namespaces: BTreeMap<String, String>,
    /// How long a device no pod holds any more keeps its lease.
    pub release_grace: Duration,
    /// How often PodResources is read (and the leases renewed).
    pub poll_interval: Duration,
    /// TTL of the plugin's leases; they are renewed at half of it while advertised
    /// or held by a pod.
    pub lease_ttl: Duration,
    /// The reserved mix: class name (`mig-1g.10gb`, `gpu`, `mps-small`) -> shape and
    /// count. The resource is `tessera.io/<class>`.
    pub mix: BTreeMap<String, ClassSpec>,
    /// Publish a CDI spec per lease (kind `tessera.io/lease`) and name it in
    /// Allocate's answer.
    pub cdi: bool,
    /// Where the per-lease CDI specs are written.
    pub cdi_dir: PathBuf,
    /// `[[kubernetes.mps_classes]]` as declared (the DRA driver publishes slots of
    /// each).
    pub mps_classes: Vec<MpsClassSpec>,
    /// The kubeconfig the DRA driver reaches the API server with; None: in-cluster
    /// (the pod's service account).
    pub kubeconfig: Option<PathBuf>,
    /// `[[kubernetes.mps_classes]]`: MPS class name -> the shape of its shares (the
    /// device plugin's `mps-<name>` classes, the DRA driver's `gpu-<i>-mps-<name>-<slot>`
    /// devices).
    pub mps_shapes: BTreeMap<String, Shape>,
    /// Serve kubelet's DRA plugin API as the driver `gpu.tessera.io` (`dra = true`).
    pub dra: bool,
    /// The DRA plugin's directory; its gRPC socket is `dra.sock` in it.
    pub dra_plugin_dir: PathBuf,
    /// kubelet's plugin registration directory (its plugin watcher).
    pub dra_registry_dir: PathBuf,
    /// This node's name, the DRA pool name (else the `NODE_NAME` environment
    /// variable at start, see [`KubernetesConfig::dra_node_name`]).
    pub node_name: Option<String>,
    /// The GPUs the DRA driver serves (None: every GPU). With the device plugin on
    /// too, it is required, and the device plugin reserves only on the others.
    pub dra_gpus: Option<Vec<u32>>,
}

/// One `[[kubernetes.mps_classes]]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsClassSpec {
    pub name: String,
    pub sm_percent: u32,
    pub memory_bytes: u64,
    /// DRA: MPS devices of this class published per GPU (`slots`); None: as many
    /// as fit the GPU by SM percent and by memory (at most 16).
    pub slots: Option<u32>,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        KubernetesConfig {
            device_plugin: false,
            device_plugin_dir: PathBuf::from("/var/lib/kubelet/device-plugins"),
            pod_resources_socket: PathBuf::from("/var/lib/kubelet/pod-resources/kubelet.sock"),
            default_tenant: "kubernetes".into(),
            namespaces: BTreeMap::new(),
            release_grace: Duration::from_secs(30),
            poll_interval: Duration::from_secs(2),
            lease_ttl: Duration::from_secs(24 * 3600),
            mix: BTreeMap::new(),
            cdi: true,
            cdi_dir: PathBuf::from("/var/run/cdi"),
            mps_classes: Vec::new(),
            kubeconfig: None,
            mps_shapes: BTreeMap::new(),
            dra: false,
            dra_plugin_dir: PathBuf::from("/var/lib/kubelet/plugins/gpu.tessera.io"),
            dra_registry_dir: PathBuf::from("/var/lib/kubelet/plugins_registry"),
            node_name: None,
            dra_gpus: None,
        }
    }
}

impl KubernetesConfig {
    /// The tenant a pod of `namespace` gets.
    pub fn tenant_of(&self, namespace: &str) -> &str {
        self.namespaces
            .get(namespace)
            .map_or(self.default_tenant.as_str(), String::as_str)
    }

    /// Whether the DRA driver serves GPU `gpu` (the device plugin serves the others).
    pub fn dra_serves(&self, gpu: u32) -> bool {
        self.dra && self.dra_gpus.as_ref().is_none_or(|g| g.contains(&gpu))
    }

    /// The DRA pool name: `node_name`, else the `NODE_NAME` environment variable (the
    /// DaemonSet sets it from `spec.nodeName`); None when neither is set.
    pub fn dra_node_name(&self) -> Option<String> {
        self.node_name
            .clone()
            .or_else(|| std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty()))
    }
}

/// The extended resource name of a class.
pub fn resource_name(class: &str) -> String {
    format!("{RESOURCE_DOMAIN}/{class}")
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKubernetes {
    device_plugin: Option<bool>,
    device_plugin_dir: Option<PathBuf>,
    pod_resources_socket: Option<PathBuf>,
    default_tenant: Option<String>,
    #[serde(default)]
    namespaces: BTreeMap<String, String>,
    release_grace: Option<String>,
    poll_interval: Option<String>,
    lease_ttl: Option<String>,
    #[serde(default)]
    mix: BTreeMap<String, u32>,
    #[serde(default)]
    mps_classes: Vec<RawMpsClass>,
    cdi: Option<bool>,
    cdi_dir: Option<PathBuf>,
    kubeconfig: Option<PathBuf>,
    dra: Option<bool>,
    dra_plugin_dir: Option<PathBuf>,
    dra_registry_dir: Option<PathBuf>,
    node_name: Option<String>,
    dra_gpus: Option<Vec<u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMpsClass {
    name: String,
    sm_percent: u32,
    memory: String,
    slots: Option<u32>,
}

/// A DNS-label-like name: 1-63 of [a-z0-9-.], starting and ending alphanumeric.
fn label_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

/// A MIG GI profile name as NVML spells it: `<n>g.<m>gb` (the `+me` variants have a
/// `+`, which no resource name may carry).
fn mig_profile_ok(p: &str) -> bool {
    let Some((g, mem)) = p.split_once("g.") else {
        return false;
    };
    let Some(gb) = mem.strip_suffix("gb") else {
        return false;
    };
    !g.is_empty()
        && g.bytes().all(|b| b.is_ascii_digit())
        && !gb.is_empty()
        && gb.bytes().all(|b| b.is_ascii_digit())
}

/// `[kubernetes]`, validated. `tenant_declared` says whether a tenant may be used when
/// quotas are on (it has a `[tenants.NAME]` section, or no tenant has one); the
/// plugin's lease TTL must lie within `ttl` (lease.min_ttl..=lease.max_ttl).
pub(super) fn validate_kubernetes(
    v: &Validator<'_>,
    raw: RawKubernetes,
    tenant_declared: &dyn Fn(&str) -> bool,
    ttl: RangeInclusive<Duration>,
) -> Result<KubernetesConfig, ConfigError> {
    let d = KubernetesConfig::default();
    let device_plugin = raw.device_plugin.unwrap_or(false);
    let dra = raw.dra.unwrap_or(false);
    let default_tenant = raw.default_tenant.unwrap_or(d.default_tenant);
    let tenants = Tenants {
        v,
        device_plugin: device_plugin || dra,
        declared: tenant_declared,
    };
    tenants.check(&default_tenant, &raw.namespaces)?;
    let (mps, mps_specs) = mps_classes(v, raw.mps_classes)?;
    let mix = mix(v, raw.mix, &mps)?;
    let dra_gpus = dra_gpus(v, device_plugin && dra, raw.dra_gpus)?;
    if let Some(n) = &raw.node_name
        && !node_name_ok(n)
    {
        return Err(v.err(
            "kubernetes.node_name",
            format!("{n:?} is not a node name (1-253 characters of a-z, 0-9, '-' or '.')"),
        ));
    }
    let (release_grace, poll_interval, lease_ttl) = timing(
        v,
        [raw.release_grace, raw.poll_interval, raw.lease_ttl],
        d.lease_ttl,
        ttl,
    )?;
    let k = KubernetesConfig {
        device_plugin,
        device_plugin_dir: raw.device_plugin_dir.unwrap_or(d.device_plugin_dir),
        pod_resources_socket: raw.pod_resources_socket.unwrap_or(d.pod_resources_socket),
        default_tenant,
        namespaces: raw.namespaces,
        release_grace,
        poll_interval,
        lease_ttl,
        mix,
        cdi: raw.cdi.unwrap_or(true),
        cdi_dir: raw.cdi_dir.unwrap_or(d.cdi_dir),
        mps_classes: mps_specs,
        kubeconfig: raw.kubeconfig,
        mps_shapes: mps,
        dra,
        dra_plugin_dir: raw.dra_plugin_dir.unwrap_or(d.dra_plugin_dir),
        dra_registry_dir: raw.dra_registry_dir.unwrap_or(d.dra_registry_dir),
        node_name: raw.node_name,
        dra_gpus,
    };
    for (field, p) in [
        ("kubernetes.device_plugin_dir", &k.device_plugin_dir),
        ("kubernetes.pod_resources_socket", &k.pod_resources_socket),
        ("kubernetes.cdi_dir", &k.cdi_dir),
        ("kubernetes.dra_plugin_dir", &k.dra_plugin_dir),
        ("kubernetes.dra_registry_dir", &k.dra_registry_dir),
    ]
    .into_iter()
    .chain(k.kubeconfig.as_ref().map(|p| ("kubernetes.kubeconfig", p)))
    {
        if !p.is_absolute() {
            return Err(v.err(field, format!("{} is not an absolute path", p.display())));
        }
    }
    if k.dra && !k.cdi {
        return Err(v.err(
            "kubernetes.cdi",
            "dra = true needs cdi = true: a prepared claim's devices reach its containers only as CDI devices".into(),
        ));
    }
    if k.device_plugin && k.mix.values().all(|c| c.count == 0) {
        return Err(v.err(
            "kubernetes.mix",
            "device_plugin = true needs at least one class with a count, e.g. \"mig-1g.10gb\" = 2"
                .into(),
        ));
    }
    Ok(k)
}

/// `dra_gpus`: distinct GPU indices, at least one; required when the device plugin
/// runs too (`both`), so that no GPU is served by both.
fn dra_gpus(
    v: &Validator<'_>,
    both: bool,
    raw: Option<Vec<u32>>,
) -> Result<Option<Vec<u32>>, ConfigError> {
    let field = "kubernetes.dra_gpus";
    let Some(mut gpus) = raw else {
        if both {
            return Err(v.err(
                field,
                "device_plugin = true and dra = true: name the GPUs the DRA driver serves \
                 (e.g. dra_gpus = [0, 1]); the device plugin serves the others, and no GPU both"
                    .into(),
            ));
        }
        return Ok(None);
    };
    if gpus.is_empty() {
        return Err(v.err(field, "names no GPU".into()));
    }
    let n = gpus.len();
    gpus.sort_unstable();
    gpus.dedup();
    if gpus.len() != n {
        return Err(v.err(field, "names a GPU twice".into()));
    }
    Ok(Some(gpus))
}

/// A Kubernetes node name (a DNS subdomain): 1-253 of [a-z0-9-.], starting and
/// ending alphanumeric.
fn node_name_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

/// The tenants `[kubernetes]` names: valid names, and with quotas on, tenants with
/// a section of their own (only when the plugin runs).
struct Tenants<'a> {
    v: &'a Validator<'a>,
    device_plugin: bool,
    declared: &'a dyn Fn(&str) -> bool,
}

impl Tenants<'_> {
    fn check(
        &self,
        default_tenant: &str,
        namespaces: &BTreeMap<String, String>,
    ) -> Result<(), ConfigError> {
        self.known("kubernetes.default_tenant", default_tenant)?;
        for (ns, t) in namespaces {
            if !label_ok(ns) {
                return Err(self.v.err(
                    &format!("kubernetes.namespaces.{ns}"),
                    "a namespace is 1-63 characters of a-z, 0-9, '-' or '.'".into(),
                ));
            }
            self.known(&format!("kubernetes.namespaces.{ns}"), t)?;
        }
        Ok(())
    }

    fn known(&self, field: &str, t: &str) -> Result<(), ConfigError> {
        validate_tenant(t).map_err(|e| self.v.err(field, e.to_string()))?;
        if self.device_plugin && !(self.declared)(t) {
            return Err(self
                .v
                .err(field, format!("tenant {t:?} has no [tenants.{t}] section")));
        }
        Ok(())
    }
}

/// `[[kubernetes.mps_classes]]`: name -> the MPS shape of its devices, and the
/// classes as declared.
fn mps_classes(
    v: &Validator<'_>,
    raw: Vec<RawMpsClass>,
) -> Result<(BTreeMap<String, Shape>, Vec<MpsClassSpec>), ConfigError> {
    let mut mps = BTreeMap::new();
    let mut specs = Vec::new();
    for (i, c) in raw.into_iter().enumerate() {
        let field = |k: &str| format!("kubernetes.mps_classes[{i}].{k}");
        if !label_ok(&c.name) || c.name.len() > 40 {
            return Err(v.err(
                &field("name"),
                format!(
                    "{:?} must be 1-40 characters of a-z, 0-9, '-' or '.' (the resource is tessera.io/mps-<name>)",
                    c.name
                ),
            ));
        }
        if c.sm_percent == 0 || c.sm_percent > 100 {
            return Err(v.err(
                &field("sm_percent"),
                format!("{} is not in 1..=100", c.sm_percent),
            ));
        }
        let memory_bytes =
            parse_size(&c.memory).map_err(|e| v.err(&field("memory"), e.to_string()))?;
        if memory_bytes == 0 {
            return Err(v.err(&field("memory"), "must be more than 0".into()));
        }
        if let Some(n) = c.slots
            && !(1..=16).contains(&n)
        {
            return Err(v.err(&field("slots"), format!("{n} is not in 1..=16")));
        }
        specs.push(MpsClassSpec {
            name: c.name.clone(),
            sm_percent: c.sm_percent,
            memory_bytes,
            slots: c.slots,
        });
        if mps
            .insert(
                c.name.clone(),
                // Pods of any namespace share a GPU's device-plugin shares: each
                // gets its own control daemon with limits it cannot loosen.
                Shape::Mps {
                    sm_percent: c.sm_percent,
                    memory_bytes,
                    mode: crate::gpu::MpsMode::Isolated,
                },
            )
            .is_some()
        {
            return Err(v.err(&field("name"), format!("{:?} is defined twice", c.name)));
        }
    }
    Ok((mps, specs))
}

/// `[kubernetes.mix]`: class -> its shape and how many devices are kept reserved.
fn mix(
    v: &Validator<'_>,
    raw: BTreeMap<String, u32>,
    mps: &BTreeMap<String, Shape>,
) -> Result<BTreeMap<String, ClassSpec>, ConfigError> {
    let mut mix = BTreeMap::new();
    for (class, count) in raw {
        let field = format!("kubernetes.mix.{class}");
        let shape = class_shape(v, &field, &class, mps)?;
        if !label_ok(&class) {
            return Err(v.err(
                &field,
                "a class name must be 1-63 characters of a-z, 0-9, '-' or '.'".into(),
            ));
        }
        if count > MAX_PER_CLASS {
            return Err(v.err(
                &field,
                format!("{count} devices; at most {MAX_PER_CLASS} per class"),
            ));
        }
        mix.insert(class, ClassSpec { shape, count });
    }
    Ok(mix)
}

/// The shape a class name stands for: `gpu`, `mig-<profile>` or `mps-<name>`.
fn class_shape(
    v: &Validator<'_>,
    field: &str,
    class: &str,
    mps: &BTreeMap<String, Shape>,
) -> Result<Shape, ConfigError> {
    if class == "gpu" {
        Ok(Shape::WholeGpu)
    } else if let Some(p) = class.strip_prefix("mig-") {
        if !mig_profile_ok(p) {
            return Err(v.err(
                field,
                format!(
                    "{p:?} is not a MIG profile name like \"1g.10gb\" (profiles with '+' cannot be resource names)"
                ),
            ));
        }
        Ok(Shape::Mig {
            profile: p.to_string(),
            compute_profile: None,
        })
    } else if let Some(n) = class.strip_prefix("mps-") {
        mps.get(n).cloned().ok_or_else(|| {
            v.err(
                field,
                format!("no [[kubernetes.mps_classes]] entry is named {n:?}"),
            )
        })
    } else {
        Err(v.err(
            field,
            "a class is \"gpu\", \"mig-<profile>\" (e.g. mig-1g.10gb) or \"mps-<name>\" of [[kubernetes.mps_classes]]".into(),
        ))
    }
}

/// (release_grace, poll_interval, lease_ttl) from their settings: the TTL within
/// `ttl` and at least 4 poll intervals (the poll renews the leases).
fn timing(
    v: &Validator<'_>,
    [release_grace, poll_interval, lease_ttl]: [Option<String>; 3],
    default_ttl: Duration,
    ttl: RangeInclusive<Duration>,
) -> Result<(Duration, Duration, Duration), ConfigError> {
    let release_grace = v.duration("kubernetes.release_grace", release_grace, "30s")?;
    let poll_interval = v.duration("kubernetes.poll_interval", poll_interval, "2s")?;
    if poll_interval < Duration::from_millis(100) {
        return Err(v.err("kubernetes.poll_interval", "must be at least 100ms".into()));
    }
    let lease_ttl = match lease_ttl {
        Some(s) => v.duration("kubernetes.lease_ttl", Some(s), "24h")?,
        None => default_ttl.min(*ttl.end()),
    };
    if !ttl.contains(&lease_ttl) {
        return Err(v.err(
            "kubernetes.lease_ttl",
            "must lie between lease.min_ttl and lease.max_ttl".into(),
        ));
    }
    if lease_ttl < poll_interval * 4 {
        return Err(v.err(
            "kubernetes.lease_ttl",
            "must be at least 4 poll intervals (leases are renewed by the poll)".into(),
        ));
    }
    Ok((release_grace, poll_interval, lease_ttl))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::Config;
    use std::path::Path;

    const GPU: &str = "[[sim.gpus]]\nmodel = \"h100-80gb\"\nmig = true\n";

    fn parse(extra: &str) -> Result<Config, String> {
        Config::parse(Path::new("t.toml"), &format!("{GPU}{extra}")).map_err(|e| e.to_string())
    }

    #[test]
    fn dra_publishing_keys_kubeconfig_and_mps_slots() {
        let c = parse(
            "[kubernetes]\nkubeconfig = \"/etc/tessera/kubeconfig\"\n[[kubernetes.mps_classes]]\nname = \"small\"\nsm_percent = 25\nmemory = \"20GiB\"\nslots = 3\n[[kubernetes.mps_classes]]\nname = \"big\"\nsm_percent = 50\nmemory = \"40GiB\"\n",
        )
        .unwrap();
        assert_eq!(
            c.kubernetes.kubeconfig.as_deref(),
            Some(Path::new("/etc/tessera/kubeconfig"))
        );
        let classes = &c.kubernetes.mps_classes;
        assert_eq!(classes.len(), 2);
        assert_eq!(
            (classes[0].name.as_str(), classes[0].slots),
            ("small", Some(3))
        );
        assert_eq!(
            (classes[1].memory_bytes, classes[1].slots),
            (40 << 30, None)
        );
        assert!(parse("").unwrap().kubernetes.kubeconfig.is_none());
        let e = parse("[kubernetes]\nkubeconfig = \"kubeconfig\"\n").unwrap_err();
        assert!(e.contains("kubernetes.kubeconfig"), "{e}");
        let e = parse(
            "[[kubernetes.mps_classes]]\nname = \"x\"\nsm_percent = 25\nmemory = \"1GiB\"\nslots = 17\n",
        )
        .unwrap_err();
        assert!(e.contains("slots"), "{e}");
    }

    #[test]
    fn dra_is_off_by_default_and_shares_no_gpu_with_the_device_plugin() {
        let c = parse("").unwrap();
        assert!(!c.kubernetes.dra);
        assert_eq!(
            c.kubernetes.dra_plugin_dir,
            Path::new("/var/lib/kubelet/plugins/gpu.tessera.io")
        );
        assert_eq!(
            c.kubernetes.dra_registry_dir,
            Path::new("/var/lib/kubelet/plugins_registry")
        );
        let c = parse("[kubernetes]\ndra = true\nnode_name = \"node-1\"\n").unwrap();
        assert!(c.kubernetes.dra_serves(3), "without dra_gpus: every GPU");
        assert_eq!(c.kubernetes.dra_node_name().as_deref(), Some("node-1"));
        let both = "[kubernetes]\ndra = true\ndevice_plugin = true\n[kubernetes.mix]\ngpu = 1\n";
        let err = parse(both).unwrap_err();
        assert!(err.contains("kubernetes.dra_gpus"), "{err}");
        let c = parse(&both.replace("dra = true\n", "dra = true\ndra_gpus = [1]\n")).unwrap();
        assert!(c.kubernetes.dra_serves(1) && !c.kubernetes.dra_serves(0));
        let err = parse("[kubernetes]\ndra = true\ncdi = false\n").unwrap_err();
        assert!(err.contains("kubernetes.cdi"), "{err}");
        let err = parse("[kubernetes]\ndra = true\ndra_gpus = [0, 0]\n").unwrap_err();
        assert!(err.contains("twice"), "{err}");
        let err = parse("[kubernetes]\ndra = true\nnode_name = \"Node_1\"\n").unwrap_err();
        assert!(err.contains("node name"), "{err}");
    }

    #[test]
    fn off_by_default_with_kubelet_paths() {
        let c = parse("").unwrap();
        assert!(!c.kubernetes.device_plugin);
        assert_eq!(
            c.kubernetes.device_plugin_dir,
            Path::new("/var/lib/kubelet/device-plugins")
        );
        assert_eq!(
            c.kubernetes.pod_resources_socket,
            Path::new("/var/lib/kubelet/pod-resources/kubelet.sock")
        );
    }

    #[test]
    fn a_mix_names_mig_profiles_whole_gpus_and_mps_classes() {
        let c = parse(
            "[kubernetes]\ndevice_plugin = true\n[kubernetes.mix]\n\"mig-1g.10gb\" = 2\ngpu = 1\nmps-small = 3\n[[kubernetes.mps_classes]]\nname = \"small\"\nsm_percent = 25\nmemory = \"20GiB\"\n",
        )
        .unwrap();
        let mix = &c.kubernetes.mix;
        assert_eq!(mix.len(), 3);
        assert_eq!(mix["mps-small"].count, 3);
        assert_eq!(
            mix["mps-small"].shape,
            crate::partition::Shape::Mps {
                sm_percent: 25,
                memory_bytes: 20 << 30,
                mode: crate::gpu::MpsMode::Isolated,
            }
        );
        assert_eq!(mix["gpu"].shape, crate::partition::Shape::WholeGpu);
    }

    #[test]
    fn bad_settings_name_their_field() {
        for (text, field) in [
            (
                "[kubernetes.mix]\n\"mig-1g.10gb+me\" = 1\n",
                "kubernetes.mix.mig-1g.10gb+me",
            ),
            ("[kubernetes.mix]\nfoo = 1\n", "kubernetes.mix.foo"),
            ("[kubernetes.mix]\nmps-big = 1\n", "kubernetes.mix.mps-big"),
            ("[kubernetes.mix]\ngpu = 100000\n", "kubernetes.mix.gpu"),
            (
                "[[kubernetes.mps_classes]]\nname = \"x\"\nsm_percent = 0\nmemory = \"1GiB\"\n",
                "kubernetes.mps_classes[0].sm_percent",
            ),
            ("[kubernetes]\ndevice_plugin = true\n", "kubernetes.mix"),
            (
                "[kubernetes]\nrelease_grace = \"soon\"\n",
                "kubernetes.release_grace",
            ),
            ("[kubernetes]\ncdi_dir = \"cdi\"\n", "kubernetes.cdi_dir"),
            (
                "[kubernetes.namespaces]\n\"Team_A\" = \"acme\"\n",
                "kubernetes.namespaces.Team_A",
            ),
            (
                "[tenants.acme]\n[kubernetes]\ndevice_plugin = true\ndefault_tenant = \"acme\"\n[kubernetes.namespaces]\nteam-b = \"other\"\n[kubernetes.mix]\ngpu = 1\n",
                "kubernetes.namespaces.team-b",
            ),
            (
                "[tenants.acme]\n[kubernetes]\ndevice_plugin = true\n[kubernetes.mix]\ngpu = 1\n",
                "kubernetes.default_tenant",
            ),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(&format!("`{field}`")), "{text}: {e}");
        }
    }

    #[test]
    fn quotas_without_the_plugin_need_no_kubernetes_tenant() {
        assert!(parse("[tenants.acme]\n").is_ok());
    }

    #[test]
    fn unmapped_namespaces_get_the_default_tenant() {
        let c = parse(
            "[kubernetes]\ndefault_tenant = \"k8s\"\n[kubernetes.namespaces]\nteam-a = \"acme\"\n",
        )
        .unwrap();
        assert_eq!(c.kubernetes.tenant_of("team-a"), "acme");
        assert_eq!(c.kubernetes.tenant_of("team-b"), "k8s");
    }
}
