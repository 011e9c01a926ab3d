"""The long run's data (long_run.py, step 12), walked through line by line in docs/reference/long-run.md: a text's
documents as token files on disk (TokenFile: read row by row, never held whole), the order a run reads their
sequences in (global_batch), each dp rank's share of a global batch (Shares, HeldOut), the loss over the tokens that
count (token_loss), --skip (skip_range, batch_range) and the GPT of the files' vocabulary (model_of).

A run reads the sequences as one stream: every sequence once per epoch, in an order drawn anew each epoch from the
seed and the epoch's number, cut into global batches of a fixed number of sequences. Global batch k is positions
k x size to (k + 1) x size of that stream, whatever the number of ranks: the one number k says where a run is (its
cursor), and any number of dp ranks reads the same batches from there, each its own rows.
"""
import argparse
import dataclasses
import json
import os

import numpy as np
import torch
import torch.nn.functional as F

PAD = 65535  # a position past a document's end: no character, and no target
IGNORE = -100  # the target F.cross_entropy leaves out (its ignore_index)


def read_meta(folder):
    """The data folder's meta.json, or one line that says how to make it."""
    try:
        with open(os.path.join(folder, "meta.json")) as file:
            return json.load(file)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: --data {folder} holds no token files ({type(error).__name__}): write them first, "
                         f"e.g. `python tools/prepare_data.py {folder}`") from None


class TokenFile:
    """The sequences of a data folder's `split`.bin ("train", "val"): a rank holds the rows it reads, not the file. A
    file that is missing or holds no sequence stops with one line (a run needs sequences to train on and a held-out set
    to measure)."""

    def __init__(self, folder, split):
        self.path, self.context = os.path.join(folder, f"{split}.bin"), read_meta(folder)["context"]
        if not os.path.isfile(self.path) or len(self) == 0:
            holds = "holds no sequence" if os.path.isfile(self.path) else "is missing"
            raise SystemExit(f"error: {self.path} {holds}: a run needs sequences to train on and held-out ones to "
                             f"measure; prepare --data {folder} again (tools/prepare_data.py, from several documents)")

    def __len__(self):
        return os.path.getsize(self.path) // (2 * (self.context + 1))

    def rows(self):
        """The file as an array of rows, memory-mapped anew for each read: once the read copied its rows, the
        mapping goes, and the pages it touched with it, so a rank's memory does not grow as an epoch reads the file."""
        return np.memmap(self.path, dtype=np.uint16, mode="r").reshape(-1, self.context + 1)

    def read(self, indices):
        """(inputs, targets) of the sequences at `indices`, in that order, as int64 (B, context): the targets of a
        position past its document's end are IGNORE, its input any valid id (no position that counts attends to it)."""
        rows = torch.from_numpy(self.rows()[np.asarray(indices, dtype=np.int64)].astype(np.int64))
        padded = rows == PAD
        return rows[:, :-1].masked_fill(padded[:, :-1], 0), rows[:, 1:].masked_fill(padded[:, 1:], IGNORE)


