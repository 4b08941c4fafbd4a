#!/usr/bin/env python3
"""Helpers for run.sh (standard library only, no GPU needed).

Subcommands:
  json-get FILE|- PATH          print the value at a dotted path (lease.partition.mps.pipe_dir)
  compare-gpus TESSERA_JSON NVIDIA_SMI_XML
                                `tessera --json gpus` against `nvidia-smi -q -x`: one
                                MATCH/MISMATCH line per GPU and field; exit 1 on any mismatch
  mps-procs PIPE_DIR            pids of nvidia-cuda-mps-control whose environment has
                                CUDA_MPS_PIPE_DIRECTORY=PIPE_DIR (one per line)
  mps-all                       every nvidia-cuda-mps-control/-server process: pid, name, pipe dir
  oci-spec OPTIONS              write an OCI config.json for a tenant container
  bench-table FILE...           matmul_bench.py JSON lines -> a table with % of the no-MPS run
  toml-check FILE               parse a TOML file (python >= 3.11), exit 1 if it is invalid
  bind-roots PATH...            the host trees to bind read-only so a container sees these
                                paths (python prefix, torch); /usr is bound anyway; exit 3
                                with the reason when one lies where the runtime never binds
"""

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET

MIB = 1 << 20


# ---------------------------------------------------------------- json-get

def json_get(doc, path):
    """Walk a dotted path; list indices are numbers. Raises KeyError when absent."""
    cur = doc
    for part in [p for p in path.split(".") if p]:
        if isinstance(cur, list):
            cur = cur[int(part)]
        elif isinstance(cur, dict):
            if part not in cur:
                raise KeyError(path)
            cur = cur[part]
        else:
            raise KeyError(path)
    return cur


def cmd_json_get(args):
    text = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
    try:
        value = json_get(json.loads(text), args.path)
    except (KeyError, IndexError, ValueError):
        print(f"json-get: {args.path} not found in {args.file}", file=sys.stderr)
        return 1
    if isinstance(value, (dict, list)):
        print(json.dumps(value))
    elif isinstance(value, bool):
        print("true" if value else "false")
    else:
        print(value)
    return 0


# ---------------------------------------------------------------- compare-gpus

def smi_gpus(xml_text):
    """The GPUs of `nvidia-smi -q -x`, in its order (NVML index order)."""
    root = ET.fromstring(xml_text)
    out = []
    for i, g in enumerate(root.findall("gpu")):
        def text(path, default=""):
            node = g.find(path)
            return node.text.strip() if node is not None and node.text else default
        total = text("fb_memory_usage/total")
        reserved = text("fb_memory_usage/reserved")
        out.append({
            "index": i,
            "name": text("product_name"),
            "uuid": text("uuid"),
            "pci_bus_id": g.get("id", ""),
            "minor": text("minor_number"),
            "memory_mib": _mib(total),
            "reserved_mib": _mib(reserved),
            "mig_current": text("mig_mode/current_mig", "N/A"),
            "mig_pending": text("mig_mode/pending_mig", "N/A"),
        })
    return out


def _mib(value):
    """'81559 MiB' -> 81559; None when absent or not a number."""
    parts = value.split()
    try:
        return int(parts[0]) if parts else None
    except ValueError:
        return None


def smi_mig_mode(gpu):
    """tessera's spelling (on/off/pending) of nvidia-smi's current/pending MIG mode."""
    cur = gpu["mig_current"].lower()
    pend = gpu["mig_pending"].lower()
    if cur in ("n/a", "") or cur.startswith("[not"):
        return "off"  # not MIG capable
    if pend not in ("n/a", "") and pend != cur:
        return "pending"
    return "on" if cur == "enabled" else "off"


