"""Interactive admission: how the gateway admits one chat or completions request against the
interactive pool, behind the engine protocol (``backfill.engine``).

- ``request``: the request's shape as read from its body, before anything is counted.
- ``sizing``: the cheap bound, the exact sizing and the per-request caps (pure).
- ``placement``: nodes ranked by load and the admission loop that reserves on one of them.
- ``refusals``: the gateway's refusals, which the API maps to statuses.
- ``nodes``: the directory of serving nodes and their context lengths.
- ``leases``: keeping an admitted lease alive while its request runs, and giving it back once.
- ``signals``: publishing this process' interactive activity for the workers' work budgets.
- ``admission``: the whole path from a request body to a lease on a node, bound or exact.

The HTTP route, the SSE relay and the metrics are the API's (``queue_api/gateway.py``).

The invariant applied to one interactive request, in this order:

1. **Cheap bound, before tokenizing.** A token covers at most ``max_bytes_per_token`` bytes
   of text, so ``ceil(prompt_bytes / max_bytes_per_token)`` is a lower bound on the prompt's
   tokens (the chat template only adds). Over the class limit even at that bound: refuse at
   once. Anything that might fit goes on to be counted.
2. **Exact count**, with the engine's own tokenizer: ``prompt + max_output`` over the limit is
   refused before any reservation or engine work.
3. **Reserve** ``prompt + max_output`` (block-rounded, per sequence) from the interactive pool,
   letting the ledger preempt batch leases when the node is short. No room on any node: wait
   within the caller's budget, polling, then refuse with a retry hint.

One request's reach is capped (:class:`RequestCaps`): its sequences (``n`` x prompts), the
tokens it reserves over all of them, checked with the limits above (on the bound, then
exactly), and how long it may wait. Without the caps a single request with a large
``n x max_tokens`` preempts every batch lease on a node, and one that waits for long holds
batch back all that while (a waiting request is pressure on the work budget).

A request without ``max_tokens`` may generate up to the model's context: its worst case is
``limit - prompt``, and the gateway sends that figure as ``max_tokens`` so the engine cannot
outgrow the reservation. (``/v1/completions`` defaults to 16, as vLLM and OpenAI do.)
"""
