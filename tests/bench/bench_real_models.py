"""What recording costs a real model's training step: transformers' T5, GPT-2, Llama and ViT from tiny configs, a
diffusers-style UNet in plain torch (``unet``) and a Mamba-style selective scan in a Python loop with checkpointed
blocks (``scan``: small tensors, many ops).

Why: the project's own tiny transformer has few tensors per op and shallow Python around each op; transformers'
models have more of both (masks, position biases, caches, deep call stacks), and the recorder's per-op cost there
was ~6x what the tiny model showed. This measures it where users see it.

What it prints:

1. Per model, one AdamW step (``loss.backward(); opt.step(); opt.zero_grad()``), one torch thread, timed in
   interleaved rounds (each round runs every variant once, starting from a rotating variant; each variant owns its
   model built from the same seed): the whole ``with`` block (set-up, step, exit: what a user waits for) and the step
   inside the block, as ratios to the plain step's median (medians over rounds), beside a do-nothing
   TorchDispatchMode (the floor) and ``torch.utils._debug_mode.DebugMode``. Variants: plain, floor, debugmode,
   meta, stats, full (zstd, the default), stats by module (``granularity="module"``).
2. With ``--replay``: a ``full`` (zstd) trace of one step of each model, replayed at fp64 and at ``same``: replayed
   ops per second of wall time in this process (``replay_trace`` after its imports and one warm-up replay: startup
   excluded, median of ``--replay-rounds``; in brackets per CPU second of the replaying thread) and through the CLI (``python -m replaydiff replay``, a fresh process:
   startup included), with ``--workers 1`` and ``2``.
3. With ``--sections``: the recorder's per-op work in microseconds per op, part by part, measured inside the
   real step by timing the functions that do each part with the recording thread's CPU clock (bench_profile.py's
   ``sections``: the fastest of 7 steps, the timers' own cost taken off): no profiler inflates it.
4. With ``--profile``: cProfile of a recorded step per model (the recording thread), own time grouped into parts
   (``bench_profile.PARTS``) in microseconds per op, beside the project's tiny model: where the per-op time goes,
   and why a real model's op costs more. cProfile inflates small functions; the table gives each part's share and
   the profiled per-op total.

No weights are downloaded: every model is built from a config with random weights (``transformers`` is a test
dependency). ``REPLAYDIFF_SRC=DIR`` runs the replaydiff of another tree (an A/B from ``git archive``).

The UNet is written here in plain torch after diffusers' ``UNet2DModel`` (ResNet blocks with GroupNorm, SiLU and a
timestep embedding, a self-attention block in the middle, skip connections, a noise-prediction MSE loss): diffusers is
not a dependency.

Usage: ``python tests/bench/bench_real_models.py [--models t5,gpt2,llama,vit,unet,scan,tiny,mid] [--variants ...] [--rounds 7]
[--profile] [--profile-variants meta,stats,full] [--replay] [--no-timing]``.
"""
from __future__ import annotations

import os
import sys

if os.environ.get("REPLAYDIFF_SRC"):
    sys.path.insert(0, os.environ["REPLAYDIFF_SRC"])

import argparse  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replaydiff  # noqa: E402
from bench import MODELS, NoopMode, Variant, build_step, md_table  # noqa: E402
from bench_profile import builtin_part, part_of  # noqa: E402

SEED = 0
BATCH, SEQ = 4, 32

VARIANTS: dict[str, Variant] = {v.key: v for v in (
    Variant("plain", "plain step"),
    Variant("floor", "do-nothing TorchDispatchMode (floor)"),
    Variant("debugmode", "torch DebugMode()"),
    Variant("meta", "record, meta", "meta"),
    Variant("stats", "record, stats", "stats"),
    Variant("full", "record, full (zstd, default)", "full", True),
    Variant("full-raw", "record, full raw", "full", False),
    Variant("module", "record, stats, --granularity module", "stats", options=(("granularity", "module"),)),
)}


