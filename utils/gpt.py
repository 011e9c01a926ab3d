"""The "gpt" workload: a small GPT that learns to write like its text, one character at a time.

A decoder-only transformer in the style of nanoGPT's character-level Shakespeare model, trained on text that every
machine already has: the help pages of CPython's own documentation (`pydoc_data.topics`, part of the standard
library, about 465,000 characters), or a UTF-8 text file of your own (a GPT step's `--text FILE`, or
$TUTORIAL_GPT_TEXT). No download, no files exchanged between ranks: every process reads the same text and builds
bit-identical tensors and initial weights. The model remembers which text it learned (its state_dict holds the text's
name, length and hash): loading it into a model of another text stops with one line instead of going on with
shifted characters.

Two sizes of the same model:

    "cpu"  2 layers, 4 heads, 64 wide, context 64, no dropout: writes words after a minute on a laptop's cores
    "gpu"  6 layers, 8 heads, 384 wide, context 256, dropout 0.2: nanoGPT's shakespeare-char model, ~10.8M weights,
           with 8 heads of 48 instead of 6 of 64, so that tensor parallelism splits them over 1, 2, 4 or 8 GPUs

`gpt(seed)` picks "gpu" when CUDA is available and "cpu" otherwise; `gpt_cpu` and `gpt_gpu` pick one by name, and
`size_of(workload)` says which size a workload's name trains, before anything is built.
`dropout=` (a GPT step's `--dropout`, or $TUTORIAL_GPT_DROPOUT) overrides the size's dropout: 0 for exact
comparisons, where every rank then computes what one process would.

Besides the Workload itself: encode() and decode() between text and token ids, unwrap() to find the GPT inside
DDP or torch.compile, and flops_per_token(model), what one trained token costs (for the MFU, utils/loop.py).
"""
import contextlib
import copy
import dataclasses
import hashlib
import inspect
import math
import os
import sys
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from utils.mlp import MLP
from utils.moe import MoE
from utils.workload import Workload

TEXT_VARIABLE = "TUTORIAL_GPT_TEXT"  # a UTF-8 text file to train on instead of Python's help pages
DROPOUT_VARIABLE = "TUTORIAL_GPT_DROPOUT"  # overrides the size's dropout, e.g. 0 for exact comparisons
HELD_OUT_FRACTION = 0.1  # the last 10% of the text is never trained on


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    n_layer: int  # transformer blocks
    n_head: int  # attention heads per block; n_embd must be a multiple of it
    n_embd: int  # width of the residual stream
    context: int  # tokens the model sees at once (block_size in nanoGPT)
    dropout: float  # on embeddings, attention weights, attention output and MLP output; 0 for exact comparisons
    lr: float  # AdamW's peak learning rate (a warm-up + cosine schedule in the step scales it)
    betas: tuple
    weight_decay: float  # decoupled (AdamW) decay, on weight matrices and embeddings only: see make_optimizer
    vocab_size: int = 0  # filled in from the text: one token per distinct character
    experts: int = 0  # a mixture of experts: each block's MLP as this many MLPs and a router (0: one MLP)
    top_k: int = 2  # the experts each token goes to
    capacity_factor: float = 0.0  # > 0: an expert takes at most this x its even share of a batch's tokens


