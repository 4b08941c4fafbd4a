#!/usr/bin/env python3
"""One CUDA client that tries to allocate (and touch) a number of bytes on the GPU.

Used by run.sh on the host and inside a container, as an MPS client of a lease
(CUDA_MPS_PIPE_DIRECTORY set by the caller). It prints one JSON line saying what it
saw, and its exit status says whether that matched what the caller expected:

  0  the outcome matched --expect (ok: the allocation worked; oom: it was refused)
  1  the outcome did not match
  2  no usable CUDA (torch missing, no device, MPS server unreachable...)

The allocation is done with torch.empty on the device and then filled, so the memory
is really committed; the MPS pinned-memory limit makes cudaMalloc fail above it, which
torch reports as OutOfMemoryError (a RuntimeError mentioning "out of memory" on old
versions).
"""

import argparse
import json
import os
import sys

MPS_ENV = (
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_VISIBLE_DEVICES",
)


def parse_size(text):
    """'4GiB', '512MiB', '1073741824' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    t = text.strip().lower()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def is_oom(err):
    name = type(err).__name__
    msg = str(err).lower()
    return name == "OutOfMemoryError" or "out of memory" in msg


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", required=True, type=parse_size, help="e.g. 4GiB")
    ap.add_argument("--expect", choices=["ok", "oom"], required=True)
    ap.add_argument("--label", default="", help="free text echoed in the JSON line")
    args = ap.parse_args()

    report = {
        "label": args.label,
        "requested_bytes": args.bytes,
        "expect": args.expect,
        "env": {k: os.environ[k] for k in MPS_ENV if k in os.environ},
    }

    def finish(code, **fields):
        report.update(fields)
        print(json.dumps(report, sort_keys=True), flush=True)
        sys.exit(code)

    try:
        import torch  # noqa: PLC0415 (imported late so a missing torch is reported)
    except ImportError as e:
        finish(2, outcome="setup-error", error=f"cannot import torch: {e}")

    try:
        if not torch.cuda.is_available():
            finish(2, outcome="setup-error", error="torch.cuda.is_available() is False")
        dev = torch.device("cuda", 0)
        report["device_name"] = torch.cuda.get_device_name(dev)
        report["device_count"] = torch.cuda.device_count()
        # Creates the context (and, under MPS, connects to the lease's server).
        torch.zeros(1, device=dev)
        torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001 (any CUDA init failure is a setup error)
        finish(2, outcome="setup-error", error=f"{type(e).__name__}: {e}")

    try:
        buf = torch.empty(args.bytes, dtype=torch.uint8, device=dev)
        buf.fill_(1)
        torch.cuda.synchronize(dev)
        allocated = torch.cuda.memory_allocated(dev)
        del buf
        torch.cuda.empty_cache()
        outcome = "ok"
        error = ""
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            finish(2, outcome="error", error=f"{type(e).__name__}: {e}")
        allocated = None
        outcome = "oom"
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    matched = outcome == args.expect
    finish(0 if matched else 1, outcome=outcome, error=error,
           allocated_bytes=allocated, matched=matched)


if __name__ == "__main__":
    main()
