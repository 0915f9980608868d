"""``python -m fastmm``: see :mod:`fastmm.cli`."""
from .cli import main

raise SystemExit(main())
