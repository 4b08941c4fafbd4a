//! Load and save an OCI bundle's config.json safely: no symlinks (O_NOFOLLOW), a size
//! cap, duplicate JSON keys refused, and an atomic rewrite (temp file in the bundle,
//! rename over the old file). The spec is kept as a `serde_json::Value`, so
//! fields this runtime does not know survive the rewrite.

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::fmt;
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The spec file name inside a bundle.
pub const CONFIG_JSON: &str = "config.json";

/// Errors reading or writing bundle files.
#[derive(Debug, Error)]
pub enum BundleError {
    #[error("{path} is a symlink or cannot be opened without following one: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a regular file")]
    NotRegular { path: PathBuf },
    #[error("{path} is larger than {max} bytes")]
    TooLarge { path: PathBuf, max: u64 },
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {message}")]
    Json { path: PathBuf, message: String },
    #[error("{path}: the top level is not a JSON object")]
    NotObject { path: PathBuf },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Where a value sits in a document being parsed: built into a JSON pointer only
/// when a refusal names it.
#[derive(Clone, Copy)]
enum Seg<'a> {
    Root,
    Key(&'a Seg<'a>, &'a str),
    Index(&'a Seg<'a>, usize),
}

impl Seg<'_> {
    fn pointer(&self) -> String {
        match self {
            Seg::Root => String::new(),
            Seg::Key(p, k) => format!(
                "{}/{}",
                p.pointer(),
                k.replace('~', "~0").replace('/', "~1")
            ),
            Seg::Index(p, i) => format!("{}/{i}", p.pointer()),
        }
    }
}

/// Go's `encoding/json` (which runc decodes every document with) matches an object
/// key to a struct field case-insensitively, with Unicode simple case folding, and
/// the last of two matching keys wins. This is the key as Go compares it: ASCII
/// letters upper-cased, any other character replaced by the smallest character of its
/// simple case-fold orbit (so KELVIN SIGN U+212A folds with `k`, LATIN SMALL LETTER
/// LONG S U+017F with `s`). DOTTED and DOTLESS I (U+0130, U+0131) fold with `i`
/// here, as some Go versions compare them: two keys that any Go version could read as
/// one are refused.
pub fn go_fold(key: &str) -> std::borrow::Cow<'_, str> {
    if key.bytes().all(|b| !b.is_ascii_lowercase() && b.is_ascii()) {
        return std::borrow::Cow::Borrowed(key);
    }
    std::borrow::Cow::Owned(key.chars().map(fold_char).collect())
}

fn fold_char(c: char) -> char {
    if c.is_ascii() {
        return c.to_ascii_uppercase();
    }
    if matches!(c, '\u{130}' | '\u{131}') {
        return 'I';
    }
    // The orbit through single-character case mappings (a mapping to several
    // characters is a full, not a simple, mapping).
    fn single(mut it: impl Iterator<Item = char>) -> Option<char> {
        let a = it.next()?;
        it.next().is_none().then_some(a)
    }
    let mut orbit = vec![c];
    let mut i = 0;
    while let Some(&x) = orbit.get(i) {
        for y in [single(x.to_lowercase()), single(x.to_uppercase())]
            .into_iter()
            .flatten()
        {
            if !orbit.contains(&y) {
                orbit.push(y);
            }
        }
        i += 1;
    }
    let min = orbit.into_iter().min().unwrap_or(c);
    if min.is_ascii() {
        min.to_ascii_uppercase()
    } else {
        min
    }
}

/// A JSON value that refuses, in any object, two keys Go would read as one (equal,
/// or equal after [`go_fold`]) while deserializing.
struct StrictSeed<'a>(&'a Seg<'a>);

impl<'de> de::DeserializeSeed<'de> for StrictSeed<'_> {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(StrictVisitor(self.0))
    }
}

struct StrictVisitor<'a>(&'a Seg<'a>);

