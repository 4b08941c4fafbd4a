//! The import graph of a crate's files, for the tests that guard the workspace's
//! shape: which file's code names which other file (`edges`), and the groups of
//! files that import each other in a loop (`loops`, `describe`).
//! `integration-tests/tests/import_cycles.rs` checks every crate with it, and
//! `runtime-shim/tests/layering.rs` includes this file (`#[path]`) for its own
//! check; it uses only `std`.
//!
//! A file `a` depends on a file `b` when a path in `a`'s non-test code (a `use` or an
//! expression, through `crate::`, `super::`, `self::`, a child module of `a`, or the
//! crate's own name in a binary) resolves to an item of `b`: the longest module prefix
//! of the path that is a file. Test code (`#[cfg(test)]` items) is left out: a test
//! module may use its parent's items freely.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A crate's files: path relative to its `src/`, and text.
pub type Files = Vec<(String, String)>;

/// The module path of a file relative to `src/` (`a/b.rs` and `a/b/mod.rs` are `[a, b]`;
/// `lib.rs` and `main.rs` are the root). `None` for a binary of `bin/`, which is a crate
/// of its own, and for `main.rs` where a `lib.rs` exists.
pub fn module_path(rel: &str, has_lib: bool) -> Option<Vec<String>> {
    if rel.starts_with("bin/") || (rel == "main.rs" && has_lib) {
        return None;
    }
    if rel == "lib.rs" || rel == "main.rs" {
        return Some(Vec::new());
    }
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_string)
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    Some(parts)
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The file's code without comments and without `#[cfg(test)]` items.
pub fn non_test_code(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if line.trim_start().starts_with("#[cfg(test)]") {
            let mut k = i + 1;
            while k < lines.len() && lines[k].trim_start().starts_with("#[") {
                k += 1;
            }
            let Some(item) = lines.get(k) else { break };
            if item.trim_end().ends_with('{') {
                let own = indent(item);
                k += 1;
                while k < lines.len()
                    && !(indent(lines[k]) == own && lines[k].trim_start().starts_with('}'))
                {
                    k += 1;
                }
            }
            i = k + 1;
            continue;
        }
        out.push(line.split("//").next().unwrap_or("").to_string());
        i += 1;
    }
    out
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `a::{b, c::{d, e}}` becomes `a::b`, `a::c::d`, `a::c::e`.
fn expand_use(prefix: &str, body: &str, out: &mut Vec<String>) {
    let Some(open) = body.find('{') else {
        out.push(format!("{prefix}{body}"));
        return;
    };
    let Some(close) = body.rfind('}').filter(|c| *c > open) else {
        return;
    };
    let head = format!("{prefix}{}", &body[..open]);
    let (mut depth, mut part) = (0usize, String::new());
    for c in body[open + 1..close].chars() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                expand_use(&head, &std::mem::take(&mut part), out);
                continue;
            }
            _ => {}
        }
        part.push(c);
    }
    if !part.is_empty() {
        expand_use(&head, &part, out);
    }
}

