"""Stage 1a, data: prompt datasets from real formats -> one prompt frame.

`sources` (kit.load, reload, prompt ids, skip counting), `inputs` (load's arguments:
names, format/mapping, directories), `readers` (file and in-memory readers, the entries a
directory load ignores) and `formats` (detection, per-format row parsers). Imports only
kit.types.
"""
