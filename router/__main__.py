import sys

from routewise_vllm.router.cli import main

sys.exit(main())
