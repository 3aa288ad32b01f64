"""The inference engine as Backfill sees it: the :class:`~backfill.engine.protocol.Engine`
protocol, its failures and stream values (``protocol``), and the vLLM HTTP client both the
worker and the interactive gateway use (``http``). No vLLM code is imported here.
"""
