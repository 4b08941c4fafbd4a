#!/usr/bin/env python3
"""Dense matmul throughput (TFLOP/s) on CUDA device 0 with torch, for a few seconds.

Prints one JSON line per dtype: {"label", "dtype", "size", "iters", "seconds", "tflops"}.
Exit status 0 on success, 2 when CUDA is not usable (the JSON line says why).
Run it plainly for the whole GPU, or with CUDA_MPS_PIPE_DIRECTORY set to a lease's
pipe directory to measure what that MPS share gets.
"""

import argparse
import json
import sys
import time


def bench(torch, dtype_name, size, seconds):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    dev = torch.device("cuda", 0)
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    c = torch.empty(size, size, device=dev, dtype=dtype)
    # Warm up (cuBLAS heuristics, clocks) and estimate one iteration's time.
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    torch.matmul(a, b, out=c)
    torch.cuda.synchronize(dev)
    one = max(time.perf_counter() - t0, 1e-6)
    # Batches of launches between synchronisations until `seconds` have passed.
    batch = max(1, min(200, int(0.25 / one)))
    iters = 0
    start = time.perf_counter()
    while True:
        for _ in range(batch):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize(dev)
        iters += batch
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    flops = 2.0 * size * size * size * iters
    return {"dtype": dtype_name, "size": size, "iters": iters,
            "seconds": round(elapsed, 3), "tflops": round(flops / elapsed / 1e12, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="", help="echoed in each JSON line (e.g. 'mps 25%%')")
    ap.add_argument("--dtypes", default="bf16,fp16", help="comma list of bf16, fp16, fp32")
    ap.add_argument("--size", type=int, default=8192, help="square matrix size")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per dtype")
    args = ap.parse_args()
    try:
        import torch  # noqa: PLC0415
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        name = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"label": args.label, "error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(2)
    for dt in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        try:
            row = bench(torch, dt, args.size, args.seconds)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"label": args.label, "dtype": dt,
                              "error": f"{type(e).__name__}: {e}"}), flush=True)
            sys.exit(2)
        row["label"] = args.label
        row["device_name"] = name
        print(json.dumps(row, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