impl<'de> Visitor<'de> for StrictVisitor<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        loop {
            let at = Seg::Index(self.0, out.len());
            match seq.next_element_seed(StrictSeed(&at))? {
                Some(v) => out.push(v),
                None => break,
            }
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        // Folded key -> the key as written, for the keys seen so far.
        let mut folded: std::collections::HashMap<String, String> =
            std::collections::HashMap::new();
        while let Some(key) = map.next_key::<String>()? {
            let fold = go_fold(&key).into_owned();
            if let Some(first) = folded.get(&fold) {
                let at = self.0.pointer();
                let at = if at.is_empty() { "/" } else { at.as_str() };
                return Err(de::Error::custom(if *first == key {
                    format_args!(
                        "{at}: duplicate key {key:?} (runc would read the last one, the runtime refuses both)"
                    )
                    .to_string()
                } else {
                    format_args!(
                        "{at}: keys {first:?} and {key:?} are one key to runc (Go matches keys case-insensitively and reads the last one); the runtime refuses both"
                    )
                    .to_string()
                }));
            }
            let v = {
                let at = Seg::Key(self.0, &key);
                map.next_value_seed(StrictSeed(&at))?
            };
            folded.insert(fold, key.clone());
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

/// Parse JSON text, refusing anywhere in the document two keys of one object that
/// runc's Go decoder would read as one: equal, or equal after [`go_fold`]. The
/// refusal names the object's JSON pointer and both keys.
pub fn parse_strict(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let v = de::DeserializeSeed::deserialize(StrictSeed(&Seg::Root), &mut de)?;
    de.end()?;
    Ok(v)
}

/// Read a regular file without following a symlink at its last component, at most `max`
/// bytes.
pub fn read_file_nofollow(path: &Path, max: u64) -> Result<Vec<u8>, BundleError> {
    read_with_mode(path, max).map(|(bytes, _)| bytes)
}

/// [`read_file_nofollow`], with the file's permission bits.
pub fn read_with_mode(path: &Path, max: u64) -> Result<(Vec<u8>, u32), BundleError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|source| BundleError::Open {
            path: path.to_path_buf(),
            source,
        })?;
    let meta = file.metadata().map_err(|source| BundleError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.file_type().is_file() {
        return Err(BundleError::NotRegular {
            path: path.to_path_buf(),
        });
    }
    if meta.len() > max {
        return Err(BundleError::TooLarge {
            path: path.to_path_buf(),
            max,
        });
    }
    let mut buf = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(max + 1)
        .read_to_end(&mut buf)
        .map_err(|source| BundleError::Read {
            path: path.to_path_buf(),
            source,
        })?;
    if buf.len() as u64 > max {
        return Err(BundleError::TooLarge {
            path: path.to_path_buf(),
            max,
        });
    }
    Ok((buf, meta.mode() & 0o7777))
}

/// Read and parse a JSON object file safely.
pub fn load_json(path: &Path, max: u64) -> Result<Value, BundleError> {
    let bytes = read_file_nofollow(path, max)?;
    parse_object(path, &bytes)
}

/// Parse `bytes`, read from `path`, as a JSON object (duplicate keys refused).
pub fn parse_object(path: &Path, bytes: &[u8]) -> Result<Value, BundleError> {
    let v = parse_strict(bytes).map_err(|e| BundleError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    if !v.is_object() {
        return Err(BundleError::NotObject {
            path: path.to_path_buf(),
        });
    }
    Ok(v)
}

/// Load `<bundle>/config.json`.
pub fn load(bundle: &Path, max: u64) -> Result<Value, BundleError> {
    load_json(&bundle.join(CONFIG_JSON), max)
}

/// Write `bytes` to `path` atomically: a temp file beside it (O_EXCL|O_NOFOLLOW), then a
/// rename over `path` (which replaces a symlink rather than following it). The file
/// keeps `mode`.
///
/// No fsync of the file or of the directory. The rename alone makes every reader (runc,
/// a moment later, in this boot) see the whole old or the whole new file, never a torn
/// one. A fsync would only make the file outlive a power loss or kernel crash, and
/// nothing needs it then: the container it describes dies with the host, containerd
/// deletes the bundles of dead tasks at its next start and creates new ones through
/// this runtime again. Skipping it saves a journal commit per start (about 10 ms on
/// ext4 on a virtual disk).
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), BundleError> {
    Staged::write(path, bytes, mode)?.commit()
}

/// A file written beside the one it will replace, not yet renamed over it: the first
/// half of [`write_atomic`], for a caller with something to wait for before the new
/// file may take effect (the runtime writes `config.json` while the daemon records
/// the container's binding). Dropped without [`Staged::commit`], the temp file is
/// removed and the old file is left as it was.
#[derive(Debug)]
pub struct Staged {
    tmp: PathBuf,
    path: PathBuf,
    done: bool,
}

impl Staged {
    /// Write `bytes` to a new temp file beside `path` (O_EXCL|O_NOFOLLOW), with `mode`.
    pub fn write(path: &Path, bytes: &[u8], mode: u32) -> Result<Self, BundleError> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dir.join(format!(".{name}.tessera-{:016x}", temp_suffix()));
        let werr = |source| BundleError::Write {
            path: path.to_path_buf(),
            source,
        };
        // Not ours if it cannot be made: nothing to remove then.
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(werr)?;
        let staged = Self {
            tmp,
            path: path.to_path_buf(),
            done: false,
        };
        // A failure from here on drops `staged`, which removes the temp file.
        f.write_all(bytes).map_err(werr)?;
        Ok(staged)
    }