SIZES = {
    # Small enough to learn visibly in a minute on 2 CPU cores: 0.12M weights. A learner gives it a few hundred
    # optimizer steps, far too few to over-fit 0.4M characters, so no dropout (it also cost a third of the speed).
    # Measured here, one process of 1 thread, 800 steps of 64 sequences on the help pages: held-out loss 1.38 with
    # lr 6e-3 (1.52 with dropout 0.1); 128 wide at lr 1e-3, as before, is 4x slower a step and had reached 2.25 after
    # 104 steps. python benchmarks/gpt_learns.py measures it.
    "cpu": GPTConfig(n_layer=2, n_head=4, n_embd=64, context=64, dropout=0.0, lr=6e-3, betas=(0.9, 0.99),
                     weight_decay=0.1),
    # nanoGPT's config/train_shakespeare_char.py: "baby GPT", batch 64 of 256 characters, lr 1e-3, betas (0.9, 0.99),
    # but 8 heads of 48 where nanoGPT has 6 of 64: the same weights and FLOPs (heads only cut the width into parts),
    # and a head count that tensor parallelism splits over 8-GPU nodes (--tp 1, 2, 4 or 8). benchmarks/gpt_heads.py
    # compares the two.
    "gpu": GPTConfig(n_layer=6, n_head=8, n_embd=384, context=256, dropout=0.2, lr=1e-3, betas=(0.9, 0.99),
                     weight_decay=0.1),
}
# Shapes of large models, to plan jobs for (plan_at_scale.py, tools/memory_plan.py), never trained here: THIS GPT
# (LayerNorm, biases, a 4x GELU MLP, learned positions, an untied head) at the depths, widths and heads of Llama 3.2 1B,
# Llama 3 8B and 70B and Llama 3.1 405B, with their vocabulary and a context of 8,192; not Llama (RMSNorm, SwiGLU,
# rotary positions, grouped keys and values): 1.35e9, 7.53e9, 66.6e9 and 410e9 weights.
SHAPES = {name: GPTConfig(n_layer=layers, n_head=heads, n_embd=width, context=8192, dropout=0.0, lr=3e-4,
                          betas=(0.9, 0.95), weight_decay=0.1, vocab_size=128256)
          for name, layers, heads, width in (("1b", 16, 32, 2048), ("8b", 32, 32, 4096), ("70b", 80, 64, 8192),
                                             ("405b", 126, 128, 16384))}
# The mixture-of-experts GPT of each size ("gpt-moe", utils/moe.py): every block's MLP as this many experts of its
# shape, so the weights grow that many times while a token's compute grows top_k times.
MOE_EXPERTS = {"cpu": 4, "gpu": 8}


# ---------------------------------------------------------------------------------------------------- the text

