"""deepxctl: the operator CLI of deepx (see docs/deepxctl.md). The entry point is deepxctl.cli:main."""
