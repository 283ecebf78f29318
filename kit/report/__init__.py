"""Stage 4, report: what a run produced, checked, shown and exported.

Modules: `audit` (kit.audit), `export` (kit.export), `validate` (kit.validate),
`tokenrows` (token-id rows with loss masks), `charts` (altair builders), `monitor`
(live progress, kit.watch), `widgets` (the interactive planner of 01_plan).
"""
