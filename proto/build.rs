use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("tessera_descriptor.bin"))
        .compile_protos(&["tessera/v1/tessera.proto"], &["."])?;
    println!("cargo:rerun-if-changed=tessera/v1/tessera.proto");
    Ok(())
}
