"""``python -m orchestrion``: the command line."""

from .frontends import main

raise SystemExit(main())
