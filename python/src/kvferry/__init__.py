"""kvferry's Python side: block keys (`keys`), an engine SDK (`sdk`, `nixl_pool`), a router
client (`router`) and, with the `vllm` extra, vLLM's `KvferryConnector` (`kvferry.vllm`).

Nothing here imports vLLM or torch; `kvferry.vllm` does, when it is imported.
"""

from kvferry.keys import block_hashes, fingerprint_digest

__all__ = ["block_hashes", "fingerprint_digest"]
__version__ = "0.1.0"
