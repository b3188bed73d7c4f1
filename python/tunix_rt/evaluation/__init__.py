"""`tunix-rt eval`: what a model (and each precision it can be stored in) scores on a file of rows."""
