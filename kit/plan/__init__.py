"""Stage 2, plan: length profiles, the pilot, samples needed per budget, the stored plan.

Modules: `lengths` (profiles), `pilots` (a seeded sample run through kit.run.generate, its
throughput at the run's concurrency), `estimate` (budget(): samples needed, bounds, hours,
cap overshoot), `inputs` (budget()/allocate() input checks), `allocation` (allocate():
tokens per dataset from hours), `planfile` (the plan in run.sqlite, the hand-over to the
run stage; a stored pilot reused by the next plan), `hidden` (the disk an offline EAGLE-3 hidden-state dump of a plan takes; byte budgets).
The pilot is a small run, so this package sits above kit.run.

    res = kit.plan.pilot_sync(prompts, config)   # 30 per dataset
    table = kit.plan.budget({"chat": 10_000_000}, res, prompts_available=prompts,
                            throughput=res.throughput)
"""

from kit.plan.allocation import allocate
from kit.plan.estimate import TOTAL, budget
from kit.plan.hidden import TargetShape, hidden_states, target_shape, tokens_for_bytes
from kit.plan.lengths import profile, profile_completions, profile_prompts
from kit.plan.pilots import (
    PILOT_PER_DATASET,
    PilotResult,
    Throughput,
    measure_throughput,
    pilot,
    pilot_sample,
    pilot_sync,
)
from kit.plan.planfile import (
    pilot_means,
    plan_prompts,
    read_plan,
    run_started,
    show_plan,
    stored_pilot,
    write_plan,
)

__all__ = [
    "PILOT_PER_DATASET",
    "TOTAL",
    "PilotResult",
    "TargetShape",
    "Throughput",
    "allocate",
    "budget",
    "hidden_states",
    "measure_throughput",
    "pilot",
    "pilot_means",
    "pilot_sample",
    "pilot_sync",
    "plan_prompts",
    "profile",
    "profile_completions",
    "profile_prompts",
    "read_plan",
    "run_started",
    "show_plan",
    "stored_pilot",
    "target_shape",
    "tokens_for_bytes",
    "write_plan",
]
