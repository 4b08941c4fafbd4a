//! Generated code for the `tessera.v1` gRPC API. Generated code only: no logic here.

#![allow(clippy::all, clippy::pedantic, missing_docs)]

pub mod v1 {
    tonic::include_proto!("tessera.v1");

    /// Encoded file descriptor set, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("tessera_descriptor");
}
