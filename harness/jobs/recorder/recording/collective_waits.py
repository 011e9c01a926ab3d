"""The "wait" lines of collectives.jsonl (see collectives.py): each time the Work of an asynchronous call (`seq`) was
waited on, by its own wait() or by a wait on its future or on a future chained to it: `began`, `ended`, `via` "work"
or "future", `again` (it had been waited on before), `caller` ([file, line, function], the innermost frame outside the
installation), and `written`: the program wrote into the tensor of an asynchronous all_reduce between the call and
this first wait, seen with the plugin ddp_by_hand, which runs such an all_reduce on a copy of the tensor, copied back
at that wait (see _NotedWork)."""
import time

import torch
import torch.futures

from .collectives import _note, _optimizer_steps
from .notes import _caller


class _NotedWork:
    """The Work an asynchronous collective returns, its waits noted (when each was called and when it returned).

    With the plugin ddp_by_hand, an asynchronous all_reduce runs on a copy of the tensor it was given, which this Work
    copies back into the tensor at the first wait (Work.wait(), or a wait on its future or on a future chained to it):
    what the program wrote into the tensor between the call and that wait is seen exactly, by comparing the tensor with
    what it held at the call (`written` in the wait's line), however fast gloo was; and a tensor never waited for never
    receives the sum. Gloo itself writes the sum into the tensor at some moment in between, so a program that writes
    there before its wait computes what its timing decides: the check makes it one thing."""

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
    """The future of a noted Work, or one chained to it (then(), collect_all()): a wait on it is a wait on those Works
    (see _NotedWork)."""

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


def note_waits_on_futures():
    """A wait on a future that torch.futures.collect_all or wait_all made of noted futures is a wait on their Works."""
    collect_all = torch.futures.collect_all

    def noting_collect_all(futures):
        works = [work for future in futures if isinstance(future, _NotedFuture) for work in future._works]
        return _chained(collect_all(futures), works) if works else collect_all(futures)

    def noting_wait_all(futures):
        for future in futures:
            if isinstance(future, _NotedFuture):
                future._waited()
        return [future.wait() for future in collect_all(futures).wait()]

    torch.futures.collect_all, torch.futures.wait_all = noting_collect_all, noting_wait_all
