"""``python -m gradgraph``: the ``gradgraph`` command."""

from gradgraph.cli.main import main

raise SystemExit(main())