# -- models -----------------------------------------------------------------------------------------------------------
def _hf_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Callable[[], Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()

    def step() -> Any:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def build(name: str) -> Callable[[], Any]:
    """A fresh model (random weights from SEED), its AdamW optimizer and a fixed batch: the step closure."""
    if name in MODELS:
        return build_step(MODELS[name])
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    vocab = 256
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    if name == "t5":
        cfg = transformers.T5Config(vocab_size=vocab, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                    num_decoder_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                    pad_token_id=0)
        model = transformers.T5ForConditionalGeneration(cfg)
        labels = torch.randint(1, vocab, (BATCH, SEQ), generator=g)
        return _hf_step(model, {"input_ids": ids, "labels": labels})
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
        return _hf_step(model, {"input_ids": ids, "labels": ids})
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        model = transformers.LlamaForCausalLM(cfg)
        return _hf_step(model, {"input_ids": ids, "labels": ids})
    if name == "vit":
        cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128, num_labels=10,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.ViTForImageClassification(cfg)
        pixels = torch.randn(BATCH, 3, 32, 32, generator=g)
        return _hf_step(model, {"pixel_values": pixels, "labels": torch.randint(0, 10, (BATCH,), generator=g)})
    if name == "unet":
        x = torch.randn(BATCH, 3, 32, 32, generator=g)
        noise = torch.randn(BATCH, 3, 32, 32, generator=g)
        t = torch.randint(0, 1000, (BATCH,), generator=g)
        return _unet_step(_UNet(), x, noise, t)
    if name == "scan":
        return _plain_step(_SelectiveScan(), torch.randn(BATCH, SEQ, 16, generator=g))
    raise SystemExit(f"unknown model {name!r} (t5, gpt2, llama, vit, unet, scan, {', '.join(MODELS)})")


class _ResBlock(torch.nn.Module):
    """diffusers' ResnetBlock2D: GroupNorm, SiLU, conv, the timestep embedding added, GroupNorm, SiLU, conv, skip."""

    def __init__(self, cin: int, cout: int, temb: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = torch.nn.GroupNorm(8, cin), torch.nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = torch.nn.Linear(temb, cout)
        self.norm2, self.conv2 = torch.nn.GroupNorm(8, cout), torch.nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = torch.nn.Conv2d(cin, cout, 1) if cin != cout else torch.nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        act = torch.nn.functional.silu
        h = self.conv1(act(self.norm1(x))) + self.temb(act(temb))[:, :, None, None]
        return self.skip(x) + self.conv2(act(self.norm2(h)))


class _Attention(torch.nn.Module):
    """diffusers' mid-block attention: GroupNorm, single-head self-attention over the pixels, residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = torch.nn.GroupNorm(8, c), torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, hh, ww = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)
        q, k, v = self.qkv(h).chunk(3, -1)
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(h).transpose(1, 2).reshape(b, c, hh, ww)


class _UNet(torch.nn.Module):
    """A small UNet2DModel: channels (16, 32), two ResNet blocks a level, attention in the middle, 32x32 images."""

    def __init__(self, ch: tuple[int, int] = (16, 32), temb: int = 64) -> None:
        super().__init__()
        c0, c1 = ch
        self.temb = torch.nn.Sequential(torch.nn.Linear(c0, temb), torch.nn.SiLU(), torch.nn.Linear(temb, temb))
        self.conv_in = torch.nn.Conv2d(3, c0, 3, padding=1)
        self.down0 = torch.nn.ModuleList([_ResBlock(c0, c0, temb), _ResBlock(c0, c0, temb)])
        self.downsample = torch.nn.Conv2d(c0, c0, 3, stride=2, padding=1)
        self.down1 = torch.nn.ModuleList([_ResBlock(c0, c1, temb), _ResBlock(c1, c1, temb)])
        self.mid = torch.nn.ModuleList([_ResBlock(c1, c1, temb), _Attention(c1), _ResBlock(c1, c1, temb)])
        self.up1 = torch.nn.ModuleList([_ResBlock(2 * c1, c1, temb), _ResBlock(2 * c1, c1, temb)])
        self.upsample = torch.nn.Conv2d(c1, c1, 3, padding=1)
        self.up0 = torch.nn.ModuleList([_ResBlock(c1 + c0, c0, temb), _ResBlock(2 * c0, c0, temb),
                                       _ResBlock(2 * c0, c0, temb)])
        self.norm_out, self.conv_out = torch.nn.GroupNorm(8, c0), torch.nn.Conv2d(c0, 3, 3, padding=1)
        self.c0 = c0

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        half = self.c0 // 2  # sinusoidal timestep embedding, as diffusers' Timesteps
        freqs = torch.exp(-torch.arange(half, dtype=torch.float32) * (9.210340371976184 / half))
        arg = t[:, None].float() * freqs[None]
        temb = self.temb(torch.cat([arg.sin(), arg.cos()], -1))
        h = self.conv_in(x)
        skips = [h]
        for block in self.down0:
            h = block(h, temb)
            skips.append(h)
        h = self.downsample(h)
        for block in self.down1:
            h = block(h, temb)
            skips.append(h)
        h = self.mid[2](self.mid[1](self.mid[0](h, temb)), temb)
        for block in self.up1:
            h = block(torch.cat([h, skips.pop()], 1), temb)
        h = self.upsample(torch.nn.functional.interpolate(h, scale_factor=2.0, mode="nearest"))
        for block in self.up0:
            h = block(torch.cat([h, skips.pop()], 1), temb)
        return self.conv_out(torch.nn.functional.silu(self.norm_out(h)))


def _unet_step(model: torch.nn.Module, x: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> Callable[[], Any]:
    """A denoising step: noise added at timestep t (a fixed schedule), the noise predicted, MSE loss, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    alpha = (1.0 - t.float() / 1000.0)[:, None, None, None]
    noisy = alpha.sqrt() * x + (1.0 - alpha).sqrt() * noise

    def step() -> Any:
        loss = torch.nn.functional.mse_loss(model(noisy, t), noise)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


class _Mixer(torch.nn.Module):
    """A Mamba-style block: a selective scan in a Python loop over the sequence (many small ops a step)."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.inp, self.dt, self.out = torch.nn.Linear(d, 2 * d), torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.B, self.C = torch.nn.Linear(d, n), torch.nn.Linear(d, n)
        self.A = torch.nn.Parameter(-torch.rand(d, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.inp(x).chunk(2, -1)
        dt = torch.nn.functional.softplus(self.dt(u))
        b, c = self.B(u), self.C(u)
        h = torch.zeros(x.shape[0], x.shape[2], self.A.shape[1])
        ys = []
        for t in range(x.shape[1]):  # (B, d, n) state, one step at a time
            h = torch.exp(dt[:, t, :, None] * self.A) * h + dt[:, t, :, None] * b[:, t, None, :] * u[:, t, :, None]
            ys.append((h * c[:, t, None, :]).sum(-1))
        return self.out(torch.stack(ys, 1) * torch.nn.functional.silu(z))


class _SelectiveScan(torch.nn.Module):
    """Two mixer blocks, each under activation checkpointing (recomputed in the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Mixer() for _ in range(2)])
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = x + checkpoint(block, self.norm(x), use_reentrant=False)
        return x.pow(2).mean()


def _plain_step(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> Any:
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def count_ops(step: Callable[[], Any]) -> int:
    class Count(NoopMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.n


# -- timing -----------------------------------------------------------------------------------------------------------
def instrument(v: Variant, trace_dir: str | None):
    import contextlib

    if v.key == "plain":
        return contextlib.nullcontext()
    if v.key == "floor":
        return NoopMode()
    if v.key == "debugmode":
        from torch.utils._debug_mode import DebugMode

        return DebugMode()
    return replaydiff.record(trace_dir, tensors=v.tensors, compress=v.compress, **dict(v.options))


def timed(v: Variant, step: Callable[[], Any]) -> tuple[float, float, float]:
    """(whole block, step inside the block, recording thread CPU of the whole block), seconds."""
    trace_dir = tempfile.mkdtemp(prefix="rdreal-") if v.tensors else None
    gc.collect()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c0 = time.thread_time()
            t0 = time.perf_counter()
            with instrument(v, trace_dir):
                s0 = time.perf_counter()
                step()
                s1 = time.perf_counter()
            t1 = time.perf_counter()
            c1 = time.thread_time()
        return t1 - t0, s1 - s0, c1 - c0
    finally:
        if trace_dir is not None:
            shutil.rmtree(trace_dir, ignore_errors=True)


def bench_model(name: str, keys: list[str], rounds: int) -> dict[str, list[tuple[float, float, float]]]:
    steps = {k: build(name) for k in keys}
    for k in keys:  # warm-up: optimizer state, first-call caches, the recorder's imports
        steps[k]()
        timed(VARIANTS[k], steps[k])
    samples: dict[str, list] = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            samples[k].append(timed(VARIANTS[k], steps[k]))
    return samples


def trace_dir_note() -> str:
    """Where the traces go and on what filesystem: a full mid step writes ~250 MB, and on a virtual machine's disk
    the writes the recording waits for at its end can take seconds (TMPDIR=/dev/shm keeps the disk out of it)."""
    where = tempfile.gettempdir()
    fs, best = "unknown", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and (where + "/").startswith(parts[1].rstrip("/") + "/") and len(parts[1]) > len(best):
                    best, fs = parts[1], parts[2]
    except OSError:
        pass
    return f"traces written under {where} ({fs})"


def load_note() -> str:
    try:
        one, five, _ = os.getloadavg()
        return f"load average {one:.1f} (5 min {five:.1f}) on {os.cpu_count()} CPUs"
    except OSError:
        return "load average unknown"


# -- profile ----------------------------------------------------------------------------------------------------------
def profile(name: str, key: str, steps: int = 3) -> tuple[dict[str, float], list[tuple], int]:
    """Own time per part, us per op (cProfile, recording thread), the top functions, ops per step."""
    step = build(name)
    step()
    n_ops = count_ops(step)
    timed(VARIANTS[key], step)
    prof = cProfile.Profile()
    out = tempfile.mkdtemp(prefix="rdrealprof-")
    v = VARIANTS[key]
    try:
        for i in range(steps):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with replaydiff.record(f"{out}/{i}", tensors=v.tensors, compress=v.compress, **dict(v.options)):
                    prof.enable()
                    step()
                    prof.disable()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    st = pstats.Stats(prof)
    parts: dict[str, float] = {}
    rows = []
    for (filename, _line, func), (_cc, nc, tt, _ct, callers) in st.stats.items():  # type: ignore[attr-defined]
        part = part_of(filename, func)
        if part is None:
            if filename == "~":
                own = sum(c[2] for f, c in callers.items() if "/replaydiff/" in f[0].replace("\\", "/"))
                if own:
                    parts[builtin_part(func)] = parts.get(builtin_part(func), 0.0) + own
                    rows.append((own, nc, f"{func} (called by replaydiff)"))
            continue
        parts[part] = parts.get(part, 0.0) + tt
        rows.append((tt, nc, f"{Path(filename).parent.name}/{Path(filename).name}:{func}"))
    rows.sort(reverse=True)
    scale = 1e6 / steps / n_ops
    return {k: v * scale for k, v in parts.items()}, [(t * scale, nc / steps, f) for t, nc, f in rows[:20]], n_ops


# -- replay -----------------------------------------------------------------------------------------------------------
def bench_replay(name: str, rounds: int) -> list[list[str]]:
    from replaydiff.replay import ReplayOptions, replay_trace
    from replaydiff.replay.engine import keep_freed_memory

    step = build(name)
    step()
    path = tempfile.mkdtemp(prefix=f"rdrealreplay-{name}-") + "/full"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with replaydiff.record(path, tensors="full"):
            step()
    rows = []
    try:
        keep_freed_memory()  # as the CLI and replay's workers do
        for precision in ("fp64", "same"):
            opts = ReplayOptions(precision=precision)
            report = replay_trace(path, opts)  # warm-up: first-call caches, lazy imports
            replayed = sum(1 for r in report.ops if r.status.name != "SKIPPED")
            times, cpu = [], []
            for _ in range(rounds):
                gc.collect()
                t0, c0 = time.perf_counter(), time.thread_time()
                replay_trace(path, opts)
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
            med, cmed = statistics.median(times), statistics.median(cpu)
            # ops per CPU second of the replaying thread: what holds on a loaded machine, where wall time is the load's
            rows.append([name, precision, "in process, 1 worker (startup excluded)", str(replayed),
                         f"{med:.2f}", f"{replayed / med:,.0f} ({replayed / cmed:,.0f} a CPU second)"])
            for workers in (1, 2):
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "replaydiff", "replay", path, "--precision", precision,
                                       "--workers", str(workers)], capture_output=True, text=True)
                secs = time.perf_counter() - t0
                note = "" if proc.returncode in (0, 1) else f" (exit {proc.returncode}: {proc.stderr.strip()[-200:]})"
                rows.append([name, precision, f"CLI, --workers {workers} (startup included){note}", str(replayed),
                             f"{secs:.2f}", f"{replayed / secs:,.0f}"])
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="t5,gpt2,llama")
    p.add_argument("--variants", default="plain,floor,debugmode,meta,stats,full,module")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="also the cProfile breakdown per op (with tiny beside)")
    p.add_argument("--profile-variants", default="meta,stats,full")
    p.add_argument("--no-timing", action="store_true", help="skip the recording table (only --profile / --replay)")
    p.add_argument("--sections", action="store_true", help="also the per-op breakdown by timed sections")
    p.add_argument("--replay", action="store_true", help="also replay throughput of a full trace of each model")
    p.add_argument("--replay-rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    models = args.models.split(",")
    keys = args.variants.split(",")
    assert keys[0] == "plain", "ratios are to the plain step: list it first"
    print(f"# replaydiff on real models ({torch.__version__}, {args.threads} thread(s), {args.rounds} rounds; "
          f"replaydiff from {os.path.dirname(replaydiff.__file__)}; {trace_dir_note()})\n")
    if not args.no_timing:
        rows = []
        for name in models:
            n_ops = count_ops((s := build(name), s())[0])
            before = load_note()
            samples = bench_model(name, keys, args.rounds)
            plain = statistics.median(s[0] for s in samples["plain"])
            plain_cpu = statistics.median(s[2] for s in samples["plain"])
            for k in keys:
                whole = statistics.median(s[0] for s in samples[k])
                inside = statistics.median(s[1] for s in samples[k])
                cpu = statistics.median(s[2] for s in samples[k])
                rows.append([name, VARIANTS[k].label, f"{1e3 * whole:.1f}", f"{whole / plain:.2f}x",
                             f"{inside / plain:.2f}x", f"{cpu / plain_cpu:.2f}x",
                             f"{1e6 * (inside - plain) / n_ops:.1f}" if k != "plain" else f"{n_ops} ops"])
            print(f"{name}: {n_ops} aten ops a step; {before} before, {load_note()} after", flush=True)
        print()
        print(md_table(["model", "variant", "block ms (median)", "block / plain", "step inside / plain",
                        "thread CPU / plain", "us an op over plain (inside)"], rows))
    if args.sections:
        import bench_profile

        keys = args.profile_variants.split(",")
        cols = models + ([] if "tiny" in models else ["tiny"])
        got = {}
        for name in cols:
            bench_profile.build_step = lambda cfg, _n=name: build(_n)  # sections() builds its step through this
            bench_profile.MODELS = {**bench_profile.MODELS, name: None}
            step = build(name)
            step()
            n_ops = count_ops(step)
            for key in keys:
                got[(name, key)] = bench_profile.sections(name, VARIANTS[key].key, n_ops, 7)
        parts = sorted({p for g in got.values() for p in g}, key=lambda p: -max(g.get(p, 0.0) for g in got.values()))
        parts = ["total"] + [p for p in parts if p != "total"]
        print(f"\n## The recorder's per-op work inside the real step, us an op (timed sections, recording thread CPU, "
              f"best of 7; {load_note()})\n")
        print(md_table(["part"] + [f"{n} {k}" for n in cols for k in keys],
                       [[p] + [f"{got[(n, k)].get(p, 0.0):.1f}" for n in cols for k in keys] for p in parts
                        if any(got[(n, k)].get(p, 0.0) >= 0.05 for n in cols for k in keys)]))
    if args.replay:
        rows = []
        for name in models:
            rows += bench_replay(name, args.replay_rounds)
        print(f"\n## Replay of one step's full trace ({load_note()})\n")
        print(md_table(["model", "precision", "how", "ops replayed", "seconds", "ops/s"], rows))
    if args.profile:
        for key in args.profile_variants.split(","):
            cols = models + ([] if "tiny" in models else ["tiny"])
            got = {name: profile(name, key) for name in cols}
            parts = sorted({p for g in got.values() for p in g[0]}, key=lambda p: -max(g[0].get(p, 0) for g in
                                                                                          got.values()))
            rows = [[p] + [f"{got[n][0].get(p, 0.0):.1f}" for n in cols] for p in parts]
            rows.append(["**profiled total, us an op**"] + [f"{sum(got[n][0].values()):.1f}" for n in cols])
            rows.append(["ops a step"] + [str(got[n][2]) for n in cols])
            print(f"\n## cProfile of `{key}`: recorder's own time per op, us (recording thread, 3 steps)\n")
            print(md_table(["part"] + cols, rows))
            for n in cols[:1]:
                print(f"\nTop functions, {n} {key} (us an op, calls a step):\n")
                print(md_table(["us/op", "calls", "function"], [[f"{t:.2f}", f"{c:.0f}", f] for t, c, f in got[n][1]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
