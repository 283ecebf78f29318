"""Stage 4, report: what a run produced, checked, shown and exported.

Modules: `audit` (kit.audit), `flags` (audit thresholds and per-record checks),
`textchecks` (the checks that need the tokenizer), `findings` (the audit's findings), `export`
(kit.export), `selection` and `writers` (its two passes), `staging` (written beside the
target, swapped in when valid), `manifest` (the export's manifest and summary), `convo` (a
record's conversation, tools and generated turns), `validate` (kit.validate), `checks`
(what an export's rows and manifest must be), `tokenrows` (token-id rows with loss masks),
`charts` (altair builders), `monitor` (live progress, kit.watch), `widgets` (the
interactive planner of 01_plan).
"""
