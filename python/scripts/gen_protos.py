#!/usr/bin/env python3
"""Generates kvferry's gRPC stubs (Engine, Migration, ReferenceEngine) from proto/ into
python/src/kvferry/v1/ with grpcio-tools (no system protoc).

    python python/scripts/gen_protos.py            # regenerate in place
    python python/scripts/gen_protos.py --out DIR  # generate elsewhere (the staleness test)
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
PROTO_ROOT = REPO / "proto"
PROTO = PROTO_ROOT / "kvferry" / "v1" / "kvferry.proto"
DEFAULT_OUT = HERE.parent / "src"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Writes kvferry/v1/kvferry_pb2{,_grpc}.py(i) under out_root; returns the files."""
    from grpc_tools import protoc  # dev dependency

    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("gen_protos: grpc_tools.protoc failed")
    v1 = out_root / "kvferry" / "v1"
    files = sorted(v1.glob("kvferry_pb2*"))
    for f in files:
        # Strip the generator's version banner lines so the committed files only change when
        # the proto does (the staleness test compares the rest byte for byte).
        text = f.read_text()
        text = re.sub(r"^# Protobuf Python Version: .*\n", "", text, flags=re.M)
        f.write_text(text)
    (v1 / "__init__.py").write_text(
        '"""Generated gRPC stubs for kvferry.v1 (python/scripts/gen_protos.py)."""\n'
    )
    return files + [v1 / "__init__.py"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    a = ap.parse_args()
    for f in generate(a.out):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
