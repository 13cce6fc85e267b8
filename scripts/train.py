"""The main job: train a LLaMA over a device mesh.

    python scripts/train.py                                   # configs/llama_tiny.yaml
    python scripts/train.py --config X parallel.zero_stage=3 training.max_steps=50
    python scripts/train.py --config configs/llama_80l_example.yaml --dry-run
    python scripts/train.py --config configs/bench/llama2_7b.yaml --compile-for h200x8
    python scripts/train.py --config configs/bench/llama2_7b.yaml --dry-run --compile-for h200x8   # both, side by side
    python scripts/train.py --eval-only checkpoint.dir=checkpoints/tiny          # a checkpoint's validation loss
    python scripts/train.py --eval-only --config OUT/model.yaml model.init_from=HF_DIR data.corpus=a.jsonl

On a machine with no accelerator it simulates 8 CPU devices (``--devices`` to change);
on GPUs it uses the real ones. With torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT — set by torchrun, by ``python -m jaxcolossal.run``, or mapped from SLURM as in
docs/multihost.md) it calls ``launch_from_env`` and joins a ``jax.distributed`` job.

Several processes on one machine (2 x 4 simulated CPU devices here):

    python -m jaxcolossal.run --nproc 2 scripts/train.py parallel.zero_stage=3

The launcher sets each process's device count in ``XLA_FLAGS``; without ``--devices`` that
count is kept.

Exit status (one line on stderr for each error a user can cause, jaxcolossal.errors): 0 done
(with --compile-for: the step fits; with --eval-only: evaluated); 1 with --compile-for or
--dry-run: it does not fit; 2 a config error (before anything compiles; also a resume with
nothing left to train, --eval-only with nothing to evaluate, a checkpoint of another model size,
optimizer or precision, a missing optional package); 3 a data, tokenizer or checkpoint error, or
training stopped on NaN/inf; 143 / 130 after SIGTERM / Ctrl-C, with the current step saved (during
start-up, before the first step: stopped at the next phase, nothing saved); 130 at once after a
second Ctrl-C, or a Ctrl-C while it exits.
"""

import argparse
import atexit
import json
import os
import signal
import sys

import jaxcolossal as jc
from jaxcolossal.aot import fleet, report, target
from jaxcolossal.config import ConfigError, config_help, load_config
from jaxcolossal.errors import exit_status
from jaxcolossal.plan import plan_dry_run
from jaxcolossal.train.guard import exit_at_once

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "llama_tiny.yaml")


def _devices_in_xla_flags() -> int | None:
    """The value of --xla_force_host_platform_device_count in XLA_FLAGS, if any."""
    for tok in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = tok.partition("=")
        if name == "--xla_force_host_platform_device_count" and value.isdigit() and int(value) > 0:
            return int(value)
    return None


