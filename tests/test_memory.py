"""utils/memory.py's saved_for_backward, the counter of what autograd keeps for backward that one_mesh.py, long_run.py,
the planner (plan_at_scale.py) and the recorder measure with: each storage once, the weights left out, and nothing
kept alive by the counting itself (a pipeline's step frees each micro-batch's activations in its backward, measured or
not)."""
import weakref

import torch

from utils.memory import saved_for_backward


def test_it_counts_each_storage_once_leaves_the_weights_out_and_keeps_nothing_alive():
    """Three micro-batches through a linear layer and a GELU, each one's backward before the next one's forward, as a
    pipeline runs them: every micro-batch's input (the linear's) and the linear's output (the GELU's) counted, each
    once though the linear saves its input and the GELU its own; the weight not; and each micro-batch's activations
    freed by its backward inside the counter, their storages dead before the next micro-batch is made."""
    layer = torch.nn.Linear(16, 32)
    freed = []
    with saved_for_backward() as saved:
        for _ in range(3):
            inputs = torch.randn(8, 16, requires_grad=True)
            hidden = layer(inputs)
            output = torch.nn.functional.gelu(hidden)
            kept = [weakref.ref(inputs.untyped_storage()), weakref.ref(hidden.untyped_storage())]
            output.sum().backward()
            del inputs, hidden, output  # freed at once, unless something else holds them
            freed.append([storage() is None for storage in kept])
    assert freed == [[True, True]] * 3, "the counter kept a micro-batch's activations alive after its backward"
    assert saved.bytes == 3 * (8 * 16 + 8 * 32) * 4  # float32: the inputs and the hidden, each micro-batch's


def test_a_storage_made_anew_where_a_freed_one_was_is_counted_again():
    """A freed storage's address is often given to the next one (here within a few of 100 micro-batches): the counter
    tells them apart (its reference to the first is dead), so 100 micro-batches of the same shapes count 100 times,
    whatever the allocator hands out."""
    addresses = set()
    with saved_for_backward() as saved:
        for _ in range(100):
            inputs = torch.randn(4, 4, requires_grad=True)
            addresses.add(inputs.untyped_storage()._cdata)
            (inputs * inputs).sum().backward()  # mul saves its input (both sides: one storage)
            del inputs  # its storage freed at once: nothing else refers to it
    assert len(addresses) < 100, "no address was given twice: this run proves nothing, run it again"
    assert saved.bytes == 100 * 4 * 4 * 4
