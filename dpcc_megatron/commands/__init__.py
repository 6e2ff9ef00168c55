"""CLI subcommands (the edge layer): argument parsing and wiring only."""
