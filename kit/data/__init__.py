"""Stage 1a, data: prompt datasets from real formats -> one prompt frame.

`sources` (kit.load, prompt ids, skip counting) and `formats` (file readers, per-format
row parsers). Imports only kit.types.
"""
