"""A grpcio client with DEFAULT channel options (4 MiB receive limit) lists every lease
of a daemon holding 20,000 of them, page by page, and the daemon refuses page tokens
it did not issue, tokens for another listing, and negative page sizes.

Run by integration-tests/tests/paging.rs, which fills the daemon and sets:
  TESSERA_SOCKET   the daemon's socket (absolute path)
  TESSERA_CREATED  a file with the id of every live lease, one a line
  PYTHONPATH       the generated stubs (tessera/v1/tessera_pb2*.py)
"""

import os

import grpc
import pytest

from tessera.v1 import tessera_pb2 as pb
from tessera.v1 import tessera_pb2_grpc as rpc

SOCKET = os.environ["TESSERA_SOCKET"]
TIMEOUT = 60
FOUR_MIB = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def stub():
    # No options: the defaults a user gets.
    with grpc.insecure_channel("unix:" + SOCKET) as channel:
        yield rpc.TesseraStub(channel)


@pytest.fixture(scope="module")
def created():
    with open(os.environ["TESSERA_CREATED"]) as f:
        return set(f.read().split())


def test_every_lease_is_listed_once_in_pages_under_the_default_limit(stub, created):
    ids = []
    token = ""
    revision = None
    pages = 0
    while True:
        resp = stub.ListLeases(pb.ListLeasesRequest(page_token=token), timeout=TIMEOUT)
        pages += 1
        assert resp.ByteSize() < FOUR_MIB
        assert len(resp.leases) <= 500, "the default page size"
        if revision is None:
            revision = resp.revision
        assert resp.revision == revision
        ids.extend(lease.id for lease in resp.leases)
        if not resp.next_page_token:
            break
        token = resp.next_page_token
    assert len(ids) == len(created), (len(ids), len(created))
    assert set(ids) == created
    assert pages >= len(created) // 500


def test_the_largest_page_is_clamped_and_fits(stub, created):
    resp = stub.ListLeases(pb.ListLeasesRequest(page_size=100000), timeout=TIMEOUT)
    assert len(resp.leases) == 1000, "page_size above the maximum is the maximum"
    assert resp.next_page_token


def test_negative_page_sizes_are_refused(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.ListLeases(pb.ListLeasesRequest(page_size=-1), timeout=TIMEOUT)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_size" in e.value.details()


def test_forged_and_foreign_page_tokens_are_refused(stub):
    first = stub.ListLeases(pb.ListLeasesRequest(page_size=10), timeout=TIMEOUT)
    token = first.next_page_token
    assert token
    # One character changed.
    forged = token[:-1] + ("0" if token[-1] != "0" else "1")
    for bad in [forged, "not-a-token", token + "00"]:
        with pytest.raises(grpc.RpcError) as e:
            stub.ListLeases(pb.ListLeasesRequest(page_size=10, page_token=bad), timeout=TIMEOUT)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "list again" in e.value.details()
    # The token of one listing does not continue another.
    with pytest.raises(grpc.RpcError) as e:
        stub.ListLeases(
            pb.ListLeasesRequest(page_size=10, page_token=token, include_ended=True),
            timeout=TIMEOUT,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "another tenant, state or include_ended" in e.value.details()
    # The genuine token continues where the first page stopped.
    second = stub.ListLeases(pb.ListLeasesRequest(page_size=10, page_token=token), timeout=TIMEOUT)
    assert not {lease.id for lease in first.leases} & {lease.id for lease in second.leases}


def test_a_watch_from_the_listings_revision_starts_there(stub):
    resp = stub.ListLeases(pb.ListLeasesRequest(page_size=1), timeout=TIMEOUT)
    watch = stub.WatchLeases(
        pb.WatchLeasesRequest(since_revision=resp.revision, bookmarks=True), timeout=TIMEOUT
    )
    # Nothing changed since the listing: the first message is a bookmark at its
    # revision (sent every api.watch_bookmark_interval).
    ev = next(watch)
    assert ev.kind == pb.LEASE_EVENT_KIND_BOOKMARK
    assert ev.revision == resp.revision
    watch.cancel()
    with pytest.raises(grpc.RpcError) as e:
        next(stub.WatchLeases(pb.WatchLeasesRequest(since_revision=resp.revision + 10**6)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
