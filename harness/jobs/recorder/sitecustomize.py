"""Loaded by every Python process of a job whose PYTHONPATH starts here (harness/jobs does that): it records what the
job does and injects faults, each part switched on by its own environment variable. The step scripts are not
changed; without the variables nothing happens.

- JOB_RECORD_DIR: what the job did, in files of that folder.
  - writes.tsv: a line `pid<TAB>rank<TAB>path` per torch.save to a file, so a reader can tell how many processes
    wrote files and which ranks they were ("-": no process group).
  - samples.jsonl: a JSON line per completed pass over a DataLoader: the process, its rank, torchrun's restart
    count, the sampler's class and epoch (its set_epoch value), the pass's number in this process, whether the model
    was wrapped in DDP, `mesh` (this rank's coordinates in the named DeviceMesh init_device_mesh made, e.g.
    {"dp": 1, "tp": 0}; None without one), `node` (torchrun's GROUP_RANK: which node the process runs on), and the
    sample indices in the order the process trained on them.
    `losses`: every loss this rank called backward() on in the pass, in order (a step's, or each micro-batch's).
    `routes`, in a job of step 10 (utils/moe.py): for each training forward of a MoE layer in the pass, in order
    (step by step, layer by layer), the experts the router chose for each of this rank's tokens, its top_k in the
    order of choice, as the hex of one byte an assignment; None elsewhere.
    Overlapping shards, a shuffle that never changes, a resume that repeats an epoch: all show in it. (A BatchSampler
    is what every DataLoader with a batch size iterates over, so patching its __iter__ sees every batch of every
    step.)
- JOB_RECORD_STEPS=1 (with JOB_RECORD_DIR): steps.jsonl, a JSON line per optimizer step: the process, its rank,
  torchrun's restart count, the step's number in this process, `at` (time.time() as the step begins, its
  gradients ready), the learning rate it used (the first param group's),
  and the gradient all-reduces since the step before: `rounds` (DDP all-reduces its buckets once per backward that
  syncs: one round), `buckets`, and `grad_norms` (each round's all-reduced gradient norm, over all its buckets). A
  DDP communication hook counts them: it wraps DDP's default all-reduce (divide by the world size, sum), so the
  numbers are those of the job without it. Gradient accumulation with no_sync() shows as one round per step.
    Each line also holds what a correct data-parallel run keeps equal, hashed: the model's parameters and the
    optimizer's state at the pass's start and end (`params_before`, `optimizer_before`, `params`, `optimizer`: equal
    on every rank after an epoch, and equal across a restart when the snapshot holds all it must); `loss`, the mean
    of the losses this rank called backward() on, weighted by batch size (what an all-reduce averages over ranks);
    `began` and `ended` (time.time()); `bypass`, the first stack (see saves.jsonl) that called the model inside
    DistributedDataParallel directly during the pass, so no gradient was averaged (None: it never happened).
    `context`, in a job of step 9 (utils/context.py): {"positions": the positions of each sequence this rank trained
    on, "scores": the query-key scores its ring attention computed in the pass, forward and backward, per head and
    sequence}; None elsewhere.
    What decides dropout's masks, the pass's draws: `draws`, {"dropout": ..., "attention": ...}, a digest of the state
    the default generator of the input's device was in at every call of F.dropout and of the attention's
    F.scaled_dot_product_attention that dropped something (in order; None: no such call). Two ranks with equal
    digests drew the same masks for tensors of the same shapes; with different ones, other masks.
    For a model of DTensors (FSDP, tensor parallelism): `whole_along_tp`, a digest of the local parts of the parameters
    this rank holds whole along the mesh dimension "tp" (every parameter not split over tp, FSDP's shards over dp
    included), at the pass's end: the ranks of a tp group hold the same ones, and must keep them equal. And
    `reduce_scatter_dtypes`, the dtypes of the gradients reduce-scattered during the pass (FSDP's), sorted.
  - saves.jsonl: a JSON line per torch.save to a file: pid, rank, restart, path, `began` and `ended`, and `stack`,
    the calling frames outside the Python and torch installation ([file, line, function], outermost first).
  - begins.jsonl: a JSON line as each save to a file and each pass begins (`what`: "save" or "pass"; pid, rank,
    restart, `began`, and a pass's epoch), written before the work: a save or a pass that a kill cuts short shows.
  - exits.jsonl: a JSON line per process that trained and exits without an error (at its end, or by os._exit(0)):
    pid, its last rank, restart, and `open`: its default process group was still initialized (never destroyed).
  - objects.jsonl: a JSON line per call of an object collective (all_gather_object, broadcast_object_list...), whose
    pickles a process that joined the group could make run code: pid, rank, restart, `collective`, and `caller`, the
    file and line that called it (the steps' own code, or torch's: DCP exchanges its plans so).
  - pipeline.jsonl: a JSON line per micro-batch pass of a torch.distributed.pipelining stage (the schedule as it ran,
    not as it was planned): pid, rank, restart, `stage`, `step` (the schedule's step in this process, from 0),
    `pass` ("forward" or "backward"), `microbatch`, `began` and `ended` (time.time()), and for a forward `saved`, the
    bytes of the tensors autograd kept for its backward (activations; the stage's parameters not counted). Patched
    in when the job imports torch.distributed.pipelining (importing it costs 1.5 s: jobs without it do not pay).
- JOB_RECORD_COLLECTIVES=1 (with JOB_RECORD_DIR): collectives.jsonl, a JSON line per event of the workshop's
  build-it-yourself exercises, each with pid, rank, restart, `event` and `step` (the optimizer steps this process had
  taken): "call", per call of a torch.distributed collective or point-to-point op (`op`, `seq` its number in the
  process, `began` and `ended` of the call, `asynchronous`, `bytes` of each tensor it was given, `dtypes`, `peer`,
  `group_size`, `in_backward` (called during a Tensor.backward: from a gradient hook), split sizes of an
  all_to_all_single, `caller` [file, line, function], the innermost frame outside the installation); "wait", each
  time the Work of an asynchronous call (`seq`) was waited on, by its own wait() or by a wait on its future or on a
  future chained to it (`began`, `ended`, `via` "work" or "future", `again`: it had been waited on before, `caller`,
  and `written`: the program wrote into the tensor of an asynchronous all_reduce between the call and this first
  wait, seen with the plugin ddp_by_hand, which runs such an all_reduce on a copy of the tensor, copied back at that
  wait: see _NotedWork); "backward", each
  Tensor.backward's `began` and `ended`, and `ready`, [time, bytes] of each gradient it accumulated into a parameter
  (a hook of the recorder's on every parameter a module registered, run before the program's own); "step" as an
  optimizer step begins (`params` and `grads`: the bytes of the parameters it updates and of their gradients, and
  `held`, with the plugin ddp_by_hand: the tensors given to collectives still alive then, each storage once, the
  model's parameters and the optimizer's state left out, as {"seq", "step", "op", "caller", "bytes"} of the first
  call each was given to; None without it) and "stepped" as it ends (`state`: the bytes of its state tensors,
  AdamW's moments).
- JOB_RECORD_PLUGINS=`PLUGIN,...` (with JOB_RECORD_DIR): run each plugin too, a .py file by its path (an exercise's
  recorder.py) or a module of recorder/plugins/ by name (traffic): what one job records beyond the above (each
  plugin's docstring says what).
- JOB_SLOW_SAVE=`SECONDS` (with or without JOB_RECORD_DIR): every torch.save to a file takes that much longer: it
  sleeps once the bytes are written, before it returns (a slow disk: the file being written is there, not yet
  renamed into place), so a rank that does not wait for the snapshot to be on disk shows it. Each rank's writes of a
  torch.distributed.checkpoint save take that much longer too (in the thread of an asynchronous save): its folder is
  there, its metadata not yet.
  - batches.jsonl, in a job of step 12 (long_run.py, whose DataLoader reads utils/data.py's Shares): a JSON line per
    optimizer step of a process: pid, rank, restart, `mesh` (as in samples.jsonl), `step` (the process's optimizer
    steps so far, this one included) and `rows` (a digest of each sequence this rank trained on in the step, in order:
    its inputs' and targets' bytes).
    Written just before the optimizer's step, from what the DataLoader handed the training process last: what was
    trained on, not what a loader's worker read ahead.
- JOB_KILL_AT=`RESTART:RANK:EPOCH`: that rank SIGKILLs itself as it begins that epoch in that attempt: a crash at a
  known point (the epoch counts passes over the DataLoader when the sampler has no set_epoch).
- JOB_KILL_AT_STEP=`RESTART:RANK:STEP`: that rank SIGKILLs itself just before its optimizer step number STEP (from 1)
  in that attempt: after the step's forwards and backwards, before any weight changes. (A step at a learning rate of
  0 is not counted, here or in batches.jsonl: torch.distributed.checkpoint takes one to give an optimizer its state
  before it loads a snapshot's.)
- JOB_SKIP_ALL_REDUCE=`RANK:N`: the process of that global rank skips its N-th torch.distributed.all_reduce and
  sleeps instead, never arriving: the classic bug of a collective inside `if rank == 0:`, or a rank stuck in I/O.
- JOB_STALL_INIT=`RANK`: the process of that global rank never reaches init_process_group (it sleeps instead): a
  rank stuck before the process group forms, or one whose address cannot be reached. `RANK:SECONDS`: it reaches it
  that many seconds late, as a rank started last on a busy machine does.
- JOB_HOLD=`FOLDER`: each process that constructs a torchft Manager (a replica group of step 13) first writes
  FOLDER/held-PID, then waits (at most 600 s) until FOLDER/go exists, and goes on: the groups of a job start to train
  at once however far apart their starts were (harness/jobs' Job.release() writes it once they all wait). Once it
  exists, a process restarted later goes on at once.
"""
import importlib.abc
import importlib.util
import json
import os
import sys
import time

