//! `update`: the resources runc is to apply, parsed into typed values (runc's
//! `LinuxResources`, exact key spellings, unknown keys refused), judged against what
//! the container was granted at create (its [`crate::record::Record`]) and the
//! policy, and written out anew by the runtime. The tenant's bytes never reach runc:
//! neither the JSON of `--resources` (a file or stdin) nor the flags, which become the
//! same typed values.

use super::base::Findings;
use super::exec::{ContainerState, device_rule_within};
use crate::cli::SubArgs;
use crate::policy::Policy;
use serde_json::Value;
use std::collections::BTreeMap;

/// What `update` may change: CPU (with cpuset), memory (up to what the container was
/// granted), pids (likewise) and hugepages. Everything else is isolation, not tuning,
/// and refused with the field named.
pub const UPDATE_MAY_CHANGE: &str = "CPU, memory, pids, hugepages and cpuset";

/// cgroup v2 files (`unified`) an update may write: the same resources, not a cpuset
/// partition (CPUs taken from every other cgroup), and `memory.max` and
/// `memory.swap.max` only within what the container was granted.
const UNIFIED_TUNABLE: &[&str] = &["cpu.", "cpuset.", "memory.", "hugetlb."];
const UNIFIED_REFUSED: &[&str] = &["cpuset.cpus.partition"];

/// A `memory.max`-like value within `granted` (`None`: no limit was granted, so
/// `max` too).
fn unified_limit_ok(value: &str, granted: Option<i64>) -> bool {
    match value.trim() {
        "max" => granted.is_none(),
        v => {
            v.bytes().all(|b| b.is_ascii_digit())
                && v.parse::<i64>()
                    .is_ok_and(|n| granted.is_none_or(|g| n <= g))
        }
    }
}

pub use crate::resources::{
    Cpu, DeviceRule, Hugepage, Memory, Pids, Resources, cgroup_file_name_ok, page_size_ok,
    parse_create, unknown_keys, without_values,
};

/// Parse a resources document (already through the strict parser) into typed values.
pub fn parse(v: &Value, f: &mut Findings) -> Option<Resources> {
    if !v.is_object() {
        f.refuse("update: the resources JSON is not an object");
        return None;
    }
    let mut unknown = Vec::new();
    unknown_keys(v, "", "", &mut unknown);
    if !unknown.is_empty() {
        for path in unknown {
            f.refuse(format!(
                "update: {path}: unknown resources key (update may change {UPDATE_MAY_CHANGE} only, keys spelt as runc's)"
            ));
        }
        return None;
    }
    match serde_json::from_value::<Resources>(v.clone()) {
        Ok(r) => Some(r),
        Err(e) => {
            f.refuse(format!(
                "update: the resources JSON: {}",
                without_values(&e.to_string())
            ));
            None
        }
    }
}

/// A cpuset list (`0-3,8`) as its members; `None` when it is not one.
fn cpu_list(s: &str) -> Option<std::collections::BTreeSet<u32>> {
    let mut out = std::collections::BTreeSet::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (u32, u32) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        if a > b || b - a > 65536 {
            return None;
        }
        out.extend(a..=b);
    }
    Some(out)
}

/// runc's default CFS period (µs) when a spec gives a quota without one.
const DEFAULT_PERIOD: u64 = 100_000;
/// The kernel's default cpu.shares (a spec without shares gets it).
const DEFAULT_SHARES: u64 = 1024;

