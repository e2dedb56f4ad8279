"""`python -m fleet` = the `fleet` command."""

from fleet.cli import main

raise SystemExit(main())
