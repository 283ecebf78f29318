"""Stage 2, plan: length profiles, the pilot, samples needed per budget, plan.json.

Modules: `lengths` (profiles), `pilots` (a seeded sample run through kit.run.generate),
`estimate` (budget(): samples needed, bounds, hours, cap overshoot), `allocation`
(allocate(): tokens per dataset from hours), `planfile` (plan.json, the hand-over to the
run stage). The pilot is a small run, so this package sits above kit.run.

    table = kit.plan.budget({"chat": 10_000_000}, pilot_result, prompts_available=prompts)
"""

from kit.plan.allocation import allocate
from kit.plan.estimate import TOTAL, budget
from kit.plan.lengths import profile, profile_completions, profile_prompts
from kit.plan.pilots import PilotResult, pilot, pilot_sample, pilot_sync
from kit.plan.planfile import pilot_means, plan_prompts, read_plan, write_plan

__all__ = [
    "TOTAL",
    "PilotResult",
    "allocate",
    "budget",
    "pilot",
    "pilot_means",
    "pilot_sample",
    "pilot_sync",
    "plan_prompts",
    "profile",
    "profile_completions",
    "profile_prompts",
    "read_plan",
    "write_plan",
]
