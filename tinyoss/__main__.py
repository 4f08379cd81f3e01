"""`python -m tinyoss ...`: the same as the `tinyoss` command."""

from tinyoss.cli import main

if __name__ == "__main__":
    main()
