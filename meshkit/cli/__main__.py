"""`python -m meshkit.cli ...` runs the `meshkit` command."""

from meshkit.cli.main import main

main()
