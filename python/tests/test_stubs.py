"""The committed gRPC stubs are what gen_protos.py makes from proto/ today."""

import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE.parent / "scripts" / "gen_protos.py"
COMMITTED = HERE.parent / "src" / "kvferry" / "v1"


def test_committed_stubs_are_fresh(tmp_path):
    # In a child process: grpc_tools' bundled protoc must not share a process with NIXL's
    # libraries (loaded by other tests), which crashes it.
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)], check=True, capture_output=True, text=True
    ).stdout
    files = [pathlib.Path(line) for line in out.split()]
    assert files
    for f in files:
        committed = COMMITTED / f.name
        assert committed.exists(), f"{f.name} is not committed; run python/scripts/gen_protos.py"
        assert committed.read_text() == f.read_text(), (
            f"{f.name} is stale: run `python python/scripts/gen_protos.py` and commit the result"
        )


def test_stubs_import_and_know_the_engine_api():
    from kvferry.v1 import kvferry_pb2 as pb
    from kvferry.v1 import kvferry_pb2_grpc as rpc

    assert hasattr(rpc, "EngineStub") and hasattr(rpc, "MigrationStub")
    r = pb.PublishRequest(lease_id="x", removed_block_ids=[3], epoch=2)
    assert pb.PublishRequest.FromString(r.SerializeToString()) == r
