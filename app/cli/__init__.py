"""The ``batchgen`` command line (:mod:`batchgen.cli.main`)."""
