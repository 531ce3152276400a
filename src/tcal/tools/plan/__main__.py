"""`python -m tcal.tools.plan`: the `tcal-plan` console script."""

from tcal.tools.plan.cli import main

main()
