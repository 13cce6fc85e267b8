"""Planning with no devices: the dry run of one config, and the layout planner.

``python -m jaxcolossal.plan --model llama3_70b --devices 16 --device h200 --seq 4096 --global-batch 512``
searches the layouts (dp/tp/pp sizes, ZeRO stage, remat, accumulation) for a model on a cluster
and prints the fastest that fit (:func:`report`, docs/planner.md).

``python scripts/train.py --config configs/llama_80l_example.yaml --dry-run`` prints the plan of
one config (:func:`dry_run`). Everything is arithmetic over the same sharding rules the train step
uses (:func:`jaxcolossal.parallel.sharding.state_specs`) and the memory model of :mod:`jaxcolossal.memory`;
the planner never imports the training code.

Modules: :mod:`~jaxcolossal.plan.devices` (the accelerators), :mod:`~jaxcolossal.plan.collectives`
(the communication model), :mod:`~jaxcolossal.plan.cost` (the time model), :mod:`~jaxcolossal.plan.search`
(the search and its table), :mod:`~jaxcolossal.plan.seed_table`, :mod:`~jaxcolossal.plan.dry_run`,
:mod:`~jaxcolossal.plan.cli`.
"""

from jaxcolossal.plan.cli import main
from jaxcolossal.plan.collectives import collective_bytes, collective_count, collective_terms, dp_gradient_bytes
from jaxcolossal.plan.cost import Layout, compiled_flops, cost_terms, predict
from jaxcolossal.plan.devices import DEVICES, Device
from jaxcolossal.plan.dry_run import DryRunPlan, dry_run, plan_dry_run
from jaxcolossal.plan.search import PlanReport, plan_layouts, report, run_overrides, search
from jaxcolossal.plan.seed_table import SEED_TABLE, seed_table

__all__ = ["DEVICES", "Device", "DryRunPlan", "Layout", "PlanReport", "SEED_TABLE", "collective_bytes", "collective_count", "collective_terms",
           "compiled_flops", "cost_terms", "dp_gradient_bytes", "dry_run", "main", "plan_dry_run", "plan_layouts", "predict",
           "report", "run_overrides", "search", "seed_table"]
