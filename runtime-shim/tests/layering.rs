//! The runtime's modules point down only, and no two files import each other in a loop.
//! Each module of `runtime-shim/src` has a rank; a file may name (`crate::x`, or
//! `tessera_runtime::x` in the binaries) only modules of a lower rank than its own. And
//! within a module, the files' imports (`super::…`, `crate::a::b`, a child's `b::…`)
//! form no cycle. A new module must be given a rank here, so that its place is a
//! decision, not an accident.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

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

/// The file's text without its unit tests (`#[cfg(test)] mod tests`), comment-free.
fn code_of(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]" {
            let mut next = lines.peek().copied().unwrap_or("");
            while next.trim_start().starts_with("#[") {
                lines.next();
                next = lines.peek().copied().unwrap_or("");
            }
            if next.trim_start().starts_with("mod tests") {
                break;
            }
        }
        out.push(line.split("//").next().unwrap_or("").to_string());
    }
    out
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The paths a line names that start with one of `prefixes` (`crate`, `super`, a child
/// module...), each as its segments; `use a::{b, c::d}` names `a::b` and `a::c::d`.
fn paths(line: &str, prefixes: &[&str]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for prefix in prefixes {
        let needle = format!("{prefix}::");
        let mut from = 0;
        while let Some(i) = line[from..].find(&needle) {
            let start = from + i;
            from = start + needle.len();
            let before = line[..start].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let mut segs = vec![prefix.to_string()];
            let mut rest = &line[from..];
            loop {
                while let Some(r) = rest.strip_prefix("super::") {
                    segs.push("super".into());
                    rest = r;
                }
                if let Some(group) = rest.strip_prefix('{') {
                    let inner = group.split('}').next().unwrap_or("");
                    for part in inner.split(',') {
                        let mut s = segs.clone();
                        s.extend(part.trim().split("::").map(ident).filter(|x| !x.is_empty()));
                        out.push(s);
                    }
                    break;
                }
                let name = ident(rest);
                if name.is_empty() {
                    out.push(segs);
                    break;
                }
                rest = &rest[name.len()..];
                segs.push(name);
                match rest.strip_prefix("::") {
                    Some(r) => rest = r,
                    None => {
                        out.push(segs);
                        break;
                    }
                }
            }
        }
    }
    out
}

/// A file's module path: `harden/mod.rs` is `harden`, `harden/base.rs` `harden::base`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut segs: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if segs.last().is_some_and(|s| s == "mod" || s == "lib") {
        segs.pop();
    }
    segs
}

/// The files each file imports from (test code left out).
fn file_edges(files: &[(PathBuf, String)]) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let by_module: BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .filter(|(rel, _)| module_of(rel) != "main")
        .map(|(rel, _)| (module_path(rel), rel.clone()))
        .collect();
    let resolve = |segs: &[String]| {
        (0..=segs.len())
            .rev()
            .find_map(|n| by_module.get(&segs[..n]).cloned())
    };
    let mut edges = BTreeMap::new();
    for (rel, text) in files {
        if module_of(rel) == "main" {
            continue;
        }
        let own = module_path(rel);
        let code = code_of(text);
        let children: Vec<String> = code
            .iter()
            .filter_map(|l| {
                let l = l.trim_start().trim_start_matches("pub ");
                l.strip_prefix("mod ")
                    .and_then(|r| r.strip_suffix(';'))
                    .map(str::to_string)
            })
            .collect();
        let mut prefixes = vec!["crate", "super", "self"];
        prefixes.extend(children.iter().map(String::as_str));
        let mut to = BTreeSet::new();
        for line in &code {
            for p in paths(line, &prefixes) {
                let mut base = match p[0].as_str() {
                    "crate" => Vec::new(),
                    _ => own.clone(),
                };
                let mut rest = &p[1..];
                if p[0] == "super" {
                    base.pop();
                }
                if !["crate", "super", "self"].contains(&p[0].as_str()) {
                    rest = &p[..];
                }
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop();
                    rest = &rest[1..];
                }
                base.extend(rest.iter().cloned());
                if let Some(target) = resolve(&base)
                    && target != *rel
                {
                    to.insert(target);
                }
            }
        }
        edges.insert(rel.clone(), to);
    }
    edges
}

/// Every file-level import cycle, as the files on it.
fn cycles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    fn visit(
        at: &PathBuf,
        edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        stack: &mut Vec<PathBuf>,
        done: &mut BTreeSet<PathBuf>,
        out: &mut Vec<Vec<PathBuf>>,
    ) {
        if let Some(i) = stack.iter().position(|p| p == at) {
            out.push(stack[i..].to_vec());
            return;
        }
        if !done.insert(at.clone()) {
            return;
        }
        stack.push(at.clone());
        for next in edges.get(at).into_iter().flatten() {
            visit(next, edges, stack, done, out);
        }
        stack.pop();
    }
    let mut out = Vec::new();
    let mut done = BTreeSet::new();
    for start in edges.keys() {
        visit(start, edges, &mut Vec::new(), &mut done, &mut out);
    }
    out
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
        for (n, line) in code_of(text).iter().enumerate() {
            for p in paths(line, &["crate", "tessera_runtime"]) {
                let Some(name) = p.get(1) else { continue };
                let Some(r) = rank(name) else { continue };
                if *name != module && r >= own {
                    violations.push(format!(
                        "{}:{}: {module} (layer {own}) uses {name} (layer {r}), which is not below it",
                        rel.display(),
                        n + 1
                    ));
                }
            }
        }
    }
    for cycle in cycles(&file_edges(files)) {
        let names: Vec<String> = cycle.iter().map(|p| p.display().to_string()).collect();
        violations.push(format!("import cycle: {}", names.join(" -> ")));
    }
    (violations, seen)
}

#[test]
fn layers_point_down_only_and_no_files_import_each_other_in_a_loop() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    rust_files(&src, &mut all);
    all.sort();
    let files: Vec<(PathBuf, String)> = all
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
    for m in ["harden", "commands", "pipeline", "host", "lease", "app"] {
        assert!(seen.get(m).copied().unwrap_or(0) > 0, "no file of {m} read");
    }
    let edges = file_edges(&files);
    let names = |f: &str| edges[Path::new(f)].clone();
    assert!(names("harden/allowlist.rs").contains(Path::new("harden/base.rs")));
    assert!(names("commands/create.rs").contains(Path::new("pipeline/admit.rs")));
}

#[test]
fn an_upward_import_an_unranked_module_or_a_cycle_is_caught() {
    let p = paths("use super::{base::Context, json};", &["super"]);
    assert_eq!(p, [vec!["super", "base", "Context"], vec!["super", "json"]]);
    let files = vec![
        (
            PathBuf::from("host.rs"),
            "use crate::harden::Context;".to_string(),
        ),
        (
            PathBuf::from("harden/mod.rs"),
            "pub mod a;\npub mod b;\nuse crate::refusal::Refusal;".to_string(),
        ),
        (PathBuf::from("harden/a.rs"), "use super::b::f;".to_string()),
        (
            PathBuf::from("harden/b.rs"),
            "fn g() { super::a::h() }\n#[cfg(test)]\nmod tests {\n use crate::app::x;\n}"
                .to_string(),
        ),
        (PathBuf::from("refusal.rs"), String::new()),
        (PathBuf::from("gadget.rs"), String::new()),
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
