"""Stage 1a, data: prompt datasets from real formats -> one prompt frame.

`sources` (kit.load, reload, prompt ids, skip counting), `inputs` (load's arguments:
names, format/mapping, directories), `readers` (file and in-memory readers, the entries a
directory load ignores), `formats` (detection, per-format row parsers), `tools` (tool
definitions in the frame's `tools` column, tool turns counted as skips) and `parts` (the
temporary Parquet parts a load writes).
Imports only kit.types.
"""
