"""The `engramflow` command: one parser, one `main` (app.py); a module per group of subcommands,
each a thin shell over library calls."""
