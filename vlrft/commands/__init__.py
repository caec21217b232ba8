"""One module per ``vlrft`` subcommand (see ``vlrft/cli.py``)."""
