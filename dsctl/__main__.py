"""`python -m dsctl` runs the CLI."""

from dsctl.cli import main

main()
