"""A Kubernetes API server stand-in for resource.k8s.io/v1 ResourceSlices and
ResourceClaims, for the tests (tests/dra_cluster.rs runs it; other suites may too).

It serves over HTTP what a client such as kube-rs sends to the real API server:
create, get, replace (PUT with metadata.resourceVersion: a stale one is answered
409 Conflict), list (labelSelector `k=v`, fieldSelector `spec.nodeName`,
`spec.driver`, `spec.pool.name`), watch (`?watch=true`, JSON lines), delete, and
for claims the `status` subresource. Errors are `Status` objects as the real one
sends them.

Every object written is checked against the JSON schema of Kubernetes 1.36's
resource.k8s.io/v1 (kubernetes-validate's strict schemas, generated from the
official OpenAPI documents: unknown fields are refused) and against the rules of
pkg/apis/resource/validation that a schema cannot say (DNS names, one of devices
and sharedCounters, at most 64 devices when any consumes counters or has taints,
at most 8 counter sets and 32 counters each, at most 2 counter consumptions per
device, attribute and capacity names and counts, taint effects). An invalid write
is answered 422 Invalid and recorded.

Test controls (not Kubernetes API): `POST /standin/conflict` `{"name": N, "times": k}`
makes another writer change slice N before each of its next k replaces, so those
replaces conflict; `GET /standin/stats` says how many writes, conflicts and
rejections there were (with their reasons); `GET /standin/pool/<driver>/<pool>`
checks the pool at its highest generation (slice count complete, device names
unique, every consumed counter set and counter defined in the pool, and no device
consuming more of a counter than the set has) and answers the problems found.

Run: `python3 apiserver_standin.py [--port 0]`; it prints `LISTENING <port>` once
it serves. `python3 apiserver_standin.py --validate FILE...` checks the documents of
YAML manifests against the same schemas instead.
"""

import argparse
import copy
import json
import re
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import kubernetes_validate

K8S_VERSION = "1.36.0"
GROUP = "resource.k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
C_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
QUANTITY = re.compile(r"^[+]?[0-9]+(\.[0-9]+)?([KMGTPE]i?|[numkMGTPE]|[eE][+-]?[0-9]+)?$")


def dns_label(s):
    return isinstance(s, str) and len(s) <= 63 and bool(DNS_LABEL.match(s))


def dns_subdomain(s):
    return isinstance(s, str) and 0 < len(s) <= 253 and all(dns_label(p) for p in s.split("."))


