"""kvferry's vLLM integration: `KvferryConnector`, an out-of-tree `KVConnectorBase_V1`.

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"daemon_socket": "/run/kvferry/engine.sock",
                                                         "engine_id": "vllm-0", "model_id": "...",
                                                         "server_url": "http://127.0.0.1:8000"}}'

Importing this module imports vLLM and torch (the `vllm` extra).
"""

from kvferry.vllm.connector import KvferryConnector, KvferryConnectorMetadata
from kvferry.vllm.layout import PoolGeometry, UnsupportedConfig, geometry_of

__all__ = ["KvferryConnector", "KvferryConnectorMetadata", "PoolGeometry", "UnsupportedConfig", "geometry_of"]
