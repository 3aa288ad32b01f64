"""The API under load, each beside the building block or a second tenant: accepting a batch
(``bench.submit``), status reads (``bench.status``), one tenant's flood beside another's calls
(``bench.isolation``), what an anonymous caller can cost (``bench.anonymous``), webhook
deliveries beside dripping endpoints (``bench.webhooks``)."""
