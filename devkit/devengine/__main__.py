"""``python -m worker.devengine``: :mod:`worker.devengine.cli`."""

from worker.devengine.cli import main

raise SystemExit(main())
