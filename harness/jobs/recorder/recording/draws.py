"""What decides dropout's masks, for samples.jsonl: `draws`, {"dropout": ..., "attention": ...}, a digest of the state
the default generator of the input's device was in at every call of F.dropout and of the attention's
F.scaled_dot_product_attention that dropped something in the pass (in order; a kind missing: no such call). Two ranks
with equal digests drew the same masks for tensors of the same shapes; with different ones, other masks."""
import hashlib

import torch

from .passes import _now


def note_draws():
    """Note the generator's state at each call of F.dropout and F.scaled_dot_product_attention that drops something."""
    dropout, attention = torch.nn.functional.dropout, torch.nn.functional.scaled_dot_product_attention

    def noting_dropout(input, p=0.5, training=True, inplace=False):
        if training and p > 0 and not _traced(input):
            _note_draw("dropout", input)
        return dropout(input, p, training, inplace)

    def noting_attention(query, *args, **kwargs):
        if kwargs.get("dropout_p", args[3] if len(args) > 3 else 0.0) > 0 and not _traced(query):
            _note_draw("attention", query)
        return attention(query, *args, **kwargs)

    torch.nn.functional.dropout = noting_dropout
    torch.nn.functional.scaled_dot_product_attention = noting_attention


def _note_draw(kind, tensor):
    """Add the state of the default generator of `tensor`'s device, which the call about to run draws its mask from,
    to the pass's digest of `kind` (not while torch.compile traces: no state is read then)."""
    if not _now["in_pass"] or torch.compiler.is_compiling():
        return
    state = torch.cuda.get_rng_state(tensor.device) if tensor.is_cuda else torch.get_rng_state()
    _now["draws"].setdefault(kind, hashlib.sha1()).update(state.numpy().tobytes())


def _traced(tensor):
    """Whether `tensor` only stands for one while torch.compile traces (a FakeTensor: no mask is drawn)."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)
