"""`python -m deepxctl`, the same as the deepxctl console script."""

from deepxctl.cli import main

main()
