"""Generated gRPC stubs for kvferry.v1 (python/scripts/gen_protos.py)."""