def qualified_name(s):
    """A label/taint key: optional DNS-subdomain prefix, a name of at most 63."""
    if not isinstance(s, str) or not s:
        return False
    prefix, _, name = s.rpartition("/")
    if prefix and not dns_subdomain(prefix):
        return False
    return 0 < len(name) <= 63 and bool(re.match(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", name))


def attribute_name(s):
    """A device attribute or capacity name: optional domain, a C identifier of at most 32."""
    domain, _, ident = s.rpartition("/")
    if domain and (not dns_subdomain(domain) or len(domain) > 63):
        return False
    return 0 < len(ident) <= 32 and bool(C_IDENT.match(ident))


def quantity_value(q):
    """The integer value of a plain decimal quantity, else None."""
    if isinstance(q, str) and re.match(r"^[0-9]+$", q):
        return int(q)
    return None


def slice_rules(obj):
    """pkg/apis/resource/validation's ResourceSlice rules a schema does not say."""
    errs = []
    meta = obj.get("metadata", {})
    if not dns_subdomain(meta.get("name", "")):
        errs.append(f"metadata.name {meta.get('name')!r}: not a DNS subdomain")
    spec = obj.get("spec", {})
    driver = spec.get("driver", "")
    if not dns_subdomain(driver) or len(driver) > 63:
        errs.append(f"spec.driver {driver!r}: not a DNS subdomain of at most 63")
    pool = spec.get("pool", {})
    name = pool.get("name", "")
    if not name or len(name) > 253 or not all(dns_subdomain(p) for p in name.split("/")):
        errs.append(f"spec.pool.name {name!r}: not DNS subdomains separated by /")
    if pool.get("generation", -1) < 0:
        errs.append("spec.pool.generation: must be >= 0")
    if pool.get("resourceSliceCount", 0) <= 0:
        errs.append("spec.pool.resourceSliceCount: must be > 0")
    selection = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
                 if spec.get(k) not in (None, False)]
    if len(selection) != 1:
        errs.append(f"spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection (got {selection})")
    if "nodeName" in spec and not dns_subdomain(spec["nodeName"]):
        errs.append(f"spec.nodeName {spec['nodeName']!r}: not a DNS subdomain")
    devices = spec.get("devices")
    counters = spec.get("sharedCounters")
    if devices is not None and counters is not None:
        errs.append("spec: only one of devices and sharedCounters may be set")
    counters = counters or []
    if len(counters) > 8:
        errs.append(f"spec.sharedCounters: {len(counters)} counter sets, at most 8")
    set_names = set()
    for i, cs in enumerate(counters):
        if not dns_label(cs.get("name", "")):
            errs.append(f"spec.sharedCounters[{i}].name {cs.get('name')!r}: not a DNS label")
        if cs.get("name") in set_names:
            errs.append(f"spec.sharedCounters[{i}].name {cs.get('name')!r}: duplicate")
        set_names.add(cs.get("name"))
        cnt = cs.get("counters") or {}
        if len(cnt) > 32:
            errs.append(f"spec.sharedCounters[{i}].counters: {len(cnt)}, at most 32")
        for k, v in cnt.items():
            if not dns_label(k):
                errs.append(f"spec.sharedCounters[{i}].counters[{k!r}]: not a DNS label")
            if not QUANTITY.match(str(v.get("value", ""))):
                errs.append(f"spec.sharedCounters[{i}].counters[{k!r}]: bad quantity")
    devices = devices or []
    advanced = any(d.get("consumesCounters") or d.get("taints") for d in devices)
    limit = 64 if advanced else 128
    if len(devices) > limit:
        errs.append(f"spec.devices: {len(devices)} devices, at most {limit}")
    names = set()
    for i, d in enumerate(devices):
        at = f"spec.devices[{i}]"
        if not dns_label(d.get("name", "")):
            errs.append(f"{at}.name {d.get('name')!r}: not a DNS label")
        if d.get("name") in names:
            errs.append(f"{at}.name {d.get('name')!r}: duplicate")
        names.add(d.get("name"))
        attrs = d.get("attributes") or {}
        caps = d.get("capacity") or {}
        if len(attrs) + len(caps) > 32:
            errs.append(f"{at}: {len(attrs) + len(caps)} attributes and capacities, at most 32")
        for k, v in attrs.items():
            if not attribute_name(k):
                errs.append(f"{at}.attributes[{k!r}]: not a qualified C identifier")
            set_fields = [f for f in ("int", "bool", "string", "version") if f in v]
            if len(set_fields) != 1:
                errs.append(f"{at}.attributes[{k!r}]: exactly one value (got {set_fields})")
            if "string" in v and len(v["string"]) > 64:
                errs.append(f"{at}.attributes[{k!r}]: string longer than 64")
        for k, v in caps.items():
            if not attribute_name(k):
                errs.append(f"{at}.capacity[{k!r}]: not a qualified C identifier")
            if not QUANTITY.match(str(v.get("value", ""))):
                errs.append(f"{at}.capacity[{k!r}]: bad quantity")
        consumes = d.get("consumesCounters") or []
        if len(consumes) > 2:
            errs.append(f"{at}.consumesCounters: {len(consumes)}, at most 2")
        seen = set()
        for j, c in enumerate(consumes):
            if not dns_label(c.get("counterSet", "")):
                errs.append(f"{at}.consumesCounters[{j}].counterSet: not a DNS label")
            if c.get("counterSet") in seen:
                errs.append(f"{at}.consumesCounters[{j}]: a second entry for {c.get('counterSet')!r}")
            seen.add(c.get("counterSet"))
            cnt = c.get("counters") or {}
            if len(cnt) > 32:
                errs.append(f"{at}.consumesCounters[{j}].counters: {len(cnt)}, at most 32")
            for k, v in cnt.items():
                if not dns_label(k):
                    errs.append(f"{at}.consumesCounters[{j}].counters[{k!r}]: not a DNS label")
                if not QUANTITY.match(str(v.get("value", ""))):
                    errs.append(f"{at}.consumesCounters[{j}].counters[{k!r}]: bad quantity")
        taints = d.get("taints") or []
        if len(taints) > 16:
            errs.append(f"{at}.taints: {len(taints)}, at most 16")
        for j, t in enumerate(taints):
            if not qualified_name(t.get("key", "")):
                errs.append(f"{at}.taints[{j}].key {t.get('key')!r}: not a label name")
            if "value" in t and (len(t["value"]) > 63 or not LABEL_VALUE.match(t["value"])):
                errs.append(f"{at}.taints[{j}].value {t.get('value')!r}: not a label value")
            if t.get("effect") not in ("None", "NoSchedule", "NoExecute"):
                errs.append(f"{at}.taints[{j}].effect {t.get('effect')!r}: not None, NoSchedule or NoExecute")
    return errs


def claim_rules(obj):
    errs = []
    meta = obj.get("metadata", {})
    if not dns_subdomain(meta.get("name", "")):
        errs.append(f"metadata.name {meta.get('name')!r}: not a DNS subdomain")
    alloc = (obj.get("status") or {}).get("allocation") or {}
    for i, r in enumerate((alloc.get("devices") or {}).get("results") or []):
        if not dns_label(r.get("device", "")):
            errs.append(f"status.allocation.devices.results[{i}].device: not a DNS label")
    return errs


class Store:
    def __init__(self):
        self.lock = threading.Condition()
        self.rv = 100
        # (kind, namespace, name) -> object
        self.objects = {}
        # (rv, type, kind, object) for watches
        self.events = []
        self.conflicts_planned = {}
        self.stats = {"writes": 0, "conflicts": 0, "rejected": [], "deleted": 0}

    def next_rv(self):
        self.rv += 1
        return str(self.rv)

    def record(self, typ, kind, obj):
        self.events.append((int(obj["metadata"]["resourceVersion"]), typ, kind, copy.deepcopy(obj)))
        self.lock.notify_all()


STORE = Store()


def status(code, reason, message, details=None):
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}
    if details:
        body["details"] = details
    return code, body


