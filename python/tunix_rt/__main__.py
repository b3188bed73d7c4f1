"""`python -m tunix_rt`: the `tunix-rt` console script."""

from tunix_rt.console import entry

entry()
