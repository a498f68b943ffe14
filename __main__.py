"""``python -m orchestrion``: the command line."""

from .frontends._cli import main

raise SystemExit(main())