def validate(kind, obj):
    """Schema and rules; a list of problems."""
    errs = []
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        errs.append(f"schema: {path}: {e.message}")
    except Exception as e:  # a schema it cannot find is a failure too
        errs.append(f"schema: {e}")
    errs += slice_rules(obj) if kind == "ResourceSlice" else claim_rules(obj)
    return errs


def selector_match(obj, labels, fields):
    for k, v in labels.items():
        if (obj["metadata"].get("labels") or {}).get(k) != v:
            return False
    spec = obj.get("spec", {})
    for k, v in fields.items():
        if k == "spec.nodeName":
            got = spec.get("nodeName")
        elif k == "spec.driver":
            got = spec.get("driver")
        elif k == "spec.pool.name":
            got = spec.get("pool", {}).get("name")
        elif k == "metadata.name":
            got = obj["metadata"].get("name")
        elif k == "metadata.namespace":
            got = obj["metadata"].get("namespace")
        else:
            raise ValueError(f'field label not supported: "{k}"')
        if got != v:
            return False
    return True


def parse_selector(s):
    out = {}
    for part in filter(None, (s or "").split(",")):
        if "!=" in part:
            raise ValueError(f"selector {part!r}: only = and == are served")
        k, _, v = part.replace("==", "=").partition("=")
        out[k.strip()] = v.strip()
    return out


