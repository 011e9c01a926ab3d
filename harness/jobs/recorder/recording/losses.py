"""The losses of a pass, for samples.jsonl: `losses`, every loss this rank called backward() on in the pass, in order
(a step's, or each micro-batch's); `loss`, their mean weighted by batch size (what an all-reduce averages over
ranks)."""
import torch

from .passes import _now


def note_losses():
    """Note each loss (a tensor of one element) that Tensor.backward is called on during a pass, with its batch's
    size."""
    backward = torch.Tensor.backward

    def noting_backward(self, *args, **kwargs):
        if _now["in_pass"] and self.numel() == 1:  # a loss: weighted by its batch's size, as the steps average
            _now["losses"].append(self.item())
            _now["loss"] += _now["losses"][-1] * _now["batch"]
            _now["samples"] += _now["batch"]
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = noting_backward
