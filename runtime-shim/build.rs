//! Converts the built-in seccomp profile (configs/seccomp/tenant.toml, the source of
//! truth, a reason beside each rule) to JSON at build time, so that the runtime does not
//! parse TOML on every container start. Only the text format changes: the runtime
//! deserializes the JSON into the same structures and runs every check (libseccomp name
//! resolution, the must-deny floor, the clone mask, a reason per rule) at each start.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let src = manifest.join("../configs/seccomp/tenant.toml");
    println!("cargo:rerun-if-changed={}", src.display());
    let text = match std::fs::read_to_string(&src) {
        Ok(t) => t,
        Err(e) => fail(&format!("reading {}: {e}", src.display())),
    };
    let value: toml::Value = match toml::from_str(&text) {
        Ok(v) => v,
        Err(e) => fail(&format!("{}: {e}", src.display())),
    };
    let json = match serde_json::to_string(&value) {
        Ok(j) => j,
        Err(e) => fail(&format!("{}: {e}", src.display())),
    };
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join("tenant.json");
    if let Err(e) = std::fs::write(&out, json) {
        fail(&format!("writing {}: {e}", out.display()));
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("tessera-runtime build: {msg}");
    std::process::exit(1);
}
