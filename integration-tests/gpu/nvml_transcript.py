#!/usr/bin/env python3
"""Record what an NVML library answers to the read-only calls tesserad makes.

    python3 nvml_transcript.py [--lib PATH] [--out FILE]

Loads `libnvidia-ml.so.1` (or PATH) with ctypes and calls, on every GPU, the
functions the daemon's NVML backend uses, with the arguments it passes, plus the
edge cases it depends on: an index past the last GPU, a UUID that does not exist,
in/out counts of 0 with no buffer and with a buffer too small, MIG queries with MIG
mode off, an event wait that times out. Each call is recorded with its return code
(and NVML's name for it) and the values it wrote, as one JSON document.

Run against the real library on a GPU host, it is the record of what real NVML
does; run against tessera's fake (`nvml-fake`), the same script says where the fake
differs. It only reads: it never creates or destroys an instance, never changes a
mode, never resets anything. Standard library only.
"""

import argparse
import ctypes
import json
import sys

NVML_CODES = {
    0: "SUCCESS", 1: "UNINITIALIZED", 2: "INVALID_ARGUMENT", 3: "NOT_SUPPORTED",
    4: "NO_PERMISSION", 5: "ALREADY_INITIALIZED", 6: "NOT_FOUND", 7: "INSUFFICIENT_SIZE",
    8: "INSUFFICIENT_POWER", 9: "DRIVER_NOT_LOADED", 10: "TIMEOUT", 11: "IRQ_ISSUE",
    12: "LIBRARY_NOT_FOUND", 13: "FUNCTION_NOT_FOUND", 14: "CORRUPTED_INFOROM",
    15: "GPU_IS_LOST", 16: "RESET_REQUIRED", 17: "OPERATING_SYSTEM",
    18: "LIB_RM_VERSION_MISMATCH", 19: "IN_USE", 20: "MEMORY", 21: "NO_DATA",
    22: "VGPU_ECC_NOT_SUPPORTED", 23: "INSUFFICIENT_RESOURCES", 24: "FREQ_NOT_SUPPORTED",
    25: "ARGUMENT_VERSION_MISMATCH", 26: "DEPRECATED", 27: "NOT_READY",
    28: "GPU_NOT_FOUND", 29: "INVALID_STATE", 999: "UNKNOWN",
}

uint = ctypes.c_uint
ull = ctypes.c_ulonglong
handle_t = ctypes.c_void_p


class Memory(ctypes.Structure):
    _fields_ = [("total", ull), ("free", ull), ("used", ull)]


class PciInfo(ctypes.Structure):  # nvmlPciInfo_t (v3)
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", uint), ("bus", uint),
                ("device", uint), ("pciDeviceId", uint), ("pciSubSystemId", uint),
                ("busId", ctypes.c_char * 32)]


class Utilization(ctypes.Structure):
    _fields_ = [("gpu", uint), ("memory", uint)]


class GiProfileInfoV2(ctypes.Structure):  # nvmlGpuInstanceProfileInfo_v2_t
    _fields_ = [("version", uint), ("id", uint), ("isP2pSupported", uint),
                ("sliceCount", uint), ("instanceCount", uint),
                ("multiprocessorCount", uint), ("copyEngineCount", uint),
                ("decoderCount", uint), ("encoderCount", uint), ("jpegCount", uint),
                ("ofaCount", uint), ("memorySizeMB", ull), ("name", ctypes.c_char * 96)]


class Placement(ctypes.Structure):
    _fields_ = [("start", uint), ("size", uint)]


class ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t (v2/v3 layout)
    _fields_ = [("pid", uint), ("usedGpuMemory", ull), ("gpuInstanceId", uint),
                ("computeInstanceId", uint)]


class EventData(ctypes.Structure):
    _fields_ = [("device", handle_t), ("eventType", ull), ("eventData", ull),
                ("gpuInstanceId", uint), ("computeInstanceId", uint)]


# NVML_GPU_INSTANCE_PROFILE_* ids 0..14 (1_SLICE .. 2_SLICE_GFX and the _REV ones).
GI_PROFILE_IDS = range(0, 15)
GI_PROFILE_INFO_V2 = ctypes.sizeof(GiProfileInfoV2) | (2 << 24)


def struct_dict(s):
    out = {}
    for name, _ in s._fields_:
        v = getattr(s, name)
        if isinstance(v, bytes):
            v = v.decode(errors="replace")
        elif isinstance(v, int) or v is None:
            pass
        else:
            v = str(v)
        out[name] = v
    return out


