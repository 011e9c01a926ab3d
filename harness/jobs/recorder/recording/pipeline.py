"""A pipeline's schedule as it ran, not as it was planned: pipeline.jsonl, a JSON line per micro-batch pass of a
torch.distributed.pipelining stage: pid, rank, restart, `stage`, `step` (the schedule's step in this process, from 0),
`pass` ("forward" or "backward"), `microbatch`, `began` and `ended` (time.time()), and for a forward `saved`, the bytes
of the tensors autograd kept for its backward (activations; the stage's parameters not counted). Patched in when the
job imports torch.distributed.pipelining (importing it costs 1.5 s: jobs without it do not pay)."""
import json
import os
import time

from .notes import _append, _rank, _restart, patch_on_import


def record_stage_passes():
    """Note each micro-batch pass of a pipeline stage, once (if ever) the job imports torch.distributed.pipelining."""
    patch_on_import("torch.distributed.pipelining.stage", _record_chunks)


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
