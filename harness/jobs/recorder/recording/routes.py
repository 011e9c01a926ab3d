"""Step 10's routers (utils/moe.py), for samples.jsonl: `routes`, for each training forward of a MoE layer in the pass,
in order (step by step, layer by layer), the experts the router chose for each of this rank's tokens, its top_k in the
order of choice, as the hex of one byte an assignment; None elsewhere. Patched in when the job imports utils.moe."""
import torch

from .notes import patch_on_import
from .passes import _now


def note_routes():
    """Note the experts each token goes to, once (if ever) the job imports utils.moe."""
    patch_on_import("utils.moe", _record_routes)


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
