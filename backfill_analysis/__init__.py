"""Analysis tools over the core's rules, no services: the trace-driven simulator
(``simulate``), capacity planning (``planner``, ``presets``), and the capacity lab
(``lab``, behind the API's ``/lab/kv`` and the dashboard's Capacity lab page).

They import the core (its admission policy and work budget run unchanged in the simulator)
and nothing above it; the API may import them. matplotlib (the ``analysis`` extra) loads only
when a plot is drawn.
"""