RECORD_DIR = os.environ.get("JOB_RECORD_DIR")
RECORD_STEPS = RECORD_DIR and os.environ.get("JOB_RECORD_STEPS")
SLOW_SAVE = float(os.environ.get("JOB_SLOW_SAVE") or 0)
KILL_AT = os.environ.get("JOB_KILL_AT")
KILL_AT_STEP = os.environ.get("JOB_KILL_AT_STEP")
SKIP_ALL_REDUCE = os.environ.get("JOB_SKIP_ALL_REDUCE")
STALL_INIT = os.environ.get("JOB_STALL_INIT")
RECORD_COLLECTIVES = RECORD_DIR and os.environ.get("JOB_RECORD_COLLECTIVES")
HOLD = os.environ.get("JOB_HOLD")


def _rank():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ["RANK"]) if "RANK" in os.environ else None


def _append(name, line):
    with open(os.path.join(RECORD_DIR, name), "a") as record:
        record.write(line + "\n")


def _restart():
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


_PLUGIN_FILES = []  # the plugins' files (JOB_RECORD_PLUGINS): their frames are the recorder's, not the program's


def _stack():
    """The calling frames outside the Python and torch installation (the script's, the repository's), outermost
    first, as [file, line, function]."""
    import traceback

    installed = (sys.base_prefix, sys.prefix, os.path.dirname(os.__file__), os.path.dirname(__file__), *_PLUGIN_FILES)
    return [[frame.filename, frame.lineno, frame.name] for frame in traceback.extract_stack()[:-2]
            if not frame.filename.startswith(installed) and "site-packages" not in frame.filename
            and not frame.filename.startswith("<")]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the module `name` as it is imported, if it ever is, before anything imports names from it."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def execute_and_patch(module):
            execute(module)
            self.patch(module)

        spec.loader.exec_module = execute_and_patch
        return spec


