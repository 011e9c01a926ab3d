"""Prepare the token files step 12 (long_run.py) reads from disk: a text's documents, one character a token, cut into
sequences of the GPT's context and written as uint16 ids (utils/data.py: prepare).

    python tools/prepare_data.py data/help            # Python's help pages: a document per topic (the default)
    python tools/prepare_data.py data/stdlib --source stdlib      # every .py file of Python's standard library
    python tools/prepare_data.py data/mine --files a.txt b.txt    # your UTF-8 files, a document each
    python tools/prepare_data.py data/help-gpu --workload gpt-gpu # the GPU size's context (256) instead of 64
    python tools/prepare_data.py data/short --max_chars 1500      # the help pages of 1,500 characters or fewer

It prints what it wrote. Characters, not sub-words: the vocabulary is the text's own (a hundred or so characters,
written in meta.json), a sample reads as it is written, and nothing is trained or downloaded first; a sub-word
tokenizer would put four times fewer tokens in a sequence, at the price of a vocabulary learned beforehand.
"""
import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python tools/prepare_data.py` from anywhere

import numpy as np  # noqa: E402

from utils.data import PAD  # noqa: E402
from utils.arguments import positive_int  # noqa: E402
from utils.gpt import SIZES, size_of  # noqa: E402

HELD_OUT_FRACTION = 0.1  # the last tenth of the documents is never trained on


def prepare(folder, documents, name, context):
    """Write the data folder of `documents` (texts, in order) for a GPT of `context` tokens: each document cut into
    sequences of context + 1 characters that overlap by one (the last one of a document padded with PAD), as uint16
    ids, the first nine tenths of the documents in train.bin and the rest in val.bin, one document at a time; and
    meta.json: the vocabulary (every character of every document), the context, and what each file holds."""
    if os.path.exists(folder):
        raise SystemExit(f"error: {folder} exists already: give the token files a new folder (nothing was changed)")
    vocab = "".join(sorted(set().union(*map(set, documents))))
    if len(vocab) >= PAD:
        raise SystemExit(f"error: {name} has {len(vocab):,} distinct characters; a token file holds fewer than {PAD:,}")
    ids, digest = {char: i for i, char in enumerate(vocab)}, hashlib.sha256()
    split, meta = int(len(documents) * (1 - HELD_OUT_FRACTION)), dict(vocab=vocab, context=context)
    # A file without a sequence would stop long_run.py (nothing to train on, or no held-out loss): said here instead.
    for part, texts in (("train", documents[:split]), ("val", documents[split:])):
        if not any(len(text) >= 2 for text in texts):
            raise SystemExit(f"error: {name} leaves {part}.bin without a sequence: of its {len(documents)} "
                             f"document{'s' * (len(documents) != 1)}, the first nine tenths ({split}) are trained on "
                             f"and the rest ({len(documents) - split}) held out, and each file needs one of 2 "
                             "characters or more; give more documents (several --files, or a text cut into several): "
                             "nothing was written")
    # Written into a folder of its own, renamed into place once whole: a crash leaves no half-written token files.
    final, folder = folder, f"{str(folder).rstrip(os.sep)}.{os.getpid()}.tmp"
    os.makedirs(folder)
    for part, texts in (("train", documents[:split]), ("val", documents[split:])):
        sequences = tokens = 0
        with open(os.path.join(folder, f"{part}.bin"), "wb") as file:
            for text in texts:
                digest.update(text.encode())
                if len(text) < 2:
                    continue  # a document of one character holds no target
                pieces = np.fromiter((ids[char] for char in text), dtype=np.uint16, count=len(text))
                starts = range(0, len(pieces) - 1, context)
                block = np.full((len(starts), context + 1), PAD, dtype=np.uint16)
                for row, start in enumerate(starts):
                    piece = pieces[start:start + context + 1]
                    block[row, :len(piece)] = piece
                file.write(block.tobytes())
                sequences, tokens = sequences + len(starts), tokens + len(pieces) - 1
        meta[part] = dict(documents=len(texts), sequences=sequences, targets=tokens)
    meta["text"] = dict(name=name, characters=sum(map(len, documents)), sha256=digest.hexdigest()[:16])
    with open(os.path.join(folder, "meta.json"), "w") as file:
        json.dump(meta, file, indent=1)
    os.rename(folder, final)
    return meta


def help_topics():
    """Python's help pages, a document per topic, in the order of their names."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "Python's help pages", [topics[key] for key in sorted(topics)]


def stdlib_sources():
    """Every .py file of this Python's standard library (site-packages left out), a document each, by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in root.rglob("*.py") if "site-packages" not in path.parts)
    return "Python's standard library", [path.read_text(encoding="utf-8", errors="replace") for path in files]


def own_files(paths):
    """UTF-8 files of one's own, a document each; one line for a file that is not one."""
    documents = []
    for path in paths:
        try:
            documents.append(Path(path).read_text(encoding="utf-8").replace("\r\n", "\n"))
        except (OSError, UnicodeDecodeError) as error:
            raise SystemExit(f"error: cannot read {path} as UTF-8 text ({type(error).__name__})") from None
    return ", ".join(Path(path).name for path in paths), documents


def write(folder, source="help", files=None, workload="gpt", max_chars=None):
    """What the command line does: prepare the folder, and say what it holds."""
    began = time.perf_counter()
    name, documents = own_files(files) if files else (help_topics() if source == "help" else stdlib_sources())
    if max_chars:
        name, documents = f"{name} of at most {max_chars:,} characters", [d for d in documents if len(d) <= max_chars]
    meta = prepare(folder, documents, name, size_of(workload).context)
    for part in ("train", "val"):
        counts = meta[part]
        print(f"{folder}/{part}.bin: {counts['documents']:,} documents, {counts['sequences']:,} sequences of "
              f"{meta['context']} + 1, {counts['targets']:,} tokens that count")
    print(f"{name}: {meta['text']['characters']:,} characters, a vocabulary of {len(meta['vocab'])}, "
          f"{time.perf_counter() - began:.1f} s")


def short_help_pages(max_chars=1500, workload="gpt-cpu"):
    """The token files of the help pages of at most `max_chars` characters, for `workload`'s context, that the tests,
    notebook 12 and the demo train on: written once in a test session (tools.jobs.shared_folder), the path to them."""
    from tools.jobs import shared_folder

    def make(folder):
        name, documents = help_topics()
        prepare(str(folder), [d for d in documents if len(d) <= max_chars], f"{name} of at most {max_chars:,} "
                "characters", size_of(workload).context)

    return shared_folder(f"help-{max_chars}-{workload}", make)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="Where to write train.bin, val.bin and meta.json")
    parser.add_argument("--source", choices=["help", "stdlib"], default="help", help="The documents to prepare")
    parser.add_argument("--files", nargs="+", help="UTF-8 files of your own instead, a document each")
    parser.add_argument("--workload", default="gpt", choices=[f"gpt-{size}" for size in SIZES] + ["gpt"],
                        help="The GPT whose context the sequences have (gpt: the GPU size where CUDA is available)")
    parser.add_argument("--max_chars", type=positive_int, help="Only the documents of at most this many characters")
    args = parser.parse_args()
    write(args.folder, args.source, args.files, args.workload, args.max_chars)


if __name__ == "__main__":
    main()
