"""Diffing a parallel run against the single-process run: every aligned op's values mapped through their layout.

Under data, fully-sharded or tensor parallelism no rank holds the single process's values: rank r holds its slice
of the batch, its shard of a weight, or its share of a gradient that an all-reduce sums later. Comparing rank r's
op with the single process's op by op (as ``engine.diff_ranks`` does for two runs of one layout) calls every such
value a difference. Here each op of the reference that every rank runs (aligned per rank, as ``align`` does) is
compared once for all ranks: its outputs on the W ranks are mapped onto the reference's through the layout that
fits (``compare.layout``: replicated, sharded on a dimension, partial), and the step's inputs the ops read
(parameters, the batch) the same way. What is not computation is not compared: the ops one side alone runs (the
collectives, DDP's bucket copies, FSDP's copy-in and copy-out, the slicing of the batch) are how layouts are made and
rejoined, and are listed as layout ops.

A correct parallel run maps everywhere at factor 1, except partial values that are the sum of per-rank means (the
loss, and the local gradients before their all-reduce: the reference is their average, factor 1/world). The first
op, in the reference's order, whose outputs map under no layout, or only at another factor, and whose inputs did
map, is where the runs part: a scale applied on every rank (a loss scaled by the world size twice), partial sums
used without their all-reduce, per-rank statistics that should be global (BatchNorm without SyncBatchNorm, a mean
over uneven token counts), a shard taken at the wrong offset. Ops after it that read what it made inherit it.

Random ops (dropout) are not compared: each rank draws its own numbers, so their outputs and what reads them are
judged only if they map anyway.

One module per part: ``result`` (the typed results), ``engine`` (the mapping op by op), ``mapping`` (one
tensor through its layouts), ``experts`` (expert parallelism: the ops one rank holds, rows routed by all-to-alls),
``factors``, ``words``, ``paths``, ``alignment``, ``declared``, ``refusals``, ``steps``.
"""
from replaydiff.diff.parallel.result import Departure, Mapped, MappedOp, ParallelDeparture, ParallelDiff
from replaydiff.diff.parallel.steps import StepsOf, only_steps, steps_of
from replaydiff.diff.parallel.mapping import close_for
from replaydiff.diff.parallel.words import earlier_step
from replaydiff.diff.parallel.engine import (diff_parallel, diff_parallel_groups, is_parallel_groups, is_parallel_pair,
                                                same_program)