class Recorder:
    def __init__(self, lib):
        self.lib = lib
        self.calls = []

    def call(self, label, fname, *args, out=None):
        fn = getattr(self.lib, fname, None)
        rec = {"call": label, "fn": fname}
        if fn is None:
            rec["missing"] = True
            self.calls.append(rec)
            return None
        fn.restype = ctypes.c_int
        rc = fn(*args)
        rec["rc"] = rc
        rec["rc_name"] = NVML_CODES.get(rc, "?")
        if out is not None and rc == 0:
            rec["out"] = out()
        self.calls.append(rec)
        return rc


def transcript(lib_path):
    lib = ctypes.CDLL(lib_path)
    r = Recorder(lib)
    r.call("init", "nvmlInit_v2")
    buf = ctypes.create_string_buffer(96)
    r.call("driver version", "nvmlSystemGetDriverVersion", buf, uint(96),
           out=lambda: buf.value.decode())
    small = ctypes.create_string_buffer(2)
    r.call("driver version, 2-byte buffer", "nvmlSystemGetDriverVersion", small, uint(2))
    n = uint(0)
    r.call("device count", "nvmlDeviceGetCount_v2", ctypes.byref(n), out=lambda: n.value)
    count = n.value
    h = handle_t()
    r.call("handle past the last index", "nvmlDeviceGetHandleByIndex_v2", uint(count),
           ctypes.byref(h))
    r.call("handle by unknown uuid", "nvmlDeviceGetHandleByUUID",
           b"GPU-00000000-0000-0000-0000-000000000000", ctypes.byref(h))
    r.call("handle, null out pointer", "nvmlDeviceGetHandleByIndex_v2", uint(0), None)
    handles = []
    for i in range(count):
        hi = handle_t()
        if r.call(f"gpu{i} handle", "nvmlDeviceGetHandleByIndex_v2", uint(i),
                  ctypes.byref(hi)) == 0:
            handles.append((i, hi))
    for i, d in handles:
        p = f"gpu{i} "
        name = ctypes.create_string_buffer(96)
        r.call(p + "name", "nvmlDeviceGetName", d, name, uint(96),
               out=lambda: name.value.decode())
        uuid = ctypes.create_string_buffer(96)
        r.call(p + "uuid", "nvmlDeviceGetUUID", d, uuid, uint(96),
               out=lambda: {"len": len(uuid.value), "prefix": uuid.value[:4].decode()})
        r.call(p + "uuid, 8-byte buffer", "nvmlDeviceGetUUID", d,
               ctypes.create_string_buffer(8), uint(8))
        idx = uint()
        r.call(p + "index", "nvmlDeviceGetIndex", d, ctypes.byref(idx), out=lambda: idx.value)
        minor = uint()
        r.call(p + "minor", "nvmlDeviceGetMinorNumber", d, ctypes.byref(minor),
               out=lambda: minor.value)
        mem = Memory()
        r.call(p + "memory", "nvmlDeviceGetMemoryInfo", d, ctypes.byref(mem),
               out=lambda: {"total": mem.total, "used_le_total": mem.used <= mem.total,
                            "free_plus_used_le_total": mem.free + mem.used <= mem.total})
        pci = PciInfo()
        r.call(p + "pci", "nvmlDeviceGetPciInfo_v3", d, ctypes.byref(pci),
               out=lambda: {"busId": pci.busId.decode(),
                            "busIdLegacy": pci.busIdLegacy.decode(),
                            "pciDeviceId": hex(pci.pciDeviceId)})
        cur, pend = uint(), uint()
        r.call(p + "mig mode", "nvmlDeviceGetMigMode", d, ctypes.byref(cur), ctypes.byref(pend),
               out=lambda: {"current": cur.value, "pending": pend.value})
        mig_on = cur.value == 1
        mx = uint()
        r.call(p + "max mig devices", "nvmlDeviceGetMaxMigDeviceCount", d, ctypes.byref(mx),
               out=lambda: mx.value)
        util = Utilization()
        r.call(p + "utilization", "nvmlDeviceGetUtilizationRates", d, ctypes.byref(util),
               out=lambda: {"in_range": util.gpu <= 100 and util.memory <= 100})
        a, b_, c, f = uint(), uint(), uint(), uint()
        r.call(p + "remapped rows", "nvmlDeviceGetRemappedRows", d, ctypes.byref(a),
               ctypes.byref(b_), ctypes.byref(c), ctypes.byref(f),
               out=lambda: {"corr": a.value, "unc": b_.value, "pending": c.value,
                            "failure": f.value})
        ev = ull()
        r.call(p + "supported events", "nvmlDeviceGetSupportedEventTypes", d, ctypes.byref(ev),
               out=lambda: hex(ev.value))
        lvl = uint()
        r.call(p + "topology with itself", "nvmlDeviceGetTopologyCommonAncestor", d, d,
               ctypes.byref(lvl), out=lambda: lvl.value)
        for j, d2 in handles:
            if j != i:
                r.call(p + f"topology with gpu{j}", "nvmlDeviceGetTopologyCommonAncestor", d, d2,
                       ctypes.byref(lvl), out=lambda: lvl.value)
        # Processes: NVML's count semantics.
        pc = uint(0)
        r.call(p + "processes, count 0 and no buffer", "nvmlDeviceGetComputeRunningProcesses_v3",
               d, ctypes.byref(pc), None, out=lambda: pc.value)
        pbuf = (ProcessInfo * 64)()
        pc = uint(64)
        r.call(p + "processes, buffer of 64", "nvmlDeviceGetComputeRunningProcesses_v3",
               d, ctypes.byref(pc), pbuf, out=lambda: pc.value)
        # GPU-instance profiles and placements.
        for pid in GI_PROFILE_IDS:
            info = GiProfileInfoV2()
            info.version = GI_PROFILE_INFO_V2
            rc = r.call(p + f"gi profile {pid}", "nvmlDeviceGetGpuInstanceProfileInfoV", d,
                        uint(pid), ctypes.byref(info), out=lambda: struct_dict(info))
            if rc != 0:
                continue
            prof = info.id
            pn = uint(0)
            r.call(p + f"gi profile {pid} placements, count 0 no buffer",
                   "nvmlDeviceGetGpuInstancePossiblePlacements_v2", d, uint(prof), None,
                   ctypes.byref(pn), out=lambda: pn.value)
            pl = (Placement * 16)()
            pn = uint(16)
            r.call(p + f"gi profile {pid} placements",
                   "nvmlDeviceGetGpuInstancePossiblePlacements_v2", d, uint(prof), pl,
                   ctypes.byref(pn),
                   out=lambda: [(pl[k].start, pl[k].size) for k in range(pn.value)])
            pn = uint(1)
            r.call(p + f"gi profile {pid} placements, buffer of 1",
                   "nvmlDeviceGetGpuInstancePossiblePlacements_v2", d, uint(prof), pl,
                   ctypes.byref(pn), out=lambda: pn.value)
            gi = (handle_t * 8)()
            gn = uint(0)
            r.call(p + f"gi profile {pid} instances, count 0", "nvmlDeviceGetGpuInstances", d,
                   uint(prof), gi, ctypes.byref(gn), out=lambda: gn.value)
            gn = uint(8)
            r.call(p + f"gi profile {pid} instances, buffer of 8", "nvmlDeviceGetGpuInstances",
                   d, uint(prof), gi, ctypes.byref(gn), out=lambda: gn.value)
        mh = handle_t()
        r.call(p + "mig device 0", "nvmlDeviceGetMigDeviceHandleByIndex", d, uint(0),
               ctypes.byref(mh))
        if not mig_on:
            gid = uint()
            r.call(p + "gpu instance id of a full GPU", "nvmlDeviceGetGpuInstanceId", d,
                   ctypes.byref(gid))
    # Events: a set, XID and ECC registered on each GPU, a wait that times out.
    es = handle_t()
    if r.call("event set create", "nvmlEventSetCreate", ctypes.byref(es)) == 0:
        for i, d in handles:
            r.call(f"gpu{i} register xid+dbe events", "nvmlDeviceRegisterEvents", d,
                   ull(0x8 | 0x2), es)
        data = EventData()
        r.call("event wait 200 ms", "nvmlEventSetWait_v2", es, ctypes.byref(data), uint(200))
        r.call("event set free", "nvmlEventSetFree", es)
    r.call("shutdown", "nvmlShutdown")
    r.call("call after shutdown", "nvmlDeviceGetCount_v2", ctypes.byref(n))
    return {"library": lib_path, "calls": r.calls}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", default="libnvidia-ml.so.1")
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    try:
        doc = transcript(a.lib)
    except OSError as e:
        print(f"nvml_transcript: cannot load {a.lib}: {e}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=1)
    if a.out == "-":
        print(text)
    else:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
