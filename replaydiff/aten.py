"""What replaydiff knows about aten ops, in one place: used by the recorder, the replayer, the index and the faults.

Which namespaces hold collectives and which of their ops only wait; which ops are random, uninitialised, views or
markers; which arguments an op writes (read from the schema's alias annotations, never from op names); op-name
globs; the rank of this process. Everything here depends on torch and the bottom module
rebuild_and_judge alone, so every layer may import it.
"""
from __future__ import annotations

import fnmatch
import os
from typing import Any, Callable, Iterator

import torch

from replaydiff.rebuild_and_judge import graph_operator

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
# Collective bookkeeping with no data of its own: waiting for a result, wrapping one for autograd.
WAIT_ONLY_PACKETS = frozenset({"wait_tensor", "_wrap_tensor_autograd"})
# Markers, not computations (record_function ranges and the like).
NON_COMPUTE_NAMESPACES = frozenset({"profiler", "prims_debug"})
# Factories whose output memory is whatever the allocator held: never compared.
UNINITIALISED_PACKETS = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                                   "empty_permuted"})
def floating_dtype(name: str) -> bool:
    """A recorded dtype's name (``float32``, ``bfloat16``, ``complex64``, ``float8_e4m3fn``) whose values are
    judged by their error against a reference; every other dtype (integers, bool) is compared exactly."""
    return name.startswith(("float", "bfloat", "complex"))


# Ops that only reinterpret bits or shapes: their meaning depends on the exact recorded dtype.
DTYPE_EXACT_OPS = frozenset({"aten.view.dtype", "aten.view_as_real.default", "aten.view_as_complex.default"})
# Bookkeeping ops that cost nothing and change no value (hidden on request in the UI), beside schema views.
_CHEAP_PACKETS = frozenset({"detach", "detach_", "alias", "lift_fresh", "_unsafe_view", "clone_", "_to_copy_"})

# Outputs that are bookkeeping for the backward whose form depends on the kernel path taken, not results of the op:
# the CPU embedding_bag returns an empty offset2bag on its float32/bf16 fast path and a full one at float64. They are
# compared only when the replay runs at the recorded dtypes. (op packet -> output positions)
KERNEL_PATH_OUTPUTS = {"_embedding_bag": (1, 2, 3), "_embedding_bag_forward_only": (1, 2, 3)}