/// Judge the CPU part of an update against the create's: no more CPU time per period
/// (quota -1 or a larger quota/period ratio refused where the create set a quota), no
/// more shares than granted (or the kernel's default 1024, whichever is more), no
/// burst beyond the create's, cpus and mems within the create's.
fn judge_cpu(c: &Cpu, granted: Option<&Cpu>, f: &mut Findings) {
    let g = granted.cloned().unwrap_or_default();
    if let Some(gq) = g.quota.filter(|q| *q > 0) {
        let gp = g.period.filter(|p| *p > 0).unwrap_or(DEFAULT_PERIOD);
        let q = c.quota.unwrap_or(gq);
        let p = c.period.filter(|p| *p > 0).unwrap_or(gp);
        // q/p <= gq/gp, in integers.
        if q <= 0 || i128::from(q) * i128::from(gp) > i128::from(gq) * i128::from(p) {
            f.refuse(format!(
                "/cpu: quota {q} per period {p} is refused: at most {gq} per {gp} (what the container was granted)"
            ));
        }
    }
    if let Some(s) = c.shares {
        // Kubernetes' in-place resize raises a container's shares within its pod: up
        // to the kernel's default (one CPU's weight) is admitted beside the grant.
        let gs = g.shares.unwrap_or(DEFAULT_SHARES).max(DEFAULT_SHARES);
        if s > gs {
            f.refuse(format!(
                "/cpu/shares: {s} is refused: at most {gs} (what the container was granted, or {DEFAULT_SHARES})"
            ));
        }
    }
    if let Some(b) = c.burst
        && b > g.burst.unwrap_or(0)
    {
        f.refuse(format!(
            "/cpu/burst: {b} is refused: at most {} (what the container was granted)",
            g.burst.unwrap_or(0)
        ));
    }
    for (name, asked, own) in [
        ("cpus", c.cpus.as_deref(), g.cpus.as_deref()),
        ("mems", c.mems.as_deref(), g.mems.as_deref()),
    ] {
        let Some(asked) = asked.filter(|a| !a.trim().is_empty()) else {
            continue;
        };
        let Some(set) = cpu_list(asked) else {
            f.refuse(format!("/cpu/{name}: {asked:?} is not a cpuset list"));
            continue;
        };
        if let Some(own) = own.filter(|o| !o.trim().is_empty())
            && !cpu_list(own).is_some_and(|o| set.is_subset(&o))
        {
            f.refuse(format!(
                "/cpu/{name}: {asked:?} is refused: within {own:?} only (what the container was granted)"
            ));
        }
    }
}

/// Judge a cgroup v2 `cpu.*` or `cpuset.*` file of an update as its [`Cpu`] field
/// would be; one that no field bounds is refused.
fn judge_unified_cpu(key: &str, value: &str, granted: Option<&Cpu>, f: &mut Findings) {
    let mut c = Cpu::default();
    match key {
        "cpu.max" => {
            let mut it = value.split_whitespace();
            let q = it.next().unwrap_or("");
            c.quota = Some(if q == "max" {
                -1
            } else {
                q.parse().unwrap_or(0)
            });
            c.period = it.next().and_then(|p| p.parse().ok());
        }
        "cpu.weight" => {
            // runc's conversion of shares to weight, bounded by the granted shares'.
            let gs = granted
                .and_then(|g| g.shares)
                .unwrap_or(DEFAULT_SHARES)
                .max(2);
            let gw = 1 + ((gs - 2) * 9999) / 262_142;
            match value.trim().parse::<u64>() {
                Ok(w) if w <= gw.max(100) => {}
                _ => f.refuse(format!(
                    "/unified/cpu.weight: {value:?} is refused: at most {} (what the container was granted)",
                    gw.max(100)
                )),
            }
            return;
        }
        "cpu.idle" => return,
        "cpuset.cpus" => c.cpus = Some(value.to_string()),
        "cpuset.mems" => c.mems = Some(value.to_string()),
        _ => {
            f.refuse(format!(
                "/unified/{key}: refused: no CPU grant bounds it (cpu.max, cpu.weight, cpu.idle, cpuset.cpus and cpuset.mems only)"
            ));
            return;
        }
    }
    judge_cpu(&c, granted, f);
}

fn empty(v: Option<&Value>) -> bool {
    v.is_none_or(|v| v.is_null() || v.as_object().is_some_and(serde_json::Map::is_empty))
}

/// Judge `r` against the container's grant and the policy; `Some` is what runc gets
/// (the container's own device rules in place of any given, nothing not judged).
pub fn judge(
    r: Resources,
    state: &ContainerState,
    policy: &Policy,
    f: &mut Findings,
) -> Option<Resources> {
    let before = f.reasons.len();
    let mut out = Resources::default();
    if let Some(p) = r.pids {
        judge_pids(&p, state, policy, f);
        out.pids = Some(p);
    }
    if let Some(m) = r.memory {
        out.memory = Some(judge_memory(m, state, f));
    }
    if let Some(c) = r.cpu {
        for (name, set) in [
            (
                "realtimeRuntime",
                c.realtime_runtime.is_some_and(|v| v != 0),
            ),
            ("realtimePeriod", c.realtime_period.is_some_and(|v| v != 0)),
        ] {
            if set {
                f.refuse(format!(
                    "/cpu/{name}: refused: real-time CPU time is the host's"
                ));
            }
        }
        judge_cpu(&c, state.cpu.as_ref(), f);
        out.cpu = Some(c);
    }
    for (i, h) in r.hugepage_limits.iter().flatten().enumerate() {
        if !page_size_ok(&h.page_size) {
            f.refuse(format!(
                "/hugepageLimits/{i}/pageSize: {:?} is not a page size (runc makes a cgroup file name of it)",
                h.page_size
            ));
        }
    }
    out.hugepage_limits = r.hugepage_limits;
    if let Some(u) = r.unified {
        judge_unified(&u, state, f);
        out.unified = Some(u);
    }
    for (name, v) in [
        ("blockIO", &r.block_io),
        ("network", &r.network),
        ("rdma", &r.rdma),
    ] {
        if !empty(v.as_ref()) {
            f.refuse(format!(
                "/{name}: update may change {UPDATE_MAY_CHANGE} only"
            ));
        }
    }
    if let Some(rules) = r.devices {
        out.devices = judge_devices(&rules, state, f);
    }
    (f.reasons.len() == before).then_some(out)
}

