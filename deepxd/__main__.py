"""`python -m deepxd`, the same as the deepxd console script."""

from deepxd.cli import main

main()
