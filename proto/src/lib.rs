//! Generated code for the `tessera.v1` gRPC API and for the kubelet APIs the device
//! plugin and the DRA driver speak. Generated code only: no logic here.

#![allow(clippy::all, clippy::pedantic, missing_docs)]

pub mod v1 {
    tonic::include_proto!("tessera.v1");

    /// Encoded file descriptor set, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("tessera_descriptor");
}

/// kubelet's published APIs (github.com/kubernetes/kubelet), vendored in
/// `proto/k8s/` with their package names, message names and field numbers.
pub mod k8s {
    /// `k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`: Registration (served by
    /// kubelet) and DevicePlugin (served by a plugin).
    pub mod deviceplugin {
        pub mod v1beta1 {
            include!(concat!(
                env!("OUT_DIR"),
                "/k8s/deviceplugin/v1beta1/v1beta1.rs"
            ));

            /// The API version a plugin registers with.
            pub const VERSION: &str = "v1beta1";
            /// The socket kubelet serves Registration on, in the device-plugins directory.
            pub const KUBELET_SOCKET: &str = "kubelet.sock";
            /// `Device.health` of a usable device.
            pub const HEALTHY: &str = "Healthy";
            /// `Device.health` of a device kubelet must not count.
            pub const UNHEALTHY: &str = "Unhealthy";
        }
    }

    /// `k8s.io/kubelet/pkg/apis/podresources/v1`: PodResourcesLister (served by kubelet).
    pub mod podresources {
        pub mod v1 {
            include!(concat!(env!("OUT_DIR"), "/k8s/podresources/v1/v1.rs"));
        }
    }

    /// `k8s.io/kubelet/pkg/apis/pluginregistration/v1` (package `pluginregistration`):
    /// Registration, served by a plugin on its socket in kubelet's `plugins_registry`.
    pub mod pluginregistration {
        pub mod v1 {
            include!(concat!(
                env!("OUT_DIR"),
                "/k8s/pluginregistration/v1/pluginregistration.rs"
            ));

            /// `PluginInfo.type` of a DRA driver's plugin.
            pub const DRA_PLUGIN: &str = "DRAPlugin";
        }
    }

    /// `k8s.io/kubelet/pkg/apis/dra`: DRAPlugin, served by a DRA driver's plugin.
    pub mod dra {
        pub mod v1 {
            include!(concat!(
                env!("OUT_DIR"),
                "/k8s/dra/v1/k8s.io.kubelet.pkg.apis.dra.v1.rs"
            ));

            /// The name a plugin lists in `PluginInfo.supported_versions` for this service.
            pub const SERVICE: &str = "v1.DRAPlugin";
        }
        pub mod v1beta1 {
            include!(concat!(
                env!("OUT_DIR"),
                "/k8s/dra/v1beta1/k8s.io.kubelet.pkg.apis.dra.v1beta1.rs"
            ));

            /// The name a plugin lists in `PluginInfo.supported_versions` for this service.
            pub const SERVICE: &str = "v1beta1.DRAPlugin";
        }
    }

    /// `k8s.io/kubelet/pkg/apis/dra-health/v1` (package `v1`): DRAResourceHealth
    /// (KEP-4680), served by a DRA driver's plugin.
    pub mod dra_health {
        pub mod v1 {
            include!(concat!(env!("OUT_DIR"), "/k8s/dra-health/v1/v1.rs"));

            /// The name a plugin lists in `PluginInfo.supported_versions` for this service.
            pub const SERVICE: &str = "v1.DRAResourceHealth";
        }
    }
}