if RECORD_DIR or SLOW_SAVE:
    import torch

    _save = torch.save

    def _recording_save(obj, f, *args, **kwargs):
        to_file, began = isinstance(f, (str, os.PathLike)), time.time()  # not a stream (DCP's items go to streams)
        if to_file and RECORD_DIR:  # noted before the write too: a save that a kill cuts short leaves no saves.jsonl
            _append("begins.jsonl", json.dumps(dict(what="save", pid=os.getpid(), rank=_rank(), restart=_restart(),
                                                    began=began)))
        result = _save(obj, f, *args, **kwargs)
        if to_file and SLOW_SAVE:
            time.sleep(SLOW_SAVE)
        if to_file and RECORD_DIR:
            rank = _rank()
            _append("writes.tsv", f"{os.getpid()}\t{'-' if rank is None else rank}\t{os.path.abspath(f)}")
            _append("saves.jsonl", json.dumps(dict(pid=os.getpid(), rank=rank, restart=_restart(),
                                                   path=os.path.abspath(f), began=began, ended=time.time(),
                                                   stack=_stack())))
        return result

    torch.save = _recording_save

if SLOW_SAVE:
    from torch.distributed.checkpoint import FileSystemWriter

    _write_data = FileSystemWriter.write_data

    def _slow_write_data(self, plan, planner):
        written = _write_data(self, plan, planner)
        time.sleep(SLOW_SAVE)
        return written

    FileSystemWriter.write_data = _slow_write_data

