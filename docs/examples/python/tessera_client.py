#!/usr/bin/env python3
"""A tesserad client in Python with grpcio: list, lease, watch from a revision, release.

It lists the GPUs and the tenant's leases (in pages), leases an MPS share, watches its
events from the listing's revision, and releases it.

Stubs come from the proto with grpcio-tools (`make python` does this and prints the
command line to run this file):

    python -m venv venv && venv/bin/pip install grpcio grpcio-tools
    venv/bin/python -m grpc_tools.protoc -Iproto --python_out=gen --grpc_python_out=gen \\
        tessera/v1/tessera.proto
    PYTHONPATH=gen venv/bin/python docs/examples/python/tessera_client.py --socket run/tesserad.sock

The caller needs access to the socket: root, the daemon's user, or a uid/gid that an
[[auth.principals]] rule maps to a role (a tenant principal may lease only for its own
tenant). Default channel options work: no grpc.default_authority is needed.
"""

import argparse
import os
import threading

import grpc

from tessera.v1 import tessera_pb2 as pb
from tessera.v1 import tessera_pb2_grpc as rpc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--socket",
        default=os.environ.get("TESSERA_SOCKET", "/run/tessera/tesserad.sock"),
        help="tesserad's API socket (default: $TESSERA_SOCKET or /run/tessera/tesserad.sock)",
    )
    ap.add_argument("--tenant", default="team-a")
    args = ap.parse_args()

    # "unix:" + an absolute or relative path; "unix:///abs/path" works too.
    with grpc.insecure_channel("unix:" + args.socket) as channel:
        stub = rpc.TesseraStub(channel)

        node = stub.GetNode(pb.GetNodeRequest(), timeout=10)
        for gpu in node.gpus:
            print(f"gpu {gpu.index}: {gpu.name} {gpu.uuid}")

        # The tenant's leases, page by page (at most 500 a page by default), then
        # its events from the revision the listing reflects: no change between the
        # listing and the watch is missed, however long either takes.
        leases, token = [], ""
        while True:
            page = stub.ListLeases(pb.ListLeasesRequest(tenant=args.tenant, page_token=token), timeout=10)
            leases.extend(page.leases)
            revision = page.revision  # every page of one listing answers the same
            token = page.next_page_token
            if not token:
                break
        print(f"{len(leases)} leases of {args.tenant} at revision {revision}")

        # Watch on a second thread while we lease and release.
        watch = stub.WatchLeases(pb.WatchLeasesRequest(tenant=args.tenant, since_revision=revision))

        released = threading.Event()

        def show_events():
            try:
                for ev in watch:
                    kind = pb.LeaseEventKind.Name(ev.kind).removeprefix("LEASE_EVENT_KIND_")
                    print(f"event: {kind} {ev.lease.id} {ev.message}".rstrip())
                    if ev.kind == pb.LEASE_EVENT_KIND_RELEASED:
                        released.set()
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    print(f"watch ended: {e.code().name}: {e.details()}")

        watcher = threading.Thread(target=show_events)
        watcher.start()

        try:
            created = stub.CreateLease(
                pb.CreateLeaseRequest(
                    tenant=args.tenant,
                    shape=pb.Shape(mps=pb.MpsShape(sm_percent=25, memory_bytes=8 << 30)),
                    ttl_seconds=600,
                    labels={"example": "python"},
                ),
                timeout=30,
            )
        except grpc.RpcError as e:
            # The daemon's refusal: a status code and a message meant for people.
            print(f"refused: {e.code().name}: {e.details()}")
            watch.cancel()
            watcher.join()
            return 1
        lease = created.lease
        print(f"lease {lease.id} on gpu {lease.partition.gpu_index}; token {created.token[:12]}...")

        stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.id, reason="example done"), timeout=30)
        released.wait(timeout=10)
        watch.cancel()
        watcher.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
