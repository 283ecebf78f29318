"""Stage 3, run: send prompts to servers under per-dataset token budgets, crash-safe.

Modules: `generate` (kit.generate, generate_sync, Run), `runner` (scheduling, budget
admission, retries, clean stops), `backends` (OpenAI-compatible, vLLM token ids, SGLang
/generate), `pool` (endpoint pool), `guard` (context-length pre-filter), `store` (the run
directory), `lines` (record line format and scanning), `progress` (progress read from a
run directory). Imports kit.types and kit.tokens only.
"""
