"""The latency the interactive gateway adds, beside nginx as a plain reverse proxy, to the same vLLM
server (``python -m bench.gateway``)."""