def _shuffled(indices, count, epoch, seed):
    """The sequences at positions `indices` of epoch `epoch`'s order, a permutation of range(count) drawn from the seed
    and the epoch, computed for these positions alone: no rank holds an order of the whole file. A Feistel network
    permutes range(4^half) >= count; a result past count goes through it again until it lands in range."""
    half = max(1, ((count - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng([seed, epoch]).integers(1 << 32, size=4, dtype=np.uint64)
    order, outside = np.asarray(indices, dtype=np.uint64), np.ones(len(indices), dtype=bool)
    while outside.any():
        left, right = order[outside] >> np.uint64(half), order[outside] & mask
        for key in keys:
            mixed = (right ^ key) * np.uint64(0x45D9F3B)
            mixed = (mixed ^ (mixed >> np.uint64(16))) * np.uint64(0x2C1B3C6D)
            left, right = right, left ^ ((mixed ^ (mixed >> np.uint64(16))) & mask)
        order[outside] = left << np.uint64(half) | right
        outside = order >= count
    return torch.from_numpy(order.astype(np.int64))


def global_batch(count, batch, size, seed):
    """The indices of global batch `batch`'s `size` sequences: positions batch x size onward of the stream that holds
    each of the `count` sequences once per epoch (a batch may end an epoch and begin the next)."""
    positions = torch.arange(batch * size, (batch + 1) * size)
    return torch.cat([_shuffled(positions[positions // count == epoch] % count, count, epoch, seed)
                      for epoch in (positions // count).unique().tolist()])


class Shares(torch.utils.data.Dataset):
    """Global batch number k -> the inputs and targets of this dp rank's share of it, a contiguous 1/dp of its rows,
    read alone: no rank reads another's rows. (The targets that count in the whole global batch, the loss's divisor,
    are the shares' counts added over dp: one number a step, which the step all-reduces.) For a DataLoader whose
    sampler lists the batch numbers to read; its workers each map the file themselves."""

    def __init__(self, tokens, size, seed, dp_rank, dp):
        self.tokens, self.size, self.seed, self.share = tokens, size, seed, size // dp  # the rows of a rank's share
        self.rows = slice(dp_rank * self.share, (dp_rank + 1) * self.share)

    def __getitem__(self, batch):
        indices = global_batch(len(self.tokens), batch, self.size, self.seed)
        return self.tokens.read(indices[self.rows])


class HeldOut(Shares):
    """Held-out batch number b: the file's sequences in their order, `size` a batch, the last one filled up with rows
    that count nothing, so that every rank runs as many micro-batches (none waits for a rank that ran out of rows)."""

    def __len__(self):
        return -(-len(self.tokens) // self.size)

    def __getitem__(self, batch):
        positions = torch.arange(batch * self.size, (batch + 1) * self.size)[self.rows]
        inputs, targets = self.tokens.read(positions.clamp(max=len(self.tokens) - 1))
        targets[positions >= len(self.tokens)] = IGNORE
        return inputs, targets


def skip_range(text):
    """argparse type for --skip: `BEGIN:END`, the global batches BEGIN to END - 1."""
    begin, _, end = text.partition(":")
    if not (begin.isdigit() and end.isdigit() and int(begin) < int(end)):
        raise argparse.ArgumentTypeError(f"expected BEGIN:END, whole numbers with BEGIN < END, got {text!r}")
    return int(begin), int(end)


def batch_range(start, steps, skip, skipped, say):
    """(the numbers of the `steps` global batches a run reads from batch `start` on, the ranges it leaves out, as its
    snapshot keeps them): less its snapshot's (`skipped`: "BEGIN:END ...") and --skip's, which must be one of them
    (torchrun restarts with the same command) or begin among the batches still to read. `say`: print which."""
    ranges = [tuple(map(int, text.split(":"))) for text in skipped.split()]
    if skip and skip not in ranges:
        begin, end = skip
        if not start <= begin < start + steps:
            where = f"it resumes at global batch {start}" if begin < start else f"it reads up to batch {start + steps}"
            raise SystemExit(f"error: --skip {begin}:{end} lies outside what this run can skip ({where}, and no "
                             f"snapshot skipped that range): name global batches from {start} to {start + steps - 1}")
        ranges.append(skip)
        if say:
            print(f"skipping global batches {begin} to {end - 1} (--skip {begin}:{end}): {end - begin} batches never "
                  "trained on", flush=True)
    batches = [batch for batch in range(start, start + steps + sum(end - begin for begin, end in ranges))
               if not any(begin <= batch < end for begin, end in ranges)][:steps]
    return batches, " ".join(f"{begin}:{end}" for begin, end in ranges)


def model_of(folder, workload, dropout):
    """The GPT of `workload`'s size on the meta device for the token files of `folder` (their vocabulary, their
    context, the identity of their text: a snapshot of another text is refused), and what makes its optimizer."""
    from utils.gpt import GPT, make_optimizer, size_of

    meta, config = read_meta(folder), size_of(workload)
    if meta["context"] != config.context:
        raise SystemExit(f"error: --data {folder} holds sequences of {meta['context']} tokens, and --workload "
                         f"{workload}'s context is {config.context}: prepare them with that --workload")
    config = dataclasses.replace(config, vocab_size=len(meta["vocab"]),
                                 dropout=config.dropout if dropout is None else dropout)
    with torch.device("meta"):
        model = GPT(config, meta["vocab"], meta["text"])
    return model, lambda model: make_optimizer(model, config)


def token_loss(logits, targets):
    """The cross-entropy of every target that counts (IGNORE left out), summed: divided by the global batch's count,
    the mean over its tokens, however the batch is split into ranks and micro-batches."""
    precise = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: the loss in fp32
    return F.cross_entropy(precise.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
