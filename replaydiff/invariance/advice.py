"""What to do about an op whose result depends on the batch, by kind of op (the kinds are aten.py's op sets).

A batch-variant op reduces in an order its kernel picks from the problem's size: a matmul's split of K or its
blocking by the number of rows, an attention kernel's split of the keys, a reduction tiled by the batch. The remedy
follows the kind: a batch-invariant kernel for it (Thinking Machines' ``batch_invariant_ops`` replaces matmul,
log_softmax and mean with kernels of one reduction order), a fixed split size, or torch's deterministic algorithm
where the cause is an atomic accumulation.
"""
from __future__ import annotations

from enum import Enum

from replaydiff import aten


class Advice(Enum):
    MATMUL = ("matmul", "its kernel picks its blocking or split of K by the number of rows: use a batch-invariant "
              "matmul (batch_invariant_ops' matmul: one tile and split size whatever the rows), or pad the rows to "
              "a count the kernel treats alike")
    CONVOLUTION = ("convolution", "the algorithm is chosen by the input's size: fix it (torch.backends.cudnn."
                   "benchmark off, torch.backends.cudnn.deterministic on) or use one kernel for every batch size")
    ATTENTION = ("attention", "its kernel splits the keys by the batch (split-KV / flash-decoding): use a fixed "
                 "split size (FlexAttention or batch_invariant_ops' attention with fixed block sizes)")
    DETERMINISTIC = ("atomic accumulation", "it accumulates with atomics, in an order that changes run to run and "
                     "with the batch: torch.use_deterministic_algorithms(True) picks a deterministic kernel")
    CUSTOM = ("custom kernel", "a kernel of your own (or a library's) whose reduction order follows the batch: give "
              "it one split size and one order whatever the rows")
    REDUCTION = ("reduction", "its reduction is split by the batch size: use a batch-invariant kernel "
                 "(batch_invariant_ops' log_softmax and mean) or one with a fixed split size")

    def __init__(self, kind: str, remedy: str) -> None:
        self.kind = kind
        self.remedy = remedy


def advice_for(name: str) -> Advice:
    """The advice for an op by its name (``aten.mm.default``)."""
    if aten.namespace(name) not in ("aten", "prims"):
        return Advice.CUSTOM
    packet = aten.packet(name)
    if packet in aten.MATMUL_PACKETS:
        return Advice.MATMUL
    if packet in aten.CONVOLUTION_PACKETS:
        return Advice.CONVOLUTION
    if "attention" in packet:
        return Advice.ATTENTION
    if packet in aten.CUDA_NONDETERMINISTIC_PACKETS:
        return Advice.DETERMINISTIC
    return Advice.REDUCTION
