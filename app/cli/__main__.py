"""``python -m batchgen.cli``: the same as the ``batchgen`` command."""

from batchgen.cli.main import main

if __name__ == "__main__":
    main()