/// Every path the code names: the bodies of `use` items, expanded, and every
/// `crate::`/`super::`/`self::`/`<own>::` path written anywhere.
pub fn paths_named(code: &str, own: &str) -> Vec<String> {
    let mut out = Vec::new();
    let lines: Vec<&str> = code.lines().collect();
    for (n, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let t = ["pub use ", "pub(crate) use ", "pub(super) use ", "use "]
            .iter()
            .find_map(|v| t.strip_prefix(v));
        let Some(first) = t else { continue };
        // A `use` item may span lines, up to its `;`.
        let mut body = first.to_string();
        let mut k = n + 1;
        while !body.contains(';') && k < lines.len() {
            body.push_str(lines[k]);
            k += 1;
        }
        let body: String = body
            .split(';')
            .next()
            .unwrap_or("")
            .replace(" as ", "#")
            .split_whitespace()
            .collect();
        let path_chars = |c: char| is_ident_char(c) || ":{},*#".contains(c);
        if body.chars().all(path_chars) {
            expand_use("", &body.replace('#', " as "), &mut out);
        }
    }
    let roots = ["crate", "super", "self", own];
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let starts_token = i == 0 || !(is_ident_char(chars[i - 1]) || chars[i - 1] == ':');
        if starts_token && is_ident_char(chars[i]) {
            let mut j = i;
            let mut path = String::new();
            loop {
                let seg_start = j;
                while j < chars.len() && is_ident_char(chars[j]) {
                    j += 1;
                }
                path.extend(&chars[seg_start..j]);
                if j + 2 < chars.len()
                    && chars[j] == ':'
                    && chars[j + 1] == ':'
                    && is_ident_char(chars[j + 2])
                {
                    path.push_str("::");
                    j += 2;
                } else {
                    break;
                }
            }
            let first = path.split("::").next().unwrap_or("");
            if path.contains("::") && roots.contains(&first) {
                out.push(path);
            }
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// The file each file depends on, with one path that shows why.
pub fn edges(files: &Files, own: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let has_lib = files.iter().any(|(rel, _)| rel == "lib.rs");
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .filter_map(|(rel, _)| module_path(rel, has_lib).map(|m| (m, rel.clone())))
        .collect();
    let mut graph = BTreeMap::new();
    for (rel, text) in files {
        let Some(module) = module_path(rel, has_lib) else {
            continue;
        };
        let code = non_test_code(text).join("\n");
        let children: BTreeSet<String> = code
            .lines()
            .filter_map(|l| {
                let l = l.trim();
                let l = l.strip_prefix("pub ").unwrap_or(l);
                let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
                l.strip_prefix("mod ")?
                    .strip_suffix(';')
                    .map(str::to_string)
            })
            .collect();
        let mut out: BTreeMap<String, String> = BTreeMap::new();
        for path in paths_named(&code, own) {
            let mut segs: Vec<&str> = path
                .split("::")
                .map(|s| s.split(" as ").next().unwrap_or(s))
                .filter(|s| !s.is_empty() && *s != "*")
                .collect();
            let mut base: Vec<String> = match segs.first().copied() {
                Some("crate") => {
                    segs.remove(0);
                    Vec::new()
                }
                Some(s) if s == own => {
                    segs.remove(0);
                    Vec::new()
                }
                Some("super") | Some("self") => {
                    let mut b = module.clone();
                    while let Some(s) = segs.first().copied() {
                        match s {
                            "super" => {
                                b.pop();
                            }
                            "self" => {}
                            _ => break,
                        }
                        segs.remove(0);
                    }
                    b
                }
                Some(s) if children.contains(s) => module.clone(),
                _ => continue,
            };
            base.extend(segs.iter().map(|s| s.to_string()));
            let target = (0..=base.len())
                .rev()
                .find_map(|n| modules.get(&base[..n]).cloned());
            if let Some(target) = target.filter(|t| t != rel) {
                out.entry(target).or_insert(path);
            }
        }
        graph.insert(rel.clone(), out);
    }
    graph
}

/// The groups of more than one file that import each other in a loop (Tarjan).
pub fn loops(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a BTreeMap<String, BTreeMap<String, String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flat_map(|m| m.keys()) {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut group = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    group.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if group.len() > 1 {
                    group.sort();
                    self.found.push(group);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

/// Each loop, with the edges inside it, as a reader fixing it wants them.
pub fn describe(
    crate_dir: &str,
    graph: &BTreeMap<String, BTreeMap<String, String>>,
) -> Vec<String> {
    loops(graph)
        .into_iter()
        .map(|group| {
            let mut s = format!("{crate_dir}: files importing each other in a loop:");
            for a in &group {
                for (b, why) in &graph[a] {
                    if group.contains(b) {
                        s.push_str(&format!("\n    {a} -> {b}  ({why})"));
                    }
                }
            }
            s
        })
        .collect()
}

/// Every `.rs` file under `src`, sorted: its path relative to `src` and its text.
/// Panics (a test's failure) where the tree cannot be read.
pub fn files_under(src: &Path) -> Files {
    let mut out = Vec::new();
    rust_files(src, src, &mut out);
    out.sort();
    out
}

fn rust_files(dir: &Path, root: &Path, out: &mut Files) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, root, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            out.push((rel, std::fs::read_to_string(&p).unwrap()));
        }
    }
}
