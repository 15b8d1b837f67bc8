"""Pure-torch model code: the target decoder, MTP modules, KV cache, checkpoint loading.

Nothing here knows about serving (no gRPC, Ray, metrics or scheduling).
"""
