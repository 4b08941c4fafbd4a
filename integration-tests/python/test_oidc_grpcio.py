"""An off-the-shelf gRPC client (Python grpcio) signs in to tesserad's TLS listener
with an OIDC bearer token, the way grpc documents it: access-token call credentials
composed with the channel's TLS credentials (`authorization: Bearer <token>`).

Run by integration-tests/tests/oidc.rs, which starts an identity provider and a
daemon, generates the stubs from proto/ and sets:
  TESSERA_TLS_TARGET  the listener, localhost:PORT
  TESSERA_CA_FILE     the CA that signed the listener's certificate
  TESSERA_TOKEN       a valid token of a team-a member
  TESSERA_EXPIRED     the same member's expired token
  PYTHONPATH          the generated stubs (tessera/v1/tessera_pb2*.py)
"""

import os

import grpc
import pytest

from tessera.v1 import tessera_pb2 as pb
from tessera.v1 import tessera_pb2_grpc as rpc

TARGET = os.environ["TESSERA_TLS_TARGET"]
TIMEOUT = 10


def stub_with(token):
    with open(os.environ["TESSERA_CA_FILE"], "rb") as f:
        tls = grpc.ssl_channel_credentials(root_certificates=f.read())
    creds = grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(TARGET, creds)


def test_a_token_creates_lists_and_releases_its_tenants_lease():
    with stub_with(os.environ["TESSERA_TOKEN"]) as channel:
        stub = rpc.TesseraStub(channel)
        lease = stub.CreateLease(
            pb.CreateLeaseRequest(shape=pb.Shape(mig=pb.MigShape(profile="1g.10gb"))),
            timeout=TIMEOUT,
        ).lease
        assert lease.tenant == "team-a"
        listed = stub.ListLeases(pb.ListLeasesRequest(), timeout=TIMEOUT).leases
        assert [l.id for l in listed] == [lease.id]
        stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.id), timeout=TIMEOUT)


def test_an_expired_token_is_unauthenticated_and_says_so():
    with stub_with(os.environ["TESSERA_EXPIRED"]) as channel:
        with pytest.raises(grpc.RpcError) as e:
            rpc.TesseraStub(channel).ListLeases(pb.ListLeasesRequest(), timeout=TIMEOUT)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "expired" in e.value.details()