if RECORD_DIR or KILL_AT:
    import signal

    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import BatchSampler

    _passes = [0]  # passes over a DataLoader begun by this process
    _wrapped = [False]  # did this process build a DistributedDataParallel?
    _ddp_init, _batches = DistributedDataParallel.__init__, BatchSampler.__iter__
    # What the pass under way has seen: its batch's size, the losses backward() was called on, a bypass of DDP
    _now = dict(in_pass=False, in_ddp=0, batch=0, loss=0.0, samples=0, bypass=None, rank=None, mesh=None, draws={},
                reduce_scatter_dtypes=set())
    _models, _optimizers = [], []  # weak references: the DDP-wrapped models and the optimizers this process built

    def _noting_ddp_init(self, *args, **kwargs):
        _wrapped[0] = True
        _ddp_init(self, *args, **kwargs)
        if RECORD_STEPS:
            self.register_comm_hook(self.process_group, _counting_all_reduce)  # DDP's group: the world, or less
        if RECORD_DIR:
            import weakref

            _models.append(weakref.ref(self.module))
            self.module.register_forward_pre_hook(_noting_bypass)

    def _noting_bypass(module, inputs):
        if _now["in_pass"] and not _now["in_ddp"] and _now["bypass"] is None:
            _now["bypass"] = _stack()

    def _hash(tensors):
        """A short digest of the tensors' bytes; None when one is not a plain tensor (a DTensor shard of FSDP, whose
        bytes would take a collective to read): only DDP's replicas are compared."""
        import hashlib

        digest = hashlib.sha1()
        for tensor in tensors:
            if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
                return None
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]

    def _parameters_hash():
        models = [model for model in (ref() for ref in _models) if model is not None]
        return _hash(p for model in models for p in model.parameters()) if models else None

    def _optimizer_hash():
        """The state of every optimizer alive (Adam's moments and step counts), in a fixed order."""
        states = [opt.state_dict()["state"] for opt in (ref() for ref in _optimizers) if opt is not None]
        return _hash(value if isinstance(value, torch.Tensor) else torch.as_tensor(value) for state in states
                     for key in sorted(state) for _, value in sorted(state[key].items())
                     if isinstance(value, (torch.Tensor, int, float)))

    def _whole_along_tp_hash():
        """The local parts of the DTensor parameters of every optimizer alive that are not split over a mesh dimension
        named "tp", hashed in a fixed order; None when there are none (a job that never imported DTensor has none:
        it is not imported for it)."""
        if "torch.distributed.tensor" not in sys.modules:
            return None
        from torch.distributed.tensor import DTensor

        whole = []
        for optimizer in (ref() for ref in _optimizers):
            for param in (p for group in (optimizer.param_groups if optimizer else []) for p in group["params"]):
                if not isinstance(param, DTensor):
                    continue
                names = param.device_mesh.mesh_dim_names or ()
                if "tp" not in names or not param.placements[names.index("tp")].is_shard():
                    whole.append(param.to_local())
        return _hash(whole) if whole else None

    def _recording_batches(self):
        epoch, number = getattr(self.sampler, "epoch", None), _passes[0]
        _passes[0] += 1
        restart = _restart()
        if RECORD_DIR:  # before the kill below: the pass a rank is killed in has begun too
            _append("begins.jsonl", json.dumps(dict(what="pass", pid=os.getpid(), rank=_rank(), restart=restart,
                                                    epoch=epoch, began=time.time())))
        if KILL_AT == f"{restart}:{_rank()}:{number if epoch is None else epoch}":
            os.kill(os.getpid(), signal.SIGKILL)
        if RECORD_DIR:
            before = dict(began=time.time(), params_before=_parameters_hash(), optimizer_before=_optimizer_hash())
            _now.update(in_pass=True, loss=0.0, samples=0, bypass=None, draws={}, reduce_scatter_dtypes=set(),
                        scores=0, losses=[], routes=[])
        indices = []
        try:
            for batch in _batches(self):
                indices.extend(int(i) for i in batch)
                _now["batch"] = len(batch)
                yield batch
        finally:  # also when the loop over the DataLoader is left early (a pass that is not recorded)
            _now["in_pass"] = False
        if RECORD_DIR:  # here the last batch's step is done: the DataLoader asks for a batch after it
            _now["rank"] = _rank()
            _append("samples.jsonl", json.dumps(dict(
                pid=os.getpid(), rank=_rank(), restart=restart, sampler=type(self.sampler).__name__, epoch=epoch,
                number=number, ddp=_wrapped[0], mesh=_now["mesh"], node=int(os.environ.get("GROUP_RANK", 0)),
                indices=indices, **before, ended=time.time(), params=_parameters_hash(), optimizer=_optimizer_hash(),
                loss=_now["loss"] / _now["samples"] if _now["samples"] else None, losses=_now["losses"],
                routes=_now["routes"] or None, bypass=_now["bypass"],
                draws={kind: digest.hexdigest()[:16] for kind, digest in _now["draws"].items()},
                whole_along_tp=_whole_along_tp_hash(),
                reduce_scatter_dtypes=sorted(_now["reduce_scatter_dtypes"]),
                context=None if _now.get("positions") is None else dict(positions=_now["positions"],
                                                                         scores=_now["scores"]))))

    DistributedDataParallel.__init__ = _noting_ddp_init

    if RECORD_DIR and torch.distributed.is_available():
        import torch.distributed.device_mesh

        _init_device_mesh = torch.distributed.device_mesh.init_device_mesh

        def _noting_init_device_mesh(*args, **kwargs):
            """This rank's coordinates in a mesh with named dimensions (FSDP's own unnamed 1-D mesh is left out)."""
            mesh = _init_device_mesh(*args, **kwargs)
            if mesh.mesh_dim_names:
                _now["mesh"] = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
            return mesh

        torch.distributed.device_mesh.init_device_mesh = _noting_init_device_mesh
        torch.distributed.init_device_mesh = _noting_init_device_mesh
    BatchSampler.__iter__ = _recording_batches

    if RECORD_DIR:
        import atexit

        _ddp_forward, _optimizer_init = DistributedDataParallel.forward, torch.optim.Optimizer.__init__
        _backward, _exit = torch.Tensor.backward, os._exit

        def _noting_ddp_forward(self, *args, **kwargs):
            _now["in_ddp"] += 1
            try:
                return _ddp_forward(self, *args, **kwargs)
            finally:
                _now["in_ddp"] -= 1

        def _noting_optimizer_init(self, *args, **kwargs):
            import weakref

            _optimizer_init(self, *args, **kwargs)
            _optimizers.append(weakref.ref(self))

        def _noting_backward(self, *args, **kwargs):
            if _now["in_pass"] and self.numel() == 1:  # a loss: weighted by its batch's size, as the steps average
                _now["losses"].append(self.item())
                _now["loss"] += _now["losses"][-1] * _now["batch"]
                _now["samples"] += _now["batch"]
            return _backward(self, *args, **kwargs)

        def _noting_exit(code=0):
            crashed = code != 0 or hasattr(sys, "last_value")  # an uncaught exception sets it before atexit runs
            if _passes[0] and not crashed:
                import torch.distributed as dist

                _append("exits.jsonl", json.dumps(dict(pid=os.getpid(), rank=_now["rank"], restart=_restart(),
                                                       open=dist.is_available() and dist.is_initialized())))

        def _exiting_now(code):
            _noting_exit(code)
            _exit(code)

        def _note_draw(kind, tensor):
            """Add the state of the default generator of `tensor`'s device, which the call about to run draws its mask
            from, to the pass's digest of `kind` (not while torch.compile traces: no state is read then)."""
            import hashlib

            if not _now["in_pass"] or torch.compiler.is_compiling():
                return
            state = torch.cuda.get_rng_state(tensor.device) if tensor.is_cuda else torch.get_rng_state()
            _now["draws"].setdefault(kind, hashlib.sha1()).update(state.numpy().tobytes())

        _dropout, _attention = torch.nn.functional.dropout, torch.nn.functional.scaled_dot_product_attention

        def _traced(tensor):
            """Whether `tensor` only stands for one while torch.compile traces (a FakeTensor: no mask is drawn)."""
            from torch._subclasses.fake_tensor import is_fake

            return is_fake(tensor)

        def _noting_dropout(input, p=0.5, training=True, inplace=False):
            if training and p > 0 and not _traced(input):
                _note_draw("dropout", input)
            return _dropout(input, p, training, inplace)

        def _noting_attention(query, *args, **kwargs):
            if kwargs.get("dropout_p", args[3] if len(args) > 3 else 0.0) > 0 and not _traced(query):
                _note_draw("attention", query)
            return _attention(query, *args, **kwargs)

        def _noting_reduce_scatter(reduce_scatter):
            def noting(*args, **kwargs):
                if _now["in_pass"]:
                    tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
                    _now["reduce_scatter_dtypes"].add(str(getattr(tensor, "dtype", None)).replace("torch.", ""))
                return reduce_scatter(*args, **kwargs)
            return noting

        for _name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # FSDP's, in torch 2.6 and 2.14
            if hasattr(torch.distributed, _name):
                setattr(torch.distributed, _name, _noting_reduce_scatter(getattr(torch.distributed, _name)))

        def _noting_object_collective(name, collective):
            def noting(*args, **kwargs):
                import traceback

                caller = traceback.extract_stack()[-2]
                _append("objects.jsonl", json.dumps(dict(pid=os.getpid(), rank=_rank(), restart=_restart(),
                                                         collective=name, caller=[caller.filename, caller.lineno])))
                return collective(*args, **kwargs)
            return noting

        for _name in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"):
            setattr(torch.distributed, _name, _noting_object_collective(_name, getattr(torch.distributed, _name)))
        torch.nn.functional.dropout = _noting_dropout
        torch.nn.functional.scaled_dot_product_attention = _noting_attention
        DistributedDataParallel.forward = _noting_ddp_forward
        torch.optim.Optimizer.__init__ = _noting_optimizer_init
        torch.Tensor.backward = _noting_backward
        os._exit = _exiting_now
        atexit.register(_noting_exit)

