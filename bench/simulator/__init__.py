"""The simulator: its speed (``python -m bench.simulate``), its cost model fitted to a real vLLM
engine (``python -m bench.calibrate_simulator``) and to a GPU's step times (``python -m
bench.gpu_step_times`` where a GPU is lent, ``python -m bench.gpu_steps``)."""
