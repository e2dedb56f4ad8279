"""`python -m simulator` = the `simulator` command."""

from simulator.cli import main

raise SystemExit(main())