if RECORD_DIR:
    def _record_chunks(stage_module):
        """Wrap the pipeline stage's forward_one_chunk and backward_one_chunk, which every schedule calls once per
        micro-batch and pass."""
        base = stage_module._PipelineStageBase
        forward_one_chunk, backward_one_chunk = base.forward_one_chunk, base.backward_one_chunk
        steps = [-1]  # the schedule's steps begun in this process

        def note(stage, kind, microbatch, began, **more):
            _append("pipeline.jsonl", json.dumps(dict(
                pid=os.getpid(), rank=_rank(), restart=_restart(), stage=stage.stage_index, step=steps[0],
                microbatch=microbatch, began=began, ended=time.time(), **{"pass": kind}, **more)))

        def recording_forward(self, chunk, *args, **kwargs):
            if chunk == 0:
                steps[0] += 1
            from utils.memory import saved_for_backward  # each storage once, the weights not counted

            began = time.time()
            with saved_for_backward() as saved:
                result = forward_one_chunk(self, chunk, *args, **kwargs)
            note(self, "forward", chunk, began, saved=saved.bytes)
            return result

        def recording_backward(self, chunk, *args, **kwargs):
            began = time.time()
            result = backward_one_chunk(self, chunk, *args, **kwargs)
            note(self, "backward", chunk, began)
            return result

        base.forward_one_chunk, base.backward_one_chunk = recording_forward, recording_backward

    sys.meta_path.insert(0, _PatchOnImport("torch.distributed.pipelining.stage", _record_chunks))

    def _record_context(context_module):
        """Wrap utils/context.py's split_sequence (the positions of the sequence a rank trains on) and the ring's
        chunk pairs (the query-key scores a rank computes: n x n per pair, per head and sequence)."""
        import contextlib

        pairs, split_sequence = context_module.Ring.pairs, context_module.split_sequence

        def counting_pairs(self, held):
            for pair in pairs(self, held):
                _now["scores"] = _now.get("scores", 0) + self.n * self.n
                yield pair

        @contextlib.contextmanager
        def noting_split_sequence(*args, **kwargs):
            with split_sequence(*args, **kwargs) as positions:
                _now["positions"] = [int(position) for position in positions]
                try:
                    yield positions
                finally:
                    _now["positions"] = None

        context_module.Ring.pairs, context_module.split_sequence = counting_pairs, noting_split_sequence

    sys.meta_path.insert(0, _PatchOnImport("utils.context", _record_context))  # step 9's exchange

    def _record_routes(moe_module):
        """Wrap utils/moe.py's MoE._record, which every training forward of a MoE layer calls with its router's
        probabilities: the experts each token goes to, as the layer picks them (topk of the same probabilities)."""
        record = moe_module.MoE._record

        def noting_record(self, probs, counts):
            if _now["in_pass"]:
                chosen = probs.topk(self.top_k, dim=-1).indices.flatten()
                _now["routes"].append(chosen.to(torch.uint8).cpu().numpy().tobytes().hex())
            return record(self, probs, counts)

        moe_module.MoE._record = noting_record

    sys.meta_path.insert(0, _PatchOnImport("utils.moe", _record_routes))  # step 10's routers

