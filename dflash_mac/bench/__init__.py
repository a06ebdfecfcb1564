"""`dflash-mac bench`: runner (run.py), aggregation (summary.py), report (report.py), live view
(view.py) and the command (command.py)."""
