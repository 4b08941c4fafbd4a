//! Small helpers on the spec's JSON tree.

use serde_json::{Map, Value};

/// The object at `key` of `v` (created when absent or null); `None` if `v` is not an
/// object or the entry is not an object.
pub fn obj_entry<'v>(v: &'v mut Value, key: &str) -> Option<&'v mut Map<String, Value>> {
    let map = v.as_object_mut()?;
    let e = map
        .entry(key.to_string())
        .or_insert_with(|| Value::Object(Map::new()));
    if e.is_null() {
        *e = Value::Object(Map::new());
    }
    e.as_object_mut()
}

/// The strings of an array value, or `None` if it is not an array of strings.
pub fn strings(v: &Value) -> Option<Vec<String>> {
    v.as_array()?
        .iter()
        .map(|s| s.as_str().map(String::from))
        .collect()
}
