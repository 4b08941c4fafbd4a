use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("tessera_descriptor.bin"))
        .compile_protos(&["tessera/v1/tessera.proto"], &["."])?;
    println!("cargo:rerun-if-changed=tessera/v1/tessera.proto");
    // kubelet's wire contracts, vendored as published (see k8s/README.md):
    // each compiled on its own so neither shares a module with tessera.v1.
    for (dir, file) in [
        ("k8s/deviceplugin/v1beta1", "api.proto"),
        ("k8s/podresources/v1", "api.proto"),
        ("k8s/pluginregistration/v1", "api.proto"),
        ("k8s/dra/v1", "api.proto"),
        ("k8s/dra/v1beta1", "api.proto"),
        ("k8s/dra-health/v1", "api.proto"),
    ] {
        let sub = out.join(dir);
        std::fs::create_dir_all(&sub)?;
        tonic_prost_build::configure()
            .out_dir(&sub)
            .compile_protos(&[format!("{dir}/{file}")], &[".".to_string()])?;
        println!("cargo:rerun-if-changed={dir}/{file}");
    }
    Ok(())
}
