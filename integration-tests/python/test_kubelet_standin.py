"""A kubelet stand-in that is not tonic: Python grpcio (grpc-core) speaking kubelet's
own protos (deviceplugin v1beta1, podresources v1, compiled from proto/k8s/ by
grpcio-tools) to tesserad's device plugin over unix sockets.

grpc-core sends the socket path as the HTTP/2 :authority (as grpc-go in kubelet
does with a raw path); the plugin's endpoints must accept it.

Run by integration-tests/tests/python_kubelet.rs, which starts tesserad with the
device plugin on (mix: mig-1g.10gb = 2, gpu = 1) and sets:
  KUBELET_DIR   a temp dir: device-plugins/ (kubelet.sock goes there) and
                pod-resources/kubelet.sock
  PYTHONPATH    the generated stubs (k8s/deviceplugin/v1beta1/api_pb2*.py, ...)
"""

import os
import queue
import threading
import time
from concurrent import futures

import grpc

from k8s.deviceplugin.v1beta1 import api_pb2 as dp
from k8s.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from k8s.podresources.v1 import api_pb2 as pr
from k8s.podresources.v1 import api_pb2_grpc as pr_grpc

DIR = os.environ["KUBELET_DIR"]
PLUGINS = os.path.join(DIR, "device-plugins")
KUBELET_SOCK = os.path.join(PLUGINS, "kubelet.sock")
POD_RESOURCES = os.path.join(DIR, "pod-resources", "kubelet.sock")
MIG = "tessera.io/mig-1g.10gb"
WHOLE = "tessera.io/gpu"
TIMEOUT = 30


class Registration(dp_grpc.RegistrationServicer):
    def __init__(self):
        self.requests = queue.Queue()

    def Register(self, request, context):
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "version")
        # kubelet dials the endpoint at once.
        with grpc.insecure_channel("unix:" + os.path.join(PLUGINS, request.endpoint)) as ch:
            dp_grpc.DevicePluginStub(ch).GetDevicePluginOptions(dp.Empty(), timeout=TIMEOUT)
        self.requests.put(request)
        return dp.Empty()


class Lister(pr_grpc.PodResourcesListerServicer):
    def __init__(self):
        self.lock = threading.Lock()
        self.pods = []

    def List(self, request, context):
        with self.lock:
            return pr.ListPodResourcesResponse(pod_resources=list(self.pods))

    def set(self, pods):
        with self.lock:
            self.pods = pods


def serve(path, add):
    if os.path.exists(path):
        os.unlink(path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add(server)
    server.add_insecure_port("unix:" + path)
    server.start()
    return server


def registered(reg, want):
    """Wait until every resource in `want` has registered; their endpoints."""
    got = {}
    deadline = time.time() + TIMEOUT
    while set(got) != set(want):
        r = reg.requests.get(timeout=max(0.1, deadline - time.time()))
        got[r.resource_name] = r.endpoint
        assert r.options.get_preferred_allocation_available
    return got


def plugin(endpoint):
    ch = grpc.insecure_channel("unix:" + os.path.join(PLUGINS, endpoint))
    return ch, dp_grpc.DevicePluginStub(ch)


def until(stream, pred):
    deadline = time.time() + TIMEOUT
    for msg in stream:
        if pred(list(msg.devices)):
            return list(msg.devices)
        assert time.time() < deadline, "ListAndWatch: no such list"
    raise AssertionError("ListAndWatch ended")


def healthy(n):
    return lambda devs: len(devs) == n and all(d.health == "Healthy" for d in devs)


def pod(ns, name, resource, ids):
    return pr.PodResources(
        name=name,
        namespace=ns,
        containers=[
            pr.ContainerResources(
                name="main",
                devices=[pr.ContainerDevices(resource_name=resource, device_ids=ids)],
            )
        ],
    )


def test_register_list_allocate_follow_pods_and_reregister():
    reg = Registration()
    lister = Lister()
    pr_server = serve(POD_RESOURCES, lambda s: pr_grpc.add_PodResourcesListerServicer_to_server(lister, s))
    reg_server = serve(KUBELET_SOCK, lambda s: dp_grpc.add_RegistrationServicer_to_server(reg, s))
    endpoints = registered(reg, {MIG, WHOLE})

    # ListAndWatch and Allocate of every advertised device at once.
    ch, stub = plugin(endpoints[MIG])
    stream = stub.ListAndWatch(dp.Empty())
    devs = until(stream, healthy(2))
    ids = [d.ID for d in devs]
    resp = stub.Allocate(
        dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=[i]) for i in ids]),
        timeout=TIMEOUT,
    )
    tokens = [c.annotations["tessera.io/lease-token"] for c in resp.container_responses]
    assert len(set(tokens)) == 2
    assert [c.envs["TESSERA_LEASE_ID"] for c in resp.container_responses] == ids
    assert [c.cdi_devices[0].name for c in resp.container_responses] == ["tessera.io/lease=" + i for i in ids]
    again = stub.Allocate(
        dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=[ids[0]])]),
        timeout=TIMEOUT,
    )
    assert again.container_responses[0].annotations["tessera.io/lease-token"] == tokens[0]
    wch, wstub = plugin(endpoints[WHOLE])
    whole = until(wstub.ListAndWatch(dp.Empty()), healthy(1))
    wstub.Allocate(
        dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=[whole[0].ID])]),
        timeout=TIMEOUT,
    )

    # Leases follow pods: ids[0] stays held; ids[1] was never in a pod and goes
    # after the grace, replaced by a fresh reservation.
    lister.set([pod("team-a", "trainer", MIG, [ids[0]])])
    devs = until(stream, lambda d: healthy(2)(d) and ids[1] not in [x.ID for x in d])
    assert ids[0] in [d.ID for d in devs]
    # The pod is gone: its device goes too.
    lister.set([])
    until(stream, lambda d: healthy(2)(d) and ids[0] not in [x.ID for x in d])
    ch.close()
    wch.close()

    # kubelet restarts: it deletes every file of the directory but its checkpoint and
    # serves a new kubelet.sock; the plugin registers again.
    reg_server.stop(0).wait()
    for name in os.listdir(PLUGINS):
        if name != "kubelet_internal_checkpoint":
            os.unlink(os.path.join(PLUGINS, name))
    reg2 = Registration()
    reg_server = serve(KUBELET_SOCK, lambda s: dp_grpc.add_RegistrationServicer_to_server(reg2, s))
    endpoints = registered(reg2, {MIG, WHOLE})
    ch, stub = plugin(endpoints[MIG])
    until(stub.ListAndWatch(dp.Empty()), healthy(2))
    ch.close()
    reg_server.stop(0)
    pr_server.stop(0)