if RECORD_DIR or KILL_AT_STEP:
    import hashlib
    import signal

    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from torch.utils.data import dataloader

    _taken, _read = [0], {}  # optimizer steps this process began; what the DataLoader handed it last (step 12's)
    _next_item = dataloader._BaseDataLoaderIter.__next__

    def _noting_next_item(self):
        item = _next_item(self)
        if RECORD_DIR and type(self._dataset).__name__ == "Shares":
            inputs, targets = item
            _read.update(rows=[
                hashlib.sha1(row_in.numpy().tobytes() + row_out.numpy().tobytes()).hexdigest()[:16]
                for row_in, row_out in zip(inputs.cpu(), targets.cpu())])
        return item

    def _before_optimizer_step(optimizer, args, kwargs):
        if all(float(group.get("lr", 1.0)) == 0.0 for group in optimizer.param_groups):
            return  # not a training step: torch.distributed.checkpoint gives Adam its state so, before it loads one
        _taken[0] += 1
        if KILL_AT_STEP == f"{_restart()}:{_rank()}:{_taken[0]}":
            os.kill(os.getpid(), signal.SIGKILL)
        if RECORD_DIR and _read:
            _append("batches.jsonl", json.dumps(dict(pid=os.getpid(), rank=_rank(), restart=_restart(),
                                                     mesh=_now["mesh"], step=_taken[0], **_read)))
            _read.clear()

    dataloader._BaseDataLoaderIter.__next__ = _noting_next_item
    register_optimizer_step_pre_hook(_before_optimizer_step)

if RECORD_STEPS:
    import math

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _steps, _buckets, _rounds = [0], [0], []  # optimizer steps taken; since the last one: buckets, rounds' squares
    # (a list per round of its buckets' summed squares: appended, never added in place, because the buckets'
    # all-reduces complete on gloo's threads, possibly at once, and `+=` from two threads can lose one)

    def _counting_all_reduce(state, bucket):
        """DDP's own all-reduce of one bucket of gradients (the default hook), counted. DDP hands a backward's
        buckets over in order, from bucket 0; their all-reduces may complete in any order."""
        if bucket.index() == 0:
            _rounds.append([])  # a new round
        squares = _rounds[-1]
        _buckets[0] += 1

        def note(future):
            averaged = future.value()
            squares.append(float(averaged.double().pow(2).sum()))
            return averaged

        return allreduce_hook(state, bucket).then(note)

    def _recording_step(optimizer, args, kwargs):
        _append("steps.jsonl", json.dumps(dict(
            pid=os.getpid(), rank=_rank(), restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            step=_steps[0], at=time.time(), lr=optimizer.param_groups[0]["lr"], rounds=len(_rounds),
            buckets=_buckets[0], grad_norms=[math.sqrt(math.fsum(squares)) for squares in _rounds])))
        _steps[0] += 1
        _buckets[0] = 0
        _rounds.clear()

    register_optimizer_step_pre_hook(_recording_step)

if SKIP_ALL_REDUCE:
    import torch.distributed as dist

    _skip_rank, _skip_call = map(int, SKIP_ALL_REDUCE.split(":"))
    _calls = [0]
    _all_reduce = dist.all_reduce

    def _all_reduce_but_skip_one(*args, **kwargs):
        _calls[0] += 1
        if int(os.environ.get("RANK", -1)) == _skip_rank and _calls[0] == _skip_call:
            print(f"[job] rank {_skip_rank} skips its all_reduce number {_skip_call}", flush=True)
            time.sleep(120)  # ended by the launcher once the other ranks have failed; bounded all the same
        return _all_reduce(*args, **kwargs)

    dist.all_reduce = _all_reduce_but_skip_one

if STALL_INIT:
    import torch.distributed as dist

    _init_process_group = dist.init_process_group

    def _stalling_init_process_group(*args, **kwargs):
        stalled, _, late = STALL_INIT.partition(":")
        if os.environ.get("RANK") == stalled and late:
            print(f"[job] rank {stalled} reaches init_process_group {late} s late", flush=True)
            time.sleep(float(late))
            print(f"[job] rank {stalled} calls init_process_group", flush=True)
        elif os.environ.get("RANK") == stalled:
            print(f"[job] rank {stalled} does not reach init_process_group", flush=True)
            time.sleep(120)  # ended by the launcher once the other ranks have failed; bounded all the same
        return _init_process_group(*args, **kwargs)

    dist.init_process_group = _stalling_init_process_group

if HOLD:
    def _hold_managers(manager_module):
        """Hold each Manager's construction until the job's go: before it, the group neither heartbeats nor asks the
        lighthouse for a quorum, so no group trains before the others are there."""
        manager_init = manager_module.Manager.__init__

        def held_init(self, *args, **kwargs):
            open(os.path.join(HOLD, f"held-{os.getpid()}"), "w").close()
            deadline = time.monotonic() + 600  # bounded all the same
            while not os.path.exists(os.path.join(HOLD, "go")) and time.monotonic() < deadline:
                time.sleep(0.02)
            manager_init(self, *args, **kwargs)

        manager_module.Manager.__init__ = held_init

    sys.meta_path.insert(0, _PatchOnImport("torchft.manager", _hold_managers))

