"""Stage 3, run: send prompts to servers under per-dataset token budgets, crash-safe.

`kit.generate` schedules requests to OpenAI-compatible servers (vLLM, SGLang) under budget
admission and retries, checks each answer before it is believed, and writes it to the run
database, its one store. Imports kit.types, kit.tokens and kit.data only; README.md maps each
module in a line.
"""
