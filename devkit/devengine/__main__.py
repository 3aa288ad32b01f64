"""``python -m devkit.devengine``: :mod:`devkit.devengine.cli`."""

from devkit.devengine.cli import main

raise SystemExit(main())