def compare_gpus(tessera, smi):
    """[(gpu label, field, ok, tessera value, nvidia-smi value)] and overall ok."""
    rows = []
    by_uuid = {g.get("uuid", ""): g for g in tessera}
    if len(tessera) != len(smi):
        rows.append(("node", "gpu count", False, len(tessera), len(smi)))
    for s in smi:
        label = f"gpu{s['index']}"
        t = by_uuid.get(s["uuid"])
        if t is None:
            # Compare the rest with the GPU at the same index, if any.
            t = next((g for g in tessera if g.get("index") == s["index"]), None)
            rows.append((label, "uuid", False, t["uuid"] if t else "(absent)", s["uuid"]))
            if t is None:
                continue
        else:
            rows.append((label, "uuid", True, t["uuid"], s["uuid"]))
        rows.append((label, "index", t.get("index") == s["index"], t.get("index"), s["index"]))
        rows.append((label, "name", t.get("name", "") == s["name"], t.get("name"), s["name"]))
        t_mib = int(t.get("memory_bytes", 0)) // MIB
        s_mib = s["memory_mib"]
        mem_ok = s_mib is not None and abs(t_mib - s_mib) <= 1
        shown = f"{s_mib} MiB" if s_mib is not None else "(unreadable)"
        if not mem_ok and s_mib is not None and s["reserved_mib"]:
            shown += f" (reserved {s['reserved_mib']} MiB not included)"
        rows.append((label, "memory", mem_ok, f"{t_mib} MiB", shown))
        want = smi_mig_mode(s)
        mig = (f"{want} (current {s['mig_current']}, pending {s['mig_pending']})")
        rows.append((label, "mig mode", t.get("mig_mode") == want, t.get("mig_mode"), mig))
        if s["pci_bus_id"]:
            ok = str(t.get("pci_bus_id", "")).lower() == s["pci_bus_id"].lower()
            rows.append((label, "pci bus id", ok, t.get("pci_bus_id"), s["pci_bus_id"]))
        if s["minor"] != "":
            ok = str(t.get("minor")) == s["minor"]
            rows.append((label, "minor", ok, t.get("minor"), s["minor"]))
    return rows, all(r[2] for r in rows)


def cmd_compare_gpus(args):
    tessera = json.load(open(args.tessera_json, encoding="utf-8"))
    if isinstance(tessera, dict) and "gpus" in tessera:
        tessera = tessera["gpus"]
    smi = smi_gpus(open(args.smi_xml, encoding="utf-8").read())
    rows, ok = compare_gpus(tessera, smi)
    for label, field, good, tv, sv in rows:
        verdict = "MATCH   " if good else "MISMATCH"
        print(f"{verdict} {label} {field}: tessera={tv!s} nvidia-smi={sv!s}")
    return 0 if ok else 1


# ---------------------------------------------------------------- MPS processes

MPS_NAMES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")


def _proc_info(pid, proc="/proc"):
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"{proc}/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    name = os.path.basename(argv[0].decode(errors="replace")) if argv and argv[0] else ""
    pipe = ""
    for kv in env:
        if kv.startswith(b"CUDA_MPS_PIPE_DIRECTORY="):
            pipe = kv.split(b"=", 1)[1].decode(errors="replace")
    return name, pipe


def mps_processes(proc="/proc"):
    out = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        info = _proc_info(entry, proc)
        if info and info[0] in MPS_NAMES:
            out.append((int(entry), info[0], info[1]))
    return sorted(out)


def _same_dir(a, b):
    return bool(a) and bool(b) and os.path.realpath(a) == os.path.realpath(b)


def cmd_mps_procs(args):
    for pid, name, pipe in mps_processes():
        if name == "nvidia-cuda-mps-control" and _same_dir(pipe, args.pipe_dir):
            print(pid)
    return 0


def cmd_mps_all(_args):
    for pid, name, pipe in mps_processes():
        print(f"{pid} {name} pipe={pipe or '(default /tmp/nvidia-mps)'}")
    return 0


# ---------------------------------------------------------------- oci-spec

# The capabilities the shipped runtime policy allows (configs/runtime.toml).
TENANT_CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_SETGID",
    "CAP_SETUID", "CAP_NET_BIND_SERVICE", "CAP_KILL", "CAP_AUDIT_WRITE",
]


def oci_spec(rootfs, args, env, token, binds, hostname="tenant"):
    """A plain tenant spec: no GPU devices of its own (they come from the lease)."""
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/run", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
    ]
    for b in binds:
        src, dst = b.split(":", 1)
        mounts.append({"destination": dst, "type": "bind", "source": src,
                       "options": ["rbind", "ro", "nosuid", "nodev"]})
    spec = {
        "ociVersion": "1.0.2-dev",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": env,
            "cwd": "/",
            "capabilities": {k: list(TENANT_CAPS) for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": mounts,
        "linux": {
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")],
            "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/timer_list"],
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger", "/proc/bus"],
        },
    }
    if token:
        spec["annotations"] = {"tessera.io/lease-token": token}
    return spec


def cmd_oci_spec(args):
    spec = oci_spec(args.rootfs, args.args, args.env, args.token, args.bind)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=2)
        f.write("\n")
    return 0


# ---------------------------------------------------------------- bind-roots

# The runtime policy's defaults (runtime-shim/src/policy.rs): trees never bound, and
# files whose ancestors may not be bound either.
SENSITIVE_TREES = ["/proc", "/sys", "/dev", "/boot", "/root", "/run/tessera",
                   "/var/lib/tessera", "/etc/tessera", "/run/runc", "/tmp/nvidia-mps",
                   "/var/lib/kubelet/pki"]
