//! No two files of a crate import each other in a loop, in any crate of the workspace.
//!
//! A loop between files (a `mod.rs` that re-exports its children while the children
//! reach back into it through `super::`) means neither file can be read, changed or
//! tested without the other. Layers between modules are guarded per crate
//! (daemon/tests/layering.rs, runtime-shim/tests/layering.rs); this test guards the
//! files inside them.
//!
//! The graph and its loops are `tessera_integration_tests::import_graph`'s (the
//! runtime's layering test uses the same file).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use tessera_integration_tests::import_graph::{Files, describe, edges, files_under, loops};

/// The workspace's members and each one's library name.
fn members() -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let manifest: toml::Value =
        toml::from_str(&std::fs::read_to_string(root.join("Cargo.toml")).unwrap()).unwrap();
    let list = manifest["workspace"]["members"].as_array().unwrap();
    list.iter()
        .map(|m| {
            let dir = root.join(m.as_str().unwrap());
            let own: toml::Value =
                toml::from_str(&std::fs::read_to_string(dir.join("Cargo.toml")).unwrap()).unwrap();
            let name = own
                .get("lib")
                .and_then(|l| l.get("name"))
                .or_else(|| own["package"].get("name"))
                .and_then(|n| n.as_str())
                .unwrap()
                .replace('-', "_");
            (dir, name)
        })
        .collect()
}

#[test]
fn no_two_files_of_any_crate_import_each_other_in_a_loop() {
    let mut problems = Vec::new();
    let mut read = 0;
    for (dir, name) in members() {
        let files = files_under(&dir.join("src"));
        read += files.len();
        let crate_dir = dir.file_name().unwrap().to_string_lossy().into_owned();
        problems.extend(describe(&crate_dir, &edges(&files, &name)));
    }
    // The test saw the tree it guards.
    assert!(read > 100, "only {read} files read");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

fn files(list: &[(&str, &str)]) -> Files {
    list.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[test]
fn a_parent_and_a_child_that_reach_into_each_other_are_a_loop() {
    let graph = edges(
        &files(&[
            ("lib.rs", "pub mod lease;\n"),
            (
                "lease/mod.rs",
                "mod create;\npub use create::Created;\npub struct State;\n",
            ),
            (
                "lease/create.rs",
                "use super::State;\npub struct Created;\n",
            ),
        ]),
        "tesserad",
    );
    let found = loops(&graph);
    assert_eq!(found, vec![vec!["lease/create.rs", "lease/mod.rs"]]);
    assert!(
        describe("daemon", &graph)[0].contains("lease/create.rs -> lease/mod.rs  (super::State)")
    );
}

#[test]
fn leaf_files_named_directly_and_test_modules_are_no_loop() {
    let graph = edges(
        &files(&[
            ("lib.rs", "pub mod lease;\n"),
            (
                "lease/mod.rs",
                "mod create;\nmod create2;\nmod state;\npub use create::Created;\n",
            ),
            ("lease/create2.rs", "pub fn f() {}\n"),
            (
                "lease/create.rs",
                "use super::{state::{State, Other}, create2};\npub struct Created;\n\
                 #[cfg(test)]\n#[allow(dead_code)]\nmod tests {\n    use super::super::*;\n}\n",
            ),
            ("lease/state.rs", "pub struct State;\n"),
        ]),
        "tesserad",
    );
    assert!(loops(&graph).is_empty(), "{graph:?}");
    assert_eq!(
        graph["lease/create.rs"].keys().collect::<Vec<_>>(),
        vec!["lease/create2.rs", "lease/state.rs"],
        "a use group names each file it reaches; the test module's glob is not counted"
    );
}

#[test]
fn paths_in_expressions_and_through_the_crate_name_count() {
    let graph = edges(
        &files(&[
            ("lib.rs", "pub mod a;\npub mod b;\n"),
            ("a.rs", "pub fn f() { crate::b::g(); }\n"),
            ("b.rs", "pub fn g() { let _ = tesserad::a::f; }\n"),
        ]),
        "tesserad",
    );
    assert_eq!(loops(&graph), vec![vec!["a.rs", "b.rs"]]);
}