def compile_for_fleet(cfg, args, predicted: bool = False) -> int:
    """``--compile-for``: 0 when the step fits the fleet's HBM, 1 when it does not; with
    ``predicted`` (``--dry-run`` too) also the planner's prediction against the compiled peak."""
    target.prepare_environment()  # before jax's backends start
    gpu, count = target.parse_fleet(args.compile_for)
    fleet.check_fleet(cfg, count, args.devices_per_host or gpu.devices_per_host, gpu)
    result = fleet.compile_for(cfg, gpu, count, args.devices_per_host, keep_hlo=False)
    print(report.text(result))
    if predicted:
        print(report.against_prediction(cfg, result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_json(result), f, indent=1)
    return 0 if result.fits else 1


def dry_run(cfg, args) -> int:
    """``--dry-run``: the plan; 1 when the run would be refused for ``offload.device_memory_limit``."""
    p = cfg.parallel
    explicit = -1 not in (p.data_parallel_size, p.tensor_parallel_size, p.pipeline_parallel_size)
    # explicit sizes give the device count; otherwise plan for --devices (default 8)
    plan = plan_dry_run(cfg, None if explicit else (args.devices or _devices_in_xla_flags() or 8))
    print(plan.text)
    if plan.offload_refusal:  # the run itself would be refused before compiling
        print("error: this run does not fit offload.device_memory_limit (the offload line above)", file=sys.stderr)
        return 1
    return 0


def run(args) -> int:
    """Load and validate the config (before JAX starts), then compile for a fleet, plan, evaluate
    (``--eval-only``: :func:`jaxcolossal.train.evaluate.evaluate_only`) or train."""
    cfg = load_config(args.config, args.overrides)
    if args.eval_only and (args.dry_run or args.compile_for):
        raise ConfigError("--eval-only evaluates a checkpoint on this machine's devices; it does not combine with "
                          "--dry-run or --compile-for")
    if args.compile_for and args.dry_run:  # the plan, then what the GPU compiler made of it
        status = dry_run(cfg, args)
        print()
        return max(status, compile_for_fleet(cfg, args, predicted=True))
    if args.compile_for:
        return compile_for_fleet(cfg, args)
    if args.dry_run:
        return dry_run(cfg, args)
    jc.gpu_memory_fraction()  # 0.9 of each GPU's memory, as the planner plans (jax's default: 0.75)
    jc.simulate_devices(args.devices or _devices_in_xla_flags() or 8)
    jc.launch_from_env(seed=cfg.training.seed, verbose=False,
                       heartbeat_timeout_s=cfg.parallel.heartbeat_timeout_s or None)
    from jaxcolossal.train.evaluate import evaluate_only  # heavy: orbax and tensorstore, for training runs only
    from jaxcolossal.train.loop import train  # heavy: as above
    if args.eval_only:
        evaluate_only(cfg)
        return 0
    return train(cfg)["exit_code"]  # 0, or 143 / 130 after SIGTERM / Ctrl-C (128 + signal), as schedulers expect


def _parser() -> argparse.ArgumentParser:
    """The command line; ``--help`` ends with every config key, its default and the first sentence
    of its doc (:func:`jaxcolossal.config.config_help`; the whole reference is docs/config.md)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=config_help())
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config (default: configs/llama_tiny.yaml)")
    ap.add_argument("--devices", type=int, default=None,
                    help="simulated CPU devices (per process) when no accelerator (default: the count "
                         "already in XLA_FLAGS, as set by python -m jaxcolossal.run, else 8)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (params, memory, mesh) and exit")
    ap.add_argument("--eval-only", action="store_true",
                    help="print the validation loss (nats/token) and perplexity of the newest checkpoint in "
                         "checkpoint.dir, else of model.init_from's Hugging Face weights, on the config's data "
                         "(as training.eval_every evaluates), append it to metrics.jsonl and exit; never trains "
                         "or saves (docs/training.md)")
    ap.add_argument("--compile-for", metavar="FLEET", default=None,
                    help="compile the train step for a GPU fleet with XLA's GPU compiler, no GPU needed, and print "
                         "its memory, collectives, overlap and custom calls; FLEET is TARGETxCOUNT, e.g. h200x16 "
                         "(targets: h100, h200, b200, a100); exit 1 when it does not fit (docs/gpu.md)")
    ap.add_argument("--devices-per-host", type=int, default=None,
                    help="with --compile-for: GPUs per host (default 8)")
    ap.add_argument("--json", metavar="PATH", default=None, help="with --compile-for: also write the report as JSON")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides (the config keys are listed below)")
    return ap


def _ctrl_c_while_exiting() -> None:
    """After the run: a Ctrl-C while the process exits ends it at once with 130 and one line
    (:func:`exit_at_once`) while Python code still runs (threads being joined); from the ``atexit``
    handlers on (this one, registered last, runs first) it is ignored, where it would otherwise raise
    inside jax's clean-up (a traceback) or kill the interpreter half-way through destroying XLA's
    client (status -2)."""
    signal.signal(signal.SIGINT, lambda *_: exit_at_once("aborted (Ctrl-C while exiting)"))
    atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)


def main(argv=None) -> int:
    """Run the command line; returns its exit status (the module's docstring). A ``KeyboardInterrupt``
    (a second Ctrl-C, or one before the run's handlers are installed) ends the process at once with
    130 (:func:`exit_at_once`: no interpreter teardown, which would wait for the XLA compile it
    abandoned and then crash); so does a Ctrl-C after the run (:func:`_ctrl_c_while_exiting`)."""
    args = _parser().parse_intermixed_args(argv)  # overrides may come before and after the flags
    try:
        status = run(args)
    except KeyboardInterrupt as e:
        exit_at_once(f"aborted ({str(e) or 'Ctrl-C'}): nothing saved since the last checkpoint")
    except Exception as e:  # a user's error: one line and its exit code (jaxcolossal.errors); a bug raises
        status = exit_status(e)
        if status is None:
            raise
        print(status[0], file=sys.stderr)
        return status[1]
    _ctrl_c_while_exiting()
    return status


if __name__ == "__main__":
    sys.exit(main())
