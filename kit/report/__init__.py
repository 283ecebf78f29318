"""Stage 4, report: what a run produced, checked, shown and exported.

`kit.audit` checks a run's records (flags per record, findings per dataset), `kit.export`
writes them for the trainers and `kit.validate` checks an export; `kit.watch`, the charts,
tables and the planner widget are for people. README.md maps each module in a line.
"""
