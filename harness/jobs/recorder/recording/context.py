"""Step 9's exchange (utils/context.py), for samples.jsonl: `context`, {"positions": the positions of each sequence
this rank trained on, "scores": the query-key scores its ring attention computed in the pass, forward and backward,
per head and sequence}; None in a job without it. Patched in when the job imports utils.context."""
import contextlib

from .notes import patch_on_import
from .passes import _now


def note_context():
    """Note the positions and scores of step 9's ring, once (if ever) the job imports utils.context."""
    patch_on_import("utils.context", _record_context)


def _record_context(context_module):
    """Wrap utils/context.py's split_sequence (the positions of the sequence a rank trains on) and the ring's chunk
    pairs (the query-key scores a rank computes: n x n per pair, per head and sequence)."""
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
