"""Sub-commands of the `fedlt` command line, one module each (see fedlt.cli)."""