def pool_check(driver, pool):
    """Problems of a pool at its highest generation."""
    with STORE.lock:
        slices = [o for (k, _, _), o in STORE.objects.items()
                  if k == "ResourceSlice" and o["spec"]["driver"] == driver
                  and o["spec"]["pool"]["name"] == pool]
    if not slices:
        return {"problems": [f"no slices of pool {pool}"], "generation": None, "slices": 0, "devices": 0}
    gen = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == gen]
    problems = []
    counts = {s["spec"]["pool"]["resourceSliceCount"] for s in current}
    if counts != {len(current)}:
        problems.append(f"generation {gen}: {len(current)} slices, resourceSliceCount says {sorted(counts)}")
    sets = {}
    for s in current:
        for cs in s["spec"].get("sharedCounters") or []:
            if cs["name"] in sets:
                problems.append(f"counter set {cs['name']} defined twice in the pool")
            sets[cs["name"]] = {k: quantity_value(v["value"]) for k, v in (cs.get("counters") or {}).items()}
    names = set()
    ndev = 0
    for s in current:
        for d in s["spec"].get("devices") or []:
            ndev += 1
            if d["name"] in names:
                problems.append(f"device {d['name']} twice in the pool")
            names.add(d["name"])
            for c in d.get("consumesCounters") or []:
                have = sets.get(c["counterSet"])
                if have is None:
                    problems.append(f"device {d['name']} consumes from undefined counter set {c['counterSet']}")
                    continue
                for k, v in (c.get("counters") or {}).items():
                    if k not in have:
                        problems.append(f"device {d['name']} consumes undefined counter {c['counterSet']}/{k}")
                    elif quantity_value(v["value"]) is None or have[k] is None or quantity_value(v["value"]) > have[k]:
                        problems.append(f"device {d['name']} consumes {v['value']} of {c['counterSet']}/{k}, which has {have[k]}")
    return {"problems": problems, "generation": gen, "slices": len(current), "devices": ndev}


