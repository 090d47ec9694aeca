#!/usr/bin/env python3
"""An independent router client: generates Python gRPC stubs from proto/ with grpcio-tools (no
Rust code involved), calls PlanMigration and MigrateSession on a kvferry daemon, and prints one
JSON line with what it saw. Used by crates/cli/tests/e2e.rs.

usage: router_client.py <proto_root> <host:port> <session> <tenant> <source_region> <comma-separated tokens>
"""
import json
import os
import sys
import tempfile

import grpc
from grpc_tools import protoc


def main() -> int:
    proto_root, addr, session, tenant, source, tokens = sys.argv[1:7]
    out = tempfile.mkdtemp(prefix="kvferry-py-")
    rc = protoc.main(["protoc", f"-I{proto_root}", f"--python_out={out}", f"--grpc_python_out={out}",
                      os.path.join(proto_root, "kvferry/v1/kvferry.proto")])
    if rc != 0:
        print(json.dumps({"error": f"protoc failed: {rc}"}))
        return 1
    sys.path.insert(0, out)
    from kvferry.v1 import kvferry_pb2 as pb, kvferry_pb2_grpc as rpc  # noqa: E402

    stub = rpc.MigrationStub(grpc.insecure_channel(addr))
    req = pb.MigrateSessionRequest(session_id=session, tenant=tenant, source_region=source,
                                   token_ids=[int(t) for t in tokens.split(",")], deadline_ms=30000,
                                   policy=pb.Policy(mode=pb.POLICY_MODE_AUTO))
    plan = stub.PlanMigration(req, timeout=30)
    seen = {"plan_action": plan.action, "plan_reason": plan.reason, "events": []}
    for ev in stub.MigrateSession(req, timeout=60):
        kind = ev.WhichOneof("event")
        seen["events"].append(kind)
        if kind == "receipt":
            seen["receipt_action"] = ev.receipt.action
            seen["tokens_ready"] = ev.receipt.tokens_ready
    try:
        stub.PlanMigration(pb.MigrateSessionRequest(session_id=session, tenant=tenant), timeout=10)
        seen["bad_request_code"] = "OK"
    except grpc.RpcError as e:
        seen["bad_request_code"] = e.code().name
        seen["bad_request_detail"] = e.details()
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
