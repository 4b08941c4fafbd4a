//! The daemon's layers point down only. Each module of `daemon/src` has a rank; a
//! file may name (`crate::x`, `super::…` across modules, or `tesserad::x` in the
//! binaries) only modules of a lower rank than its own. Only `api` (and the
//! binaries) may know tonic and the `tessera.v1` proto types; `k8s` (the kubelet
//! device plugin, a client of the lease core like `api`) speaks kubelet's protocol
//! with tonic and the vendored kubelet types, never `tessera.v1`; so does `dra` (the
//! DRA driver). A new module must be
//! given a rank here, so that its place is a decision, not an accident.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Bottom to top. docs/design.md draws the same stack.
const LAYERS: &[&str] = &[
    "names",     // ids and names: imports nothing of the crate
    "host",      // host side effects behind HostOps
    "mps",       // MPS control daemons
    "gpu",       // GpuBackend, the simulator, NVML
    "partition", // the pure placement planner
    "config",    // load + validate (its GPU types live in gpu)
    "model",     // Lease and its state machine, partitions, intents
    "store",     // SQLite, write-ahead intents
    "usage",     // GPU-seconds accounting through the store
    "lease",     // the lease core
    "audit",     // the audit log
    "cdi",       // a CDI spec per active lease (a client of lease)
    "metrics",   // Prometheus
    "api",       // tonic, proto, status mapping
    "k8s",       // kubelet device plugin: tonic and kubelet's protos (uses api's unix transport)
    "dra",       // the DRA driver: kubelet's DRA protos with tonic, like k8s
    "main",      // main.rs and bin/
];

fn rank(module: &str) -> Option<usize> {
    LAYERS.iter().position(|m| *m == module)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module a file belongs to: its first path component under src/.
fn module_of(rel: &Path) -> String {
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    match first.as_ref() {
        "main.rs" | "bin" => "main".into(),
        f => f.trim_end_matches(".rs").to_string(),
    }
}

/// Modules a line names through `crate::` or `tesserad::`, and whether it names
/// tonic or the proto crate (and whether only its kubelet part). Comments are skipped.
fn named(line: &str) -> (Vec<String>, bool) {
    let (names, transport, _) = named_k8s(line);
    (names, transport)
}

fn named_k8s(line: &str) -> (Vec<String>, bool, bool) {
    let code = line.split("//").next().unwrap_or("");
    let mut out = Vec::new();
    for prefix in ["crate::", "tesserad::"] {
        let mut rest = code;
        while let Some(i) = rest.find(prefix) {
            let after = &rest[i + prefix.len()..];
            let name: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push(name);
            }
            rest = after;
        }
        // `use crate::{a, b::c}` names several.
        if let Some(i) = code.find(&format!("{prefix}{{")) {
            let inner = &code[i + prefix.len() + 1..];
            for part in inner.split(',') {
                let name: String = part
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.push(name);
                }
            }
        }
    }
    let transport = code.contains("tonic") || code.contains("tessera_proto");
    // The kubelet protocol only: tessera_proto::k8s, never tessera_proto::v1.
    let kubelet_only = !code.contains("tessera_proto::v1") && !code.contains("tessera_proto::{");
    (out, transport, kubelet_only)
}

/// Every violation in `files` (path relative to src/, text).
fn check(files: &[(PathBuf, String)]) -> (Vec<String>, BTreeMap<String, usize>) {
    let mut violations = Vec::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (rel, text) in files {
        if rel == Path::new("lib.rs") {
            continue;
        }
        let module = module_of(rel);
        let Some(own) = rank(&module) else {
            violations.push(format!(
                "{}: module {module:?} has no layer: add it to LAYERS (and docs/design.md)",
                rel.display()
            ));
            continue;
        };
        *seen.entry(module.clone()).or_default() += 1;
        for (n, line) in text.lines().enumerate() {
            let (names, transport, kubelet_only) = named_k8s(line);
            for name in names {
                let Some(r) = rank(&name) else { continue };
                if name != module && r >= own {
                    violations.push(format!(
                        "{}:{}: {module} (layer {own}) uses {name} (layer {r}), which is not below it",
                        rel.display(),
                        n + 1
                    ));
                }
            }
            if transport && (module == "k8s" || module == "dra") && !kubelet_only {
                violations.push(format!(
                    "{}:{}: {module} speaks kubelet's protocol, not tessera.v1",
                    rel.display(),
                    n + 1
                ));
            } else if transport && !["api", "main", "k8s", "dra"].contains(&module.as_str()) {
                violations.push(format!(
                    "{}:{}: only api knows tonic and the proto types",
                    rel.display(),
                    n + 1
                ));
            }
        }
    }
    (violations, seen)
}

#[test]
fn layers_point_down_only_and_only_api_knows_the_transport() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    rust_files(&src, &mut paths);
    paths.sort();
    let files: Vec<(PathBuf, String)> = paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(&src).unwrap().to_path_buf();
            (rel, std::fs::read_to_string(p).unwrap())
        })
        .collect();
    let (violations, seen) = check(&files);
    assert!(
        violations.is_empty(),
        "layering violations:\n{}",
        violations.join("\n")
    );
    // The test saw the tree it guards (a moved src/ would make it vacuous).
    for m in ["lease", "gpu", "store", "api", "model", "host", "k8s"] {
        assert!(seen.get(m).copied().unwrap_or(0) > 0, "no file of {m} read");
    }
}

#[test]
fn an_upward_import_a_transport_type_or_an_unranked_module_is_caught() {
    let (names, transport) = named("use crate::{lease::LeaseManager, model::Lease}; // crate::api");
    assert_eq!(names, vec!["lease", "model"]);
    assert!(!transport);
    let files = vec![
        (
            PathBuf::from("store/mod.rs"),
            "use crate::lease::LeaseManager;".to_string(),
        ),
        (
            PathBuf::from("model.rs"),
            "use crate::names::new_id;".to_string(),
        ),
        (
            PathBuf::from("usage.rs"),
            "fn f() -> tonic::Status { todo() }".to_string(),
        ),
        (PathBuf::from("csi/mod.rs"), String::new()),
        (
            PathBuf::from("k8s/service.rs"),
            "use tessera_proto::v1 as pb;".to_string(),
        ),
        (
            PathBuf::from("k8s/kubelet.rs"),
            "use tessera_proto::k8s::podresources::v1 as pr;".to_string(),
        ),
    ];
    let (v, _) = check(&files);
    assert_eq!(v.len(), 4, "{v:#?}");
    assert!(
        v[0].contains("store (layer 7) uses lease (layer 9)"),
        "{}",
        v[0]
    );
    assert!(v[1].contains("only api knows tonic"), "{}", v[1]);
    assert!(v[2].contains("\"csi\" has no layer"), "{}", v[2]);
    assert!(v[3].contains("k8s speaks kubelet's protocol"), "{}", v[3]);
}