_SEEDED = torch.Tag.nondeterministic_seeded
# Kernels that write arguments their schemas leave unmarked (torch 2.13): the batch norms update running_mean and
# running_var in training although the schema says ``Tensor? running_mean``. Composite ops (batch_norm,
# instance_norm) reach these or _native_batch_norm_legit / _batch_norm_with_update, whose schemas mark the writes.
_UNANNOTATED_WRITES = {("aten", name): ("running_mean", "running_var") for name in
                       ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")}
# FSDP2 copies each rank's shards into its slot of the all-gather buffer and returns views of it; the schema
# (torch 2.13) marks nothing written, so without this the all-gather would read the buffer as it was before.
_UNANNOTATED_WRITES[("fsdp", "all_gather_copy_in")] = ("all_gather_output",)


def namespace(name: str) -> str:
    """``aten.mm.default`` -> ``aten``."""
    return name.split(".", 1)[0]


def packet(name: str) -> str:
    """``aten.mm.default`` -> ``mm``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 else name


def is_collective(name: str) -> bool:
    return namespace(name) in COLLECTIVE_NAMESPACES


# the all-reduces, c10d's (in place) and the functional ones: a sum (or other reduction) every rank gets whole
ALL_REDUCE_PACKETS = frozenset({"allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_",
                                "all_reduce_coalesced"})


def is_all_reduce(name: str) -> bool:
    return is_collective(name) and packet(name) in ALL_REDUCE_PACKETS


# the reduce-scatters: each rank gets its shard of the reduction
REDUCE_SCATTER_PACKETS = frozenset({"reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor",
                                    "reduce_scatter_tensor_coalesced"})


def reduces(name: str) -> bool:
    """A collective whose output is a reduction over the ranks (an all-reduce, a reduce-scatter)."""
    return is_collective(name) and packet(name) in ALL_REDUCE_PACKETS | REDUCE_SCATTER_PACKETS


# c10d's point-to-point ops: each pairs with its peer's op (a send with the receive on its destination), not with the
# k-th call of every rank of its group, as the group collectives do.
POINT_TO_POINT_PACKETS = frozenset({"send", "recv_", "recv_any_source_"})


def is_point_to_point(name: str) -> bool:
    return namespace(name) == "c10d" and packet(name) in POINT_TO_POINT_PACKETS


def is_wait_only(name: str) -> bool:
    return is_collective(name) and packet(name) in WAIT_ONLY_PACKETS


# A compiled unit (record/unit_capture.py): one call of a torch.compile graph is one record named compiled.unit.<kind>.
UNIT_NAMESPACE = "compiled"


def unit_name(kind: str) -> str:
    """``forward`` -> ``compiled.unit.forward``."""
    return f"{UNIT_NAMESPACE}.unit.{kind}"


def is_unit(name: str) -> bool:
    return namespace(name) == UNIT_NAMESPACE


def graph_target_name(target: Any) -> str:
    """The name a graph node's target is stored under: ``aten.erf.default``, ``operator.getitem``, or the
    qualified name of anything else (which replay refuses)."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or type(target).__module__
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__qualname__
    if module in ("_operator", "operator"):
        module = "operator"
    return f"{module}.{qual}"


def resolve_graph_target(name: str) -> Any:
    """A unit graph's node target by name: a registered aten/prims op or one of the ``operator`` functions allowed
    (``rebuild_and_judge.graph_operator``: the one allowlist, which the standalone repro script reads too);
    UnknownOp (with the reason) for anything else, so that a trace can never make replay call other code."""
    try:
        f = graph_operator(name)
    except ValueError as exc:
        raise UnknownOp(str(exc)) from None
    return f if f is not None else resolve(name)


def is_graph_plumbing(name: str) -> bool:
    """A unit graph's ``operator`` node (getitem of a tuple, arithmetic on sizes): no new tensor value of its own."""
    return namespace(name) == "operator"


def is_marker(name: str) -> bool:
    return namespace(name) in NON_COMPUTE_NAMESPACES


def matches_any(name: str | None, globs: list[str] | None) -> bool:
    """True when ``name`` matches one of ``globs`` (fnmatch, case-sensitive); no globs match everything."""
    if not globs:
        return True
    return name is not None and any(fnmatch.fnmatchcase(name, g) for g in globs)


class UnknownOp(LookupError):
    """An op name that is not registered in this process (an extension not loaded, a newer torch)."""


_RESOLVED: dict[str, Any] = {}


def resolve(name: str) -> Any:
    """``aten.mm.default`` -> ``torch.ops.aten.mm.default``, looked up among registered ops only (never imported)."""
    func = _RESOLVED.get(name)
    if func is not None:
        return func
    parts = name.split(".") if isinstance(name, str) else ()
    # Each part a plain name: an attribute such as ``__class__`` or ``load_library`` is never looked up, and what
    # is found must be an op overload, so that a name read from a trace can only ever call a registered op.
    if len(parts) != 3 or not all(p.isidentifier() and not p.startswith("__") for p in parts):
        raise UnknownOp(f"op name {name!r} is not namespace.op.overload")
    ns, op, overload = parts
    try:
        func = getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        raise UnknownOp(f"op {name} is not registered here (load the extension that defines it)") from None
    if not isinstance(func, torch._ops.OpOverload):
        raise UnknownOp(f"{name} is not an op overload")
    _RESOLVED[name] = func
    return func


def _is_write(alias_info: Any) -> bool:
    return alias_info is not None and alias_info.is_write


def _writes(func: Any, collective: bool) -> tuple[tuple[int, str, bool], ...]:
    """(position, name, kwarg_only) of each argument the op may write.

    Read from the schema's alias annotations (``Tensor(a!)``, ``Tensor(a!)?``, ``Tensor(a!)[]`` alike), plus the
    few kernels known to write what their schema leaves unmarked; collectives mark nothing written but fill their
    tensors in place, so every tensor argument of a collective counts.
    """
    unmarked = _UNANNOTATED_WRITES.get((func.namespace, func.overloadpacket.__name__), ())
    out = []
    for i, a in enumerate(func._schema.arguments):
        if collective or _is_write(a.alias_info) or a.name in unmarked:
            out.append((i, a.name, a.kwarg_only))
    return tuple(out)


def _result_writes(func: Any, writes: tuple[tuple[int, str, bool], ...], collective: bool
                   ) -> tuple[tuple[int, str, bool], ...]:
    """The written arguments that *are* the op's result: those an in-place or out= op returns (``Tensor(a!)`` in
    its returns), every written argument of an op that returns nothing (``_foreach_add_``, ``_fused_adam_``) and a
    collective's tensors. Empty for a functional op that also updates buffers (batch norm's running statistics):
    its result is its outputs, and what it writes is bookkeeping."""
    schema = func._schema
    if collective or not schema.returns:
        return writes
    returned: set[str] = set()
    for r in schema.returns:
        if _is_write(r.alias_info):
            returned |= set(r.alias_info.before_set)
    args = schema.arguments
    return tuple(w for w in writes
                 if _is_write(args[w[0]].alias_info) and returned & set(args[w[0]].alias_info.before_set))


_BUILTIN_NAMESPACES = frozenset({"aten", "prims", "prim"}) | COLLECTIVE_NAMESPACES | NON_COMPUTE_NAMESPACES


def defining_module(func: Any) -> str | None:
    """The Python module that registered a custom op (``fsdp::`` in torch.distributed.fsdp, a user's
    ``mylib::``), from the dispatcher's registration record; None when it was registered from C++ or is unknown."""
    import sys

    qualname = f"{func.namespace}::{func._schema.name.split('::')[-1]}"
    try:  # torch.library.custom_op keeps the decorated function: its module is the user's
        from torch._library.custom_ops import OPDEFS

        opdef = OPDEFS.get(qualname)
        module = getattr(getattr(opdef, "_init_fn", None), "__module__", None)
        if module:
            return module
    except Exception:
        pass
    try:
        dump = torch._C._dispatch_dump(qualname)
    except Exception:
        return None
    files = set()
    library = os.path.join(os.path.dirname(torch.__file__), "")
    for line in dump.splitlines():
        if "registered at " in line:
            where = line.split("registered at ", 1)[1].split(" :: ")[0].rsplit(":", 1)[0]
            if not where.startswith((library + "_library", library + "library.py")):  # the machinery, not the op
                files.add(where)
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if f and f in files:
            return name
    return None


class OpFacts:
    """What the recorder and the replayer need to know of one op overload, worked out once per overload."""

    __slots__ = ("name", "collective", "seeded", "uninitialised", "writes", "result_writes", "view", "module")

    def __init__(self, func: Any) -> None:
        self.name = str(func)
        # custom ops (outside aten, prims, collectives): the module that defines them, for replay to import
        self.module = defining_module(func) if func.namespace not in _BUILTIN_NAMESPACES else None
        self.collective = func.namespace in COLLECTIVE_NAMESPACES
        self.seeded = _SEEDED in func.tags
        self.uninitialised = func.overloadpacket.__name__ in UNINITIALISED_PACKETS
        self.writes = _writes(func, self.collective)
        # what a planted fault perturbs: these written arguments, or (when empty) the op's outputs
        self.result_writes = _result_writes(func, self.writes, self.collective)
        self.view = bool(getattr(func, "is_view", False))


# Keyed by id: an OpOverload's __hash__ is Python code (~0.4 us on every recorded op). The op object is kept with its
# facts, so its id is never reused by another object while the entry exists.
_FACTS: dict[int, tuple[Any, OpFacts]] = {}


def facts(func: Any) -> OpFacts:
    hit = _FACTS.get(id(func))
    if hit is not None and hit[0] is func:
        return hit[1]
    f = OpFacts(func)
    _FACTS[id(func)] = (func, f)
    return f


def iter_tensors(v: Any) -> Iterator[torch.Tensor]:
    """Every tensor in an argument: a tensor, or one inside (nested) lists and tuples, in order."""
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from iter_tensors(x)


def written_args(f: OpFacts, args: tuple | list, kwargs: dict, *, result_only: bool = False
                 ) -> list[tuple[tuple[str, int | str], Any]]:
    """(("arg", i) or ("kwarg", name), value) of each argument the op writes that holds a tensor; with
    ``result_only``, of those that are the op's result (``OpFacts.result_writes``)."""
    out: list[tuple[tuple[str, int | str], Any]] = []
    for i, name, kwarg_only in (f.result_writes if result_only else f.writes):
        if i < len(args) and not kwarg_only:
            path, v = ("arg", i), args[i]
        elif name in kwargs:
            path, v = ("kwarg", name), kwargs[name]
        else:
            continue
        if any(True for _ in iter_tensors(v)):  # a tensor, or a (nested) list holding one: allgather's list of lists
            out.append((path, v))
    return out


def written_values(f: OpFacts, args: tuple | list, kwargs: dict) -> list[Any]:
    """The arguments the op writes, whatever they hold: a graph's nodes (a unit's graph: which of its inputs an
    in-place node writes), where ``written_args`` keeps only those holding tensors."""
    out = []
    for i, name, kwarg_only in f.writes:
        if i < len(args) and not kwarg_only:
            out.append(args[i])
        elif name in kwargs:
            out.append(kwargs[name])
    return out


_CHEAP: dict[str, bool] = {}


def _named_fact(name: str, fact: str) -> bool:
    """One of ``OpFacts``' flags for an op given by name; False for a name not registered here (replaydiff's own
    records, an op of a library not loaded)."""
    try:
        return bool(getattr(facts(resolve(name)), fact))
    except UnknownOp:
        return False


def is_cheap(name: str) -> bool:
    """A view, alias, detach or marker: an op that costs nothing and computes no new value."""
    c = _CHEAP.get(name)
    if c is None:
        c = is_marker(name) or is_wait_only(name) or packet(name) in _CHEAP_PACKETS
        if not c and namespace(name) == "aten":
            c = _named_fact(name, "view")
        _CHEAP[name] = c
    return c


# Ops that hand a tensor's value to Python (``loss.item()``, ``if t:``, ``torch.equal``): what they read flows into no
# later op of the trace, so a print of the previous step's loss is not where a difference matters.
_TO_PYTHON_PACKETS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal"})


def reads_to_python(name: str) -> bool:
    """An op that hands its input's value to Python (``.item()``, ``bool(t)``) rather than computing a tensor."""
    return namespace(name) == "aten" and packet(name) in _TO_PYTHON_PACKETS


# Factories that read only the shape, dtype and device of their tensor argument, never its values (the backward of a
# loss starts with ``ones_like(loss)``): a NaN in that argument flows into no value they make.
_SHAPE_ONLY_PACKETS = frozenset({"ones_like", "zeros_like", "full_like", "empty_like", "rand_like", "randn_like",
                                 "randint_like", "new_ones", "new_zeros", "new_full", "new_empty", "new_empty_strided",
                                 "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"})


def reads_values(name: str) -> bool:
    """False for an op that reads only the shape of its tensor arguments (``ones_like``, ``new_zeros``...)."""
    return not (namespace(name) == "aten" and packet(name) in _SHAPE_ONLY_PACKETS)


_COLLATE_PACKETS = frozenset({"stack", "cat"})


def collates(name: str) -> bool:
    """An op that joins tensors into one along a new or leading dimension: how a DataLoader's default_collate makes
    a batch of a dataset's rows (``stack``)."""
    return namespace(name) == "aten" and packet(name) in _COLLATE_PACKETS


def takes_a_row(name: str) -> bool:
    """An op that takes one entry out of a dimension (``x[i]``): how a dataset's rows are taken for a collation."""
    return namespace(name) == "aten" and packet(name) == "select"


_RANDOM: dict[str, bool] = {}


def is_random(name: str) -> bool:
    """An op whose outputs are drawn from a generator (``nondeterministic_seeded``: rand, randint, dropout...);
    False for names not registered here and for replaydiff's own records."""
    r = _RANDOM.get(name)
    if r is None:
        r = _RANDOM[name] = _named_fact(name, "seeded")
    return r


def draws(name: str, args: list, kwargs: dict) -> bool:
    """Whether a recorded call of a random op drew numbers: ``is_random``, but for an op whose probability argument
    (``dropout_p`` of scaled_dot_product_attention's kernels, ``p`` of dropout) is 0 in this call (attention without
    dropout is deterministic; its kernels are tagged as seeded all the same)."""
    if not is_random(name):
        return False
    try:
        arguments = resolve(name)._schema.arguments
    except (UnknownOp, AttributeError):
        return True
    for k, a in enumerate(arguments):
        if a.name in ("dropout_p", "p"):
            v = args[k] if k < len(args) else kwargs.get(a.name, a.default_value)
            return not (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)
    return True


# -- random draws inside a compiled unit, recovered from its recorded outputs (replay/unit_replay.py) ---------------
# A compiled graph draws with the backend's own generator (inductor's seeds), which replay cannot draw again; what
# the draw decided (a dropout mask) is often among the unit's recorded outputs (saved for the backward).

def draw_reads_input_values(name: str) -> bool:
    """False for a random op whose tensor arguments give only a shape (``rand_like``, ``randn_like``...): its draw
    depends on no input value. True for the others (dropout, bernoulli of a probability tensor)."""
    return not packet(name).endswith("_like")


# uniform draws on [0, 1): op name -> (argument position, value) that must hold (inductor_random's mode), or None
_UNIFORM_DRAWS: dict[str, tuple[int, str] | None] = {
    "aten.rand.default": None, "aten.rand_like.default": None, "prims.inductor_random.default": (2, "rand")}
# comparisons of a draw against a constant: True when the draw must be above it (rand > p keeps with 1 - p)
_THRESHOLDS = {"gt": True, "ge": True, "lt": False, "le": False}


def uniform_draw(name: str, args: list) -> bool:
    """The op draws uniformly on [0, 1)."""
    if name not in _UNIFORM_DRAWS:
        return False
    need = _UNIFORM_DRAWS[name]
    return need is None or (len(args) > need[0] and args[need[0]] == need[1])


def threshold_keep(name: str, args: list, is_uniform: Callable[[Any], bool]) -> float | None:
    """The probability that ``draw OP c`` is True, for a uniform draw on [0, 1) (``is_uniform`` of the argument)
    and a constant ``c``: a mask made as ``rand > p`` (inductor's dropout). None when the op is not that."""
    if namespace(name) != "aten" or packet(name) not in _THRESHOLDS or len(args) < 2:
        return None
    draw, c = args[0], args[1]
    if not is_uniform(draw) or isinstance(c, bool) or not isinstance(c, (int, float)):
        return None
    c = min(max(float(c), 0.0), 1.0)
    return 1.0 - c if _THRESHOLDS[packet(name)] else c


def dropout_args(name: str, args: list) -> tuple[Any, float] | None:
    """(input, p) of a dropout op that returns (value, mask) with value = input * mask / (1 - p), in training mode;
    None for any other op."""
    if name != "aten.native_dropout.default" or len(args) < 2 or (len(args) > 2 and args[2] is False):
        return None
    return args[0], float(args[1])


DROPOUT_MASK_OUTPUT = 1  # native_dropout's outputs: (value, mask)


def applies_mask(name: str) -> bool:
    """The op multiplies its two tensor arguments (a decomposed dropout applies its mask so: mask * x)."""
    return name == "aten.mul.Tensor"


def scales_by_constant(name: str, args: list) -> bool:
    """The op multiplies or divides its first argument by a nonzero constant (a decomposed dropout's 1 / (1 - p)):
    zero stays zero and nonzero stays nonzero."""
    return (name in ("aten.mul.Tensor", "aten.div.Tensor") and len(args) == 2 and not isinstance(args[1], bool)
            and isinstance(args[1], (int, float)) and args[1] != 0)


def dropout_value(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """What native_dropout computes from its input and a given mask (all zeros for p = 1)."""
    if p >= 1.0:
        return torch.zeros_like(x)
    return x * mask * (1.0 / (1.0 - p))


_WRAPS: dict[tuple, bool] = {}


def wraps_tensors(types: Any) -> bool:
    """True when one of a dispatch's subclass ``types`` wraps plain tensors it unwraps itself (DTensor and other
    traceable wrapper subclasses, which define ``__tensor_flatten__``); FakeTensor and the like do not."""
    w = _WRAPS.get(types)
    if w is None:
        w = _WRAPS[types] = any(hasattr(t, "__tensor_flatten__") for t in types)
    return w


try:
    _FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
    _get_mode = torch._C._get_dispatch_mode
except AttributeError:  # an older torch: no infra-mode keys
    _FAKE_KEY = _get_mode = None


def fake_mode_active() -> bool:
    """A FakeTensorMode is running (shape propagation on tensors without data)."""
    return _get_mode is not None and _get_mode(_FAKE_KEY) is not None


def current_rank() -> tuple[int, int]:
    """(rank, world size) of this process: torch.distributed's if initialised, else $RANK / $WORLD_SIZE."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


# -- what the health report knows about causes ---------------------------------------------------------------------
# Ops whose float32 CUDA kernels run on TF32 tensor cores when torch.backends.cuda.matmul.allow_tf32 (or
# set_float32_matmul_precision("high"/"medium")) is set, and convolutions under torch.backends.cudnn.allow_tf32.
# Matrix products: each output element sums over the last dimension of the first matrix argument.
MATMUL_PACKETS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "mv", "addmv",
                            "_addmm_activation"})
# Matrix products whose first argument is a bias, added (times beta) to alpha times the product of the next two.
BIASED_MATMUL_PACKETS = frozenset({"addmm", "baddbmm", "addmv", "addbmm", "_addmm_activation"})
# Sums over dimensions: each output element adds up (a mean: then divides) the input's elements along the dims.
DIM_SUM_PACKETS = frozenset({"sum", "mean"})
# Convolutions: each output element sums over the weight's in-channels times its kernel.
CONVOLUTION_PACKETS = frozenset({"convolution", "_convolution", "conv1d", "conv2d", "conv3d"})
TF32_MATMUL_PACKETS = MATMUL_PACKETS | frozenset({"_scaled_dot_product_efficient_attention",
                                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                                 "_efficient_attention_backward", "_scaled_dot_product_efficient_attention_backward"})
TF32_CONV_PACKETS = CONVOLUTION_PACKETS | frozenset({"convolution_backward", "cudnn_convolution",
                                                     "cudnn_convolution_transpose"})
# Ops PyTorch documents as non-deterministic on CUDA (torch.use_deterministic_algorithms: those that throw without a
# deterministic kernel, and those that switch to one), plus LayerNorm backward's atomicAdd reductions.
CUDA_NONDETERMINISTIC_PACKETS = frozenset({
    "index_add", "index_add_", "index_copy", "index_copy_", "index_put", "index_put_", "_index_put_impl_",
    "_unsafe_index_put", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
    "put", "put_", "embedding_dense_backward", "embedding_backward", "_embedding_bag_backward",
    "_embedding_bag_dense_backward", "_embedding_bag_per_sample_weights_backward", "cumsum", "cumsum_",
    "histc", "bincount", "kthvalue", "median", "nll_loss2d_forward", "nll_loss2d_backward", "_ctc_loss_backward",
    "avg_pool3d_backward", "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward",
    "adaptive_max_pool2d_backward", "adaptive_max_pool3d_backward", "max_pool3d_with_indices_backward",
    "fractional_max_pool2d_backward", "fractional_max_pool3d_backward", "max_unpool2d", "max_unpool3d",
    "upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_bicubic2d_backward",
    "upsample_trilinear3d_backward", "_upsample_bilinear2d_aa_backward", "_upsample_bicubic2d_aa_backward",
    "reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward",
    "replication_pad1d_backward", "replication_pad2d_backward", "replication_pad3d_backward",
    "grid_sampler_2d_backward", "grid_sampler_3d_backward", "native_layer_norm_backward",
})


# What each result of a multi-result op is, for ops whose schema leaves its returns unnamed (max.dim names
# ``values, indices``; native_layer_norm names none): said with an output's index wherever an output is judged.
_RETURN_ROLES: dict[str, tuple[str, ...]] = {
    **{p: ("out", "mean", "rstd") for p in ("native_layer_norm", "native_group_norm")},
    **{p: ("grad_input", "grad_weight", "grad_bias") for p in (
        "native_layer_norm_backward", "native_group_norm_backward", "native_batch_norm_backward")},
    **{p: ("out", "save_mean", "save_invstd") for p in (
        "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training")},
    "_native_batch_norm_legit_functional": ("out", "save_mean", "save_invstd", "running_mean", "running_var"),
    "var_mean": ("var", "mean"),
    "std_mean": ("std", "mean"),
    "native_dropout": ("out", "mask"),
    "_fused_rms_norm": ("out", "rstd"),
}


def return_roles(name: str) -> tuple[str | None, ...]:
    """The role of each return of op ``name`` (``aten.native_layer_norm.default`` -> ``(out, mean, rstd)``): the
    schema's return names where it has them, else the table above; None for a return known by neither (or an op not
    registered here)."""
    try:
        returns = resolve(name)._schema.returns
    except (UnknownOp, AttributeError):
        return _RETURN_ROLES.get(packet(name), ())
    named = tuple(r.name or None for r in returns)
    if all(named):
        return named
    table = _RETURN_ROLES.get(packet(name))
    if table is not None and len(table) == len(named):
        return table
    return named


def argument_name(name: str, position: int | str) -> str | None:
    """The schema name of argument ``position`` of op ``name`` (a keyword argument is its own name)."""
    if isinstance(position, str):
        return position
    try:
        args = resolve(name)._schema.arguments
    except (UnknownOp, AttributeError):
        return None
    return args[position].name if 0 <= position < len(args) else None

# one row of a tensor picked by its number: a map-style dataset's ``dataset[i]`` (diff/parallel/rows.py)
ROW_PICKS = frozenset({"aten.select.int"})