if RECORD_COLLECTIVES:
    import threading
    import traceback
    import weakref

    import torch
    import torch.distributed as dist
    import torch.futures
    from torch import nn
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _sequence, _optimizer_steps, _in_backward = [0], [0], [0]
    _lock = threading.Lock()
    _COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
                    "broadcast", "all_to_all_single", "all_to_all", "isend", "irecv", "send", "recv", "barrier",
                    "reduce", "gather", "scatter")
    # Two measurements that cost time a benchmark of the same job would see, switched on by the plugin of the exercise
    # that needs them (exercises/07_ddp_by_hand/recorder.py): an asynchronous all_reduce run on a copy of its tensor
    # (_NotedWork), and the collectives' tensors still alive listed at each step (`held`).
    _OPTIONS = dict(copy_in_flight=False, note_held=False)
    _ready = []  # [time, bytes] of each gradient the backward under way has accumulated, in order
    _given = []  # (weak reference to a tensor given to a collective (its base, for a view), seq, step, op, caller)
    _parameters = []  # weak references to every parameter a module registered: their memory is the model's

    def _tensors_in(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from _tensors_in(item)

    def _caller():
        """The innermost calling frame outside the Python and torch installation: [file, line, function]."""
        installed = (sys.base_prefix, sys.prefix, os.path.dirname(os.__file__), os.path.dirname(__file__),
                     *_PLUGIN_FILES)
        for frame in reversed(traceback.extract_stack()[:-2]):
            if not frame.filename.startswith(installed) and "site-packages" not in frame.filename:
                return [frame.filename, frame.lineno, frame.name]
        return None

    def _note(**fields):
        _append("collectives.jsonl", json.dumps(dict(pid=os.getpid(), rank=_rank(), restart=_restart(), **fields)))

    class _NotedWork:
        """The Work an asynchronous collective returns, its waits noted (when each was called and when it returned).

        With the plugin ddp_by_hand, an asynchronous all_reduce runs on a copy of the tensor it was given, which this
        Work copies back into the tensor at the first wait (Work.wait(), or a wait on its future or on a future
        chained to it): what the program wrote into the tensor between the call and that wait is seen exactly, by
        comparing the tensor with what it held at the call (`written` in the wait's line), however fast gloo was;
        and a tensor never waited for never receives the sum. Gloo itself writes the sum into the tensor at some
        moment in between, so a program that writes there before its wait computes what its timing decides: the
        check makes it one thing."""

        def __init__(self, work, sequence, tensor=None, copy=None, before=None):
            self._work, self._sequence = work, sequence
            self._tensor, self._copy, self._before = tensor, copy, before
            self._finished, self._written, self._future = False, False, None

        def _finish(self):
            if self._finished:
                return
            self._work.wait()
            self._finished = True
            if self._tensor is not None:
                self._written = not torch.equal(self._tensor, self._before)
                with torch.no_grad():
                    self._tensor.copy_(self._copy)
            if self._future is not None and not self._future.done():
                self._future.set_result([self._tensor] if self._tensor is not None else self._work.result())
            self._tensor = self._copy = self._before = None  # the program's tensor is held by the program alone

        def _noted_wait(self, via):
            began, again = time.time(), self._finished
            if again and via == "future":
                return  # a callback reading its future's value, or a wait on a chain: the Work's wait is noted
            self._finish()
            _note(event="wait", seq=self._sequence, began=began, ended=time.time(), step=_optimizer_steps[0],
                  via=via, again=again, written=self._written and not again, caller=_caller())

        def wait(self, *args, **kwargs):
            self._noted_wait("work")
            return True

        def get_future(self):
            if self._future is None:
                self._future = _NotedFuture([self])
                if self._finished:
                    self._future.set_result(self._work.result())
            return self._future

        def __getattr__(self, name):
            return getattr(self._work, name)

    class _NotedFuture(torch.futures.Future):
        """The future of a noted Work, or one chained to it (then(), collect_all()): a wait on it is a wait on those
        Works (see _NotedWork)."""

        def __init__(self, works):
            super().__init__()
            self._works = works

        def _waited(self):
            for work in self._works:
                work._noted_wait("future")

        def wait(self):
            self._waited()
            return super().wait()

        def value(self):
            self._waited()
            return super().value()

        def then(self, callback):
            return _chained(super().then(callback), self._works)

    def _chained(future, works):
        """`future` (a torch future) as a _NotedFuture of `works`, completed as it completes."""
        noted = _NotedFuture(works)

        def complete(done):
            try:
                noted.set_result(done.value())
            except Exception as error:
                noted.set_exception(error)

        future.add_done_callback(complete)
        return noted

    _collect_all = torch.futures.collect_all

    def _noting_collect_all(futures):
        works = [work for future in futures if isinstance(future, _NotedFuture) for work in future._works]
        return _chained(_collect_all(futures), works) if works else _collect_all(futures)

    def _noting_wait_all(futures):
        for future in futures:
            if isinstance(future, _NotedFuture):
                future._waited()
        return [future.wait() for future in _collect_all(futures).wait()]

    torch.futures.collect_all, torch.futures.wait_all = _noting_collect_all, _noting_wait_all

    def _noting_collective(name, collective):
        def noting(*args, **kwargs):
            with _lock:
                _sequence[0] += 1
                sequence = _sequence[0]
            tensors = list(_tensors_in(list(args) + list(kwargs.values())))
            group = kwargs.get("group")
            peers = [kwargs.get(key) for key in ("dst", "src", "group_dst", "group_src")]
            if name in ("isend", "irecv", "send", "recv") and len(args) > 1:
                peers.append(args[1])
            peer = next((peer for peer in peers if peer is not None), None)
            splits = {key: list(kwargs[key]) for key in ("output_split_sizes", "input_split_sizes")
                      if kwargs.get(key) is not None}
            if name == "all_to_all_single" and len(args) > 2:
                splits.update(output_split_sizes=list(args[2] or []), input_split_sizes=list(args[3] or [])
                              if len(args) > 3 else [])
            caller = _caller()
            for tensor in tensors:
                base = tensor if tensor._base is None else tensor._base
                _given.append((weakref.ref(base), sequence, _optimizer_steps[0], name, caller))
            tensor, copy = None, None
            asynchronous = kwargs.get("async_op", len(args) > 3 and name == "all_reduce" and args[3])
            if _OPTIONS["copy_in_flight"] and name == "all_reduce" and asynchronous and tensors:
                tensor = tensors[0]
                copy = tensor.detach().clone()
                args, kwargs = ((copy, *args[1:]), kwargs) if args else ((), dict(kwargs, tensor=copy))
            began = time.time()
            work = collective(*args, **kwargs)
            _note(event="call", seq=sequence, op=name, began=began, ended=time.time(),
                  asynchronous=work is not None, bytes=[t.numel() * t.element_size() for t in tensors],
                  dtypes=sorted({str(t.dtype).replace("torch.", "") for t in tensors}), peer=peer,
                  group_size=dist.get_world_size(group) if dist.is_initialized() else None,
                  in_backward=_in_backward[0] > 0, step=_optimizer_steps[0], caller=caller, **splits)
            if work is None:
                return None
            if tensor is not None:
                return _NotedWork(work, sequence, tensor, copy, tensor.detach().clone())
            return _NotedWork(work, sequence)
        noting.__wrapped__ = collective
        return noting

    # One wrapper per op, in both modules: torch's own checks compare with the module's functions (P2POp's op must be
    # distributed_c10d's isend or irecv, and a script passes torch.distributed's).
    for _name in _COLLECTIVES:
        if hasattr(dist.distributed_c10d, _name):
            _wrapper = _noting_collective(_name, getattr(dist.distributed_c10d, _name))
            for _module in (dist, dist.distributed_c10d):
                setattr(_module, _name, _wrapper)

    def _noting_ready(parameter):
        _ready.append([time.time(), parameter.grad.numel() * parameter.grad.element_size()])

    _register_parameter = nn.Module.register_parameter

    def _noting_register_parameter(self, name, param):
        """Every parameter a module registers: noted (weakly), and a hook of its own, registered before any of the
        program's, that notes when backward has accumulated its gradient."""
        _register_parameter(self, name, param)
        if param is not None and param.requires_grad and not any(ref() is param for ref in _parameters[-64:]):
            _parameters.append(weakref.ref(param))
            param.register_post_accumulate_grad_hook(_noting_ready)

    nn.Module.register_parameter = _noting_register_parameter

    _backward_for_collectives = torch.Tensor.backward

    def _noting_backward_times(self, *args, **kwargs):
        began = time.time()
        outermost = not _in_backward[0]
        if outermost:
            _ready.clear()
        _in_backward[0] += 1
        try:
            return _backward_for_collectives(self, *args, **kwargs)
        finally:
            _in_backward[0] -= 1
            _note(event="backward", began=began, ended=time.time(), step=_optimizer_steps[0],
                  ready=list(_ready) if outermost else [])

    torch.Tensor.backward = _noting_backward_times

    def _state_bytes(optimizer):
        return sum(value.numel() * value.element_size() for state in optimizer.state.values()
                   for value in state.values() if isinstance(value, torch.Tensor) and value.dim() > 0)

    def _storage(tensor):
        return tensor.untyped_storage().data_ptr()

    def _held(optimizer):
        """The tensors given to collectives that are still alive as this step begins, each storage once (the model's
        parameters and the optimizer's state left out: they are held anyway), as {"seq", "step", "op", "caller",
        "bytes"} of the first call each was given to; those of this step's calls first."""
        models = {_storage(p) for p in (ref() for ref in _parameters) if p is not None}
        models |= {_storage(p) for group in optimizer.param_groups for p in group["params"]}
        models |= {_storage(value) for state in optimizer.state.values() for value in state.values()
                   if isinstance(value, torch.Tensor)}
        alive = [(ref(), sequence, step, op, caller) for ref, sequence, step, op, caller in _given]
        _given[:] = [entry for entry, (tensor, *_) in zip(_given, alive) if tensor is not None]
        held, seen = [], set()
        for tensor, sequence, step, op, caller in sorted((entry for entry in alive if entry[0] is not None),
                                                         key=lambda entry: (entry[2] != _optimizer_steps[0],
                                                                            entry[1])):
            storage = _storage(tensor)
            if storage in models or storage in seen:
                continue
            seen.add(storage)
            held.append(dict(seq=sequence, step=step, op=op, caller=caller,
                             bytes=tensor.untyped_storage().nbytes()))
        return held

    def _noting_step_began(optimizer, args, kwargs):
        _note(event="step", step=_optimizer_steps[0], began=time.time(),
              params=sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"]),
              grads=sum(p.grad.numel() * p.grad.element_size() for group in optimizer.param_groups
                        for p in group["params"] if p.grad is not None),
              held=_held(optimizer) if _OPTIONS["note_held"] else None)

    def _noting_step_ended(optimizer, args, kwargs):
        _note(event="stepped", step=_optimizer_steps[0], ended=time.time(), state=_state_bytes(optimizer))
        _optimizer_steps[0] += 1

    register_optimizer_step_pre_hook(_noting_step_began)
    register_optimizer_step_post_hook(_noting_step_ended)

if RECORD_DIR and os.environ.get("JOB_RECORD_PLUGINS"):
    import importlib
    import importlib.util

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
