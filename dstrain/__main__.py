"""`python -m dstrain` is the `dstrain` command."""

from dstrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
