//! The runtime's modules point down only, and no two files import each other in a loop.
//! Each module of `runtime-shim/src` has a rank; a file may name (`crate::x`, or
//! `tessera_runtime::x` in the binaries) only modules of a lower rank than its own. And
//! within a module, the files' imports (`super::…`, `crate::a::b`, a child's `b::…`)
//! form no cycle. A new module must be given a rank here, so that its place is a
//! decision, not an accident.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;

/// The import graph every crate's check shares (integration-tests' library, where
/// `import_cycles.rs` uses it for the whole workspace).
#[allow(dead_code)]
#[path = "../../integration-tests/src/import_graph.rs"]
mod import_graph;

use import_graph::Files;

/// Bottom to top. docs/design.md draws the same stack.
const LAYERS: &[&str] = &[
    "refusal",      // the one shape of a refusal: imports nothing of the crate
    "policy",       // the policy table's types
    "cgroup_names", // cgroup paths as components (pure text)
    "resources",    // runc's LinuxResources as typed values
    "cli",          // runc's command line, parsed
    "runclog",      // runc's log file
    "bundle",       // reading and writing a bundle's config.json
    "private_file", // the runtime's own state files
    "config",       // the runtime's config: load + validate
    "host",         // HostView: the host as the hardening reads it
    "plan",         // how the runtime ends: exec runc, mirror it, exit
    "fds",          // --preserve-fds
    "early",        // runc started while the spec is judged
    "runc_cves",    // runc's version against known CVEs
    "lease",        // the daemon client and the grant
    "record",       // what the runtime keeps of each container
    "harden",       // harden(spec, grant, host view): the policy's decision
    "runc_root",    // runc's --root, canonical
    "session",      // one invocation: argv, config, log, root
    "pipeline",     // view -> resolve -> admit -> bind
    "commands",     // one module per subcommand
    "app",          // argv in, the command run
    "main",         // main.rs and bin/
];

fn rank(module: &str) -> Option<usize> {
    LAYERS.iter().position(|m| *m == module)
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

/// The modules of this crate a line names (`crate::x`, `tessera_runtime::x`), each
/// once (a `use` item's paths are named both as the item and as paths).
fn modules_named(line: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for p in import_graph::paths_named(line, "tessera_runtime") {
        let mut segs = p.split("::");
        if let (Some("crate" | "tessera_runtime"), Some(m)) = (segs.next(), segs.next())
            && !out.iter().any(|o| o == m)
        {
            out.push(m.to_string());
        }
    }
    out
}

/// Every violation in `files` (path relative to src/, text).
fn check(files: &Files) -> (Vec<String>, BTreeMap<String, usize>) {
    let mut violations = Vec::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (rel, text) in files {
        if rel == "lib.rs" {
            continue;
        }
        let module = module_of(Path::new(rel));
        let Some(own) = rank(&module) else {
            violations.push(format!(
                "{rel}: module {module:?} has no layer: add it to LAYERS (and docs/design.md)"
            ));
            continue;
        };
        *seen.entry(module.clone()).or_default() += 1;
        for (n, line) in import_graph::non_test_code(text).iter().enumerate() {
            for name in modules_named(line) {
                let Some(r) = rank(&name) else { continue };
                if name != module && r >= own {
                    violations.push(format!(
                        "{rel}:{}: {module} (layer {own}) uses {name} (layer {r}), which is not below it",
                        n + 1
                    ));
                }
            }
        }
    }
    for cycle in import_graph::loops(&import_graph::edges(files, "tessera_runtime")) {
        violations.push(format!("import cycle: {}", cycle.join(" -> ")));
    }
    (violations, seen)
}

#[test]
fn layers_point_down_only_and_no_files_import_each_other_in_a_loop() {
    let files = import_graph::files_under(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let (violations, seen) = check(&files);
    assert!(
        violations.is_empty(),
        "layering violations:\n{}",
        violations.join("\n")
    );
    // The test saw the tree it guards (a moved src/ would make it vacuous).
    for m in ["harden", "commands", "pipeline", "host", "lease", "app"] {
        assert!(seen.get(m).copied().unwrap_or(0) > 0, "no file of {m} read");
    }
    let edges = import_graph::edges(&files, "tessera_runtime");
    let names = |f: &str| edges[f].clone();
    assert!(names("harden/allowlist.rs").contains_key("harden/base.rs"));
    assert!(names("commands/create.rs").contains_key("pipeline/admit.rs"));
}

#[test]
fn an_upward_import_an_unranked_module_or_a_cycle_is_caught() {
    let p = import_graph::paths_named("use super::{base::Context, json};", "tessera_runtime");
    assert_eq!(p, ["super::base::Context", "super::json"]);
    let files: Files = vec![
        ("host.rs".into(), "use crate::harden::Context;".to_string()),
        (
            "harden/mod.rs".into(),
            "pub mod a;\npub mod b;\nuse crate::refusal::Refusal;".to_string(),
        ),
        ("harden/a.rs".into(), "use super::b::f;".to_string()),
        (
            "harden/b.rs".into(),
            "fn g() { super::a::h() }\n#[cfg(test)]\nmod tests {\n use crate::app::x;\n}"
                .to_string(),
        ),
        ("refusal.rs".into(), String::new()),
        ("gadget.rs".into(), String::new()),
    ];
    let (v, _) = check(&files);
    assert_eq!(v.len(), 3, "{v:#?}");
    assert!(
        v[0].contains("host (layer 9) uses harden (layer 16)"),
        "{}",
        v[0]
    );
    assert!(v[1].contains("\"gadget\" has no layer"), "{}", v[1]);
    assert!(
        v[2].contains("import cycle: harden/a.rs -> harden/b.rs"),
        "{}",
        v[2]
    );
}
