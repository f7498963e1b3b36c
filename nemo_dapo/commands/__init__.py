"""The operator verbs behind `nemo-dapo` (cli.py): plan, ladder, plot, launch, bringup, eval, selfcheck."""
