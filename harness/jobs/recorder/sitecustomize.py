"""Loaded by every Python process of a job whose PYTHONPATH starts here (harness/jobs does that): it records what the
job does and injects faults, each part switched on by its own environment variable. The step scripts are not
changed; without the variables nothing happens. Each part is a module of recording/, whose docstring says what it
records and the format of its file:

- JOB_RECORD_DIR: what the job did, in files of that folder: each torch.save to a file (saves.py: writes.tsv,
  saves.jsonl, begins.jsonl), each pass over a DataLoader (samples.py: samples.jsonl, begins.jsonl, with what
  models.py, losses.py, draws.py, sharded.py, context.py and routes.py note during the pass), each clean exit
  (exits.py: exits.jsonl), each object collective (objects.py: objects.jsonl), each micro-batch pass of a pipeline
  stage (pipeline.py: pipeline.jsonl), what step 12's optimizer steps trained on (batches.py: batches.jsonl).
- JOB_RECORD_STEPS=1 (with JOB_RECORD_DIR): each optimizer step and DDP's gradient all-reduces (steps.py: steps.jsonl).
- JOB_RECORD_COLLECTIVES=1 (with JOB_RECORD_DIR): each collective's call and waits, each backward and optimizer step
  (collectives.py, collective_calls.py, collective_waits.py, collective_steps.py: collectives.jsonl).
- JOB_RECORD_PLUGINS=`PLUGIN,...` (with JOB_RECORD_DIR): run each plugin too, a .py file by its path (an exercise's
  recorder.py) or a module of recorder/plugins/ by name (traffic): what one job records beyond the above (each
  plugin's docstring says what).
- JOB_SLOW_SAVE=`SECONDS`: a slow disk (saves.py).
- JOB_KILL_AT, JOB_KILL_AT_STEP, JOB_SKIP_ALL_REDUCE, JOB_STALL_INIT, JOB_HOLD: faults at known points (faults.py).

The order below matters where two parts wrap the same function: the one loaded later runs outside the other. So a
fault is loaded just before the record of what it cuts short (a pass that a kill ends has its begins.jsonl line), and
the plugins last. A part is imported only when a variable asks for it: what it imports, every process of the job
waits for before its script starts.
"""
import os
import sys

# What the plugins read from this module: the records' folder, and how they note a line.
from recording.notes import RECORD_DIR, _append, _rank, _restart, _stack

RECORD_STEPS = RECORD_DIR and os.environ.get("JOB_RECORD_STEPS")
RECORD_COLLECTIVES = RECORD_DIR and os.environ.get("JOB_RECORD_COLLECTIVES")
SLOW_SAVE = float(os.environ.get("JOB_SLOW_SAVE") or 0)
KILL_AT = os.environ.get("JOB_KILL_AT")
KILL_AT_STEP = os.environ.get("JOB_KILL_AT_STEP")
SKIP_ALL_REDUCE = os.environ.get("JOB_SKIP_ALL_REDUCE")
STALL_INIT = os.environ.get("JOB_STALL_INIT")
HOLD = os.environ.get("JOB_HOLD")

if RECORD_DIR or SLOW_SAVE:
    from recording.saves import _save, note_and_slow_down_saves  # _save: torch's own, for the plugins

    note_and_slow_down_saves(record=bool(RECORD_DIR), slow=SLOW_SAVE)

if SLOW_SAVE:
    from recording.saves import slow_down_checkpoint_writes

    slow_down_checkpoint_writes(SLOW_SAVE)

if KILL_AT:
    from recording.faults import kill_at_pass

    kill_at_pass(KILL_AT)

if RECORD_DIR:
    from recording.context import note_context
    from recording.draws import note_draws
    from recording.exits import record_exits
    from recording.losses import note_losses
    from recording.models import note_models
    from recording.objects import record_object_collectives
    from recording.pipeline import record_stage_passes
    from recording.routes import note_routes
    from recording.samples import record_passes
    from recording.sharded import note_reduce_scatter_dtypes

    note_models()
    record_passes()
    note_reduce_scatter_dtypes()
    record_object_collectives()
    note_draws()
    note_losses()
    record_exits()
    record_stage_passes()
    note_context()
    note_routes()

# Before batches.py: its hook runs first, so the step it kills has no line in batches.jsonl.
if KILL_AT_STEP:
    from recording.faults import kill_at_step

    kill_at_step(KILL_AT_STEP)

if RECORD_DIR:
    from recording.batches import record_batches

    record_batches()

if RECORD_STEPS:
    from recording.steps import record_steps

    record_steps()

if SKIP_ALL_REDUCE:
    from recording.faults import skip_all_reduce

    skip_all_reduce(SKIP_ALL_REDUCE)

if STALL_INIT:
    from recording.faults import stall_init

    stall_init(STALL_INIT)

if HOLD:
    from recording.faults import hold_managers

    hold_managers(HOLD)

if RECORD_COLLECTIVES:
    # What the plugins read of the collectives' record: its options, the tensors given, the calls counted, its wrapper.
    from recording.collective_calls import _noting_collective, _sequence, record_collective_calls
    from recording.collective_steps import record_backwards_and_steps
    from recording.collective_waits import note_waits_on_futures
    from recording.collectives import _OPTIONS, _given

    note_waits_on_futures()
    record_collective_calls()
    record_backwards_and_steps()

if RECORD_DIR and os.environ.get("JOB_RECORD_PLUGINS"):
    import importlib
    import importlib.util

    from recording.notes import _PLUGIN_FILES

    # What one job needs recorded beyond the above, named in JOB_RECORD_PLUGINS (comma-separated): an exercise's
    # recorder.py by its path, or a module of recorder/plugins/ by name (traffic); each reads this module's _append,
    # _rank and _restart.
    sys.path.insert(0, os.path.dirname(__file__))
    for _plugin in os.environ["JOB_RECORD_PLUGINS"].split(","):
        if _plugin.endswith(".py"):
            _PLUGIN_FILES.append(os.path.abspath(_plugin))
            _spec = importlib.util.spec_from_file_location(os.path.basename(os.path.dirname(_PLUGIN_FILES[-1])),
                                                           _PLUGIN_FILES[-1])
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        else:
            importlib.import_module(f"plugins.{_plugin}")
