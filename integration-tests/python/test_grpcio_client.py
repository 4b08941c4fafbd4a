"""An off-the-shelf gRPC client (Python grpcio, built on grpc-core) talks to tesserad
over its unix socket with DEFAULT channel options.

grpc-core sends the percent-encoded socket path as the HTTP/2 :authority; tesserad
must accept it (before the fix every call failed with INTERNAL "Stream removed").

Run by integration-tests/tests/python_client.rs, which starts a daemon, generates the
stubs from proto/ with grpcio-tools and sets:
  TESSERA_SOCKET  the daemon's socket (absolute path)
  PYTHONPATH      the generated stubs (tessera/v1/tessera_pb2*.py)
It also runs docs/examples/python/tessera_client.py, so the example stays true.
"""

import os
import queue
import subprocess
import sys
import threading
import uuid

import grpc
import pytest

from tessera.v1 import tessera_pb2 as pb
from tessera.v1 import tessera_pb2_grpc as rpc

SOCKET = os.environ["TESSERA_SOCKET"]
TIMEOUT = 10


# Both spellings grpc documents for a unix socket: unix:PATH and unix://ABS_PATH.
@pytest.fixture(params=["unix:" + SOCKET, "unix://" + SOCKET], ids=["unix:", "unix://"])
def stub(request):
    # No options: the defaults a user gets.
    with grpc.insecure_channel(request.param) as channel:
        yield rpc.TesseraStub(channel)


def mig(profile):
    return pb.Shape(mig=pb.MigShape(profile=profile))


def test_unary_calls(stub):
    node = stub.GetNode(pb.GetNodeRequest(), timeout=TIMEOUT)
    assert len(node.gpus) == 3, node

    tenant = "py-" + uuid.uuid4().hex[:8]
    created = stub.CreateLease(
        pb.CreateLeaseRequest(tenant=tenant, shape=mig("1g.10gb"), labels={"client": "grpcio"}),
        timeout=TIMEOUT,
    )
    lease = created.lease
    assert lease.id.startswith("l-"), lease
    assert lease.state == pb.LEASE_STATE_ACTIVE
    assert lease.partition.mig.profile == "1g.10gb"
    assert created.token.startswith("tsr1_")

    got = stub.GetLease(pb.GetLeaseRequest(lease_id=lease.id), timeout=TIMEOUT).lease
    assert got.tenant == tenant
    assert dict(got.labels) == {"client": "grpcio"}

    released = stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.id), timeout=TIMEOUT)
    assert released.lease.state == pb.LEASE_STATE_RELEASED


def test_server_streaming_watch(stub):
    tenant = "py-" + uuid.uuid4().hex[:8]
    call = stub.WatchLeases(pb.WatchLeasesRequest(tenant=tenant), timeout=TIMEOUT)
    # Response headers come once the daemon has subscribed: nothing after is missed.
    call.initial_metadata()
    events = queue.Queue()

    def read():
        try:
            for ev in call:
                events.put(ev)
        except grpc.RpcError as e:
            events.put(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    lease = stub.CreateLease(
        pb.CreateLeaseRequest(tenant=tenant, shape=pb.Shape(mps=pb.MpsShape(sm_percent=10, memory_bytes=1 << 30))),
        timeout=TIMEOUT,
    ).lease
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.id, reason="done"), timeout=TIMEOUT)

    kinds = []
    while pb.LEASE_EVENT_KIND_RELEASED not in kinds:
        ev = events.get(timeout=TIMEOUT)
        assert not isinstance(ev, grpc.RpcError), ev
        assert ev.lease.tenant == tenant, "the tenant filter holds"
        assert ev.lease.id == lease.id
        kinds.append(ev.kind)
    assert kinds[0] == pb.LEASE_EVENT_KIND_CREATED, kinds

    call.cancel()
    reader.join(TIMEOUT)
    assert not reader.is_alive()


def test_errors_carry_code_and_decoded_details(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.GetLease(pb.GetLeaseRequest(lease_id="l-does-not-exist"), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details() == 'no lease "l-does-not-exist"'

    # A non-ASCII message travels percent-encoded in grpc-message and decodes back.
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateLease(pb.CreateLeaseRequest(tenant="équipe", shape=mig("1g.10gb")), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith('invalid tenant: "équipe"'), err.value.details()

    with pytest.raises(grpc.RpcError) as err:
        stub.CreateLease(pb.CreateLeaseRequest(tenant="py", shape=mig("9g.999gb")), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "9g.999gb" in err.value.details()
    assert "1g.10gb" in err.value.details(), "names the profiles the node offers"


def test_a_request_over_the_size_limit_is_resource_exhausted(stub):
    # gRPC's status code table: "server max receive message size exceeded" is
    # RESOURCE_EXHAUSTED, as a grpc-core server answers; the channel stays usable.
    with pytest.raises(grpc.RpcError) as err:
        stub.GetLease(pb.GetLeaseRequest(lease_id="l-" + "a" * (2 << 20)), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    assert "too large" in err.value.details(), err.value.details()
    assert len(stub.GetNode(pb.GetNodeRequest(), timeout=TIMEOUT).gpus) == 3


def test_many_calls_on_one_connection(stub):
    # grpc-core indexes :authority in its HPACK table after the first request and
    # refers to it afterwards: later requests must decode as well as the first.
    for _ in range(50):
        assert len(stub.GetNode(pb.GetNodeRequest(), timeout=TIMEOUT).gpus) == 3


def test_the_docs_example_runs():
    example = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "examples", "python", "tessera_client.py")
    tenant = "py-" + uuid.uuid4().hex[:8]
    out = subprocess.run(
        [sys.executable, example, "--socket", SOCKET, "--tenant", tenant],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gpu 2: NVIDIA A100-SXM4-40GB" in out.stdout, out.stdout
    assert "event: CREATED l-" in out.stdout, out.stdout
    assert "event: RELEASED l-" in out.stdout, out.stdout
