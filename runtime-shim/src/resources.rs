//! runc's `LinuxResources` as typed values, exact key spellings (each field optional,
//! unknown keys refused by serde): what `update` parses and writes anew, and what a
//! container's record keeps of its create (its CPU grant).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// The keys runc's Go decoder reads at each place of the resources JSON, spelt as
/// the runtime reads them. A key spelt otherwise (Go would still match `LIMIT` to
/// `limit`) is refused by its path.
const KEYS: &[(&str, &[&str])] = &[
    (
        "",
        &[
            "devices",
            "memory",
            "cpu",
            "pids",
            "blockIO",
            "hugepageLimits",
            "network",
            "rdma",
            "unified",
        ],
    ),
    (
        "/memory",
        &[
            "limit",
            "reservation",
            "swap",
            "kernel",
            "kernelTCP",
            "swappiness",
            "disableOOMKiller",
            "useHierarchy",
            "checkBeforeUpdate",
        ],
    ),
    (
        "/cpu",
        &[
            "shares",
            "quota",
            "burst",
            "period",
            "realtimeRuntime",
            "realtimePeriod",
            "cpus",
            "mems",
            "idle",
        ],
    ),
    ("/pids", &["limit"]),
    (
        "/blockIO",
        &[
            "weight",
            "leafWeight",
            "weightDevice",
            "throttleReadBpsDevice",
            "throttleWriteBpsDevice",
            "throttleReadIOPSDevice",
            "throttleWriteIOPSDevice",
        ],
    ),
    (
        "/blockIO/weightDevice/*",
        &["major", "minor", "weight", "leafWeight"],
    ),
    (
        "/blockIO/throttleReadBpsDevice/*",
        &["major", "minor", "rate"],
    ),
    (
        "/blockIO/throttleWriteBpsDevice/*",
        &["major", "minor", "rate"],
    ),
    (
        "/blockIO/throttleReadIOPSDevice/*",
        &["major", "minor", "rate"],
    ),
    (
        "/blockIO/throttleWriteIOPSDevice/*",
        &["major", "minor", "rate"],
    ),
    ("/devices/*", &["allow", "type", "major", "minor", "access"]),
    ("/hugepageLimits/*", &["pageSize", "limit"]),
];

macro_rules! opt_struct {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $field:ident : $ty:ty),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            $(
                $(#[$fm])*
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $field: Option<$ty>,
            )*
        }
    };
}

opt_struct!(
    /// runc's `LinuxMemory`.
    Memory {
        limit: i64,
        reservation: i64,
        swap: i64,
        kernel: i64,
        #[serde(rename = "kernelTCP")]
        kernel_tcp: i64,
        swappiness: u64,
        #[serde(rename = "disableOOMKiller")]
        disable_oom_killer: bool,
        #[serde(rename = "useHierarchy")]
        use_hierarchy: bool,
        #[serde(rename = "checkBeforeUpdate")]
        check_before_update: bool,
    }
);

opt_struct!(
    /// runc's `LinuxCPU`.
    Cpu {
        shares: u64,
        quota: i64,
        burst: u64,
        period: u64,
        #[serde(rename = "realtimeRuntime")]
        realtime_runtime: i64,
        #[serde(rename = "realtimePeriod")]
        realtime_period: u64,
        cpus: String,
        mems: String,
        idle: i64,
    }
);

opt_struct!(
    /// A device cgroup rule.
    DeviceRule {
        allow: bool,
        #[serde(rename = "type")]
        kind: String,
        major: i64,
        minor: i64,
        access: String,
    }
);

/// runc's `LinuxPids`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pids {
    pub limit: i64,
}

/// A hugepage limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hugepage {
    #[serde(rename = "pageSize")]
    pub page_size: String,
    pub limit: u64,
}

opt_struct!(
    /// runc's `LinuxResources`, as `update --resources` reads it.
    Resources {
        devices: Vec<DeviceRule>,
        memory: Memory,
        cpu: Cpu,
        pids: Pids,
        #[serde(rename = "blockIO")]
        block_io: Value,
        #[serde(rename = "hugepageLimits")]
        hugepage_limits: Vec<Hugepage>,
        network: Value,
        rdma: Value,
        unified: BTreeMap<String, String>,
    }
);

/// The paths of every key not spelt as [`KEYS`] says.
pub fn unknown_keys(v: &Value, at: &str, pattern: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            let allowed = KEYS.iter().find(|(p, _)| *p == pattern).map(|(_, k)| *k);
            for (k, child) in m {
                let path = format!("{at}/{k}");
                match allowed {
                    Some(keys) if keys.contains(&k.as_str()) => {
                        unknown_keys(child, &path, &format!("{pattern}/{k}"), out);
                    }
                    Some(_) => out.push(path),
                    // Maps of free keys (unified) are judged elsewhere.
                    None => {}
                }
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                unknown_keys(child, &format!("{at}/{i}"), &format!("{pattern}/*"), out);
            }
        }
        _ => {}
    }
}

/// A decoder's message without the value it quotes (`invalid type: string "s3cret",
/// expected i64` becomes `invalid type: string, expected i64`): the document may be
/// any file root can read, named by whoever wrote the command line.
pub fn without_values(msg: &str) -> String {
    for lead in ["invalid type: ", "invalid value: "] {
        if let Some(i) = msg.find(lead)
            && let Some(j) = msg[i..].find(", expected")
        {
            let kind = msg[i + lead.len()..i + j]
                .split([' ', '`', '"'])
                .next()
                .unwrap_or("");
            return format!("{}{lead}{kind}{}", &msg[..i], without_values(&msg[i + j..]));
        }
    }
    msg.to_string()
}

/// A create's `linux.resources` parsed into the same typed values: every key spelt as
/// runc's Go structs name it (runc matches keys case-insensitively, so `LIMIT` would
/// be its `limit` while a reader by exact name saw none), every value of its type.
/// `Err` lists the reasons.
pub fn parse_create(v: &Value) -> Result<Resources, Vec<String>> {
    if !v.is_object() {
        return Err(vec!["/linux/resources: not an object".to_string()]);
    }
    let mut unknown = Vec::new();
    unknown_keys(v, "", "", &mut unknown);
    if !unknown.is_empty() {
        return Err(unknown
            .into_iter()
            .map(|p| format!("/linux/resources{p}: unknown key (keys are spelt as runc's)"))
            .collect());
    }
    serde_json::from_value::<Resources>(v.clone()).map_err(|e| {
        vec![format!(
            "/linux/resources: {}",
            without_values(&e.to_string())
        )]
    })
}

/// A hugepage size as runc names the cgroup file with it (`hugetlb.<size>.limit_in_bytes`):
/// digits and a unit, nothing that could make a path.
pub fn page_size_ok(s: &str) -> bool {
    let digits = s.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &s[digits.len()..];
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && !digits.starts_with('0')
        && matches!(unit, "KB" | "MB" | "GB")
}

/// A cgroup file name (runc joins it to the container's cgroup directory).
pub fn cgroup_file_name_ok(s: &str) -> bool {
    !s.is_empty() && !s.contains('/') && s != "." && s != ".." && !s.contains('\0')
}
