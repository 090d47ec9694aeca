"""The committed gRPC stubs are what gen_protos.py makes from proto/ today."""

import importlib.util
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE.parent / "scripts" / "gen_protos.py"
COMMITTED = HERE.parent / "src" / "kvferry" / "v1"


def test_committed_stubs_are_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = mod
    spec.loader.exec_module(mod)
    files = mod.generate(tmp_path)
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
