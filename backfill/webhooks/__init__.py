"""Webhooks: a tenant's endpoints hear when its batches end, as OpenAI's webhooks say it.

- ``events``: the event types and the bytes of an event (pure).
- ``signing``: secrets and Standard Webhooks signatures as OpenAI makes them (pure).
- ``sealing``: signing secrets encrypted at rest under the deployment's keys.
- ``targets``: which URLs and addresses a delivery may go to.
- ``outbox``: events, their deliveries and the queue senders claim them from (written in
  the transaction that ends the batch, so an event exists exactly when the end committed).
- ``store``: a tenant's endpoints, their signing secrets and the delivery log.
- ``retry``: when a failed delivery is tried again, and when it is given up (pure).
- ``delivery``: the sender, a thin loop that carries those plans out.
"""
