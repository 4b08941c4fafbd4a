//! Checks the built-in seccomp profile (configs/seccomp/tenant.toml, the source of truth,
//! a reason beside each rule) when the runtime is built, with the runtime's own checks
//! (src/harden/seccomp/check.rs: libseccomp name resolution, the must-deny floor, the
//! clone mask, a reason per rule), and writes the OCI form they produce for the target
//! architecture. A profile that fails a check stops the build with the rule named; a
//! container start only reads the result.

use std::path::PathBuf;

#[path = "src/harden/seccomp/check.rs"]
#[allow(dead_code)]
mod check;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let src = manifest.join("../configs/seccomp/tenant.toml");
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-changed=src/harden/seccomp/check.rs");
    let text = match std::fs::read_to_string(&src) {
        Ok(t) => t,
        Err(e) => fail(&format!("reading {}: {e}", src.display())),
    };
    let file: check::ProfileFile = match toml::from_str(&text) {
        Ok(v) => v,
        Err(e) => fail(&format!("{}: {e}", src.display())),
    };
    let target_arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let oci = match check::check(&file, &src, check::arch_of(&target_arch)) {
        Ok(oci) => oci,
        Err(e) => fail(&e.to_string()),
    };
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join("tenant-oci.json");
    if let Err(e) = std::fs::write(&out, oci.to_string()) {
        fail(&format!("writing {}: {e}", out.display()));
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("tessera-runtime build: {msg}");
    std::process::exit(1);
}
