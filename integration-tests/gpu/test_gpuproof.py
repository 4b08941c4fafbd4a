#!/usr/bin/env python3
"""Tests of gpuproof.py's pure parts (no GPU needed): python3 -m unittest test_gpuproof.py"""

import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpuproof  # noqa: E402

SMI_XML = """<?xml version="1.0" ?>
<nvidia_smi_log>
  <driver_version>550.54.15</driver_version>
  <gpu id="00000000:19:00.0">
    <product_name>NVIDIA H100 80GB HBM3</product_name>
    <mig_mode><current_mig>Disabled</current_mig><pending_mig>Disabled</pending_mig></mig_mode>
    <uuid>GPU-aaaaaaaa-0000-0000-0000-000000000000</uuid>
    <minor_number>0</minor_number>
    <fb_memory_usage><total>81559 MiB</total><reserved>328 MiB</reserved></fb_memory_usage>
  </gpu>
  <gpu id="00000000:3B:00.0">
    <product_name>NVIDIA A100-SXM4-40GB</product_name>
    <mig_mode><current_mig>Disabled</current_mig><pending_mig>Enabled</pending_mig></mig_mode>
    <uuid>GPU-bbbbbbbb-0000-0000-0000-000000000000</uuid>
    <minor_number>1</minor_number>
    <fb_memory_usage><total>40960 MiB</total></fb_memory_usage>
  </gpu>
</nvidia_smi_log>
"""


def tessera_gpus():
    return [
        {"index": 0, "uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000000",
         "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 81559 << 20, "minor": 0,
         "pci_bus_id": "00000000:19:00.0", "mig_mode": "off"},
        {"index": 1, "uuid": "GPU-bbbbbbbb-0000-0000-0000-000000000000",
         "name": "NVIDIA A100-SXM4-40GB", "memory_bytes": 40960 << 20, "minor": 1,
         "pci_bus_id": "00000000:3b:00.0", "mig_mode": "pending"},
    ]


class CompareGpus(unittest.TestCase):
    def test_identical_node_matches_every_field(self):
        rows, ok = gpuproof.compare_gpus(tessera_gpus(), gpuproof.smi_gpus(SMI_XML))
        self.assertTrue(ok, rows)
        fields = {r[1] for r in rows}
        self.assertTrue({"uuid", "name", "memory", "mig mode", "pci bus id", "minor"} <= fields)

    def test_each_differing_field_is_named(self):
        t = tessera_gpus()
        t[0]["name"] = "NVIDIA H100"
        t[0]["memory_bytes"] = 80 << 30
        t[1]["mig_mode"] = "off"
        rows, ok = gpuproof.compare_gpus(t, gpuproof.smi_gpus(SMI_XML))
        self.assertFalse(ok)
        bad = {(r[0], r[1]) for r in rows if not r[2]}
        self.assertEqual(bad, {("gpu0", "name"), ("gpu0", "memory"), ("gpu1", "mig mode")})

    def test_unknown_uuid_and_missing_gpu_fail(self):
        t = tessera_gpus()[:1]
        t[0]["uuid"] = "GPU-other"
        rows, ok = gpuproof.compare_gpus(t, gpuproof.smi_gpus(SMI_XML))
        self.assertFalse(ok)
        bad = {(r[0], r[1]) for r in rows if not r[2]}
        self.assertIn(("node", "gpu count"), bad)
        self.assertIn(("gpu0", "uuid"), bad)
        self.assertIn(("gpu1", "uuid"), bad)

    def test_memory_within_one_mib_matches(self):
        t = tessera_gpus()
        t[0]["memory_bytes"] = (81559 << 20) + (1 << 20) - 1
        _, ok = gpuproof.compare_gpus(t, gpuproof.smi_gpus(SMI_XML))
        self.assertTrue(ok)

    def test_mig_mode_spelling(self):
        def mode(cur, pend):
            return gpuproof.smi_mig_mode({"mig_current": cur, "mig_pending": pend})
        self.assertEqual(mode("Enabled", "Enabled"), "on")
        self.assertEqual(mode("Disabled", "Disabled"), "off")
        self.assertEqual(mode("Disabled", "Enabled"), "pending")
        self.assertEqual(mode("N/A", "N/A"), "off")

    def test_cli_exit_status(self):
        with tempfile.TemporaryDirectory() as d:
            tj, sx = os.path.join(d, "t.json"), os.path.join(d, "s.xml")
            with open(sx, "w") as f:
                f.write(SMI_XML)
            with open(tj, "w") as f:
                json.dump(tessera_gpus(), f)
            self.assertEqual(gpuproof.main(["compare-gpus", tj, sx]), 0)
            t = tessera_gpus()
            t[1]["minor"] = 7
            with open(tj, "w") as f:
                json.dump(t, f)
            self.assertEqual(gpuproof.main(["compare-gpus", tj, sx]), 1)


class JsonGet(unittest.TestCase):
    def test_paths(self):
        doc = {"lease": {"id": "l-1", "partition": {"mps": {"pipe_dir": "/p"}}}, "l": [1, 2]}
        self.assertEqual(gpuproof.json_get(doc, "lease.partition.mps.pipe_dir"), "/p")
        self.assertEqual(gpuproof.json_get(doc, "l.1"), 2)
        with self.assertRaises(KeyError):
            gpuproof.json_get(doc, "lease.partition.mig.gi_id")


class BindRoots(unittest.TestCase):
    def test_usr_is_covered_and_nested_paths_collapse(self):
        roots = gpuproof.bind_roots([
            "/usr/bin", "/opt/venv", "/opt/venv/lib/python3.11/site-packages", "/usr/lib/python3"])
        self.assertEqual(roots, ["/opt/venv"])

    def test_refused_trees(self):
        for p in ["/root/.pyenv/versions/3.11", "/proc/1", "/etc", "/run", "/tmp", "/"]:
            with self.assertRaises(gpuproof.BindError, msg=p):
                gpuproof.bind_roots([p])


class OciSpec(unittest.TestCase):
    def test_token_binds_and_no_gpu_devices(self):
        spec = gpuproof.oci_spec("/r", ["sh"], ["PATH=/bin"], "tok", ["/usr:/usr"])
        self.assertEqual(spec["annotations"], {"tessera.io/lease-token": "tok"})
        binds = [m for m in spec["mounts"] if m["type"] == "bind"]
        self.assertEqual(binds[0]["source"], "/usr")
        self.assertIn("ro", binds[0]["options"])
        self.assertEqual(spec["linux"]["resources"]["devices"], [{"allow": False, "access": "rwm"}])
        self.assertNotIn("CAP_SYS_ADMIN", spec["process"]["capabilities"]["bounding"])

    def test_no_token_no_annotation(self):
        self.assertNotIn("annotations", gpuproof.oci_spec("/r", ["sh"], [], "", []))


class BenchTable(unittest.TestCase):
    def test_percent_of_no_mps(self):
        rows = gpuproof.bench_rows([
            '{"label": "no MPS", "dtype": "bf16", "size": 8192, "tflops": 600.0}',
            'noise',
            '{"label": "mps 25%", "dtype": "bf16", "size": 8192, "tflops": 150.0}',
            '{"label": "mps 50%", "dtype": "fp16", "error": "boom"}',
        ])
        table = gpuproof.bench_table(rows)
        self.assertIn("25%", table.splitlines()[2])
        self.assertRegex(table.splitlines()[2], r"150\.00\s+25%$")
        self.assertIn("error", table.splitlines()[3])


if __name__ == "__main__":
    unittest.main()