/// A pids limit within what the container was granted (and the policy's).
fn judge_pids(p: &Pids, state: &ContainerState, policy: &Policy, f: &mut Findings) {
    let cap = state
        .pids_limit
        .filter(|g| *g > 0)
        .map_or(policy.pids_limit, |g| g.min(policy.pids_limit));
    if !(1..=cap).contains(&p.limit) {
        f.refuse(format!(
            "/pids/limit: {} is refused: update may set a pids limit of 1..={cap} only (what the container was granted)",
            p.limit
        ));
    }
}

/// Memory limits within what the container was granted, no kernel memory limit, an
/// OOM killer kept; what runc gets (kernel limits left out).
fn judge_memory(m: Memory, state: &ContainerState, f: &mut Findings) -> Memory {
    let granted = state.memory_limit.filter(|g| *g > 0);
    if let Some(l) = m.limit
        && (l < 0 || granted.is_some_and(|g| l > g))
    {
        f.refuse(format!(
            "/memory/limit: {l} is refused: update may set a memory limit of 1..={} bytes only (0 leaves it)",
            granted.map_or_else(|| "any".to_string(), |g| g.to_string())
        ));
    }
    if let Some(s) = m.reservation
        && (s < 0 || granted.is_some_and(|g| s > g))
    {
        f.refuse(format!(
            "/memory/reservation: {s} is refused: 0..=the memory limit only"
        ));
    }
    if let Some(s) = m.swap {
        let gswap = state.memory_swap.filter(|g| *g > 0);
        if s < 0 || gswap.is_some_and(|g| s > g) {
            f.refuse(format!(
                "/memory/swap: {s} is refused: update may set a memory+swap limit of 0..={} only",
                gswap.map_or_else(|| "any".to_string(), |g| g.to_string())
            ));
        }
    }
    for (name, v) in [("kernel", m.kernel), ("kernelTCP", m.kernel_tcp)] {
        if v.is_some_and(|v| v != 0) {
            f.refuse(format!(
                "/memory/{name}: kernel memory limits are refused (update may change {UPDATE_MAY_CHANGE} only)"
            ));
        }
    }
    if m.disable_oom_killer == Some(true) {
        f.refuse("/memory/disableOOMKiller: refused: a container over its limit must be killable");
    }
    if m.swappiness.is_some_and(|s| s > 100) {
        f.refuse("/memory/swappiness: 0..=100 only");
    }
    Memory {
        kernel: None,
        kernel_tcp: None,
        ..m
    }
}

/// cgroup v2 files: the same resources only, within what the container was granted.
fn judge_unified(u: &BTreeMap<String, String>, state: &ContainerState, f: &mut Findings) {
    for (key, value) in u {
        let bound = match key.as_str() {
            "memory.max" => Some(state.memory_limit.filter(|g| *g > 0)),
            "memory.swap.max" => Some(state.memory_swap.filter(|g| *g > 0)),
            _ => None,
        };
        if !cgroup_file_name_ok(key)
            || !UNIFIED_TUNABLE.iter().any(|p| key.starts_with(p))
            || UNIFIED_REFUSED.contains(&key.as_str())
        {
            f.refuse(format!(
                "/unified/{key}: update may change {UPDATE_MAY_CHANGE} only"
            ));
        } else if key.starts_with("cpu.") || key.starts_with("cpuset.") {
            judge_unified_cpu(key, value, state.cpu.as_ref(), f);
        } else if let Some(granted) = bound
            && !unified_limit_ok(value, granted)
        {
            f.refuse(format!(
                "/unified/{key}: {value:?} is refused: at most {} bytes (what the container was granted)",
                granted.map_or_else(|| "any".to_string(), |g| g.to_string())
            ));
        }
    }
}

