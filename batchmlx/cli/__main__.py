"""`python -m batchmlx.cli`: the console script's entry."""

from batchmlx.cli.entry import main

main()
