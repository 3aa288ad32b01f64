"""Interactive admission: how the gateway admits one chat or completions request against the
interactive pool, behind the engine protocol (``backfill.engine``).

- ``decisions``: the request's shape, the cheap bound and the exact sizing, the per-request
  caps, node ranking and the admission loop over the ledger (values and pure functions).
- ``nodes``: the directory of serving nodes and their context lengths.
- ``leases``: keeping an admitted lease alive while its request runs, and giving it back once.
- ``signals``: publishing this process' interactive activity for the workers' work budgets.
- ``admission``: the whole path from a request body to a lease on a node, bound or exact.

The HTTP route, the SSE relay and the metrics are the API's (``queue_api/gateway.py``).
"""