    /// Rename the temp file over the target (which replaces a symlink there rather than
    /// following it).
    pub fn commit(mut self) -> Result<(), BundleError> {
        std::fs::rename(&self.tmp, &self.path).map_err(|source| BundleError::Write {
            path: self.path.clone(),
            source,
        })?;
        self.done = true;
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A number for a temp file's name that others cannot guess: std's per-thread random
/// hash keys (one getrandom when the process starts), not a seeded CSPRNG, whose
/// set-up took a tenth of a millisecond per container start. The name only has to
/// differ from any other writer's: the file is made with O_EXCL|O_NOFOLLOW.
pub fn temp_suffix() -> u64 {
    use std::hash::BuildHasher;
    std::hash::RandomState::new().hash_one(std::process::id())
}

/// Save a spec as `<bundle>/config.json` atomically, keeping the old file's mode.
pub fn save(bundle: &Path, spec: &Value) -> Result<(), BundleError> {
    let bytes = serde_json::to_vec(spec).map_err(|e| BundleError::Write {
        path: bundle.join(CONFIG_JSON),
        source: std::io::Error::other(e),
    })?;
    stage(bundle, &bytes)?.commit()
}

/// [`save`] up to the rename: the new `config.json` (`bytes`, the hardened spec as
/// [`crate::harden::Decision::config_json`] writes it) written beside the old one.
pub fn stage(bundle: &Path, bytes: &[u8]) -> Result<Staged, BundleError> {
    let path = bundle.join(CONFIG_JSON);
    let mode = std::fs::symlink_metadata(&path)
        .ok()
        .filter(|m| m.file_type().is_file())
        .map_or(0o600, |m| m.mode());
    stage_with_mode(bundle, bytes, mode)
}

/// [`stage`] with the mode of the tenant's `config.json` as it was read (the file may
/// have been replaced since: see [`crate::early`]). Only its read bits for group and
/// others are kept.
pub fn stage_with_mode(bundle: &Path, bytes: &[u8], mode: u32) -> Result<Staged, BundleError> {
    Staged::write(&bundle.join(CONFIG_JSON), bytes, mode & 0o644)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        let e = parse_strict(br#"{"a":1,"a":2}"#).unwrap_err().to_string();
        assert!(e.contains("/: duplicate key \"a\""), "{e}");
        assert!(
            parse_strict(
                br#"{"process":{"capabilities":{"bounding":[],"bounding":["CAP_SYS_ADMIN"]}}}"#
            )
            .unwrap_err()
            .to_string()
            .contains("bounding")
        );
        assert!(parse_strict(br#"[{"x":1},{"x":1,"x":1}]"#).is_err());
        let v = parse_strict(br#"{"a":{"b":[1,2.5,"s",null,true]},"z":{}}"#).unwrap();
        assert_eq!(v["a"]["b"][1], 2.5);
    }

    #[test]
    fn keys_go_reads_as_one_are_refused_with_their_path() {
        for (doc, at, pair) in [
            (
                r#"{"pids":{"limit":100,"LIMIT":-1}}"#,
                "/pids",
                ("limit", "LIMIT"),
            ),
            (
                r#"{"pids":{"Limit":1,"limit":2}}"#,
                "/pids",
                ("Limit", "limit"),
            ),
            // KELVIN SIGN folds with k, LONG S with s (Unicode simple case folding).
            (
                "{\"user\":{\"uid\":1},\"u\\u017fer\":{\"uid\":0}}",
                "/",
                ("user", "u\u{17f}er"),
            ),
            (
                "{\"linux\":{\"masKedPaths\":[],\"mas\\u212aedPaths\":[]}}",
                "/linux",
                ("masKedPaths", "mas\u{212a}edPaths"),
            ),
            // Written with an escape: the same key once decoded.
            (
                r#"{"a":[{"x":{"gid":1,"\u0047ID":0}}]}"#,
                "/a/0/x",
                ("gid", "GID"),
            ),
            (r#"{"m":{"a/b":{"k":1,"K":2}}}"#, "/m/a~1b", ("k", "K")),
            // Dotless and dotted I: some Go versions fold them with i.
            ("{\"uid\":1,\"u\\u0131d\":0}", "/", ("uid", "u\u{131}d")),
        ] {
            let e = parse_strict(doc.as_bytes()).unwrap_err().to_string();
            assert!(e.starts_with(&format!("{at}: keys ")), "{doc}: {e}");
            assert!(
                e.contains(&format!("{:?} and {:?}", pair.0, pair.1)),
                "{doc}: {e}"
            );
        }
        // Keys that differ by more than case stay apart.
        let v = parse_strict(br#"{"uid":1,"gid":2,"additionalGids":[3],"user_id":4}"#).unwrap();
        assert_eq!(v["gid"], 2);
        assert_eq!(go_fold("mas\u{212a}ed\u{17f}"), "MASKEDS");
        assert_eq!(go_fold("\u{3c3}"), go_fold("\u{3a3}"));
        assert_eq!(go_fold("\u{3c2}"), go_fold("\u{3a3}"));
        assert_eq!(go_fold("\u{df}"), go_fold("\u{1e9e}"));
        assert_ne!(go_fold("a"), go_fold("b"));
    }

    #[test]
    fn trailing_garbage_and_deep_nesting_are_refused() {
        assert!(parse_strict(br#"{"a":1} x"#).is_err());
        let deep = "[".repeat(100_000);
        assert!(parse_strict(deep.as_bytes()).is_err());
    }

    #[test]
    fn symlinked_config_is_refused_and_size_is_capped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("real.json"), b"{}").unwrap();
        std::os::unix::fs::symlink(dir.path().join("real.json"), dir.path().join(CONFIG_JSON))
            .unwrap();
        assert!(matches!(
            load(dir.path(), 1024),
            Err(BundleError::Open { .. })
        ));
        std::fs::remove_file(dir.path().join(CONFIG_JSON)).unwrap();
        std::fs::write(dir.path().join(CONFIG_JSON), vec![b' '; 2048]).unwrap();
        assert!(matches!(
            load(dir.path(), 1024),
            Err(BundleError::TooLarge { .. })
        ));
        std::fs::write(dir.path().join(CONFIG_JSON), b"[1]").unwrap();
        assert!(matches!(
            load(dir.path(), 1024),
            Err(BundleError::NotObject { .. })
        ));
    }

    #[test]
    fn save_is_atomic_and_keeps_unknown_fields() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(CONFIG_JSON),
            br#"{"x-vendor":{"k":[1]},"ociVersion":"1.0.2"}"#,
        )
        .unwrap();
        let mut v = load(dir.path(), 1 << 20).unwrap();
        v["process"] = serde_json::json!({"noNewPrivileges": true});
        save(dir.path(), &v).unwrap();
        let back = load(dir.path(), 1 << 20).unwrap();
        assert_eq!(back["x-vendor"]["k"][0], 1);
        assert_eq!(back["process"]["noNewPrivileges"], true);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_staged_config_takes_effect_only_when_committed() {
        let dir = tempfile::tempdir().unwrap();
        let old = br#"{"ociVersion":"1.0.2"}"#;
        std::fs::write(dir.path().join(CONFIG_JSON), old).unwrap();
        let v = serde_json::json!({"ociVersion": "1.2.0"});

        // Dropped without a commit: the old file stays, the temp file goes.
        let staged = stage(dir.path(), &serde_json::to_vec(&v).unwrap()).unwrap();
        assert_eq!(names(dir.path()).len(), 2, "the new file is written beside");
        assert_eq!(std::fs::read(dir.path().join(CONFIG_JSON)).unwrap(), old);
        drop(staged);
        assert_eq!(names(dir.path()), [CONFIG_JSON]);
        assert_eq!(std::fs::read(dir.path().join(CONFIG_JSON)).unwrap(), old);

        // Committed: the new spec, nothing else left.
        stage(dir.path(), &serde_json::to_vec(&v).unwrap())
            .unwrap()
            .commit()
            .unwrap();
        assert_eq!(names(dir.path()), [CONFIG_JSON]);
        assert_eq!(load(dir.path(), 1 << 20).unwrap(), v);
    }

    #[test]
    fn a_stage_to_a_missing_bundle_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-such-bundle");
        let e = stage(&missing, b"{}").unwrap_err();
        assert!(e.to_string().contains("no-such-bundle"), "{e}");
    }

    /// Set in the child process of the test below: the bundle it stages into.
    const STAGE_CHILD: &str = "TESSERA_TEST_STAGE_INTO";

    #[test]
    fn a_stage_whose_write_fails_removes_its_temp_file_and_names_the_file() {
        let name =
            "bundle::tests::a_stage_whose_write_fails_removes_its_temp_file_and_names_the_file";
        if let Some(bundle) = std::env::var_os(STAGE_CHILD) {
            // The child: no file may grow past 16 bytes, so the temp file is made and
            // the write into it fails (EFBIG, SIGXFSZ ignored), even as root.
            // SAFETY: setting a signal's disposition to SIG_IGN runs no handler code.
            unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes one rlimit into the struct it is given.
            assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim) }, 0);
            lim.rlim_cur = 16;
            // SAFETY: setrlimit reads the struct it is given; the limit is this child's.
            assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &lim) }, 0);
            let bundle = Path::new(&bundle);
            let spec =
                serde_json::json!({"ociVersion": "1.2.0", "annotations": {"pad": "x".repeat(64)}});
            let e = stage(bundle, &serde_json::to_vec(&spec).unwrap()).unwrap_err();
            let path = bundle.join(CONFIG_JSON);
            assert!(e.to_string().contains(&path.display().to_string()), "{e}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let old = br#"{"ociVersion":"1.0.2"}"#;
        std::fs::write(dir.path().join(CONFIG_JSON), old).unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads=1"])
            .env(STAGE_CHILD, dir.path())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && said.contains("1 passed"),
            "the child failed or ran no test: {said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(names(dir.path()), [CONFIG_JSON], "the temp file is removed");
        assert_eq!(std::fs::read(dir.path().join(CONFIG_JSON)).unwrap(), old);
    }
}
