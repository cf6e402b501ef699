"""KV connectors: moving a request's KV cache between engine instances (disaggregated prefill/decode).

The seam is shaped like vLLM's KVConnector v1 (``base.py``): a scheduler side, pure Python, that the scheduler asks
how many prompt tokens an outside source supplies, tells about allocated blocks and finished requests, and that
builds per-step metadata; and a worker side, next to the KV tensors, that starts loads and reports finished
transfers. ``NixlConnector`` (nixl_scheduler.py, nixl_worker.py) is the one connector: NIXL reads over UCX, with
the handshake and block layout over ZeroMQ + msgspec (side_channel.py). The scheduler side never imports torch.
"""