def help_pages():
    """CPython's help pages, the text behind help("assert"), help("for")...: in every CPython install."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "".join(topics[key] for key in sorted(topics))  # sorted keys: the same order in every process


def text_needed(context):
    """The characters a text needs for a GPT of `context` tokens: its held-out tenth must hold 4 blocks of context."""
    return 10 * 4 * (context + 1)


def load_text(path, min_chars):
    """(name, text): the UTF-8 file at `path` (None: $TUTORIAL_GPT_TEXT's), else CPython's help pages. One clear
    line if the file is unusable, or if the text is shorter than `min_chars` (text_needed: a long --context needs a
    long text, the help pages too)."""
    given = f"--text {path}" if path else f"{TEXT_VARIABLE}={os.environ.get(TEXT_VARIABLE)}"
    path = path or os.environ.get(TEXT_VARIABLE)
    if not path:
        text = help_pages()
        if len(text) < min_chars:
            raise SystemExit(f"error: Python's help pages have {len(text):,} characters, and a context of "
                             f"{min_chars // 40 - 1:,} tokens needs at least {min_chars:,} (its held-out tenth must "
                             "hold 4 blocks of it): lower --context, or give a longer --text")
        return "Python's help pages", text
    try:
        with open(path, "rb") as file:
            text = file.read().decode("utf-8-sig")  # strict: a wrong byte stops here; a leading BOM is dropped
    except UnicodeDecodeError as error:
        raise SystemExit(f"error: {given} is not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8 "
                         "or leave it out to train on Python's help pages") from None
    except OSError as error:  # missing, a directory, no permission...
        raise SystemExit(f"error: cannot read {given} ({error.strerror or type(error).__name__}); point it at a UTF-8 "
                         "text file or leave it out to train on Python's help pages") from None
    text = text.replace("\r\n", "\n")  # the same file checked out on Windows gives the same tokens
    if len(text) < min_chars:
        raise SystemExit(f"error: {given} has {len(text):,} characters; this model size needs at least "
                         f"{min_chars:,} (its held-out tenth must hold a few blocks of its context)")
    return os.path.basename(path), text


def text_identity(name, text):
    """What a model remembers of the text it learns: its name, its length and the start of its SHA-256."""
    return dict(name=name, characters=len(text), sha256=hashlib.sha256(text.encode()).hexdigest()[:16])


def encode(text, vocab):
    """Characters -> token ids (positions in `vocab`, a sorted string of distinct characters), as int64."""
    codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()  # one code point each
    vocab_codes = torch.tensor([ord(char) for char in vocab])
    ids = torch.searchsorted(vocab_codes, codes)  # vocab is sorted, so the position is a binary search away
    if len(codes) and (ids.max() >= len(vocab) or not torch.equal(vocab_codes[ids.clamp(max=len(vocab) - 1)], codes)):
        raise ValueError(f"characters not in the vocabulary: {sorted(set(text) - set(vocab))[:10]}")
    return ids


def decode(ids, vocab):
    return "".join(vocab[i] for i in ids.tolist())


def blocks_of(tokens, context):
    """Consecutive, non-overlapping blocks of context+1 tokens: x = block[:-1], y = block[1:] (the next character).

    Block i holds tokens [i*context, i*context + context + 1): neighbours share one token, so every token of the
    split is a target exactly once per epoch. The tail shorter than a block is dropped (< context tokens).
    """
    blocks = tokens.unfold(0, context + 1, context)  # (n_blocks, context + 1), a view: no copy yet
    return TensorDataset(blocks[:, :-1].contiguous(), blocks[:, 1:].contiguous())


# ---------------------------------------------------------------------------------------------------- the model

class Embedding(nn.Module):
    """Token ids (B, T) -> vectors (B, T, C): what the character is, plus where it stands (learned positions)."""

    def __init__(self, config):
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.n_embd)
        self.position = nn.Embedding(config.context, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        # The positions of the tokens it is given: 0..T-1, unless a step gives it a part of each sequence
        # (context_parallel.py: each rank the positions of its chunks in the whole sequence).
        self.positions = None

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device) if self.positions is None else self.positions
        return self.dropout(self.token(ids) + self.position(positions))


class CausalSelfAttention(nn.Module):
    """Each position mixes in the positions before it (never after: the next character must not leak in).

    Queries, keys and values come from three matrices, not one fused (C, 3C) one, and the number of heads is read off
    the shape of the queries: so tensor_parallel.py can split each matrix column-wise (Megatron-style), and a rank
    holding 1/N of the columns computes n_head/N whole heads. Unsplit, it computes what a fused matrix would (one
    fused matrix multiply is three of these side by side; the initial weights are drawn in the same order too).
    """

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.head_size = config.n_embd // config.n_head
        self.q = nn.Linear(config.n_embd, config.n_embd)  # what each position looks for
        self.k = nn.Linear(config.n_embd, config.n_embd)  # what it offers to be found by
        self.v = nn.Linear(config.n_embd, config.n_embd)  # what it passes on when found
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.attention_dropout = config.dropout  # on the attention weights, inside the fused kernel
        self.dropout = nn.Dropout(config.dropout)  # on the output
        # Where the dropout of the attention weights draws its masks: the default generator, unless a step gives the
        # attention a generator of its own (tensor_parallel.py: each rank its own heads' masks).
        self.generator = None
        # What computes the attention of q, k and v instead of scaled_dot_product_attention, when a step gives it one
        # (context_parallel.py: the keys and values exchanged with the ranks that hold the sequence's other parts).
        self.attend = None

    def forward(self, x):
        B, T, _ = x.shape
        # (B, T, C) each, or (B, T, C/N) on a rank that holds 1/N of the heads: the heads are counted, not assumed
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // self.head_size
        q, k, v = (t.view(B, T, heads, self.head_size).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hs)
        # softmax(q k^T / sqrt(hs)) v with the causal mask, fused (flash attention on recent GPUs)
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.attend is not None:
            y = self.attend(q, k, v, dropout_p)
        else:
            with contextlib.nullcontext() if self.generator is None else drawing_from(self.generator):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(B, T, heads * self.head_size)  # the heads side by side again
        return self.dropout(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.n_embd)
        self.attention = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.n_embd)
        if config.experts:  # the mixture-of-experts GPT
            self.mlp = MoE(config)
        else:
            self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final LayerNorm and the linear map to one score (logit) per character of the vocabulary."""

    def __init__(self, config):
        super().__init__()
        self.norm = nn.LayerNorm(config.n_embd)
        self.linear = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # not tied to the embedding: see GPT

    def forward(self, x):
        return self.linear(self.norm(x))


class GPT(nn.Sequential):
    """Embedding -> block0 ... blockN-1 -> Head: token ids (B, T) in, logits (B, T, vocab) out.

    An nn.Sequential on purpose: each block is a direct child, so a step that shards `model.children()` one by one
    (fsdp.py) gets one FSDP unit per block, and only one block's full weights exist at a time. Blocks kept in an
    nn.ModuleList would be a single child: sharded as one unit, all of them gathered at once.

    The head is not tied to the token embedding (nanoGPT ties them): with ~100 characters the embedding is 0.4% of
    the weights, so tying saves next to nothing, and a weight shared by two children cannot be sharded with each.
    """

    def __init__(self, config, vocab, text=None):
        layers = dict(GPT.layers(config))
        super().__init__(OrderedDict([("embed", layers.pop("embed")), *layers.items()]))
        self.config = config
        self.vocab = vocab  # a plain attribute, not a buffer: decoding needs it, the state_dict and DDP do not
        self.text = text  # text_identity() of what it learns: in the state_dict, see get_extra_state
        # What GPT-2's init draws, in the order it draws it: every weight matrix and embedding (a normal of std 0.02),
        # then again the matrices that write into the residual stream, smaller, so that the sum over 2 x n_layer of
        # them starts at unit scale. The whole model's list, kept while a step deletes the layers of other ranks.
        self.draws = [(f"{name}.weight", module.weight.shape, 0.02) for name, module in self.named_modules()
                      if isinstance(module, (nn.Linear, nn.Embedding))]
        self.draws += [(name, param.shape, 0.02 / math.sqrt(2 * config.n_layer))
                       for name, param in self.named_parameters() if name.endswith("proj.weight")]
        self.init_weights()

    @staticmethod
    def layers(config):
        """(name, layer) for a new GPT, built in this order, which draws torch's own initial weights (init_weights
        replaces them, but their draws move the random generator on): the blocks, the embedding, the head."""
        for i in range(config.n_layer):
            yield f"block{i}", Block(config)
        yield "embed", Embedding(config)
        yield "head", Head(config)

    @torch.no_grad()
    def init_weights(self, seed=None):
        """GPT-2's initial weights, the same whatever the layout: each weight of the whole model is drawn whole, on the
        CPU, from the default generator, in the order of self.draws, and this model keeps its part of it: all of it in
        one process; a pipeline stage, the layers it holds; a DTensor (FSDP's shard of tensor parallelism's slice),
        its own shard. Biases start at 0, the norms' gains at 1.

        `seed`: for a model built on the meta device and given memory later (one_mesh.py, on every rank): the draws
        of one process that builds the GPT on the CPU with that seed are made again first, layer by layer, so that
        every rank starts from that process's very weights, with no seed checkpoint. Every rank then draws the whole
        model twice (its building and GPT-2's): about 8 ns a weight on one CPU core (docs/one-mesh.md)."""
        # The weights this model holds, by their names in the whole GPT: a block in checkpoint_wrapper (activation
        # checkpointing) holds its layers under a prefix of its own.
        held = {name.replace("_checkpoint_wrapped_module.", ""): param for name, param in self.named_parameters()}
        if any(param.is_meta for param in held.values()):
            return  # shapes without memory: nothing to draw into yet
        # A weight the draws do not know by its name would keep what its memory held: say which, rather than train it.
        unknown = sorted(name for name in set(held) - {name for name, _, _ in self.draws}
                         if not name.endswith(".bias") and ".norm" not in name)
        if unknown:
            raise RuntimeError(f"init_weights draws no weight named {unknown[0]}: a wrapper renamed it")
        if seed is not None:
            torch.manual_seed(seed)
            with torch.device("cpu"):
                for _ in GPT.layers(self.config):
                    pass
        # Memory given after the meta device holds whatever was there before: every weight is drawn or set.
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
        for name, shape, std in self.draws:
            whole = torch.empty(shape, device="cpu").normal_(mean=0.0, std=std)
            if name in held:
                copy_part(whole, held[name])

    def get_extra_state(self):
        """Saved in the state_dict beside the weights (as `_extra_state`): the text the model learns. A copy of it: a
        sharded load (DCP) writes the snapshot's values into the very dicts of the state_dict it fills, and the text
        set_extra_state compares the snapshot's with must stay this model's own."""
        return dict(text=copy.deepcopy(self.text))

    def set_extra_state(self, state):
        """Loading weights learned on another text would go on with every character's id shifted: refuse."""
        theirs = state.get("text")
        if self.text and theirs and theirs["sha256"] != self.text["sha256"]:
            raise ValueError(f"it holds a GPT of another text ({theirs['name']}, {theirs['characters']:,} characters) "
                             f"than this run's ({self.text['name']}, {self.text['characters']:,} characters): give "
                             "the text it was trained on (--text; step 12: --data), or another --snapshot_path to "
                             "start anew")


def copy_part(whole, param):
    """Copy into `param` its part of the tensor `whole`: all of it, or for a DTensor (a weight sharded by FSDP, split by
    tensor parallelism, or both) the shard this rank holds, cut by DTensor's own rules (distribute_tensor) from the
    whole, which every rank has: with no communication where torch allows it (2.7 and later), else scattered from the
    mesh's first rank, which holds the same whole."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no weight can be a DTensor
    if dtensor is None or not isinstance(param, dtensor.DTensor):
        return param.copy_(whole)
    local = {"src_data_rank": None} if "src_data_rank" in inspect.signature(dtensor.distribute_tensor).parameters else {}
    part = dtensor.distribute_tensor(whole, param.device_mesh, param.placements, **local)
    return param.to_local().copy_(part.to_local())


@contextlib.contextmanager
def drawing_from(generator):
    """Inside it, random operations on `generator`'s device draw from `generator` (its state moves on) instead of the
    device's default generator, which is left where it was. For operations that take no generator of their own, such
    as the dropout inside scaled_dot_product_attention: Megatron's model-parallel RNG tracker does the same."""
    device = generator.device
    if device.type == "cuda":
        get, put = (lambda: torch.cuda.get_rng_state(device)), (lambda state: torch.cuda.set_rng_state(state, device))
    else:
        get, put = torch.get_rng_state, torch.set_rng_state
    default = get()
    put(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(get())
        put(default)


def size_of(workload):
    """The GPTConfig that the GPT workload `workload` ("gpt", "gpt-cpu", "gpt-gpu", "gpt-moe", "gpt-moe-cpu"...)
    trains, as gpt() picks it: the GPU size for "gpt" and "gpt-moe" where CUDA is available. Its vocabulary size is
    unknown (0) until a text is read."""
    parts = workload.split("-")
    size = parts[-1] if parts[-1] in SIZES else ("gpu" if torch.cuda.is_available() else "cpu")
    return dataclasses.replace(SIZES[size], experts=MOE_EXPERTS[size]) if "moe" in parts else SIZES[size]


def unwrap(model):
    """The GPT inside DDP(...) and/or torch.compile(...)."""
    while not isinstance(model, GPT):
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if model is None:
            raise TypeError("not a GPT, nor a DDP or torch.compile wrapper of one")
    return model


# ---------------------------------------------------------------------------------------------------- training

def next_token_loss(logits, targets):
    """Cross-entropy of the next character, averaged over every position of every sequence (per token).

    logits (B, T, V), targets (B, T). In float32 even when the logits come out of bf16/fp16 autocast. Since every
    sequence has T tokens, evaluate()'s `loss * len(source)` summed and divided by the sequences is still per token.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_optimizer(model, config):
    """AdamW; weight decay on the matrices (linear weights, embeddings), none on biases and LayerNorm gains.

    Decaying a LayerNorm gain or a bias pulls it toward 0 for no benefit (nanoGPT and GPT-2 leave them out). The
    groups are picked by the parameters' shapes, so fsdp.py, which makes the optimizer after sharding (a sharded
    parameter keeps its full shape), gets the same two groups as DDP.
    """
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([dict(params=matrices), dict(params=vectors, weight_decay=0.0)],
                             lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def gpt(seed, size=None, text=None, dropout=None, context=None, experts=0, top_k=2, capacity_factor=0.0, device=None):
    """The GPT workload. size: "cpu" or "gpu", by default "gpu" when CUDA is available; text: a UTF-8 file to learn
    (None: $TUTORIAL_GPT_TEXT's, else Python's help pages); dropout: instead of the size's (None:
    $TUTORIAL_GPT_DROPOUT's if set); context: the tokens it sees at once, instead of the size's (a step's --context:
    context_parallel.py's long sequences); experts, top_k, capacity_factor: a mixture of experts (gpt_moe); device:
    where the model is built, "meta" for its shapes alone (one_mesh.py gives each rank memory for its shards only)."""
    size = size or ("gpu" if torch.cuda.is_available() else "cpu")
    if size not in SIZES:
        raise ValueError(f"unknown GPT size {size!r}; choose one of {', '.join(SIZES)}")
    config = SIZES[size]
    dropout = os.environ.get(DROPOUT_VARIABLE) if dropout is None else dropout
    if dropout is not None and dropout != "":
        config = dataclasses.replace(config, dropout=float(dropout))
    if context:
        config = dataclasses.replace(config, context=context)
    config = dataclasses.replace(config, experts=experts, top_k=top_k, capacity_factor=capacity_factor)
    name, text = load_text(text, min_chars=text_needed(config.context))
    vocab = "".join(sorted(set(text)))
    config = dataclasses.replace(config, vocab_size=len(vocab))
    tokens = encode(text, vocab)
    split = int(len(tokens) * (1 - HELD_OUT_FRACTION))  # first 90% to train on, the last 10% held out
    train_set, eval_set = blocks_of(tokens[:split], config.context), blocks_of(tokens[split:], config.context)

    torch.manual_seed(seed)  # same initial weights in every process (DDP would broadcast rank 0's anyway)
    with torch.device(device or "cpu"):
        model = GPT(config, vocab, text_identity(name, text))
    return Workload(train_set, eval_set, model, lambda model: make_optimizer(model, config), next_token_loss)


def gpt_cpu(seed, **options):
    return gpt(seed, "cpu", **options)


def gpt_gpu(seed, **options):
    return gpt(seed, "gpu", **options)


def gpt_moe(seed, size=None, **options):
    """The mixture-of-experts GPT of a size (utils/moe.py): MOE_EXPERTS[size] experts in every block; options as
    gpt()'s (top_k, capacity_factor...)."""
    size = size or ("gpu" if torch.cuda.is_available() else "cpu")
    return gpt(seed, size, experts=MOE_EXPERTS.get(size, 0), **options)


def gpt_moe_cpu(seed, **options):
    return gpt_moe(seed, "cpu", **options)


def gpt_moe_gpu(seed, **options):
    return gpt_moe(seed, "gpu", **options)


# ---------------------------------------------------------------------------------------------------- its cost

def flops_per_token(model_or_config):
    """Model FLOPs to train on one token (forward + backward): 6 N + 12 L H Q T (PaLM appendix B; nanoGPT's MFU).

    N: the weights that multiply activations: every block and the head; the embeddings are table look-ups and do
    no multiplies. A multiply-add is 2 FLOPs, and backward costs about twice forward, hence 6 per weight per token.
    12 L H Q T: attention's two products (q k^T and weights x v), each 2 T H Q FLOPs per token in each of L layers,
    times 3 for forward + backward; H heads of Q dimensions each (H Q = n_embd), over a context of T. It counts the
    whole T x T score matrix although the causal mask makes half of it unused; by convention, as in PaLM and nanoGPT.
    Divide tokens/s x this by the hardware's peak FLOP/s for the MFU. Evaluation (forward only) costs a third.
    """
    config = getattr(model_or_config, "config", model_or_config)
    L, C, T, V = config.n_layer, config.n_embd, config.context, config.vocab_size
    mlp = (4 * C * C + 4 * C) + (4 * C * C + C)
    if config.experts:  # a token goes through top_k experts' MLPs, and the router scores all of them
        mlp = config.top_k * mlp + C * config.experts
    per_block = (3 * C * C + 3 * C) + (C * C + C) + mlp + 2 * 2 * C  # + 2 norms
    n = L * per_block + (2 * C + C * V)  # + final norm and head
    return 6 * n + 12 * L * C * T