ROUTE = re.compile(
    r"^/apis/resource\.k8s\.io/v1/(?:namespaces/(?P<ns>[^/]+)/)?(?P<res>resourceslices|resourceclaims)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>status))?$")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def send_json(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else None

    def route(self):
        u = urlparse(self.path)
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        return u.path, q

    def do_GET(self):
        self.body()
        path, q = self.route()
        if path == "/standin/stats":
            with STORE.lock:
                return self.send_json(200, STORE.stats)
        m = re.match(r"^/standin/pool/([^/]+)/(.+)$", path)
        if m:
            return self.send_json(200, pool_check(m.group(1), m.group(2)))
        m = ROUTE.match(path)
        if not m:
            return self.send_json(*status(404, "NotFound", f"the server could not find the requested resource {path}"))
        kind = "ResourceSlice" if m["res"] == "resourceslices" else "ResourceClaim"
        if kind == "ResourceClaim" and not m["ns"] and m["name"]:
            return self.send_json(*status(404, "NotFound", "claims are namespaced"))
        if m["name"]:
            with STORE.lock:
                obj = STORE.objects.get((kind, m["ns"], m["name"]))
            if obj is None:
                return self.send_json(*status(404, "NotFound", f'{m["res"]}.{GROUP} "{m["name"]}" not found',
                                              {"name": m["name"], "group": GROUP, "kind": m["res"]}))
            return self.send_json(200, obj)
        try:
            labels = parse_selector(q.get("labelSelector"))
            fields = parse_selector(q.get("fieldSelector"))
            with STORE.lock:
                items = [copy.deepcopy(o) for (k, ns, _), o in sorted(STORE.objects.items(), key=lambda kv: (kv[0][1] or "", kv[0][2]))
                         if k == kind and (m["ns"] is None or ns == m["ns"]) and selector_match(o, labels, fields)]
                rv = str(STORE.rv)
        except ValueError as e:
            return self.send_json(*status(400, "BadRequest", str(e)))
        if q.get("watch") in ("true", "1"):
            return self.watch(kind, m["ns"], labels, fields, q)
        return self.send_json(200, {"apiVersion": API_VERSION, "kind": kind + "List",
                                    "metadata": {"resourceVersion": rv}, "items": items})

    def watch(self, kind, ns, labels, fields, q):
        since = int(q.get("resourceVersion") or 0)
        deadline = time.time() + min(int(q.get("timeoutSeconds") or 30), 60)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = since
        if since == 0:
            # From now: the objects as ADDED first, like the real one.
            with STORE.lock:
                initial = [copy.deepcopy(o) for (k, n, _), o in STORE.objects.items()
                           if k == kind and (ns is None or n == ns) and selector_match(o, labels, fields)]
                sent = STORE.rv
            for o in initial:
                self.chunk({"type": "ADDED", "object": o})
        try:
            while time.time() < deadline:
                with STORE.lock:
                    evs = [e for e in STORE.events if e[0] > sent and e[2] == kind]
                    if not evs:
                        STORE.lock.wait(timeout=max(0.0, min(1.0, deadline - time.time())))
                        continue
                for rv, typ, _, obj in evs:
                    sent = max(sent, rv)
                    if (ns is None or obj["metadata"].get("namespace") == ns) and selector_match(obj, labels, fields):
                        self.chunk({"type": typ, "object": obj})
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def chunk(self, event):
        data = (json.dumps(event) + "\n").encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_POST(self):
        path, q = self.route()
        if path == "/standin/conflict":
            b = self.body() or {}
            with STORE.lock:
                STORE.conflicts_planned[b["name"]] = int(b.get("times", 1))
            return self.send_json(200, {})
        m = ROUTE.match(path)
        if not m or m["name"]:
            return self.send_json(*status(405, "MethodNotAllowed", "POST a collection"))
        kind = "ResourceSlice" if m["res"] == "resourceslices" else "ResourceClaim"
        obj = self.body() or {}
        obj.setdefault("apiVersion", API_VERSION)
        obj.setdefault("kind", kind)
        meta = obj.setdefault("metadata", {})
        if kind == "ResourceClaim":
            if not m["ns"]:
                return self.send_json(*status(404, "NotFound", "claims are namespaced"))
            meta["namespace"] = m["ns"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        errs = validate(kind, obj)
        if kind == "ResourceSlice":
            errs += immutable_and_defaults(obj, None)
        if errs:
            return self.reject(kind, meta.get("name"), errs)
        with STORE.lock:
            key = (kind, m["ns"], meta["name"])
            if key in STORE.objects:
                return self.send_json(*status(409, "AlreadyExists", f'{m["res"]}.{GROUP} "{meta["name"]}" already exists',
                                              {"name": meta["name"], "group": GROUP, "kind": m["res"]}))
            meta["uid"] = str(uuid.uuid4())
            meta["resourceVersion"] = STORE.next_rv()
            meta["generation"] = 1
            meta["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            STORE.objects[key] = obj
            STORE.stats["writes"] += 1
            STORE.record("ADDED", kind, obj)
        return self.send_json(201, obj)

    def reject(self, kind, name, errs):
        with STORE.lock:
            STORE.stats["rejected"].append({"kind": kind, "name": name, "errors": errs})
        return self.send_json(*status(422, "Invalid", f'{kind}.{GROUP} "{name}" is invalid: ' + "; ".join(errs)))

    def do_PUT(self):
        path, _ = self.route()
        m = ROUTE.match(path)
        if not m or not m["name"]:
            return self.send_json(*status(405, "MethodNotAllowed", "PUT an object"))
        kind = "ResourceSlice" if m["res"] == "resourceslices" else "ResourceClaim"
        obj = self.body() or {}
        obj.setdefault("apiVersion", API_VERSION)
        obj.setdefault("kind", kind)
        meta = obj.setdefault("metadata", {})
        if meta.get("name") not in (None, m["name"]):
            return self.send_json(*status(400, "BadRequest", "the name of the object does not match the name on the URL"))
        meta["name"] = m["name"]
        if kind == "ResourceClaim":
            meta["namespace"] = m["ns"]
        with STORE.lock:
            key = (kind, m["ns"], m["name"])
            old = STORE.objects.get(key)
            if old is None:
                return self.send_json(*status(404, "NotFound", f'{m["res"]}.{GROUP} "{m["name"]}" not found',
                                              {"name": m["name"], "group": GROUP, "kind": m["res"]}))
            planned = STORE.conflicts_planned.get(m["name"], 0)
            if kind == "ResourceSlice" and planned > 0:
                # Another writer got there first.
                STORE.conflicts_planned[m["name"]] = planned - 1
                old["metadata"]["resourceVersion"] = STORE.next_rv()
                STORE.record("MODIFIED", kind, old)
            if meta.get("resourceVersion") and meta["resourceVersion"] != old["metadata"]["resourceVersion"]:
                STORE.stats["conflicts"] += 1
                return self.send_json(*status(
                    409, "Conflict",
                    f'Operation cannot be fulfilled on {m["res"]}.{GROUP} "{m["name"]}": the object has been modified; please apply your changes to the latest version and try again',
                    {"name": m["name"], "group": GROUP, "kind": m["res"]}))
            new = copy.deepcopy(obj)
            if m["sub"] == "status":
                new = copy.deepcopy(old)
                new["status"] = obj.get("status")
            elif kind == "ResourceClaim":
                new["status"] = old.get("status")
        errs = validate(kind, new)
        if kind == "ResourceSlice":
            errs += immutable_and_defaults(new, old)
        if errs:
            return self.reject(kind, m["name"], errs)
        with STORE.lock:
            cur = STORE.objects.get(key)
            if cur is None or cur["metadata"]["resourceVersion"] != old["metadata"]["resourceVersion"]:
                STORE.stats["conflicts"] += 1
                return self.send_json(*status(409, "Conflict", "the object has been modified"))
            for k in ("uid", "creationTimestamp"):
                new["metadata"][k] = old["metadata"][k]
            gen = old["metadata"].get("generation", 1)
            new["metadata"]["generation"] = gen + (1 if new.get("spec") != old.get("spec") else 0)
            new["metadata"]["resourceVersion"] = STORE.next_rv()
            STORE.objects[key] = new
            STORE.stats["writes"] += 1
            STORE.record("MODIFIED", kind, new)
        return self.send_json(200, new)

    def do_DELETE(self):
        self.body()  # DeleteOptions, if sent
        path, _ = self.route()
        m = ROUTE.match(path)
        if not m or not m["name"]:
            return self.send_json(*status(405, "MethodNotAllowed", "DELETE an object"))
        kind = "ResourceSlice" if m["res"] == "resourceslices" else "ResourceClaim"
        with STORE.lock:
            obj = STORE.objects.pop((kind, m["ns"], m["name"]), None)
            if obj is None:
                return self.send_json(*status(404, "NotFound", f'{m["res"]}.{GROUP} "{m["name"]}" not found',
                                              {"name": m["name"], "group": GROUP, "kind": m["res"]}))
            obj["metadata"]["resourceVersion"] = STORE.next_rv()
            STORE.stats["deleted"] += 1
            STORE.record("DELETED", kind, obj)
        return self.send_json(200, obj)


def immutable_and_defaults(new, old):
    """Fields that may not change, and what the server fills in (taints' timeAdded)."""
    errs = []
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for d in new.get("spec", {}).get("devices") or []:
        for t in d.get("taints") or []:
            t.setdefault("timeAdded", now)
    if old is not None:
        for path in (("driver",), ("nodeName",), ("pool", "name")):
            a, b = new.get("spec", {}), old.get("spec", {})
            for p in path:
                a, b = (a or {}).get(p), (b or {}).get(p)
            if a != b:
                errs.append(f"spec.{'.'.join(path)}: field is immutable")
    return errs


def validate_files(paths):
    """`--validate FILE...`: every document of the YAML files against the schema of
    its kind (any kind Kubernetes 1.36 has), and the stand-in's rules for slices and
    claims. Prints each problem; the exit status is 1 when there is one."""
    import yaml
    bad = 0
    for path in paths:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        for d in docs:
            kind = d.get("kind")
            name = (d.get("metadata") or {}).get("name")
            errs = []
            try:
                kubernetes_validate.validate(d, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                errs.append(f"schema: {'.'.join(str(p) for p in e.path)}: {e.message}")
            except Exception as e:
                errs.append(f"schema: {getattr(e, 'message', e)}")
            if kind == "ResourceSlice":
                errs += slice_rules(d)
            elif kind == "ResourceClaim":
                errs += claim_rules(d)
            for e in errs:
                print(f"{path}: {kind} {name}: {e}")
            bad += len(errs)
            if not errs:
                print(f"{path}: {kind} {name}: valid")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--validate", nargs="+", metavar="FILE")
    args = ap.parse_args()
    if args.validate:
        return validate_files(args.validate)
    srv = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    srv.daemon_threads = True
    print(f"LISTENING {srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