/// The device rules of an update allow nothing beyond the container's own; runc gets
/// the container's own (re-applied).
fn judge_devices(
    rules: &[DeviceRule],
    state: &ContainerState,
    f: &mut Findings,
) -> Option<Vec<DeviceRule>> {
    // containerd's CRI sends a deny-all rule and the device plugin's allows with
    // every update: accepted when they allow nothing beyond the container's, and
    // replaced by the container's own rules (re-applied).
    for (i, rule) in rules.iter().enumerate() {
        let v = serde_json::to_value(rule).unwrap_or(Value::Null);
        if !device_rule_within(&v, &state.device_rules) {
            f.refuse(format!(
                "/devices/{i}: update may not allow a device beyond the container's own ({v})"
            ));
        }
    }
    let own: Result<Vec<DeviceRule>, _> = state
        .device_rules
        .iter()
        .map(|r| serde_json::from_value(r.clone()))
        .collect();
    match own {
        Ok(own) => Some(own),
        Err(e) => {
            f.refuse(format!("the container's own device rules: {e}"));
            None
        }
    }
}

/// go-units' `RAMInBytes` as far as the runtime accepts it: a decimal number of
/// bytes, with an optional binary unit (k, m, g, t, p; `b` or `ib` after it).
fn ram_in_bytes(s: &str) -> Option<i64> {
    let lower = s.to_ascii_lowercase();
    let digits_end = lower
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(lower.len());
    let (num, unit) = lower.split_at(digits_end);
    let n: i64 = num.parse().ok()?;
    let unit = unit
        .strip_suffix("ib")
        .or_else(|| unit.strip_suffix('b'))
        .unwrap_or(unit);
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        "p" => 50,
        _ => return None,
    };
    n.checked_mul(1i64.checked_shl(shift)?)
}

/// `update` flags as the same typed resources runc builds from them (runc ignores
/// every other flag when `--resources` is given; the runtime refuses the mix).
/// Flags that change isolation rather than tuning are refused.
pub fn from_flags(sub: &SubArgs, f: &mut Findings) -> Resources {
    let mut r = Resources::default();
    let given: Vec<&str> = sub
        .flags
        .iter()
        .map(|fl| fl.name)
        .filter(|n| *n != "help")
        .collect();
    if sub.value("resources").is_some() {
        if let Some(other) = given.iter().find(|n| **n != "resources") {
            f.refuse(format!(
                "update --{other} with --resources is refused: runc would ignore it; put it in the resources JSON"
            ));
        }
        return r;
    }
    refuse_other_flags(sub, f);
    let mut num = |flag: &str, signed: bool| -> Option<i64> {
        let v = sub.value(flag)?;
        let n = v
            .parse::<i64>()
            .ok()
            .filter(|n| signed || *n >= 0)
            .filter(|_| v.bytes().all(|b| b.is_ascii_digit() || b == b'-'));
        if n.is_none() {
            f.refuse(format!(
                "update --{flag} {v:?} is refused: a decimal number only"
            ));
        }
        n
    };
    let u = |n: Option<i64>| n.and_then(|n| u64::try_from(n).ok());
    let mut cpu = Cpu {
        shares: u(num("cpu-share", false)),
        period: u(num("cpu-period", false)),
        quota: num("cpu-quota", true),
        realtime_period: u(num("cpu-rt-period", false)),
        realtime_runtime: num("cpu-rt-runtime", true),
        idle: num("cpu-idle", true),
        ..Cpu::default()
    };
    let pids = num("pids-limit", true);
    cpu.cpus = sub.value("cpuset-cpus").map(str::to_string);
    cpu.mems = sub.value("cpuset-mems").map(str::to_string);
    if cpu != Cpu::default() {
        r.cpu = Some(cpu);
    }
    if let Some(l) = pids {
        r.pids = Some(Pids { limit: l });
    }
    r.memory = memory_from_flags(sub, f);
    r
}

