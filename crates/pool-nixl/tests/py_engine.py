"""Engine-side NIXL exporter on NIXL's own Python API (what vLLM's NixlConnector uses).

Same command line and output as the `kvferry-nixl-engine` binary:
    py_engine.py --name AGENT [--region PATH:LEN]...
maps each file shared, registers all regions with one `register_memory` call, prints
`KVFERRY-NIXL-DESCRIPTOR <json>` and serves until stdin closes or says "quit".
"""

import argparse
import ctypes
import json
import mmap
import os
import sys

try:
    from nixl_cu12 import nixl_agent, nixl_agent_config  # PyPI nixl-cu12
except ImportError:  # pragma: no cover - other NIXL wheels name the module `nixl`
    from nixl._api import nixl_agent, nixl_agent_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--region", action="append", default=[])
    args = ap.parse_args()

    maps, regions = [], []
    for spec in args.region:
        path, n = spec.rsplit(":", 1)
        n = int(n)
        fd = os.open(path, os.O_RDWR)
        m = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        maps.append(m)
        regions.append((addr, n))

    agent = nixl_agent(args.name, nixl_agent_config(backends=["UCX"]))
    reg = agent.register_memory([(addr, n, 0, "") for addr, n in regions], "DRAM")
    desc = {
        "agent_name": args.name,
        "agent_metadata": agent.get_agent_metadata().hex(),
        "regions": [{"addr": a, "len": n, "mem_type": "dram", "dev": 0} for a, n in regions],
    }
    print("KVFERRY-NIXL-DESCRIPTOR " + json.dumps(desc), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    agent.deregister_memory(reg)


if __name__ == "__main__":
    main()
