//! Generates the CRI RuntimeService and ImageService v1 client from the vendored
//! kubernetes/cri-api proto (proto/cri-api/), for the end-to-end CRI suite.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&["cri-api/runtime/v1/api.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/cri-api/runtime/v1/api.proto");
    Ok(())
}