/// The flags of what update may not change are refused.
fn refuse_other_flags(sub: &SubArgs, f: &mut Findings) {
    for flag in ["l3-cache-schema", "mem-bw-schema"] {
        if let Some(v) = sub.value(flag) {
            f.refuse(format!(
                "update --{flag} {v} is refused: cache and memory-bandwidth allocation are host-wide"
            ));
        }
    }
    for flag in ["blkio-weight", "kernel-memory", "kernel-memory-tcp"] {
        if let Some(v) = sub.value(flag) {
            f.refuse(format!(
                "update --{flag} {v} is refused: update may change {UPDATE_MAY_CHANGE} only"
            ));
        }
    }
}

/// The memory flags (`--memory`, `--memory-reservation`, `--memory-swap`) as runc's
/// `LinuxMemory`; `None` when none is given.
fn memory_from_flags(sub: &SubArgs, f: &mut Findings) -> Option<Memory> {
    let mut mem = Memory::default();
    for (flag, slot) in [
        ("memory", &mut mem.limit),
        ("memory-reservation", &mut mem.reservation),
        ("memory-swap", &mut mem.swap),
    ] {
        if let Some(v) = sub.value(flag) {
            *slot = if v == "-1" { Some(-1) } else { ram_in_bytes(v) };
            if slot.is_none() {
                f.refuse(format!(
                    "update --{flag} {v:?} is refused: bytes, or a number with k, m, g, t or p"
                ));
            }
        }
    }
    (mem != Memory::default()).then_some(mem)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::record::User;
    use serde_json::json;

    #[test]
    fn a_refusal_never_quotes_a_value_of_the_document() {
        let mut f = Findings::default();
        assert!(parse(&json!({"pids": {"limit": "s3cret"}}), &mut f).is_none());
        let all = f.reasons.join(" ");
        assert!(!all.contains("s3cret"), "{all}");
        assert!(all.contains("invalid type: string, expected i64"), "{all}");
        let e = parse_create(&json!({"cpu": {"cpus": 7}}))
            .unwrap_err()
            .join(" ");
        assert!(
            e.contains("invalid type: integer, expected a string"),
            "{e}"
        );
        assert!(!e.contains('7'), "{e}");
    }

    fn state() -> ContainerState {
        ContainerState {
            bounding: Vec::new(),
            caps: Default::default(),
            cpu: None,
            apparmor_profile: None,
            process_label: None,
            user: User {
                uid: 1000,
                gid: 1000,
                additional_gids: Vec::new(),
            },
            lease_env: Vec::new(),
            device_rules: vec![
                json!({"allow": false, "access": "rwm"}),
                json!({"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rwm"}),
                json!({"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"}),
            ],
            pids_limit: Some(100),
            memory_limit: Some(1 << 30),
            memory_swap: None,
        }
    }

    fn run(doc: &str) -> (Option<Resources>, Vec<String>) {
        let mut f = Findings::default();
        let v = crate::bundle::parse_strict(doc.as_bytes()).unwrap();
        let out = parse(&v, &mut f).and_then(|r| judge(r, &state(), &Policy::default(), &mut f));
        (out, f.reasons)
    }

    #[test]
    fn what_containerd_sends_passes_and_the_containers_rules_are_reapplied() {
        let (out, reasons) = run(
            r#"{"memory": {"limit": 1}, "cpu": {"shares": 2, "cpus": "0-1"},
            "pids": {"limit": 100}, "hugepageLimits": [{"pageSize": "2MB", "limit": 0}],
            "unified": {"memory.high": "max", "memory.max": "1048576", "memory.swap.max": "0"},
            "blockIO": {},
            "devices": [{"allow": false, "access": "rwm"},
                        {"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rw"}]}"#,
        );
        assert!(reasons.is_empty(), "{reasons:?}");
        let out = serde_json::to_value(out.unwrap()).unwrap();
        assert_eq!(out["devices"], json!(state().device_rules));
        assert_eq!(out["memory"], json!({"limit": 1}));
        assert_eq!(out["pids"], json!({"limit": 100}));
        assert!(out.get("blockIO").is_none(), "{out}");
    }

    #[test]
    fn limits_beyond_the_grant_and_keys_runc_reads_otherwise_are_refused() {
        for (doc, want) in [
            (r#"{"pids": {"limit": 101}}"#, "/pids/limit: 101"),
            (r#"{"pids": {"limit": -1}}"#, "/pids/limit: -1"),
            (r#"{"pids": {"limit": 0}}"#, "/pids/limit: 0"),
            (r#"{"pids": {"LIMIT": -1}}"#, "/pids/LIMIT: unknown"),
            (r#"{"pids": {"Limit": 999999}}"#, "/pids/Limit: unknown"),
            (r#"{"Pids": {"limit": 1}}"#, "/Pids: unknown"),
            (r#"{"pids": {"limit": 100.5}}"#, "invalid type"),
            (
                r#"{"pids": null, "memory": {"limit": -1}}"#,
                "/memory/limit: -1",
            ),
            (r#"{"memory": {"limit": 2147483648}}"#, "/memory/limit"),
            (r#"{"memory": {"swap": -1}}"#, "/memory/swap"),
            (r#"{"memory": {"kernel": 1}}"#, "/memory/kernel"),
            (
                r#"{"memory": {"disableOOMKiller": true}}"#,
                "disableOOMKiller",
            ),
            (
                r#"{"cpu": {"realtimeRuntime": 950000}}"#,
                "/cpu/realtimeRuntime",
            ),
            (
                r#"{"unified": {"memory.max": "max"}}"#,
                "/unified/memory.max",
            ),
            (r#"{"unified": {"pids.max": "max"}}"#, "/unified/pids.max"),
            (
                r#"{"unified": {"memory./../../other/cgroup.procs": "1"}}"#,
                "/unified/memory./../../other/cgroup.procs",
            ),
            (
                r#"{"hugepageLimits": [{"pageSize": "2MB.limit_in_bytes/../../other/hugetlb.2MB", "limit": 0}]}"#,
                "/hugepageLimits/0/pageSize",
            ),
            (
                r#"{"unified": {"devices.allow": "a"}}"#,
                "/unified/devices.allow",
            ),
            (r#"{"blockIO": {"weight": 10}}"#, "/blockIO"),
            (r#"{"network": {"classID": 1}}"#, "/network"),
            (r#"{"rdma": {"mlx5_0": {"hcaHandles": 1}}}"#, "/rdma"),
            (r#"{"bogus": 1}"#, "/bogus"),
            (
                r#"{"devices": [{"allow": true, "type": "c", "major": 195, "minor": 1, "access": "rw"}]}"#,
                "/devices/0",
            ),
            (
                r#"{"devices": [{"allow": true, "access": "rwm"}]}"#,
                "/devices/0",
            ),
            (
                r#"{"devices": [{"allow": false, "Type": "a"}]}"#,
                "/devices/0/Type",
            ),
            (r#"[1]"#, "not an object"),
        ] {
            let (out, reasons) = run(doc);
            assert!(out.is_none(), "{doc} passed");
            assert!(
                reasons.iter().any(|r| r.contains(want)),
                "{doc}: want {want} in {reasons:?}"
            );
        }
    }

    #[test]
    fn flags_become_the_same_typed_resources() {
        let sub = |line: &str| {
            let inv =
                crate::cli::parse_strings(line.split_whitespace().map(String::from).collect())
                    .unwrap();
            inv.command.unwrap().1
        };
        let mut f = Findings::default();
        let r = from_flags(
            &sub("update --pids-limit 50 --memory 256m --cpu-share 512 --cpuset-cpus 0-1 c1"),
            &mut f,
        );
        assert!(f.reasons.is_empty(), "{:?}", f.reasons);
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"pids": {"limit": 50}, "memory": {"limit": 268435456},
                   "cpu": {"shares": 512, "cpus": "0-1"}})
        );
        for (line, want) in [
            ("update --pids-limit 0x10 c1", "--pids-limit"),
            ("update --memory 1.5g c1", "--memory"),
            ("update --kernel-memory 1 c1", "--kernel-memory"),
            ("update --l3-cache-schema L3:0=1 c1", "--l3-cache-schema"),
            ("update -r /x --pids-limit 5 c1", "with --resources"),
        ] {
            let mut f = Findings::default();
            from_flags(&sub(line), &mut f);
            assert!(
                f.reasons.iter().any(|r| r.contains(want)),
                "{line}: {:?}",
                f.reasons
            );
        }
        let mut f = Findings::default();
        let r = from_flags(&sub("update --pids-limit -1 c1"), &mut f);
        assert!(f.reasons.is_empty());
        assert!(judge(r, &state(), &Policy::default(), &mut f).is_none());
        assert_eq!(ram_in_bytes("1GiB"), Some(1 << 30));
        assert_eq!(ram_in_bytes("10"), Some(10));
        assert_eq!(ram_in_bytes("k"), None);
    }
}