PROTECTED_FILES = ["/run/containerd/containerd.sock", "/var/run/containerd/containerd.sock",
                   "/run/docker.sock", "/var/run/docker.sock", "/run/crio/crio.sock",
                   "/var/run/crio/crio.sock", "/run/tessera/tesserad.sock", "/etc/shadow",
                   "/etc/tessera/runtime.toml", "/var/lib/tessera/state.db",
                   "/var/lib/docker/containers"]


def _under(path, tree):
    return path == tree or path.startswith(tree.rstrip("/") + "/")


class BindError(Exception):
    pass


def bind_roots(paths, covered=("/usr",)):
    """Minimal list of host trees to bind so every path is visible; BindError if a
    path can only be reached through a tree the runtime refuses."""
    wanted = []
    for p in paths:
        p = os.path.normpath(p)
        if not p.startswith("/"):
            raise BindError(f"{p} is not absolute")
        if any(_under(p, c) for c in covered):
            continue
        for tree in SENSITIVE_TREES:
            if _under(p, tree):
                raise BindError(f"{p} is under {tree}, which the runtime policy never binds")
        for f in PROTECTED_FILES:
            if _under(f, p):
                raise BindError(f"{p} holds {f}, so the runtime policy refuses to bind it")
        if p == "/tmp":
            raise BindError("/tmp is shared by every tenant; the runtime refuses to bind it")
        wanted.append(p)
    roots = []
    for p in sorted(set(wanted)):
        if not any(_under(p, r) for r in roots):
            roots.append(p)
    return roots


def cmd_bind_roots(args):
    try:
        roots = bind_roots(args.paths)
    except BindError as e:
        print(f"bind-roots: {e}", file=sys.stderr)
        return 3
    for r in roots:
        print(r)
    return 0


# ---------------------------------------------------------------- bench-table

def bench_rows(lines):
    rows = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def bench_table(rows):
    base = {r["dtype"]: r["tflops"] for r in rows
            if r.get("label") == "no MPS" and "tflops" in r}
    out = [f"{'run':<14} {'dtype':<6} {'size':>6} {'TFLOP/s':>9} {'vs no MPS':>10}"]
    for r in rows:
        if "tflops" not in r:
            out.append(f"{r.get('label', ''):<14} {r.get('dtype', '-'):<6} "
                       f"{'-':>6} {'error':>9}  {r.get('error', '')}")
            continue
        ref = base.get(r["dtype"])
        pct = f"{100.0 * r['tflops'] / ref:.0f}%" if ref else "-"
        out.append(f"{r['label']:<14} {r['dtype']:<6} {r['size']:>6} "
                   f"{r['tflops']:>9.2f} {pct:>10}")
    return "\n".join(out)


def cmd_bench_table(args):
    lines = []
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            lines.extend(f.readlines())
    print(bench_table(bench_rows(lines)))
    return 0


# ---------------------------------------------------------------- toml-check

def cmd_toml_check(args):
    try:
        import tomllib  # noqa: PLC0415 (3.11+)
    except ImportError:
        print(f"toml-check: python {sys.version.split()[0]} has no tomllib; not checked")
        return 0
    try:
        with open(args.file, "rb") as f:
            tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        print(f"toml-check: {args.file}: {e}", file=sys.stderr)
        return 1
    print(f"toml-check: {args.file}: OK")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description="helpers for integration-tests/gpu/run.sh")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("json-get")
    p.add_argument("file")
    p.add_argument("path")
    p.set_defaults(fn=cmd_json_get)
    p = sub.add_parser("compare-gpus")
    p.add_argument("tessera_json")
    p.add_argument("smi_xml")
    p.set_defaults(fn=cmd_compare_gpus)
    p = sub.add_parser("mps-procs")
    p.add_argument("pipe_dir")
    p.set_defaults(fn=cmd_mps_procs)
    p = sub.add_parser("mps-all")
    p.set_defaults(fn=cmd_mps_all)
    p = sub.add_parser("oci-spec")
    p.add_argument("--out", required=True)
    p.add_argument("--rootfs", required=True)
    p.add_argument("--token", default="")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE, repeatable")
    p.add_argument("--bind", action="append", default=[],
                   help="HOST:CONTAINER read-only bind, repeatable")
    p.add_argument("args", nargs="+", help="the container's command line (after --)")
    p.set_defaults(fn=cmd_oci_spec)
    p = sub.add_parser("bench-table")
    p.add_argument("files", nargs="+")
    p.set_defaults(fn=cmd_bench_table)
    p = sub.add_parser("bind-roots")
    p.add_argument("paths", nargs="+")
    p.set_defaults(fn=cmd_bind_roots)
    p = sub.add_parser("toml-check")
    p.add_argument("file")
    p.set_defaults(fn=cmd_toml_check)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
