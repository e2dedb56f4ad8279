"""`python -m routewise_vllm.fleet` = the `fleet` command."""

from routewise_vllm.fleet.cli import main

raise SystemExit(main())
