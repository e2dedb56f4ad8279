import sys

from routewise_vllm.trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
