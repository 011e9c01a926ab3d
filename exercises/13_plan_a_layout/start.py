"""Exercise 13 - plan a layout: choose how step 11's mesh lays out a job before renting the GPUs.

The job: the 8B GPT (utils/gpt.SHAPES["8b"]: 32 blocks, 32 heads, 4,096 wide, a vocabulary of 128,256, a context of
8,192 tokens; 7.5e9 weights) trained by one_mesh.py on 2 nodes of 8 H100s (80 GB each; NVLink inside a node, one
400 Gb/s InfiniBand port a GPU between the nodes), in bf16, 8 sequences a dp rank a step. Choose the layout below:
pp (pipeline ranks, two stages each), tp (the ranks that split each block), the micro-batches a step and whether
each block is recomputed in backward; dp is what is left of the 16 GPUs (16 / (PP x TP)).

A good layout fits (every rank's peak memory under 85% of an 80 GB GPU: the rest is for the CUDA context, NCCL's
buffers and fragmentation), keeps tensor parallelism's traffic inside a node, and steps about as fast as the best
layout that fits (within 10% of its MFU, on paper). Try layouts with the planner, then check yours:
    python plan_at_scale.py --world 16 --size 8b --batch_size 8 --pp 8 --tp 1 --microbatches 8
    python exercises/check.py 13 my_layout.py
The checker runs the planner on your layout (each kind of rank traced: minutes) and says what is wrong. Hints
in exercises/13_plan_a_layout/hints.md.
"""
PP = 8  # TODO: pipeline ranks: 1, 2, 4 or 8 (each holds 2 of the 2 x PP stages; the GPT has 34 layers)
TP = 1  # TODO: tensor-parallel ranks: they must divide the 32 heads and the 8,192 positions
MICROBATCHES = 8  # TODO: the 8 sequences of a step in this many micro-batches: a multiple of PP, dividing 8
CHECKPOINT_ACTIVATIONS = False  # TODO: recompute each block in backward: keep its input alone, not its activations
