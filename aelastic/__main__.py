"""``python -m aelastic``: the same as the ``aelastic`` command."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
