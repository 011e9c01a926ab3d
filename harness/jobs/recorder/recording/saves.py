"""Saves: every torch.save to a file, noted (JOB_RECORD_DIR) and made slower (JOB_SLOW_SAVE), and each rank's writes
of a torch.distributed.checkpoint save made slower. (torch.save to a stream is left alone: DCP's items go to streams.)

Records, in JOB_RECORD_DIR:
- begins.jsonl: a JSON line as each save to a file begins (`what`: "save"; pid, rank, restart, `began`), written before
  the work: a save that a kill cuts short shows. (samples.py writes the lines of passes that begin.)
- writes.tsv: a line `pid<TAB>rank<TAB>path` per torch.save to a file, so a reader can tell how many processes wrote
  files and which ranks they were ("-": no process group).
- saves.jsonl: a JSON line per torch.save to a file: pid, rank, restart, path, `began` and `ended`, and `stack`, the
  calling frames outside the Python and torch installation ([file, line, function], outermost first).

A slow disk, JOB_SLOW_SAVE=SECONDS (with or without JOB_RECORD_DIR): every torch.save to a file takes that much longer:
it sleeps once the bytes are written, before it returns (the file being written is there, not yet renamed into place),
so a rank that does not wait for the snapshot to be on disk shows it. Each rank's writes of a
torch.distributed.checkpoint save take that much longer too (in the thread of an asynchronous save): its folder is
there, its metadata not yet.
"""
import json
import os
import time

import torch

from .notes import _append, _rank, _restart, _stack

_save = torch.save  # torch's own: what a plugin saves its measurements with, neither noted nor slowed


def note_and_slow_down_saves(record, slow):
    """From now on each torch.save to a file is noted in begins.jsonl before it writes (when `record`), sleeps `slow`
    seconds once written, and is then noted in writes.tsv and saves.jsonl."""

    def recording_save(obj, f, *args, **kwargs):
        to_file, began = isinstance(f, (str, os.PathLike)), time.time()
        if to_file and record:  # noted before the write too: a save that a kill cuts short leaves no saves.jsonl
            _append("begins.jsonl", json.dumps(dict(what="save", pid=os.getpid(), rank=_rank(), restart=_restart(),
                                                    began=began)))
        result = _save(obj, f, *args, **kwargs)
        if to_file and slow:
            time.sleep(slow)
        if to_file and record:
            rank = _rank()
            _append("writes.tsv", f"{os.getpid()}\t{'-' if rank is None else rank}\t{os.path.abspath(f)}")
            _append("saves.jsonl", json.dumps(dict(pid=os.getpid(), rank=rank, restart=_restart(),
                                                   path=os.path.abspath(f), began=began, ended=time.time(),
                                                   stack=_stack())))
        return result

    torch.save = recording_save


def slow_down_checkpoint_writes(slow):
    """Each rank's writes of a torch.distributed.checkpoint save sleep `slow` seconds once done."""
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        written = write_data(self, plan, planner)
        time.sleep(slow)
        return written

    FileSystemWriter.write_data = slow_write_data
