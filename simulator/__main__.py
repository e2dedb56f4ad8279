"""`python -m routewise_vllm.simulator` = the `simulator` command."""

from routewise_vllm.simulator.cli import main

raise SystemExit(main())
